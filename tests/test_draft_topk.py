"""The drafter's candidates (ddtree_kernels/draft_topk.py): the one-pass Triton top-k == torch.topk over log_softmax.

Without CUDA the Triton pass runs in the interpreter (tests/conftest.py); the vocabulary chunk
is lowered so that rows span several chunks with a ragged last one.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafter_svc.ddtree import select_ddtrees
from ddtree_kernels import draft_topk
from ddtree_kernels.draft_topk import top_logprobs, top_logprobs_reference, top_logprobs_triton
from ddtree_kernels.tree_sampling import BACKEND_ENV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(draft_topk, "CHUNK_V", 256)
    monkeypatch.setattr(draft_topk, "TRITON_MIN_ROWS", 2)  # k above WIDE_K takes the Triton path from 2 rows here


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 5, 16])
def test_triton_equals_reference_on_continuous_logits(seed, k):
    gen = torch.Generator().manual_seed(seed)
    vocab = 16 * (70 + 13 * seed)  # 1120 .. 1744: several chunks, the last one ragged
    logits = (torch.randn(3, 4, vocab, generator=gen) * (1 + seed)).to(DEVICE)
    logits[0, 1, :] -= 30.0  # a row far below zero
    got_logq, got_tokens = top_logprobs_triton(logits, k)
    want_logq, want_tokens = top_logprobs_reference(logits, k)
    assert got_logq.dtype == torch.float32 and got_tokens.dtype == torch.int64
    assert got_logq.shape == got_tokens.shape == (3, 4, k)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logq, want_logq, rtol=0, atol=2e-5)
    assert bool((got_logq[..., :-1] >= got_logq[..., 1:]).all())  # descending


def test_sub_chunks_are_the_most_that_divide_the_vocabulary_and_fit_the_lanes():
    """Qwen3's vocabulary (151,936 = 2^7 x 1187) takes 128-logit sub-chunks at k <= 16, fewer
    where k's candidates would pass CANDIDATE_LANES; other vocabularies the most that divide them."""
    assert [draft_topk.sub_chunk(151_936, k) for k in (1, 16, 17, 32, 64, 128)] == [128, 128, 64, 64, 32, 16]
    assert [draft_topk.sub_chunk(v, 4) for v in (16 * 70, 16 * 83, 128 * 12, 64 * 9)] == [32, 16, 64, 32]
    assert draft_topk.sub_chunk(128 * 64, 16) == 128 and draft_topk.sub_chunk(128 * 12, 16) == 16  # k sub-chunks x 4


@pytest.mark.parametrize("k", [3, 16, 40])
def test_triton_equals_reference_at_every_sub_chunk_size(k):
    """A vocabulary of 128 x 40 takes sub-chunks of 128 (k = 3), 64 (k = 16: 4 x 16 x 64 <= V) and
    32 (k = 40: 2048 candidate lanes / 64)."""
    gen = torch.Generator().manual_seed(k)
    vocab = 128 * 40
    assert [draft_topk.sub_chunk(vocab, j) for j in (3, 16, 40)] == [128, 64, 32]
    logits = (torch.randn(5, vocab, generator=gen) * 4).to(DEVICE)
    got_logq, got_tokens = top_logprobs_triton(logits, k)
    want_logq, want_tokens = top_logprobs_reference(logits, k)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logq, want_logq, rtol=0, atol=2e-5)


@pytest.mark.parametrize("seed", range(3))
def test_triton_takes_the_largest_values_when_logits_tie(seed):
    # bfloat16 logits from a few levels: many ties, also at the k-th value. Any of the tied
    # tokens may be taken (as with torch.topk); the values taken must be the largest ones.
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 16 * 64, 12
    logits = torch.randint(0, 6, (2, 3, vocab), generator=gen).to(torch.bfloat16).to(DEVICE)
    got_logq, got_tokens = top_logprobs_triton(logits, k)
    want_logq, _ = top_logprobs_reference(logits, k)
    torch.testing.assert_close(got_logq, want_logq, rtol=0, atol=2e-5)
    taken = logits.gather(-1, got_tokens).float()
    assert torch.equal(taken, logits.float().topk(k, dim=-1).values)
    assert all(len(set(row)) == k for row in got_tokens.view(-1, k).tolist())  # distinct tokens


def test_infinite_and_nan_rows_match_log_softmax():
    vocab, k = 16 * 32, 4
    logits = torch.randn(4, vocab)
    logits[0, ::2] = float("-inf")  # half the tokens impossible
    logits[1, :] = float("-inf")  # every token impossible: NaN log-probs (as log_softmax)
    logits[2, 77] = float("nan")
    logits[3, 5] = float("inf")  # one certain token: log-prob 0, the rest -inf... and NaN (inf - inf)
    logits = logits.to(DEVICE)
    got_logq, got_tokens = top_logprobs_triton(logits, k)
    want_logq, want_tokens = top_logprobs_reference(logits, k)
    assert torch.equal(got_tokens[0], want_tokens[0])
    torch.testing.assert_close(got_logq[0], want_logq[0], rtol=0, atol=2e-5)
    assert bool(got_logq[1:3].isnan().all()) and bool(want_logq[1:3].isnan().all())
    assert torch.equal(got_logq[3].isnan(), want_logq[3].isnan())


