"""DDTree: turn DFlash blocks of draft logits into draft trees under a node budget.

The DFlash draft gives one distribution q_d per depth d = 1..D (D = block_size - 1).
A path that takes the token of rank r_i at each depth i scores sum_i log q_i(rank r_i),
summed left to right in float64. A tree holds the `budget` best prefixes under the key
(-score, depth, rank tuple): the higher cumulative log-prob first; on equal scores the
shallower prefix first; on equal depth the lexicographically smaller tuple of per-depth
ranks first. The key is unique, and node index = position in key order, so the tree is
deterministic. It is what a best-first heap search pops (tests/reference.py keeps one).

`build_ddtrees` builds the trees of many sessions at once, vectorised over sessions with
numpy, one step per depth. Why that is exact: a prefix's first child and its next-rank
sibling have larger keys than it (log q <= 0, topk sorts, float64 addition is monotone),
so the heap pops prefixes in key order; the tree is the `budget` smallest keys, and a
node's parent is in it with a smaller key. Its depth-d nodes are therefore among the
`budget` best children of the depth-(d - 1) nodes still selected, and among the `budget`
best once merged with the shallower selection. Each step keeps exactly those children
and merges them into the running selection (on equal scores the shallower node first).

Finding the `budget` best children without scoring them all: with the parents in key
order, scores fall along ranks and along parents, so the child of the j-th parent at rank
r scores at most as much as each of the (j + 1)(r + 1) children of its rectangle. Only
the staircase (j + 1)(r + 1) <= budget is scored. A child past it can still be selected
only if it ties the `budget`-th best score (float rounding or -inf log-probs tie children
of different parents, and then the rank tuple decides); each parent's first child past
the staircase bounds the rest, and a session where one reaches that score rescores all
its children at that depth.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.staging import HostCopy, to_device
from common.tree import DeviceTree, DeviceTrees, DraftTree, expected_gains
from ddtree_kernels.ddtree_select import MAX_WIDTH, select_on_device, select_rows
from ddtree_kernels.draft_topk import top_logprobs
from ddtree_kernels.tree_sampling import kernel_backend

NAN_LOGITS = "block_logits contain NaN (or a row that is all -inf)"


def _check_block_logits(block_logits: Tensor) -> None:
    if block_logits.dim() != 2:
        raise ValueError(f"block_logits must be [depth, vocab], got shape {tuple(block_logits.shape)}")


def _children(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parent slot, rank) of candidate children: ranks 0..counts[j] - 1 of each parent slot j."""
    slot = np.repeat(np.arange(counts.shape[0]), counts)
    rank = np.arange(slot.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return slot, rank


def _best_children(
    front_score: np.ndarray, front_order: np.ndarray, logq: np.ndarray, pairs: tuple[np.ndarray, np.ndarray],
    width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The `width` best candidate children per session, in key order: (score, parent slot, rank) [S, width].

    front_score/front_order: [S, F] parent scores (NaN = no parent) and their rank-tuple
    order; logq: [S, K] this depth's log-probs; pairs: the candidates' (parent slot, rank).
    At one depth the key is (-score, (parent's rank-tuple order, rank)). Missing children
    (fewer candidates than `width`) have score NaN.
    """
    slot, rank = pairs
    rows = np.arange(front_score.shape[0])[:, None]
    score = front_score[:, slot] + logq[:, rank]  # NaN = no such child; sorts last
    # The width + 1 best by score (one more to see a tie at the cut), then sorted; a short row is
    # sorted whole (one call instead of three).
    if score.shape[1] > max(width + 1, 64):
        best = np.argpartition(-score, width, axis=1)[:, : width + 1]
        order = best[rows, np.argsort(-score[rows, best], axis=1)]
    else:
        order = np.argsort(-score, axis=1)[:, : width + 1]
    # Equal scores among the kept children, or at the cut, also need the rank-tuple order;
    # sorting by the full key is slower, so only those sessions get it.
    kept = score[rows, order]
    equal = kept[:, 1:] == kept[:, :-1]
    if equal.any():  # (the whole-array test first: much cheaper than per row, and usually False)
        tied = np.flatnonzero(equal.any(axis=1))
        code = front_order[tied][:, slot] * logq.shape[1] + rank
        order[tied] = np.lexsort((code, -score[tied]), axis=1)[:, : width + 1]
    order = order[:, :width]
    if order.shape[1] < width:  # fewer candidates than width: point the rest at a missing child
        score = np.concatenate((score, np.full((score.shape[0], 1), np.nan)), axis=1)
        slot, rank = np.append(slot, 0), np.append(rank, 0)
        order = np.concatenate((order, np.full((score.shape[0], width - order.shape[1]), slot.shape[0] - 1)), axis=1)
    return score[rows, order], slot[order], rank[order]


def _retrieve_buffers(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """next_token and next_sibling of nodes given by flat parents (-1 = a root, else an earlier node).

    Each parent's children are linked in node-index order, as `DraftTree.from_parents` does.
    """
    next_token = np.full(parents.shape, -1, dtype=np.int64)
    next_sibling = np.full(parents.shape, -1, dtype=np.int64)
    node = np.flatnonzero(parents >= 0)
    # Group the children by parent; a stable sort keeps node-index order inside a group.
    node = node[np.argsort(parents[node], kind="stable")]
    parent = parents[node]
    same = parent[1:] == parent[:-1]
    next_sibling[node[:-1][same]] = node[1:][same]
    first = np.ones(node.shape, dtype=bool)
    first[1:] = ~same
    next_token[parent[first]] = node[first]
    return next_token, next_sibling


@dataclass
class DDTreeSelection:
    """The best-first nodes of S sessions' DDTrees, in key order, before they become trees.

    Node i of session s (i >= 1) has cumulative draft log-prob scores[s, i - 1]: the draft's
    own probability that the target takes that path. Since node index = position in key
    order and a parent comes before its children, the first b nodes of a tree built with a
    budget B >= b are exactly the tree of budget b (`trees(budgets)` cuts them there).
    """
    tokens: np.ndarray     # [S, 1 + width] int64, the root first
    parents: np.ndarray    # [S, 1 + width] node indices, -1 for the root
    num_nodes: np.ndarray  # [S] root included
    scores: np.ndarray     # [S, width] float64, NaN past num_nodes - 1

    def trees(self, budgets: Sequence[int] | np.ndarray | None = None) -> list[DraftTree]:
        """The trees, each cut to at most budgets[s] drafted nodes (None: as selected)."""
        num_nodes = self.num_nodes if budgets is None else np.minimum(self.num_nodes, 1 + np.asarray(budgets))
        return _trees(self.tokens, self.parents, num_nodes)

    def expected_gains(self) -> np.ndarray:
        """[S, 1 + width]: `common.tree.expected_gains` of the selected nodes."""
        return expected_gains(self.scores)


def build_ddtrees(block_logits: Tensor, root_tokens: Sequence[int], budgets: Sequence[int]) -> list[DraftTree]:
    """Best-first DDTrees for S sessions at once; tree s has at most `budgets[s]` drafted nodes.

    block_logits: [S, D, V] draft logits for depths 1..D, any float dtype, any device.
    The trees are on the CPU. See `select_ddtrees`.
    """
    return select_ddtrees(block_logits, root_tokens, budgets).trees()


def select_ddtrees(block_logits: Tensor, root_tokens: Sequence[int], budgets: Sequence[int]) -> DDTreeSelection:
    """The nodes of S sessions' best-first DDTrees, at most `budgets[s]` drafted nodes each.

    Per depth the candidates are the top min(budget, V) tokens of log_softmax. One top-k of
    the largest budget serves all sessions: a tree of b nodes never uses a rank >= b, since a
    node's elder siblings come before it. Siblings come out in descending cumulative log-prob;
    budget 0 gives the root only. Where `kernel_backend` says Triton (CUDA logits) and the
    largest budget is at most `ddtree_kernels.ddtree_select.MAX_WIDTH`, the selection runs on the
    device and only the trees are copied back; otherwise the candidates are, and numpy selects.
    """
    if block_logits.dim() != 3:
        raise ValueError(f"block_logits must be [sessions, depth, vocab], got shape {tuple(block_logits.shape)}")
    num_sessions, num_depths, vocab_size = block_logits.shape
    if len(root_tokens) != num_sessions or len(budgets) != num_sessions:
        raise ValueError(
            f"need one root token and one budget per session: {num_sessions} sessions, "
            f"{len(root_tokens)} root tokens, {len(budgets)} budgets"
        )
    if any(budget < 0 for budget in budgets):
        raise ValueError(f"budgets must be >= 0, got {list(budgets)}")
    budget = np.array(budgets, dtype=np.int64).reshape(num_sessions)
    width = int(budget.max(initial=0))
    ranks = min(width, vocab_size)
    roots = np.array(root_tokens, dtype=np.int64).reshape(num_sessions)
    if ranks == 0 or num_depths == 0:
        return DDTreeSelection(roots[:, None], np.full((num_sessions, 1), -1), np.ones(num_sessions, dtype=np.int64),
                               np.zeros((num_sessions, 0)))

    values, tokens = top_logprobs(block_logits.detach(), ranks)
    if kernel_backend(block_logits.device) == "triton" and width <= MAX_WIDTH:
        return _select_on_device(values, tokens, roots, budget)
    logq, top_tokens = _to_host(values, tokens)
    if np.isnan(logq[budget > 0, :, 0]).any():  # a row with a NaN has NaN log-probs
        raise ValueError(NAN_LOGITS)

    rows = np.arange(num_sessions)[:, None]
    over_budget = np.arange(width) >= budget[:, None]
    cut = bool(over_budget.any())  # some session's budget is below the width
    stair_counts = np.minimum(width // np.arange(1, width + 1), ranks)
    staircase, stair_ends = _children(stair_counts), np.cumsum(stair_counts)
    # The parents with children past the staircase (a suffix: the counts never grow) and the rank of
    # each one's first such child.
    past_slot = np.flatnonzero(stair_counts < ranks)
    past_rank = stair_counts[past_slot]
    first_past = int(past_slot[0]) if past_slot.size else width
    last_kept = np.maximum(budget - 1, 0)[:, None]

    # Node ids: 0 = the root, 1 + d * width + q = child q kept at depth d + 1.
    id_tokens = np.zeros((num_sessions, 1 + num_depths * width), dtype=np.int64)
    id_parents = np.zeros_like(id_tokens)
    # The frontier: the previous depth's nodes still selected, in key order (at first the root).
    front_score = np.zeros((num_sessions, 1))
    front_order = np.zeros((num_sessions, 1), dtype=np.int64)
    front_base = 0
    # The running selection over all depths so far, in key order.
    best_score = np.full((num_sessions, width), np.nan)
    best_id = np.zeros((num_sessions, width), dtype=np.int64)
    merged_id = np.empty((num_sessions, 2 * width), dtype=np.int64)
    for depth in range(num_depths):
        num_parents = front_score.shape[1]
        pairs = tuple(column[: stair_ends[num_parents - 1]] for column in staircase)
        score, slot, rank = _best_children(front_score, front_order, logq[:, depth], pairs, width)
        cutoff = score[rows, last_kept]
        cutoff[np.isnan(cutoff)] = -np.inf  # fewer children than the budget: any outside one counts
        outside = max(0, num_parents - first_past)  # parents with children past the staircase
        reached = front_score[:, past_slot[:outside]] + logq[:, depth, past_rank[:outside]] >= cutoff
        if outside and reached.any():
            redo = np.flatnonzero(reached.any(axis=1))
            score[redo], slot[redo], rank[redo] = _best_children(
                front_score[redo], front_order[redo], logq[redo, depth], _children(np.full(num_parents, ranks)), width
            )
        if cut:
            score[over_budget] = np.nan
        base = 1 + depth * width
        id_tokens[:, base:base + width] = top_tokens[rows, depth, rank]
        id_parents[:, base:base + width] = front_base + slot

        # Merge: on equal scores the shallower (already selected) node comes first, and a
        # stable sort on score keeps each side's own key order.
        merged_score = np.concatenate((best_score, score), axis=1)
        pick = np.argsort(-merged_score, axis=1, kind="stable")[:, :width]
        best_score = merged_score[rows, pick]
        if cut:
            best_score[over_budget] = np.nan
        merged_id[:, :width], merged_id[:, width:] = best_id, base + np.arange(width)
        best_id = merged_id[rows, pick]
        # This depth's nodes still selected are a prefix of its children (both sides are in key order).
        selected = ((pick >= width) & ~over_budget if cut else pick >= width).sum(axis=1)
        num_parents = int(selected.max())
        if num_parents == 0:  # nothing deeper can be selected
            break
        front_score = np.where(np.arange(num_parents) < selected[:, None], score[:, :num_parents], np.nan)
        # The new parents' rank-tuple order (parent's order, then rank), as ranks 0 .. num_parents - 1.
        code = front_order[rows, slot[:, :num_parents]] * ranks + rank[:, :num_parents]
        front_order, front_base = np.argsort(np.argsort(code, axis=1), axis=1), base

    # Node index = 1 + position in key order; a parent's key is smaller, so its index too.
    num_nodes = 1 + (~np.isnan(best_score)).sum(axis=1)
    node_of_id = np.zeros_like(id_tokens)
    node_of_id[rows, best_id] = np.arange(1, width + 1)
    node_of_id[:, 0] = 0  # ids of unused slots may be 0: the root stays node 0
    tokens = np.concatenate((roots[:, None], id_tokens[rows, best_id]), axis=1)
    parents = np.concatenate((np.full((num_sessions, 1), -1), node_of_id[rows, id_parents[rows, best_id]]), axis=1)
    return DDTreeSelection(tokens, parents, num_nodes, best_score)


def select_device_trees(block_logits: Tensor, root_tokens: Sequence[int], budgets: Sequence[int],
                        cut: Sequence[int] | None = None) -> list[DeviceTree]:
    """The trees of `select_ddtrees`, left on the block logits' device for a verifier in this
    process (`common.tree.DeviceTrees`), each cut to its first 1 + cut[s] nodes (default: as
    selected; the first b nodes of a tree are the tree of budget b). Where the selection runs on
    the device (see `select_ddtrees`) nothing here waits for it: the node counts are known without
    it (`tree_sizes`) and the copy of the trees and scores to the host is queued behind it. A NaN
    row then shows as count -1, found by the verifier; elsewhere numpy selects the same trees (and
    raises on a NaN row) and they are moved to the device."""
    num_sessions, num_depths, vocab_size = block_logits.shape
    width = max(budgets, default=0)
    ranks = min(width, vocab_size)
    cut = list(budgets) if cut is None else [min(c, b) for c, b in zip(cut, budgets)]
    device = block_logits.device
    if kernel_backend(device) == "triton" and 0 < width <= MAX_WIDTH and num_depths > 0:
        values, tokens = top_logprobs(block_logits.detach(), ranks)
        given = to_device([list(root_tokens), list(budgets)], device, torch.int64)  # one copy
        packed = select_rows(values, tokens, given[0], given[1], width)
        selected = tree_sizes(budgets, ranks, num_depths)
    else:
        selection = select_ddtrees(block_logits, root_tokens, budgets)
        width = selection.tokens.shape[1] - 1
        selected = tuple(selection.num_nodes.tolist())
        scores = np.ascontiguousarray(selection.scores).view(np.int64)  # float64 bits, as the kernel writes them
        packed = to_device(torch.from_numpy(np.concatenate(
            (selection.tokens, selection.parents, selection.num_nodes[:, None], scores), axis=1)), device, torch.int64)
    num_nodes = tuple(min(n, 1 + c) for n, c in zip(selected, cut))
    trees = DeviceTrees(packed, width, num_nodes, min(max(cut, default=0), num_depths), HostCopy(packed))
    return [trees.tree(row, int(root)) for row, root in enumerate(root_tokens)]


def tree_sizes(budgets: Sequence[int], ranks: int, num_depths: int) -> tuple[int, ...]:
    """Each DDTree's node count, root included, without its logits: `budget` drafted nodes,
    or every prefix there is when there are fewer (`ranks` candidates per depth, `num_depths`
    depths); -inf log-probs are still selected, and a NaN row raises instead."""
    prefixes, level = 0, 1
    for _ in range(num_depths):
        level *= ranks
        prefixes += level
        if prefixes >= max(budgets, default=0):
            break
    return tuple(1 + min(budget, prefixes) for budget in budgets)


def top_candidates(block_logits: Tensor, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The top `ranks` log-probs (float64) and their tokens (int64) of every [S, D] row, on the host:
    one top-k (`ddtree_kernels.draft_topk`) and one device->host copy (which waits for the draft forward
    behind it)."""
    return _to_host(*top_logprobs(block_logits.detach(), ranks))


def _to_host(values: Tensor, tokens: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probs (as float64) and their tokens (int64) on the host, in one device->host copy."""
    logq, top_tokens = torch.stack((values.double(), tokens.double())).cpu().numpy()  # float64 holds ids exactly
    return logq, top_tokens.astype(np.int64)


def _select_on_device(values: Tensor, tokens: Tensor, roots: np.ndarray, budget: np.ndarray) -> DDTreeSelection:
    """The selection by `ddtree_kernels.ddtree_select` next to the candidates: only the trees come back."""
    given = to_device(np.stack((roots, budget)), values.device)  # one copy; nothing waits for the draft
    selected, parents, num_nodes, scores = select_on_device(values, tokens, given[0], given[1],
                                                            int(budget.max(initial=0)))
    if (num_nodes < 0).any():  # a row with a NaN has NaN log-probs
        raise ValueError(NAN_LOGITS)
    return DDTreeSelection(selected.numpy(), parents.numpy(), num_nodes.numpy(), scores.numpy())


# Up to this many trees, `_trees` links each one's nodes in Python (`DraftTree.from_parents`), below
# the fixed cost of its batched form.
FEW_TREES = 6


def _trees(tokens: np.ndarray, parents: np.ndarray, num_nodes: np.ndarray) -> list[DraftTree]:
    """DraftTrees from per-session [S, N] tokens and parents (node indices), the first num_nodes[s] used."""
    if len(num_nodes) <= FEW_TREES:
        return [DraftTree.from_parents(row_tokens[:n], row_parents[:n])
                for row_tokens, row_parents, n in zip(tokens.tolist(), parents.tolist(), num_nodes.tolist())]
    used = np.arange(tokens.shape[1]) < num_nodes[:, None]
    # One flat array of all trees: parents become flat indices, a root keeps -1.
    offsets = np.cumsum(num_nodes) - num_nodes
    flat_parents = np.where(parents >= 0, parents + offsets[:, None], -1)[used]
    next_token, next_sibling = _retrieve_buffers(flat_parents)
    next_token = np.where(next_token >= 0, next_token - np.repeat(offsets, num_nodes), -1)
    next_sibling = np.where(next_sibling >= 0, next_sibling - np.repeat(offsets, num_nodes), -1)
    sizes = num_nodes.tolist()
    fields = (torch.from_numpy(field).split(sizes) for field in (tokens[used], next_token, next_sibling))
    return [DraftTree(*tree) for tree in zip(*fields)]


def build_ddtree(block_logits: Tensor, root_token: int, budget: int) -> DraftTree:
    """Best-first DDTree of at most `budget` drafted nodes under root `root_token`.

    block_logits: [D, V] draft logits for depths 1..D, any float dtype, any device.
    One session of `build_ddtrees`.
    """
    _check_block_logits(block_logits)
    return build_ddtrees(block_logits[None], [root_token], [budget])[0]


def build_chains(block_logits: Tensor, root_tokens: Sequence[int], lengths: Sequence[int]) -> list[DraftTree]:
    """Vanilla DFlash drafts of S sessions: the argmax token at each depth 1..lengths[s] (at most
    D), as single paths. block_logits [S, D, V]; one argmax and one device-to-host copy."""
    if block_logits.dim() != 3:
        raise ValueError(f"block_logits must be [sessions, depth, vocab], got shape {tuple(block_logits.shape)}")
    argmax = block_logits.argmax(dim=-1).tolist()
    trees = []
    for root, drafted, n in zip(root_tokens, argmax, lengths):
        path = [int(root)] + drafted[: max(0, n)]
        trees.append(DraftTree.from_parents(path, list(range(-1, len(path) - 1))))
    return trees


def build_chain(block_logits: Tensor, root_token: int) -> DraftTree:
    """Vanilla DFlash draft of one session: `build_chains` of block_logits [D, V]."""
    _check_block_logits(block_logits)
    return build_chains(block_logits[None], [root_token], [block_logits.shape[0]])[0]
