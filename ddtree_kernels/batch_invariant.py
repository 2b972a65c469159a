"""Batch-invariant GEMM and attention: the deterministic mode (`--deterministic`).

In the default mode a token's logits depend, in their last bits, on everything else in its
forward: cuBLAS picks tiles and split-K by the number of rows M, and the tree attention
(`ddtree_kernels.slot_attention`) picks its query blocks and key splits by the batch's shape and
reads a tree's keys in node order. So the tree bucket and the other sessions of a batch
change a token's logits, and a near-tie flips a greedy token. In this mode every row's
result depends on that row alone:

* `linear(x, w)` = x @ w.T with one tile shape per weight shape, never split over K, so each output
  element reduces K in the same order whatever M is: a Triton GEMM on CUDA; elsewhere GEMMs of
  exactly `CPU_ROWS` rows (zero-padded), each row's result independent of the rows beside it.
* `logical_attention(q, k_cache, v_cache, slots, keys)`: each query row attends to its keys in
  *logical* order, the row's whole past [0, past) and then the keys of this pass it sees, by
  cache position (`LogicalKeys`), in fixed tiles of `TILE` logical positions under one online
  softmax. A tree node at depth d then reduces the same keys, in the same lanes, as plain
  decoding of the same token at position past + d, whatever else is in the pass.

The other steps are per row already: RMSNorm, q/k norm + RoPE and SiLU (`ddtree_kernels.layer_ops`),
and the accept stage (`ddtree_kernels.fused_accept`). The mode is process-wide (`set_enabled`), as
torch.use_deterministic_algorithms is: a service runs in one mode, chosen at start-up, and
CUDA graphs capture whichever kernels it selects.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.slot_attention import online_softmax_tile
from ddtree_kernels.tree_sampling import kernel_backend

CPU_ROWS = 16  # rows per GEMM off CUDA
TILE = 64  # logical key positions per attention tile

_enabled = False


def set_enabled(on: bool) -> None:
    """Turn the deterministic mode on or off for this process (before models run or graphs are captured)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def deterministic(on: bool = True) -> Iterator[None]:
    """The mode for the duration of a block (tests, benchmarks), restored after."""
    before = _enabled
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)


# ---------------------------------------------------------------------------------------
# GEMM.
# ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   IEEE: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T, one program per output tile, K in one loop of BLOCK_K
    steps: an output element's sum runs over the same K chunks in the same order whatever M is.
    Programs go GROUP_M row blocks at a time along N, so each weight tile is read once per group."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(dtype: torch.dtype, n: int) -> dict:
    """One tile shape per (dtype, weight width N), never per M: what makes the GEMM
    batch-invariant. (No split over K: a fixed split per weight would be invariant too, but its
    partial sums cost more than it gained on an H200.) Wide weights (q/k/v, gate/up, the head) take 128 x 128 tiles; the
    4096-wide o_proj and down_proj 64 x 64 ones, whose more programs fill the GPU at few rows
    (bench/deterministic.py)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    if n >= 6144:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)


def _flat(x: Tensor, weight: Tensor, out: Tensor | None) -> tuple[Tensor, Tensor]:
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight takes {weight.shape[1]}")
    rows = x.reshape(-1, k)
    if out is None:
        result = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    else:
        if out.shape[:-1].numel() != rows.shape[0] or out.shape[-1] != n or not out.is_contiguous():
            raise ValueError(f"out must be contiguous with {rows.shape[0]} x {n} elements")
        result = out.view(-1, n)
    return rows, result


def linear_triton(x: Tensor, weight: Tensor, out: Tensor | None = None, tiles: dict | None = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] (or into `out`), batch-invariant (Triton).
    `tiles` overrides the tile shape (benchmarks); whatever it is, it must not depend on M."""
    rows, result = _flat(x, weight, out)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    if m:
        cfg = tiles or _tiles(x.dtype, n)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _linear_kernel[grid](rows, weight, result, m, n, k, rows.stride(0), weight.stride(0), result.stride(0),
                             IEEE=x.dtype == torch.float32, **cfg)
    return out if out is not None else result.view(*x.shape[:-1], n)


