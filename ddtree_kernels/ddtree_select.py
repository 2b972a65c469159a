"""The DDTree best-first selection on the device: one program per session, from the top-k candidates.

`drafter_svc.ddtree.select_ddtrees` defines the trees: the `budget` best prefixes under the
key (-score, depth, rank tuple), where a prefix's score is the float64 sum, left to right,
of its per-depth log-probs, node index = position in key order. Its host path selects them
with numpy from the top-k log-probs copied to the host; on an H200 host that took about
4 ms per step for 32 sessions at budget 15, while the device waited. This kernel runs the
best-first search itself, on the device, right behind the top-k, so only the trees come back.

Per session, a frontier holds the candidates: at first the root's first child (depth 1, rank
0). Each of the `budget` iterations pops the candidate with the smallest key; it becomes the
next node, and its first child (rank 0 one depth down) and its next sibling (the same parent,
the next rank) join the frontier. Both have larger keys than it (log-probs are <= 0, ranks
sort descending, float64 addition is monotone), so the pops come out in key order: the same
nodes, indices and parents as the definition. The frontier never holds more than budget + 1.

The rank tuple decides between equal scores at equal depth (bf16 logits make such ties
common). Two candidates at depth d compare as (their parents' tuples, their own ranks), and
their parents sit at depth d - 1 among the nodes already selected. So every selected node
keeps its position among the selected nodes of its depth in rank-tuple order ("ord"), and
every candidate and node its parent's; a candidate's tuple then ranks as parent ord * K +
rank. Inserting a node shifts the ords above its own at its depth by one, which keeps every
other order as it was; the ords that name those nodes as parents shift with them.

Outputs (one int64 buffer, one device-to-host copy): per session the node tokens and parents
(root first, parent -1) and the node count, and the nodes' float64 scores (bit-cast, NaN past
the count). A session whose rank-0 log-prob is NaN at some depth (and whose budget is > 0)
gets the count -1: the caller raises, as the host path does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.tree_sampling import unspecialised

# Widths (the step's largest budget) the kernel takes: each pop costs a few reductions over
# about 2 x width lanes, so far wider trees are left to the host path.
MAX_WIDTH = 256
MIN_LANES = 64  # lanes of the smallest compiled variant: budgets up to 62 share one compile


def _lanes(width: int) -> int:
    return max(MIN_LANES, triton.next_power_of_2(width + 2))


# One compiled variant for every step of a lane count: no size is specialised on its value, and
# no pointer on its alignment (a step's roots and budgets are the two rows of one [2, S] buffer,
# so at an odd S the budgets start 8 bytes off a 16-byte boundary, and such a step compiled a
# variant of its own while serving).
@triton.jit(**unspecialised(["D", "K", "W", "OUT_W"],
                            ["logq_ptr", "tok_ptr", "budget_ptr", "root_ptr", "out_ptr", "score_ptr"]))
def _select_kernel(logq_ptr, tok_ptr, budget_ptr, root_ptr, out_ptr, score_ptr, D, K, W, OUT_W,
                   DEPTHS: tl.constexpr, FRONT: tl.constexpr, NODES: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    budget = tl.load(budget_ptr + s).to(tl.int32)
    base = s * D * K
    out = out_ptr + s * OUT_W  # [tokens 1 + W | parents 1 + W | count]
    scores = score_ptr + s * OUT_W  # the same row as float64: scores at columns 2 + 2W ...
    tl.store(out, tl.load(root_ptr + s))
    tl.store(out + 1 + W, -1)

    # A NaN rank-0 log-prob at any depth (a NaN row): the host path raises; so do we (count -1).
    depths = tl.arange(0, DEPTHS)
    first = tl.load(logq_ptr + base + depths * K, mask=depths < D, other=0.0)
    bad = ((tl.max((first != first).to(tl.int32), axis=0) > 0) & (budget > 0)).to(tl.int32)

    lanes = tl.arange(0, FRONT)
    nodes = tl.arange(0, NODES)
    # The frontier: validity, score, parent's score, depth, rank, parent node, parent's ord.
    f_valid = (lanes == 0) & (budget > 0)
    first_lq = tl.load(logq_ptr + base).to(tl.float64)
    zero64 = tl.zeros((FRONT,), dtype=tl.float64)
    f_score = tl.where(lanes == 0, first_lq, zero64)
    f_pscore = zero64
    f_depth = tl.full((FRONT,), 1, dtype=tl.int32)
    f_rank = tl.zeros((FRONT,), dtype=tl.int32)
    f_parent = tl.zeros((FRONT,), dtype=tl.int32)
    f_pord = tl.zeros((FRONT,), dtype=tl.int32)
    # The selected nodes (node 0 the root, depth 0): depth, ord, parent's ord, rank.
    n_depth = tl.zeros((NODES,), dtype=tl.int32)
    n_ord = tl.zeros((NODES,), dtype=tl.int32)
    n_pord = tl.zeros((NODES,), dtype=tl.int32)
    n_rank = tl.zeros((NODES,), dtype=tl.int32)
    count = 1
    size = 1  # frontier slots used
    for i in range(0, W):
        if (i < budget) & (tl.max(f_valid.to(tl.int32), axis=0) > 0) & (bad == 0):
            # The smallest key: the largest score, then the smallest depth, then the rank tuple.
            best = tl.max(tl.where(f_valid, f_score, -float("inf")), axis=0)
            cand = f_valid & (f_score == best)
            depth = tl.min(tl.where(cand, f_depth, 1 << 30), axis=0)
            cand = cand & (f_depth == depth)
            lex = f_pord.to(tl.int64) * K + f_rank
            least = tl.min(tl.where(cand, lex, 1 << 62), axis=0)
            cand = cand & (lex == least)
            slot = tl.min(tl.where(cand, lanes, FRONT), axis=0)
            popped = lanes == slot
            rank = tl.sum(tl.where(popped, f_rank, 0), axis=0)
            parent = tl.sum(tl.where(popped, f_parent, 0), axis=0)
            pord = tl.sum(tl.where(popped, f_pord, 0), axis=0)
            pscore = tl.sum(tl.where(popped, f_pscore, zero64), axis=0)
            # Its ord among the selected nodes of its depth, and the shift of those above it.
            used = nodes < count
            level = used & (n_depth == depth)
            order = tl.sum((level & (n_pord.to(tl.int64) * K + n_rank < least)).to(tl.int32), axis=0)
            n_ord = tl.where(level & (n_ord >= order), n_ord + 1, n_ord)
            n_pord = tl.where(used & (n_depth == depth + 1) & (n_pord >= order), n_pord + 1, n_pord)
            f_pord = tl.where(f_valid & (f_depth == depth + 1) & (f_pord >= order), f_pord + 1, f_pord)
            added = nodes == count
            n_depth = tl.where(added, depth, n_depth)
            n_ord = tl.where(added, order, n_ord)
            n_pord = tl.where(added, pord, n_pord)
            n_rank = tl.where(added, rank, n_rank)
            tl.store(out + count, tl.load(tok_ptr + base + (depth - 1) * K + rank))
            tl.store(out + 1 + W + count, parent)
            tl.store(scores + 2 + 2 * W + count, best)
            # Its first child takes its slot; its next sibling a new one.
            child = depth < D
            child_lq = tl.load(logq_ptr + base + depth * K, mask=child, other=0.0).to(tl.float64)
            f_valid = tl.where(popped, child, f_valid)
            f_score = tl.where(popped, best + child_lq, f_score)
            f_pscore = tl.where(popped, best, f_pscore)
            f_depth = tl.where(popped, depth + 1, f_depth)
            f_rank = tl.where(popped, 0, f_rank)
            f_parent = tl.where(popped, count, f_parent)
            f_pord = tl.where(popped, order, f_pord)
            sibling = rank + 1 < K
            sib_lq = tl.load(logq_ptr + base + (depth - 1) * K + rank + 1, mask=sibling, other=0.0).to(tl.float64)
            joined = lanes == size
            f_valid = tl.where(joined, sibling, f_valid)
            f_score = tl.where(joined, pscore + sib_lq, f_score)
            f_pscore = tl.where(joined, pscore, f_pscore)
            f_depth = tl.where(joined, depth, f_depth)
            f_rank = tl.where(joined, rank + 1, f_rank)
            f_parent = tl.where(joined, parent, f_parent)
            f_pord = tl.where(joined, pord, f_pord)
            size += 1
            count += 1
    tl.store(out + 2 + 2 * W, tl.where(bad > 0, -1, count).to(tl.int64))
    tl.store(scores + 2 + 2 * W + nodes, tl.full((NODES,), float("nan"), tl.float64),
             mask=(nodes >= count) & (nodes <= W))  # no node there


def select_on_device(logq: Tensor, tokens: Tensor, roots: Tensor, budgets: Tensor, width: int | None = None
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Best-first DDTree nodes of S sessions from their top-k candidates, on the candidates' device.

    logq [S, D, K] float32 (descending per row), tokens [S, D, K] int64, roots [S] and budgets
    [S] int64 on the same device; K >= the largest budget or the vocabulary. Returns host
    tensors after one copy: tokens and parents [S, 1 + W] (W = the largest budget; columns past
    a session's count are unspecified), counts [S] (root included; -1: a NaN row) and scores
    [S, W] float64 (NaN past count - 1). `width`: the largest budget, where the host knows it
    (else it is read from the device, which waits for the work queued before)."""
    if width is None:
        width = int(budgets.max()) if budgets.numel() else 0
    out = select_rows(logq, tokens, roots, budgets, width).cpu()
    scores = out.view(torch.float64)[:, 3 + 2 * width:]
    return out[:, : 1 + width], out[:, 1 + width: 2 + 2 * width], out[:, 2 + 2 * width], scores


