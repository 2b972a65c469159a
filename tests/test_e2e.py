"""Both services on loopback: the networked path gives exactly the local engine's output,
concurrent requests do not interfere, errors carry the right status, slots never leak,
and one request is one trace across both services."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.config import load_draft_config, load_target_config
from common.make_tiny import TinySizes, make_tiny
from common.protocol import SamplingParams, StatusError
from common.rpc import CHANNEL_OPTIONS, GENERATION_SERVICE, pb, pb_grpc
from common.tracing import setup_tracing
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.link import LocalLink
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from drafter_svc.session import GenerationConfig
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier
from verifier_svc.tree_verifier import VerifierLimits

MAX_SESSIONS = 4
MAX_SEQ_LEN = 128
PROMPTS = [[5, 17, 42, 99, 3], [300, 12], list(range(60, 90))]
EXPORTER = InMemorySpanExporter()


def verifier_config(pair, **changes) -> VerifierConfig:
    # The verifier projects the features (the draft's fc + hidden_norm), as `--draft` makes it do.
    fields = dict(target_dir=str(pair[0]), feature_layer_ids=load_draft_config(pair[1]).target_layer_ids,
                  projection_dir=str(pair[1]), host="127.0.0.1", port=0, max_sessions=MAX_SESSIONS,
                  max_seq_len=MAX_SEQ_LEN, max_tree_nodes=65)
    return VerifierConfig(**(fields | changes))


def drafter_engine(pair, verifier_port: int, **changes) -> DrafterEngine:
    fields = dict(draft_dir=str(pair[1]), target_dir=str(pair[0]), verifier=f"127.0.0.1:{verifier_port}",
                  host="127.0.0.1", port=0, tree_budget=8, max_new_tokens=16, verifier_wait_s=5)
    cfg = DrafterConfig(**(fields | changes))
    return DrafterEngine.start(cfg, torch.float32)


@pytest.fixture(scope="module")
def spans():
    setup_tracing("e2e-tests").add_span_processor(SimpleSpanProcessor(EXPORTER))
    return EXPORTER


@pytest.fixture(scope="module")
def verifier(qwen3_pair, spans):
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair))) as running:
        yield running


@pytest.fixture(scope="module")
def drafter(qwen3_pair, verifier):
    engine = drafter_engine(qwen3_pair, verifier.port)
    with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as running:
        yield running


@pytest.fixture(scope="module")
def client(drafter):
    with grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def verifier_stub(verifier):
    with grpc.insecure_channel(f"127.0.0.1:{verifier.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def local(qwen3_pair):
    return LocalEngine.load(str(qwen3_pair[0]), str(qwen3_pair[1]),
                            limits=VerifierLimits(max_sessions=2, max_seq_len=MAX_SEQ_LEN))


def request(prompt, n=16, budget=None, temperature=0.0, top_k=0, top_p=1.0, seed=None, **extra):
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=n, sampling=sampling, **extra)
    if budget is not None:
        req.tree_budget = budget
    return req


def run(client, req, timeout=60):
    """Tokens, text and final message of one streamed Generate call."""
    tokens, text, final = [], [], None
    for reply in client.Generate(req, timeout=timeout):
        if reply.HasField("final"):
            final = reply.final
        else:
            tokens.extend(reply.delta.token_ids)
            text.append(reply.delta.text)
    return tokens, "".join(text), final


@contextlib.contextmanager
def served(engine):
    """A Generation stub to `engine`, served on loopback for the block."""
    with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as running, \
            grpc.insecure_channel(f"127.0.0.1:{running.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.GenerationStub(channel)


def concurrently(stub, reqs):
    """Every request at once: `run`'s (tokens, text, final) of each."""
    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: run(stub, r), reqs))


def local_run(local, prompt, n=16, budget=8, sampling=SamplingParams()):
    return local.generate(prompt, GenerationConfig(max_new_tokens=n, sampling=sampling, mode=DraftMode("tree", budget)))


