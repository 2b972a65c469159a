"""Token biases: logit_bias (added to the target's logits everywhere) and min_tokens (the first N
generated tokens are never a stop token: the stop token ids and the end-of-sequence tokens at
-inf there). The verifier adds them inside the verify step (`common.logit_bias.bias_tokens`)
and for the prefill's first token; the drafter sends them with the open, their positions in the
session's context so that a re-open keeps them, and adds them to its own block logits so that
its trees propose what the biased target picks. Outputs are compared with a plain reference
decoding of the same biased target."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.protocol import MAX_TOKEN_BIAS, OpenEntry, SamplingParams, StatusError, TokenBias
from common.wire import LinkLimits, decode_link_request, encode_link_request
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from tests.reference import decode_with_flaky_link
from common.logit_bias import bias_tokens
from verifier_svc.tree_verifier import VerifierLimits

PROMPT = [5, 17, 42, 99, 3]
N = 24
MODES = [DraftMode("ar", 0), DraftMode("chain", 0), DraftMode("tree", 4), DraftMode("tree", 16)]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=6, max_seq_len=256))


def bias_reference(logits, next_positions, entries):
    """entries[b]: (token, value, until) triples; the finite value of a token first, as a request gives."""
    out = logits.clone()
    for b, row in enumerate(entries):
        for t in range(logits.shape[1]):
            for token, value, until in row:
                if next_positions[b, t] < until:
                    out[b, t, token] += torch.tensor(value).to(logits.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_tokens_equals_its_reference(dtype):
    """Random biases, -inf bounds among them, one token often both biased and held back, padding."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        b, t, v = (int(torch.randint(1, n, (1,), generator=gen)) for n in (5, 9, 50))
        v += 8
        logits = torch.randn(b, t, v, generator=gen).to(dtype)
        positions = torch.randint(0, 20, (b, t), generator=gen)
        entries = []
        for _ in range(b):
            tokens = torch.randperm(v, generator=gen)[:int(torch.randint(0, 6, (1,), generator=gen))].tolist()
            row = [(x, float(torch.empty(()).uniform_(-100, 100, generator=gen)), 1 << 32 - 1) for x in tokens[::2]]
            row += [(x, float("-inf"), int(torch.randint(0, 24, (1,), generator=gen))) for x in tokens[:3]]
            entries.append(row)
        ids = torch.zeros(b, MAX_TOKEN_BIAS, dtype=torch.int64)
        values = torch.zeros(b, MAX_TOKEN_BIAS)
        until = torch.zeros(b, MAX_TOKEN_BIAS, dtype=torch.int64)
        for row, triples in enumerate(entries):
            for k, (token, value, bound) in enumerate(triples):
                ids[row, k], values[row, k], until[row, k] = token, value, bound
        expected = bias_reference(logits, positions, entries)
        bias_tokens(logits, positions, ids, values, until)
        assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]), dtype=torch.float32).eval()


