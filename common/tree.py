"""Draft trees as they cross the wire, and the verifier-side walk that checks them.

A draft tree has node 0 = the root (the last bonus token) and nodes 1..n = drafted tokens.
On the wire it is three equal-length int arrays in the EAGLE/SGLang retrieve-buffer layout
(`retrieve_index` is the identity, so it is not sent):

    tokens[i]        the token at node i
    next_token[i]    node i's first child, or -1
    next_sibling[i]  node i's next sibling (same parent), or -1

Every link points to a larger node index, so parents precede children. That keeps KV
compaction and masks simple and lets the walk rule out cycles with one comparison per link.

The verifier checks all the trees of a step at once: `walk_trees` validates them and derives
their parents and depths in numpy over all their nodes together (`walk_tree` is the one-tree
form), and `ancestor_masks` builds their padded attention masks in one go.

A drafter in the verifier's process hands over `DeviceTree`s instead: rows of the tensors its
selection left on the device (`DeviceTrees`), never copied to the host on the way. They are
trusted (they never come from the wire), and the verifier derives the same buffers, depths and
masks from their parents on the device (`tree_fields`), so that it can queue a verify behind
the draft step before either has run.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from common.staging import HostCopy


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

    @property
    def root(self) -> int:
        return int(self.tokens[0])

    def token_list(self) -> list[int]:
        """The node tokens as a list (the verifier's commit reads them)."""
        return self.tokens.tolist()

    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        """The tree of a round that drafts nothing: plain decoding of one token."""
        return cls(torch.tensor([int(root)]), torch.tensor([-1]), torch.tensor([-1]))

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
        # (one array for the three: a third of the cost of three tensors made from lists)
        return cls(*torch.from_numpy(np.array([list(tokens), next_token, next_sibling], dtype=np.int64)))


@dataclass(eq=False)
class DeviceTrees:
    """The DDTrees of one drafter step as its selection left them on the device (see
    `drafter_svc.ddtree.select_device_trees`). Trusted: built in this process, never decoded
    from the wire, so the verifier takes them without `walk_trees`.

    `packed` [S, 3 + 3W] int64 holds per tree, as `ddtree_kernels.ddtree_select.select_rows` writes
    it: node tokens (1 + W, root first) | parents (1 + W, -1 for the root) | the selected count
    (root included; -1 where the draft logits held a NaN) | the nodes' path log-probs (W float64
    bit patterns, NaN past the count). Columns past a tree's count are unspecified. A tree's own
    count is `num_nodes[s]`: the selected one, or fewer where the adaptive budget cut it."""

    packed: Tensor
    width: int  # W: nodes selected per tree at most, root excluded
    num_nodes: tuple[int, ...]  # each tree's nodes, root included, known on the host without a copy
    max_depth: int  # no tree is deeper
    host: HostCopy  # `packed` on its way to the host, queued right behind the selection
    _gains: np.ndarray | None = None
    _host: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    _token_lists: list[list[int]] | None = None
    _count_list: list[int] | None = None

    @property
    def tokens(self) -> Tensor:
        return self.packed[:, : 1 + self.width]

    @property
    def parents(self) -> Tensor:
        return self.packed[:, 1 + self.width: 2 + 2 * self.width]

    @property
    def counts(self) -> Tensor:
        return self.packed[:, 2 + 2 * self.width]

    def on(self, device: torch.device) -> DeviceTrees:
        """These trees with `packed` on `device` (self where it is there already): a verifier on
        another device than the draft (a CPU draft in tests) copies them over before placing them."""
        return self if self.packed.device == device else replace(self, packed=self.packed.to(device))

    def on_host(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens, parents, counts, scores) on the host (waits for the copy, once)."""
        if self._host is None:
            packed, w = self.host.wait()[0], self.width
            self._host = (packed[:, : 1 + w], packed[:, 1 + w: 2 + 2 * w], packed[:, 2 + 2 * w],
                          packed.view(torch.float64)[:, 3 + 2 * w:])
            self._token_lists, self._count_list = self._host[0].tolist(), self._host[2].tolist()
        return self._host

    def token_list(self, row: int) -> list[int]:
        """Row `row`'s node tokens, cut to its count, as a list (the verifier's commit reads them)."""
        self.on_host()
        return self._token_lists[row][: self.num_nodes[row]]

    def failed(self, row: int) -> bool:
        """Whether row `row`'s draft logits held a NaN (the verifier then ran it as a root-only tree)."""
        self.on_host()
        return self._count_list[row] < 0

    def tree(self, row: int, root: int) -> DeviceTree:
        return DeviceTree(self, row, root)

    def gains(self) -> np.ndarray:
        """[S, 1 + W]: `expected_gains` of every tree as selected (before a cut), once on the host."""
        if self._gains is None:
            self._gains = expected_gains(self.on_host()[3].numpy())
        return self._gains