def wait_full(verifier_stub, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if verifier_stub.Info(pb.InfoRequest()).free_sessions == MAX_SESSIONS:
            return
        time.sleep(0.05)
    raise AssertionError(f"verifier capacity not back to {MAX_SESSIONS}")


def test_greedy_over_grpc_equals_local_and_ar(client, local, verifier_stub):
    for prompt in PROMPTS:
        ar = local.generate(prompt, GenerationConfig(max_new_tokens=16, mode=DraftMode("ar", 0))).tokens
        for budget in (0, 4, 16):
            tokens, text, final = run(client, request(prompt, budget=budget))
            here = local_run(local, prompt, budget=budget)  # features projected on the drafter
            assert tokens == ar == here.tokens
            assert list(final.stats.acceptance_lengths) == here.acceptance_lengths  # the same trees
            assert final.usage.completion_tokens == 16 and final.usage.prompt_tokens == len(prompt)
            assert final.stats.rounds == len(final.stats.acceptance_lengths) > 0
            assert text == local.tokenizer.decode(tokens)
    wait_full(verifier_stub)


def test_text_prompt_and_generate_once(client, local):
    prompt = "def add(a, b):"
    ids = local.tokenizer.encode(prompt).ids
    once = client.GenerateOnce(pb.GenerateRequest(text=prompt, max_new_tokens=12), timeout=60)
    assert list(once.token_ids) == local_run(local, ids, n=12).tokens
    assert once.final.finish_reason == "length"


def test_sampling_with_seed_equals_local(client, local):
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    tokens, _, _ = run(client, request(PROMPTS[0], temperature=0.8, top_k=40, top_p=0.9, seed=1234))
    assert tokens == local_run(local, PROMPTS[0], sampling=sampling).tokens


def test_concurrent_requests_do_not_interfere(client, verifier_stub):
    reqs = [request(PROMPTS[i % 3], n=12, budget=(0, 4, 8, 16)[i % 4], temperature=(0.0, 1.0)[i % 2],
                    seed=100 + i) for i in range(8)]
    alone = [run(client, r)[0] for r in reqs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda r: run(client, r)[0], reqs))
    assert together == alone
    wait_full(verifier_stub)


def test_stop_string_cuts_the_text_and_the_tokens(client, local, qwen3_pair, verifier, tmp_path):
    """The text ends before the stop string; the token ids and completion_tokens end with the
    token in which it ends, also where that token's round has more (a drafter whose drafts
    are always accepted), and no later round is delivered or even run."""
    tokens, text, _ = run(client, request(PROMPTS[0], n=16))
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"accept_prob": 1.0,
                                  "continuations": [{"prompt_token_ids": PROMPTS[0], "tokens": tokens}]}))
    engine = drafter_engine(qwen3_pair, verifier.port, bench_oracle=str(oracle))
    with (ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as accepting,
          grpc.insecure_channel(f"127.0.0.1:{accepting.port}", options=CHANNEL_OPTIONS) as channel):
        long_rounds = pb_grpc.GenerationStub(channel)
        same, _, final = run(long_rounds, request(PROMPTS[0], n=16))
        lengths = list(final.stats.acceptance_lengths)
        assert same == tokens and max(lengths) > 2
        round_ends = {1 + sum(lengths[:i]) for i in range(len(lengths) + 1)}  # the prefill's token first

        def completing(stop: str) -> int:
            """How many tokens it takes for the text to hold `stop`."""
            return next(k for k in range(1, len(tokens) + 1) if stop in local.tokenizer.decode(tokens[:k]))

        # A stop string whose first occurrence ends in a token that is not the last of its round.
        candidates = [local.tokenizer.decode(tokens[:k])[-3:] for k in range(2, len(tokens)) if k not in round_ends]
        stop = next(s for s in candidates if len(s) == 3 and "\ufffd" not in s
                    and text.index(s) > 0 and completing(s) not in round_ends)
        k = completing(stop)
        for stub in (client, long_rounds):
            cut_tokens, cut, final = run(stub, request(PROMPTS[0], n=16, stop=[stop]))
            assert cut == text[: text.index(stop)] and final.finish_reason == "stop"
            assert cut_tokens == tokens[:k] and final.usage.completion_tokens == k < len(tokens)
            ran = list(final.stats.acceptance_lengths)  # the verify rounds that ran: the last completed the stop
            assert 1 + sum(ran[:-1]) < k <= 1 + sum(ran), (k, ran)
            once = stub.GenerateOnce(request(PROMPTS[0], n=16, stop=[stop], logprobs=0), timeout=60)
            assert list(once.token_ids) == tokens[:k] and once.text == cut
            assert [t.token_id for t in once.logprobs] == tokens[:k]  # cut with the tokens
            assert once.final.usage.completion_tokens == k and once.final.finish_reason == "stop"


@pytest.mark.parametrize("req, needle", [
    (request([]), "empty"),
    (pb.GenerateRequest(max_new_tokens=4), "no prompt"),
    (request(list(range(MAX_SEQ_LEN))), "max_seq_len"),
    (request([1, 2, 10**9]), "outside the vocabulary"),
    (request([1, -5]), "outside the vocabulary"),
    (request([1, 2], temperature=-1.0), "temperature"),
    (request([1, 2], top_p=1.5), "top_p"),
    (request([1, 2], top_k=-3), "top_k"),
    (request([1, 2], n=0), "max_new_tokens"),
    (request([1, 2], budget=10_000), "tree_budget"),
    (request([1, 2], stop_token_ids=[10**9]), "stop token"),
    (request([1, 2], logprobs=21), "logprobs must be in [0, 20]"),
])
def test_bad_requests_are_invalid_argument(client, verifier_stub, req, needle):
    with pytest.raises(grpc.RpcError) as err:
        run(client, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert run(client, request(PROMPTS[1], n=4))[2].finish_reason == "length"  # still serving
    wait_full(verifier_stub)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)],
                         ids=["greedy", "sampled"])