def reference_decode(model, prompt, n, suppressed, min_tokens, stop_ids, bias=None):
    """Greedy decoding with transformers' model of the target, the whole sequence each step, with
    `bias` ({token: value}) added and `suppressed` at -inf for the first `min_tokens` tokens; it
    ends at a stop id (inclusive)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for i in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            for token, value in (bias or {}).items():
                logits[token] += value
            if i < min_tokens:
                logits[list(suppressed)] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] in stop_ids:
                break
    return out


def test_greedy_min_tokens_equals_the_masked_target_in_every_mode(engine, hf_target):
    """With the greedy output's 4th token as the model's EOS and a stop id from later on, the
    first 10 tokens are neither; every mode equals the masked reference, batched beside a twin
    without min_tokens (which stops at the EOS) and with a chunked prompt."""
    ar = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0))).tokens
    eos, stop = ar[3], ar[12]
    with_eos = dataclasses.replace(engine, eos_token_ids=(eos,))
    expected = reference_decode(hf_target, PROMPT, N, {eos, stop}, 10, {eos, stop})
    assert expected[:10] != ar[:10] and eos not in expected[:10] and stop not in expected[:10]
    for mode in MODES:
        for chunk in (0, 2):
            kept, plain = with_eos.generate_many([
                (PROMPT, GenerationConfig(N, mode=mode, stop_token_ids=(stop,), min_tokens=10)),
                (PROMPT, GenerationConfig(N, mode=mode, stop_token_ids=(stop,)))], prefill_chunk=chunk)
            assert kept.tokens == expected, (mode, chunk)
            assert kept.finish_reason == ("stop" if expected[-1] in (eos, stop) else "length")
            assert plain.tokens == ar[: ar.index(eos) + 1] and plain.finish_reason == "stop"


def test_greedy_logit_bias_equals_the_biased_target_in_every_mode(engine, hf_target):
    """logit_bias bans the greedy output's second token and favours its sixth: every mode equals the
    biased reference, batched beside an unbiased twin, with and without min_tokens too."""
    ar = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0))).tokens
    bias = {ar[1]: -100.0, ar[5]: 3.0}
    with_eos = dataclasses.replace(engine, eos_token_ids=(ar[7],))
    expected = reference_decode(hf_target, PROMPT, N, set(), 0, {ar[7]}, bias)
    held = reference_decode(hf_target, PROMPT, N, {ar[7]}, 12, {ar[7]}, bias)
    assert expected != ar[:len(expected)] and ar[1] not in expected
    for mode in MODES:
        biased, held_back, plain = with_eos.generate_many([
            (PROMPT, GenerationConfig(N, mode=mode, logit_bias=tuple(bias.items()))),
            (PROMPT, GenerationConfig(N, mode=mode, logit_bias=tuple(bias.items()), min_tokens=12)),
            (PROMPT, GenerationConfig(N, mode=mode))], prefill_chunk=2)
        assert biased.tokens == expected and held_back.tokens == held, mode
        assert plain.tokens == ar[: ar.index(ar[7]) + 1], mode


def test_min_tokens_on_the_first_token(engine, hf_target):
    """The prefill's own token is suppressed too: with the greedy first token as the EOS and
    min_tokens 1, the output starts with the runner-up."""
    ar = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0))).tokens
    with_eos = dataclasses.replace(engine, eos_token_ids=(ar[0],))
    expected = reference_decode(hf_target, PROMPT, N, {ar[0]}, 1, {ar[0]})
    for mode in (DraftMode("ar", 0), DraftMode("tree", 16)):
        out = with_eos.generate(PROMPT, GenerationConfig(N, mode=mode, min_tokens=1))
        assert out.tokens == expected and out.tokens[0] != ar[0]
    assert with_eos.generate(PROMPT, GenerationConfig(N, mode=DraftMode("tree", 16))).tokens == [ar[0]]


def test_seeded_sampling_with_min_tokens_holds_back_the_stop_ids_and_equals_plain_decoding(engine):
    """Sampled (position-keyed) with the greedy output's tokens as stop ids: without min_tokens some
    seeds stop within 12 tokens; with min_tokens 12 none does, and tree decoding gives plain
    decoding's tokens for the same seed."""
    ar = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0))).tokens
    stops = tuple(dict.fromkeys(ar))[:MAX_TOKEN_BIAS - len(engine.eos_token_ids)]
    early = 0
    for seed in range(12):
        sampling = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=seed)
        free = engine.generate(PROMPT, GenerationConfig(N, sampling, stop_token_ids=stops, mode=DraftMode("tree", 8)))
        early += len(free.tokens) < 12
        runs = engine.generate_many([(PROMPT, GenerationConfig(N, sampling, stop_token_ids=stops, mode=mode,
                                                               min_tokens=12)) for mode in MODES])
        assert not set(runs[0].tokens[:12]) & set(stops + engine.eos_token_ids), seed
        assert all(r.tokens == runs[0].tokens for r in runs), seed
    assert early >= 3, early


def test_seeded_sampling_with_logit_bias_equals_plain_decoding(engine):
    """Sampled (position-keyed): a banned token never comes, a favoured one comes more often than
    without its bias, and tree decoding gives plain decoding's tokens for the same seed."""
    ar = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("ar", 0))).tokens
    banned = ar[0]
    favoured = next(t for t in ar[4:] if t != banned)
    counts = {"free": 0, "biased": 0}
    for seed in range(10):
        sampling = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=seed)
        free = engine.generate(PROMPT, GenerationConfig(N, sampling, mode=DraftMode("tree", 8), ignore_eos=True))
        runs = engine.generate_many([(PROMPT, GenerationConfig(N, sampling, mode=mode, ignore_eos=True,
                                                               logit_bias=((banned, -100.0), (favoured, 30.0))))
                                     for mode in MODES])
        assert all(r.tokens == runs[0].tokens for r in runs), seed
        assert banned not in runs[0].tokens
        counts["free"] += free.tokens.count(favoured)
        counts["biased"] += runs[0].tokens.count(favoured)
    assert counts["biased"] > 5 * counts["free"] + 50, counts


def test_the_draft_takes_the_biases_too(engine):
    """A token at +100 is every token; the draft's block logits take the bias as well, so its trees
    propose it and most rounds accept many tokens (without: one token a round)."""
    forced = engine.generate(PROMPT, GenerationConfig(N, mode=DraftMode("tree", 16), logit_bias=((42, 100.0),)))
    assert forced.tokens == [42] * N
    assert forced.rounds <= N // 4, forced.acceptance_lengths