def expected_gains(scores: np.ndarray) -> np.ndarray:
    """[S, 1 + W] from the selected nodes' path log-probs [S, W] (NaN: no node): column b is the
    expected number of drafted tokens a tree cut to its first b nodes gets accepted under greedy
    verification, if the draft's probabilities were the target's (the sum of those b nodes'
    path probabilities). The adaptive budget weighs budgets with it (`drafter_svc.budget`)."""
    probs = np.nan_to_num(np.exp(scores), nan=0.0)
    return np.concatenate((np.zeros((probs.shape[0], 1)), np.cumsum(probs, axis=1)), axis=1)


@dataclass(frozen=True, eq=False)
class DeviceTree:
    """Row `row` of `trees`: one session's tree, on the device (see `DeviceTrees`)."""

    trees: DeviceTrees
    row: int
    root: int

    @property
    def num_nodes(self) -> int:
        """Root included."""
        return self.trees.num_nodes[self.row]

    @property
    def max_depth(self) -> int:
        """A bound on its depth (the host does not read the tree itself)."""
        return self.trees.max_depth

    @property
    def gains(self) -> np.ndarray:
        """Its `expected_gains` row as selected (the adaptive budget's prior for the next step)."""
        return self.trees.gains()[self.row]

    @property
    def failed(self) -> bool:
        """Whether its draft logits held a NaN (the verifier then ran it as a root-only tree)."""
        return self.trees.failed(self.row)

    def token_list(self) -> list[int]:
        """The node tokens on the host, as a list (waits for their copy, read out once per step:
        by the verify's end it is done)."""
        return self.trees.token_list(self.row)

    def on_host(self) -> DraftTree:
        """The same tree as retrieve buffers on the host (waits for the copy)."""
        parents = self.trees.on_host()[1]
        return DraftTree.from_parents(self.token_list(), parents[self.row, : self.num_nodes].tolist())


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """What the verifier derives from a valid tree: int64 arrays of shape [1 + n] (numpy: every
    reader, the masks and the verify's staged inputs, works in numpy)."""

    parents: np.ndarray  # parents[0] = -1
    depths: np.ndarray  # depths[0] = 0; a node's position id is past length + depth
    max_depth: int


_INT64_MAX = np.iinfo(np.int64).max


def _int64_vector(values: Tensor, name: str) -> Tensor:
    """`values` as a CPU int64 tensor, once it is checked to be a 1-D integer tensor."""
    if type(values) is Tensor and values.dtype is torch.int64 and values.is_cpu and values.dim() == 1:
        return values  # the usual case, in four cheap checks
    if not isinstance(values, Tensor) or values.dim() != 1:
        raise TreeError(f"{name} must be a 1-D tensor")
    dtype = values.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TreeError(f"{name} must have an integer dtype, got {dtype}")
    if dtype == torch.uint64:  # past int64, values would wrap around (2**64 - 1 to -1, "no link")
        array = values.cpu().numpy()
        too_large = np.flatnonzero(array > _INT64_MAX)
        if too_large.size:
            raise TreeError(f"node {too_large[0]}: {name} {array[too_large[0]]} is out of range (past int64)")
        return torch.from_numpy(array.astype(np.int64))
    return values.to("cpu", torch.int64)