def test_dispatch_and_argument_checks(monkeypatch, kernel_env):
    logits = torch.randn(2, 16 * 40)
    kernel_env(BACKEND_ENV, None)
    if DEVICE == "cpu":  # the reference on CPU tensors
        calls = []
        monkeypatch.setattr(draft_topk, "top_logprobs_triton", lambda *a: calls.append(a))
        top_logprobs(logits, 4)
        assert calls == []
    kernel_env(BACKEND_ENV, "triton")
    # Not a multiple of MIN_SUB; k * MIN_SUB above a quarter of V; k above WIDE_K on fewer rows than TRITON_MIN_ROWS.
    for rows, vocab, k in ((2, 16 * 40 + 3, 4), (2, 16 * 40, 40), (1, 16 * 200, 40)):
        x = torch.randn(rows, vocab)
        values, tokens = top_logprobs(x, k)  # falls back to the reference
        want_values, want_tokens = top_logprobs_reference(x, k)
        assert torch.equal(values, want_values) and torch.equal(tokens, want_tokens)
    calls = []
    monkeypatch.setattr(draft_topk, "top_logprobs_triton", lambda *a: calls.append(a))
    top_logprobs(logits, 4)  # k at most WIDE_K: at any row count, one row too
    top_logprobs(logits[:1], 4)
    top_logprobs(torch.randn(2, 16 * 200), 40)  # k above WIDE_K: two rows, at TRITON_MIN_ROWS
    assert len(calls) == 3
    with pytest.raises(ValueError, match="multiple of 16"):
        top_logprobs_triton(torch.randn(2, 16 * 40 + 3), 4)
    with pytest.raises(ValueError, match="0 < k"):
        top_logprobs_triton(logits, 41)


@pytest.mark.parametrize("seed", range(3))
def test_trees_are_the_same_with_either_top_k(seed, kernel_env):
    rng = np.random.default_rng(seed)
    sessions, depths, vocab = 5, 6, 16 * 100  # budget 24: 24 * 16 * 4 <= vocab, so the Triton pass runs
    logits = torch.from_numpy(rng.normal(size=(sessions, depths, vocab)) * 2).float().to(DEVICE)
    roots, budgets = rng.integers(0, vocab, sessions).tolist(), [0, 3, 9, 16, 24]
    kernel_env(BACKEND_ENV, "reference")
    want = select_ddtrees(logits, roots, budgets)
    kernel_env(BACKEND_ENV, "triton")
    got = select_ddtrees(logits, roots, budgets)
    for a, b in zip(got.trees(), want.trees()):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.next_token, b.next_token)
        assert torch.equal(a.next_sibling, b.next_sibling)


def test_bench_reports_both_paths(tmp_path):
    from bench.draft_topk import main

    out = tmp_path / "dt.json"
    # The machine's device: on a CUDA machine Triton does not run interpreted, so not on CPU tensors.
    res = main(["--small", "--batches", "1", "--reps", "1", "--device", DEVICE, "--out-json", str(out)])
    (row,) = res["rows"]
    assert row["same_values"] and row["max_logq_diff"] < 1e-5 and row["rows"] == 15
    assert row["reference_us"] > 0 and row["triton_us"] > 0 and row["build_trees_wall_us"] > 0
    assert json.loads(out.read_text())["rows"] == res["rows"]


def test_warm_up_compiles_one_variant_per_rank_lanes_and_sub_chunk(monkeypatch):
    """Every k up to 16 shares the row kernel's rank lanes (the adaptive budget moves between them
    step by step); at Qwen3's vocabulary they share its sub-chunk too, so k up to 64 compile three
    variants. The warm-up runs one k of each variant the dispatch can take, and nothing for a
    vocabulary the Triton path does not take."""
    assert {draft_topk.rank_lanes(k) for k in range(1, 17)} == {16}
    assert [draft_topk.rank_lanes(k) for k in (17, 32, 33, 64)] == [32, 32, 64, 64]
    assert draft_topk.variants(151_936, 64) == {(16, 128): 1, (32, 64): 17, (64, 32): 33}
    draft_topk.warm_up(torch.device(DEVICE), 16 * 64, torch.float32, max_k=20)  # runs for real
    calls = []
    monkeypatch.setattr(draft_topk, "top_logprobs_triton", lambda logits, k: calls.append((tuple(logits.shape), k)))
    draft_topk.warm_up(torch.device(DEVICE), 16 * 64, torch.bfloat16, max_k=40)
    # k <= 16 go to the Triton path at V = 1024 (4 k x 16 <= V), in four sub-chunk sizes.
    assert calls == [((1, 16 * 64), k) for k in (1, 3, 5, 9)]
    assert {(draft_topk.rank_lanes(k), draft_topk.sub_chunk(16 * 64, k)) for k in range(1, 17)} == set(
        draft_topk.variants(16 * 64, 40))
    calls.clear()
    draft_topk.warm_up(torch.device(DEVICE), 16 * 64 + 3, torch.bfloat16)  # no Triton path for this vocabulary
    assert calls == []