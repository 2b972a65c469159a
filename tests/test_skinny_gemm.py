"""The few-row GEMM (`ddtree_kernels.skinny_gemm`) against F.linear on fresh random inputs (the
Triton interpreter on CPU, in float32), and where `common.layers.linear` uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import MLP, linear, residual_linear
from ddtree_kernels.layer_ops import add_rms_norm_reference, add_rms_norm_triton
from ddtree_kernels.skinny_gemm import (MAX_ROWS, MAX_SPLIT_ROWS, MIN_SPLIT_ROWS, SplitSum, skinny_config,
                                        skinny_linear, split_config, split_linear, tiles_for)

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


@pytest.mark.parametrize("m, n, k, splits", [(1, 48, 64, 2), (5, 100, 96, 2), (16, 64, 130, 2), (33, 40, 64, 3),
                                             (64, 32, 256, 2), (2, 16, 20, 4)])
def test_split_linear_sums_to_f_linear(m, n, k, splits):
    """Each slice's partial sums, added, are the product; so is `total()`, rounded to x's dtype
    (K not a whole number of tiles per slice, and a slice past K, included)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + splits)
    x = torch.randn(2, m, k, generator=gen)[1:]  # [1, m, k]
    w = torch.randn(n, k, generator=gen)
    got = split_linear(x, w, tiles=SMALL, splits=splits)
    assert isinstance(got, SplitSum) and got.partials.shape == (splits, 1, m, n)
    assert got.partials.dtype == torch.float32 and got.dtype == x.dtype
    torch.testing.assert_close(got.total(), F.linear(x, w), rtol=1e-5, atol=1e-4)
    half = k // splits
    if splits == 2 and k % (2 * SMALL["BLOCK_K"]) == 0:  # whole tiles: slice 0 is exactly K's first half
        torch.testing.assert_close(got.partials[0], F.linear(x[..., :half], w[:, :half]), rtol=1e-5, atol=1e-4)


def test_split_tiles_only_where_they_pay():
    """Split tiles for o_proj's and down's shapes (few output columns) at 16 to 64 rows, none
    outside them or for wide outputs; `split_linear` refuses what it has no tiles for."""
    for m in (MIN_SPLIT_ROWS, 33, MAX_SPLIT_ROWS):
        assert split_config(m, 4096, 4096) and split_config(m, 4096, 12288)
    assert split_config(MAX_SPLIT_ROWS + 1, 4096, 4096) is None and split_config(MIN_SPLIT_ROWS - 1, 4096, 4096) is None
    assert split_config(16, 6144, 4096) is None and split_config(16, 151936, 4096) is None
    with pytest.raises(ValueError):
        split_linear(torch.randn(MAX_SPLIT_ROWS + 1, 64), torch.randn(32, 64))
    with pytest.raises(ValueError):
        split_linear(torch.randn(4, 64), torch.randn(32, 64), tiles=SMALL, splits=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_partial_sums_like_their_total(dtype):
    """add_rms_norm of a SplitSum: the reference adds `total()`; the kernel (interpreter) sums the
    partials in float32, rounds to h's dtype, adds, and agrees with it."""
    gen = torch.Generator().manual_seed(11)
    h = (torch.randn(2, 5, 96, generator=gen) * 3).to(dtype)
    partials = SplitSum(torch.randn(2, 2, 5, 96, generator=gen), dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    want_h, want_x = add_rms_norm_reference(h, partials, weight, 1e-6)
    assert torch.equal(want_h, h + partials.total())
    got_h, got_x = add_rms_norm_triton(h, partials, weight, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(got_h, want_h)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(got_h, want_h, **tol)
    torch.testing.assert_close(got_x, want_x, **tol)
    with pytest.raises(ValueError):
        add_rms_norm_triton(h[:, :4], partials, weight, 1e-6)


def test_residual_outputs_are_tensors_off_the_gpu():
    """On a CPU `residual_linear` and the MLP's residual form are the plain products."""
    x, w = torch.randn(5, 24), torch.randn(12, 24)
    assert tiles_for(x, w, split=True) is None
    assert torch.equal(residual_linear(x, w), F.linear(x, w))
    mlp = MLP(24, 40)
    assert torch.equal(mlp(x, into_residual=True), mlp(x))


def _variant(rows: torch.Tensor, weight: torch.Tensor, splits: int, tiles: dict) -> tuple:
    """What a launch compiles for: its tiles, BLOCK_M and whether its tiles are whole."""
    (m, k), n = rows.shape, weight.shape[0]
    whole = n % tiles["BLOCK_N"] == 0 and k % (splits * tiles["BLOCK_K"]) == 0
    return splits, max(16, 1 << (m - 1).bit_length()), whole, tuple(sorted(tiles.items())), tuple(weight.shape)


def test_the_warm_up_launches_every_variant_a_row_count_takes(monkeypatch):
    """At Qwen3-8B's shapes (q/k/v, its k/v rows, o, gate/up, down, head), every row count either
    GEMM takes compiles a variant that `warm_up` launched: an eager pass then compiles nothing."""
    from ddtree_kernels import skinny_gemm

    shapes = [(6144, 4096), (2048, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
    weights = [torch.empty(n, k, dtype=torch.bfloat16) for n, k in shapes]
    assert skinny_gemm.warm_up(weights) == 0  # on a CPU no GEMM takes them
    launched = []
    monkeypatch.setattr(skinny_gemm, "tiles_for", lambda x, w, split=False: (split_config if split else skinny_config)(
        x.shape[0], *w.shape))
    monkeypatch.setattr(skinny_gemm, "_launch", lambda rows, w, out, splits, tiles: launched.append(
        _variant(rows, w, splits, tiles)))
    launches = skinny_gemm.warm_up(weights + [weights[0]])  # a second weight of a shape adds nothing
    assert launches == len(launched) == len(set(launched))
    taken = set()
    for w in weights:
        for m in range(1, MAX_SPLIT_ROWS + 1):
            x = torch.empty(m, w.shape[1], dtype=torch.bfloat16)
            for splits, tiles in ((1, skinny_config(m, *w.shape)), (2, split_config(m, *w.shape))):
                if tiles is not None and (splits == 1 and m <= MAX_ROWS or splits == 2):
                    taken.add(_variant(x, w, splits, tiles))
    assert taken == set(launched)


def test_gemm_weights_include_the_fused_ones():
    from common.layers import AttentionProjections, gemm_weights

    attn, mlp = AttentionProjections(32, 4, 2, 8, 1e-6, qk_norm=True), MLP(32, 48)
    model = torch.nn.ModuleList([attn, mlp])
    assert {tuple(w.shape) for w in gemm_weights(model)} == {(32, 32), (16, 32), (48, 32), (32, 48)}
    attn.fuse_weights()
    mlp.fuse_weights()
    fused = gemm_weights(model)
    assert any(w is attn.qkv_weight for w in fused) and any(w is mlp.gate_up_weight for w in fused)
    assert {tuple(w.shape) for w in fused} == {(32, 32), (16, 32), (48, 32), (32, 48), (64, 32), (96, 32)}
    x = torch.randn(3, 32)
    torch.testing.assert_close(attn.kv(x), F.linear(x, attn.kv_weight))
