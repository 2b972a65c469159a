"""The small per-layer steps of a decoder forward, fused: residual add + RMSNorm, Qwen3's
per-head q/k RMSNorm + rotary embedding + the K/V cache store, and the MLP's SiLU-and-mul.

Unfused, these are dozens of tiny kernels per layer (casts, squares, means, rsqrt, scales,
the rotate-half concatenation, the cache scatter); in a CUDA-graph verify pass at batch 1
they cost as much as a third of the pass. Semantics (the `*_reference` functions, built
from `common.layers`' plain PyTorch, which the model's eager CPU path runs):

    rms_norm(x, w)   = w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)
    add_rms_norm     : h = h + delta (in h's dtype); return (h, rms_norm(h, w)); delta may be a
        K-split GEMM's float32 partial sums (`skinny_gemm.SplitSum`), added here and
        rounded to h's dtype before the add, as the GEMM rounds its result
    apply_rope(x)    = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    qk_norm_rope_store: split the fused projection [B, T, (H + 2 * KV) * D] into q, k, v;
        q, k <- rms_norm per head (Qwen3; skipped when no norm weights are given), then
        rotary; k and v are stored at k_cache[slot_b, :, cache_pos[b, t]]; returns q as
        [B, H, T, D] for attention.
    silu_mul(gate_up) = silu(gate) * up for gate_up = [gate, up] along the last dim.

The Triton versions round where the reference rounds (each bf16 product and sum), so they
differ from it only by the order of the float32 sum of squares.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from common.layers import apply_rope, rms_norm, silu_mul as silu_mul_reference
from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.skinny_gemm import SplitSum
from ddtree_kernels.tree_sampling import kernel_backend


# ---------------------------------------------------------------------------------------
# References (plain PyTorch; `rms_norm` and `apply_rope` are the model's own layers).
# ---------------------------------------------------------------------------------------


def add_rms_norm_reference(h: Tensor, delta: Tensor | SplitSum | None, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    if isinstance(delta, SplitSum):
        delta = delta.total()
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def qk_norm_rope_store_reference(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None,
                                 k_norm: Tensor | None, eps: float, num_heads: int, num_kv_heads: int,
                                 k_cache: Tensor, v_cache: Tensor, slots: Tensor, cache_pos: Tensor) -> Tensor:
    """qkv [B, T, (H + 2 KV) D]; k_cache / v_cache [slots, KV, L, D] (one layer); slots [B];
    cache_pos [B, T]. Returns rotated queries [B, H, T, D]."""
    b, t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.reshape(b, t, num_heads, d)
    k = k.reshape(b, t, num_kv_heads, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q = apply_rope(q.transpose(1, 2), cos, sin)
    k = apply_rope(k.transpose(1, 2), cos, sin)
    rows = slots[:, None].expand_as(cache_pos)
    k_cache[rows, :, cache_pos] = k.transpose(1, 2)
    v_cache[rows, :, cache_pos] = v.reshape(b, t, num_kv_heads, d)
    return q


# ---------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------


@triton.jit
def _rms_scale(x, w, n, eps, OUT: tl.constexpr):
    """rms_norm of one float32 vector x (n valid entries, zeros past them) with weight w."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    return (w.to(tl.float32) * (x * rstd).to(OUT).to(tl.float32)).to(OUT)


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, h_out_ptr, x_out_ptr, N, eps, s_split,
                         HAS_DELTA: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row; delta is SPLITS partial sums s_split apart (one: the delta itself)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK)
    valid = offs < N
    out_ty = x_out_ptr.dtype.element_ty
    h = tl.load(h_ptr + row + offs, mask=valid, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row + offs, mask=valid, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLITS):
            d += tl.load(delta_ptr + s * s_split + row + offs, mask=valid, other=0.0)
        h = (h.to(tl.float32) + d.to(out_ty).to(tl.float32)).to(out_ty)
        tl.store(h_out_ptr + row + offs, h, mask=valid)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    tl.store(x_out_ptr + row + offs, _rms_scale(h.to(tl.float32), w, N, eps, out_ty), mask=valid)


