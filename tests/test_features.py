"""The draft's context features follow DFlash exactly: feature layer id l is transformers'
`hidden_states[l + 1]` (the last layer's taken after the final norm), on every path that
produces features; and `--target-layer-ids auto` is DFlash's build_target_layer_ids."""
import json

import pytest
import torch

from common.config import CheckpointError, dflash_target_layer_ids, is_valid_layer_ids, load_draft_config
from drafter_svc import train as T
from verifier_svc.cuda_graphs import rows_first_order
from verifier_svc.target_model import KVCache, TargetModel
from verifier_svc.target_runner import TargetRunner

PROMPT_LEN = 29


def _ids(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()


def _hf_hidden_states(target_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def _causal_features(model: TargetModel, ids: list[int]) -> torch.Tensor:
    t = len(ids)
    cache = KVCache(model.cfg, 1, t, "cpu", torch.float32)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        return model(torch.tensor([ids]), pos, cache, torch.tensor([0]), pos, mask).features[0]


def _per_layer(features: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(features.chunk(n, dim=-1))


def _assert_equals_hf(features: torch.Tensor, hidden_states, layer_ids) -> None:
    assert features.shape == (PROMPT_LEN, len(layer_ids) * hidden_states[0].shape[-1])
    for layer, got in zip(layer_ids, _per_layer(features, len(layer_ids))):
        want = hidden_states[layer + 1][0]
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"layer {layer}: max error {err} against hidden_states[{layer + 1}]"


@pytest.mark.parametrize("path", ["plain", "fused-triton", "runner-prefill", "training"])
def test_every_feature_layer_is_hidden_states_of_the_next_index(tiny_pair, path, kernel_env):
    """All layer ids, the last one included (post final norm), against transformers in float32."""
    target_dir, _ = tiny_pair
    probe = TargetModel.from_pretrained(target_dir)
    layer_ids = tuple(range(probe.cfg.num_layers))
    model = TargetModel.from_pretrained(target_dir, layer_ids)
    ids = _ids(model.cfg.vocab_size)
    hidden_states = _hf_hidden_states(target_dir, ids)
    assert len(hidden_states) == model.cfg.num_layers + 1
    if path == "plain":
        features = _causal_features(model, ids)
    elif path == "fused-triton":
        model.fuse_weights()
        kernel_env("DDTREE_KERNELS", "triton")
        features = _causal_features(model, ids)
    elif path == "runner-prefill":  # the verifier's batched prefill (fused weights, padded batch)
        runner = TargetRunner(model, num_slots=2, max_seq_len=64, max_tree_nodes=9)
        _, per_prompt = runner.prefill([1, 0], [torch.tensor(ids), torch.tensor(ids[:7])])
        features = per_prompt[0]
    else:  # the trainer's features of whole sequences
        features = T.target_features(model, torch.tensor([ids]))[0]
    _assert_equals_hf(features, hidden_states, layer_ids)


def test_last_layer_feature_is_after_the_final_norm(tiny_pair):
    """The test has power: the last layer's residual stream, the final norm's input, is far off."""
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair
    last = TargetModel.from_pretrained(target_dir).cfg.num_layers - 1
    model = TargetModel.from_pretrained(target_dir, (last,))
    ids = _ids(model.cfg.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    seen = {}

    def keep_input(module, args):
        seen["pre_norm"] = args[0][0]

    hf.model.norm.register_forward_pre_hook(keep_input)
    with torch.no_grad():
        hidden_states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = _causal_features(model, ids)
    assert (got - hidden_states[-1][0]).abs().max().item() < 1e-4
    assert (got - seen["pre_norm"]).abs().max().item() > 1e-1


# -- --target-layer-ids auto ----------------------------------------------------------------------

@pytest.mark.parametrize(("layers", "n", "want"), [
    (36, 5, (1, 9, 17, 25, 33)),   # Qwen3-4B / Qwen3-8B with a 5-layer draft (z-lab's published configs)
    (48, 5, (1, 12, 23, 34, 45)),  # Qwen3-Coder-30B-A3B
    (32, 5, (1, 8, 15, 22, 29)),   # Llama-3.1-8B
    (28, 5, (1, 7, 13, 19, 25)),
    (36, 3, (1, 17, 33)),
    (40, 8, (1, 6, 11, 16, 22, 27, 32, 37)),  # Python rounding: 21.5 -> 22
    (6, 2, (1, 3)),                # the shipped pair's target with its 2-layer draft
    (6, 3, (1, 2, 3)),
    (36, 1, (18,)),                # one feature layer: the middle one
    (7, 1, (3,)),
])
def test_auto_layer_ids_are_dflash_rule(layers, n, want):
    assert dflash_target_layer_ids(layers, n) == want
    assert T.build_target_layer_ids(layers, n) == want
    assert is_valid_layer_ids(want, layers)


@pytest.mark.parametrize("layers", range(8, 80, 7))
def test_auto_layer_ids_span_one_to_l_minus_3_evenly(layers):
    n = 4
    ids = T.build_target_layer_ids(layers, n)
    assert ids[0] == 1 and ids[-1] == layers - 3
    step = (layers - 4) / (n - 1)
    assert all(abs(i - (1 + k * step)) <= 0.5 for k, i in enumerate(ids))


def test_auto_on_shallow_targets_spreads_over_all_layers():
    """Where DFlash's rule repeats ids ([1, 1] for 4 layers), n distinct ids over all layers."""
    assert dflash_target_layer_ids(4, 2) == (1, 1) and not is_valid_layer_ids((1, 1), 4)
    assert T.build_target_layer_ids(4, 2) == (0, 3)
    assert T.build_target_layer_ids(6, 5) == (0, 1, 2, 4, 5)
    assert T.build_target_layer_ids(2, 2) == (0, 1)
    with pytest.raises(ValueError, match="3 feature layers from a 2-layer target"):
        T.build_target_layer_ids(2, 3)
    with pytest.raises(ValueError):
        dflash_target_layer_ids(36, 0)


def test_train_cli_parses_auto(tiny_pair, capsys):
    target_cfg = TargetModel.from_pretrained(tiny_pair[0]).cfg
    assert T.parse_layer_ids("auto", target_cfg, 2) == T.build_target_layer_ids(target_cfg.num_layers, 2)
    assert T.parse_layer_ids("0,2", target_cfg, 2) == (0, 2)
    with pytest.raises(SystemExit):
        T.parse_layer_ids("auto", target_cfg, target_cfg.num_layers + 1)
    assert "--target-layer-ids auto" in capsys.readouterr().err


def test_draft_config_without_layer_ids_uses_dflash_rule(tmp_path, tiny_pair):
    """As DFlash's draft model: dflash_config without target_layer_ids -> the rule for
    (num_target_layers, num_hidden_layers); a rule that gives repeated ids is refused."""
    _, draft_dir = tiny_pair
    raw = json.loads((draft_dir / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    folder = tmp_path / "draft"
    folder.mkdir()
    for layers, want in ((36, (1, 33)), (6, (1, 3))):
        (folder / "config.json").write_text(json.dumps({**raw, "num_target_layers": layers, "num_hidden_layers": 2}))
        assert load_draft_config(folder).target_layer_ids == want
    (folder / "config.json").write_text(json.dumps({**raw, "num_target_layers": 4, "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"DFlash's rule gives \[1, 1\]"):
        load_draft_config(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "num_target_layers"}))
    with pytest.raises(CheckpointError, match="target_layer_ids and num_target_layers are missing"):
        load_draft_config(folder)


def test_rows_first_order_puts_the_rows_to_read_first_in_row_order():
    """`rows_first_order` (the order in which a verify step hands its path rows over, computed on
    the device before its results are read) against picking them row by row, on fresh random
    steps: rows that want no features and paths of every length from the root alone to the whole
    width."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(50):
        b, w, f = (int(x) for x in torch.randint(1, 9, (3,), generator=gen))
        features = torch.randn(b, w, f, generator=gen)
        lengths = torch.randint(1, w + 1, (b,), generator=gen) * (torch.rand(b, generator=gen) < 0.8)
        want = torch.cat([features[i, :n] for i, n in enumerate(lengths.tolist())])
        got = features.reshape(b * w, f).index_select(0, rows_first_order(lengths, w))
        assert got.shape == (b * w, f) and torch.equal(got[: int(lengths.sum())], want)
        # the rest are the other rows, each once
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, features.reshape(b * w, f).tolist()))


@pytest.mark.parametrize("layers", [(), (0, 2)], ids=["no-feature-layers", "two-layers"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_verify_hands_back_the_wanted_path_rows_whatever_the_feature_width(layers, static):
    """A verify step's rows for the host come in the order the step computed (`rows_first_order`):
    each wanted row's root and accepted nodes, in row order, none of the others; also for a target
    without feature layers (plain decoding, bench/deterministic.py), whose rows have no values."""
    import dataclasses

    from bench.verify import make_batch, make_runner, qwen3_8b_config, random_target
    from common.protocol import SamplingParams
    from verifier_svc.cuda_graphs import GraphConfig

    cfg = qwen3_8b_config(small=True)
    model = random_target(cfg, layers, torch.device("cpu"), torch.float32, seed=1)
    config = GraphConfig(tree_buckets=(15,), batch_buckets=(4,), kv_buckets=(64,), modes=("greedy",))

    def prefilled() -> TargetRunner:
        runner = make_runner(model, 4, 48, 16, config=config if static else None)
        for slot in range(3):
            prompt = torch.randint(cfg.vocab_size, (9 + slot,), generator=torch.Generator().manual_seed(slot))
            runner.prefill([slot], [prompt])
        return runner

    rows, masks = make_batch(cfg, 3, 7, 0, SamplingParams())
    rows = [dataclasses.replace(r, past=9 + r.slot, wants_features=w) for r, w in zip(rows, (True, False, True))]
    reference = prefilled()
    reference.features_on_device = True  # the rows kept on the device, where a colocated draft reads them
    want = reference.verify_batch(rows, masks)
    got = prefilled().verify_batch(rows, masks)  # the same step, its rows to the host
    assert got.paths == want.paths and got.bonus == want.bonus
    assert got.features.shape == (len(got.paths[0]) + len(got.paths[2]), model.feature_dim)
    assert torch.equal(got.features, want.features.cpu())
