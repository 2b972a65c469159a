"""The DFlash draft trainer (drafter_svc/train.py) on tiny random targets, on CPU.

The strongest check is `test_training_forward_equals_inference_forward`: the batched
training pass must give, for every block, what the serving path (a `DraftKVPool` slot filled
round by round with `extend`, then `block_hidden`) gives, so that a draft trained here
serves as trained.
"""
import json
import math

import pytest
import torch
from safetensors import safe_open

from common.config import load_draft_config
from common.make_tiny import TinySizes, make_tiny
from drafter_svc import train as T
from drafter_svc.draft_model import DFlashDraftModel, DraftKVPool
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from verifier_svc.target_model import TargetModel
from verifier_svc.tree_verifier import VerifierLimits

B = 8


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_tokenizer):
    """A tiny random Qwen3 target and its random draft (make_tiny's sizes: 4 layers, hidden 64)."""
    return make_tiny(tmp_path_factory.mktemp("train-tiny"), seed=5, sizes=TinySizes(), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((stdlib / "bisect.py").read_text() + (stdlib / "heapq.py").read_text()[:6000])
    return path


# -- recipe units ----------------------------------------------------------------------------------

def test_mask_block_sees_only_context_before_its_anchor_and_its_own_block():
    anchors = torch.tensor([[3, 5, 9, 9], [1, 2, 3, 12]])  # overlapping blocks, a repeated anchor
    seq_len = 16
    mask = T.dflash_training_mask(anchors, seq_len, B)
    n, a = anchors.shape
    assert mask.shape == (n, a * B, seq_len + a * B) and mask.dtype == torch.bool
    for i in range(n):
        for j in range(a):
            anchor = int(anchors[i, j])
            for k in range(B):
                row = mask[i, j * B + k]
                assert row[:anchor].all(), "all context before the anchor is visible"
                assert not row[anchor:seq_len].any(), "no context at or after the anchor"
                blocks = row[seq_len:].view(a, B)
                assert blocks[j].all(), "the own block is visible bidirectionally"
                others = torch.cat([blocks[:j], blocks[j + 1:]])
                assert not others.any(), "no other block is visible"


def test_labels_are_same_position_and_blocks_start_with_the_anchor_token():
    ids = torch.arange(100, 140)[None].repeat(2, 1)
    ids[1] += 1000
    anchors = torch.tensor([[0, 5, 32], [7, 7, 1]])
    labels = T.block_labels(ids, anchors, B)
    blocks = T.block_inputs(ids, anchors, B, mask_token_id=3)
    assert labels.shape == (2, 3, B - 1)
    for i in range(2):
        for j in range(3):
            a = int(anchors[i, j])
            for k in range(1, B):
                assert labels[i, j, k - 1] == ids[i, a + k]  # position k predicts token anchor + k
            assert blocks[i, j, 0] == ids[i, a] and (blocks[i, j, 1:] == 3).all()
    pos = T.block_positions(anchors, B).view(2, 3, B)
    assert (pos == anchors[..., None] + torch.arange(B)).all()


def test_batcher_anchors_fit_and_skip_the_prompt():
    lengths, loss_start = [40, 30, 12], [10, 1, 4]
    # Token value = 1000 * sequence + position, so a batch row tells where it was cut from.
    seqs = [1000 * i + torch.arange(n) for i, n in enumerate(lengths)]
    batcher = T.Batcher(T.TokenData(seqs, loss_start), seq_len=24, block_size=B, anchors=6, pad_id=-1, seed=0)
    for _ in range(20):
        ids, anchors, valid = batcher.sample(3)
        assert ids.shape[1] <= 24
        for i in range(3):
            seq, offset = divmod(int(ids[i, 0]), 1000)
            length = min(24, lengths[seq] - offset)
            assert valid[i].any()
            for a, ok in zip(anchors[i].tolist(), valid[i].tolist()):
                if ok:
                    assert offset + a >= max(1, loss_start[seq]), "anchors never sit inside the prompt"
                    assert a + B <= length, "the whole block fits in the sequence"
                    assert int(ids[i, a]) == 1000 * seq + offset + a


def test_loss_weights_and_layer_ids():
    w = T.position_weights(8)
    assert torch.allclose(w, torch.exp(-(torch.arange(1, 8) - 1) / 4.0))
    assert T.loss_gamma(16) == 7 and T.loss_gamma(8) == 4 and T.loss_gamma(10) == 5
    assert T.build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, as DFlash
    assert T.build_target_layer_ids(6, 2) == (1, 3)
    assert all(0 <= i < 3 for i in T.build_target_layer_ids(3, 2))


# -- training == serving ----------------------------------------------------------------------------

def test_training_forward_equals_inference_forward(tiny_dirs):
    _, draft_dir = tiny_dirs
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    cfg = draft.cfg
    gen = torch.Generator().manual_seed(0)
    seq_len = 40
    feats = torch.randn(2, seq_len, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    anchors = torch.tensor([[5, 9, 9, 30], [1, 17, 20, 32]])
    embeds = torch.randn(2, 4, cfg.block_size, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        train_hidden = T.draft_training_hidden(draft, feats, embeds, anchors)
    for j in range(4):
        # The serving path, one block per session, both sequences in one batch: each slot is
        # filled the way a session fills it, the prompt and then the accepted rows of a round.
        pool = DraftKVPool(draft, slots=2, capacity=64)
        slots = torch.tensor([pool.acquire(), pool.acquire()])
        a = anchors[:, j]
        with torch.inference_mode():
            for i in range(2):
                half = int(a[i]) // 2
                draft.extend(pool.kv, slots[i: i + 1], torch.tensor([0]), feats[i: i + 1, :half])
                draft.extend(pool.kv, slots[i: i + 1], torch.tensor([half]), feats[i: i + 1, half: int(a[i])])
            ref = draft.block_hidden(pool.kv, slots, a, embeds[:, j], int(a.max()) + cfg.block_size)
        for i in range(2):
            assert torch.allclose(train_hidden[i, j], ref[i], atol=1e-5, rtol=0), (i, j)


def test_target_training_forward_equals_serving_forward(tiny_dirs):
    from scripts.train_target import cached_forward_loss, lm_logits

    target_dir, _ = tiny_dirs
    model = TargetModel.from_pretrained(target_dir)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = lm_logits(model, ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
    assert math.isclose(cached_forward_loss(model, ids), ref, rel_tol=1e-5)


# -- training --------------------------------------------------------------------------------------

def test_a_few_steps_make_the_loss_go_down(tiny_dirs, tiny_tokenizer):
    target_dir, _ = tiny_dirs
    layer_ids = (1, 2)
    target = TargetModel.from_pretrained(target_dir, layer_ids)
    mask_id = tiny_tokenizer.token_to_id("<|mask|>")
    cfg = T.draft_config_from_dict(T.draft_config_dict(target.cfg, 2, B, layer_ids, mask_id))
    torch.manual_seed(0)
    draft = T.new_draft(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 400, (48,), generator=gen) for _ in range(4)]
    batch = T.Batcher(T.TokenData(seqs, [1] * 4), 48, B, 8, 0, seed=0).sample(4)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    weights = T.position_weights(B)
    losses = []
    for _ in range(25):
        res = T.draft_loss(draft, target, *batch, weights)
        opt.zero_grad()
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(res.loss.item())
    assert all(p.grad is None for p in target.parameters()), "the target stays frozen"
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses


def test_cli_writes_a_checkpoint_the_engine_loads_and_resumes(tiny_dirs, corpus_file, tmp_path, capsys):
    target_dir, _ = tiny_dirs
    out = tmp_path / "draft"
    common = ["--target", str(target_dir), "--data", str(corpus_file), "--out", str(out),
              "--generate", "--gen-prompts", "8", "--gen-tokens", "24", "--gen-prompt-len", "12",
              "--gen-batch", "4", "--gen-file", str(tmp_path / "gen.pt"), "--ckpt", str(tmp_path / "state.pt"),
              "--batch", "4", "--anchors", "4", "--seq-len", "48", "--log-every", "1", "--save-every", "2",
              "--val-seqs", "2", "--device", "cpu"]
    first = T.main(common + ["--steps", "3", "--eval-prompts", "0"])
    assert first["steps"] == 3
    assert (tmp_path / "gen.pt").is_file() and (tmp_path / "state.pt").is_file()
    summary = T.main(common + ["--steps", "5", "--resume", "--eval-prompts", "2", "--eval-tokens", "12",
                               "--eval-budget", "8"])
    printed = capsys.readouterr().out
    assert "reusing generated data" in printed and "resumed from" in printed and "step      5/5" in printed
    assert summary["steps"] == 5
    assert set(summary["eval"]) >= {"ar", "chain", "tree8"}

    # z-lab format: config keys and tensor names; no embedding or LM head in the draft.
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == B
    assert raw["num_target_layers"] == 4
    assert raw["dflash_config"]["mask_token_id"] == 1  # <|mask|> of the tiny tokenizer
    dcfg = load_draft_config(out)
    assert dcfg.target_layer_ids == T.build_target_layer_ids(4, 2)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith("layers.") or n in ("fc.weight", "hidden_norm.weight", "norm.weight") for n in names)

    engine = LocalEngine.load(str(target_dir), str(out), "cpu", torch.float32,
                              VerifierLimits(max_sessions=1, max_seq_len=256))
    prompt = [5, 17, 42, 99, 3, 250]
    ar = engine.generate(prompt, GenerationConfig(16, mode=DraftMode("ar", 0))).tokens
    for mode in (DraftMode("chain", 0), DraftMode("tree", 8)):
        assert engine.generate(prompt, GenerationConfig(16, mode=mode)).tokens == ar


def test_trains_for_both_target_architectures_from_text(tiny_pair, corpus_file, tmp_path):
    """Qwen3 and Llama (tied embeddings) targets; plain text data, explicit layer ids."""
    target_dir, _ = tiny_pair
    out = tmp_path / "draft"
    summary = T.main(["--target", str(target_dir), "--data", str(corpus_file), "--out", str(out),
                      "--target-layer-ids", "0,3", "--block-size", "4", "--steps", "2", "--batch", "2",
                      "--anchors", "3", "--seq-len", "32", "--eval-prompts", "0", "--device", "cpu",
                      "--ckpt", str(tmp_path / "state.pt")])
    assert summary["steps"] == 2 and summary["train_sequences"] > 0
    assert load_draft_config(out).target_layer_ids == (0, 3)
    engine = LocalEngine.load(str(target_dir), str(out), "cpu", torch.float32,
                              VerifierLimits(max_sessions=1, max_seq_len=128))
    prompt = [7, 8, 9, 10]
    ar = engine.generate(prompt, GenerationConfig(10, mode=DraftMode("ar", 0))).tokens
    assert engine.generate(prompt, GenerationConfig(10, mode=DraftMode("tree", 4))).tokens == ar
