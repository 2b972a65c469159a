"""Tree attention that reads K/V straight from a session's cache slot (no gather), split over keys.

    out[b, t, h] = softmax(q[b, h, t] . K[slot_b, h // group, :L]^T / sqrt(D), masked) V[...]

with mask bool [B, T, L] (True = visible). `slot_attention_reference` is exactly that with
PyTorch's SDPA over the gathered slot; `slot_attention_triton` leaves the cache in place,
so a captured CUDA graph takes the slot as data, and cuts the keys into ranges whose partial
softmaxes a second kernel merges, as flash-decoding does: at batch 1 one program per (KV head,
query block) would leave most of the GPU idle.

Each row's keys fall into three ranges (`key_ranges`, computed once per forward): a prefix that
every query row sees (a session's past), read without the mask in a software-pipelined loop;
then up to the last key any row sees (the tree or prompt chunk), read with the mask; the rest
(a longer neighbour's keys, the padding of a graph's KV bucket) is not read at all.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.tree_sampling import kernel_backend


def slot_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                             ranges: Tensor | None = None) -> Tensor:
    """SDPA over the gathered slots; same arguments and result layout as `slot_attention_triton`
    (`ranges` only spares that kernel reads; the mask says it all here). The mask goes in
    additive (0 / -inf): SDPA's fused GPU kernels take that faster than a bool one."""
    length = mask.shape[-1]
    k, v = k_cache[slots, :, :length], v_cache[slots, :, :length]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


