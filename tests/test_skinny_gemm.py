"""The few-row GEMM (`ddtree_kernels.skinny_gemm`) against F.linear on fresh random inputs (the
Triton interpreter on CPU, in float32), and where `common.layers.linear` uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import linear
from ddtree_kernels.skinny_gemm import MAX_ROWS, skinny_config, skinny_linear, tiles_for

SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_stages=1)  # interpreter-sized tiles


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (3, 100, 96), (16, 128, 130), (17, 40, 64), (32, 64, 32)])
def test_skinny_linear_equals_f_linear(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(2, m, k, generator=gen)[1]  # a view: rows with a stride
    w = torch.randn(n, k, generator=gen)
    torch.testing.assert_close(skinny_linear(x, w, tiles=SMALL), F.linear(x, w), rtol=1e-5, atol=1e-4)
    out = torch.full((1, m, n), float("nan"))
    assert skinny_linear(x[None], w, out=out, tiles=SMALL) is out
    torch.testing.assert_close(out[0], F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_tiles_only_where_they_pay():
    """Tiles for 1-32 rows; none past 32, nor for a long K at 17-32 rows (cuBLAS was as fast)."""
    assert skinny_config(1, 4096, 4096) and skinny_config(16, 151936, 4096) and skinny_config(32, 6144, 4096)
    assert skinny_config(33, 4096, 4096) is None and skinny_config(17, 4096, 12288) is None
    assert skinny_config(16, 4096, 12288) is not None
    with pytest.raises(ValueError):
        skinny_linear(torch.randn(MAX_ROWS + 1, 64), torch.randn(32, 64))
    with pytest.raises(ValueError):
        skinny_linear(torch.randn(4, 64), torch.randn(32, 48), tiles=SMALL)


def test_linear_keeps_f_linear_off_the_gpu():
    """On a CPU (and in float32 anywhere) `linear` is F.linear, into `out` when given."""
    x, w = torch.randn(5, 24), torch.randn(12, 24)
    assert tiles_for(x, w) is None
    assert torch.equal(linear(x, w), F.linear(x, w))
    out = torch.empty(5, 12)
    assert linear(x, w, out=out) is out and torch.allclose(out, F.linear(x, w), rtol=1e-6, atol=1e-6)
