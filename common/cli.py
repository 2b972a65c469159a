"""Small helpers every command-line entry point shares."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def fail(message: str, code: int = 2) -> NoReturn:
    """Exit with a one-line error message and no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def env_flag(text: str) -> bool:
    """An on/off value from the environment: 1, true, yes, on."""
    return str(text).lower() in ("1", "true", "yes", "on")


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors, and flags that fall back to an environment variable
    and then to a default (given by the caller from its config dataclass)."""

    def error(self, message: str) -> NoReturn:
        fail(message)

    def flag(self, name: str, *, env: str, default=None, help: str, type=str, **kwargs) -> None:
        # argparse applies `type` to string defaults, so a bad environment value fails like a bad flag.
        self.add_argument(name, type=type, default=os.environ.get(env, default), help=f"{help} [env {env}]",
                          **kwargs)

    def switch(self, name: str, *, env: str, default: bool = False, help: str, negatable: bool = False) -> None:
        """An on/off flag whose environment variable takes 1/true/yes/on; `negatable` adds its
        --no- form (for switches that are on by default)."""
        action = argparse.BooleanOptionalAction if negatable else "store_true"
        self.add_argument(name, action=action, default=env_flag(os.environ.get(env, default)),
                          help=f"{help} [env {env}]")
