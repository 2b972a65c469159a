"""Prompt chunks riding a verify's forward (`TreeVerifier`'s mixed prompts): a step's opens and
extends beside its trees go in as prompt segments, rows of the verify's width with no tree, and
give the same first tokens, logprobs, features, K/V and later rounds as a prefill of their own
(float32); the segments' rows never change the trees' results; and a verify under graphs takes
them in only where that costs less than a prefill apart."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.protocol import ExtendEntry, OpenEntry, Prefilled, SamplingParams, TreeEntry, Verified
from common.tree import DraftTree
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits

LAYERS = (0, 1)
GREEDY = SamplingParams()


def verifier(target, mix: bool, device: str = "cpu", graph_config: GraphConfig | None = None) -> TreeVerifier:
    """A float32 verifier of 6 sessions (eager; under CUDA graphs of `graph_config` on a GPU)."""
    model = TargetModel.from_pretrained(target, LAYERS, device=device)
    runner = TargetRunner(model, 6, 128, 17, graph_config=graph_config)
    v = TreeVerifier(runner, VerifierLimits(max_sessions=6, max_seq_len=128, max_tree_nodes=17))
    v.mix_prompts = mix
    return v


def random_tree(rng: np.random.Generator, root: int, nodes: int, vocab: int) -> DraftTree:
    """A tree of `nodes` nodes under `root`, random parents, every token distinct (so are siblings')."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
    tokens = [root] + rng.choice(vocab, nodes - 1, replace=False).tolist()
    return DraftTree.from_parents(tokens, parents)


def run(v: TreeVerifier, entries) -> tuple[list, bool]:
    """One step's outcomes, and whether its verify took prompt chunks in."""
    pending = v.begin([("d", e) for e in entries])
    mixed = pending.verify is not None and pending.verify.mixed is not None
    return [r.outcome if r is not None else None for r in v.finish(pending)], mixed


def assert_same(got, want) -> None:
    assert type(got) is type(want), (got, want)
    torch.testing.assert_close(got.features.float(), want.features.float(), rtol=1e-4, atol=1e-4)
    if isinstance(want, Verified):
        assert (got.accepted_tokens, got.next_token) == (want.accepted_tokens, want.next_token)
    if isinstance(want, Prefilled):
        assert got.token == want.token
        assert (got.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None:
            (g,), (w,) = got.logprobs, want.logprobs
            assert g.token == w.token and g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_prompts_in_a_verify_equal_their_own_prefill(tiny_pair):
    """Trees of two sessions, with in the same step: a 37-token open (three segments at the
    verify's 16-node width) that samples with penalties and asks for logprobs, a 5-token open that
    wants no features, and the last chunk of a prompt opened in chunks. Mixed into the verify, every
    result equals the step's twin with a prefill of their own, and so do the committed K/V, the
    penalties' counts and two later rounds of trees for every session (which read the K/V the
    segments wrote)."""
    check_mixed_equals_apart([verifier(tiny_pair[0], mix=True), verifier(tiny_pair[0], mix=False)])


def check_mixed_equals_apart(twins: list[TreeVerifier]) -> None:
    """`test_prompts_in_a_verify_equal_their_own_prefill` on two verifiers: mixing, and not."""
    vocab = twins[0].vocab_size
    rng = np.random.default_rng(3)
    prompt = lambda n: rng.integers(1, vocab, n).tolist()  # noqa: E731
    keyed = SamplingParams(temperature=0.8, top_k=20, seed=11, presence_penalty=0.5, repetition_penalty=1.2)
    opens = [OpenEntry(1, prompt(9), GREEDY, feature_layer_ids=LAYERS),
             OpenEntry(2, prompt(12), SamplingParams(temperature=0.9, seed=3, frequency_penalty=0.3),
                       feature_layer_ids=LAYERS),
             OpenEntry(5, prompt(20), GREEDY, feature_layer_ids=LAYERS, more=True)]
    later = [OpenEntry(3, prompt(37), keyed, feature_layer_ids=LAYERS, logprobs=2),
             OpenEntry(4, prompt(5), GREEDY), ExtendEntry(5, prompt(14))]
    results = []
    for v in twins:
        first, mixed = run(v, opens)
        assert not mixed  # no trees: a prefill of their own
        roots = {sid: o.token for sid, o in zip((1, 2), first)}
        tree_rng = np.random.default_rng(1)  # the same trees for both
        trees = [TreeEntry(sid, 1, random_tree(tree_rng, roots[sid], 16, vocab)) for sid in (1, 2)]
        second, mixed = run(v, trees + later)
        assert mixed == v.mix_prompts
        results.append((first, second))
    for (first, second), (want_first, want_second) in zip(results[:1], results[1:]):
        for got, want in zip(first + second, want_first + want_second):
            assert_same(got, want)
    opened = results[0][1][2:]  # the mixed twin's opens of sessions 3 and 4, and the extend of 5
    assert [o.features.shape[0] for o in opened] == [37, 0, 14]
    mixed, apart = (v.runner for v in twins)
    for key, s in twins[1]._sessions.items():  # the committed K/V, and the repetition penalties' counts
        other = twins[0]._sessions[key]
        assert (other.slot, other.length) == (s.slot, s.length)
        for cache in ("k", "v"):
            torch.testing.assert_close(getattr(mixed.cache, cache)[:, s.slot, :, :s.length],
                                       getattr(apart.cache, cache)[:, s.slot, :, :s.length], rtol=1e-4, atol=1e-4)
    assert torch.equal(mixed.penalties.generated, apart.penalties.generated)
    assert torch.equal(mixed.penalties.context, apart.penalties.context)

    rounds = {v: {} for v in twins}
    for v, (first, second) in zip(twins, results):
        rounds[v] = {1: second[0].next_token, 2: second[1].next_token, 3: second[2].token, 4: second[3].token,
                     5: second[4].token}
    for step in (2, 3):
        outs = []
        for v in twins:
            tree_rng = np.random.default_rng(step)  # the same trees for both
            entries = [TreeEntry(sid, step if sid < 3 else step - 1, random_tree(tree_rng, root, 9, vocab))
                       for sid, root in sorted(rounds[v].items())]
            out, _ = run(v, entries)
            rounds[v] = {e.session_id: o.next_token for e, o in zip(entries, out)}
            outs.append(out)
        for got, want in zip(*outs):
            assert_same(got, want)


def test_a_step_whose_trees_all_fail_prefills_its_prompts_apart(tiny_pair):
    """With no good tree there is no verify to ride: the prompts are prefilled on their own."""
    v = verifier(tiny_pair[0], mix=True)
    first, _ = run(v, [OpenEntry(1, [5, 6, 7], GREEDY, feature_layer_ids=LAYERS)])
    bad = DraftTree.from_parents([first[0].token + 1, 4], [-1, 0])  # not rooted at the first token
    out, mixed = run(v, [TreeEntry(1, 1, bad), OpenEntry(2, [8, 9], GREEDY, feature_layer_ids=LAYERS)])
    assert not mixed and out[0].status == "INVALID_ARGUMENT" and isinstance(out[1], Prefilled)
    assert out[1].features.shape[0] == 2


def test_under_graphs_prompts_ride_the_verify_only_where_it_costs_less(tiny_pair):
    """The cost rule (`TargetRunner.mixing_pays`), with graphs' buckets (not captured): a verify
    takes the segments while its padded tokens are at most the trees' verify and the prefill apart
    plus one weight pass (`MIXED_FORWARD_TOKENS`), and never without a graph for the mixed batch."""
    model = TargetModel.from_pretrained(tiny_pair[0], LAYERS)
    runner = TargetRunner(model, 32, 256, 129)
    config = GraphConfig(tree_buckets=(15, 31, 127), batch_buckets=(1, 16, 32, 40, 64), kv_buckets=(256,),
                         prefill_batches=(1, 2, 4))
    runner.graphs = VerifyGraphs(model, runner.cache, 256, runner.scratch_slot, config, capture=False)
    assert runner.graphs.batch_buckets == (1, 16, 32, 40, 48)  # up to the 32 sessions and half as many again
    assert runner.row_width(12) == 16 and runner.row_width(16) == 16 and runner.row_width(17) == 32
    assert runner.MIXED_FORWARD_TOKENS == 256
    # 15 trees and a 128-token prompt (8 segments): 32 x 16 = 512 <= 16 x 16 + 1 x 128 + 256
    assert runner.mixing_pays("greedy", 15, 8, 16, 200, [128])
    # 31 trees: 40 x 16 = 640 <= 32 x 16 + 128 + 256
    assert runner.mixing_pays("greedy", 31, 8, 16, 200, [128])
    # 16 trees of 32 nodes and a 100-token prompt (4 segments): 32 x 32 = 1024 > 16 x 32 + 1 x 128 + 256
    assert not runner.mixing_pays("greedy", 16, 4, 32, 200, [100])
    assert not runner.mixing_pays("greedy", 40, 9, 16, 200, [140])  # 49 rows: no graph
    runner.graphs = None  # eager: one forward of the same rows beats two, within max_tokens (logits for each node)
    assert runner.mixing_pays("greedy", 60, 8, 16, 200, [128])
    assert runner.graph_config.max_tokens == 4096
    assert runner.mixing_pays("greedy", 192, 64, 16, 200, [1024]) and not runner.mixing_pays(
        "greedy", 193, 64, 16, 200, [1024])