def test_logprobs_over_grpc_equal_local(client, local, verifier_stub, sampling):
    """Streamed and one-shot logprobs: one per token, as the in-process engine computes them."""
    s = sampling
    req = request(PROMPTS[2], n=16, budget=8, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                  logprobs=4)
    streamed, tokens = [], []
    for reply in client.Generate(req, timeout=60):
        if reply.HasField("delta"):
            assert len(reply.delta.logprobs) == len(reply.delta.token_ids)
            streamed.extend(reply.delta.logprobs)
            tokens.extend(reply.delta.token_ids)
    once = client.GenerateOnce(req, timeout=60)
    want = local.generate(PROMPTS[2], GenerationConfig(16, s, mode=DraftMode("tree", 8), logprobs=4))
    assert tokens == list(once.token_ids) == want.tokens
    for got in (streamed, list(once.logprobs)):
        assert [t.token_id for t in got] == want.tokens
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
        assert [[a.token_id for a in t.top] for t in got] == [[i for i, _ in t.top] for t in want.logprobs]
        assert all(len(t.top) == 4 for t in got)
    plain = client.GenerateOnce(request(PROMPTS[2], n=4), timeout=60)
    assert not plain.logprobs  # only asked for
    wait_full(verifier_stub)


def test_cancel_and_deadline_free_the_verifier_slot(client, verifier_stub):
    call = client.Generate(request(PROMPTS[0], n=120), timeout=60)
    next(call)
    call.cancel()
    wait_full(verifier_stub)
    with pytest.raises(grpc.RpcError) as err:
        run(client, request(PROMPTS[0], n=120), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_full(verifier_stub)


def test_health_and_reflection(drafter):
    with grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
        assert GENERATION_SERVICE in names
        # grpc.reflection.v1 (the same messages under another service name) answers too.
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        reply = next(v1(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=GENERATION_SERVICE)])))
        assert reply.WhichOneof("message_response") == "file_descriptor_response"
        names_v1 = {s.name for s in next(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
                    .list_services_response.service}
        assert {GENERATION_SERVICE, "grpc.reflection.v1.ServerReflection"} <= names_v1 == names


def test_one_request_is_one_trace(client, spans, verifier_stub):
    wait_full(verifier_stub)  # requests of earlier tests (cancelled ones too) are over
    time.sleep(0.2)
    spans.clear()
    prompt = [7, 8, 9, 10, 11, 12, 13]  # a prompt no other test uses
    _, _, final = run(client, request(prompt, n=10, budget=4))
    time.sleep(0.2)
    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.name == "generate" and s.attributes.get("prompt.tokens") == len(prompt)]
    assert len(roots) == 1
    trace_id = roots[0].context.trace_id
    mine = [s for s in finished if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in finished}
    rounds = [s for s in mine if s.name == "round"]
    assert len(rounds) == final.stats.rounds and all(s.parent.span_id == roots[0].context.span_id for s in rounds)
    # Each round is linked to the batched drafter step it ran in, which has the step's parts
    # (a step that drafted nothing, e.g. the last one with no room left, has no draft).
    for r in rounds:
        (link,) = r.links
        step = by_id[link.context.span_id]
        assert step.name == "draft_step"
        parts = {s.name for s in finished if s.parent is not None and s.parent.span_id == step.context.span_id}
        assert "verify_rpc" in parts
        if r.attributes["tree.nodes"] > 1:
            assert {"draft", "tree_build"} <= parts
    # The verifier's span for each round lands under it, linked to the verifier step.
    verifies = [s for s in mine if s.name == "verify"]
    assert len(verifies) == len(rounds) and all(by_id[s.parent.span_id].name == "round" for s in verifies)
    for v in verifies:
        (link,) = v.links
        step = by_id[link.context.span_id]
        assert step.name == "verify_step"
        parts = {s.name for s in finished if s.parent is not None and s.parent.span_id == step.context.span_id}
        assert {"forward", "commit"} <= parts
    (prefill,) = [s for s in mine if s.name == "prefill"]
    assert prefill.parent.span_id == roots[0].context.span_id