@triton.jit
def online_softmax_tile(q, k, v, visible, sm_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of flash attention: q [M, D] against k, v [N, D] where `visible` ([M, N] or
    broadcast to it); returns the updated row max m_i, row sum l_i and unnormalised output acc.
    IEEE: float32 products (also the interpreter's only working path); else the inputs' own
    tensor-core products with float32 accumulation."""
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# The arguments that change with a pass's shape (its tokens, its mask's length, the key splits):
# not specialised on (Triton would compile a variant per divisibility by 16, and for 1), so an
# eager pass of any shape (a prompt chunk of any length) takes a variant `warm_up` compiled.
# ONE_TOKEN (T == 1, a decode step) and PARTIAL (more than one split) keep what the
# specialisation on 1 gave: T and SPLITS constant there.
@triton.jit(do_not_specialize=["T", "L", "SPLITS", "s_mb", "s_mt"])
def _slot_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, mask_ptr, slots_ptr, ranges_ptr, sm_scale, T, L,
                           GROUP, SPLITS, split_len,
                           s_qb, s_qh, s_qt, s_cs, s_ch, s_cl, s_mb, s_mt, s_ob, s_os, s_ot, s_oh,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                           PARTIAL: tl.constexpr, STAGES: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr):
    """One program per (KV head, block of GROUP * T query rows, batch row x key split): online
    softmax over the split's cache positions. The key tiles below the row's shared prefix
    (`key_ranges`) are read without the mask, in a loop the compiler pipelines; the tiles from
    there to the last key any row sees read the mask and are skipped when no row of the block
    sees them; the keys after that are not read. PARTIAL: write the unnormalised output and the
    row max / sum of the split (combined by `_combine_splits_kernel`); else the normalised output."""
    pdl_enter(PDL)
    tokens = T
    if ONE_TOKEN:
        tokens = 1
    splits = SPLITS
    if not PARTIAL:
        splits = 1
    kvh = tl.program_id(0)
    b = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < GROUP * tokens
    t = rows % tokens
    head = kvh * GROUP + rows // tokens
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + t[:, None] * s_qt + d[None, :], mask=valid[:, None],
                other=0.0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    k_base = k_ptr + slot * s_cs + kvh * s_ch
    v_base = v_ptr + slot * s_cs + kvh * s_ch
    mask_rows = mask_ptr + b * s_mb + t * s_mt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    first = split * split_len
    last = tl.minimum(first + split_len, L)
    prefix = tl.load(ranges_ptr + 2 * b)
    end = tl.load(ranges_ptr + 2 * b + 1)
    shared_end = tl.maximum(first, tl.minimum(last, prefix // BLOCK_N * BLOCK_N))
    every_row = tl.full([1, BLOCK_N], 1, tl.int1)
    for start in tl.range(first, shared_end, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[:, None] * s_cl + d[None, :])
        v = tl.load(v_base + cols[:, None] * s_cl + d[None, :])
        m_i, l_i, acc = online_softmax_tile(q, k, v, every_row, sm_scale, m_i, l_i, acc, IEEE)
    for start in range(shared_end, tl.minimum(last, end), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < L
        visible = tl.load(mask_rows[:, None] + cols[None, :], mask=valid[:, None] & inside[None, :], other=0) != 0
        if tl.max(visible.to(tl.int32)) > 0:
            k = tl.load(k_base + cols[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, v, visible, sm_scale, m_i, l_i, acc, IEEE)
    out_rows = b * s_ob + split * s_os + t * s_ot + head * s_oh
    if PARTIAL:
        stat_rows = ((b * splits + split) * tokens + t) * (GROUP * tl.num_programs(0)) + head
        tl.store(m_ptr + stat_rows, m_i, mask=valid)
        tl.store(l_ptr + stat_rows, l_i, mask=valid)
        tl.store(o_ptr + out_rows[:, None] + d[None, :], acc, mask=valid[:, None])
    else:
        out = acc / tl.where(valid, l_i, 1.0)[:, None]
        tl.store(o_ptr + out_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _combine_splits_kernel(part_ptr, m_ptr, l_ptr, o_ptr, T, H, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr,
                           PDL: tl.constexpr):
    """One program per (batch row, token, head): merge the key splits' partial softmaxes.
    Partials [B, SPLITS, T, H, D] and stats [B, SPLITS, T, H] (float32); out [B, T, H, D]."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # (b * T + t) * H + head
    b = row // (T * H)
    th = row % (T * H)
    splits = tl.arange(0, BLOCK_S)
    present = splits < SPLITS
    stats = (b * SPLITS + splits) * (T * H) + th
    m = tl.load(m_ptr + stats, mask=present, other=float("-inf"))
    l = tl.load(l_ptr + stats, mask=present, other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    d = tl.arange(0, D)
    part = tl.load(part_ptr + stats[:, None] * D + d[None, :], mask=present[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty))


@dataclass(frozen=True)
class AttentionTiles:
    """Launch shape of `_slot_attention_kernel`: query rows and keys per tile, warps, pipeline
    stages of the shared-prefix loop, and the programs per SM the key splits aim for."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    programs_per_sm: int = 1


SHORT_KEYS = 640  # up to this many keys (ten tiles), small query blocks fill the GPU best


def attention_tiles(rows: int, pairs: int, keys: int, multiprocessors: int) -> AttentionTiles:
    """The tiles for GROUP * T query rows per KV head, in `pairs` (batch row, KV head) pairs, over
    `keys` keys: 64 keys by 16, 32 or 64 query rows on 4 warps, 3 stages, key splits for about
    one program per SM. Decode steps (at most 16 rows) take 16-row blocks. Over few keys, the
    largest block whose programs fill the SMs without key splits, else 16 rows: fewer splits,
    often none, so less for the merge kernel to read (measured on an H200 at Qwen3-8B shapes:
    the best of 16, 32 and 64 rows at batches 1 and 4, trees of 16 and 64, pasts 128 and 512;
    0.53-1.01x the 64-row blocks' time at batches 1 to 16; bench/RESULTS.md, "Attention tiles by
    the programs they make"). Otherwise, and over more keys (which small blocks re-read once per
    block), 64 rows: best or within 10% of the best of the shapes tried at batches 1 / 16 / 32,
    trees of 17 and 65, pasts 256 and 1024 (bench/attention.py)."""
    if rows <= 16:
        return AttentionTiles(16, 64, 4, 3)
    if keys <= SHORT_KEYS:
        for block in (64, 32):
            if pairs * triton.cdiv(rows, block) >= multiprocessors:
                return AttentionTiles(block, 64, 4, 3)
        return AttentionTiles(16, 64, 4, 3)
    return AttentionTiles(64, 64, 4, 3)


def key_ranges(mask: Tensor) -> Tensor:
    """[B, 2] int32 of a bool mask [B, T, L]: per batch row, how many keys from key 0 on every
    query row sees, and one past the last key any row sees. The kernel reads the first range
    without the mask and stops at the second. Device ops only (no host sync), so a forward
    computes it once for all its layers, inside a CUDA graph too."""
    length = mask.shape[-1]
    shared, seen = mask.all(dim=1), mask.any(dim=1)  # [B, L]
    prefix = torch.where(shared.all(-1), length, (~shared).to(torch.int32).argmax(-1))
    end = torch.where(seen.any(-1), length - seen.flip(-1).to(torch.int32).argmax(-1), 0)
    return torch.stack([prefix, end], -1).to(torch.int32)


def slot_attention_ranges(mask: Tensor) -> Tensor | None:
    """What `slot_attention` takes as `ranges`: `key_ranges(mask)` where it runs the Triton kernel,
    None where it runs the reference, which needs none."""
    return key_ranges(mask) if kernel_backend(mask.device) == "triton" else None


def _key_splits(batch_programs: int, key_blocks: int, programs_per_sm: int, device: torch.device) -> int:
    """How many key splits give the GPU about `programs_per_sm` programs per SM (1 when already that busy)."""
    return max(1, min(key_blocks, -(-programs_per_sm * _multiprocessors(device) // batch_programs)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def slot_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                          ranges: Tensor | None = None, float32_products: bool | None = None,
                          splits: int | None = None, tiles: AttentionTiles | None = None) -> Tensor:
    """Masked GQA attention that reads K/V straight from the cache slots (no gather, no mask copy).

    q [B, H, T, D] (rotated queries); k_cache / v_cache [slots, KVH, max_len, D] (one layer of
    KVCache.k / .v, already holding this pass's keys); slots [B]; mask bool [B, T, L] (True =
    visible, L <= max_len); ranges: `key_ranges(mask)` (computed here when None; a forward
    passes it to every layer). Returns [B, T, H, D], the layout o_proj wants. Same result as
    SDPA over `KVCache.read` with that mask; takes no host sync, so it captures in CUDA
    graphs with the slot as data. Triton (CUDA, or the interpreter).
    The keys are cut into `splits` ranges (default: enough programs for `tiles.programs_per_sm`
    per SM) whose partial softmaxes a second kernel merges, as flash-decoding does: at batch 1
    one program per (KV head, query block) would leave most of the GPU idle.
    float32_products: multiply in float32 (default: for float32 inputs only; bf16/fp16 inputs
    use the tensor cores' native products with float32 accumulation, as flash attention does).
    tiles: the launch shape (default `attention_tiles(H / KVH * T, B * KVH, L)`).
    """
    b, h, t, d = q.shape
    kvh, length = k_cache.shape[1], mask.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if mask.stride(-1) != 1 or mask.dtype != torch.bool:
        mask = mask.to(torch.bool).contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides, last dimension contiguous")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if ranges is None:
        ranges = key_ranges(mask)
    group = h // kvh
    tiles = tiles or attention_tiles(group * t, b * kvh, length, _multiprocessors(q.device))
    block_m, block_n = tiles.block_m, tiles.block_n
    m_blocks = triton.cdiv(group * t, block_m)
    key_blocks = triton.cdiv(length, block_n)
    splits = splits or _key_splits(kvh * m_blocks * b, key_blocks, tiles.programs_per_sm, q.device)
    splits = max(1, min(splits, key_blocks))
    split_len = triton.cdiv(key_blocks, splits) * block_n
    splits = triton.cdiv(length, split_len)
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    if splits == 1:
        part, m_stat, l_stat = out, out, out  # written directly; the stats are unused
        s_part = (out.stride(0), 0, out.stride(1), out.stride(2))
    else:
        part = torch.empty(b, splits, t, h, d, dtype=torch.float32, device=q.device)
        m_stat = torch.empty(b, splits, t, h, dtype=torch.float32, device=q.device)
        l_stat = torch.empty_like(m_stat)
        s_part = part.stride()[:4]
    mask_u8 = mask.view(torch.uint8)
    _slot_attention_kernel[(kvh, m_blocks, b * splits)](
        q, k_cache, v_cache, part, m_stat, l_stat, mask_u8, slots, ranges, 1.0 / math.sqrt(d), t, length, group,
        splits, split_len,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        mask_u8.stride(0), mask_u8.stride(1), *s_part,
        D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 if float32_products is None else float32_products, PARTIAL=splits > 1,
        STAGES=tiles.stages, ONE_TOKEN=t == 1, num_warps=tiles.warps, **pdl.launch_options(q.device))
    if splits > 1:
        _combine_splits_kernel[(b * t * h,)](part, m_stat, l_stat, out, t, h, splits, D=d,
                                             BLOCK_S=triton.next_power_of_2(splits), **pdl.launch_options(q.device))
    return out


def warm_up(k_cache: Tensor, v_cache: Tensor, num_heads: int) -> None:
    """Compile every variant of the kernels a pass may launch over these caches (one layer's,
    [slots, KVH, max_len, D]) with `num_heads` query heads: each block size of `attention_tiles`,
    with and without key splits, and the merge for each power-of-two bound of the split count up
    to one split per key tile of the cache. The verify graphs compile the shapes they were
    captured at; eager passes (prompt chunks of any length) would otherwise compile theirs while
    serving, stalling every session's step for about a second each (measured on an H200).
    Nothing to do where the kernels do not run compiled (a CPU, DDTREE_KERNELS=reference)."""
    dev = k_cache.device
    if dev.type != "cuda" or kernel_backend(dev) != "triton":
        return
    d, key_blocks = k_cache.shape[3], k_cache.shape[2] // 64
    slots = torch.zeros(1, dtype=torch.int64, device=dev)

    def launch(block_m: int, splits: int, tokens: int = 4) -> None:
        q = torch.zeros(1, num_heads, tokens, d, dtype=k_cache.dtype, device=dev)
        mask = torch.ones(1, tokens, splits * 64, dtype=torch.bool, device=dev)
        slot_attention_triton(q, k_cache, v_cache, slots, mask, splits=splits, tiles=AttentionTiles(block_m, 64, 4, 3))

    for splits in [s for s in (1, 2) if s <= key_blocks]:  # each split holds at least one key tile
        launch(16, splits, tokens=1)  # decode steps: 16-row blocks
        for block_m in (16, 32, 64):
            launch(block_m, splits)
    bound = 4
    while bound // 2 < key_blocks:  # the merge's BLOCK_S = next power of two of the split count
        launch(64, min(bound, key_blocks))
        bound *= 2


def slot_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                   ranges: Tensor | None = None) -> Tensor:
    """Triton on CUDA, the reference elsewhere (DDTREE_KERNELS overrides); see the module doc."""
    impl = slot_attention_triton if kernel_backend(q.device) == "triton" else slot_attention_reference
    return impl(q, k_cache, v_cache, slots, mask, ranges)
