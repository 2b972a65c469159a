"""Overlapped verifier steps on the GPU (`TreeVerifier.begin` / `finish`, as the model worker runs
them when a link pipelines): the next step's inputs, graph replay and result copies are queued
while the previous step's forward still runs, and both steps may replay the same CUDA graph
(same batch and tree bucket, so the same input and output buffers). Each step's results must be
those of the same steps run one after another.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import load_draft_config
from common.protocol import CloseEntry, OpenEntry, Prefilled, SamplingParams, TreeEntry, Verified
from common.tree import DraftTree
from verifier_svc.server import VerifierConfig, load_verifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 90)), [7, 300, 12, 450, 33, 8, 2], [100, 200, 300],
           [9, 8, 7, 6], list(range(200, 240))]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, top_k=50, seed=7), SamplingParams(),
             SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(), SamplingParams()]


def random_tree(root: int, rng: np.random.Generator, vocab: int) -> DraftTree:
    n = int(rng.integers(1, 12))
    parents = [-1] + [int(rng.integers(0, i + 1)) for i in range(n)]
    tokens = [root] + [int(t) for t in rng.choice(vocab, n, replace=False)]
    return DraftTree.from_parents(tokens, parents)


def twin_verifiers(qwen3_pair, dtype: str, max_sessions: int):
    """Two verifiers on the GPU with the same six sessions opened (CUDA graphs, prefill graphs
    too); returns both, the feature layers and the sessions' first tokens."""
    layers = load_draft_config(qwen3_pair[1]).target_layer_ids
    config = VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, device="cuda", dtype=dtype,
                            max_sessions=max_sessions, max_seq_len=256, max_tree_nodes=17, max_tree_depth=16,
                            graph_batches=(1, 2, 4), graph_trees=(0, 8, 16), measure_costs="off", prefill_graphs=True)
    overlapped, sequential = load_verifier(config), load_verifier(config)
    opens = [("L", OpenEntry(i + 1, p, s, "", tuple(layers))) for i, (p, s) in enumerate(zip(PROMPTS, SAMPLINGS))]
    roots = {}
    for verifier in (overlapped, sequential):
        roots = {r.session_id: r.outcome.token for r in verifier.step(opens)}
    return overlapped, sequential, tuple(layers), roots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_steps_equal_steps_one_after_another(qwen3_pair, dtype):
    overlapped, sequential, _, roots = twin_verifiers(qwen3_pair, dtype, 6)
    vocab = overlapped.vocab_size
    rng = np.random.default_rng(0)
    groups = [[1, 2, 3], [4, 5, 6]]  # two halves, as a pipelining drafter sends them
    rounds = {sid: 0 for sid in roots}
    for step in range(12):
        if step % 3 == 2:
            groups = [[1, 2], [3, 4, 5, 6]] if len(groups[0]) == 3 else [[1, 2, 3], [4, 5, 6]]  # other buckets
        messages = []
        for group in groups:
            messages.append([("L", TreeEntry(sid, rounds[sid] + 1, random_tree(roots[sid], rng, vocab)))
                             for sid in group])
        pending = [overlapped.begin(m) for m in messages]  # the second is queued behind the first
        got = [overlapped.finish(p) for p in pending]
        want = [sequential.step(m) for m in messages]
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                assert isinstance(a.outcome, Verified) and isinstance(b.outcome, Verified)
                assert (a.outcome.accepted_tokens, a.outcome.next_token) == (b.outcome.accepted_tokens,
                                                                             b.outcome.next_token)
                assert torch.equal(a.outcome.features, b.outcome.features)
                roots[a.session_id] = a.outcome.next_token
                rounds[a.session_id] += 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_begun_behind_prefills_equals_steps_one_after_another(qwen3_pair, dtype):
    """A step's prefills are queued with its verify, and the next step (other sessions) begins
    before it finishes, replaying the same graphs (the prefill's "forward" graph and the verify's)
    before the first one's first tokens, logprobs and features are read: every result, prefills
    included, must be that of the two steps one after another."""
    overlapped, sequential, layers, roots = twin_verifiers(qwen3_pair, dtype, 10)
    vocab = overlapped.vocab_size
    rng = np.random.default_rng(1)
    rounds = {sid: 0 for sid in roots}

    def trees(group):
        return [("L", TreeEntry(sid, rounds[sid] + 1, random_tree(roots[sid], rng, vocab))) for sid in group]

    for step in range(6):
        new = [("L", OpenEntry(100 + 2 * step + j, PROMPTS[(step + j) % len(PROMPTS)][: 3 + step], SAMPLINGS[j],
                               "", layers, 2 if j else None)) for j in range(2)]  # one asks for logprobs
        ending = [("L", CloseEntry(100 + 2 * (step - 1) + j)) for j in range(2)] if step else []
        messages = [trees([1, 2, 3]) + new, trees([4, 5, 6]) + ending]
        pending = [overlapped.begin(m) for m in messages]  # the second is queued behind the first's prefill
        got = [overlapped.finish(p) for p in pending]
        want = [sequential.step(m) for m in messages]
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                if b is None:
                    assert a is None
                    continue
                assert type(a.outcome) is type(b.outcome) and isinstance(b.outcome, (Verified, Prefilled))
                if isinstance(b.outcome, Verified):
                    assert (a.outcome.accepted_tokens, a.outcome.next_token) == (b.outcome.accepted_tokens,
                                                                                 b.outcome.next_token)
                    roots[a.session_id] = a.outcome.next_token
                    rounds[a.session_id] += 1
                else:
                    assert (a.outcome.token, a.outcome.logprobs) == (b.outcome.token, b.outcome.logprobs)
                assert torch.equal(a.outcome.features, b.outcome.features)