def test_concurrent_requests_are_batched(client, verifier_stub, drafter):
    """Concurrent requests share drafter steps: fewer steps than the rounds they ran, same outputs."""
    reqs = [request(PROMPTS[i % 3] + [i], n=12, budget=8) for i in range(MAX_SESSIONS)]
    alone = [run(client, r) for r in reqs]
    scheduler = drafter.server.engine.scheduler
    before = scheduler.steps
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: run(client, r), reqs))
    steps = scheduler.steps - before
    assert [t[0] for t in together] == [a[0] for a in alone]
    rounds = sum(t[2].stats.rounds for t in together)
    assert steps < rounds, (steps, rounds)
    wait_full(verifier_stub)


def test_pipelined_drafter_changes_no_output(qwen3_pair, client, verifier, verifier_stub):
    """A drafter with --pipelining on (two link messages in flight, half the sessions each) gives
    every concurrent request, greedy or seeded, its tokens alone on the lockstep drafter."""
    reqs = [request(PROMPTS[i % 3] + [i], n=12 + i, budget=(0, 4, 8, 16)[i % 4], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=50 + i) for i in range(MAX_SESSIONS)]
    alone = [run(client, r)[0] for r in reqs]
    engine = drafter_engine(qwen3_pair, verifier.port, pipelining="on")
    assert engine.scheduler.pipelined
    with served(engine) as stub:
        for _ in range(2):
            assert [tokens for tokens, _, _ in concurrently(stub, reqs)] == alone
    wait_full(verifier_stub)


def test_local_verifier_drafter_equals_the_services(qwen3_pair, client, verifier_stub):
    """A drafter with --verifier local (the target in its own process, linked in memory, rounds in
    lockstep) gives concurrent requests, greedy and seeded, the networked services' tokens, and
    closes every session it opened on its verifier; it refuses --pipelining on. Its features stay
    on the device: --feature-wire fp8 among its verifier flags packs nothing."""
    reqs = [request(PROMPTS[i % 3] + [i], n=12 + i, budget=(0, 4, 8, 16)[i % 4], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=70 + i) for i in range(MAX_SESSIONS)]
    alone = [run(client, r)[0] for r in reqs]
    cfg = DrafterConfig(draft_dir=str(qwen3_pair[1]), target_dir=str(qwen3_pair[0]), verifier="local",
                        local_verifier=verifier_config(qwen3_pair, feature_wire="fp8"), host="127.0.0.1", port=0,
                        tree_budget=8,
                        max_new_tokens=16)
    with pytest.raises(ValueError, match="lockstep"):
        dataclasses.replace(cfg, pipelining="on").pipelined("cpu")
    engine = DrafterEngine.start(cfg, torch.float32)
    link = engine.scheduler.link
    assert isinstance(link, LocalLink) and not engine.scheduler.pipelined and engine.channels == []
    assert engine.info.max_sessions == MAX_SESSIONS and engine.info.feature_projection
    assert engine.info.feature_wire == "" and link.verifier.runner.feature_wire == ""
    target = link.verifier.runner.model  # the draft shares the target's embedding and head
    assert engine.scheduler.proposer.lm_head is target.lm_head.weight
    assert engine.scheduler.proposer.embed_tokens is target.embed_tokens.weight
    with served(engine) as stub:
        assert [tokens for tokens, _, _ in concurrently(stub, reqs)] == alone
        deadline = time.monotonic() + 10
        while link.verifier.num_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.verifier.num_sessions == 0


def test_chunked_prefill_over_grpc_changes_no_output(qwen3_pair, client, verifier, verifier_stub):
    """A drafter that sends prompts in 8-token chunks (Open + Extend entries, their features
    back in Extended results) gives every concurrent request, greedy or seeded, the tokens and
    rounds of the drafter that sends each prompt in one piece."""
    reqs = [request(PROMPTS[i % 3] * (1 + i), n=12, budget=(4, 8, 16, 0)[i], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=70 + i) for i in range(MAX_SESSIONS)]
    alone = [run(client, r) for r in reqs]
    engine = drafter_engine(qwen3_pair, verifier.port, prefill_chunk=8)
    with served(engine) as stub:
        together = concurrently(stub, reqs)
    for (tokens, _, final), (want, _, want_final) in zip(together, alone):
        assert tokens == want and list(final.stats.acceptance_lengths) == list(want_final.stats.acceptance_lengths)
    wait_full(verifier_stub)