def select_rows(logq: Tensor, tokens: Tensor, roots: Tensor, budgets: Tensor, width: int) -> Tensor:
    """`select_on_device`'s results left on the device, queued without waiting (`width`, the
    largest budget, comes from the host): one int64 row [S, 3 + 3W] per session, tokens (1 + W) |
    parents (1 + W) | count | scores (W, float64 bits)."""
    num_sessions, num_depths, k = logq.shape
    if not 0 < width <= MAX_WIDTH or num_depths == 0 or k == 0:
        raise ValueError(f"the device selection takes 1 to {MAX_WIDTH} nodes, depths and candidates; got "
                         f"budget {width}, {num_depths} depths, {k} candidates")
    cols = 3 + 3 * width  # tokens (1 + W), parents (1 + W), count, scores (W)
    out = torch.empty((num_sessions, cols), dtype=torch.int64, device=logq.device)
    if num_sessions:
        _select_kernel[(num_sessions,)](
            logq.contiguous(), tokens.contiguous(), budgets, roots, out, out.view(torch.float64), num_depths, k,
            width, cols, DEPTHS=triton.next_power_of_2(max(num_depths, 1)), FRONT=_lanes(width), NODES=_lanes(width),
            num_warps=1 if width <= 62 else 4)
    return out


def warm_up(device: torch.device, num_depths: int, max_width: int = 64) -> None:
    """Compile the kernel for blocks of `num_depths` depths (a constexpr: the draft's block size - 1)
    and every budget up to `max_width` (one variant per lane count), with the argument types a
    step passes (float32 log-probs, int64 tokens, roots and budgets), so that no step waits for it."""
    widths = {_lanes(w): w for w in range(1, min(max_width, MAX_WIDTH) + 1)}  # the widest of each lane count
    for width in widths.values():
        logq = torch.zeros((1, num_depths, width), dtype=torch.float32, device=device)
        given = torch.tensor([[0], [width]], dtype=torch.int64, device=device)  # roots, budgets: as a step's
        select_rows(logq, torch.zeros_like(logq, dtype=torch.int64), given[0], given[1], width)
