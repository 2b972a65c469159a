"""Checkpoint loading and model numerics against transformers' own implementations."""
import json
import shutil

import pytest
import torch

from common.config import CheckpointError, check_draft_fits_target, load_draft_config, load_target_config
from common.make_tiny import TinySizes, make_tiny
from drafter_svc.draft_model import DFlashDraftModel, DraftKVPool
from tests.reference import dflash_hidden_reference
from verifier_svc.target_model import KVCache, TargetModel


def _causal_forward(model, ids):
    t = len(ids)
    cache = KVCache(model.cfg, 2, t + 4, "cpu", torch.float32)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        return model(torch.tensor([ids]), pos, cache, torch.tensor([1]), pos, mask)


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fused-weights-triton"])
def test_target_matches_transformers(tiny_pair, fast, kernel_env):
    """Also with the serving fast path: fused q/k/v and gate/up weights, Triton norm/RoPE kernels."""
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = tiny_pair
    layer_ids = load_draft_config(draft_dir).target_layer_ids
    ours = TargetModel.from_pretrained(target_dir, layer_ids)
    if fast:
        ours.fuse_weights()
        kernel_env("DDTREE_KERNELS", "triton")
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    out = _causal_forward(ours, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    assert (out.logits - ref.logits).abs().max().item() < 1e-4
    want = torch.cat([ref.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert (out.features - want).abs().max().item() < 1e-4


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_tokenizer):
    single, _ = make_tiny(tmp_path / "a", seed=3, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    sharded, _ = make_tiny(tmp_path / "b", seed=3, sizes=TinySizes(), shards=3, tokenizer=tiny_tokenizer)
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = [1, 2, 3, 4, 5]
    a = _causal_forward(TargetModel.from_pretrained(single), ids).logits
    b = _causal_forward(TargetModel.from_pretrained(sharded), ids).logits
    assert torch.equal(a, b)


def test_draft_context_cache_matches_one_pass(qwen3_pair):
    """Context K/V written into pool slots in pieces (as rounds write them), then the block over
    the slot == one pass over [context; block]; two sessions of different lengths in one batch."""
    target_dir, draft_dir = qwen3_pair
    draft = DFlashDraftModel.from_pretrained(draft_dir)
    embed = TargetModel.from_pretrained(target_dir).embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(n, draft.fc.in_features, generator=gen) for n in (11, 5)]
    t = draft.cfg.block_size
    blocks = [[7] + [draft.cfg.mask_token_id] * (t - 1), [300] + [draft.cfg.mask_token_id] * (t - 1)]
    pool = DraftKVPool(draft, slots=2, capacity=64)
    slots = torch.tensor([pool.acquire(), pool.acquire()])
    with torch.inference_mode():
        # The cache grows in pieces, as rounds do: 4 + 7 rows for one session, 3 + 2 for the other.
        draft.extend(pool.kv, slots[:1], torch.tensor([0]), feats[0][None, :4])
        draft.extend(pool.kv, slots[:1], torch.tensor([4]), feats[0][None, 4:])
        draft.extend(pool.kv, slots[1:], torch.tensor([0]), feats[1][None, :3])
        draft.extend(pool.kv, slots[1:], torch.tensor([3]), feats[1][None, 3:])
        got = draft.block_hidden(pool.kv, slots, torch.tensor([11, 5]), embed[torch.tensor(blocks)], 11 + t)
        want = [dflash_hidden_reference(draft, embed, f, b) for f, b in zip(feats, blocks)]
    assert got.shape == (2, t, draft.cfg.hidden_size)
    for i in range(2):
        assert (got[i] - want[i]).abs().max().item() < 1e-5, i


def edit_config(folder, **changes):
    """Edit config.json in place; a value of None removes the key."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.fixture
def pair_copy(tmp_path, qwen3_pair):
    target, draft = qwen3_pair
    return shutil.copytree(target, tmp_path / "target"), shutil.copytree(draft, tmp_path / "draft")


def test_loader_errors(tmp_path, pair_copy):
    target, draft = pair_copy
    with pytest.raises(CheckpointError, match="not found"):
        load_target_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_target_config(tmp_path / "empty")
    edit_config(target, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_target_config(target)
    edit_config(target, architectures=["Qwen3ForCausalLM"])
    (target / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        TargetModel.from_pretrained(target)


@pytest.mark.parametrize("which, changes, needle", [
    ("target", dict(head_dim=7), "head_dim must be even"),
    ("draft", dict(head_dim=7), "head_dim must be even"),
    ("draft", dict(num_hidden_layers=0), "num_layers must be >= 1"),
    ("target", dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    ("target", dict(vocab_size=0), "vocab_size must be >= 1"),
    ("target", dict(hidden_size="abc"), "value of the wrong type"),
    ("draft", dict(rms_norm_eps=[1e-6]), "value of the wrong type"),
    ("draft", dict(dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 10**6}), "mask_token_id"),
])
def test_configs_a_forward_cannot_run_are_refused_at_load(pair_copy, which, changes, needle):
    """Not at the first request (a service that loaded such a checkpoint failed every one)."""
    target, draft = pair_copy
    folder = target if which == "target" else draft
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=needle) as caught:
        (load_target_config if which == "target" else load_draft_config)(folder)
    assert str(folder) in str(caught.value) and "\n" not in str(caught.value)


def test_unreadable_files_are_checkpoint_errors(pair_copy):
    target, draft = pair_copy
    (draft / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        load_draft_config(draft)
    (target / "model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        TargetModel.from_pretrained(target)


def test_mismatched_draft_is_refused(pair_copy):
    target, draft = pair_copy
    target_cfg = load_target_config(target)
    check_draft_fits_target(load_draft_config(draft), target_cfg)
    edit_config(draft, dflash_config={"target_layer_ids": [0, 9], "mask_token_id": 1})
    with pytest.raises(CheckpointError, match="outside the target"):
        check_draft_fits_target(load_draft_config(draft), target_cfg)
    edit_config(draft, dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 1}, hidden_size=32)
    with pytest.raises(CheckpointError, match="hidden_size"):
        check_draft_fits_target(load_draft_config(draft), target_cfg)
    edit_config(draft, hidden_size=target_cfg.hidden_size, num_target_layers=12)
    with pytest.raises(CheckpointError, match="12-layer target"):
        check_draft_fits_target(load_draft_config(draft), target_cfg)


def test_loading_the_models_does_not_import_the_compiler(tiny_pair):
    """`from_pretrained` builds the modules on the meta device without running ops there (a
    random init, the RoPE table), which would import torch._dynamo: about a second per process."""
    import subprocess
    import sys

    target_dir, draft_dir = tiny_pair
    code = ("import sys, torch\n"
            "from common.feature_projection import FeatureProjection\n"
            "from drafter_svc.draft_model import DFlashDraftModel\n"
            "from verifier_svc.target_model import TargetModel\n"
            f"TargetModel.from_pretrained({str(target_dir)!r}, (0, 1))\n"
            f"DFlashDraftModel.from_pretrained({str(draft_dir)!r})\n"
            f"FeatureProjection.from_draft({str(draft_dir)!r}, torch.device('cpu'), torch.float32)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