def _checked_buffers(tree: DraftTree, max_nodes: int) -> tuple[Tensor, Tensor, Tensor] | TreeError:
    """The tree's buffers as CPU int64 tensors, or what the per-tree checks (types and sizes,
    ahead of the batched walk) find wrong."""
    try:
        tokens = _int64_vector(tree.tokens, "tokens")
        next_token = _int64_vector(tree.next_token, "next_token")
        next_sibling = _int64_vector(tree.next_sibling, "next_sibling")
    except TreeError as error:
        return error
    num_nodes = tokens.shape[0]
    if next_token.shape[0] != num_nodes or next_sibling.shape[0] != num_nodes:
        return TreeError(
            f"length mismatch: tokens {num_nodes}, next_token {next_token.shape[0]}, "
            f"next_sibling {next_sibling.shape[0]}"
        )
    if num_nodes == 0:
        return TreeError("empty tree: the root node is missing")
    if num_nodes > max_nodes:
        return TreeError(f"{num_nodes} nodes exceed the limit of {max_nodes}")
    return tokens, next_token, next_sibling


def walk_trees(
    trees: Sequence[DraftTree], *, vocab_size: int, max_nodes: int, max_depth: int
) -> list[TreeLayout | TreeError]:
    """Validate a batch of trees that came over the network and derive their parents and depths.

    Each tree gets its TreeLayout, or a TreeError naming its problem and the offending node,
    in its own position: a bad tree never changes another's result. Only the per-tree type
    and size checks loop in Python; the rest runs once over all trees' nodes (numpy), and
    every index is range-checked before it is used.
    """
    checked = [_checked_buffers(tree, max_nodes) for tree in trees]
    passed = [buffers for buffers in checked if isinstance(buffers, tuple)]
    if sum(tokens.shape[0] for tokens, _, _ in passed) <= SMALL_STEP_NODES:
        walked = iter([_walk_small(*buffers, vocab_size=vocab_size, max_depth=max_depth) for buffers in passed])
    else:
        walked = iter(_walk_batch(passed, vocab_size=vocab_size, max_depth=max_depth))
    return [next(walked) if isinstance(buffers, tuple) else buffers for buffers in checked]


# At most this many nodes in all, the trees are walked one by one in Python (`_walk_small`), and
# their masks built so (`ancestor_masks`): below it the batched forms' fixed cost, some sixty and
# some thirty numpy calls, is the larger (about 128 nodes for the walk where both cost the same).
SMALL_STEP_NODES = 96


def _walk_small(tokens: Tensor, next_token: Tensor, next_sibling: Tensor, *, vocab_size: int,
                max_depth: int) -> TreeLayout | TreeError:
    """`_walk_batch` of one tree, node by node in Python: the same rules in the same order, so the
    same result and the same message whichever walk a tree meets."""
    tokens, first_child, sibling = tokens.tolist(), next_token.tolist(), next_sibling.tolist()
    n = len(tokens)
    for field, links in (("next_token", first_child), ("next_sibling", sibling)):
        for i, link in enumerate(links):
            if link != -1 and not i < link < n:
                return TreeError(_link_error(i, field, link, n))
    if sibling[0] != -1:
        return TreeError(f"root node 0 has a sibling (node {sibling[0]})")
    incoming = [0] * n
    for link in first_child + sibling:
        if link != -1:
            incoming[link] += 1
    incoming[0] = 1  # the root's link, from outside the tree
    for i, count in enumerate(incoming):
        if count != 1:
            return TreeError(f"node {i} is reached twice ({count} links point to it)" if count
                             else f"node {i} is not reachable from the root")
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            return TreeError(f"node {i}: token {token} is outside the vocabulary [0, {vocab_size})")
    parents, depths = [-1] * n, [0] * n
    for i in range(n):  # links point forward: node i's parent and depth are known by now
        if (child := first_child[i]) != -1:
            parents[child], depths[child] = i, depths[i] + 1
        if (later := sibling[i]) != -1:
            parents[later], depths[later] = parents[i], depths[i]
    deepest = max(depths)
    if deepest > max_depth:
        i = next(i for i, depth in enumerate(depths) if depth > max_depth)
        return TreeError(f"node {i}: depth {depths[i]} exceeds max_depth {max_depth}")
    seen = set()
    for i in range(1, n):
        key = (parents[i], tokens[i])
        if key in seen:
            return TreeError(f"node {i}: token {tokens[i]} repeats a sibling's token under parent {parents[i]}")
        seen.add(key)
    return TreeLayout(np.array(parents, dtype=np.int64), np.array(depths, dtype=np.int64), deepest)


