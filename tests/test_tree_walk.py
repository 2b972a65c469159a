"""Batched tree walk and masks (`walk_trees`, `ancestor_masks`) against plain per-node references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from common.tree import (
    SMALL_STEP_NODES,
    DraftTree,
    TreeError,
    TreeLayout,
    ancestor_mask_reference,
    ancestor_masks,
    walk_tree,
    _checked_buffers,
    _walk_batch,
    _walk_small,
    walk_trees,
)
from tests.reference import distinct_sibling_tokens

LIMITS = {"vocab_size": 50, "max_nodes": 128, "max_depth": 100}
FIELDS = ("tokens", "next_token", "next_sibling")


def _int_list(values: Tensor, name: str) -> list[int]:
    if not isinstance(values, Tensor) or values.dim() != 1:
        raise TreeError(f"{name} must be a 1-D tensor")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TreeError(f"{name} must have an integer dtype, got {values.dtype}")
    return values.tolist()


def walk_tree_reference(tree: DraftTree, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeLayout:
    """The plain per-node walk that `walk_trees` vectorises: one Python loop in node order."""
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
                raise TreeError(f"node {node}: {field} {target} does not point forward")
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

    # Links only point forward, so a node still unseen when the loop reaches it is unreachable.
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

    return TreeLayout(
        parents=np.array(parents, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        max_depth=max(depths),
    )


def reference_outcome(tree: DraftTree, limits: dict) -> TreeLayout | TreeError:
    try:
        return walk_tree_reference(tree, **limits)
    except TreeError as error:
        return error


def assert_same_layout(layout: TreeLayout | TreeError, expected: TreeLayout) -> None:
    assert isinstance(layout, TreeLayout), f"valid tree rejected: {layout}"
    assert layout.parents.dtype == np.int64 and layout.depths.dtype == np.int64
    assert layout.parents.tolist() == expected.parents.tolist()
    assert layout.depths.tolist() == expected.depths.tolist()
    assert layout.max_depth == expected.max_depth


# ----------------------------------------------------------------------------- trees


def random_parents(rng: np.random.Generator, num_nodes: int) -> list[int]:
    """A random valid parent array; `window` near 1 gives deep trees, large gives bushy ones."""
    window = int(rng.choice([1, 2, 4, num_nodes]))
    return [-1] + [int(rng.integers(max(0, node - window), node)) for node in range(1, num_nodes)]


def random_tree(rng: np.random.Generator, num_nodes: int, parents: list[int] | None = None) -> DraftTree:
    parents = random_parents(rng, num_nodes) if parents is None else parents
    return DraftTree.from_parents(distinct_sibling_tokens(rng, parents, LIMITS["vocab_size"]), parents)


def random_sizes(rng: np.random.Generator, count: int) -> list[int]:
    """Mixed sizes from the root alone up to 100 nodes, small ones more often."""
    return [int(rng.choice([1, 2, rng.integers(3, 18), rng.integers(18, 101)])) for _ in range(count)]


def with_fields(tree: DraftTree, dtype: torch.dtype = torch.int64, **fields) -> DraftTree:
    """`tree` with some buffers replaced: lists and the buffers kept become `dtype` tensors,
    tensors are taken as they are."""
    values = {name: fields.get(name, getattr(tree, name)) for name in FIELDS}
    return DraftTree(
        *(v if isinstance(v, Tensor) and name in fields else torch.as_tensor(v).to(dtype) for name, v in values.items())
    )


def links_of(tree: DraftTree) -> list[tuple[str, int, int]]:
    """(field, node, target) of every link."""
    return [
        (field, node, target)
        for field in ("next_token", "next_sibling")
        for node, target in enumerate(getattr(tree, field).tolist())
        if target != -1
    ]


def sibling_pairs(tree: DraftTree) -> list[tuple[int, int]]:
    """(earlier, later) siblings, from the sibling links."""
    return [(node, target) for field, node, target in links_of(tree) if field == "next_sibling"]


KINDS = {  # kind of malformed tree -> what its error says
    "length": "length mismatch",
    "empty": "empty tree",
    "too_many": "exceed the limit",
    "not_1d": "must be a 1-D tensor",
    "dtype": "must have an integer dtype",
    "link_range": "is out of range",
    "uint64": "is out of range",
    "link_backward": "does not point forward",
    "root_sibling": "root node 0 has a sibling",
    "reached_twice": "is reached twice",
    "unreachable": "is not reachable",
    "too_deep": "exceeds max_depth",
    "token_range": "is outside the vocabulary",
    "repeated_sibling_token": "repeats a sibling's token",
}


def corrupted(kind: str, rng: np.random.Generator) -> DraftTree:
    """A random tree that breaks the one rule `kind` names, under LIMITS."""
    n = int(rng.integers(3, 101))
    tree = random_tree(rng, n)
    field = str(rng.choice(FIELDS))
    link_field = str(rng.choice(["next_token", "next_sibling"]))
    links = getattr(tree, link_field).tolist()
    node = int(rng.integers(n))
    if kind == "length":
        values = getattr(tree, field).tolist()
        return with_fields(tree, **{field: values + [-1] if rng.random() < 0.5 else values[:-1]})
    if kind == "empty":
        return with_fields(tree, tokens=[], next_token=[], next_sibling=[])
    if kind == "too_many":
        return random_tree(rng, LIMITS["max_nodes"] + int(rng.integers(1, 5)))
    if kind == "not_1d":
        return with_fields(tree, **{field: getattr(tree, field)[None]})
    if kind == "dtype":
        return with_fields(tree, **{field: getattr(tree, field).to(rng.choice([torch.float32, torch.bool]))})
    if kind == "link_range":
        links[node] = int(rng.choice([-2, -7, n, n + 5]))
        return with_fields(tree, **{link_field: links})
    if kind == "uint64":  # every -1 wraps to 2**64 - 1, which must not read as -1 again
        return DraftTree(*(torch.from_numpy(getattr(tree, f).numpy().astype(np.uint64)) for f in FIELDS))
    if kind == "link_backward":
        links[node] = int(rng.integers(node + 1))  # itself or an earlier node
        return with_fields(tree, **{link_field: links})
    if kind == "root_sibling":
        next_sibling = tree.next_sibling.tolist()
        next_sibling[0] = int(rng.integers(1, n))
        return with_fields(tree, next_sibling=next_sibling)
    if kind == "reached_twice":  # a spare link (-1, not the root's sibling) to a node already reached
        spare = [(f, i) for f in ("next_token", "next_sibling") for i in range(n - 1)
                 if getattr(tree, f)[i] == -1 and (f == "next_token" or i > 0)]
        f, i = spare[int(rng.integers(len(spare)))]
        links = getattr(tree, f).tolist()
        links[i] = int(rng.integers(i + 1, n))
        return with_fields(tree, **{f: links})
    if kind == "unreachable":
        edges = links_of(tree)
        f, i, _ = edges[int(rng.integers(len(edges)))]
        links = getattr(tree, f).tolist()
        links[i] = -1
        return with_fields(tree, **{f: links})
    if kind == "too_deep":
        chain = int(rng.integers(LIMITS["max_depth"] + 2, LIMITS["max_nodes"] + 1))
        return random_tree(rng, chain, parents=list(range(-1, chain - 1)))
    if kind == "token_range":
        tokens = tree.tokens.tolist()
        tokens[node] = int(rng.choice([-1, LIMITS["vocab_size"], LIMITS["vocab_size"] + 9, -(2**62), 2**62]))
        return with_fields(tree, tokens=tokens)
    if kind == "repeated_sibling_token":
        tree = random_tree(rng, n, parents=[-1, 0, 0] + random_parents(rng, n)[3:])  # the root has two children
        pairs = sibling_pairs(tree)
        earlier, later = pairs[int(rng.integers(len(pairs)))]
        tokens = tree.tokens.tolist()
        if rng.random() < 0.5:
            tokens[later] = tokens[earlier]
        else:
            tokens[earlier] = tokens[later]
        return with_fields(tree, tokens=tokens)
    raise AssertionError(kind)


def randomly_corrupted(rng: np.random.Generator, tree: DraftTree) -> DraftTree:
    """`tree` with one to three buffer entries set to random values near the valid range (the
    result may happen to be valid)."""
    fields = {name: getattr(tree, name).tolist() for name in FIELDS}
    num_nodes = tree.num_nodes
    for _ in range(int(rng.integers(1, 4))):
        name = str(rng.choice(FIELDS))
        high = LIMITS["vocab_size"] if name == "tokens" else num_nodes
        fields[name][int(rng.integers(num_nodes))] = int(rng.integers(-3, high + 3))
    return with_fields(tree, **fields)


# The checks that come first (types, sizes, links) go in the same order in both walks, so
# both name the same first problem. uint64 buffers are the exception: walk_trees refuses
# values past int64 before the link checks.
FIRST_CHECKS = (
    "must be a 1-D tensor",
    "must have an integer dtype",
    "length mismatch",
    "empty tree",
    "exceed the limit",
    "is out of range",
    "does not point forward",
    "root node 0 has a sibling",
)


def check_against_reference(trees: list[DraftTree], limits: dict) -> list[TreeLayout | TreeError]:
    """walk_trees accepts exactly the trees the reference accepts, with the same layouts, and
    each tree's result is the same as when it is walked alone."""
    results = walk_trees(trees, **limits)
    assert len(results) == len(trees)
    for position, (tree, result) in enumerate(zip(trees, results)):
        expected = reference_outcome(tree, limits)
        alone = walk_trees([tree], **limits)[0]
        if isinstance(expected, TreeError):
            assert isinstance(result, TreeError), f"tree {position} accepted; the reference says: {expected}"
            assert "\n" not in str(result)
            assert isinstance(alone, TreeError) and str(alone) == str(result)
            if any(check in str(expected) for check in FIRST_CHECKS) and tree.tokens.dtype != torch.uint64:
                assert str(result).startswith(str(expected)), f"tree {position}"
        else:
            assert_same_layout(result, expected)
            assert_same_layout(alone, expected)
    return results


