"""DDTree: turn one DFlash block of draft logits into a draft tree under a node budget.

The DFlash draft gives one distribution q_d per depth d = 1..D (D = block_size - 1).
A path that takes the token of rank r_i at each depth i scores sum_i log q_i(rank r_i).
Best-first search over that score picks the `budget` best prefixes; because a prefix
scores at least as much as its extensions, and rank r at least as much as rank r + 1,
the result is always a valid tree (prefix-closed, parents before children).

Tie-break: candidates are ordered by the key (-score, depth, rank tuple), i.e. the
higher cumulative log-prob first; on equal scores the shallower candidate first; on
equal depth the lexicographically smaller tuple of per-depth ranks first. The key is
unique per candidate, so the tree is fully deterministic.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from common.tree import DraftTree


@dataclass(frozen=True, eq=False)
class ScoredTree:
    """A built tree plus the per-node facts the builder knows (index 0 = root)."""

    tree: DraftTree
    parents: list[int]  # parents[0] = -1
    scores: list[float]  # cumulative log-prob of the path to the node; scores[0] = 0.0
    ranks: list[tuple[int, ...]]  # per-depth ranks of that path; ranks[0] = ()

    @property
    def depths(self) -> list[int]:
        return [len(path) for path in self.ranks]


def _check_block_logits(block_logits: Tensor) -> None:
    if block_logits.dim() != 2:
        raise ValueError(f"block_logits must be [depth, vocab], got shape {tuple(block_logits.shape)}")


def build_ddtree_with_scores(block_logits: Tensor, root_token: int, budget: int) -> ScoredTree:
    """Build the DDTree (see `build_ddtree`) and keep each node's parent, score and ranks."""
    _check_block_logits(block_logits)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    num_depths, vocab_size = block_logits.shape
    k = min(budget, vocab_size)

    tokens, parents, scores, ranks = [int(root_token)], [-1], [0.0], [()]
    if k > 0 and num_depths > 0:
        top = torch.topk(torch.log_softmax(block_logits.float(), dim=-1), k, dim=-1)
        # One device->host copy for both; float64 holds token ids exactly.
        top_logq, top_tokens = torch.stack((top.values.double(), top.indices.double())).tolist()
        if any(math.isnan(row[0]) for row in top_logq):  # topk ranks NaN first
            raise ValueError("block_logits contain NaN (or a row that is all -inf)")

        # Heap entries: (-score, depth, rank tuple, parent node); the first three are the
        # documented ordering key, and they are unique, so `parent` is never compared.
        heap = [(-top_logq[0][0], 1, (0,), 0)]
        while heap and len(tokens) <= budget:
            neg_score, depth, path_ranks, parent = heapq.heappop(heap)
            node, rank, score = len(tokens), path_ranks[-1], -neg_score
            tokens.append(int(top_tokens[depth - 1][rank]))
            parents.append(parent)
            scores.append(score)
            ranks.append(path_ranks)
            if rank + 1 < k:
                sibling_score = scores[parent] + top_logq[depth - 1][rank + 1]
                heapq.heappush(heap, (-sibling_score, depth, path_ranks[:-1] + (rank + 1,), parent))
            if depth < num_depths:
                child_score = score + top_logq[depth][0]
                heapq.heappush(heap, (-child_score, depth + 1, path_ranks + (0,), node))

    # Node index = pop order, so each parent's children are already in descending score.
    return ScoredTree(DraftTree.from_parents(tokens, parents), parents, scores, ranks)


def build_ddtree(block_logits: Tensor, root_token: int, budget: int) -> DraftTree:
    """Best-first DDTree of at most `budget` drafted nodes under root `root_token`.

    block_logits: [D, V] draft logits for depths 1..D, any float dtype, any device.
    Per depth the top K = min(budget, V) tokens of log_softmax are the candidates.
    Siblings come out in descending cumulative log-prob; budget 0 gives the root only.
    """
    return build_ddtree_with_scores(block_logits, root_token, budget).tree


def build_chain(block_logits: Tensor, root_token: int) -> DraftTree:
    """Vanilla DFlash draft: the argmax token at each depth 1..D, as a single path."""
    _check_block_logits(block_logits)
    tokens = [int(root_token)] + block_logits.argmax(dim=-1).tolist()
    return DraftTree.from_parents(tokens, list(range(-1, len(tokens) - 1)))
