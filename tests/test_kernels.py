"""The SGLang-semantics references of tree verification and of the probability step.

ddtree_kernels/tree_sampling.py and ddtree_kernels/probs.py are the specification that
ddtree_kernels/fused_accept.py's `tree_accept_reference` composes (tests/test_fused_accept.py checks
the Triton stage against it). Here: SGLang's published test vectors, the top-k / top-p
definitions applied literally, and the distribution of the emitted tokens (losslessness).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from ddtree_kernels.probs import process_probs_reference
from ddtree_kernels.tree_sampling import (
    BACKEND_ENV,
    kernel_backend,
    reread_environment,
    tree_speculative_sampling_target_only_reference,
    verify_tree_greedy_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUTPUTS = ("predicts", "accept_index", "accept_token_num", "draft_probs")


def run(impl, args: dict) -> dict[str, Tensor]:
    """Call impl by keyword on copies of args moved to DEVICE; return its outputs on the CPU."""
    moved = {k: v.clone().to(DEVICE) if isinstance(v, Tensor) else v for k, v in args.items()}
    impl(**moved)
    return {k: moved[k].cpu() for k in OUTPUTS if k in moved}


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


def sglang_sampling_args(seed: int) -> dict:
    """The shared inputs with sharp target probabilities and random coins (thresholds not set)."""
    args, logits = sglang_tree_args()
    target_probs = torch.softmax(logits / 0.01, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    args.update(
        uniform_samples=torch.rand(2, 6, generator=gen).clamp_min(2**-24),  # SGLang: coin-independent unless 0
        uniform_samples_for_final_sampling=torch.rand(2, generator=gen),
        target_probs=target_probs, draft_probs=torch.zeros_like(target_probs),
    )
    return args


@pytest.mark.parametrize("case", SGLANG_CASES, ids=["thresholds_1_1", "thresholds_0_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sglang_sampling_vectors(case, seed):
    threshold_single, threshold_acc, predicts, accept_index, accept_token_num = case
    args = {**sglang_sampling_args(seed), "threshold_single": threshold_single, "threshold_acc": threshold_acc}
    out = run(tree_speculative_sampling_target_only_reference, args)
    assert out["predicts"].tolist() == predicts
    assert out["accept_index"].tolist() == accept_index
    assert out["accept_token_num"].tolist() == accept_token_num


def test_sglang_greedy_vector():
    args, logits = sglang_tree_args()
    args["target_predict"] = logits.argmax(dim=-1)
    assert args["target_predict"].tolist() == [[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]]
    out = run(verify_tree_greedy_reference, args)
    _, _, predicts, accept_index, accept_token_num = SGLANG_CASES[0]
    assert out["predicts"].tolist() == predicts
    assert out["accept_index"].tolist() == accept_index
    assert out["accept_token_num"].tolist() == accept_token_num


def test_sglang_residual_masking_vector():
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
    out = run(tree_speculative_sampling_target_only_reference, args)
    assert out["predicts"].tolist() == [3, 31, -1]
    assert out["accept_index"].tolist() == [[0, 1, -1]]
    assert out["accept_token_num"].tolist() == [1]
    assert out["draft_probs"][0, 1, 5].item() == target_probs[0, 1, 5].item()
    assert out["draft_probs"].count_nonzero().item() == 1


def test_sglang_chain_vector():
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
    out = run(tree_speculative_sampling_target_only_reference, args)
    assert out["predicts"].tolist() == [3, 5, 7, -1, 4, 6, 8, -1]
    assert out["accept_index"].tolist() == [[0, 1, 2], [4, 5, 6]]
    assert out["accept_token_num"].tolist() == [2, 2]


@pytest.mark.parametrize("threshold_single, threshold_acc, coin, predicts, accept_index", [
    (1.0, 1.0, 0.5, [2, -1, 3], [[0, 2]]),  # exact: the first sibling whose running mass reaches the coin
    (1.0, 0.5, 0.5, [1, 3, -1], [[0, 1]]),  # coin <= running mass / threshold_acc
    (0.25, 1.0, 0.9, [1, 3, -1], [[0, 1]]),  # q >= threshold_single
    (1.0, 1.0, 0.9, [0, -1, -1], [[0, -1]]),  # both rejected: the bonus from the rest of the root's row
])
def test_acceptance_rule_vector(threshold_single, threshold_acc, coin, predicts, accept_index):
    """SGLang's rule, worked by hand: accept iff coin <= mass / threshold_acc or q >= threshold_single."""
    target_probs = torch.tensor([[[0.4, 0.3, 0.3, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]])
    args = {
        "candidates": as_int64([[0, 1, 2]]), "retrive_index": as_int64([[0, 1, 2]]),
        "retrive_next_token": as_int64([[1, -1, -1]]), "retrive_next_sibling": as_int64([[-1, 2, -1]]),
        **fresh_outputs(bs=1, max_path=2, num_slots=3),
        "uniform_samples": torch.tensor([[coin, 0.5, 0.5]]),
        "uniform_samples_for_final_sampling": torch.tensor([0.5]),
        "target_probs": target_probs, "draft_probs": torch.zeros_like(target_probs),
        "threshold_single": threshold_single, "threshold_acc": threshold_acc,
    }
    out = run(tree_speculative_sampling_target_only_reference, args)
    assert out["predicts"].tolist() == predicts
    assert out["accept_index"].tolist() == accept_index
    assert out["accept_token_num"].tolist() == [1 if accept_index[0][1] >= 0 else 0]


# ---------------------------------------------------------------------------------------
# Random trees.
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


# ---------------------------------------------------------------------------------------
# process_probs_reference.
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


def test_process_probs_definition_with_ties():
    """Integer logits tie often, also at the top-k / top-p boundaries: ties are kept."""
    rng = np.random.default_rng(7)
    rows, vocab = 18, 40
    logits = torch.from_numpy(rng.integers(0, 6, size=(rows, vocab)).astype(np.float32))
    temperature, top_k, top_p = random_filters(rng, rows, vocab)
    actual = process_probs_reference(*(t.to(DEVICE) for t in (logits, temperature, top_k, top_p))).cpu()
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
# Backend choice and argument checking.
# ---------------------------------------------------------------------------------------


def test_kernel_backend_follows_device_and_env(kernel_env):
    kernel_env(BACKEND_ENV, None)
    assert kernel_backend(torch.device("cpu")) == "reference"
    assert kernel_backend(torch.device("cuda")) == "triton"
    for forced in ("reference", "triton"):
        kernel_env(BACKEND_ENV, forced)
        assert kernel_backend(torch.device("cpu")) == kernel_backend(torch.device("cuda")) == forced
    kernel_env(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="DDTREE_KERNELS"):
        kernel_backend(torch.device("cpu"))


def test_the_kernel_settings_are_read_once_per_process(monkeypatch):
    """Every kernel's dispatch asks for its setting, and an environment lookup costs about a
    microsecond: the variable is read once, and again only after `reread_environment`."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    reread_environment()
    assert kernel_backend(torch.device("cpu")) == "reference"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert kernel_backend(torch.device("cpu")) == "reference"
    reread_environment()
    assert kernel_backend(torch.device("cpu")) == "triton"


BAD_ARGS = [
    ("candidates", lambda a: a["candidates"].int(), "candidates must be torch.int64"),
    ("predicts", lambda a: a["predicts"].long(), "predicts must be torch.int32"),
    ("draft_probs", lambda a: a["draft_probs"][:, :, :-1].contiguous(), "draft_probs must have shape"),
    ("uniform_samples", lambda a: a["uniform_samples"].t().contiguous().t(), "must be contiguous"),
    ("threshold_acc", lambda a: 1.5, "threshold_acc must be in"),
]


@pytest.mark.parametrize("key, corrupt, message", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_sampling_rejects_bad_arguments(key, corrupt, message):
    args = sglang_sampling_args(seed=0)
    args[key] = corrupt(args)
    with pytest.raises(ValueError, match=message):
        tree_speculative_sampling_target_only_reference(**args)


def test_process_probs_rejects_bad_arguments():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="top_k must be torch.int64"):
        process_probs_reference(logits, torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    with pytest.raises(ValueError, match="temperature must have shape"):
        process_probs_reference(logits, torch.ones(3), torch.zeros(2, dtype=torch.int64), torch.ones(2))
