"""Checkpoints as users have them: RoPE variants, generation_config.json EOS ids, tied
embeddings, tiny temperatures and attention-layout fields, against transformers itself."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.config import CheckpointError, load_draft_config, load_target_config
from common.layers import RotaryEmbedding
from common.make_tiny import TinySizes, make_tiny
from common.protocol import SamplingParams
from drafter_svc.draft_model import DFlashDraftModel
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from tests.test_models import edit_config
from verifier_svc.target_model import KVCache, TargetModel
from verifier_svc.tree_verifier import VerifierLimits

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CHECKPOINTS = {"llama-llama3": ("llama", 500000.0, LLAMA3), "qwen3-yarn": ("qwen3", 1e6, YARN)}
LAYOUTS = ("hub", "hub-legacy-type", "rope_parameters")
PROMPT = list(range(40, 80))
N = 24


def save_layout(folder, theta: float, scaling: dict, layout: str) -> None:
    """Rewrite config.json's RoPE fields in one of the layouts checkpoints come in."""
    if layout == "rope_parameters":  # transformers 5: one dict holds everything
        edit_config(folder, rope_parameters={"rope_theta": theta, **scaling}, rope_theta=None, rope_scaling=None)
        return
    scaling = dict(scaling)
    if layout == "hub-legacy-type":
        scaling["type"] = scaling.pop("rope_type")
    edit_config(folder, rope_parameters=None, rope_theta=theta, rope_scaling=scaling)


