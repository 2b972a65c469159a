"""The verifier may apply the draft's fc + hidden_norm before the features go on the wire:
the drafter's context, block logits and trees are the same either way (float32)."""
import pytest
import torch

from common.config import load_draft_config
from common.feature_projection import FeatureProjection, projection_fingerprint
from common.make_tiny import TinySizes, make_tiny
from common.protocol import SamplingParams
from drafter_svc.ddtree import build_ddtrees
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import VerifierLimits


def _features(pair, projected: bool, prompts):
    target_dir, draft_dir = pair
    model = TargetModel.from_pretrained(target_dir, load_draft_config(draft_dir).target_layer_ids)
    if projected:
        model.feature_projection = FeatureProjection.from_draft(draft_dir)
    runner = TargetRunner(model, num_slots=len(prompts), max_seq_len=128, max_tree_nodes=17)
    _, feats = runner.prefill(list(range(len(prompts))), [torch.tensor(p) for p in prompts])
    return model, feats


def test_verifier_projection_equals_the_drafters(qwen3_pair):
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11]]
    raw_model, raw = _features(qwen3_pair, False, prompts)
    proj_model, proj = _features(qwen3_pair, True, prompts)
    draft_fc = FeatureProjection.from_draft(qwen3_pair[1])
    assert proj_model.feature_dim == raw_model.cfg.hidden_size < raw_model.feature_dim == raw[0].shape[1]
    for r, p in zip(raw, proj):
        assert p.shape == (r.shape[0], raw_model.cfg.hidden_size)
        torch.testing.assert_close(p, draft_fc(r), rtol=1e-5, atol=1e-5)


def test_drafter_trees_are_the_same_either_way(qwen3_pair):
    """Two proposers on one draft, one given raw features and one context rows: same block
    logits and identical DDTrees, over a prompt and then two rounds of new rows, batched."""
    target_dir, draft_dir = qwen3_pair
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 70))]
    _, raw = _features(qwen3_pair, False, prompts)
    proj = [FeatureProjection.from_draft(draft_dir)(f) for f in raw]
    proposers = [DFlashProposer.from_pretrained(draft_dir, target_dir, slots=4, projected_features=p)
                 for p in (False, True)]
    assert proposers[0].projection_fingerprint() == proposers[1].projection_fingerprint()
    feats_of = (raw, proj)
    states = [[pr.start(p, f[:-3]) for p, f in zip(prompts, feats)] for pr, feats in zip(proposers, feats_of)]
    gen = torch.Generator().manual_seed(0)
    for rows in (slice(-3, -1), slice(-1, None)):  # two rounds: 2 new rows per session, then 1
        new = [[f[rows] for f in feats] for feats in feats_of]
        roots = torch.randint(0, 100, (len(prompts),), generator=gen).tolist()
        logits = [pr.propose(st, roots, [[r] for r in roots], n) for pr, st, n in zip(proposers, states, new)]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        for budget in (4, 16, 32):
            trees = [build_ddtrees(lg, roots, [budget] * len(roots)) for lg in logits]
            for a, b in zip(*trees):
                assert a.num_nodes == budget + 1
                for x, y in ((a.tokens, b.tokens), (a.next_token, b.next_token), (a.next_sibling, b.next_sibling)):
                    assert torch.equal(x, y)


def test_a_projecting_local_engine_generates_as_the_plain_one(qwen3_pair):
    """`LocalEngine.load(projected=True)` (the target projects, as the verifier service does given
    --draft): greedy and seeded outputs and their rounds equal the engine whose draft projects."""
    engines = [LocalEngine.load(str(qwen3_pair[0]), str(qwen3_pair[1]), projected=p,
                                limits=VerifierLimits(max_sessions=2, max_seq_len=128)) for p in (False, True)]
    assert engines[1].verifier.runner.model.feature_projection is not None and engines[1].proposer.projected
    for prompt, sampling in (([5, 17, 42, 99, 3], SamplingParams()),
                             (list(range(60, 90)), SamplingParams(0.9, 20, 1.0, 3))):
        config = GenerationConfig(max_new_tokens=20, sampling=sampling, mode=DraftMode("tree", 8))
        plain, projected = (e.generate(prompt, config) for e in engines)
        assert projected.tokens == plain.tokens and projected.acceptance_lengths == plain.acceptance_lengths


def test_fingerprint_is_dtype_independent_and_tells_drafts_apart(qwen3_pair, tmp_path, tiny_tokenizer):
    draft_dir = qwen3_pair[1]
    f32 = FeatureProjection.from_draft(draft_dir)
    bf16 = FeatureProjection.from_draft(draft_dir, dtype=torch.bfloat16)
    assert f32.fingerprint() == bf16.fingerprint() == projection_fingerprint(f32.fc.weight, f32.hidden_norm.weight)
    other = make_tiny(tmp_path, seed=7, sizes=TinySizes(), tokenizer=tiny_tokenizer)[1]
    assert FeatureProjection.from_draft(other).fingerprint() != f32.fingerprint()
    changed = f32.fc.weight.clone()
    changed[0, 0] += 1.0  # the first element is always in the sample
    assert projection_fingerprint(changed, f32.hidden_norm.weight) != f32.fingerprint()


def test_projection_needs_matching_widths(qwen3_pair, tmp_path, tiny_tokenizer):
    from common.config import CheckpointError
    from verifier_svc.server import VerifierConfig, load_verifier

    other = make_tiny(tmp_path, seed=7, sizes=TinySizes(hidden=32), tokenizer=tiny_tokenizer)[1]
    cfg = VerifierConfig(target_dir=str(qwen3_pair[0]), projection_dir=str(other),
                         feature_layer_ids=load_draft_config(qwen3_pair[1]).target_layer_ids, device="cpu",
                         max_sessions=1, max_seq_len=64)
    with pytest.raises(CheckpointError, match="fc takes"):
        load_verifier(cfg)