@triton.jit
def _rope_half(a, b, cos, sin, OUT: tl.constexpr):
    """One half of x * cos + rotate_half(x) * sin, rounded like the reference: a * cos + b * sin."""
    return ((a * cos).to(OUT).to(tl.float32) + (b * sin).to(OUT).to(tl.float32)).to(OUT)


# Not specialised on T (Triton would on T == 1 and T % 16 == 0; T only locates a token's row):
# one compiled kernel serves every pass length, so an eager prompt chunk compiles nothing.
@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                               slots_ptr, pos_ptr, eps, T, H, KV,
                               s_slot, s_head, s_pos,
                               HAS_NORM: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, group of HEADS heads): heads 0 .. H - 1 are queries, heads
    H .. H + KV - 1 handle k and v of a KV head. (One program per head left each a few dozen
    bytes of work: at 512 tokens the launch was ten waves of tiny programs.)"""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    b = token // T
    t = token % T
    HALF: tl.constexpr = D // 2
    lo = tl.arange(0, HALF)[None, :]
    out_ty = q_out_ptr.dtype.element_ty
    is_q = (head < H)[:, None]
    is_k = ((head >= H) & (head < H + KV))[:, None]
    width = (H + 2 * KV) * D
    src = qkv_ptr + token * width + head[:, None] * D
    live = is_q | is_k
    a = tl.load(src + lo, mask=live, other=0.0).to(tl.float32)
    c = tl.load(src + HALF + lo, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        w_lo = tl.where(is_q, tl.load(qn_ptr + lo), tl.load(kn_ptr + lo)).to(tl.float32)
        w_hi = tl.where(is_q, tl.load(qn_ptr + HALF + lo), tl.load(kn_ptr + HALF + lo)).to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(c * c, axis=1)) / D + eps)[:, None]
        a = (w_lo * (a * rstd).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
        c = (w_hi * (c * rstd).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    rope = cos_ptr + token * D
    cos_lo = tl.load(rope + lo).to(tl.float32)
    cos_hi = tl.load(rope + HALF + lo).to(tl.float32)
    rope = sin_ptr + token * D
    sin_lo = tl.load(rope + lo).to(tl.float32)
    sin_hi = tl.load(rope + HALF + lo).to(tl.float32)
    out_lo = _rope_half(a, -c, cos_lo, sin_lo, out_ty)
    out_hi = _rope_half(c, a, cos_hi, sin_hi, out_ty)
    dst = q_out_ptr + ((b * H + head[:, None]) * T + t) * D
    tl.store(dst + lo, out_lo, mask=is_q)
    tl.store(dst + HALF + lo, out_hi, mask=is_q)
    kv = head[:, None] - H
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offset = slot * s_slot + kv * s_head + pos * s_pos
    tl.store(k_cache_ptr + offset + lo, out_lo, mask=is_k)
    tl.store(k_cache_ptr + offset + HALF + lo, out_hi, mask=is_k)
    v_src = qkv_ptr + token * width + (H + KV + kv) * D
    tl.store(v_cache_ptr + offset + lo, tl.load(v_src + lo, mask=is_k), mask=is_k)
    tl.store(v_cache_ptr + offset + HALF + lo, tl.load(v_src + HALF + lo, mask=is_k), mask=is_k)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, block of I columns); rounds like the reference: silu, then the product."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < I
    out_ty = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * I + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * I + I + cols, mask=valid, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (act * up).to(out_ty), mask=valid)


def silu_mul_triton(gate_up: Tensor) -> Tensor:
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up needs an even last dimension, got {width}")
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], width // 2, dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // max(width // 2, 1)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width // 2))
        _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, BLOCK=block,
                                                                 **pdl.launch_options(out.device))
    return out


def add_rms_norm_triton(h: Tensor, delta: Tensor | SplitSum | None, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    n = h.shape[-1]
    h = h.contiguous()
    h_out = torch.empty_like(h) if delta is not None else h
    x_out = torch.empty_like(h)
    rows = h.numel() // n
    splits = 1
    if isinstance(delta, SplitSum):
        splits, delta = delta.partials.shape[0], delta.partials
        if delta.shape[1:] != h.shape:
            raise ValueError(f"partial sums of shape {tuple(delta.shape)} for a residual of {tuple(h.shape)}")
    if rows:
        _add_rms_norm_kernel[(rows,)](h, h if delta is None else delta.contiguous(), weight, h_out, x_out, n, eps,
                                      rows * n, HAS_DELTA=delta is not None, SPLITS=splits,
                                      BLOCK=triton.next_power_of_2(n), **pdl.launch_options(h.device))
    return h_out, x_out


ROPE_HEADS_PER_PROGRAM = 8  # heads per program of the q/k norm + rotary + store kernel


def qk_norm_rope_store_triton(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None,
                              k_norm: Tensor | None, eps: float, num_heads: int, num_kv_heads: int,
                              k_cache: Tensor, v_cache: Tensor, slots: Tensor, cache_pos: Tensor) -> Tensor:
    b, t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    if d & (d - 1) or d < 2:
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache need the same strides and contiguous heads")
    q = torch.empty(b, num_heads, t, d, dtype=qkv.dtype, device=qkv.device)
    if b * t:
        norm = q_norm if q_norm is not None else qkv
        heads = min(ROPE_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads + num_kv_heads))
        _qk_norm_rope_store_kernel[(b * t, triton.cdiv(num_heads + num_kv_heads, heads))](
            qkv.contiguous(), cos.contiguous(), sin.contiguous(), norm, norm if k_norm is None else k_norm,
            q, k_cache, v_cache, slots, cache_pos.contiguous(), eps, t, num_heads, num_kv_heads,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HAS_NORM=q_norm is not None, D=d,
            HEADS=heads, **pdl.launch_options(q.device))
    return q


# ---------------------------------------------------------------------------------------
# Dispatchers: Triton on CUDA, the reference elsewhere (DDTREE_KERNELS overrides).
# ---------------------------------------------------------------------------------------


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up = [gate, up] along the last dim."""
    impl = silu_mul_triton if kernel_backend(gate_up.device) == "triton" else silu_mul_reference
    return impl(gate_up)