# ----------------------------------------------------------------------------- walk_trees


@pytest.mark.parametrize("seed", range(10))
def test_valid_trees_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n) for n in [1, 100, 1] + random_sizes(rng, 40)]
    dtypes = [torch.int64, torch.int32, torch.int16, torch.int8]
    trees = [with_fields(tree, dtypes[int(rng.integers(len(dtypes)))]) for tree in trees]
    results = check_against_reference(trees, LIMITS)
    assert all(isinstance(result, TreeLayout) for result in results)


def test_large_trees_share_a_batch_with_small_ones():
    rng = np.random.default_rng(0)
    n = 1024
    chain = DraftTree.from_parents([1] * n, list(range(-1, n - 1)))
    wide = DraftTree.from_parents(list(range(n)), [-1] + [0] * (n - 1))
    trees = [random_tree(rng, size) for size in (1, 17, 65)]
    limits = {"vocab_size": n, "max_nodes": n, "max_depth": n - 1}
    results = check_against_reference([chain, *trees, wide], limits)
    assert results[0].max_depth == n - 1 and results[-1].max_depth == 1


def test_empty_batch():
    assert walk_trees([], **LIMITS) == []


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_malformed_tree_is_rejected_among_valid_ones(kind):
    rng = np.random.default_rng(list(KINDS).index(kind))
    trees, bad = [], []
    for _ in range(30):
        if rng.random() < 0.5:
            bad.append(len(trees))
            trees.append(corrupted(kind, rng))
        else:
            trees.append(random_tree(rng, random_sizes(rng, 1)[0]))
    results = check_against_reference(trees, LIMITS)
    assert bad
    for position, result in enumerate(results):
        if position in bad:
            assert KINDS[kind] in str(result), f"tree {position}: {result}"
        else:
            assert isinstance(result, TreeLayout)


