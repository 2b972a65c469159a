"""Kernel compiles in a serving process, timed, counted and, once it serves, logged.

Triton compiles a kernel for each new specialisation of its arguments (or loads it from its
on-disk cache) the first time a process launches it that way. At start-up that is expected:
the CUDA graph captures and the drafter's warm-ups compile what the steps will launch. While
serving, a compile stalls the step that launched it, for up to a few hundred milliseconds, and
the adaptive budget reads that stall as the cost of its choice. `watch` times every compile
(`ddtree_kernel_compiles_total` and `ddtree_kernel_compile_seconds`, by phase); after
`serving`, each one is also logged as a warning with the kernel and its specialisation, which
says which warm-up missed it.
"""
from __future__ import annotations

import logging
import threading
import time

from common import metrics

log = logging.getLogger(__name__)

_state = threading.local()  # the compiles under way on this thread: repr -> start time
_phase = "startup"
_installed = False
_DESCRIPTION_CHARS = 2000  # a log line, not a dump


def _started(**kwargs):
    if not hasattr(_state, "started"):
        _state.started = {}
    _state.started[kwargs.get("repr")] = time.perf_counter()


def _finished(**kwargs) -> None:
    started = getattr(_state, "started", {}).pop(kwargs.get("repr"), None)
    seconds = time.perf_counter() - started if started is not None else 0.0
    phase = _phase
    metrics.KERNEL_COMPILES.labels(phase).inc()
    metrics.KERNEL_COMPILE_SECONDS.labels(phase).observe(seconds)
    if phase == "serving":
        log.warning("kernel compiled while serving, %.3f s (the step that launched it waited): %s",
                    seconds, describe(kwargs))


def describe(kwargs: dict) -> str:
    """The kernel and its specialisation from a compile hook's arguments: its name, constexprs,
    argument types and specialisation attributes (pointer alignment, integers equal to 1), which
    say what a warm-up missed. Triton's own `repr` pairs the arguments with the wrong part of the
    cache key in some versions (e.g. "logq_ptr: ()"), so it is used only where nothing else came."""
    info = kwargs.get("compile")
    fn = kwargs.get("fn")
    if not isinstance(info, dict) or fn is None:
        return str(kwargs.get("repr"))
    parts = [f"{getattr(fn, 'name', fn)} num_warps={info.get('num_warps')}"]
    for key in ("constants", "signature"):
        if info.get(key):
            parts.append(f"{key} {info[key]}")
    configs = info.get("configs") or ()
    if configs and configs[0]:
        parts.append(f"attributes {configs[0]}")
    return "; ".join(parts)[:_DESCRIPTION_CHARS]


def _chained(first, then):
    """A hook that calls `first`, then `then` (an earlier one), and answers as `then` does."""
    if then is None:
        return first

    def hook(**kwargs):
        first(**kwargs)
        return then(**kwargs)
    return hook


def watch() -> bool:
    """Time and count this process's Triton compiles from now on (once per process; hooks set
    before are kept and still called). False where this Triton has no compile hooks."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        runtime = knobs.runtime
        runtime.jit_cache_hook, runtime.jit_post_compile_hook  # noqa: B018 (present in this Triton?)
    except (ImportError, AttributeError):
        log.debug("this Triton has no compile hooks: kernel compiles are not watched")
        return False
    runtime.jit_cache_hook = _chained(_started, runtime.jit_cache_hook)
    runtime.jit_post_compile_hook = _chained(_finished, runtime.jit_post_compile_hook)
    _installed = True
    return True


def serving() -> None:
    """Start-up is over: compiles from now on count as serving ones and are logged."""
    global _phase
    _phase = "serving"
