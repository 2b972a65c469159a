"""A verify step's KV compaction: each row's accepted path moved to the front of its tree, in one kernel.

After a verify step, node path[i] of a row's tree goes to position past + i for every i up to the
accepted length (`verifier_svc.cuda_graphs.verify_step`). Semantics (`move_kv_rows_reference`, the
cache's own advanced indexing):

    for every row b, layer, KV head, and column p:
        cache[layer, slots[b], head, dst[b, p]] <- cache[layer, slots[b], head, src[b, p]]
    every source of a row read before any of its destinations is written

Within a row, no column's source may be an earlier column's destination (the compaction's are
not: its destinations past + i ascend, and each source past + path[i] lies at or after its own),
and destinations are distinct, except that entries with src == dst (which the kernel skips) may
repeat another's destination when they carry the same value, as a step's rows past their
accepted length do (each copies `past` onto itself). The kernel skips an entry outside [0, length)
(where the reference raises, or wraps a negative index): no step reaches past its slot's entries.

PyTorch's index kernels do this as four launches (read K, write K, read V, write V) that gather
and scatter every column, the no-op ones included: 0.5 ms of a 13 ms verify replay at 32 sessions
of 16 nodes (Qwen3-8B dimensions, H100). The kernel takes one program per (row, layer, KV head),
which walks the row's columns in blocks, in order: it reads a block's moving entries of K and V,
waits for all its threads' reads (a block's destination may be a later column's source in the
same block), then writes them. A later block's sources are none of an earlier block's
destinations, so the blocks need no wait between them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.tree_sampling import kernel_backend, unspecialised

COLUMNS = 16  # a block of a row's columns, read then written


def move_kv_rows_reference(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    """k, v [layers, slots, kv_heads, length, head_dim]; slots [B]; src, dst [B, P] (see module doc)."""
    rows = slots[:, None].expand_as(src)
    k[:, rows, :, dst] = k[:, rows, :, src]
    v[:, rows, :, dst] = v[:, rows, :, src]


@triton.jit(**unspecialised(["P", "SLOTS", "HEADS", "LENGTH"], ["k_ptr", "v_ptr", "slots_ptr", "src_ptr", "dst_ptr"]))
def _move_kv_rows_kernel(k_ptr, v_ptr, slots_ptr, src_ptr, dst_ptr, P, SLOTS, HEADS, LENGTH, D: tl.constexpr,
                         D_BLOCK: tl.constexpr, COLUMNS: tl.constexpr, PDL: tl.constexpr):
    """One program per (row b, layer * HEADS + head), over the row's columns in blocks, in order."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    layer_head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    base = ((layer_head // HEADS * SLOTS + slot) * HEADS + layer_head % HEADS) * LENGTH * D
    k_head, v_head = k_ptr + base, v_ptr + base  # this (layer, slot, head)'s [LENGTH, D] entries
    dims = tl.arange(0, D_BLOCK)
    for start in range(0, P, COLUMNS):
        cols = start + tl.arange(0, COLUMNS)
        valid = cols < P
        src = tl.load(src_ptr + b * P + cols, mask=valid, other=0).to(tl.int32)
        dst = tl.load(dst_ptr + b * P + cols, mask=valid, other=0).to(tl.int32)
        inside = (src >= 0) & (src < LENGTH) & (dst >= 0) & (dst < LENGTH)  # never past the head's entries
        moving = (valid & inside & (src != dst))[:, None] & (dims < D)[None, :]
        src_at = src[:, None] * D + dims[None, :]
        dst_at = dst[:, None] * D + dims[None, :]
        keys = tl.load(k_head + src_at, mask=moving)
        values = tl.load(v_head + src_at, mask=moving)
        tl.debug_barrier()  # the block's reads before any write: a destination may be a later column's source
        tl.store(k_head + dst_at, keys, mask=moving)
        tl.store(v_head + dst_at, values, mask=moving)


def move_kv_rows_triton(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    layers, num_slots, heads, length, d = k.shape
    if v.shape != k.shape or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"k and v must be contiguous and of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if src.shape != dst.shape or src.dim() != 2 or slots.shape != src.shape[:1]:
        raise ValueError(f"slots [B] and src, dst [B, P] expected, got {tuple(slots.shape)}, {tuple(src.shape)}, "
                         f"{tuple(dst.shape)}")
    if length * d >= 1 << 31:
        raise ValueError(f"a head's {length} x {d} cache entries exceed the kernel's 32-bit offsets")
    b, p = src.shape
    if b == 0 or p == 0:
        return
    _move_kv_rows_kernel[(b, layers * heads)](
        k, v, slots.contiguous(), src.contiguous(), dst.contiguous(), p, num_slots, heads, length, D=d,
        D_BLOCK=triton.next_power_of_2(d), COLUMNS=COLUMNS, num_warps=4, **pdl.launch_options(k.device))


def move_kv_rows(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    """The compaction in place (see module doc): the Triton kernel on CUDA, the reference elsewhere."""
    impl = move_kv_rows_triton if kernel_backend(k.device) == "triton" else move_kv_rows_reference
    impl(k, v, slots, src, dst)


def warm_up(k: Tensor, v: Tensor) -> None:
    """Compile the kernel for this cache now (one variant serves every step width), so that no
    verify step waits for it; moves nothing (src == dst)."""
    if kernel_backend(k.device) != "triton":
        return
    cols = torch.zeros(1, 1, dtype=torch.int64, device=k.device)
    move_kv_rows_triton(k, v, cols[0], cols, cols)
