"""Repetition penalties (OpenAI's presence_penalty and frequency_penalty, vLLM's repetition_penalty):
the verifier applies them to the target's logits per tree node, with the node's own path counted
(`common.penalties`), inside the verify step and for the prefill's first token. Outputs are
compared with a plain reference decoding of the penalised target (transformers' model, vLLM's
formula), every mode with plain decoding for a seed, and the per-node penalties with a
plain per-node reference on random trees."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from common.penalties import PenaltyState, penalize, penalized
from common.protocol import OpenEntry, SamplingParams
from common.wire import LinkLimits, decode_link_request, encode_link_request
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from tests.reference import decode_with_flaky_link
from verifier_svc.tree_verifier import VerifierLimits

PROMPT = [5, 17, 42, 99, 3, 17, 42]
N = 40
MODES = [DraftMode("ar", 0), DraftMode("chain", 0), DraftMode("tree", 4), DraftMode("tree", 16)]
SETTINGS = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=0.8),
            SamplingParams(repetition_penalty=1.6), SamplingParams(presence_penalty=-0.5, frequency_penalty=1.2,
                                                                   repetition_penalty=1.3)]


def random_tree(gen, t):
    """Parents of a random tree of 1..t nodes, then padding nodes (seeing themselves only); the
    ancestor mask [t, t]: node n sees itself and its ancestors."""
    n = int(torch.randint(1, t + 1, (1,), generator=gen))
    ancestors = torch.eye(t, dtype=torch.bool)
    for node in range(1, n):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        ancestors[node] |= ancestors[parent]
    return ancestors


def penalize_reference(logits, state, slots, tokens, ancestors, penalties):
    """Each node's logits through `penalized` with its own counts: its slot's plus its path's."""
    out = logits.clone()
    b, t, _ = logits.shape
    for row in range(b):
        p, f, r = penalties[row].tolist()
        for node in range(t):
            generated = state.generated[slots[row]].clone()
            context = state.context[slots[row]].clone()
            for a in range(t):
                if ancestors[row, node, a]:
                    generated[tokens[row, a]] += 1
                    context[tokens[row, a]] += 1
            out[row, node] = penalized(logits[row, node], generated, context > 0, torch.tensor(p), torch.tensor(f),
                                       torch.tensor(r)).to(logits.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalize_equals_its_per_node_reference(dtype):
    """Random trees whose tokens repeat along their paths, random slot counts, rows with and without
    penalties, padding nodes."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        b, t, v = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 10, (1,), generator=gen)), 12
        logits = (torch.randn(b, t, v, generator=gen) * 3).to(dtype)
        state = PenaltyState(b + 2, v, torch.device("cpu"))
        state.generated.copy_(torch.randint(0, 3, state.generated.shape, generator=gen).float())
        state.context.copy_(state.generated + torch.randint(0, 2, state.generated.shape, generator=gen).float())
        slots = torch.randperm(b + 2, generator=gen)[:b]
        tokens = torch.randint(0, 4, (b, t), generator=gen)  # few distinct tokens: paths repeat them
        ancestors = torch.stack([random_tree(gen, t) for _ in range(b)])
        penalties = torch.stack([torch.tensor([float(torch.empty(()).uniform_(-2, 2, generator=gen)),
                                               float(torch.empty(()).uniform_(-2, 2, generator=gen)),
                                               float(torch.empty(()).uniform_(0.5, 2.0, generator=gen))])
                                 for _ in range(b)])
        penalties[0] = torch.tensor([0.0, 0.0, 1.0])  # a row without penalties
        expected = penalize_reference(logits, state, slots, tokens, ancestors, penalties)
        penalize(logits, state, slots, tokens, ancestors, penalties)
        assert torch.equal(logits, expected)
        assert torch.equal(logits[0], expected[0])


def test_the_formula_is_vllms():
    """Repetition first (a positive logit divided, a negative multiplied, for tokens in the context),
    then frequency per occurrence and presence once, for generated tokens only; no penalty: identity."""
    x = torch.tensor([2.0, -2.0, 2.0, -1.0, 0.5])
    count = torch.tensor([0.0, 0.0, 3.0, 1.0, 0.0])
    seen = torch.tensor([True, True, True, True, False])
    out = penalized(x, count, seen, torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0))
    assert out.tolist() == [1.0, -4.0, 1.0 - 0.75 - 0.5, -2.0 - 0.25 - 0.5, 0.5]
    assert torch.equal(penalized(x, count, seen, torch.tensor(0.0), torch.tensor(0.0), torch.tensor(1.0)), x)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=6, max_seq_len=256))


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]), dtype=torch.float32).eval()


def reference_decode(model, prompt, n, sampling):
    """Greedy decoding with transformers' model of the target, the whole sequence each step, its
    logits penalised as vLLM does: repetition over the prompt and the output, then frequency and
    presence over the output."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token in set(ids):
                x = logits[token]
                logits[token] = x / sampling.repetition_penalty if x > 0 else x * sampling.repetition_penalty
            for token, count in collections.Counter(out).items():
                logits[token] -= sampling.frequency_penalty * count + sampling.presence_penalty
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_greedy_penalties_equal_the_penalised_target_in_every_mode(engine, hf_target):
    """Each setting changes the greedy output; every mode gives the penalised reference's tokens,
    batched beside an unpenalised twin, with the prompt in one piece and in chunks of 2."""
    plain = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0), ignore_eos=True)).tokens
    for sampling in SETTINGS:
        expected = reference_decode(hf_target, PROMPT, N, sampling)
        assert expected != plain, sampling
        for mode in MODES:
            for chunk in (0, 2):
                penalised, twin = engine.generate_many([
                    (PROMPT, GenerationConfig(N, sampling, mode=mode, ignore_eos=True)),
                    (PROMPT, GenerationConfig(N, mode=mode, ignore_eos=True))], prefill_chunk=chunk)
                assert penalised.tokens == expected, (sampling, mode, chunk)
                assert twin.tokens == plain, (sampling, mode, chunk)