def test_features_sent_as_fp8_change_no_output(qwen3_pair, client, verifier_stub):
    """A verifier that packs its feature rows as fp8 (--feature-wire fp8, InfoResponse.feature_wire)
    gives concurrent requests, greedy and keyed-seeded, whole prompts and chunked ones, the tokens of
    the verifier that sends them in the model's dtype, in a quarter of the bytes for the float32 rows
    (the prompts' rows dominate); only the drafts read the rounded rows. (Rows inline: no feature ring.)"""
    reqs = [request(PROMPTS[i % 3] * (1 + i), n=12, budget=(4, 8, 16, 0)[i], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=90 + i) for i in range(MAX_SESSIONS)]
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair, max_sessions=2))) as plain_verifier:
        engine = drafter_engine(qwen3_pair, plain_verifier.port, prefill_chunk=8, feature_ring=False)
        with served(engine) as stub:
            alone = concurrently(stub, reqs)
        plain_bytes = engine.scheduler.link.bytes_received
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair, max_sessions=2, feature_wire="fp8"))) as fp8:
        with grpc.insecure_channel(f"127.0.0.1:{fp8.port}", options=CHANNEL_OPTIONS) as channel:
            assert pb_grpc.VerifierStub(channel).Info(pb.InfoRequest()).feature_wire == "fp8-e4m3-rowscale"
        engine = drafter_engine(qwen3_pair, fp8.port, prefill_chunk=8, feature_ring=False)
        with served(engine) as stub:
            together = concurrently(stub, reqs)
        fp8_bytes = engine.scheduler.link.bytes_received
    assert [tokens for tokens, _, _ in together] == [tokens for tokens, _, _ in alone]
    assert [final.finish_reason for _, _, final in together] == [final.finish_reason for _, _, final in alone]
    assert fp8_bytes < 0.35 * plain_bytes
    wait_full(verifier_stub)


def test_feature_rows_through_the_ring_change_no_output(qwen3_pair, client, verifier_stub, tmp_path):
    """A drafter on the verifier's host takes its feature rows through the verifier's shared-memory
    ring (common/feature_ring.py): concurrent requests, greedy and seeded, whole prompts and
    chunked ones, get the tokens of a drafter that takes them inline, the link carries a small
    part of the bytes, and the ring's file is gone from its directory."""
    reqs = [request(PROMPTS[i % 3] * (1 + i), n=12, budget=(4, 8, 16, 0)[i], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=110 + i) for i in range(MAX_SESSIONS)]
    config = verifier_config(qwen3_pair, max_sessions=2, feature_ring_dir=str(tmp_path))
    with ServerThread(lambda: serve_verifier(config)) as ring_verifier:
        engine = drafter_engine(qwen3_pair, ring_verifier.port, prefill_chunk=8, feature_ring=False)
        with served(engine) as stub:
            alone = concurrently(stub, reqs)
        inline_bytes = engine.scheduler.link.bytes_received
        engine = drafter_engine(qwen3_pair, ring_verifier.port, prefill_chunk=8)
        with served(engine) as stub:
            together = concurrently(stub, reqs)
            assert os.listdir(tmp_path) == []  # unlinked once the drafter mapped it
        ring_bytes = engine.scheduler.link.bytes_received
    assert [tokens for tokens, _, _ in together] == [tokens for tokens, _, _ in alone]
    assert [list(f.stats.acceptance_lengths) for _, _, f in together] == \
        [list(f.stats.acceptance_lengths) for _, _, f in alone]
    assert ring_bytes < 0.2 * inline_bytes
    wait_full(verifier_stub)


def test_messages_through_the_unix_socket_change_no_output(qwen3_pair, client, verifier_stub, tmp_path):
    """A drafter on the verifier's host sends its link's messages through the Unix socket the
    verifier offers (common/socket_link.py): concurrent requests, greedy and seeded, whole prompts
    and chunked ones, get the tokens and acceptance of a drafter whose messages go through gRPC,
    and the socket's directory is gone once connected."""
    reqs = [request(PROMPTS[i % 3] * (1 + i), n=12, budget=(4, 8, 16, 0)[i], temperature=(0.0, 0.9)[i % 2],
                    top_k=20, seed=120 + i) for i in range(MAX_SESSIONS)]
    config = verifier_config(qwen3_pair, max_sessions=2, unix_socket_dir=str(tmp_path))
    with ServerThread(lambda: serve_verifier(config)) as socket_verifier:
        runs = []
        for unix_socket in (False, True):
            engine = drafter_engine(qwen3_pair, socket_verifier.port, prefill_chunk=8, unix_socket=unix_socket)
            with served(engine) as stub:
                runs.append(concurrently(stub, reqs))
                assert os.listdir(tmp_path) == []
                link = engine.scheduler.link.replicas[0].link
                assert (link._socket is not None) == unix_socket
    grpc_out, socket_out = runs
    assert [tokens for tokens, _, _ in socket_out] == [tokens for tokens, _, _ in grpc_out]
    assert [list(f.stats.acceptance_lengths) for _, _, f in socket_out] == \
        [list(f.stats.acceptance_lengths) for _, _, f in grpc_out]
    wait_full(verifier_stub)