def test_bad_token_biases_are_refused(engine):
    too_many = tuple(range(1, MAX_TOKEN_BIAS + 2))
    with pytest.raises(ValueError, match="min_tokens holds back 66 stop and end-of-sequence ids"):
        engine.generate(PROMPT, GenerationConfig(N, stop_token_ids=too_many, min_tokens=1))
    engine.generate(PROMPT, GenerationConfig(4, stop_token_ids=too_many))  # fine without min_tokens
    with pytest.raises(ValueError, match="logit_bias has 65 entries, at most 64"):
        engine.generate(PROMPT, GenerationConfig(N, logit_bias=tuple((t, 1.0) for t in too_many)))
    with pytest.raises(ValueError, match="must be in"):
        engine.generate(PROMPT, GenerationConfig(N, logit_bias=((3, 100.5),)))
    with pytest.raises(ValueError, match="min_tokens must be in"):
        engine.generate(PROMPT, GenerationConfig(4, min_tokens=5))


def test_refused_requests_leave_the_queue_as_it_was(engine):
    """Requests refused for their biases, many more than the queue holds, take no place in it."""
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler

    scheduler = DraftScheduler(LocalLink(engine.verifier), engine.proposer, max_sessions=2, max_queue=3,
                               feature_layer_ids=engine.verifier.feature_layer_ids)
    for _ in range(10):
        with pytest.raises(ValueError, match="logit_bias has 65 entries"):
            scheduler.submit(PROMPT, GenerationConfig(4, logit_bias=tuple((t, 1.0) for t in range(65))), print)
    ends = []
    for _ in range(5):
        scheduler.submit(PROMPT, GenerationConfig(4), ends.append)
    scheduler.run_until_idle()
    assert sum(len(getattr(e, "tokens", ())) == 4 for e in ends) == 5


def test_the_link_carries_token_biases_and_the_verifier_checks_them(engine):
    limits = LinkLimits(max_entries=8, max_tree_nodes=64)
    entry = OpenEntry(7, [1, 2, 3], SamplingParams(), token_bias=(TokenBias(4, 2.5), TokenBias(9, float("-inf"), 13)))
    many = OpenEntry(8, [1, 2, 3], SamplingParams(), token_bias=tuple(TokenBias(t, 1.0) for t in range(65)))
    decoded, refused = decode_link_request(encode_link_request(1, [entry, many]), limits)
    assert decoded == entry
    assert isinstance(refused.outcome, StatusError) and "at most 64" in refused.outcome.message
    message = encode_link_request(1, [entry])
    del message.entries[0].open.bias_values[1]
    (uneven,) = decode_link_request(message, limits)
    assert uneven.outcome.status == "INVALID_ARGUMENT" and "as many of each" in uneven.outcome.message
    verifier = engine.verifier
    for bias, needle in ((TokenBias(verifier.vocab_size, 1.0), "outside the vocabulary"),
                         (TokenBias(3, float("nan")), "must be in [-100, 100]"),
                         (TokenBias(3, float("inf")), "must be in [-100, 100]"),
                         (TokenBias(3, -101.0), "must be in [-100, 100]")):
        (result,) = verifier.step([("test", OpenEntry(9, [1, 2, 3], SamplingParams(), token_bias=(bias,)))])
        assert result.outcome.status == "INVALID_ARGUMENT" and needle in result.outcome.message, needle
    assert verifier.free_capacity == verifier.limits.max_sessions


def test_a_session_that_re_opens_keeps_its_min_tokens(engine):
    """The link fails twice early on (the verifier drops its sessions): every session re-opens with
    its prompt plus its tokens so far, and the held-back ids stay held back up to the same token,
    not min_tokens past the re-open: the outputs are the undisturbed ones."""
    ar = engine.generate(PROMPT, GenerationConfig(40, mode=DraftMode("ar", 0))).tokens
    eos = tuple(dict.fromkeys(ar[2:10]))  # several, so that some come after min_tokens
    requests = [(PROMPT + [i], GenerationConfig(40, mode=mode, min_tokens=m))
                for i, mode in enumerate(MODES) for m in (6, 12)]
    with_eos = dataclasses.replace(engine, eos_token_ids=eos)
    undisturbed = with_eos.generate_many(requests)
    assert any(len(r.tokens) < 40 for r in undisturbed)  # some stop at the EOS once allowed
    tokens, sends = decode_with_flaky_link(engine, requests, (3, 6), eos_token_ids=eos)
    assert sends > 6
    assert tokens == [r.tokens for r in undisturbed]