def test_the_first_token_takes_the_prompt_s_repetition_penalty(engine, hf_target):
    """A prompt of the greedy first token repeated: a strong repetition penalty changes that token."""
    first = engine.generate(PROMPT, GenerationConfig(1, mode=DraftMode("ar", 0))).tokens[0]
    prompt = PROMPT + [first]
    unpenalised = engine.generate(prompt, GenerationConfig(1, mode=DraftMode("ar", 0))).tokens
    sampling = SamplingParams(repetition_penalty=50.0)
    expected = reference_decode(hf_target, prompt, 8, sampling)
    assert expected[0] != unpenalised[0] or expected[0] not in prompt
    for mode in (DraftMode("ar", 0), DraftMode("tree", 16)):
        assert engine.generate(prompt, GenerationConfig(8, sampling, mode=mode, ignore_eos=True)).tokens == expected


def test_seeded_sampling_with_penalties_equals_plain_decoding(engine):
    """Sampled (position-keyed): tree decoding gives plain decoding's tokens for the same seed, and
    a frequency penalty makes repeats rarer."""
    repeats = {"free": 0, "penalised": 0}
    for seed in range(8):
        free = SamplingParams(temperature=0.9, seed=seed)
        penalised = SamplingParams(temperature=0.9, seed=seed, frequency_penalty=2.0, presence_penalty=1.0)
        runs = engine.generate_many([(PROMPT, GenerationConfig(N, penalised, mode=mode, ignore_eos=True))
                                     for mode in MODES])
        assert all(r.tokens == runs[0].tokens for r in runs), seed
        out = engine.generate(PROMPT, GenerationConfig(N, free, mode=DraftMode("tree", 8), ignore_eos=True)).tokens
        repeats["free"] += len(out) - len(set(out))
        repeats["penalised"] += len(runs[0].tokens) - len(set(runs[0].tokens))
    assert repeats["penalised"] < repeats["free"], repeats


def test_a_session_that_re_opens_keeps_its_counts(engine):
    """The link fails twice, a few rounds in (the verifier drops its sessions): each session re-opens
    with its prompt plus its tokens so far as the prompt, which count as generated from the
    prompt's end on (Open.output_start): the outputs are the undisturbed ones."""
    requests = [(PROMPT, GenerationConfig(N, sampling, mode=DraftMode("tree", 4), ignore_eos=True))
                for sampling in SETTINGS]
    expected = [r.tokens for r in engine.generate_many(requests)]
    tokens, sends = decode_with_flaky_link(engine, requests, (7, 15))
    assert sends > 15
    assert tokens == expected