def save_tiny(folder, arch: str, theta: float, scaling: dict, tokenizer, layout: str = "hub", tied: bool = False):
    """A tiny random transformers model saved in float32 with config.json in `layout`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = config_cls(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256, rope_parameters={"rope_theta": theta, **scaling},
                        tie_word_embeddings=tied, initializer_range=0.15, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    model_cls(config).float().save_pretrained(folder)
    save_layout(folder, theta, scaling, layout)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def hf_generate(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def causal_logits(model: TargetModel, ids: list[int]) -> torch.Tensor:
    t = len(ids)
    cache = KVCache(model.cfg, 1, t, "cpu", torch.float32)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        return model(torch.tensor([ids]), pos, cache, torch.tensor([0]), pos, mask).logits


def ar(engine, prompt, n=N, **sampling):
    return engine.generate(prompt, GenerationConfig(n, SamplingParams(**sampling), mode=DraftMode("ar", 0)))


def ar_engine(folder):
    return LocalEngine.load(str(folder), None, limits=VerifierLimits(max_sessions=2, max_seq_len=256))


# -- RoPE -------------------------------------------------------------------------------------

ROPE_CASES = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "yarn": {"rope_theta": 1e6, "rope_scaling": YARN},
    "yarn-legacy-type": {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    "yarn-betas-no-truncate": {"rope_theta": 1e6, "rope_scaling": {**YARN, "beta_fast": 16, "beta_slow": 2,
                                                                   "truncate": False}},
    "yarn-mscale": {"rope_theta": 1e6, "rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}},
    "yarn-attention-factor": {"rope_theta": 1e6, "rope_scaling": {**YARN, "attention_factor": 0.9}},
    "yarn-factor-from-lengths": {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": None,
                                                                     "original_max_position_embeddings": 64}},
    "yarn-top-level-original": {"rope_theta": 1e6, "original_max_position_embeddings": 16, "rope_scaling": YARN},
    "rope_parameters-yarn": {"rope_parameters": {"rope_theta": 5e4, **YARN}},
    "rope_parameters-llama3": {"rope_parameters": {"rope_theta": 5e5, **LLAMA3}},
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_tables_equal_transformers(tmp_path, case):
    """The cos/sin tables (attention factor included) equal transformers' for the same config.json, bit for bit."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 16,
           "max_position_embeddings": 256, **ROPE_CASES[case]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_target_config(tmp_path)
    ours = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    positions = torch.arange(400)[None]
    want = theirs(torch.zeros(1, 400, 16), positions)
    got = ours(positions, torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.attention_factor == theirs.attention_scaling
    plain = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
    assert (case == "default") == torch.equal(plain(positions, torch.float32)[0], got[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_scaled_rope_checkpoint_matches_transformers(tmp_path, tiny_tokenizer, name, layout):
    """Logits within float32 noise of transformers, and `--ar` greedy decoding == generate()."""
    arch, theta, scaling = CHECKPOINTS[name]
    folder = save_tiny(tmp_path / name, arch, theta, scaling, tiny_tokenizer, layout)
    raw = json.loads((folder / "config.json").read_text())
    assert ("rope_parameters" in raw) == (layout == "rope_parameters")
    hf = hf_model(folder)
    ids = torch.randint(0, hf.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits
    ours = TargetModel.from_pretrained(folder)
    assert (causal_logits(ours, ids) - want).abs().max().item() < 1e-4
    assert ours.cfg.rope_scaling.rope_type == scaling["rope_type"]
    # The test has power: the same weights with plain RoPE are far off.
    ours.rotary = RotaryEmbedding(ours.cfg.head_dim, ours.cfg.rope_theta)
    assert (causal_logits(ours, ids) - want).abs().max().item() > 1e-2

    tokens = ar(ar_engine(folder), PROMPT).tokens
    assert tokens == hf_generate(hf, PROMPT, N)
    assert len(tokens) == N and len(set(tokens)) > 1


def test_draft_reads_rope_scaling(tmp_path, tiny_tokenizer):
    """The draft's RoPE follows its own config.json's rope_scaling, as transformers' Qwen3 RoPE does."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    _, draft = make_tiny(tmp_path, seed=4, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    edit_config(draft, rope_theta=1e6, rope_scaling=YARN)
    model = DFlashDraftModel.from_pretrained(draft)
    theirs = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(draft))
    positions = torch.arange(300)[None]
    got = model.rotary(positions, torch.float32)
    want = theirs(torch.zeros(1, 300, model.cfg.head_dim), positions)
    assert model.cfg.rope_scaling.rope_type == "yarn" and model.rotary.attention_factor > 1.0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "unsupported rope_type 'longrope'"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "unsupported rope_type 'su'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "needs 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs 'factor'"),
    ({"rope_scaling": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "per-layer-type RoPE"),
])
def test_unsupported_rope_is_refused(tmp_path, tiny_tokenizer, fields, message):
    target, draft = make_tiny(tmp_path, seed=4, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    for folder, load in ((target, load_target_config), (draft, load_draft_config)):
        edit_config(folder, **fields)
        with pytest.raises(ValueError, match=message) as info:
            load(folder)
        assert isinstance(info.value, CheckpointError)


# -- EOS ids from generation_config.json ------------------------------------------------------

@pytest.mark.parametrize("as_list", [True, False], ids=["list", "int"])
def test_eos_only_in_generation_config_stops_generation(tmp_path, tiny_tokenizer, as_list):
    arch, theta, scaling = CHECKPOINTS["llama-llama3"]
    folder = save_tiny(tmp_path / "t", arch, theta, scaling, tiny_tokenizer)
    (folder / "generation_config.json").unlink()
    full = ar(ar_engine(folder), PROMPT).tokens
    assert len(full) == N
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    stop = next(t for t in full[3:] if t != eos)
    first = full.index(stop)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, stop] if as_list else stop}))

    assert stop in load_target_config(folder).eos_token_ids and eos in load_target_config(folder).eos_token_ids
    out = ar(ar_engine(folder), PROMPT)
    assert out.tokens == full[: first + 1] and out.finish_reason == "stop"
    assert out.tokens == hf_generate(hf_model(folder), PROMPT, N)


def test_malformed_generation_config_is_refused(tmp_path, tiny_tokenizer):
    target, _ = make_tiny(tmp_path, seed=4, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    (target / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_target_config(target)


# -- tied embeddings --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_pair(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama target with tied embeddings (and no EOS id) plus a DFlash draft for it."""
    target, draft = make_tiny(tmp_path_factory.mktemp("tied"), seed=5,
                              sizes=TinySizes(arch="llama", tie_embeddings=True), tokenizer=tiny_tokenizer)
    edit_config(target, eos_token_id=None)
    return target, draft


def test_tied_target_keeps_one_tensor(tmp_path, tiny_tokenizer):
    """After `.to()` (here a dtype change, which copies every tensor) the head is still the embedding."""
    arch, theta, scaling = CHECKPOINTS["llama-llama3"]
    folder = save_tiny(tmp_path / "t", arch, theta, scaling, tiny_tokenizer, tied=True)
    model = TargetModel.from_pretrained(folder)
    assert model.lm_head.weight is model.embed_tokens.weight
    model.to(torch.float64)
    assert model.lm_head.weight.dtype == torch.float64
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    model.to(torch.float32)
    ids = PROMPT[:20]
    with torch.no_grad():
        want = hf_model(folder)(torch.tensor([ids])).logits
    assert (causal_logits(model, ids) - want).abs().max().item() < 1e-4


def test_tied_target_ignores_a_stored_head(tmp_path, tied_pair):
    """tie_word_embeddings=true with an lm_head.weight stored anyway: the head is the embedding,
    as in transformers."""
    from safetensors.torch import load_file, save_file

    target = shutil.copytree(tied_pair[0], tmp_path / "t")
    tensors = load_file(target / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, target / "model.safetensors")
    model = TargetModel.from_pretrained(target)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_tied_drafter_keeps_one_tensor(tied_pair):
    """The drafter's head and embedding, moved to a device, are one tensor (meta: every `.to` copies)."""
    target, draft = tied_pair
    proposer = DFlashProposer.from_pretrained(draft, target, device="meta", cuda_graphs=False)
    assert proposer.lm_head is proposer.embed_tokens and proposer.lm_head.device.type == "meta"


# -- tiny temperatures ------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-39, True), (9.9e-6, True), (1e-5, False),
                                                 (0.5, False)])
def test_greedy_below_1e_5(temperature, greedy):
    params = SamplingParams(temperature=temperature, seed=1)
    params.check()
    assert params.greedy is greedy


@pytest.mark.parametrize("temperature", [1e-39, 1e-6])
def test_tiny_temperature_decodes_greedily(tied_pair, temperature):
    """Autoregressive and tree rounds: a tiny temperature gives the greedy tokens (T = 1e-39 used
    to give NaN probabilities and token V - 1)."""
    engine = LocalEngine.load(str(tied_pair[0]), str(tied_pair[1]), limits=VerifierLimits(max_sessions=2,
                                                                                          max_seq_len=256))
    for mode in (DraftMode("ar", 0), DraftMode("tree", 4)):
        want = engine.generate(PROMPT, GenerationConfig(N, SamplingParams(), mode=mode)).tokens
        got = engine.generate(PROMPT, GenerationConfig(N, SamplingParams(temperature, seed=3), mode=mode)).tokens
        assert got == want and len(want) == N and len(set(want)) > 1, mode


# -- attention-layout fields ------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"layer_types": ["full_attention", "full_attention"]},
    {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},
    {"sliding_window": 64, "max_window_layers": 0},  # no use_sliding_window: off, as in Qwen3Config
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},  # window from layer 2 of 2: none
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None},  # no window to apply
], ids=["all-full", "window-off", "window-flag-absent", "window-past-last-layer", "sliding-without-window"])
def test_no_op_attention_fields_are_accepted(tmp_path, tiny_tokenizer, fields):
    _, draft = make_tiny(tmp_path, seed=4, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    edit_config(draft, **fields)
    assert load_draft_config(draft).num_layers == 2


@pytest.mark.parametrize("fields, message", [
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "sliding-window attention"),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
     "sliding-window attention"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "unsupported layer_types"),
    ({"layer_types": ["full_attention"]}, "one type per layer"),
])
def test_unsupported_attention_fields_are_refused(tmp_path, tiny_tokenizer, fields, message):
    target, draft = make_tiny(tmp_path, seed=4, sizes=TinySizes(layers=2), tokenizer=tiny_tokenizer)
    for folder, load in ((draft, load_draft_config), (target, load_target_config)):
        edit_config(folder, **fields)
        with pytest.raises(CheckpointError, match=message):
            load(folder)


