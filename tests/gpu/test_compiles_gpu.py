"""A real Triton compile on CUDA goes through `common.compiles`' hooks: counted in its phase,
and logged with the kernel's name once the process serves."""
from __future__ import annotations

import logging

import pytest
import torch

from common import compiles
from tests.test_compiles import compiled, knobs

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_kernel_compiled_while_serving_is_counted_and_logged(monkeypatch, caplog):
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_phase", "startup")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compiles.watch()
    x = torch.zeros(8, device="cuda")
    startup = compiled("startup")
    _add_one[(1,)](x, 8, BLOCK=8)
    assert compiled("startup") == startup + 1
    compiles.serving()
    serving = compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        _add_one[(1,)](x, 8, BLOCK=16)  # a new constexpr: a new variant
        _add_one[(1,)](x, 8, BLOCK=16)  # the same one: no compile
    assert compiled("serving") == serving + 1
    assert len(caplog.records) == 1 and "_add_one" in caplog.records[0].getMessage()
    assert x.tolist() == [3.0] * 8
