"""A verify step's KV compaction: each row's accepted path moved to the front of its tree, in one kernel.

After a verify step, node path[i] of a row's tree goes to position past + i for every i up to the
accepted length (`verifier_svc.cuda_graphs.verify_step`). Semantics (`move_kv_rows_reference`, the
cache's own advanced indexing):

    for every row b, layer, KV head, and column p:
        cache[layer, slots[b], head, dst[b, p]] <- cache[layer, slots[b], head, src[b, p]]
    every source of a row read before any of its destinations is written

Destinations within a row are distinct, except that entries with src == dst (which the kernel
skips) may repeat another's destination when they carry the same value, as a step's rows past their
accepted length do (each copies `past` onto itself).

PyTorch's index kernels do this as four launches (read K, write K, read V, write V) that gather
and scatter every column, the no-op ones included: 0.5 ms of a 13 ms verify replay at 32 sessions
of 16 nodes (Qwen3-8B dimensions, H100). The kernel takes one program per (row, layer, KV head),
reads the row's moving columns of K and V, waits for all its threads' reads, then writes them.
A row's columns are one tile, so steps of more than MAX_COLUMNS columns (trees past 127 nodes)
take the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.tree_sampling import kernel_backend, unspecialised

MAX_COLUMNS = 128


def move_kv_rows_reference(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    """k, v [layers, slots, kv_heads, length, head_dim]; slots [B]; src, dst [B, P] (see module doc)."""
    rows = slots[:, None].expand_as(src)
    k[:, rows, :, dst] = k[:, rows, :, src]
    v[:, rows, :, dst] = v[:, rows, :, src]


@triton.jit(**unspecialised(["P", "SLOTS", "HEADS", "LENGTH", "D"],
                            ["k_ptr", "v_ptr", "slots_ptr", "src_ptr", "dst_ptr"]))
def _move_kv_rows_kernel(k_ptr, v_ptr, slots_ptr, src_ptr, dst_ptr, P, SLOTS, HEADS, LENGTH, D,
                         P_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per (row b, layer * HEADS + head)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    layer_head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, P_BLOCK)
    valid = cols < P
    src = tl.load(src_ptr + b * P + cols, mask=valid, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + b * P + cols, mask=valid, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dims = tl.arange(0, D_BLOCK)
    moving = (valid & (src != dst))[:, None] & (dims < D)[None, :]
    base = ((layer_head // HEADS * SLOTS + slot) * HEADS + layer_head % HEADS) * LENGTH * D
    src_at = base + src[:, None] * D + dims[None, :]
    dst_at = base + dst[:, None] * D + dims[None, :]
    keys = tl.load(k_ptr + src_at, mask=moving)
    values = tl.load(v_ptr + src_at, mask=moving)
    tl.debug_barrier()  # every thread's reads before any write: a row's destination may be another's source
    tl.store(k_ptr + dst_at, keys, mask=moving)
    tl.store(v_ptr + dst_at, values, mask=moving)


def move_kv_rows_triton(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    layers, num_slots, heads, length, d = k.shape
    if v.shape != k.shape or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"k and v must be contiguous and of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if src.shape != dst.shape or src.dim() != 2 or slots.shape != src.shape[:1]:
        raise ValueError(f"slots [B] and src, dst [B, P] expected, got {tuple(slots.shape)}, {tuple(src.shape)}, "
                         f"{tuple(dst.shape)}")
    b, p = src.shape
    if p > MAX_COLUMNS:
        raise ValueError(f"at most {MAX_COLUMNS} columns a row, got {p}")
    if b == 0 or p == 0:
        return
    p_block = triton.next_power_of_2(p)
    _move_kv_rows_kernel[(b, layers * heads)](
        k, v, slots.contiguous(), src.contiguous(), dst.contiguous(), p, num_slots, heads, length, d,
        P_BLOCK=p_block, D_BLOCK=triton.next_power_of_2(d), num_warps=8 if p_block >= 64 else 4,
        **pdl.launch_options(k.device))


def move_kv_rows(k: Tensor, v: Tensor, slots: Tensor, src: Tensor, dst: Tensor) -> None:
    """The compaction in place (see module doc): the Triton kernel on CUDA, the reference elsewhere
    and past MAX_COLUMNS columns."""
    fused = kernel_backend(k.device) == "triton" and src.shape[-1] <= MAX_COLUMNS
    impl = move_kv_rows_triton if fused else move_kv_rows_reference
    impl(k, v, slots, src, dst)


def warm_up(k: Tensor, v: Tensor, max_nodes: int) -> None:
    """Compile the kernel for every tile a step of up to `max_nodes` columns takes (one variant per
    P_BLOCK), so that no eager verify step waits for a compile; moves nothing (src == dst)."""
    if kernel_backend(k.device) != "triton":
        return
    slots = torch.zeros(1, dtype=torch.int64, device=k.device)
    for block in sorted({triton.next_power_of_2(n) for n in range(1, min(max_nodes, MAX_COLUMNS) + 1)}):
        cols = torch.zeros(1, min(block, max_nodes), dtype=torch.int64, device=k.device)
        move_kv_rows_triton(k, v, slots, cols, cols)
