"""Kernel compiles are timed and counted by phase, and those while serving are logged
(`common.compiles`); hooks set before are kept."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from common import compiles

knobs = pytest.importorskip("triton").knobs


def compiled(phase: str) -> float:
    return REGISTRY.get_sample_value("ddtree_kernel_compiles_total", {"phase": phase}) or 0.0


@pytest.fixture()
def watched(monkeypatch):
    """`compiles.watch()` installed afresh over an earlier cache hook that records its calls."""
    earlier = []
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_phase", "startup")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: earlier.append(kw["repr"]) or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compiles.watch() and compiles.watch()  # once per process: the second call adds nothing
    return earlier


def compile_once(name: str) -> None:
    """What Triton calls around one compile."""
    assert not knobs.runtime.jit_cache_hook(repr=name, key=name)  # falsy: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(repr=name, key=name)


def test_compiles_are_counted_by_phase_and_logged_while_serving(watched, caplog):
    startup, serving = compiled("startup"), compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        compile_once("warm_kernel[num_warps=4](x: *fp32)")
        assert (compiled("startup"), compiled("serving")) == (startup + 1, serving)
        assert not caplog.records  # start-up compiles are expected
        compiles.serving()
        compile_once("late_kernel[num_warps=4](x: *fp32, n: i32)")
    assert (compiled("startup"), compiled("serving")) == (startup + 1, serving + 1)
    (record,) = caplog.records
    assert "while serving" in record.getMessage() and "late_kernel[num_warps=4](x: *fp32, n: i32)" in record.getMessage()
    assert watched == ["warm_kernel[num_warps=4](x: *fp32)", "late_kernel[num_warps=4](x: *fp32, n: i32)"]
    count = REGISTRY.get_sample_value("ddtree_kernel_compile_seconds_count", {"phase": "serving"})
    assert count is not None and count >= 1


def test_a_serving_compile_is_logged_with_its_specialisation(watched, caplog):
    """The warning names the kernel, its constexprs, argument types and specialisation attributes
    from the hook's compile arguments (Triton's repr is used only when they are missing)."""
    class Info:  # what Triton passes as `fn`
        name = "_select_kernel"

    compile_args = {"num_warps": 1, "constants": {"DEPTHS": 16}, "signature": {"logq_ptr": "*fp32", "D": "i32"},
                    "configs": [{(2,): [["tt.divisibility", 16]]}]}
    compiles.serving()
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        assert not knobs.runtime.jit_cache_hook(repr="_select_kernel[...](logq_ptr: ()", key="k")
        knobs.runtime.jit_post_compile_hook(repr="_select_kernel[...](logq_ptr: ()", key="k", fn=Info(),
                                            compile=compile_args)
    (record,) = caplog.records
    message = record.getMessage()
    assert "_select_kernel num_warps=1" in message and "'DEPTHS': 16" in message
    assert "'logq_ptr': '*fp32'" in message and "tt.divisibility" in message and "logq_ptr: ()" not in message


def test_an_earlier_hook_still_decides_whether_to_compile(monkeypatch):
    """Triton skips a compile when the cache hook answers True: a hook set before keeps that say."""
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    compiles.watch()
    assert knobs.runtime.jit_cache_hook(repr="k", key="k") is True
