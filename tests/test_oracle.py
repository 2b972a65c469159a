"""The benchmark-only controlled acceptance (drafter_svc/oracle.py): each depth of a round hits
with the set probability, independently (a geometric run), whatever the batch; edits stop for a
session whose output left the continuation."""
from __future__ import annotations

import math

import pytest
import torch

from drafter_svc.oracle import ControlledAcceptance


@pytest.mark.parametrize("p", [0.5, 0.8445, 0.95])
def test_runs_are_geometric(p):
    """P(run >= j) = p^j, capped at the span: the mean run and the share of runs of at least 1
    and 3 match, over 40,000 (prompt, length) keys (4 standard deviations)."""
    hook = ControlledAcceptance(p, {})
    n, span = 40_000, 15
    runs = [hook._run(hash((0, 128, k, (1, 2, 3))), span) for k in range(n)]
    assert all(0 <= r <= span for r in runs)
    mean = sum(p ** j for j in range(1, span + 1))
    var = sum((2 * j - 1) * p ** j for j in range(1, span + 1)) - mean ** 2
    assert abs(sum(runs) / n - mean) < 4 * math.sqrt(var / n)
    for j in (1, 3):
        share = sum(r >= j for r in runs) / n
        assert abs(share - p ** j) < 4 * math.sqrt(p ** j * (1 - p ** j) / n)


def test_edits_follow_the_continuation_and_stop_where_the_output_leaves_it():
    """A session's block gets its continuation's next tokens as the top candidates up to the run
    and the miss removed; the same (prompt, length) gives the same edits alone or in a batch; an
    output that left the continuation gets none, also when it grows later."""
    truth = list(range(100, 140))
    prompt, other = [1, 2, 3], [4, 5, 6]
    hook = ControlledAcceptance(0.9, {tuple(prompt): truth, tuple(other): truth[::-1]}, seed=5)
    out = truth[:4]
    alone = torch.zeros(1, 6, 200)
    hook([prompt], [out], 6)(alone)
    batched = torch.zeros(2, 6, 200)
    hook([other, prompt], [truth[::-1][:2], out], 6)(batched)
    assert torch.equal(batched[1], alone[0])
    top = alone[0].argmax(-1).tolist()
    run = next((d for d in range(6) if alone[0, d, truth[4 + d]] != alone[0, d].max()), 6)
    assert top[:run] == truth[4: 4 + run]
    if run < 6:
        assert alone[0, run, truth[4 + run]] == float("-inf")
    wrong = truth[:3] + [7]
    assert hook([prompt], [wrong], 6) is None
    wrong.append(truth[4])  # grows after leaving it: still none
    assert hook([prompt], [wrong], 6) is None
    assert hook([[9, 9]], [[1]], 6) is None  # no continuation known


@pytest.mark.parametrize("p", [0.3, 0.8445])
def test_edited_depths_are_a_calibrated_draft(p):
    """Every depth of an edited session has a top candidate of probability p (the true token up
    to the run, another one at the miss, whose true token is gone, and past it) and the other
    candidates share the rest evenly; a session without a continuation keeps its logits."""
    torch.manual_seed(0)
    truth = list(range(100, 140))
    prompt, unknown = [1, 2, 3], [7, 7]
    hook = ControlledAcceptance(p, {tuple(prompt): truth}, seed=3)
    misses = 0
    for n in [*range(1, 41, 2), 40]:  # to the continuation's end (span 0)
        logits = torch.randn(2, 8, 300) * 2.0
        raw = logits.clone()
        hook([prompt, unknown], [truth[:n], [5]], 8)(logits)
        assert torch.equal(logits[1], raw[1])
        probs = logits[0].softmax(-1)
        best, top = probs.topk(2, -1)
        assert torch.allclose(best[:, 0], torch.full((8,), p), atol=1e-3)
        assert torch.allclose(best[:, 1], (1 - best[:, 0]) / ((probs > 0).sum(-1) - 1))  # the rest, evenly
        span = min(8, len(truth) - n)
        run = next((d for d in range(span) if top[d, 0] != truth[n + d]), span)
        assert top[:run, 0].tolist() == truth[n: n + run]
        if run < span:  # the miss: its true token is gone
            assert probs[run, truth[n + run]] == 0.0
            misses += 1
    assert misses > 0