def some_corrupted(rng: np.random.Generator, sizes: list[int], kinds, broken: float) -> list[DraftTree]:
    """Random trees of these sizes: 40% with random entries spoiled (`randomly_corrupted`), a
    `broken` share more breaking one of the rules in `kinds` (`corrupted`), the rest valid."""
    trees = []
    for size in sizes:
        tree = random_tree(rng, size)
        roll = rng.random()
        if roll < 0.4:
            tree = randomly_corrupted(rng, tree)
        elif roll < 0.4 + broken:
            tree = corrupted(str(rng.choice(list(kinds))), rng)
        trees.append(tree)
    return trees


@pytest.mark.parametrize("seed", range(40))
def test_random_corruptions_are_rejected_exactly_when_the_reference_rejects(seed):
    rng = np.random.default_rng(1000 + seed)
    trees = [with_fields(tree, torch.int32) if rng.random() < 0.2 else tree
             for tree in some_corrupted(rng, random_sizes(rng, 30), KINDS, 0.15)]
    limits = {**LIMITS, "max_depth": int(rng.integers(1, 101))}  # now and then deep valid trees fail
    results = check_against_reference(trees, limits)
    assert any(isinstance(result, TreeError) for result in results)
    assert any(isinstance(result, TreeLayout) for result in results)