def test_info_reports_device_projection_and_busy_time(client, verifier_stub, qwen3_pair):
    from common.feature_projection import FeatureProjection

    before = verifier_stub.Info(pb.InfoRequest())
    run(client, request(PROMPTS[0], n=8))
    after = verifier_stub.Info(pb.InfoRequest())
    assert after.device_id == before.device_id == "cpu"
    assert after.feature_projection == FeatureProjection.from_draft(qwen3_pair[1]).fingerprint()
    assert after.busy_s > before.busy_s >= 0


@pytest.mark.parametrize("setting, device, verifier_device, expected", [
    ("auto", "cpu", "cpu", False), ("auto", "cuda:0", "cuda:GPU-a", True), ("on", "cpu", "cpu", True),
    ("off", "cuda:0", "cuda:GPU-a", False)])
def test_pipelining_setting(setting, device, verifier_device, expected, monkeypatch):
    import drafter_svc.server as server

    monkeypatch.setattr(server, "device_id", lambda d: "cuda:GPU-b" if str(d).startswith("cuda") else "cpu")
    cfg = DrafterConfig(draft_dir="d", target_dir="t", device=device, pipelining=setting)
    assert cfg.pipelined(verifier_device) is expected
    assert cfg.pipeline_min_sessions(verifier_device) == 2
    # auto on the verifier's own GPU: pipelined only from --shared-gpu-pipeline-sessions sessions
    shared = DrafterConfig(draft_dir="d", target_dir="t", device=device, shared_gpu_pipeline_sessions=12)
    assert shared.pipelined("cuda:GPU-b") is device.startswith("cuda")
    assert shared.pipeline_min_sessions("cuda:GPU-b") == (12 if device.startswith("cuda") else 2)
    with pytest.raises(ValueError, match="pipelining"):
        DrafterConfig(draft_dir="d", target_dir="t", pipelining="sometimes").pipelined("cpu")
    with pytest.raises(ValueError, match="shared_gpu_pipeline_sessions"):
        DrafterConfig(draft_dir="d", target_dir="t", shared_gpu_pipeline_sessions=1).pipeline_min_sessions("cpu")


def test_sampling_through_the_services_is_lossless(client, local, verifier_stub):
    """The first two sampled tokens of many concurrent requests follow the target's own
    distribution (top-k 4 at temperature 1): the second comes out of a tree round."""
    from scipy.stats import chisquare

    from ddtree_kernels.probs import process_probs_reference

    prompt, k = [11, 22, 33, 44], 4
    model = local.verifier.runner.model

    def probs(ids):
        cfg = model.cfg
        from verifier_svc.target_model import KVCache
        cache = KVCache(cfg, 1, len(ids), "cpu", torch.float32)
        pos = torch.arange(len(ids))[None]
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None]
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), pos, cache, torch.tensor([0]), pos, mask).logits[0, -1:]
        one = torch.ones(1)
        return process_probs_reference(logits.float(), one, torch.tensor([k]), one)[0].double()

    first = probs(prompt)
    support = first.nonzero().flatten().tolist()
    expected = {}
    for a in support:
        second = probs(prompt + [a])
        for b in second.nonzero().flatten().tolist():
            expected[(a, b)] = float(first[a] * second[b])
    n = 1200
    reqs = [request(prompt, n=2, budget=8, temperature=1.0, top_k=k, seed=5000 + i) for i in range(n)]
    with ThreadPoolExecutor(16) as pool:
        pairs = [tuple(t) for t, _, _ in pool.map(lambda r: run(client, r), reqs)]
    cells = sorted(expected)
    assert set(pairs) <= set(cells)
    observed = [pairs.count(c) for c in cells]
    total = sum(expected.values())
    p = [expected[c] / total for c in cells]
    assert chisquare(observed, [n * x for x in p]).pvalue > 1e-3
    # The test has power: the distribution of sampling at about half the temperature is caught.
    sharper = [x * x for x in p]
    sharper = [x / sum(sharper) for x in sharper]
    assert chisquare(observed, [n * x for x in sharper]).pvalue < 1e-3
    wait_full(verifier_stub)


def test_verifier_down_at_startup_fails_promptly(qwen3_pair):
    start = time.monotonic()
    with pytest.raises(StatusError) as err:
        drafter_engine(qwen3_pair, verifier_port=1, verifier_wait_s=1.0)
    assert err.value.status == "UNAVAILABLE" and time.monotonic() - start < 15


def test_mismatched_verifier_is_refused(tmp_path, tiny_tokenizer, verifier):
    other = make_tiny(tmp_path, seed=5, sizes=TinySizes(layers=6), tokenizer=tiny_tokenizer)
    with pytest.raises(StatusError) as err:
        drafter_engine(other, verifier.port)
    assert err.value.status == "FAILED_PRECONDITION" and "mismatch" in err.value.message


