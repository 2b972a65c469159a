"""The shipped pair (models/default): the trained draft really drafts, and greedy output is
still exactly the target's own, token for token, on held-out prompts."""
from pathlib import Path

import pytest

from bench.acceptance import load_prompts
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from verifier_svc.tree_verifier import VerifierLimits

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "models" / "default"


@pytest.fixture(scope="module")
def engine():
    return LocalEngine.load(str(PAIR / "target"), str(PAIR / "draft"), limits=VerifierLimits(max_sessions=1))


def test_greedy_equals_ar_on_heldout_prompts(engine):
    prompts = load_prompts(PAIR / "target", engine.tokenizer, 3, 48)
    assert len(prompts) == 3
    acceptance = []
    for _, ids in prompts:
        ar = engine.generate(ids, GenerationConfig(48, mode=DraftMode("ar", 0))).tokens
        for mode in (DraftMode("chain", 0), DraftMode("tree", 16), DraftMode("tree", 32)):
            out = engine.generate(ids, GenerationConfig(48, mode=mode))
            assert out.tokens == ar, f"{mode} differs from AR"
            acceptance.append(out.mean_acceptance)
    # A trained draft accepts well above one token per round (random weights give ~1.0).
    assert sum(acceptance) / len(acceptance) > 2.5, acceptance
