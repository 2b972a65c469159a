"""DDTree builder, retrieve-buffer compile, verifier-side walk and ancestor mask."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from common.tree import (
    DraftTree,
    TreeError,
    ancestor_mask,
    ancestor_mask_reference,
    walk_tree,
)
from drafter_svc.ddtree import build_chain, build_ddtree, build_ddtrees, select_ddtrees
from tests.reference import build_ddtree_heap_reference

ROOT_TOKEN = 7
INF = float("inf")


def random_logits(depths: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Continuous random logits: no two paths tie on score."""
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(depths, vocab, generator=generator)).to(dtype)


def sibling_groups(tree: DraftTree) -> dict[int, list[int]]:
    """Parent node -> its children in retrieve-buffer (sibling chain) order."""
    next_token, next_sibling = tree.next_token.tolist(), tree.next_sibling.tolist()
    groups = {}
    for parent, child in enumerate(next_token):
        if child != -1:
            groups[parent] = []
            while child != -1:
                groups[parent].append(child)
                child = next_sibling[child]
    return groups


def walk_ddtree(tree: DraftTree, block_logits: torch.Tensor):
    depth_limit, vocab = block_logits.shape
    return walk_tree(tree, vocab_size=vocab, max_nodes=tree.num_nodes, max_depth=depth_limit)


def assert_same_tree(tree: DraftTree, expected: DraftTree) -> None:
    for field in ("tokens", "next_token", "next_sibling"):
        got, want = getattr(tree, field), getattr(expected, field)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), field


def heap_trees(block_logits: torch.Tensor, root_tokens: list[int], budgets: list[int]) -> list[DraftTree]:
    """The heap reference, one session at a time."""
    return [
        build_ddtree_heap_reference(logits, root, budget).tree
        for logits, root, budget in zip(block_logits, root_tokens, budgets)
    ]


