"""Small helpers every command-line entry point shares."""
from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str, code: int = 2) -> NoReturn:
    """Exit with a one-line error message and no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def env_default(name: str, default, cast=str):
    """The value of environment variable `name` cast to the flag's type, else `default`."""
    import os

    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        fail(f"environment variable {name}={raw!r} is not a valid {cast.__name__}")