def test_verifier_with_unknown_features_or_before_token_biases_penalties_or_columns_is_refused(qwen3_pair,
                                                                                              verifier_stub):
    from drafter_svc.link import check_verifier

    info = verifier_stub.Info(pb.InfoRequest())
    target, draft = load_target_config(qwen3_pair[0]), load_draft_config(qwen3_pair[1])
    check_verifier(info, target, draft)
    wire, info.feature_wire = info.feature_wire, "fp4-nvfp4"
    with pytest.raises(StatusError) as err:
        check_verifier(info, target, draft)
    assert err.value.status == "FAILED_PRECONDITION" and "'fp4-nvfp4'" in err.value.message
    info.feature_wire, info.token_bias = wire, False  # an older verifier's Info
    with pytest.raises(StatusError) as err:
        check_verifier(info, target, draft)
    assert err.value.status == "FAILED_PRECONDITION" and "predates token biases" in err.value.message
    info.token_bias, info.penalties = True, False  # one with the token biases, before the penalties
    with pytest.raises(StatusError) as err:
        check_verifier(info, target, draft)
    assert err.value.status == "FAILED_PRECONDITION" and "predates the repetition penalties" in err.value.message
    info.penalties, info.columns = True, False  # one with the penalties, before the link's columns
    with pytest.raises(StatusError) as err:
        check_verifier(info, target, draft)
    assert err.value.status == "FAILED_PRECONDITION" and "as columns" in err.value.message


def test_verifier_projecting_for_another_draft_is_refused(tmp_path, tiny_tokenizer, qwen3_pair, verifier):
    """Same target config, another draft's fc + hidden_norm on the verifier: FAILED_PRECONDITION."""
    other = make_tiny(tmp_path, seed=5, sizes=TinySizes(), tokenizer=tiny_tokenizer)
    with pytest.raises(StatusError) as err:
        drafter_engine((qwen3_pair[0], other[1]), verifier.port)
    assert err.value.status == "FAILED_PRECONDITION" and "--raw-features" in err.value.message


