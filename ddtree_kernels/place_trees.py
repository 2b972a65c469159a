"""Trusted trees into a verify step's input buffers, on the device, in one launch.

An in-process drafter hands its DDTrees over as the selection left them (`common.tree.DeviceTrees`:
node tokens and parents per row). The verifier needs, per tree, its tokens, retrieve links
(`next_token`, `next_sibling`), position ids (past + depth) and ancestor mask, in the rows of
its static buffers (`verifier_svc.cuda_graphs.BatchInputs`). `common.tree.tree_fields` derives them
with torch operations (the reference: some twenty small launches, each a few tens of microseconds
of host time on a busy serving thread); this kernel does all of it in one program per tree:

* a node's ancestors, level by level: each round loads the parent of every node's current
  ancestor (parents precede children, so `max_depth` rounds reach every root);
* its first child and next sibling: the smallest later node with it (or its parent) as parent,
  over a [W, W] tile;
* padding nodes (past the tree's count) stay as the host staged them: token 0, no links,
  depth 0, seeing only themselves.

A tree's count is its selected count cut to the host's `limit` (the adaptive budget's cut); a
count of -1 (draft logits with a NaN) leaves the root alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.tree_sampling import unspecialised

MAX_BLOCK = 128  # widest tree tile a program takes; wider trees take the reference path

# One compiled variant for every step: no integer is specialised on its value, and no pointer on
# its alignment. `BatchInputs` packs a step's fields in one buffer, so in the (1 tree, 1 node)
# bucket (one session at the adaptive budget's budget 0) some start 8 bytes off a 16-byte
# boundary, and the first such step compiled a variant of its own while serving.
@triton.jit(**unspecialised(["R", "STRIDE", "T", "WIDTH", "MAX_DEPTH"],
                            ["tok_ptr", "par_ptr", "cnt_ptr", "rows_ptr", "out_tok", "out_pos", "out_next", "out_sib",
                             "past_ptr", "mask_ptr"]))
def _place_kernel(tok_ptr, par_ptr, cnt_ptr, rows_ptr, R, STRIDE, out_tok, out_pos, out_next, out_sib, past_ptr,
                  mask_ptr, T, WIDTH, MAX_DEPTH, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    src = tl.load(rows_ptr + r)
    dst = tl.load(rows_ptr + R + r)
    limit = tl.load(rows_ptr + 2 * R + r)
    count = tl.load(cnt_ptr + src * STRIDE)
    count = tl.where(count < 0, 1, tl.minimum(count, limit))
    count = tl.maximum(tl.minimum(count, WIDTH), 1)
    node = tl.arange(0, BLOCK)
    inside = node < WIDTH
    valid = node < count
    linked = valid & (node > 0)
    base = src * STRIDE
    parent = tl.load(par_ptr + base + node, mask=linked, other=0)
    parent = tl.where(linked, tl.minimum(tl.maximum(parent, 0), WIDTH - 1), node)  # roots and padding: themselves
    token = tl.load(tok_ptr + base + node, mask=valid, other=0)

    seen = (node[:, None] == node[None, :]) | (node[None, :] == parent[:, None])
    depth = linked.to(tl.int64)
    above = parent
    for _ in range(1, MAX_DEPTH):
        up_linked = (above > 0) & (above < count)
        up = tl.load(par_ptr + base + above, mask=up_linked & inside, other=0)
        up = tl.where(up_linked, tl.minimum(tl.maximum(up, 0), WIDTH - 1), above)
        depth += (up != above).to(tl.int64)
        above = up
        seen = seen | (node[None, :] == above[:, None])

    none = BLOCK + WIDTH
    child = (parent[None, :] == node[:, None]) & linked[None, :]  # [p, c]: c is a child of p
    first = tl.min(tl.where(child, node[None, :], none), axis=1)
    sibling = (parent[None, :] == parent[:, None]) & (node[None, :] > node[:, None]) & linked[None, :] & linked[:, None]
    later = tl.min(tl.where(sibling, node[None, :], none), axis=1)

    row = dst * T
    past = tl.load(past_ptr + dst)
    tl.store(out_tok + row + node, token, mask=inside)
    tl.store(out_pos + row + node, past + depth, mask=inside)
    tl.store(out_next + row + node, tl.where(first < none, first, -1), mask=inside)
    tl.store(out_sib + row + node, tl.where(later < none, later, -1), mask=inside)
    cells = mask_ptr + dst * T * T + node[:, None] * T + node[None, :]
    tl.store(cells, seen.to(tl.int8), mask=inside[:, None] & inside[None, :])


def place_trees(tokens: Tensor, parents: Tensor, counts: Tensor, rows: Tensor, max_depth: int, width: int,
                out_tokens: Tensor, out_positions: Tensor, out_next: Tensor, out_sibling: Tensor, past: Tensor,
                mask: Tensor) -> None:
    """Write R trees into the step's buffers: rows [3, R] int64 (on the device) holds each tree's
    row in tokens / parents [S, WT] and counts [S] (views with one row stride: the columns of
    `common.tree.DeviceTrees.packed`), its batch row, and its host count limit; the first `width`
    <= min(WT, T) columns of each batch row are written (out_* [B, T] int64, past [B], mask
    [B, T, T] bool). Raises ValueError when `width` needs more than MAX_BLOCK lanes."""
    stride = tokens.stride(0)
    if parents.stride(0) != stride or counts.stride(0) != stride or tokens.stride(1) != 1 or parents.stride(1) != 1:
        raise ValueError("tokens, parents and counts must be columns of one row-major buffer")
    block = max(16, triton.next_power_of_2(width))
    if block > MAX_BLOCK:
        raise ValueError(f"place_trees takes trees of at most {MAX_BLOCK} nodes, got {width}")
    num_rows = rows.shape[1]
    if num_rows:
        _place_kernel[(num_rows,)](tokens, parents, counts, rows, num_rows, stride, out_tokens, out_positions,
                                   out_next, out_sibling, past, mask.view(torch.int8), out_tokens.shape[1], width,
                                   max(max_depth, 1), BLOCK=block, num_warps=4)


def warm_up(device: torch.device, max_width: int) -> None:
    """Compile the kernel for every tile it may take for trees of up to `max_width` nodes (one
    variant per BLOCK, the only thing it is specialised on), so that no verify step waits for it."""
    for block in sorted({max(16, triton.next_power_of_2(w)) for w in range(1, min(max_width, MAX_BLOCK) + 1)}):
        width = min(block, max_width)
        packed = torch.zeros((1, 2 * width + 1), dtype=torch.int64, device=device)
        packed[0, 2 * width] = 1  # the count: the root alone
        out = torch.zeros((4, 1, width), dtype=torch.int64, device=device)
        mask = torch.zeros((1, width, width), dtype=torch.bool, device=device)
        rows = torch.tensor([[0], [0], [1]], dtype=torch.int64, device=device)  # tree row, batch row, count limit
        place_trees(packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width], rows, 1, width,
                    out[0], out[1], out[2], out[3], out[0, :, 0], mask)
