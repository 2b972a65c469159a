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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_trees_placed_into_every_small_bucket_take_one_compiled_variant(monkeypatch, caplog):
    """The place kernel writes into each (batch, nodes) bucket's packed input buffers, some of
    whose fields start off a 16-byte boundary (batch 1, 1 node): once compiled, no bucket of up
    to 16 nodes compiles it again (its pointers are not specialised on their alignment)."""
    from ddtree_kernels.place_trees import place_trees
    from verifier_svc.cuda_graphs import BatchInputs

    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_phase", "startup")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compiles.watch()
    width = 16
    packed = torch.zeros((1, 2 * width + 1), dtype=torch.int64, device="cuda")
    packed[0, 2 * width] = 1  # the count: the root alone
    tokens, parents, counts = packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width]

    def place(b: int, t: int) -> BatchInputs:
        inp = BatchInputs(b, t, torch.device("cuda"), pinned=True)
        inp.ints.past.fill_(7)
        rows = torch.tensor([[0], [b - 1], [1]], device="cuda")  # tree row, batch row, count limit
        place_trees(tokens, parents, counts, rows, 1, min(width, t), inp.ints.tokens, inp.ints.positions,
                    inp.ints.next_token, inp.ints.next_sibling, inp.ints.past, inp.tree_mask)
        return inp

    place(1, 16)
    compiles.serving()
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        placed = [place(b, t) for b, t in ((1, 1), (2, 16), (2, 1), (4, 1))]
    assert not [r for r in caplog.records if "_place_kernel" in r.getMessage()]
    for inp in placed:
        assert inp.ints.positions[-1, 0].item() == 7 and inp.ints.next_token[-1, 0].item() == -1
        assert inp.tree_mask[-1, 0, 0].item()