def _walk_batch(
    buffers: Sequence[tuple[Tensor, Tensor, Tensor]], *, vocab_size: int, max_depth: int
) -> list[TreeLayout | TreeError]:
    """`walk_trees` of trees that passed the per-tree checks, vectorised over all their nodes.

    Nodes are numbered globally: node i of tree b is starts[b] + i. The rules go links first,
    so a tree's parents and depths are only relied on (and reported on) once its links are
    known to form a tree.
    """
    sizes = np.array([tokens.shape[0] for tokens, _, _ in buffers])
    starts = np.cumsum(sizes) - sizes
    flat = torch.cat([values for field in zip(*buffers) for values in field]).numpy().reshape(3, -1)
    tokens, links = flat[0], flat[1:]  # links: next_token, next_sibling
    total = tokens.shape[0]
    index = np.arange(total)
    tree_of = np.repeat(np.arange(len(buffers)), sizes)
    root_of = starts[tree_of]  # each node's root, as a global index
    local = index - root_of
    errors: dict[int, TreeError] = {}

    def first_bad(bad: np.ndarray) -> list[tuple[int, int, int]]:
        """(tree, global node, local node) of the first bad node in each tree without an error
        yet; the caller records one for each."""
        if not np.count_nonzero(bad):
            return []
        if errors:
            failed = np.zeros(len(buffers), dtype=bool)
            failed[list(errors)] = True
            bad = bad & ~failed[tree_of]
        nodes = np.flatnonzero(bad)
        trees = tree_of[nodes]
        first = np.flatnonzero(np.diff(trees, prepend=-1))
        return [
            (tree, node, node - int(starts[tree])) for tree, node in zip(trees[first].tolist(), nodes[first].tolist())
        ]

    # Links are -1 or in range and forward; the root has no sibling.
    linked = (links > local) & (links < sizes[tree_of])
    bad_links = (links != -1) & ~linked
    for row, field in enumerate(("next_token", "next_sibling")):
        for tree, node, i in first_bad(bad_links[row]):
            errors[tree] = TreeError(_link_error(i, field, int(links[row, node]), int(sizes[tree])))
    for tree, node, _ in first_bad((local == 0) & (links[1] != -1)):
        errors[tree] = TreeError(f"root node 0 has a sibling (node {links[1, node]})")

    # Every node but the root has exactly one incoming link. up[c] is the source of c's link
    # (c itself for roots and unreached nodes; any one source where there are several), always
    # smaller than c: following it cannot cycle.
    targets = np.where(linked, root_of + links, total)  # `total`: a spare slot for "no link"
    incoming = np.bincount(targets.ravel(), minlength=total + 1)[:total]
    incoming[starts] = 1  # the root's from outside the tree
    for tree, node, i in first_bad(incoming != 1):
        errors[tree] = TreeError(
            f"node {i} is reached twice ({incoming[node]} links point to it)"
            if incoming[node]
            else f"node {i} is not reachable from the root"
        )
    up = np.arange(total + 1)
    up[targets[0]] = index
    up[targets[1]] = index
    via_child = np.zeros(total + 1, dtype=bool)
    via_child[targets[0]] = True
    up, via_child = up[:total], via_child[:total]

    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    for tree, node, i in first_bad(~in_vocab):
        errors[tree] = TreeError(f"node {i}: token {tokens[node]} is outside the vocabulary [0, {vocab_size})")

    # Pointer jumping, 2**rounds steps at least as long as any path (n - 1 links): a node's
    # parent is the up of the first sibling in its chain, and its depth counts the parents above.
    rounds = max(int(sizes.max()) - 2, 0).bit_length()
    first_sibling = np.where(via_child, index, up)
    for _ in range(rounds):
        first_sibling = first_sibling[first_sibling]
    has_parent = via_child[first_sibling]
    parent = np.where(has_parent, up[first_sibling], index)
    depth, above = has_parent.astype(np.int64), parent
    for _ in range(rounds):
        depth += depth[above]
        above = above[above]
    for tree, node, i in first_bad(depth > max_depth):
        errors[tree] = TreeError(f"node {i}: depth {depth[node]} exceeds max_depth {max_depth}")

    # Siblings carry distinct tokens: no (parent, token) key twice. Roots and bad tokens get
    # distinct negative keys; the others fit int64 while total * vocab_size does.
    parents = np.where(has_parent, parent - root_of, -1)
    key = np.where(has_parent & in_vocab, parent * vocab_size + tokens, -1 - index)
    order = np.argsort(key, kind="stable")
    sorted_keys = key[order]
    repeats = np.zeros(total, dtype=bool)
    repeats[order[1:][sorted_keys[1:] == sorted_keys[:-1]]] = True  # stable: marks the later node
    for tree, node, i in first_bad(repeats):
        errors[tree] = TreeError(
            f"node {i}: token {tokens[node]} repeats a sibling's token under parent {parents[node]}"
        )

    # Each tree's rows as slices (np.split costs several times as much per tree).
    bounds = starts.tolist() + [total]
    max_depths = np.maximum.reduceat(depth, starts).tolist()
    results: list[TreeLayout | TreeError] = [TreeLayout(parents[a:b], depth[a:b], m)
                                             for a, b, m in zip(bounds, bounds[1:], max_depths)]
    for tree, error in errors.items():
        results[tree] = error
    return results