def linear_rows(x: Tensor, weight: Tensor, out: Tensor | None = None, rows_per_gemm: int = CPU_ROWS) -> Tensor:
    """x @ weight^T as GEMMs of exactly `rows_per_gemm` rows (the last zero-padded): every GEMM
    has one shape, so a row's result does not depend on how many rows come with it."""
    rows, result = _flat(x, weight, out)
    m, k = rows.shape
    padded = -(-m // rows_per_gemm) * rows_per_gemm
    if padded != m:
        rows = torch.cat([rows, rows.new_zeros(padded - m, k)])
    staged = torch.empty(padded, weight.shape[0], dtype=x.dtype, device=x.device)
    w_t = weight.t()
    for start in range(0, padded, rows_per_gemm):
        torch.mm(rows[start: start + rows_per_gemm], w_t, out=staged[start: start + rows_per_gemm])
    result.copy_(staged[:m])
    return out if out is not None else result.view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """Batch-invariant x @ weight^T: Triton on CUDA, 16-row GEMMs elsewhere (DDTREE_KERNELS overrides)."""
    impl = linear_triton if kernel_backend(x.device) == "triton" else linear_rows
    return impl(x, weight, out)


# ---------------------------------------------------------------------------------------
# Attention.
# ---------------------------------------------------------------------------------------


@dataclass
class LogicalKeys:
    """Which cache positions each query row of a pass reads, in logical order.

    Row (b, t) reads positions [0, past[b]) of its slot, then key_pos[b, t, :count[b, t]], the
    positions of this pass's keys it sees, ascending: past[b] + count[b, t] keys in all."""

    past: Tensor     # int32 [B]
    key_pos: Tensor  # int32 [B, T, T]
    count: Tensor    # int32 [B, T]

    @classmethod
    def from_mask(cls, mask: Tensor, cache_pos: Tensor) -> LogicalKeys:
        """From a pass's mask (bool [B, T, L], True = visible) and its keys' cache positions
        ([B, T], distinct per row). The layout the verify step and the prefill use is assumed:
        a row's past is every position below its smallest cache position, and all of it is
        visible to each of its tokens (the mask is read for this pass's keys only). Static
        shapes and no host sync, so it runs inside a CUDA graph."""
        b, t = cache_pos.shape
        order = cache_pos.argsort(dim=1)
        by_position = cache_pos.gather(1, order)  # this pass's keys, ascending
        seen = mask.gather(2, by_position[:, None, :].expand(b, t, t))  # [B, query, key by position]
        rank = seen.to(torch.int32).cumsum(2) - 1
        # Seen keys go to their rank; the rest to a spare last column, dropped after.
        target = torch.where(seen, rank.to(torch.int64), t)
        key_pos = torch.zeros(b, t, t + 1, dtype=torch.int32, device=cache_pos.device)
        key_pos.scatter_(2, target, by_position[:, None, :].expand(b, t, t).to(torch.int32))
        return cls(past=by_position[:, 0].to(torch.int32), key_pos=key_pos[:, :, :t].contiguous(),
                   count=seen.sum(2, dtype=torch.int32))


@triton.jit
def _logical_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, past_ptr, key_pos_ptr, count_ptr, sm_scale,
                              T, GROUP, s_qb, s_qh, s_qt, s_cs, s_ch, s_cl, s_kb, s_kt, s_ob, s_ot, s_oh,
                              D: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
    """One program per (query token, KV head): the GROUP query heads of that KV head over the
    token's keys in logical order, TILE logical positions at a time, one online softmax."""
    token = tl.program_id(0)  # b * T + t
    kvh = tl.program_id(1)
    b = token // T
    t = token % T
    g = tl.arange(0, BLOCK_G)
    valid = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + t * s_qt + d[None, :], mask=valid[:, None], other=0.0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    past = tl.load(past_ptr + b)
    n = past + tl.load(count_ptr + token)
    k_base = k_ptr + slot * s_cs + kvh * s_ch
    v_base = v_ptr + slot * s_cs + kvh * s_ch
    key_row = key_pos_ptr + b * s_kb + t * s_kt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(0, n, TILE):
        j = start + tl.arange(0, TILE)
        inside = j < n
        in_pass = j >= past
        pos = tl.where(in_pass, tl.load(key_row + (j - past), mask=in_pass & inside, other=0), j).to(tl.int64)
        k = tl.load(k_base + pos[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
        m_i, l_i, acc = online_softmax_tile(q, k, v, inside[None, :], sm_scale, m_i, l_i, acc, IEEE)
    out = acc / tl.where(valid, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * s_ob + t * s_ot + head[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=valid[:, None])


def logical_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, keys: LogicalKeys) -> Tensor:
    """q [B, H, T, D] (rotated); k_cache / v_cache [slots, KVH, max_len, D] (one layer, this
    pass's keys already stored); slots [B]. Returns [B, T, H, D], as `slot_attention` does."""
    b, h, t, d = q.shape
    kvh = k_cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides, last dimension contiguous")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    group = h // kvh
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    if b * t:
        key_pos, count, past = keys.key_pos.contiguous(), keys.count.contiguous(), keys.past.contiguous()
        _logical_attention_kernel[(b * t, kvh)](
            q, k_cache, v_cache, out, slots, past, key_pos, count, 1.0 / math.sqrt(d), t, group,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            key_pos.stride(0), key_pos.stride(1), out.stride(0), out.stride(1), out.stride(2),
            D=d, BLOCK_G=max(16, triton.next_power_of_2(group)), TILE=TILE, IEEE=q.dtype == torch.float32,
            num_warps=4)
    return out


def logical_attention_tiled(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, keys: LogicalKeys) -> Tensor:
    """The same tiles and online softmax in PyTorch (off CUDA): float32 products summed with
    elementwise ops over fixed tile shapes, so a row's result does not depend on the others."""
    b, h, t, d = q.shape
    kvh = k_cache.shape[1]
    group = h // kvh
    past = keys.past.long()[:, None, None]                     # [B, 1, 1]
    n = past[..., 0] + keys.count.long()                       # [B, T]
    width = keys.key_pos.shape[-1]
    qf = q.float().view(b, kvh, group, t, d).permute(0, 3, 1, 2, 4)  # [B, T, KVH, G, D]
    m_i = torch.full((b, t, kvh, group), float("-inf"), device=q.device)
    l_i = torch.zeros(b, t, kvh, group, device=q.device)
    acc = torch.zeros(b, t, kvh, group, d, device=q.device)
    scale = 1.0 / math.sqrt(d)
    rows = slots.long()[:, None, None]
    for start in range(0, int(n.max()) if n.numel() else 0, TILE):
        j = torch.arange(start, start + TILE, device=q.device)[None, None]   # [1, 1, TILE]
        in_pass = j >= past
        pick = (j - past).clamp(0, width - 1).expand(b, t, TILE)
        pos = torch.where(in_pass, keys.key_pos.long().gather(2, pick), j)    # [B, T, TILE]
        inside = j < n[..., None]
        pos = torch.where(inside, pos, 0)
        k = k_cache[rows, :, pos].float()                          # [B, T, TILE, KVH, D]
        v = v_cache[rows, :, pos].float()
        scores = (qf[:, :, :, :, None, :] * k.permute(0, 1, 3, 2, 4)[:, :, :, None]).sum(-1) * scale
        scores = scores.masked_fill(~inside[:, :, None, None, :], float("-inf"))  # [B, T, KVH, G, TILE]
        m_new = torch.maximum(m_i, scores.amax(-1))
        m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(scores - m_use[..., None])
        alpha = torch.exp(m_i - m_use)
        l_i = l_i * alpha + p.sum(-1)
        pv = (p[..., None] * v.permute(0, 1, 3, 2, 4)[:, :, :, None]).sum(-2)   # [B, T, KVH, G, D]
        acc = acc * alpha[..., None] + pv
        m_i = m_new
    out = acc / torch.where(l_i > 0, l_i, 1.0)[..., None]
    return out.reshape(b, t, h, d).to(q.dtype)


def logical_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                                keys: LogicalKeys) -> Tensor:
    """What both compute, plainly: SDPA over each row's keys under the mask they stand for."""
    b, h, t, d = q.shape
    length = int((keys.past.long()[:, None] + keys.count.long()).max()) if q.numel() else 0
    length = max(length, int(keys.key_pos.max()) + 1 if keys.key_pos.numel() else 0)
    cols = torch.arange(length, device=q.device)
    mask = cols[None, None] < keys.past.long()[:, None, None]
    in_pass = torch.arange(keys.key_pos.shape[-1], device=q.device)[None, None] < keys.count.long()[..., None]
    hit = (keys.key_pos.long()[..., None] == cols) & in_pass[..., None]
    mask = mask | hit.any(2)
    k, v = k_cache[slots, :, :length], v_cache[slots, :, :length]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=h != k.shape[1])
    return out.transpose(1, 2)


def logical_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, keys: LogicalKeys) -> Tensor:
    """Batch-invariant attention: Triton on CUDA, the tiled PyTorch version elsewhere."""
    impl = logical_attention_triton if kernel_backend(q.device) == "triton" else logical_attention_tiled
    return impl(q, k_cache, v_cache, slots, keys)
