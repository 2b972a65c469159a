"""The DDTree selection on the device (`ddtree_kernels.ddtree_select`) against the host's numpy selection
and the heap reference, on fresh random logits with many exact ties (without CUDA the kernel
runs in the Triton interpreter: tests/conftest.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import drafter_svc.ddtree as ddtree
from drafter_svc.ddtree import select_ddtrees
from ddtree_kernels.ddtree_select import select_on_device
from ddtree_kernels.draft_topk import top_logprobs_reference
from tests.reference import build_ddtree_heap_reference
from tests.test_ddtree import assert_same_tree, random_logits, tied_log_prob_logits, tied_score_logits


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel's (the interpreter's on a CPU)


def host_selection(kernel_env, logits, roots, budgets):
    kernel_env("DDTREE_KERNELS", "reference")
    return select_ddtrees(logits, roots, budgets)


def logits_of(kind: str, rng: random.Random, sessions: int, depths: int, vocab: int) -> torch.Tensor:
    if kind == "tied scores":
        return tied_score_logits(rng, sessions, depths, vocab)
    if kind == "tied log-probs":
        return tied_log_prob_logits(rng, sessions, depths, vocab)
    return random_logits(sessions * depths, vocab, rng.randrange(2**31)).reshape(sessions, depths, vocab)


@pytest.mark.parametrize("kind", ["continuous", "tied scores", "tied log-probs"])
@pytest.mark.parametrize("seed", range(8))
def test_device_selection_equals_the_host_selection(kernel_env, kind, seed):
    """Same nodes, tokens, parents and float64 scores, session by session, at mixed budgets
    (0, small, around V, past V)."""
    rng = random.Random(seed * 7 + len(kind))
    sessions, depths, vocab = rng.randint(1, 6), rng.randint(1, 8), rng.randint(2, 30)
    logits = logits_of(kind, rng, sessions, depths, vocab).to(DEVICE)
    budgets = [rng.choice([0, 1, rng.randint(2, 8), vocab, vocab + 2, 24]) for _ in range(sessions)]
    budgets[0] = max(budgets[0], 1)
    roots = [rng.randrange(vocab) for _ in range(sessions)]
    host = host_selection(kernel_env, logits, roots, budgets)
    values, tokens = top_logprobs_reference(logits, min(max(budgets), vocab))
    given = torch.tensor(roots, device=DEVICE), torch.tensor(budgets, device=DEVICE)
    got, parents, num_nodes, scores = select_on_device(values, tokens, *given)
    told = select_on_device(values, tokens, *given, width=max(budgets))  # the width from the host: no wait
    assert torch.equal(told[2], num_nodes)
    for s, n in enumerate(num_nodes.tolist()):  # (columns past a tree's count are unspecified)
        assert told[0][s, :n].tolist() == got[s, :n].tolist() and told[1][s, :n].tolist() == parents[s, :n].tolist()
        assert torch.equal(told[3][s, : n - 1].view(torch.int64), scores[s, : n - 1].view(torch.int64))
    assert num_nodes.tolist() == host.num_nodes.tolist()
    for s, n in enumerate(num_nodes.tolist()):
        assert got[s, :n].tolist() == host.tokens[s, :n].tolist(), s
        assert parents[s, :n].tolist() == host.parents[s, :n].tolist(), s
        assert np.array_equal(scores[s, : n - 1].numpy(), host.scores[s, : n - 1]), s  # bit for bit
        assert torch.isnan(scores[s, n - 1:]).all()


@pytest.mark.parametrize("seed", range(4))
def test_select_ddtrees_on_the_device_path_matches_the_heap_reference(monkeypatch, kernel_env, seed):
    """With the Triton backend `select_ddtrees` selects on the device; its trees, cut to smaller
    budgets too (the adaptive budget), are the heap reference's."""
    kernel_env("DDTREE_KERNELS", "triton")
    calls = []
    real = ddtree.select_on_device
    monkeypatch.setattr(ddtree, "select_on_device", lambda *args: calls.append(1) or real(*args))
    rng = random.Random(seed)
    sessions, depths, vocab = 4, 6, 12
    logits = tied_score_logits(rng, sessions, depths, vocab).to(DEVICE)
    roots, caps = [1, 2, 3, 4], [15, 3, 0, 20]
    selection = select_ddtrees(logits, roots, caps)
    assert calls
    for cut in (caps, [min(c, 5) for c in caps]):
        for session, tree in enumerate(selection.trees(cut)):
            want = build_ddtree_heap_reference(logits[session], roots[session], cut[session]).tree
            assert_same_tree(tree, want)


def test_device_path_refuses_nan_logits_and_leaves_wide_trees_to_the_host(monkeypatch, kernel_env):
    kernel_env("DDTREE_KERNELS", "triton")
    logits = random_logits(2 * 4 * 3, 10, seed=1).reshape(2, 4 * 3, 10)[:, :4].to(DEVICE)
    bad = logits.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        select_ddtrees(bad, [0, 1], [3, 3])
    select_ddtrees(bad, [0, 1], [3, 0])  # the NaN row's session drafts nothing: no error, as on the host
    monkeypatch.setattr(ddtree, "MAX_WIDTH", 4)
    monkeypatch.setattr(ddtree, "select_on_device", lambda *args: pytest.fail("a wide tree took the device path"))
    wide = select_ddtrees(logits, [0, 1], [5, 2])
    assert wide.num_nodes.tolist() == [6, 3]


def test_the_warm_ups_launch_every_variant_a_step_may_compile(monkeypatch):
    """`ddtree_select.warm_up` launches the selection once per lane count of the budgets up to its
    bound, with the drafter's depths and the step's argument types; `place_trees.warm_up` places
    once per tile width. (That nothing compiles after them is tests/gpu/test_compiles_gpu.py's.)"""
    import ddtree_kernels.ddtree_select as select_kernel
    import ddtree_kernels.place_trees as place_kernel

    selected = []
    monkeypatch.setattr(select_kernel, "select_rows", lambda logq, tokens, roots, budgets, width: selected.append(
        (tuple(logq.shape), logq.dtype, tokens.dtype, roots.dtype, budgets.dtype, int(budgets[0]), width)))
    select_kernel.warm_up(torch.device("cpu"), 15, 130)
    lanes = {select_kernel._lanes(w) for w in range(1, 131)}
    assert sorted(select_kernel._lanes(s[-1]) for s in selected) == sorted(lanes)  # one launch per variant
    for shape, logq, tokens, roots, budgets, budget, width in selected:
        assert shape[1] == 15 and (logq, tokens, roots, budgets) == (torch.float32,) + (torch.int64,) * 3
        assert budget == width == shape[2]
    placed = []
    monkeypatch.setattr(place_kernel, "place_trees", lambda *args: placed.append(args[5]))
    place_kernel.warm_up(torch.device("cpu"), 100)
    assert sorted(max(16, 1 << (w - 1).bit_length()) for w in placed) == [16, 32, 64, 128] and max(placed) == 100
