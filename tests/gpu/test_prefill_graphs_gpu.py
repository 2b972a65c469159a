"""Prefills replaying captured "forward" graphs on CUDA equal the eager prefill (float32):
logits, features and the prompts' K/V, chunk after chunk (tests/test_prefill_graphs.py runs the
same static-shape code eagerly on the CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.test_prefill_graphs import CLOSE, CONFIG, MAX_SEQ, chunks
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_prefill_graphs_equal_the_eager_prefill(tiny_pair):
    def runner(graphs: bool) -> TargetRunner:
        model = TargetModel.from_pretrained(tiny_pair[0], (0, 1), device="cuda")
        return TargetRunner(model, 3, MAX_SEQ, 17, cuda_graphs=graphs, graph_config=CONFIG)

    eager, graphed = runner(False), runner(True)
    assert any(key[0] == "forward" for key in graphed.graphs._graphs)
    vocab, lengths = eager.model.cfg.vocab_size, [0, 0]
    for step, sizes in enumerate(([10, 17], [5, 3], [16])):
        prompts = chunks(step, sizes, vocab)
        slots, pasts = [0, 1][: len(sizes)], lengths[: len(sizes)]
        want_logits, want_features = eager.prefill(slots, prompts, pasts)
        got = graphed._prefill_graphed(slots, prompts, pasts)
        assert got is not None
        torch.testing.assert_close(got[0], want_logits, **CLOSE)
        for g, w in zip(got[1], want_features):
            torch.testing.assert_close(g, w, **CLOSE)
        for i, n in enumerate(sizes):
            lengths[i] += n
    for slot, n in enumerate(lengths):
        torch.testing.assert_close(graphed.cache.k[:, slot, :, :n], eager.cache.k[:, slot, :, :n], **CLOSE)
        torch.testing.assert_close(graphed.cache.v[:, slot, :, :n], eager.cache.v[:, slot, :, :n], **CLOSE)