def test_the_link_carries_penalties_and_the_verifier_checks_them(engine):
    limits = LinkLimits(max_entries=8, max_tree_nodes=64)
    entry = OpenEntry(7, [1, 2, 3], SamplingParams(presence_penalty=0.5, repetition_penalty=1.1), output_start=2)
    (decoded,) = decode_link_request(encode_link_request(1, [entry]), limits)
    assert decoded == entry
    message = encode_link_request(1, [entry])
    message.entries[0].open.sampling.frequency_penalty = 2.5
    (refused,) = decode_link_request(message, limits)
    assert refused.outcome.status == "INVALID_ARGUMENT" and "frequency_penalty must be in" in refused.outcome.message
    verifier = engine.verifier
    for sampling, needle in ((SamplingParams(presence_penalty=float("nan")), "presence_penalty must be in"),
                             (SamplingParams(frequency_penalty=-2.01), "frequency_penalty must be in"),
                             (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be in (0, 100]"),
                             (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be in")):
        (result,) = verifier.step([("test", OpenEntry(9, [1, 2, 3], sampling))])
        assert result.outcome.status == "INVALID_ARGUMENT" and needle in result.outcome.message, needle
    assert verifier.free_capacity == verifier.limits.max_sessions


SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"
CODE = "import os\nimport json\n\ndef load(path):\n"


def test_the_draft_takes_the_penalties_too(monkeypatch):
    """The drafter penalises its block logits with each session's counts so far: on the shipped
    trained pair, the same tokens in fewer rounds than when its proposals ignore the penalties."""
    import drafter_svc.drafter as drafter

    engine = LocalEngine.load(str(SHIPPED / "target"), str(SHIPPED / "draft"),
                              limits=VerifierLimits(max_sessions=2, max_seq_len=512))
    prompt = engine.tokenizer.encode(CODE).ids
    for sampling in (SamplingParams(frequency_penalty=1.5), SamplingParams(repetition_penalty=1.5)):
        config = GenerationConfig(128, sampling, mode=DraftMode("tree", 15), ignore_eos=True)
        steered = engine.generate(prompt, config)
        with monkeypatch.context() as patch:
            patch.setattr(drafter, "penalize_block", lambda logits, rows: None)
            blind = engine.generate(prompt, config)
        assert steered.tokens == blind.tokens
        assert steered.rounds < 0.9 * blind.rounds, (sampling, steered.rounds, blind.rounds)


def test_the_dense_kernel_equals_the_reference():
    """`ddtree_kernels.penalties` (through Triton's interpreter here, on the device in
    tests/gpu/test_penalties_gpu.py) against the reference's dense part: vocabularies over
    several chunks, rows with and without penalties, logits strided as the graphs' buffer is."""
    from common.penalties import penalize_dense
    from ddtree_kernels.penalties import BLOCK, penalize_dense_triton

    gen = torch.Generator().manual_seed(2)
    for v in (5, BLOCK + 3):
        state = PenaltyState(4, v, torch.device("cpu"))
        state.generated.copy_(torch.randint(0, 3, state.generated.shape, generator=gen).float())
        state.context.copy_(state.generated + torch.randint(0, 2, state.generated.shape, generator=gen).float())
        slots = torch.tensor([2, 0, 3])
        penalties = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.25, 1.7], [1.1, 0.3, 0.6]])
        logits = (torch.randn(3, 2, v + 8, generator=gen) * 3)[:, :, :v]  # rows of a wider buffer
        raw, expected = logits.clone(), logits.clone()
        penalize_dense(expected, state, slots, penalties)
        penalize_dense_triton(logits, state.generated, state.context, slots, penalties)
        assert torch.equal(logits, expected)
        assert torch.equal(logits[0], raw[0]) and not torch.equal(logits[1], raw[1])


def test_the_node_kernels_equal_the_reference():
    """`penalize_nodes_triton` and `count_paths_triton` (through Triton's interpreter here, on the
    device in tests/gpu/test_penalties_gpu.py) against the reference's `penalize` and counting, on
    random trees whose paths repeat tokens; rows without penalties are left alone (and uncounted).
    float32 only: the interpreter rounds float32 to bfloat16 otherwise than the device does."""
    dtype = torch.float32
    from ddtree_kernels.penalties import count_paths_triton, penalize_nodes_triton

    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        b, t, v = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 18, (1,), generator=gen)), 40
        state = PenaltyState(b + 1, v, torch.device("cpu"))
        state.generated.copy_(torch.randint(0, 3, state.generated.shape, generator=gen).float())
        state.context.copy_(state.generated + torch.randint(0, 2, state.generated.shape, generator=gen).float())
        slots = torch.randperm(b + 1, generator=gen)[:b]
        tokens = torch.randint(0, 5, (b, t), generator=gen)
        ancestors = torch.stack([random_tree(gen, t) for _ in range(b)])
        penalties = torch.tensor([[0.0, 0.0, 1.0]] + [[0.75, -0.5, 1.3]] * (b - 1))
        logits = (torch.randn(b, t, v, generator=gen) * 3).to(dtype)
        expected = logits.clone()
        penalize(expected, state, slots, tokens, ancestors, penalties)
        penalize_nodes_triton(logits, state.generated, state.context, slots, tokens, ancestors, penalties)
        assert torch.equal(logits, expected)
        # An accepted path per row: the root, then a chain of some nodes (-1 past it).
        result = torch.full((b, t + 2), -1, dtype=torch.int64)
        result[:, 0] = torch.randint(0, t, (b,), generator=gen)
        for row in range(b):
            result[row, 2: 3 + int(result[row, 0])] = torch.randperm(t, generator=gen)[: int(result[row, 0]) + 1]
        counted = PenaltyState(b + 1, v, torch.device("cpu"))
        counted.generated.copy_(state.generated)
        counted.context.copy_(state.context)
        count_paths_triton(counted.generated, counted.context, slots, penalties, tokens, result)
        state.count_paths(slots, tokens, result, penalties)
        penalized_slots = slots[1:]
        assert torch.equal(counted.generated[penalized_slots], state.generated[penalized_slots])
        assert torch.equal(counted.context[penalized_slots], state.context[penalized_slots])
