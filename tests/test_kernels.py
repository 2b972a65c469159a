"""Tree-verification and probability kernels: SGLang's vectors, Triton == reference, losslessness.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py), so the random
comparisons use small vocabularies and few rows. Random target probabilities are
multiples of a power of two (2**-20 mostly): every float32 sum of them is then exact in
any order, so the Triton kernel (chunked sums) and the reference (torch sums) must agree
bit for bit, ties included.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from kernels import probs as probs_module
from kernels import tree_sampling
from kernels.probs import process_probs, process_probs_reference, process_probs_triton
from kernels.tree_sampling import (
    tree_speculative_sampling_target_only,
    tree_speculative_sampling_target_only_reference,
    tree_speculative_sampling_target_only_triton,
    verify_tree_greedy,
    verify_tree_greedy_reference,
    verify_tree_greedy_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAMPLING = [tree_speculative_sampling_target_only_reference, tree_speculative_sampling_target_only_triton]
GREEDY = [verify_tree_greedy_reference, verify_tree_greedy_triton]
OUTPUTS = ("predicts", "accept_index", "accept_token_num", "draft_probs")


def run(impl, args: dict) -> dict[str, Tensor]:
    """Call impl by keyword on copies of args moved to DEVICE; return its outputs on the CPU."""
    moved = {k: v.clone().to(DEVICE) if isinstance(v, Tensor) else v for k, v in args.items()}
    impl(**moved)
    return {k: moved[k].cpu() for k in OUTPUTS if k in moved}


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs:\n{a[key]}\n{b[key]}"


def fresh_outputs(bs: int, max_path: int, num_slots: int) -> dict[str, Tensor]:
    """Output buffers as SGLang's callers prepare them (predicts and accept_index at -1)."""
    return {
        "predicts": torch.full((num_slots,), -1, dtype=torch.int32),
        "accept_index": torch.full((bs, max_path), -1, dtype=torch.int32),
        "accept_token_num": torch.zeros(bs, dtype=torch.int32),
    }


def as_int64(rows) -> Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# SGLang's published test vectors (shared/notes/sglang_tree_verification.md, section 2).
# ---------------------------------------------------------------------------------------


