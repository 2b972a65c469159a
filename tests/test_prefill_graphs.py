"""Prefill through the verify graphs' "forward" mode (`GraphConfig.prefill_batches`): a prompt
chunk as a chain tree gives the eager prefill's K/V, features and last logits (float32), chunk
after chunk; a batch or chunk that no graph fits runs eagerly; through the TreeVerifier, opens
and the rounds after them answer as with eager prefills. On the CPU the graph path runs its
static-shape code eagerly (`VerifyGraphs(capture=False)`), as the GPU tests' graphs replay it."""
from __future__ import annotations

import pytest
import torch

from common.protocol import OpenEntry, Prefilled, SamplingParams, TreeEntry, Verified
from common.tree import DraftTree
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits

MAX_SEQ = 64
CLOSE = dict(atol=1e-4, rtol=1e-4)  # float32; the padded shapes sum in another order
CONFIG = GraphConfig(tree_buckets=(8, 16), batch_buckets=(1, 2, 4), kv_buckets=(32, 96), prefill_batches=(1, 2))


def runners(target_dir, config: GraphConfig = CONFIG) -> tuple[TargetRunner, TargetRunner]:
    """(eager, graphed) runners of the same weights, three sessions each."""
    eager = TargetRunner(TargetModel.from_pretrained(target_dir, (0, 1)), 3, MAX_SEQ, 17)
    graphed = TargetRunner(TargetModel.from_pretrained(target_dir, (0, 1)), 3, MAX_SEQ, 17)
    graphed.graphs = VerifyGraphs(graphed.model, graphed.cache, MAX_SEQ, graphed.scratch_slot, config, capture=False)
    return eager, graphed


def chunks(seed: int, sizes: list[int], vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in sizes]


def test_chunks_through_the_graphs_equal_the_eager_prefill(tiny_pair):
    eager, graphed = runners(tiny_pair[0])
    vocab = eager.model.cfg.vocab_size
    lengths = [0, 0]
    for step, sizes in enumerate(([10, 17], [5, 3], [16])):
        prompts = chunks(step, sizes, vocab)
        slots = [0, 1][: len(sizes)]
        pasts = lengths[: len(sizes)]
        want_logits, want_features = eager.prefill(slots, prompts, pasts)
        got_logits, got_features = graphed._prefill_graphed(slots, prompts, pasts)  # what prefill() takes first
        torch.testing.assert_close(got_logits, want_logits, **CLOSE)
        for got, want in zip(got_features, want_features):
            torch.testing.assert_close(got, want, **CLOSE)
        for i, n in enumerate(sizes):
            lengths[i] += n
    for slot, n in enumerate(lengths):  # every layer's K/V of the prompts, where later steps read them
        torch.testing.assert_close(graphed.cache.k[:, slot, :, :n], eager.cache.k[:, slot, :, :n], **CLOSE)
        torch.testing.assert_close(graphed.cache.v[:, slot, :, :n], eager.cache.v[:, slot, :, :n], **CLOSE)


def test_prefill_takes_the_graph_path_when_one_fits(tiny_pair, monkeypatch):
    _, graphed = runners(tiny_pair[0])
    calls = []
    run = graphed.graphs.run
    monkeypatch.setattr(graphed.graphs, "run", lambda *args: calls.append(args[0]) or run(*args))
    graphed.prefill([0], chunks(4, [9], graphed.model.cfg.vocab_size))
    assert calls == ["forward"]


def test_what_no_graph_fits_runs_eagerly(tiny_pair):
    eager, graphed = runners(tiny_pair[0])
    vocab = eager.model.cfg.vocab_size
    too_long = chunks(1, [20], vocab)  # past the largest bucket (17 tokens)
    too_many = chunks(2, [4, 4, 4], vocab)  # past the largest prefill batch (2)
    for slots, prompts in (([0], too_long), ([0, 1, 2], too_many)):
        assert graphed._prefill_graphed(slots, prompts, [0] * len(slots)) is None
        want_logits, _ = eager.prefill(slots, prompts)
        got_logits, _ = graphed.prefill(slots, prompts)
        torch.testing.assert_close(got_logits, want_logits, **CLOSE)
    eager_only = runners(tiny_pair[0], GraphConfig(tree_buckets=(8, 16), batch_buckets=(1, 2), kv_buckets=(32, 96)))[1]
    assert eager_only._prefill_graphed([0], chunks(3, [5], vocab), [0]) is None  # no prefill graphs configured


def test_opens_and_rounds_through_the_verifier_match_eager_prefills(tiny_pair):
    limits = VerifierLimits(max_sessions=3, max_seq_len=MAX_SEQ, max_tree_nodes=17)
    verifiers = [TreeVerifier(runner, limits) for runner in runners(tiny_pair[0])]
    vocab = verifiers[0].vocab_size
    prompts = [p.tolist() for p in chunks(7, [12, 6], vocab)]
    answers = []
    for verifier in verifiers:
        opened = verifier.step([("d", OpenEntry(i, p, SamplingParams(), feature_layer_ids=(0, 1)))
                                for i, p in enumerate(prompts)])
        firsts = [r.outcome for r in opened]
        assert all(isinstance(o, Prefilled) for o in firsts)
        trees = [DraftTree.from_parents([o.token, 3, 4, 5], [-1, 0, 0, 1]) for o in firsts]
        verified = verifier.step([("d", TreeEntry(i, 1, tree)) for i, tree in enumerate(trees)])
        assert all(isinstance(r.outcome, Verified) for r in verified)
        answers.append((firsts, [r.outcome for r in verified]))
    (eager_first, eager_round), (graph_first, graph_round) = answers
    for want, got in zip(eager_first, graph_first):
        assert got.token == want.token
        torch.testing.assert_close(got.features, want.features, **CLOSE)
    for want, got in zip(eager_round, graph_round):
        assert (got.accepted_tokens, got.next_token) == (want.accepted_tokens, want.next_token)
        torch.testing.assert_close(got.features, want.features, **CLOSE)


def test_config_rejects_a_bad_prefill_batch():
    with pytest.raises(ValueError, match="prefill_batches"):
        GraphConfig(prefill_batches=(0, 2)).check()


def test_the_startup_line_says_how_prompts_prefill(tiny_pair):
    from verifier_svc.server import startup_summary

    eager, graphed = runners(tiny_pair[0])
    limits = VerifierLimits(max_sessions=3, max_seq_len=MAX_SEQ, max_tree_nodes=17)
    assert "eager prefills" in startup_summary(TreeVerifier(eager, limits))  # no graphs on the CPU
    assert "prefills through graphs" in startup_summary(TreeVerifier(graphed, limits))