def _link_error(node: int, field: str, target: int, num_nodes: int) -> str:
    if not -1 <= target < num_nodes:
        return f"node {node}: {field} {target} is out of range [-1, {num_nodes - 1}]"
    return (
        f"node {node}: {field} {target} does not point forward "
        "(links must go to a larger index: parents precede children, no cycles)"
    )


def walk_tree(tree: DraftTree, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeLayout:
    """`walk_trees` of one tree; raises its TreeError."""
    result = walk_trees([tree], vocab_size=vocab_size, max_nodes=max_nodes, max_depth=max_depth)[0]
    if isinstance(result, TreeError):
        raise result
    return result


def ancestor_masks(layouts: Sequence[TreeLayout], width: int) -> Tensor:
    """Bool [B, width, width]: mask[b, i, j] is True when node j of tree b is node i or one of
    its ancestors. Rows and columns past a tree's nodes are padding that sees only itself, so
    in a padded forward no node sees padding and padding sees no node.

    On the host (numpy). Up to SMALL_STEP_NODES nodes in all, tree by tree, each row from its
    parent's; past it level by level, every tree at once: in step d each node at depth >= d
    marks its d-th ancestor, so the work is the sum of the depths, plus a few array operations
    per level of the deepest tree.
    """
    sizes = np.array([layout.parents.shape[0] for layout in layouts], dtype=np.int64)
    if (sizes > width).any():
        raise ValueError(f"a tree of {sizes.max()} nodes does not fit masks of width {width}")
    masks = np.zeros((len(layouts), width, width), dtype=bool)
    masks.reshape(len(layouts), width * width)[:, :: width + 1] = True  # the diagonals
    if sizes.sum() <= SMALL_STEP_NODES:
        # Tree by tree: each node's row as the bits of an int (its parent's, and its own), in node
        # order (a parent comes first), then unpacked into the rows at once.
        row_bytes = (width + 7) // 8
        for b, layout in enumerate(layouts):
            rows: list[int] = []
            for i, parent in enumerate(layout.parents.tolist()):
                rows.append((rows[parent] if parent >= 0 else 0) | 1 << i)
            bits = np.frombuffer(b"".join(row.to_bytes(row_bytes, "little") for row in rows), dtype=np.uint8)
            masks[b, : len(rows)] = np.unpackbits(bits.reshape(len(rows), row_bytes), axis=1, count=width,
                                                  bitorder="little")
    else:
        # Nodes are numbered globally (node i of a tree is start + i) and `up` maps them to their
        # parents. A node's `row` is its row in the masks seen as [B * width, width], and its
        # cell plus a global node index is the flat index of that node's column in this row.
        parent = np.concatenate([layout.parents for layout in layouts])
        depth = np.concatenate([layout.depths for layout in layouts])
        start = np.repeat(np.cumsum(sizes) - sizes, sizes)
        row = np.repeat(np.arange(len(layouts)) * width, sizes) + np.arange(parent.shape[0]) - start
        up = parent + start
        deepest_first = np.argsort(-depth, kind="stable")  # stable: the faster kind for few distinct keys
        cell = (row * width - start)[deepest_first]
        at_least = np.cumsum(np.bincount(depth)[::-1])[::-1]  # how many nodes have depth >= d
        cells = masks.reshape(-1)
        ancestor = deepest_first
        for count in at_least[1:].tolist():
            ancestor = up[ancestor[:count]]
            cells[cell[:count] + ancestor] = True
    return torch.from_numpy(masks)


def tree_fields(parents: Tensor, counts: Tensor, max_depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the verifier needs of R trusted trees, on their device: (next_token, next_sibling,
    depths) int64 [R, W] and the ancestor masks bool [R, W, W], as `DraftTree.from_parents`,
    `walk_trees` and `ancestor_masks` give them for the same trees.

    parents [R, W] int64 (node indices, -1 for the root), counts [R] nodes per tree (clamped to
    [1, W]), max_depth a bound on the trees' depths. Nodes past a tree's count are padding: no
    links, depth 0, seeing only themselves. A few whole-batch operations and
    ceil(log2(max_depth)) rounds of pointer jumping, whatever R; no host copy.
    """
    rows, width = parents.shape
    node = torch.arange(width, device=parents.device)
    valid = node < counts.clamp(1, width)[:, None]
    linked = valid & (node > 0)
    up = torch.where(linked, parents.clamp(0, width - 1), node)  # the root and padding point at themselves
    masks = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(rows, 1, 1)
    masks.scatter_(2, up[:, :, None], True)
    jump = up
    for _ in range(max(max_depth - 1, 0).bit_length()):  # masks[i] holds i's ancestors up to 2**k above
        masks |= torch.gather(masks, 1, jump[:, :, None].expand(rows, width, width))
        jump = torch.gather(jump, 1, jump)
    depths = masks.sum(-1) - 1
    none = torch.full_like(parents, width)

    def first(links: Tensor) -> Tensor:  # [R, W, W] bool -> the smallest linked column, or -1
        found = torch.where(links, node, none[:, :, None]).amin(-1)
        return torch.where(found < width, found, -1)

    child = (up[:, None, :] == node[None, :, None]) & linked[:, None, :]  # [r, p, c]: c is a child of p
    sibling = ((up[:, None, :] == up[:, :, None]) & (node[None, None, :] > node[None, :, None])
               & linked[:, None, :] & linked[:, :, None])  # [r, c, c2]: c2 a later sibling of c
    return first(child), first(sibling), depths, masks


def ancestor_mask(parents: np.ndarray, depths: np.ndarray) -> Tensor:
    """Bool [1+n, 1+n]: mask[i, j] is True when node j is node i or one of its ancestors
    (`ancestor_masks` of one tree)."""
    layout = TreeLayout(parents=parents, depths=depths, max_depth=int(depths.max()))
    return ancestor_masks([layout], parents.shape[0])[0]


def ancestor_mask_reference(parents: np.ndarray | Tensor, depths: np.ndarray | Tensor) -> Tensor:
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
    return torch.tensor(rows, dtype=torch.bool)