def assert_batch_matches_heap(block_logits: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    roots = [(7 * s + 3) % block_logits.shape[-1] for s in range(block_logits.shape[0])]
    trees = build_ddtrees(block_logits, roots, budgets)
    assert len(trees) == block_logits.shape[0]
    for session, (tree, expected) in enumerate(zip(trees, heap_trees(block_logits, roots, budgets))):
        try:
            assert_same_tree(tree, expected)
        except AssertionError as error:
            raise AssertionError(f"session {session} (budget {budgets[session]}): {error}") from error
    return trees


def mixed_budgets(rng: random.Random, sessions: int, depths: int, vocab: int) -> list[int]:
    """Budgets 0, 1, small, around V, up to 150, and past the V + ... + V^D possible prefixes."""
    possible = sum(vocab**d for d in range(1, depths + 1))
    choices = [0, 1, rng.randint(2, 8), vocab, vocab + 1, rng.randint(1, 150)]
    if possible <= 150:
        choices += [possible, possible + 3]
    return [rng.choice(choices) for _ in range(sessions)]


def batch_shape(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(1, 12), rng.randint(0, 6), rng.randint(1, 40)


# ----------------------------------------------------------------------------- builder


@pytest.mark.parametrize("depths, vocab", [(3, 3), (4, 2), (2, 40)])
@pytest.mark.parametrize("budget", [0, 1, 4, 16, 64])
def test_node_count_is_budget_capped_by_possible_prefixes(depths, vocab, budget):
    k = min(budget, vocab)
    possible = sum(k**d for d in range(1, depths + 1))
    tree = build_ddtree(random_logits(depths, vocab, seed=budget), ROOT_TOKEN, budget)
    assert tree.num_nodes == 1 + min(budget, possible)
    assert tree.tokens[0].item() == ROOT_TOKEN


def test_budget_zero_is_root_only():
    tree = build_ddtree(random_logits(4, 10, seed=0), ROOT_TOKEN, 0)
    assert tree.tokens.tolist() == [ROOT_TOKEN]
    assert tree.next_token.tolist() == [-1]
    assert tree.next_sibling.tolist() == [-1]


@pytest.mark.parametrize("budget", [1, 5, 32, 200])
def test_structure_and_walk_agree_with_builder(budget):
    logits = random_logits(6, 12, seed=budget)
    built = build_ddtree_heap_reference(logits, ROOT_TOKEN, budget)
    assert_same_tree(build_ddtree(logits, ROOT_TOKEN, budget), built.tree)
    layout = walk_ddtree(built.tree, logits)

    assert all(parent < node for node, parent in enumerate(built.parents))
    assert layout.parents.tolist() == built.parents
    assert layout.depths.tolist() == built.depths
    assert layout.max_depth == max(built.depths)
    for parent, children in sibling_groups(built.tree).items():
        child_scores = [built.scores[child] for child in children]
        assert child_scores == sorted(child_scores, reverse=True), f"siblings of node {parent}"


def brute_force_top_prefixes(block_logits: torch.Tensor, budget: int):
    """Every token path of length 1..D, ranked by cumulative log-prob, best `budget` kept.

    Returns (token path, score) pairs in the builder's documented order. Scores are summed
    left to right from 0.0 like the builder's, so they match bit for bit.
    """
    logq = torch.log_softmax(block_logits.float(), dim=-1).double().tolist()
    depth_limit, vocab = block_logits.shape
    rank_of = [
        {token: rank for rank, token in enumerate(sorted(range(vocab), key=lambda t: -row[t]))}
        for row in logq
    ]
    candidates = []
    for depth in range(1, depth_limit + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            score = sum(logq[d][token] for d, token in enumerate(path))
            ranks = tuple(rank_of[d][token] for d, token in enumerate(path))
            candidates.append(((-score, depth, ranks), path, score))
    candidates.sort(key=lambda candidate: candidate[0])
    return [(path, score) for _, path, score in candidates[:budget]]


def token_paths(tree: DraftTree, parents: list[int]) -> list[tuple[int, ...]]:
    tokens = tree.tokens.tolist()
    paths = [()]
    for node in range(1, tree.num_nodes):
        paths.append(paths[parents[node]] + (tokens[node],))
    return paths[1:]


@pytest.mark.parametrize("depths, vocab", [(4, 4), (3, 6), (5, 2)])
@pytest.mark.parametrize("budget", [1, 3, 17, 64, 400])
def test_matches_brute_force_top_prefixes(depths, vocab, budget):
    logits = random_logits(depths, vocab, seed=100 * depths + budget)
    built = build_ddtree_heap_reference(logits, ROOT_TOKEN, budget)
    expected = brute_force_top_prefixes(logits, budget)

    # Node order equals the global order, which implies the order in every sibling group.
    assert token_paths(built.tree, built.parents) == [path for path, _ in expected]
    assert built.scores[1:] == [score for _, score in expected]
    assert_same_tree(build_ddtree(logits, ROOT_TOKEN, budget), built.tree)


def test_ties_follow_depth_then_rank_tuple():
    # All-equal logits make every candidate at one depth tie on score.
    built = build_ddtree_heap_reference(torch.zeros(3, 2), ROOT_TOKEN, budget=100)
    all_rank_tuples = [r for d in (1, 2, 3) for r in itertools.product(range(2), repeat=d)]
    assert built.ranks[1:] == all_rank_tuples
    assert_same_tree(build_ddtree(torch.zeros(3, 2), ROOT_TOKEN, 100), built.tree)

    # A score tie across depths: a depth-2 path equals a depth-1 sibling; shallower first.
    logits = torch.tensor([[0.0, 0.0, -50.0], [50.0, -50.0, -50.0]])
    built = build_ddtree_heap_reference(logits, ROOT_TOKEN, budget=3)
    assert built.scores[2] == built.scores[3]
    assert built.ranks[1:] == [(0,), (1,), (0, 0)]
    assert_same_tree(build_ddtree(logits, ROOT_TOKEN, 3), built.tree)


@pytest.mark.parametrize("seed", range(40))
def test_batch_matches_heap_reference(seed):
    rng = random.Random(seed)
    sessions, depths, vocab = batch_shape(rng)
    logits = random_logits(sessions * depths, vocab, seed).reshape(sessions, depths, vocab)
    assert_batch_matches_heap(logits, mixed_budgets(rng, sessions, depths, vocab))


def tied_score_logits(rng: random.Random, sessions: int, depths: int, vocab: int) -> torch.Tensor:
    """Logits distinct within each row whose paths often tie exactly on score.

    Rows are permutations of -step * (0..V-1) drawn from a pool of two per session, so
    rows repeat across depths and permuted rank paths tie (a + b == b + a). A step of 64
    makes the log-probs exact integers with a top log-prob of 0: sums are exact, and a
    rank-0 child ties its parent, so many ties cross depths too.
    """
    sessions_rows = []
    for _ in range(sessions):
        pool = []
        for _ in range(2):
            step, order = rng.choice([0.5, 1.0, 64.0]), list(range(vocab))
            rng.shuffle(order)
            pool.append([-step * position for position in order])
        sessions_rows.append([rng.choice(pool) for _ in range(depths)])
    return torch.tensor(sessions_rows, dtype=torch.float32).reshape(sessions, depths, vocab)


@pytest.mark.parametrize("seed", range(40))
def test_batch_matches_heap_reference_on_tied_scores(seed):
    rng = random.Random(seed)
    sessions, depths, vocab = batch_shape(rng)
    logits = tied_score_logits(rng, sessions, depths, vocab)
    assert_batch_matches_heap(logits, mixed_budgets(rng, sessions, depths, vocab))


@pytest.mark.parametrize("seed", range(30))
def test_selection_cut_to_a_smaller_budget_is_that_budgets_tree(seed):
    """The adaptive budget builds at the cap and cuts: the first b nodes must be exactly the
    budget-b tree (tie-breaks included), and the expected gains the sums of its nodes' path
    probabilities, from the heap reference's scores."""
    rng = random.Random(seed)
    sessions, depths, vocab = batch_shape(rng)
    logits = (tied_score_logits(rng, sessions, depths, vocab) if seed % 2
              else torch.stack([random_logits(depths, vocab, seed * 100 + s) for s in range(sessions)]))
    roots = [(5 * s + 1) % vocab for s in range(sessions)]
    caps = mixed_budgets(rng, sessions, depths, vocab)
    selection = select_ddtrees(logits, roots, caps)
    gains = selection.expected_gains()
    for cut in sorted({0, 1, 2, rng.randint(0, 40), max(caps)}):
        budgets = [min(c, cut) for c in caps]
        for session, (tree, expected) in enumerate(zip(selection.trees(budgets), heap_trees(logits, roots, budgets))):
            assert_same_tree(tree, expected)
            reference = build_ddtree_heap_reference(logits[session], roots[session], budgets[session])
            want = sum(math.exp(score) for score in reference.scores[1:])
            assert gains[session, tree.num_nodes - 1] == pytest.approx(want, rel=1e-12, abs=1e-300), (session, cut)


def tied_log_prob_logits(rng: random.Random, sessions: int, depths: int, vocab: int) -> torch.Tensor:
    """Logits with equal values inside rows: small integers, duplicated columns and -inf entries."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randint(-3, 1, (sessions, depths, vocab), generator=generator).float()
    logits[..., vocab // 2:] = logits[..., : vocab - vocab // 2]  # duplicated columns
    logits[torch.rand(logits.shape, generator=generator) < 0.2] = -INF
    logits[..., 0] = 0.0  # no row all -inf
    return logits


def node_log_probs(tree: DraftTree, block_logits: torch.Tensor) -> list[float]:
    """Each drafted node's log-prob at its depth, in node order."""
    logq = torch.log_softmax(block_logits.float(), dim=-1).double()
    depths = walk_ddtree(tree, block_logits).depths.tolist()
    return [logq[depth - 1, token].item() for depth, token in zip(depths[1:], tree.tokens.tolist()[1:])]


@pytest.mark.parametrize("seed", range(40))
def test_batch_matches_heap_reference_on_tied_log_probs(seed):
    rng = random.Random(seed)
    sessions, depths, vocab = batch_shape(rng)
    logits = tied_log_prob_logits(rng, sessions, depths, vocab)
    # One budget for all: each session's top-k is the heap's, ties inside rows included.
    assert_batch_matches_heap(logits, [rng.randint(0, 150)] * sessions)

    # Mixed budgets: among tokens of exactly equal log-prob, which one torch.topk ranks
    # first depends on k (here the largest budget, for the heap the session's own), so
    # the trees agree in every link and every node's log-prob, not always in token ids.
    budgets = mixed_budgets(rng, sessions, depths, vocab)
    roots = [ROOT_TOKEN % vocab] * sessions
    for session, (tree, expected) in enumerate(
        zip(build_ddtrees(logits, roots, budgets), heap_trees(logits, roots, budgets))
    ):
        assert torch.equal(tree.next_token, expected.next_token), session
        assert torch.equal(tree.next_sibling, expected.next_sibling), session
        assert node_log_probs(tree, logits[session]) == node_log_probs(expected, logits[session]), session


def test_tie_past_the_staircase_matches_heap_reference():
    # -inf log-probs make children of parents with different scores tie at -inf, so the
    # rank tuple decides: node (0, 4, 3), child of the 17th parent in key order, belongs
    # in the tree although (17)(3 + 1) > 66 puts it past the staircase.
    logits = torch.tensor([[0, -1, -2, -3, -INF], [0, -1.5, -3.1, -4.7, -INF], [0, -INF, -INF, -INF, -INF]])
    expected = build_ddtree_heap_reference(logits, ROOT_TOKEN, 66)
    assert (0, 4, 3) in expected.ranks
    assert_batch_matches_heap(torch.stack([logits, logits, random_logits(3, 5, seed=0)]), [66, 65, 66])


@pytest.mark.parametrize(
    "depths, vocab, budgets",
    [
        (4, 10, [0, 0]),  # budget 0: root only
        (1, 6, [0, 1, 3, 6, 40]),  # D = 1
        (3, 2, [1, 5, 14, 100]),  # V < budget; 14 = every possible prefix
        (2, 1, [0, 1, 2, 9]),  # V = 1: a chain
        (0, 8, [0, 4]),  # D = 0: root only
    ],
)
def test_batch_edge_cases_match_heap_reference(depths, vocab, budgets):
    logits = random_logits(len(budgets) * depths, vocab, seed=depths).reshape(len(budgets), depths, vocab)
    trees = assert_batch_matches_heap(logits, budgets)
    for tree, budget in zip(trees, budgets):
        possible = sum(min(budget, vocab) ** d for d in range(1, depths + 1))
        assert tree.num_nodes == 1 + min(budget, possible)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batch_low_precision_logits_match_heap_reference(dtype):
    logits = random_logits(6 * 5, 300, seed=4).reshape(6, 5, 300).to(dtype)
    assert_batch_matches_heap(logits, [24] * 6)  # one budget: low precision ties inside rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_on_cuda_matches_heap_reference_on_cuda():
    rng = random.Random(0)
    logits = random_logits(16 * 15, 4096, seed=0).reshape(16, 15, 4096).cuda()
    assert_batch_matches_heap(logits, mixed_budgets(rng, 16, 15, 4096))


def test_low_precision_logits_give_the_same_tree():
    logits = random_logits(5, 30, seed=3, dtype=torch.bfloat16)
    low = build_ddtree(logits, ROOT_TOKEN, 40)
    full = build_ddtree(logits.float(), ROOT_TOKEN, 40)
    for field in ("tokens", "next_token", "next_sibling"):
        assert torch.equal(getattr(low, field), getattr(full, field))


def test_realistic_size_tree_is_valid():
    logits = random_logits(15, 5000, seed=1)
    tree = build_ddtree(logits, ROOT_TOKEN, 1024)
    assert tree.num_nodes == 1025
    layout = walk_ddtree(tree, logits)
    assert (layout.depths[1:] >= 1).all()


@pytest.mark.parametrize(
    "logits, budget",
    [(torch.zeros(4, 10), -1), (torch.zeros(10), 4), (torch.zeros(2, 4, 10), 4)],
)
def test_builder_rejects_bad_arguments(logits, budget):
    with pytest.raises(ValueError):
        build_ddtree(logits, ROOT_TOKEN, budget)


@pytest.mark.parametrize(
    "logits, roots, budgets",
    [
        (torch.zeros(4, 10), [1], [4]),  # not [S, D, V]
        (torch.zeros(2, 4, 10), [1], [4, 4]),  # a root token short
        (torch.zeros(2, 4, 10), [1, 2], [4]),  # a budget short
        (torch.zeros(2, 4, 10), [1, 2], [4, -1]),  # negative budget
    ],
)
def test_batch_builder_rejects_bad_arguments(logits, roots, budgets):
    with pytest.raises(ValueError):
        build_ddtrees(logits, roots, budgets)


def test_builder_rejects_nan_logits():
    logits = random_logits(3, 8, seed=0)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_ddtree(logits, ROOT_TOKEN, 8)


@pytest.mark.parametrize("all_minus_inf", [False, True])
def test_batch_rejects_nan_like_the_heap(all_minus_inf):
    logits = random_logits(3 * 4, 8, seed=0).reshape(3, 4, 8)
    if all_minus_inf:
        logits[1, 3, :] = -INF  # NaN after log_softmax
    else:
        logits[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_ddtree_heap_reference(logits[1], ROOT_TOKEN, 4)
    with pytest.raises(ValueError, match="NaN"):
        build_ddtrees(logits, [ROOT_TOKEN] * 3, [4, 4, 4])
    # A session that drafts nothing does not read its logits, like the heap.
    assert_batch_matches_heap(logits, [4, 0, 2])


def test_chain_is_the_argmax_path():
    logits = random_logits(6, 50, seed=5)
    tree = build_chain(logits, ROOT_TOKEN)
    assert tree.tokens.tolist() == [ROOT_TOKEN] + logits.argmax(dim=-1).tolist()
    assert tree.next_token.tolist() == [1, 2, 3, 4, 5, 6, -1]
    assert tree.next_sibling.tolist() == [-1] * 7
    assert walk_ddtree(tree, logits).depths.tolist() == list(range(7))


def test_chain_rejects_non_2d_logits():
    with pytest.raises(ValueError):
        build_chain(torch.zeros(10), ROOT_TOKEN)


# ----------------------------------------------------------------------------- walk_tree

# Node 0 (token 5) has children 1 (token 7) and 2 (token 8); node 1 has child 3 (token 9).
GOOD = {"tokens": [5, 7, 8, 9], "next_token": [1, 3, -1, -1], "next_sibling": [-1, 2, -1, -1]}
LIMITS = {"vocab_size": 10, "max_nodes": 8, "max_depth": 2}


def make_tree(tokens, next_token, next_sibling, dtype=torch.int64) -> DraftTree:
    return DraftTree(*(torch.tensor(values, dtype=dtype) for values in (tokens, next_token, next_sibling)))


def edited(**changes) -> DraftTree:
    """GOOD with some fields replaced, e.g. edited(next_token={3: 1}) sets next_token[3] = 1."""
    fields = {}
    for name, values in GOOD.items():
        change = changes.get(name, {})
        fields[name] = change if isinstance(change, list) else [change.get(i, v) for i, v in enumerate(values)]
    return make_tree(**fields)


def test_walk_derives_parents_and_depths():
    layout = walk_tree(make_tree(**GOOD), **LIMITS)
    assert layout.parents.tolist() == [-1, 0, 0, 1]
    assert layout.depths.tolist() == [0, 1, 1, 2]
    assert layout.max_depth == 2


@pytest.mark.parametrize(
    "tree, limits, message",
    [
        (edited(tokens=[5, 7, 8, 9, 1]), {}, "length mismatch"),
        (edited(next_sibling=[-1, 2, -1]), {}, "length mismatch"),
        (make_tree([], [], []), {}, "empty"),
        (make_tree(**GOOD), {"max_nodes": 3}, "exceed the limit"),
        (DraftTree(torch.tensor([[5]]), torch.tensor([[-1]]), torch.tensor([[-1]])), {}, "1-D"),
        (make_tree(**GOOD, dtype=torch.float32), {}, "integer dtype"),
        (edited(next_token={2: -2}), {}, "node 2: next_token -2 is out of range"),
        (edited(next_sibling={2: 4}), {}, "node 2: next_sibling 4 is out of range"),
        (edited(next_token={3: 1}), {}, "node 3: next_token 1 does not point forward"),  # cycle
        (edited(next_token={3: 3}), {}, "node 3: next_token 3 does not point forward"),  # self-loop
        (edited(next_token={3: 0}), {}, "node 3: next_token 0 does not point forward"),  # to root
        (edited(next_sibling={2: 3}), {}, "node 3 is reached twice"),
        (edited(next_token={1: -1}), {}, "node 3 is not reachable"),
        (make_tree([5, 7, 8], [2, -1, 1], [-1, -1, -1]), {}, "node 2: next_token 1 does not point forward"),
        (make_tree([5, 7, 8], [2, -1, -1], [-1, -1, 1]), {}, "node 2: next_sibling 1 does not point forward"),
        (edited(next_token={0: 2, 1: -1}, next_sibling={0: 1, 1: -1}), {}, "root node 0 has a sibling"),
        (make_tree(**GOOD), {"max_depth": 1}, "node 3: depth 2 exceeds max_depth 1"),
        (edited(tokens={2: -1}), {}, "node 2: token -1 is outside"),
        (edited(tokens={3: 10}), {}, "node 3: token 10 is outside"),
        (edited(tokens={0: 10}), {}, "node 0: token 10 is outside"),
        (edited(tokens={2: 7}), {}, "node 2: token 7 repeats a sibling's token"),
    ],
)
def test_walk_rejects_malformed_trees(tree, limits, message):
    with pytest.raises(TreeError, match=message):
        walk_tree(tree, **{**LIMITS, **limits})


def test_walk_accepts_root_only():
    layout = walk_tree(make_tree([3], [-1], [-1]), vocab_size=4, max_nodes=1, max_depth=0)
    assert layout.parents.tolist() == [-1] and layout.depths.tolist() == [0]


def test_walk_accepts_deep_chain_at_the_limits():
    n = 1023
    tree = DraftTree.from_parents([1] * (n + 1), list(range(-1, n)))
    layout = walk_tree(tree, vocab_size=2, max_nodes=n + 1, max_depth=n)
    assert layout.depths.tolist() == list(range(n + 1))
    assert layout.max_depth == n


def test_walk_accepts_wide_one_level_tree():
    n = 1023
    tree = DraftTree.from_parents(list(range(n + 1)), [-1] + [0] * n)
    layout = walk_tree(tree, vocab_size=n + 1, max_nodes=n + 1, max_depth=1)
    assert layout.parents.tolist() == [-1] + [0] * n
    assert layout.max_depth == 1


def test_from_parents_rejects_a_parent_that_does_not_precede():
    with pytest.raises(TreeError, match="node 2: parent 2"):
        DraftTree.from_parents([0, 1, 2], [-1, 0, 2])


# ----------------------------------------------------------------------------- masks


def random_parents(num_nodes: int, rng: random.Random) -> list[int]:
    """A random valid parent array; `window` near 1 gives deep trees, large gives bushy ones."""
    window = rng.choice([1, 2, 4, num_nodes])
    return [-1] + [rng.randrange(max(0, node - window), node) for node in range(1, num_nodes)]


@pytest.mark.parametrize("seed", range(20))
def test_random_trees_round_trip_and_mask_matches_reference(seed):
    rng = random.Random(seed)
    num_nodes = rng.randint(1, 300)
    parents = random_parents(num_nodes, rng)
    tree = DraftTree.from_parents(list(range(num_nodes)), parents)  # distinct tokens
    layout = walk_tree(tree, vocab_size=num_nodes, max_nodes=num_nodes, max_depth=num_nodes)
    assert layout.parents.tolist() == parents

    mask = ancestor_mask(layout.parents, layout.depths)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, ancestor_mask_reference(layout.parents, layout.depths))


def test_ancestor_mask_small_example():
    layout = walk_tree(make_tree(**GOOD), **LIMITS)
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(layout.parents, layout.depths), expected)
    assert torch.equal(ancestor_mask_reference(layout.parents, layout.depths), expected)


@pytest.mark.parametrize("seed", range(10))
def test_few_trees_are_linked_as_the_batch_links_them(seed, monkeypatch):
    """Up to FEW_TREES trees get their links tree by tree (`DraftTree.from_parents`), more in one
    batched pass: the same trees either way."""
    import drafter_svc.ddtree as ddtree

    rng = random.Random(seed)
    sessions, depths, vocab = rng.randint(1, ddtree.FEW_TREES), rng.randint(1, 6), rng.randint(2, 40)
    logits = random_logits(sessions * depths, vocab, seed).reshape(sessions, depths, vocab)
    selection = select_ddtrees(logits, [s % vocab for s in range(sessions)], mixed_budgets(rng, sessions, depths,
                                                                                         vocab))
    few = selection.trees()
    monkeypatch.setattr(ddtree, "FEW_TREES", 0)
    for tree, batched in zip(few, selection.trees(), strict=True):
        assert_same_tree(tree, batched)