def sglang_tree_args() -> tuple[dict, Tensor]:
    """The shared bs=2, N=6, S=4, V=20 inputs; returns (tree args + outputs, logits)."""
    logits = torch.full((2, 6, 20), 1.0)
    for b, i, v in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        logits[b, i, v] = 10.0
    logits[..., 18] = torch.where(logits.max(dim=-1).values < 10, 10.0, logits[..., 18])
    args = {
        "candidates": as_int64([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
        "retrive_index": as_int64([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "retrive_next_token": as_int64([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        "retrive_next_sibling": as_int64([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        **fresh_outputs(bs=2, max_path=4, num_slots=12),
    }
    return args, logits


SGLANG_CASES = [
    # (threshold_single, threshold_acc, predicts, accept_index, accept_token_num)
    (1.0, 1.0, [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2]),
    (0.0, 0.0, [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]], [2, 2]),
]


@pytest.mark.parametrize("impl", SAMPLING)
@pytest.mark.parametrize("case", SGLANG_CASES, ids=["thresholds_1_1", "thresholds_0_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sglang_sampling_vectors(impl, case, seed):
    threshold_single, threshold_acc, predicts, accept_index, accept_token_num = case
    args, logits = sglang_tree_args()
    target_probs = torch.softmax(logits / 0.01, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    args.update(
        uniform_samples=torch.rand(2, 6, generator=gen).clamp_min(2**-24),  # SGLang: coin-independent unless 0
        uniform_samples_for_final_sampling=torch.rand(2, generator=gen),
        target_probs=target_probs, draft_probs=torch.zeros_like(target_probs),
        threshold_single=threshold_single, threshold_acc=threshold_acc,
    )
    out = run(impl, args)
    assert out["predicts"].tolist() == predicts
    assert out["accept_index"].tolist() == accept_index
    assert out["accept_token_num"].tolist() == accept_token_num


@pytest.mark.parametrize("impl", GREEDY)
def test_sglang_greedy_vector(impl):
    args, logits = sglang_tree_args()
    args["target_predict"] = logits.argmax(dim=-1)
    assert args["target_predict"].tolist() == [[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]]
    out = run(impl, args)
    _, _, predicts, accept_index, accept_token_num = SGLANG_CASES[0]
    assert out["predicts"].tolist() == predicts
    assert out["accept_index"].tolist() == accept_index
    assert out["accept_token_num"].tolist() == accept_token_num


@pytest.mark.parametrize("impl", SAMPLING)
def test_sglang_residual_masking_vector(impl):
    """A rejected draft's mass is removed before the bonus is drawn (0.90 on token 5)."""
    target_probs = torch.zeros(1, 3, 32)
    for (b, i, v), p in {(0, 0, 0): 0.05, (0, 0, 3): 0.95, (0, 1, 5): 0.90, (0, 1, 31): 0.10,
                         (0, 2, 0): 1.0}.items():
        target_probs[b, i, v] = p
    args = {
        "candidates": as_int64([[0, 3, 5]]), "retrive_index": as_int64([[0, 1, 2]]),
        "retrive_next_token": as_int64([[1, 2, -1]]), "retrive_next_sibling": as_int64([[-1, -1, -1]]),
        **fresh_outputs(bs=1, max_path=3, num_slots=3),
        "uniform_samples": torch.tensor([[0.0, 0.99, 0.0]]),
        "uniform_samples_for_final_sampling": torch.tensor([0.5]),
        "target_probs": target_probs, "draft_probs": torch.zeros_like(target_probs),
        "threshold_single": 0.91, "threshold_acc": 1.0,
    }
    out = run(impl, args)
    assert out["predicts"].tolist() == [3, 31, -1]
    assert out["accept_index"].tolist() == [[0, 1, -1]]
    assert out["accept_token_num"].tolist() == [1]
    assert out["draft_probs"][0, 1, 5].item() == target_probs[0, 1, 5].item()
    assert out["draft_probs"].count_nonzero().item() == 1


@pytest.mark.parametrize("impl", SAMPLING)
def test_sglang_chain_vector(impl):
    """A chain longer than S: S - 1 drafts accepted, bonus from the last accepted node."""
    candidates = as_int64([[0, 3, 5, 7], [0, 4, 6, 8]])
    logits = torch.full((2, 4, 16), -10.0)
    for b in range(2):
        for j in range(3):
            logits[b, j, candidates[b, j + 1]] = 10.0
    target_probs = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(0)
    args = {
        "candidates": candidates, "retrive_index": as_int64([[0, 1, 2, 3], [4, 5, 6, 7]]),
        "retrive_next_token": as_int64([[1, 2, 3, -1], [1, 2, 3, -1]]),
        "retrive_next_sibling": torch.full((2, 4), -1, dtype=torch.int64),
        **fresh_outputs(bs=2, max_path=3, num_slots=8),
        "uniform_samples": torch.rand(2, 4, generator=gen),
        "uniform_samples_for_final_sampling": torch.rand(2, generator=gen),
        "target_probs": target_probs, "draft_probs": torch.zeros_like(target_probs),
    }
    out = run(impl, args)
    assert out["predicts"].tolist() == [3, 5, 7, -1, 4, 6, 8, -1]
    assert out["accept_index"].tolist() == [[0, 1, 2], [4, 5, 6]]
    assert out["accept_token_num"].tolist() == [2, 2]


# ---------------------------------------------------------------------------------------
# Random trees: Triton == reference.
# ---------------------------------------------------------------------------------------


def random_parents(rng: np.random.Generator, shape: str, num_nodes: int) -> list[int]:
    """Parent of each node (parents[0] = -1, parents[i] < i)."""
    if shape == "chain":
        return [-1] + list(range(num_nodes - 1))
    if shape == "wide":
        return [-1] + [0] * (num_nodes - 1)
    if shape == "deep":  # mostly chains with short side branches
        return [-1] + [max(0, i - 1 - int(rng.integers(0, 3))) for i in range(1, num_nodes)]
    assert shape == "random"
    return [-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)]


def random_tokens(rng: np.random.Generator, parents: list[int], vocab: int) -> list[int]:
    """A token per node; siblings get distinct tokens."""
    tokens = [int(rng.integers(vocab))] + [0] * (len(parents) - 1)
    for parent in set(parents[1:]):
        children = [i for i, p in enumerate(parents) if p == parent]
        for child, token in zip(children, rng.choice(vocab, len(children), replace=False)):
            tokens[child] = int(token)
    return tokens


def link_children(parents: list[int]) -> tuple[list[int], list[int]]:
    """next_token / next_sibling lists, siblings in ascending node index (as SGLang builds them)."""
    next_token, next_sibling = [-1] * len(parents), [-1] * len(parents)
    for node in range(len(parents) - 1, 0, -1):  # insert at the head of the parent's list
        next_sibling[node] = next_token[parents[node]]
        next_token[parents[node]] = node
    return next_token, next_sibling


def depth_of(parents: list[int]) -> int:
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return max(depths)


def random_target_probs(rng, parents, tokens, vocab, zero_children, coarse) -> np.ndarray:
    """[N, V] target rows: flat to peaked, partly sparse, often favouring a drafted child.

    Values are multiples of 2**-20, so float32 sums are exact in any order. coarse rows
    put a few sixteenths on a few tokens instead (with coins in sixteenths too, coin
    values then often equal partial sums exactly: this exercises <= versus < ties).
    zero_children gives every drafted child zero target mass.
    """
    n = len(parents)
    if coarse:
        weights = np.zeros((n, vocab))
        for row in range(n):
            weights[row, rng.choice(vocab, min(vocab, 4), replace=False)] = rng.integers(0, 5, min(vocab, 4))
    else:
        weights = rng.exponential(size=(n, vocab)) ** rng.uniform(1, 6, size=(n, 1))
        weights *= rng.random((n, vocab)) < rng.uniform(0.2, 1.0, size=(n, 1))
    for child in range(1, n):
        row = parents[child]
        if zero_children:
            weights[row, tokens[child]] = 0.0
        elif rng.random() < 0.6:
            boost = rng.integers(1, 9) if coarse else weights[row].sum() * rng.uniform(0.5, 8)
            weights[row, tokens[child]] += boost
    if coarse:  # a power-of-two denominator keeps the values exact (rows may sum below 1)
        return (weights / 2.0 ** np.ceil(np.log2(max(weights.sum(axis=1).max(), 1)))).astype(np.float32)
    sums = weights.sum(axis=1, keepdims=True)
    probs = np.divide(weights, sums, out=np.zeros_like(weights), where=sums > 0)
    return (np.floor(probs * 2**20) / 2**20).astype(np.float32)


def random_greedy_targets(rng, parents, tokens, vocab) -> list[int]:
    """Target argmax per node: often the token of one of its children, else any token."""
    targets = []
    for node in range(len(parents)):
        children = [i for i, p in enumerate(parents) if p == node]
        if children and rng.random() < 0.75:
            targets.append(tokens[int(rng.choice(children))])
        else:
            targets.append(int(rng.integers(vocab)))
    return targets


def random_batch(seed, shape, num_nodes, vocab, bs, path="depth", zero_children=False,
                 shuffled_slots=False, dirty_scratch=False) -> tuple[dict, dict]:
    """Random trees, one per row; returns (sampling args without thresholds, greedy args).

    path: S = deepest path ("depth"), N ("full") or one less than the deepest ("short",
    so the walk is cut off). shuffled_slots: retrive_index is a random permutation of
    more slots than bs * N (sampling only; greedy assumes b * N + i). dirty_scratch:
    draft_probs starts non-zero, which SGLang's callers never do, but which makes the
    rule "nothing is removed from the bonus row on a full path" observable.
    """
    rng = np.random.default_rng(seed)
    parents = [random_parents(rng, shape, num_nodes) for _ in range(bs)]
    tokens = [random_tokens(rng, p, vocab) for p in parents]
    links = [link_children(p) for p in parents]
    depth = max(depth_of(p) for p in parents)
    max_path = {"depth": depth + 1, "full": num_nodes, "short": max(depth, 1)}[path]

    num_slots = bs * num_nodes + (3 if shuffled_slots else 0)
    slots = rng.permutation(num_slots)[: bs * num_nodes] if shuffled_slots else np.arange(bs * num_nodes)
    tree = {
        "candidates": as_int64(tokens),
        "retrive_index": torch.from_numpy(slots.reshape(bs, num_nodes)).to(torch.int64),
        "retrive_next_token": as_int64([nt for nt, _ in links]),
        "retrive_next_sibling": as_int64([ns for _, ns in links]),
        **fresh_outputs(bs, max_path, num_slots),
    }
    gen = torch.Generator().manual_seed(seed)
    coins = torch.rand(bs, num_nodes, generator=gen)
    coins[torch.rand(bs, num_nodes, generator=gen) < 0.05] = 0.0  # a zero coin accepts q = 0
    final_coins = torch.rand(bs, generator=gen)
    final_coins[torch.rand(bs, generator=gen) < 0.1] = 1.0  # u = total: the fallback path
    coarse = torch.rand(bs, generator=gen) < 0.3
    coins[coarse] = (coins[coarse] * 16).floor() / 16
    final_coins[coarse] = (final_coins[coarse] * 16).floor() / 16
    target_probs = torch.from_numpy(np.stack([
        random_target_probs(rng, p, t, vocab, zero_children, bool(c))
        for p, t, c in zip(parents, tokens, coarse)]))
    scratch = torch.zeros_like(target_probs)
    if dirty_scratch:
        scratch = torch.where(torch.rand(target_probs.shape, generator=gen) < 0.5, target_probs, 0.0)
    sampling = {**tree, "uniform_samples": coins, "uniform_samples_for_final_sampling": final_coins,
                "target_probs": target_probs, "draft_probs": scratch}
    greedy = {**tree, "target_predict": as_int64(
        [random_greedy_targets(rng, p, t, vocab) for p, t in zip(parents, tokens)])}
    return sampling, greedy


RANDOM_CASES = [
    # (shape, N, V, bs, extra random_batch options, other thresholds, max vocabulary chunk)
    ("random", 1, 50, 6, {}, (0.5, 0.5), None),  # budget 0: root only
    ("chain", 8, 64, 8, {}, (0.6, 0.9), None),
    ("chain", 16, 100, 8, {"path": "full"}, (0.0, 0.0), None),
    ("chain", 12, 80, 8, {"path": "short"}, (0.0, 0.0), None),
    ("deep", 20, 150, 8, {}, (0.3, 1.0), None),
    ("deep", 20, 150, 8, {"path": "short"}, (0.3, 1.0), None),
    ("chain", 10, 120, 8, {"path": "short", "dirty_scratch": True}, (0.0, 0.0), None),
    ("wide", 12, 77, 8, {}, (1.0, 0.5), None),
    ("wide", 30, 128, 6, {"path": "full"}, (0.2, 0.7), None),
    ("random", 10, 97, 8, {}, (0.6, 0.9), None),
    ("random", 24, 300, 8, {}, (0.5, 0.5), None),
    ("random", 16, 255, 8, {"zero_children": True}, (0.5, 0.5), None),
    ("chain", 6, 60, 6, {"zero_children": True}, (0.9, 0.1), None),
    ("random", 12, 90, 8, {"shuffled_slots": True}, (0.6, 0.9), None),
    ("random", 12, 200, 8, {}, (0.6, 0.9), 32),
    ("chain", 6, 100, 6, {}, (0.3, 1.0), 16),
    ("wide", 9, 129, 6, {"zero_children": True}, (0.5, 0.5), 64),
    ("random", 12, 2000, 3, {}, (0.6, 0.9), None),
    ("wide", 8, 2049, 3, {}, (1.0, 0.5), None),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", RANDOM_CASES, ids=[f"{c[0]}-N{c[1]}-V{c[2]}" for c in RANDOM_CASES])
def test_triton_matches_reference_on_random_trees(seed, case, monkeypatch):
    shape, num_nodes, vocab, bs, options, other_thresholds, max_block = case
    if max_block is not None:
        monkeypatch.setattr(tree_sampling, "MAX_BLOCK_V", max_block)
    seed += 100 * RANDOM_CASES.index(case)
    sampling, greedy = random_batch(seed, shape, num_nodes, vocab, bs, **options)

    for threshold_single, threshold_acc in [(1.0, 1.0), other_thresholds]:
        args = {**sampling, "threshold_single": threshold_single, "threshold_acc": threshold_acc}
        expected = run(tree_speculative_sampling_target_only_reference, args)
        assert_same(run(tree_speculative_sampling_target_only_triton, args), expected)
        if options.get("zero_children") and threshold_single > 0:  # only a coin of 0 accepts q = 0
            root_coin_positive = sampling["uniform_samples"][:, 0] > 0
            assert expected["accept_token_num"][root_coin_positive].eq(0).all()

    if not options.get("shuffled_slots"):
        assert_same(run(verify_tree_greedy_triton, greedy), run(verify_tree_greedy_reference, greedy))


def test_triton_matches_reference_on_softmax_probs():
    """Unquantised softmax rows: sums then differ in the last bits, tokens still agree."""
    sampling, _ = random_batch(seed=99, shape="random", num_nodes=12, vocab=150, bs=16)
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(sampling["target_probs"].shape, generator=gen) * 3
    sampling["target_probs"] = torch.softmax(logits, dim=-1)
    sampling["draft_probs"] = torch.zeros_like(logits)
    expected = run(tree_speculative_sampling_target_only_reference, sampling)
    assert_same(run(tree_speculative_sampling_target_only_triton, sampling), expected)


# ---------------------------------------------------------------------------------------
# process_probs.
# ---------------------------------------------------------------------------------------


def random_filters(rng, rows: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """Temperatures, top-k (off as 0 or >= V, 1, random) and top-p (off, random) per row."""
    temperature = torch.tensor(rng.uniform(0.3, 2.0, rows), dtype=torch.float32)
    k_choices = [0, 1, vocab, vocab + 7, int(rng.integers(1, vocab + 1)), int(rng.integers(1, vocab + 1))]
    top_k = as_int64([k_choices[i % len(k_choices)] for i in range(rows)])
    top_p = torch.tensor([1.0 if i % 4 == 0 else rng.uniform(0.05, 0.99) for i in range(rows)],
                         dtype=torch.float32)
    return temperature, top_k, top_p


def assert_probs_close(actual: Tensor, expected: Tensor) -> None:
    assert torch.equal(actual > 0, expected > 0), "different support"
    assert (actual - expected).abs().max().item() <= 1e-6


PROBS_CASES = [
    # (rows, V, logits dtype, logit scale, max vocabulary chunk)
    (1, 1, torch.float32, 1.0, None),
    (12, 50, torch.float32, 1.0, None),
    (12, 300, torch.bfloat16, 3.0, None),
    (12, 257, torch.float16, 2.0, 64),
    (6, 100, torch.float32, 6.0, 16),
    (4, 2000, torch.float32, 2.0, None),
]


@pytest.mark.parametrize("seed, case", list(enumerate(PROBS_CASES)),
                         ids=[f"R{c[0]}-V{c[1]}-{str(c[2])[6:]}" for c in PROBS_CASES])
def test_process_probs_triton_matches_reference(seed, case, monkeypatch):
    rows, vocab, dtype, scale, max_block = case
    if max_block is not None:
        monkeypatch.setattr(tree_sampling, "MAX_BLOCK_V", max_block)
    rng = np.random.default_rng(seed)
    logits = (torch.from_numpy(rng.normal(size=(rows, vocab))) * scale).to(dtype)
    filters = random_filters(rng, rows, vocab)
    expected = process_probs_reference(logits, *filters)
    actual = process_probs_triton(*(t.to(DEVICE) for t in (logits, *filters))).cpu()
    assert_probs_close(actual, expected)
    assert torch.allclose(expected.sum(dim=-1), torch.ones(rows))


def brute_force_filters(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """The top-k / top-p definitions applied literally to one row, in float64."""
    vocab = len(probs)
    if 0 < top_k < vocab:
        kth = sorted(probs, reverse=True)[top_k - 1]
        probs = [p if p >= kth else 0.0 for p in probs]
        probs = [p / sum(probs) for p in probs]
    if top_p < 1:
        goal = top_p * sum(probs)
        pivot = max(v for v in set(probs) if sum(p for p in probs if p >= v) >= goal)
        probs = [p if p >= pivot else 0.0 for p in probs]
        probs = [p / sum(probs) for p in probs]
    return probs


@pytest.mark.parametrize("impl", [process_probs_reference, process_probs_triton])
def test_process_probs_definition_with_ties(impl):
    """Integer logits tie often, also at the top-k / top-p boundaries: ties are kept."""
    rng = np.random.default_rng(7)
    rows, vocab = 18, 40
    logits = torch.from_numpy(rng.integers(0, 6, size=(rows, vocab)).astype(np.float32))
    temperature, top_k, top_p = random_filters(rng, rows, vocab)
    actual = impl(*(t.to(DEVICE) for t in (logits, temperature, top_k, top_p))).cpu()
    softmax = torch.softmax(logits / temperature[:, None], dim=-1).double()
    for r in range(rows):
        expected = torch.tensor(brute_force_filters(softmax[r].tolist(), int(top_k[r]), float(top_p[r])))
        assert_probs_close(actual[r].double(), expected)
    # The vectors exercise ties at the boundary: some row keeps more than k tokens.
    kept = (actual > 0).sum(dim=-1)
    k_on = (top_k > 0) & (top_k < vocab) & (top_p == 1)
    assert (kept[k_on] > top_k[k_on]).any()


# ---------------------------------------------------------------------------------------
# Losslessness: the emitted tokens are distributed as the target.
# ---------------------------------------------------------------------------------------

STAT_PARENTS = [-1, 0, 0, 0, 1, 1]  # root with 3 children; child 1 has 2 children
STAT_ROWS = 100_000


def chisquare_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; categories of probability 0 must never be observed."""
    assert observed[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * observed.sum()
    assert expected.min() >= 5, "too few expected counts for the chi-square approximation"
    return chisquare(observed[keep], expected).pvalue


def shifted(probs: np.ndarray, amount: float = 0.01) -> np.ndarray:
    """Move `amount` of mass from the largest cell to the second largest."""
    first, second = np.argsort(probs)[::-1][:2]
    out = probs.copy()
    out[first] -= amount
    out[second] += amount
    return out


@pytest.mark.parametrize("filtered", [False, True], ids=["softmax", "top_k_top_p"])
def test_emitted_tokens_follow_the_target(filtered):
    rng = np.random.default_rng(2024 + filtered)
    vocab, num_nodes = 10, len(STAT_PARENTS)
    tokens = random_tokens(rng, STAT_PARENTS, vocab)
    logits = torch.from_numpy(rng.normal(size=(num_nodes, vocab)) * 0.7).float()
    if filtered:
        node_probs = process_probs_reference(
            logits, torch.full((num_nodes,), 0.8), torch.full((num_nodes,), 7, dtype=torch.int64),
            torch.full((num_nodes,), 0.9))
        assert (node_probs == 0).any()
    else:
        node_probs = torch.softmax(logits, dim=-1)

    next_token, next_sibling = link_children(STAT_PARENTS)
    bs = STAT_ROWS
    gen = torch.Generator().manual_seed(5)
    target_probs = node_probs.expand(bs, num_nodes, vocab).contiguous()
    args = {
        "candidates": as_int64([tokens]).expand(bs, -1).contiguous(),
        "retrive_index": torch.arange(bs * num_nodes).view(bs, num_nodes),
        "retrive_next_token": as_int64([next_token]).expand(bs, -1).contiguous(),
        "retrive_next_sibling": as_int64([next_sibling]).expand(bs, -1).contiguous(),
        **fresh_outputs(bs, max_path=3, num_slots=bs * num_nodes),
        "uniform_samples": torch.rand(bs, num_nodes, generator=gen),
        "uniform_samples_for_final_sampling": torch.rand(bs, generator=gen),
        "target_probs": target_probs, "draft_probs": torch.zeros_like(target_probs),
    }
    tree_speculative_sampling_target_only_reference(**args)

    accept_index = args["accept_index"].long()
    predicts = args["predicts"].long()
    first = predicts[accept_index[:, 0]].numpy()
    accepted = args["accept_token_num"].numpy() >= 1
    second = predicts[accept_index[:, 1].clamp(min=0)].numpy()
    child_of_root = {tokens[c]: c for c in range(1, num_nodes) if STAT_PARENTS[c] == 0}
    assert np.array_equal(accepted, np.isin(first, list(child_of_root)))
    assert 0.05 < accepted.mean() < 0.95  # both branches of the joint are exercised

    # (a) the first token ~ p_root.
    p = node_probs.double().numpy()
    observed = np.bincount(first, minlength=vocab)
    assert chisquare_pvalue(observed, p[0]) > 1e-3
    assert chisquare_pvalue(observed, shifted(p[0])) < 1e-3  # the test has power

    # (b) (x1, x2) ~ p_root(x1) p_node(x1)(x2) when x1 is a drafted child; x1 alone otherwise.
    cells, probs = {}, []
    for x1 in range(vocab):
        if x1 in child_of_root:
            for x2 in range(vocab):
                cells[x1, x2] = len(probs)
                probs.append(p[0, x1] * p[child_of_root[x1], x2])
        else:
            cells[x1] = len(probs)
            probs.append(p[0, x1])
    keys = [(x1, x2) if ok else x1 for x1, x2, ok in zip(first.tolist(), second.tolist(), accepted)]
    observed = np.bincount([cells[k] for k in keys], minlength=len(probs))
    probs = np.array(probs)
    assert chisquare_pvalue(observed, probs) > 1e-3
    assert chisquare_pvalue(observed, shifted(probs)) < 1e-3


# ---------------------------------------------------------------------------------------
# Dispatch and argument checking.
# ---------------------------------------------------------------------------------------


DISPATCH = [
    (tree_sampling, verify_tree_greedy, "verify_tree_greedy"),
    (tree_sampling, tree_speculative_sampling_target_only, "tree_speculative_sampling_target_only"),
    (probs_module, process_probs, "process_probs"),
]


@pytest.mark.parametrize("module, dispatcher, name", DISPATCH, ids=[d[2] for d in DISPATCH])
def test_dispatch_follows_device_and_env(module, dispatcher, name, monkeypatch):
    calls = []
    for backend in ("reference", "triton"):
        monkeypatch.setattr(module, f"{name}_{backend}", lambda *a, _b=backend: calls.append(_b))
    first_arg = torch.zeros(2, 3, device=DEVICE)  # only its device matters to the fakes
    args = [first_arg] * 4 if name == "process_probs" else [None] * 3 + [first_arg] + [None] * 10

    def dispatch(env):
        if env is None:
            monkeypatch.delenv(tree_sampling.BACKEND_ENV, raising=False)
        else:
            monkeypatch.setenv(tree_sampling.BACKEND_ENV, env)
        calls.clear()
        dispatcher(*args[: dispatcher.__code__.co_argcount])
        return calls

    assert dispatch(None) == ["triton" if DEVICE == "cuda" else "reference"]
    assert dispatch("reference") == ["reference"]
    assert dispatch("triton") == ["triton"]
    with pytest.raises(ValueError, match="DDTREE_KERNELS"):
        dispatch("cuda")


BAD_ARGS = [
    ("candidates", lambda a: a["candidates"].int(), "candidates must be torch.int64"),
    ("predicts", lambda a: a["predicts"].long(), "predicts must be torch.int32"),
    ("draft_probs", lambda a: a["draft_probs"][:, :, :-1].contiguous(), "draft_probs must have shape"),
    ("uniform_samples", lambda a: a["uniform_samples"].t().contiguous().t(), "must be contiguous"),
    ("threshold_acc", lambda a: 1.5, "threshold_acc must be in"),
]


@pytest.mark.parametrize("impl", SAMPLING)
@pytest.mark.parametrize("key, corrupt, message", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_sampling_rejects_bad_arguments(impl, key, corrupt, message):
    sampling, _ = random_batch(seed=0, shape="random", num_nodes=4, vocab=8, bs=2)
    sampling[key] = corrupt(sampling)
    with pytest.raises(ValueError, match=message):
        impl(**sampling)


@pytest.mark.parametrize("impl", [process_probs_reference, process_probs_triton])
def test_process_probs_rejects_bad_arguments(impl):
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="top_k must be torch.int64"):
        impl(logits, torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    with pytest.raises(ValueError, match="temperature must have shape"):
        impl(logits, torch.ones(3), torch.zeros(2, dtype=torch.int64), torch.ones(2))