# -- logprobs ---------------------------------------------------------------------------------

LOGPROB_SAMPLING = {"greedy": {}, "temperature": {"temperature": 0.7, "seed": 11},
                    "top-k-top-p": {"temperature": 1.3, "top_k": 20, "top_p": 0.8, "seed": 12}}


def want_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """float64 log probabilities [R, V] of the distribution each row samples from (-inf: dropped)."""
    from ddtree_kernels.probs import process_probs_reference

    if sampling.greedy:
        return torch.log_softmax(logits.double(), dim=-1)
    r = logits.shape[0]
    probs = process_probs_reference(logits, torch.full((r,), sampling.temperature), torch.full((r,), sampling.top_k),
                                    torch.full((r,), float(sampling.top_p)))
    return probs.double().log()


def check_logprobs(folder, prompt, result, sampling: SamplingParams, top_n: int) -> None:
    """Each emitted token's logprob and its top-N, against transformers' logits of the same text."""
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([prompt + result.tokens])).logits[0]
    want = want_logprobs(logits[len(prompt) - 1: len(prompt) - 1 + len(result.tokens)], sampling)
    assert len(result.logprobs) == len(result.tokens) > 1
    for row, token, got in zip(want, result.tokens, result.logprobs):
        assert got.token == token
        # float32 noise: our logits and transformers' differ by ~1e-4 (the test above), over T
        assert got.logprob == pytest.approx(row[token].item(), abs=5e-4)
        assert got.logprob > float("-inf")
        kept = int((row > float("-inf")).sum())
        values, ids = row.topk(min(top_n, kept))
        assert [i for i, _ in got.top] == ids.tolist()
        assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=5e-4)


SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"


@pytest.fixture(scope="module")
def shipped():
    """The shipped trained pair (its draft is accepted, so tree rounds emit several tokens) and a
    held-out prompt of its corpus."""
    engine = LocalEngine.load(str(SHIPPED / "target"), str(SHIPPED / "draft"),
                              limits=VerifierLimits(max_sessions=4, max_seq_len=256))
    from bench.acceptance import load_prompts

    (_, prompt), = load_prompts(SHIPPED / "target", engine.tokenizer, 1, 48)
    return engine, prompt


@pytest.mark.parametrize("sampling", LOGPROB_SAMPLING, ids=list(LOGPROB_SAMPLING))
@pytest.mark.parametrize("mode", [DraftMode("ar", 0), DraftMode("tree", 8)], ids=["ar", "tree"])
def test_logprobs_equal_transformers(shipped, mode, sampling):
    """Logprobs of every emitted token (the prefill's first included), plain and tree rounds,
    greedy and sampled, equal those of transformers' logits under the request's filters."""
    engine, prompt = shipped
    params = SamplingParams(**LOGPROB_SAMPLING[sampling])
    result = engine.generate(prompt, GenerationConfig(N, params, mode=mode, logprobs=5))
    check_logprobs(SHIPPED / "target", prompt, result, params, 5)
    if mode.kind == "tree":
        assert max(result.acceptance_lengths) > 1  # rounds that accepted drafted tokens
    plain = engine.generate(prompt, GenerationConfig(N, params, mode=mode))
    assert plain.tokens == result.tokens and plain.logprobs is None  # asking changes no token


def test_logprobs_alone_equal_logprobs_in_a_batch(shipped):
    """A session's logprobs do not depend on what else is batched with it (float32)."""
    engine, prompt = shipped
    config = GenerationConfig(N, SamplingParams(temperature=0.9, top_k=30, seed=4), mode=DraftMode("tree", 6),
                              logprobs=3)
    alone = engine.generate(prompt, config)
    others = [(prompt[i:], GenerationConfig(N, mode=DraftMode("tree", 4 + i))) for i in range(1, 4)]
    batched = engine.generate_many([(prompt, config)] + others)
    assert batched[0].tokens == alone.tokens
    assert all(o.logprobs is None for o in batched[1:])
    for a, b in zip(alone.logprobs, batched[0].logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_out_of_range_logprobs_are_refused(logprobs):
    with pytest.raises(ValueError, match="logprobs must be in"):
        GenerationConfig(N, logprobs=logprobs).check()