def add_rms_norm(h: Tensor, delta: Tensor | SplitSum | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h + delta, rms_norm(h + delta)); delta None: (h, rms_norm(h)); a SplitSum delta is its total."""
    impl = add_rms_norm_triton if kernel_backend(h.device) == "triton" else add_rms_norm_reference
    return impl(h, delta, weight, eps)


def project_store(attn, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                  cache_pos: Tensor, *, queries: bool = True) -> Tensor:
    """`qk_norm_rope_store` on the fused projection of x [B, T, hidden] by `attn` (a
    `common.layers.AttentionProjections`): rotated K and V into the cache, rotated queries
    [B, H, T, D] returned; queries=False projects and stores K and V only (returns [B, 0, T, D])."""
    k_norm = None if attn.k_norm is None else attn.k_norm.weight
    if not queries:
        return qk_norm_rope_store(attn.kv(x), cos, sin, k_norm, k_norm, attn.eps, 0, attn.num_kv_heads,
                                  k_cache, v_cache, slots, cache_pos)
    q_norm = None if attn.q_norm is None else attn.q_norm.weight
    return qk_norm_rope_store(attn.qkv(x), cos, sin, q_norm, k_norm, attn.eps, attn.num_heads, attn.num_kv_heads,
                              k_cache, v_cache, slots, cache_pos)


def qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None,
                       eps: float, num_heads: int, num_kv_heads: int, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor, cache_pos: Tensor) -> Tensor:
    """Rotated queries [B, H, T, D]; rotated keys and values stored in the cache (see module doc)."""
    impl = qk_norm_rope_store_triton if kernel_backend(qkv.device) == "triton" else qk_norm_rope_store_reference
    return impl(qkv, cos, sin, q_norm, k_norm, eps, num_heads, num_kv_heads, k_cache, v_cache, slots, cache_pos)
