"""Draft trees as they cross the wire, and the verifier-side walk that checks them.

A draft tree has node 0 = the root (the last bonus token) and nodes 1..n = drafted tokens.
On the wire it is three equal-length int arrays in the EAGLE/SGLang retrieve-buffer layout
(`retrieve_index` is the identity, so it is not sent):

    tokens[i]        the token at node i
    next_token[i]    node i's first child, or -1
    next_sibling[i]  node i's next sibling (same parent), or -1

Every link points to a larger node index, so parents precede children. That keeps KV
compaction and masks simple and lets `walk_tree` rule out cycles with one comparison.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class TreeError(ValueError):
    """A draft tree is malformed (bad sizes, links, depths or tokens)."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors with == is ambiguous
class DraftTree:
    """The retrieve buffers of one draft tree: int64 tensors of shape [1 + n]."""

    tokens: Tensor
    next_token: Tensor
    next_sibling: Tensor

    @property
    def num_nodes(self) -> int:
        """Root included."""
        return self.tokens.shape[0]

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """Compile a parent array (parents[0] = -1, parents[i] < i) into retrieve buffers.

        Each parent's children are linked in node-index order: the first becomes its
        `next_token`, the later ones follow through `next_sibling`.
        """
        num_nodes = len(tokens)
        if num_nodes == 0 or len(parents) != num_nodes or parents[0] != -1:
            raise TreeError(
                f"need as many parents as tokens (got {len(parents)} and {num_nodes}), "
                "at least one node, and parents[0] == -1"
            )
        next_token = [-1] * num_nodes
        next_sibling = [-1] * num_nodes
        last_child = [-1] * num_nodes
        for node in range(1, num_nodes):
            parent = parents[node]
            if not 0 <= parent < node:
                raise TreeError(f"node {node}: parent {parent} must be in [0, {node})")
            if last_child[parent] == -1:
                next_token[parent] = node
            else:
                next_sibling[last_child[parent]] = node
            last_child[parent] = node
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.int64),
            next_token=torch.tensor(next_token, dtype=torch.int64),
            next_sibling=torch.tensor(next_sibling, dtype=torch.int64),
        )


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """What the verifier derives from a valid tree: int64 tensors of shape [1 + n]."""

    parents: Tensor  # parents[0] = -1
    depths: Tensor  # depths[0] = 0; a node's position id is past length + depth
    max_depth: int


def _int_list(values: Tensor, name: str) -> list[int]:
    if not isinstance(values, Tensor) or values.dim() != 1:
        raise TreeError(f"{name} must be a 1-D tensor")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TreeError(f"{name} must have an integer dtype, got {values.dtype}")
    return values.tolist()


def walk_tree(tree: DraftTree, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeLayout:
    """Validate a tree that came over the network and derive its parents and depths.

    Raises TreeError naming the problem and the offending node. O(n) in plain Python,
    and every index is range-checked before it is used.
    """
    tokens = _int_list(tree.tokens, "tokens")
    next_token = _int_list(tree.next_token, "next_token")
    next_sibling = _int_list(tree.next_sibling, "next_sibling")

    num_nodes = len(tokens)
    if len(next_token) != num_nodes or len(next_sibling) != num_nodes:
        raise TreeError(
            f"length mismatch: tokens {num_nodes}, next_token {len(next_token)}, "
            f"next_sibling {len(next_sibling)}"
        )
    if num_nodes == 0:
        raise TreeError("empty tree: the root node is missing")
    if num_nodes > max_nodes:
        raise TreeError(f"{num_nodes} nodes exceed the limit of {max_nodes}")
    for field, links in (("next_token", next_token), ("next_sibling", next_sibling)):
        for node, target in enumerate(links):
            if not -1 <= target < num_nodes:
                raise TreeError(f"node {node}: {field} {target} is out of range [-1, {num_nodes - 1}]")
            if target != -1 and target <= node:
                raise TreeError(
                    f"node {node}: {field} {target} does not point forward "
                    "(links must go to a larger index: parents precede children, no cycles)"
                )
    if next_sibling[0] != -1:
        raise TreeError(f"root node 0 has a sibling (node {next_sibling[0]})")

    unseen = -2
    parents = [unseen] * num_nodes
    depths = [0] * num_nodes
    parents[0] = -1

    def attach(source: int, field: str, target: int, parent: int, depth: int) -> None:
        if target == -1:
            return
        if parents[target] != unseen:
            raise TreeError(f"node {target} is reached twice (again as {field} of node {source})")
        if depth > max_depth:
            raise TreeError(f"node {target}: depth {depth} exceeds max_depth {max_depth}")
        parents[target] = parent
        depths[target] = depth

    # Links only point forward, so by the time we reach a node everything that could
    # point to it has been seen: a node still unseen here is unreachable.
    sibling_tokens: set[tuple[int, int]] = set()
    for node in range(num_nodes):
        parent = parents[node]
        if parent == unseen:
            raise TreeError(f"node {node} is not reachable from the root")
        token = tokens[node]
        if not 0 <= token < vocab_size:
            raise TreeError(f"node {node}: token {token} is outside the vocabulary [0, {vocab_size})")
        if node > 0:
            if (parent, token) in sibling_tokens:
                raise TreeError(f"node {node}: token {token} repeats a sibling's token under parent {parent}")
            sibling_tokens.add((parent, token))
        attach(node, "next_token", next_token[node], node, depths[node] + 1)
        attach(node, "next_sibling", next_sibling[node], parent, depths[node])

    device = tree.tokens.device
    return TreeLayout(
        parents=torch.tensor(parents, dtype=torch.int64, device=device),
        depths=torch.tensor(depths, dtype=torch.int64, device=device),
        max_depth=max(depths),
    )


def ancestor_mask(parents: Tensor, depths: Tensor) -> Tensor:
    """Bool [1+n, 1+n]: mask[i, j] is True when node j is node i or one of its ancestors.

    Level by level on the host (numpy): the rows of depth d are their parents' rows plus
    themselves, so max_depth row-gathers build the whole mask (tens of microseconds for
    the trees a verifier sees; small tensor ops would cost ten times more).
    """
    parent = parents.cpu().numpy()
    depth = depths.cpu().numpy()
    mask = np.eye(parent.shape[0], dtype=bool)
    order = np.argsort(depth, kind="stable")
    starts = np.searchsorted(depth[order], np.arange(1, int(depth.max()) + 2))
    for lo, hi in zip(starts[:-1], starts[1:]):
        rows = order[lo:hi]
        mask[rows] |= mask[parent[rows]]
    return torch.from_numpy(mask).to(parents.device)


def ancestor_mask_reference(parents: Tensor, depths: Tensor) -> Tensor:
    """Per-node reference for `ancestor_mask`: from every node, step up depth + 1 times."""
    parent_list = parents.tolist()
    depth_list = depths.tolist()
    num_nodes = len(parent_list)
    rows = [[False] * num_nodes for _ in range(num_nodes)]
    for node in range(num_nodes):
        ancestor = node
        for _ in range(depth_list[node] + 1):
            rows[node][ancestor] = True
            ancestor = parent_list[ancestor]
    return torch.tensor(rows, dtype=torch.bool, device=parents.device)