@pytest.mark.parametrize("seed", range(20))
def test_the_one_by_one_walk_equals_the_batched_walk(seed):
    """Small steps walk their trees one by one (`_walk_small`), larger ones in one batch
    (`_walk_batch`): every tree, valid or not, gets the same layout or the same message from both."""
    rng = np.random.default_rng(2000 + seed)
    limits = {"vocab_size": LIMITS["vocab_size"], "max_depth": int(rng.integers(1, 101))}
    walked = [k for k in KINDS if k not in ("length", "empty", "too_many", "not_1d", "dtype", "uint64")]
    checked = [_checked_buffers(tree, LIMITS["max_nodes"]) for tree in some_corrupted(rng, random_sizes(rng, 40),
                                                                                       walked, 0.3)]
    buffers = [c for c in checked if isinstance(c, tuple)]  # those that reach a walk
    batched = _walk_batch(buffers, **limits)
    kinds = set()
    for tree_buffers, together in zip(buffers, batched):
        alone = _walk_small(*tree_buffers, **limits)
        kinds.add(type(alone))
        if isinstance(together, TreeError):
            assert isinstance(alone, TreeError) and str(alone) == str(together)
        else:
            assert_same_layout(alone, together)
    assert kinds == {TreeError, TreeLayout}


def test_small_steps_take_the_one_by_one_walk(monkeypatch):
    """Up to SMALL_STEP_NODES nodes in all, walk_trees walks tree by tree; past it, in one batch."""
    import common.tree as tree_module

    calls = []
    monkeypatch.setattr(tree_module, "_walk_batch", lambda buffers, **kw: calls.append(len(buffers)) or [
        TreeError("batched")] * len(buffers))
    rng = np.random.default_rng(0)
    small = [random_tree(rng, 16) for _ in range(SMALL_STEP_NODES // 16)]
    assert all(isinstance(r, TreeLayout) for r in walk_trees(small, **LIMITS)) and not calls
    assert [str(r) for r in walk_trees(small + [random_tree(rng, 1)], **LIMITS)] == ["batched"] * (len(small) + 1)
    assert calls == [len(small) + 1]


def test_each_tree_names_its_first_bad_node_for_the_rule_it_breaks():
    rng = np.random.default_rng(0)
    bad_tokens = random_tree(rng, 40)
    tokens = bad_tokens.tokens.tolist()
    tokens[7], tokens[30] = -1, LIMITS["vocab_size"]
    bad_tokens = with_fields(bad_tokens, tokens=tokens)

    chain = random_tree(rng, 10, parents=list(range(-1, 9)))
    next_token = chain.next_token.tolist()
    next_token[2] = next_token[6] = -1  # cuts off nodes 3 and 7
    unreachable = with_fields(chain, next_token=next_token)

    too_deep = random_tree(rng, 110, parents=list(range(-1, 109)))  # nodes 101.. are too deep

    repeats = DraftTree.from_parents([9, 5, 6, 5, 6], [-1, 0, 0, 0, 0])

    reached_twice = DraftTree.from_parents([9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 3, 4])
    next_sibling = reached_twice.next_sibling.tolist()
    next_sibling[3], next_sibling[5] = 4, 6  # nodes 4 and 6 get a second link
    reached_twice = with_fields(reached_twice, next_sibling=next_sibling)

    trees = [bad_tokens, random_tree(rng, 30), unreachable, too_deep, random_tree(rng, 5), repeats, reached_twice]
    results = check_against_reference(trees, LIMITS)
    expected = [
        "node 7: token -1 is outside the vocabulary",
        None,
        "node 3 is not reachable",
        "node 101: depth 101 exceeds max_depth 100",
        None,
        "node 3: token 5 repeats a sibling's token under parent 0",
        "node 4 is reached twice",
    ]
    for result, message in zip(results, expected):
        if message is None:
            assert isinstance(result, TreeLayout)
        else:
            assert str(result).startswith(message), str(result)


def test_walk_tree_raises_the_error_of_its_one_tree():
    tree = corrupted("unreachable", np.random.default_rng(0))
    with pytest.raises(TreeError, match="is not reachable"):
        walk_tree(tree, **LIMITS)


# ----------------------------------------------------------------------------- ancestor_masks


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_masks_match_the_reference_and_pad(seed):
    """In one batch (past SMALL_STEP_NODES nodes) and tree by tree (small steps)."""
    rng = np.random.default_rng(seed)
    n = 150
    chain = DraftTree.from_parents([1] * n, list(range(-1, n - 1)))
    check_masks(rng, [chain] + [random_tree(rng, size) for size in [1, 2] + random_sizes(rng, 20)], n)
    small = [random_tree(rng, size) for size in [1, 2] + [int(rng.integers(1, 18)) for _ in range(4)]]
    assert sum(tree.num_nodes for tree in small) <= SMALL_STEP_NODES
    check_masks(rng, small, max(tree.num_nodes for tree in small))
    check_masks(rng, [DraftTree.from_parents([1] * 90, list(range(-1, 89)))], 90)  # wider than 64 bits


def check_masks(rng: np.random.Generator, trees: list[DraftTree], n: int) -> None:
    layouts = walk_trees(trees, vocab_size=LIMITS["vocab_size"], max_nodes=n, max_depth=n)
    width = n + int(rng.integers(0, 3))
    masks = ancestor_masks(layouts, width)
    assert masks.shape == (len(trees), width, width) and masks.dtype == torch.bool
    eye = torch.eye(width, dtype=torch.bool)
    for b, layout in enumerate(layouts):
        size = layout.parents.shape[0]
        assert torch.equal(masks[b, :size, :size], ancestor_mask_reference(layout.parents, layout.depths)), b
        assert torch.equal(masks[b, size:], eye[size:]), b  # padding rows see only themselves
        assert torch.equal(masks[b, :, size:], eye[:, size:]), b  # and no row sees padding


def test_ancestor_masks_of_an_empty_batch():
    assert ancestor_masks([], 5).shape == (0, 5, 5)


def test_ancestor_masks_refuse_a_tree_wider_than_the_masks():
    layouts = walk_trees([random_tree(np.random.default_rng(0), 9)], **LIMITS)
    with pytest.raises(ValueError, match="9 nodes"):
        ancestor_masks(layouts, 8)
