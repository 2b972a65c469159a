"""Fused residual-add + RMSNorm, q/k norm + RoPE + cache store, SiLU-and-mul: Triton == reference.

On the CPU the Triton kernels run in the interpreter (whose float32 -> bf16 casts do not
round to nearest); tests/gpu runs the same checks compiled, at Qwen3-8B sizes.
"""
import pytest
import torch

from common.layers import RotaryEmbedding
from common.layers import silu_mul
from ddtree_kernels.layer_ops import (add_rms_norm_reference, add_rms_norm_triton, qk_norm_rope_store_reference,
                               qk_norm_rope_store_triton, silu_mul_triton)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def assert_matches(got: torch.Tensor, want: torch.Tensor):
    """Within rounding everywhere (in bf16 a last-bit difference in a rounded intermediate is
    one bf16 step of the result)."""
    torch.testing.assert_close(got, want, **TOL[want.dtype])


def check_add_rms_norm(device: str, dtype: torch.dtype, shape: tuple[int, ...], with_delta: bool):
    gen = torch.Generator().manual_seed(sum(shape) + with_delta)
    h = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    delta = torch.randn(shape, generator=gen).to(device, dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    want_h, want_x = add_rms_norm_reference(h, delta, weight, 1e-6)
    got_h, got_x = add_rms_norm_triton(h, delta, weight, 1e-6)
    if device == "cuda" or dtype == torch.float32:
        assert torch.equal(got_h, want_h)  # one rounded add, like PyTorch's
    assert_matches(got_h, want_h)
    assert_matches(got_x, want_x)


def check_qk_norm_rope_store(device: str, dtype: torch.dtype, qk_norm: bool, heads: int, kv_heads: int, d: int,
                             b: int = 2, t: int = 5):
    slots_n, length = 3, 3 * t
    gen = torch.Generator().manual_seed(7 + qk_norm + d)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4000, (b, t), generator=gen).to(device)
    cos, sin = RotaryEmbedding(d, 1e6).to(device)(positions, dtype)
    norms = ([(1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype) for _ in range(2)] if qk_norm
             else [None, None])
    slots = torch.tensor([2, 0][:b], device=device)
    cache_pos = torch.stack([torch.randperm(length, generator=gen)[:t] for _ in range(b)]).to(device)
    results = []
    for fn in (qk_norm_rope_store_reference, qk_norm_rope_store_triton):
        k_cache = torch.zeros(slots_n, kv_heads, length, d, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        q = fn(qkv, cos, sin, *norms, 1e-6, heads, kv_heads, k_cache, v_cache, slots, cache_pos)
        results.append((q, k_cache, v_cache))
    (q_ref, k_ref, v_ref), (q_tri, k_tri, v_tri) = results
    assert q_tri.shape == (b, heads, t, d)
    assert_matches(q_tri, q_ref)
    assert_matches(k_tri, k_ref)
    assert torch.equal(v_tri, v_ref)
    assert k_ref[1].abs().sum() == 0 and k_tri[1].abs().sum() == 0  # slot 1 untouched by both


def check_silu_mul(device: str, dtype: torch.dtype, shape: tuple[int, ...]):
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = (torch.randn(shape, generator=gen) * 4).to(device, dtype)
    got = silu_mul_triton(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert_matches(got, silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3, 64), (2, 5, 3000)])
def test_silu_mul_matches_reference(dtype, shape):
    check_silu_mul("cpu", dtype, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(dtype, hidden, with_delta):
    check_add_rms_norm("cpu", dtype, (2, 5, hidden), with_delta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_reference(dtype, qk_norm):
    check_qk_norm_rope_store("cpu", dtype, qk_norm, heads=4, kv_heads=2, d=16)


@pytest.mark.parametrize("heads, kv_heads", [(0, 2), (5, 3), (9, 3), (12, 5)])
def test_qk_norm_rope_store_head_groups(heads, kv_heads):
    """A program takes up to 8 heads: queries and keys in one group, a part-filled last group,
    and keys and values alone (the draft's context extension)."""
    check_qk_norm_rope_store("cpu", torch.float32, True, heads=heads, kv_heads=kv_heads, d=8)


def test_qk_norm_rope_store_rejects_odd_head_dim():
    qkv = torch.zeros(1, 1, 3 * 12)
    cache = torch.zeros(1, 1, 4, 12)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope_store_triton(qkv, torch.zeros(1, 1, 12), torch.zeros(1, 1, 12), None, None, 1e-6, 1, 1,
                                  cache, cache.clone(), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1).long())