def _verifier_process(cfg: VerifierConfig, port: int = 0, *extra: str) -> tuple[subprocess.Popen, int]:
    """`python -m verifier_svc` for the pair of `cfg` on `port` (0 = any); (process, bound port)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "verifier_svc", "--target", cfg.target_dir,
                             "--feature-layers", ",".join(map(str, cfg.feature_layer_ids)), "--host", "127.0.0.1",
                             "--port", str(port), "--max-seq-len", "1024", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if " listening on " in line:
            return proc, int(line.rsplit(":", 1)[1])
    proc.wait()
    raise RuntimeError(f"the verifier exited with {proc.returncode} before listening")


@pytest.mark.parametrize("recovery_s", [0.0, 1.5])
def test_verifier_killed_mid_generation_is_unavailable(qwen3_pair, recovery_s):
    """No verifier comes back: UNAVAILABLE at once without recovery, else after the recovery timeout."""
    proc, port = _verifier_process(verifier_config(qwen3_pair))
    try:
        engine = drafter_engine(qwen3_pair, port, recovery_timeout_s=recovery_s)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
            call = pb_grpc.GenerationStub(channel).Generate(request(PROMPTS[0], n=900, budget=0), timeout=60)
            next(call)
            proc.kill()
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert recovery_s <= time.monotonic() - start < recovery_s + 10
            assert engine.scheduler.proposer.free_slots == engine.scheduler.max_sessions
    finally:
        proc.kill()
        proc.wait()


def test_drafter_health_follows_its_verifier(qwen3_pair):
    """An idle drafter reports NOT_SERVING soon after its verifier dies, SERVING once a new one
    answers on the same address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc, _ = _verifier_process(verifier_config(qwen3_pair), port)
    try:
        engine = drafter_engine(qwen3_pair, port)
        engine.scheduler.probe_interval_s = 0.2
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def wait_for(status, timeout=20.0):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE)).status == status:
                        return time.monotonic()
                    time.sleep(0.05)
                raise AssertionError(f"health never became {status}")

            wait_for(health_pb2.HealthCheckResponse.SERVING)
            proc.kill()
            proc.wait()
            killed = time.monotonic()
            assert wait_for(health_pb2.HealthCheckResponse.NOT_SERVING) - killed < 5
            proc, _ = _verifier_process(verifier_config(qwen3_pair), port)
            wait_for(health_pb2.HealthCheckResponse.SERVING)
            assert run(pb_grpc.GenerationStub(channel), request(PROMPTS[0], n=4))[2].usage.completion_tokens == 4
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "keyed-seeded"])
def test_verifier_restart_mid_generation_recovers_the_same_output(qwen3_pair, sampled):
    """kill -9 of the verifier mid-generation, then a new one on the same port: every session
    re-opens with its prompt plus the tokens so far and finishes with exactly the tokens of an
    undisturbed run (greedy; seeded with position-keyed sampling)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extra = ("--sampling", "keyed")
    proc, _ = _verifier_process(verifier_config(qwen3_pair), port, *extra)
    try:
        engine = drafter_engine(qwen3_pair, port, recovery_timeout_s=60.0)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            sampling = dict(temperature=0.9, top_k=30, seed=11) if sampled else {}
            reqs = [request(PROMPTS[i], n=96, budget=(0, 8, 16)[i], **sampling) for i in range(3)]
            undisturbed = [run(stub, r)[0] for r in reqs]
            calls = [stub.Generate(r, timeout=120) for r in reqs]
            got = [[] for _ in reqs]
            for tokens, call in zip(got, calls):  # a few tokens each, then the verifier dies
                tokens.extend(next(call).delta.token_ids)
            proc.kill()
            proc.wait()
            time.sleep(0.5)
            proc, _ = _verifier_process(verifier_config(qwen3_pair), port, *extra)
            for tokens, call in zip(got, calls):
                for reply in call:
                    tokens.extend(reply.delta.token_ids)
            assert got == undisturbed
            assert all(len(t) == 96 for t in got) and len(got[0]) > 0
            assert engine.scheduler.proposer.free_slots == engine.scheduler.max_sessions
    finally:
        proc.kill()
        proc.wait()


def test_adaptive_budget_changes_no_output(qwen3_pair, client, verifier_stub):
    """A verifier that measures its verify costs, and a drafter whose planner cuts each step's
    trees to one budget: every concurrent request gets its tokens alone on the fixed-budget
    drafter, greedy ones and seeded ones alike, whose trees it cuts too (the verifier's default
    position-keyed sampling: a seeded output does not depend on its trees)."""
    reqs = [request(PROMPTS[i % 3] + [i], n=14 + i, budget=(4, 8, 16, 8)[i], temperature=(0.0, 0.0, 0.0, 0.9)[i],
                    top_k=20, seed=70 + i) for i in range(MAX_SESSIONS)]
    alone = [run(client, r)[0] for r in reqs]
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair, measure_costs="on"))) as measured:
        with grpc.insecure_channel(f"127.0.0.1:{measured.port}", options=CHANNEL_OPTIONS) as channel:
            info = pb_grpc.VerifierStub(channel).Info(pb.InfoRequest())
        assert info.sampling == "keyed" and not info.deterministic and len(info.verify_costs) >= 4
        assert all(c.seconds > 0 for c in info.verify_costs)
        engine = drafter_engine(qwen3_pair, measured.port)
        planner = engine.scheduler.planner
        assert planner is not None and engine.scheduler.adapt_sampled
        planner.explore_every = 2  # the tiny random pair accepts little: make it try trees too
        chosen, choose = [], planner.choose
        planner.choose = lambda *args, **kw: chosen.append(choose(*args, **kw)) or chosen[-1]
        with served(engine) as stub:
            together = [tokens for tokens, _, _ in concurrently(stub, reqs)]
    assert together == alone
    assert len({c.budget for c in chosen}) >= 2, [c.budget for c in chosen]
    wait_full(verifier_stub)


def test_a_verifier_on_cpu_sends_no_cost_table_by_default(verifier_stub, drafter):
    assert not verifier_stub.Info(pb.InfoRequest()).verify_costs
    assert drafter.server.engine.scheduler.planner is None  # --adaptive-budget auto: fixed budgets


def test_final_stats_say_where_each_rounds_time_went(client):
    """One RoundStats per verify round: its tokens and tree, its step's draft and build, the
    verifier's step (LinkResponse.step_seconds) and the rest of the round trip."""
    _, _, final = run(client, request(PROMPTS[2], n=16, budget=8))
    stats = final.stats
    assert len(stats.round_stats) == stats.rounds >= 1
    assert [r.tokens for r in stats.round_stats] == list(stats.acceptance_lengths)
    for r in stats.round_stats:
        assert 1 <= r.tokens <= r.tree_nodes <= 9
        assert r.verify_ms > 0 and r.network_ms >= 0
        # A step whose sessions all draft nothing (no room left: a root-only tree) has no draft.
        assert (r.draft_ms > 0 and r.build_ms > 0) if r.tree_nodes > 1 else r.draft_ms == r.build_ms == 0
    assert max(r.tree_nodes for r in stats.round_stats) > 1
