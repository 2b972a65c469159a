"""Logging of both services: a level, a format (text lines or JSON lines), and process facts
(memory) for their start-up summaries.

`setup_logging` replaces the root logger's handlers with one on stderr. The JSON format writes
one object per line with `time` (UTC, ISO 8601), `level`, `logger`, `message`, `exception`
when there is one, and every field passed through `extra=`, so that a log pipeline can read
a request's numbers without parsing its message. `add_logging_flags` gives a service's CLI
`--log-level` and `--log-format` with its own env prefix (DRAFTER_, VERIFIER_).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
from datetime import datetime, timezone
from typing import TextIO

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord carries; anything else on a record came from `extra=`.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class _ServiceHandler(logging.StreamHandler):
    """The handler `setup_logging` installs (so that a second call replaces it)."""


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Log records of `level` and above to `stream` (stderr) as text or JSON lines; ValueError
    for an unknown level or format."""
    level, fmt = level.upper(), fmt.lower()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = _ServiceHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ServiceHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def add_logging_flags(parser, env_prefix: str, level: str, fmt: str) -> None:
    """`--log-level` and `--log-format` on a `common.cli.FlagParser`, with env `{prefix}_LOG_LEVEL`
    and `{prefix}_LOG_FORMAT` and the defaults of the service's config."""
    parser.flag("--log-level", env=f"{env_prefix}_LOG_LEVEL", default=level, type=str.upper, choices=LEVELS,
                help="least severe log records written: DEBUG, INFO, WARNING or ERROR")
    parser.flag("--log-format", env=f"{env_prefix}_LOG_FORMAT", default=fmt, type=str.lower, choices=FORMATS,
                help="text lines, or json: one object per line with time, level, logger, message and the "
                     "record's fields")


def memory_summary(device) -> str:
    """The process's memory, for start-up lines: allocated / reserved on a CUDA device, else the
    resident set size (from /proc where there is one, else the peak from getrusage)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        gib = 1 << 30
        return (f"CUDA memory {torch.cuda.memory_allocated(device) / gib:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved")
    rss = resident_bytes()
    return f"RSS {rss / (1 << 20):.0f} MiB" if rss else "RSS unknown"


def resident_bytes() -> int:
    """The process's current resident set size in bytes (0 when it cannot be told)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024
