"""Small helpers every command-line entry point shares."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn


def fail(message: str, code: int = 2) -> NoReturn:
    """Exit with a one-line error message and no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def number_list(text: str, flag: str, kind: type = int) -> list:
    """The comma-separated numbers of a list flag (spaces allowed; an empty item is a typo, not
    nothing); exits with one line naming `flag` otherwise."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        fail(f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}")


def token_biases(items: Sequence[str] | None, flag: str) -> dict[int, float]:
    """The ID=BIAS items of a repeatable flag as {token id: bias}; exits with one line naming `flag`
    on a malformed one (the range is the request's to check)."""
    out = {}
    for item in items or ():
        token, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(token)] = float(bias)
        except ValueError:
            fail(f"{flag} must be TOKEN_ID=BIAS, got {item!r}")
    return out


def add_penalty_flags(p: argparse.ArgumentParser) -> None:
    """The repetition penalties' flags (`penalty_options` reads them), as both request CLIs take them."""
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this (in [-2, 2]) from the logit of every token generated so far, as OpenAI's "
                        "presence_penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this (in [-2, 2]) from a token's logit once per time it was generated so far, as "
                        "OpenAI's frequency_penalty (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide a positive logit (multiply a negative one) of every token in the prompt or generated "
                        "so far by this, in (0, 100], as vLLM's repetition_penalty (default 1: off)")


def penalty_options(a: argparse.Namespace) -> dict[str, float]:
    """The repetition penalties of parsed `add_penalty_flags` flags, by their SamplingParams names."""
    return dict(presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                repetition_penalty=a.repetition_penalty)


def env_flag(text: str) -> bool:
    """An on/off value from the environment: 1, true, yes, on."""
    return str(text).lower() in ("1", "true", "yes", "on")


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors, and flags that fall back to an environment variable
    and then to a default (given by the caller from its config dataclass).

    A value from the environment passes the same checks as one on the command line: its `type`
    (argparse applies it to string defaults) and its `choices` (which argparse skips for
    defaults; `parse_known_args` checks them, naming the variable)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._envs: dict[str, str] = {}  # dest -> the environment variable a flag falls back to
        self._raw: set[str] = set()  # flags whose next word is their value even when it begins with "-"

    def error(self, message: str) -> NoReturn:
        fail(message)

    def flag(self, name: str, *, env: str, default=None, help: str, type=str, raw: bool = False, **kwargs) -> None:
        """`raw`: the word after the flag is its value even when it begins with "-" (a value that
        is itself a flag, e.g. --local-verifier-flags --deterministic)."""
        if isinstance(default, (tuple, list)) and type is not str:  # shown and parsed as written: 1,2,4
            default = ",".join(str(v) for v in default)
        action = self.add_argument(name, type=type, default=os.environ.get(env, default), help=f"{help} [env {env}]",
                                   **kwargs)
        if env in os.environ:
            self._envs[action.dest] = env
        if raw:
            self._raw.add(name)

    def switch(self, name: str, *, env: str, default: bool = False, help: str, negatable: bool = False) -> None:
        """An on/off flag whose environment variable takes 1/true/yes/on; `negatable` adds its
        --no- form (for switches that are on by default)."""
        action = argparse.BooleanOptionalAction if negatable else "store_true"
        self.add_argument(name, action=action, default=env_flag(os.environ.get(env, default)),
                          help=f"{help} [env {env}]")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for i in range(len(args) - 2, -1, -1):
            if args[i] in self._raw:
                args[i: i + 2] = [f"{args[i]}={args[i + 1]}"]
        ns, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if action.choices is None or value is None or value in action.choices:
                continue
            # Only a default escapes argparse's check: the value comes from the environment.
            env = self._envs.get(action.dest)
            given = f"{env}={os.environ[env]!r}" if env else f"default {action.default!r}"
            self.error(f"{given}: invalid choice for {action.option_strings[0]} "
                       f"(choose from {', '.join(map(str, action.choices))})")
        return ns, rest
