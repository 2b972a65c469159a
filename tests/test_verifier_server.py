"""The Verifier gRPC server on loopback, over the `Link` API: the same results as in process,
batching over sessions and links that changes nothing, per-session failures that stay
per-session, link limits, no leaked KV slots, idle timeout, pipelining, health,
reflection, tracing and shutdown.

The server runs in this process, on its own event loop in a background thread
(`ServerThread`); tests talk to it with the sync gRPC client, as the drafter does, one
`LinkStream` per drafter connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import stat
import threading
import time
from collections.abc import Sequence
from typing import Self

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import metrics
from common.config import load_draft_config
from common.feature_ring import RingOffer, RingReader
from common.make_tiny import TinySizes
from common.protocol import (
    CloseEntry,
    Entry,
    Extended,
    ExtendEntry,
    OpenEntry,
    Prefilled,
    SamplingParams,
    StatusError,
    StepResult,
    TreeEntry,
    Verified,
)
from common.rpc import CHANNEL_OPTIONS, VERIFIER_SERVICE, decode_message, pb, pb_grpc
from common.tracing import current_traceparent, setup_tracing, tracer
from common.tree import DraftTree
from common.wire import (
    MAX_SESSION_ID,
    VERIFIED_COLUMNS,
    decode_link_response,
    decode_tensor,
    encode_link_request,
    pack_ints,
    tensor_bytes,
    unpack_ints,
)
from common.socket_link import SocketOffer, SocketStream, recv_frame, send_frame
from common.socket_link import connect as socket_connect
from drafter_svc.ddtree import build_ddtree
from drafter_svc.link import GrpcLink, verifier_stub
from tests.servers import ServerThread
from verifier_svc.scheduler import LinkStep
from verifier_svc.server import VerifierConfig, VerifierServer, load_verifier, serve
from verifier_svc.tree_verifier import VerifierError

MAX_SESSIONS = 4
MAX_SEQ_LEN = 128
MAX_TREE_NODES = 33
MAX_TREE_DEPTH = 16
SIZES = TinySizes()  # the qwen3_pair fixture's sizes
VOCAB = SIZES.vocab
FEATURE_DIM = SIZES.hidden * len(SIZES.target_layer_ids)
DEPTH = SIZES.block_size - 1  # draft depths per tree
BUDGET = 8  # drafted nodes per tree
ROUNDS = 4
PROMPT = [5, 17, 42, 99, 3]
PROMPTS = [PROMPT, list(range(60, 90)), [7, 300, 12, 450, 33, 8, 2], [100, 200, 300]]
TRUTH_LEN = 48  # greedy continuation tokens the drafter knows per prompt
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=7)
SAMPLINGS = {  # one sampling per session of PROMPTS
    "greedy": [GREEDY] * 4,
    "seeded": [SEEDED, SamplingParams(temperature=0.7, top_p=0.9, seed=8),
               SamplingParams(temperature=1.3, top_k=5, seed=9), SamplingParams(temperature=1.0, seed=10)],
    "mixed": [GREEDY, SEEDED, GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=11)],
}
EXPORTER = InMemorySpanExporter()
IDLE_S = 0.6  # idle_timeout_s of the idle-timeout tests' server


class LinkStream:
    """One Link call, driven a message at a time from the test thread."""

    def __init__(self, stub: pb_grpc.VerifierStub, timeout: float | None = None):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Link(iter(self._requests.get, None), timeout=timeout)
        self.steps = 0
        self.notices: dict[int, pb.LinkResponse] = {}  # step -> the notice that came ahead of its reply

    def post(self, message: pb.LinkRequest | Sequence[Entry]) -> pb.LinkRequest:
        """Send one message without reading its reply; entries go out as the next step."""
        if not isinstance(message, pb.LinkRequest):
            self.steps += 1
            message = encode_link_request(self.steps, message)
        self._requests.put(message)
        return message

    def recv(self) -> pb.LinkResponse:
        """The next reply; a notice ahead of it is kept in `notices` and checked against it: the
        same step, and for each of its sessions a Prefilled in the reply with the same token."""
        reply = next(self.call)
        if not reply.notice:
            return reply
        notice, reply = reply, next(self.call)
        assert not reply.notice and reply.step == notice.step and notice.step not in self.notices
        firsts = {r.session_id: r.prefilled.token for r in reply.results if r.WhichOneof("kind") == "prefilled"}
        assert notice.results and all(r.prefilled.feature_rows == 0 and firsts[r.session_id] == r.prefilled.token
                                      for r in notice.results)
        self.notices[notice.step] = notice
        return reply

    def send(self, message: pb.LinkRequest | Sequence[Entry]) -> pb.LinkResponse:
        """One message and its one reply (same step)."""
        sent = self.post(message)
        reply = self.recv()
        assert reply.step == sent.step
        return reply

    def step(self, message: pb.LinkRequest | Sequence[Entry]) -> list[StepResult]:
        return decode(self.send(message))

    def end(self) -> None:
        """Half-close: the server ends the call with OK and no further reply."""
        self._requests.put(None)
        assert list(self.call) == []
        assert self.call.code() == grpc.StatusCode.OK

    def expect_abort(self, code: grpc.StatusCode, needle: str) -> None:
        """The server ends the link with `code`; its details name the problem on one line."""
        with pytest.raises(grpc.RpcError) as info:
            next(self.call)
        assert info.value.code() == code, info.value
        assert needle in info.value.details()
        assert "\n" not in info.value.details() and "Traceback" not in info.value.details()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._requests.put(None)  # ends the request iterator
        self.call.cancel()


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layers(qwen3_pair) -> tuple[int, ...]:
    return load_draft_config(qwen3_pair[1]).target_layer_ids


@pytest.fixture(scope="module")
def config(qwen3_pair, layers) -> VerifierConfig:
    return VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, host="127.0.0.1", port=0,
                          max_sessions=MAX_SESSIONS, max_seq_len=MAX_SEQ_LEN, max_tree_nodes=MAX_TREE_NODES,
                          max_tree_depth=MAX_TREE_DEPTH, idle_timeout_s=30)


@pytest.fixture(scope="module")
def tracing():
    # setup_tracing installs the process's provider once (another test module may have done
    # it first), so the exporter goes onto whichever provider is installed.
    setup_tracing("verifier-tests").add_span_processor(SimpleSpanProcessor(EXPORTER))
    return EXPORTER


def _connect(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)


@pytest.fixture(scope="module")
def server(config, tracing):
    with ServerThread(lambda: serve(config)) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server):
    with _connect(server.port) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.VerifierStub:
    return pb_grpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def local(config):
    """The same model in process, to compare against."""
    return load_verifier(config)


@pytest.fixture
def twin(local):
    """Makes in-process links to `local` (its `TreeVerifier.step` under a fresh owner, like
    `LocalLink`); their sessions are closed after the test."""
    owners = []

    def make():
        owner = object()
        owners.append(owner)
        return lambda entries: [r for r in local.step([(owner, e) for e in entries]) if r is not None]

    yield make
    for owner in owners:
        local.close_owner(owner)


class WorkerGate:
    """Holds the server's model worker inside one TreeVerifier.begin until `release`, so that
    the messages sent meanwhile queue up and are served by the step after it."""

    def __init__(self, worker, monkeypatch):
        self.worker, self.monkeypatch, self.calls = worker, monkeypatch, []
        self.entered, self.gate = threading.Event(), threading.Event()

    def hold(self, link: LinkStream) -> pb.LinkRequest:
        """Post a no-op message on `link` (a close of an unknown session: a worker step with no
        results), wait until the worker is stuck in it; later steps are counted in `calls`."""
        real = self.worker.verifier.begin

        def step(entries, **kw):
            self.calls.append(len(entries))
            if len(self.calls) == 1:
                self.entered.set()
                assert self.gate.wait(30)
            return real(entries, **kw)

        self.monkeypatch.setattr(self.worker.verifier, "begin", step)
        sent = link.post([CloseEntry(99)])
        assert self.entered.wait(10), "the worker did not start the step"
        return sent

    def release(self, queued: int) -> None:
        """Once `queued` messages wait in the worker's queue, let the worker go on."""
        deadline = time.monotonic() + 10
        while self.worker._queue.qsize() < queued:
            assert time.monotonic() < deadline, "the messages did not reach the worker's queue"
            time.sleep(0.005)
        self.gate.set()


@pytest.fixture
def worker_gate(server, monkeypatch):
    gate = WorkerGate(server.server.worker, monkeypatch)
    yield gate
    gate.gate.set()  # never leave the shared worker stuck


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Every test that uses the shared server leaves all of its KV slots free."""
    stub = request.getfixturevalue("stub") if "stub" in request.fixturenames else None
    yield
    if stub is not None:
        wait_free(stub)


@pytest.fixture(scope="module")
def truth(local, layers) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation on the target (root-only trees, in process)."""
    owner = object()
    step = lambda entries: [r for r in local.step([(owner, e) for e in entries]) if r is not None]
    seqs = [[r.outcome.token] for r in step([OpenEntry(i + 1, p, GREEDY, "", layers) for i, p in enumerate(PROMPTS)])]
    for rnd in range(1, TRUTH_LEN):
        for s, r in zip(seqs, step([TreeEntry(i + 1, rnd, root_only(s[-1])) for i, s in enumerate(seqs)])):
            s.append(r.outcome.next_token)
    local.close_owner(owner)
    return {tuple(p): s for p, s in zip(PROMPTS, seqs)}


# -- helpers --------------------------------------------------------------------------------


def decode(reply: pb.LinkResponse) -> list[StepResult]:
    return decode_link_response(reply, vocab_size=VOCAB, feature_dim=FEATURE_DIM,
                                max_feature_rows=(len(reply.results) + 1) * MAX_SEQ_LEN)


def wait_free(stub, expected: int = MAX_SESSIONS, timeout: float = 10.0) -> None:
    """Poll Info until `expected` slots are free (link ends release them on the worker thread)."""
    deadline = time.monotonic() + timeout
    while (free := stub.Info(pb.InfoRequest(), timeout=5).free_sessions) != expected:
        assert time.monotonic() < deadline, f"free_sessions stuck at {free}, expected {expected}"
        time.sleep(0.02)


def free_sessions(stub) -> int:
    return stub.Info(pb.InfoRequest(), timeout=5).free_sessions


def opening(sid: int, layers, prompt=PROMPT, sampling: SamplingParams = GREEDY, traceparent="",
            logprobs: int | None = None, more: bool = False) -> OpenEntry:
    return OpenEntry(sid, list(prompt), sampling, traceparent, tuple(layers), logprobs, more)


def root_only(root: int) -> DraftTree:
    return DraftTree(torch.tensor([root]), torch.tensor([-1]), torch.tensor([-1]))


def small_tree(root: int) -> DraftTree:
    """root -> 11 -> 13, root -> 12."""
    return DraftTree.from_parents([root, 11, 12, 13], [-1, 0, 0, 1])


def chain(root: int, length: int) -> DraftTree:
    """A path of `length` drafted nodes under `root`."""
    return DraftTree.from_parents([root] + [(7 * i + 3) % VOCAB for i in range(length)], list(range(-1, length)))


def raw_message(entries, step: int = 0) -> pb.LinkRequest:
    """A LinkRequest built by hand. `entries` holds pb.SessionEntry messages and trees given as
    (session id, round, tokens, next_token, next_sibling[, num_nodes]), num_nodes len(tokens)
    unless given; the trees go as columns, their buffers concatenated in order."""
    msg = pb.LinkRequest(step=step)
    buffers: tuple[list[int], list[int], list[int]] = ([], [], [])
    trees: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])  # id, round, nodes, position
    for index, e in enumerate(entries):
        if isinstance(e, pb.SessionEntry):
            msg.entries.append(e)
            continue
        sid, rnd, *tree = e
        for column, value in zip(trees, (sid, rnd, tree[3] if len(tree) > 3 else len(tree[0]), index)):
            column.append(value)
        for column, values in zip(buffers, tree[:3]):
            column.extend(values)
    if trees[0]:
        msg.trees.fields.CopyFrom(pack_ints([v for column in trees for v in column]))
    for name, column in zip(("tokens", "next_token", "next_sibling"), buffers):
        getattr(msg, f"tree_{name}").CopyFrom(pack_ints(column))
    return msg


def as_raw(sid: int, rnd: int, tree: DraftTree) -> tuple:
    return (sid, rnd, tree.tokens.tolist(), tree.next_token.tolist(), tree.next_sibling.tolist())


def outcome(r: StepResult) -> tuple[tuple, torch.Tensor | None]:
    """A result as plain values (its session id left out) and its features."""
    o = r.outcome
    if isinstance(o, Prefilled):
        return ("prefilled", o.token, o.max_seq_len, o.features.shape[0]), o.features.clone()
    if isinstance(o, Verified):
        return ("verified", o.round, tuple(o.accepted_tokens), o.next_token), o.features.clone()
    return ("error", o.status, o.message), None


def assert_same(got: list, want: list, *, exact: bool) -> None:
    """Outcome lists equal; features bit for bit (`exact`) or up to float32 rounding (a batch of
    other sessions, or of other prompt lengths, changes GEMM shapes and so the last bits)."""
    assert [g for g, _ in got] == [w for w, _ in want]
    for (_, g), (_, w) in zip(got, want):
        if g is None or w is None:
            assert g is w
        elif exact:
            assert g.dtype == w.dtype and g.shape == w.shape and g.numpy().tobytes() == w.numpy().tobytes()
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)


def assert_error(result: StepResult, sid: int, status: str, needle: str) -> None:
    """An in-band Error for session `sid`, with a one-line message."""
    assert result.session_id == sid
    o = result.outcome
    assert isinstance(o, StatusError), o
    assert o.status == status and needle in o.message, (o.status, o.message)
    assert "\n" not in o.message and "Traceback" not in o.message


def assert_error_code(reply: pb.LinkResponse, index: int, code: grpc.StatusCode) -> None:
    """The raw Error result, the reply's `index`-th in order, carries the numeric grpc.StatusCode."""
    fields = unpack_ints(reply.verified.fields, max_count=1 << 20, what="verified").reshape(VERIFIED_COLUMNS, -1)
    verified = set(fields[-1].tolist())  # the Verified columns' indices among the results
    assert index not in verified
    r = reply.results[index - sum(i < index for i in verified)]
    assert r.WhichOneof("kind") == "error", r
    assert r.error.code == code.value[0], r.error


class Drafter:
    """One session's draft trees: seeded random logits per depth (`build_ddtree`), with the
    target's greedy continuation boosted at most depths while the session is on it, so
    greedy sessions accept tokens and the KV compaction is exercised."""

    def __init__(self, prompt, truth):
        self.gen = torch.Generator().manual_seed(31 * sum(prompt) + len(prompt))
        self.truth = truth.get(tuple(prompt), [])
        self.generated: list[int] = []

    def start(self, token: int) -> None:
        self.generated = [token]

    def tree(self) -> DraftTree:
        logits = torch.randn(DEPTH, VOCAB, generator=self.gen)
        hits = torch.rand(DEPTH, generator=self.gen) < 0.8
        k = len(self.generated)
        if self.generated == self.truth[:k]:
            for d in range(DEPTH):
                if hits[d] and k + d < len(self.truth):
                    logits[d, self.truth[k + d]] = 8.0
        return build_ddtree(logits, self.generated[-1], budget=BUDGET)

    def advance(self, v: Verified) -> None:
        self.generated += v.accepted_tokens + [v.next_token]


def drive(step, plans, ids, truth, layers, rounds: int = ROUNDS, barrier: threading.Barrier | None = None) -> list:
    """Run the sessions `plans` [(prompt, sampling)] under `ids` through `step` (entries ->
    results): one message opens them all, each round's message carries a tree of every one,
    a last one closes them. Returns each session's outcomes. `barrier` is passed before each
    message but the close (to line messages of several links up in the same worker steps)."""
    drafters = [Drafter(prompt, truth) for prompt, _ in plans]
    out: list[list] = [[] for _ in plans]

    def call(entries):
        if barrier is not None:
            barrier.wait(timeout=60)
        results = step(entries)
        assert [r.session_id for r in results] == [e.session_id for e in entries]
        return results

    for i, r in enumerate(call([opening(sid, layers, p, s) for sid, (p, s) in zip(ids, plans)])):
        assert isinstance(r.outcome, Prefilled), r.outcome
        out[i].append(outcome(r))
        drafters[i].start(r.outcome.token)
    for rnd in range(1, rounds + 1):
        for i, r in enumerate(call([TreeEntry(sid, rnd, d.tree()) for sid, d in zip(ids, drafters)])):
            assert isinstance(r.outcome, Verified) and r.outcome.round == rnd, r.outcome
            out[i].append(outcome(r))
            drafters[i].advance(r.outcome)
    assert step([CloseEntry(sid) for sid in ids]) == []
    return out


def plans_for(name: str) -> list[tuple[list[int], SamplingParams]]:
    return list(zip(PROMPTS, SAMPLINGS[name]))


@pytest.fixture(scope="module")
def alone(stub, truth, layers):
    """Each session of a SAMPLINGS plan run alone on its own link (memoised)."""
    cache: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in cache:
            runs = []
            for plan in plans_for(name):
                with LinkStream(stub) as link:
                    runs.append(drive(link.step, [plan], [1], truth, layers)[0])
                    link.end()
            cache[name] = runs
        return cache[name]

    return get


# -- info, health, reflection -----------------------------------------------------------------


def test_info(stub, config, local):
    info = stub.Info(pb.InfoRequest(), timeout=5)
    cfg = local.runner.model.cfg
    assert (info.architecture, info.vocab_size, info.hidden_size, info.num_layers) == (
        cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers)
    assert info.dtype == "float32" and info.config_fingerprint == cfg.fingerprint()
    assert tuple(info.feature_layer_ids) == config.feature_layer_ids
    assert (info.max_seq_len, info.max_sessions, info.max_tree_nodes, info.free_sessions) == (
        MAX_SEQ_LEN, MAX_SESSIONS, MAX_TREE_NODES, MAX_SESSIONS)
    assert (info.vocab_size, local.runner.model.feature_dim) == (VOCAB, FEATURE_DIM)


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", VERIFIER_SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert {VERIFIER_SERVICE, "grpc.health.v1.Health"} <= names
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=VERIFIER_SERVICE)
    (reply,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
    assert reply.WhichOneof("message_response") == "file_descriptor_response"


# -- same results as in process; batching changes nothing ----------------------------------------


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_link_matches_in_process_verifier(stub, twin, truth, layers, name):
    """Every message carries all four sessions; the link gives TreeVerifier.step's results bit for bit."""
    plans = plans_for(name)
    ids = [3, 1, 2**40, 7]
    with LinkStream(stub) as link:
        got = drive(link.step, plans, ids, truth, layers)
        link.end()
    want = drive(twin(), plans, ids, truth, layers)
    for g, w in zip(got, want):
        assert_same(g, w, exact=True)
    assert all(o[0][2] == MAX_SEQ_LEN for o in (s[0] for s in got))  # Prefilled.max_seq_len
    greedy = [s for s, sampling in zip(got, SAMPLINGS[name]) if sampling.greedy]
    if greedy:  # the drafts are mostly right: the trees were really walked
        assert sum(len(o[0][2]) for s in greedy for o in s[1:]) > 3 * len(greedy)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_sessions_batched_on_one_link_match_each_alone(stub, alone, truth, layers, name):
    with LinkStream(stub) as link:
        together = drive(link.step, plans_for(name), [9, 2, 5, 1], truth, layers)
        link.end()
    for got, want in zip(together, alone(name)):
        assert_same(got, want, exact=False)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_sessions_spread_over_two_links_match_each_alone(stub, alone, truth, layers, name):
    """Two drafters share the verifier at once, each with two sessions under the same ids."""
    plans = plans_for(name)
    barrier = threading.Barrier(2)
    got: list = [None, None]
    errors: list = []

    def run(half: int) -> None:
        try:
            with LinkStream(stub) as link:
                got[half] = drive(link.step, plans[2 * half: 2 * half + 2], [1, 2], truth, layers, barrier=barrier)
                link.end()
        except Exception as exc:  # noqa: BLE001 (reported by the test thread)
            barrier.abort()
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(h,)) for h in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for session, want in zip(got[0] + got[1], alone(name)):
        assert_same(session, want, exact=False)


def test_worker_batches_messages_of_all_links_into_one_step(server, stub, local, layers, tracing, worker_gate,
                                                            monkeypatch):
    """While the worker is busy, messages from two links queue up; the next worker step runs
    them together: one TreeVerifier step, one batched forward of all four trees."""
    worker = server.server.worker
    a, b = LinkStream(stub), LinkStream(stub)
    with a, b:
        roots = {}
        for name, link in (("a", a), ("b", b)):
            for r in link.step([opening(1, layers, PROMPTS[0]), opening(2, layers, PROMPTS[1])]):
                roots[name, r.session_id] = r.outcome.token
        steps_before = worker.steps
        rows = []
        real_verify = worker.verifier.runner.launch_verify

        def counting_verify(batch_rows, *args):
            rows.append(len(batch_rows))
            return real_verify(batch_rows, *args)

        monkeypatch.setattr(worker.verifier.runner, "launch_verify", counting_verify)
        blocker = worker_gate.hold(a)
        spans_before = len(tracing.get_finished_spans())
        trees = {key: small_tree(root) if key[1] == 1 else chain(root, 5) for key, root in roots.items()}
        entries = {"a": [TreeEntry(1, 1, trees["a", 1]), TreeEntry(2, 1, trees["a", 2])],
                   "b": [TreeEntry(2, 1, trees["b", 2]), TreeEntry(1, 1, trees["b", 1])]}
        sent_a, sent_b = a.post(entries["a"]), b.post(entries["b"])
        worker_gate.release(queued=2)
        first = a.recv()
        assert first.step == blocker.step and list(first.results) == []
        reply_a, reply_b = a.recv(), b.recv()
        assert (reply_a.step, reply_b.step) == (sent_a.step, sent_b.step)
        assert worker_gate.calls == [1, 4] and rows == [4]  # one step, one forward, for both links' trees
        assert worker.steps - steps_before == 2  # three messages, two worker steps
        new_steps = [s for s in tracing.get_finished_spans()[spans_before:] if s.name == "verify_step"]
        assert (new_steps[1].attributes["links"], new_steps[1].attributes["entries"]) == (2, 4)
        for link in (a, b):
            link.send([CloseEntry(1), CloseEntry(2)])
            link.end()

    # The results are those of the same four trees in one in-process step (row order aside).
    owners = {"a": object(), "b": object()}
    try:
        for name, owner in owners.items():
            local.step([(owner, opening(1, layers, PROMPTS[0])), (owner, opening(2, layers, PROMPTS[1]))])
        want = local.step([(owners[n], e) for n in "ab" for e in entries[n]])
    finally:
        for owner in owners.values():
            local.close_owner(owner)
    got = decode(reply_a) + decode(reply_b)
    assert [r.session_id for r in got] == [1, 2, 2, 1]
    assert_same([outcome(r) for r in got], [outcome(r) for r in want], exact=False)


def test_one_batched_forward_per_step(local, layers):
    """TreeVerifier.step: the step's opens share one prefill (forward + sample queued, then one
    read of its results); all trees share one launched forward, one wait for it and one commit."""
    stages = []

    def stage(name):
        stages.append(name)
        return contextlib.nullcontext()

    owner = object()
    try:
        opened = local.step([(owner, opening(1, layers)), (owner, opening(2, layers, PROMPTS[2]))], stage=stage)
        assert stages == ["prefill", "forward", "sample", "prefilled"]
        stages.clear()
        trees = [(owner, TreeEntry(r.session_id, 1, small_tree(r.outcome.token))) for r in opened]
        assert all(isinstance(r.outcome, Verified) for r in local.step(trees, stage=stage))
        assert stages == ["launch", "forward", "commit"]
    finally:
        local.close_owner(owner)


@pytest.mark.parametrize("second", ["open", "close"])
def test_in_process_duplicate_entry_closes_the_session(local, layers, second):
    """TreeVerifier.step: two entries for one session in one step fail it (both results are
    errors), and it ends closed."""
    owner = object()
    try:
        dup = opening(5, layers) if second == "open" else CloseEntry(5)
        results = local.step([(owner, opening(5, layers)), (owner, dup)])
        assert_error(results[0], 5, "FAILED_PRECONDITION", "another entry in this step")
        assert_error(results[1], 5, "FAILED_PRECONDITION", "another entry in this step")
        assert local.free_capacity == MAX_SESSIONS and local.num_sessions == 0
    finally:
        local.close_owner(owner)


# -- per-session failures -------------------------------------------------------------------------


def _bad(tokens, next_token, next_sibling, rnd=1):
    return lambda r: (rnd, tokens(r), next_token, next_sibling)


def _chain_raw(n: int):
    """A path of n nodes (root included)."""
    return lambda r: (1, [r] + [(5 * i + 1) % VOCAB for i in range(n - 1)], list(range(1, n)) + [-1], [-1] * n)


# name -> (root -> (round, tokens, next_token, next_sibling), needle, prompt of the bad session)
BAD_TREES = {
    "link backwards (cycle)": (_bad(lambda r: [r, 5, 6], [1, 2, 1], [-1, -1, -1]), "does not point forward", PROMPT),
    "self loop": (_bad(lambda r: [r, 5], [1, 1], [-1, -1]), "does not point forward", PROMPT),
    "sibling backwards": (_bad(lambda r: [r, 5, 6], [1, -1, -1], [-1, -1, 1]), "does not point forward", PROMPT),
    "index out of range": (_bad(lambda r: [r, 5], [7, -1], [-1, -1]), "out of range", PROMPT),
    "link below -1": (_bad(lambda r: [r, 5], [-2, -1], [-1, -1]), "out of range", PROMPT),
    "node reached twice": (_bad(lambda r: [r, 5, 6], [1, 2, -1], [-1, 2, -1]), "reached twice", PROMPT),
    "unreachable node": (_bad(lambda r: [r, 5, 6], [1, -1, -1], [-1, -1, -1]), "not reachable", PROMPT),
    "root has a sibling": (_bad(lambda r: [r, 5], [-1, -1], [1, -1]), "root node 0 has a sibling", PROMPT),
    "token outside vocab": (_bad(lambda r: [r, VOCAB + 9], [1, -1], [-1, -1]), "outside the vocabulary", PROMPT),
    "negative token": (_bad(lambda r: [r, -4], [1, -1], [-1, -1]), "outside the vocabulary", PROMPT),
    "duplicate sibling tokens": (_bad(lambda r: [r, 5, 5], [1, -1, -1], [-1, 2, -1]), "repeats a sibling",
                                 PROMPT),
    "root is not the bonus": (_bad(lambda r: [(r + 1) % VOCAB, 5], [1, -1], [-1, -1]), "last bonus token", PROMPT),
    "round out of order": (_bad(lambda r: [r, 5], [1, -1], [-1, -1], rnd=2), "expected round 1", PROMPT),
    "round zero": (_bad(lambda r: [r, 5], [1, -1], [-1, -1], rnd=0), "out of order", PROMPT),
    "too deep": (_chain_raw(MAX_TREE_DEPTH + 2), f"exceeds max_depth {MAX_TREE_DEPTH}", PROMPT),
    "past max_seq_len": (_chain_raw(4), "does not fit", [1] * (MAX_SEQ_LEN - 3)),
    "too many nodes": (_chain_raw(MAX_TREE_NODES + 1), f"expected 1 to {MAX_TREE_NODES}", PROMPT),
    "empty tree": (lambda r: (1, [], [], []), f"0 nodes, expected 1 to {MAX_TREE_NODES}", PROMPT),
}


@pytest.mark.parametrize("case", list(BAD_TREES))
def test_bad_tree_fails_only_its_session(stub, twin, layers, case):
    """Sessions 1 and 3 verify good trees in the message where session 2's tree is bad: only
    session 2 fails (INVALID_ARGUMENT) and is closed; the link goes on."""
    build, needle, bad_prompt = BAD_TREES[case]
    local = twin()
    with LinkStream(stub) as link:
        opens = [opening(1, layers, PROMPTS[0]), opening(2, layers, bad_prompt), opening(3, layers, PROMPTS[2])]
        opened = link.step(opens)
        assert_same([outcome(r) for r in opened], [outcome(r) for r in local(opens)], exact=False)
        roots = {r.session_id: r.outcome.token for r in opened}
        good = {1: small_tree(roots[1]), 3: chain(roots[3], 6)}
        reply = link.send(raw_message([as_raw(1, 1, good[1]), (2, *build(roots[2])), as_raw(3, 1, good[3])]))
        got = decode(reply)
        assert [r.session_id for r in got] == [1, 2, 3]
        assert_error(got[1], 2, "INVALID_ARGUMENT", needle)
        assert_error_code(reply, 1, grpc.StatusCode.INVALID_ARGUMENT)
        want = local([TreeEntry(1, 1, good[1]), TreeEntry(3, 1, good[3])])
        assert_same([outcome(got[0]), outcome(got[2])], [outcome(r) for r in want], exact=False)
        assert free_sessions(stub) == MAX_SESSIONS - 2  # session 2's slot is free at once
        # The link goes on; session 2 is gone.
        roots = {1: got[0].outcome.next_token, 3: got[2].outcome.next_token}
        again = link.step([TreeEntry(1, 2, small_tree(roots[1])), TreeEntry(2, 1, root_only(5)),
                           TreeEntry(3, 2, small_tree(roots[3]))])
        want = local([TreeEntry(1, 2, small_tree(roots[1])), TreeEntry(3, 2, small_tree(roots[3]))])
        assert_same([outcome(again[0]), outcome(again[2])], [outcome(r) for r in want], exact=False)
        assert_error(again[1], 2, "NOT_FOUND", "no open session 2")
        link.send([CloseEntry(1), CloseEntry(3)])
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


BAD_OPENS = {
    "top_p 0": ({"sampling": SamplingParams(top_p=0.0)}, "INVALID_ARGUMENT", "top_p"),
    "top_p above 1": ({"sampling": SamplingParams(top_p=1.5)}, "INVALID_ARGUMENT", "top_p"),
    "negative temperature": ({"sampling": SamplingParams(temperature=-0.5)}, "INVALID_ARGUMENT", "temperature"),
    "infinite temperature": ({"sampling": SamplingParams(temperature=float("inf"))}, "INVALID_ARGUMENT",
                             "temperature"),
    "negative top_k": ({"sampling": SamplingParams(top_k=-1)}, "INVALID_ARGUMENT", "top_k"),
    "seed past 2^63": ({"sampling": SamplingParams(temperature=1.0, seed=2**63)}, "INVALID_ARGUMENT", "seed"),
    "empty prompt": ({"prompt": []}, "INVALID_ARGUMENT", "prompt is empty"),
    "prompt too long": ({"prompt": [1] * MAX_SEQ_LEN}, "INVALID_ARGUMENT", "does not fit max_seq_len"),
    "id >= vocab": ({"prompt": [1, VOCAB]}, "INVALID_ARGUMENT", "outside the vocabulary"),
    "id < 0": ({"prompt": [-1, 2]}, "INVALID_ARGUMENT", "outside the vocabulary"),
    "logprobs above 20": ({"logprobs": 21}, "INVALID_ARGUMENT", "logprobs must be in [0, 20]"),
    "feature layers differ": ({"layers": (0,)}, "FAILED_PRECONDITION", "features of target layers"),
    "feature layers reordered": ({"layers": "reversed"}, "FAILED_PRECONDITION", "features of target layers"),
}


@pytest.mark.parametrize("case", list(BAD_OPENS))
def test_bad_open_fails_only_its_session(stub, twin, layers, case):
    fields, status, needle = BAD_OPENS[case]
    bad_layers = tuple(reversed(layers)) if fields.get("layers") == "reversed" else fields.get("layers", layers)
    bad = opening(2, bad_layers, fields.get("prompt", PROMPT), fields.get("sampling", GREEDY),
                  logprobs=fields.get("logprobs"))
    local = twin()
    with LinkStream(stub) as link:
        reply = link.send([opening(1, layers, PROMPTS[0]), bad, opening(3, layers, PROMPTS[3], SEEDED)])
        got = decode(reply)
        assert_error(got[1], 2, status, needle)
        assert_error_code(reply, 1, getattr(grpc.StatusCode, status))
        want = local([opening(1, layers, PROMPTS[0]), opening(3, layers, PROMPTS[3], SEEDED)])
        assert_same([outcome(got[0]), outcome(got[2])], [outcome(r) for r in want], exact=False)
        assert free_sessions(stub) == MAX_SESSIONS - 2
        trees = [TreeEntry(1, 1, small_tree(got[0].outcome.token)), TreeEntry(3, 1, chain(got[2].outcome.token, 3))]
        again = link.step(trees[:1] + [TreeEntry(2, 1, root_only(5))] + trees[1:])
        assert_same([outcome(again[0]), outcome(again[2])], [outcome(r) for r in local(trees)], exact=False)
        assert_error(again[1], 2, "NOT_FOUND", "no open session 2")
        link.send([CloseEntry(1), CloseEntry(3)])
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


def test_open_without_feature_layers_gets_no_features(stub, layers):
    """A session opened with no feature layers (plain decoding) gets the same tokens and no
    feature rows, in a message with a session that gets them."""
    with LinkStream(stub) as link:
        got = link.step([opening(1, layers), opening(2, (), PROMPT)])
        assert [r.outcome.features.shape[0] for r in got] == [len(PROMPT), 0]
        assert got[0].outcome.token == got[1].outcome.token
        trees = [TreeEntry(1, 1, small_tree(got[0].outcome.token)), TreeEntry(2, 1, small_tree(got[1].outcome.token))]
        again = link.step(trees)
        assert again[0].outcome.accepted_tokens == again[1].outcome.accepted_tokens
        assert again[0].outcome.features.shape[0] == 1 + len(again[0].outcome.accepted_tokens)
        assert again[1].outcome.features.shape[0] == 0
        link.send([CloseEntry(1), CloseEntry(2)])
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


def test_notice_of_first_tokens_goes_ahead_of_the_reply(stub, layers):
    """A message that completes prompts with features gets a notice of their first tokens first
    (no features), then the reply with the same tokens and the features; a chunk with more to
    come, and a prompt without feature layers (plain decoding), get none."""
    with LinkStream(stub) as link:
        got = link.step([opening(1, layers), opening(2, (), PROMPT), opening(3, layers, PROMPT[:3], more=True)])
        assert isinstance(got[2].outcome, Extended)
        notice = link.notices[1]
        assert notice.notice and [r.session_id for r in notice.results] == [1]
        assert notice.results[0].prefilled.token == got[0].outcome.token and not notice.features.shape[0]
        link.step([ExtendEntry(3, PROMPT[3:])])
        assert [r.session_id for r in link.notices[2].results] == [3]
        plain = link.step([CloseEntry(1), CloseEntry(3), opening(4, (), PROMPT)])
        assert 3 not in link.notices and isinstance(plain[0].outcome, Prefilled)
        link.send([CloseEntry(2), CloseEntry(4)])
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


def test_unknown_session_and_reopen(stub, layers):
    """A tree for a session never opened is NOT_FOUND; a close of one is a no-op without a
    result; opening an open session again fails it (ALREADY_EXISTS) and closes it."""
    with LinkStream(stub) as link:
        got = link.step([TreeEntry(7, 1, root_only(5)), CloseEntry(8), opening(1, layers)])
        assert [r.session_id for r in got] == [7, 1]
        assert_error(got[0], 7, "NOT_FOUND", "no open session 7")
        assert isinstance(got[1].outcome, Prefilled)
        root = got[1].outcome.token
        got = link.step([opening(2, layers), opening(1, layers)])
        assert isinstance(got[0].outcome, Prefilled)
        assert_error(got[1], 1, "ALREADY_EXISTS", "already open")
        assert free_sessions(stub) == MAX_SESSIONS - 1
        got = link.step([TreeEntry(1, 1, root_only(root)), TreeEntry(2, 1, root_only(got[0].outcome.token))])
        assert_error(got[0], 1, "NOT_FOUND", "no open session 1")
        assert isinstance(got[1].outcome, Verified)
        assert link.step([CloseEntry(2)]) == []
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


def test_tree_that_fills_max_seq_len_exactly(stub, layers):
    """A prompt of max_seq_len - 1 tokens opens, and trees that end exactly at max_seq_len verify
    (one node more: the "past max_seq_len" case of test_bad_tree_fails_only_its_session)."""
    with LinkStream(stub) as link:
        (a, b) = link.step([opening(1, layers, [1] * (MAX_SEQ_LEN - 1)), opening(2, layers, [1] * (MAX_SEQ_LEN - 3))])
        got = link.step([TreeEntry(1, 1, root_only(a.outcome.token)), TreeEntry(2, 1, chain(b.outcome.token, 2))])
        assert all(isinstance(r.outcome, Verified) for r in got), got
        link.send([CloseEntry(1), CloseEntry(2)])
        link.end()


def _entry(sid: int, **kind) -> pb.SessionEntry:
    return pb.SessionEntry(session_id=sid, **kind)


def _open_pb(layers, prompt=PROMPT) -> pb.Open:
    return pb.Open(prompt_token_ids=prompt, sampling=pb.SamplingParams(), feature_layer_ids=layers)


def test_decode_time_errors_are_in_band(stub, twin, layers):
    """Entries refused while decoding (two for one session, a tree of no or too many nodes, an
    entry of no kind) get their Error result in place; the other results of the message are
    right and the link goes on."""
    local = twin()
    with LinkStream(stub) as link:
        opened = link.step([opening(1, layers, PROMPTS[0]), opening(2, layers, PROMPTS[1])])
        roots = {r.session_id: r.outcome.token for r in opened}
        local([opening(1, layers, PROMPTS[0]), opening(2, layers, PROMPTS[1])])
        message = raw_message([
            _entry(5, open=_open_pb(layers)),
            as_raw(1, 1, small_tree(roots[1])),
            _entry(5, close=pb.Close()),                          # second entry for session 5
            (6, 1, [], [], []),                                   # no nodes
            (7, 1, *([[3] * (MAX_TREE_NODES + 1)] * 3)),         # too many nodes
            _entry(8),                                            # no kind
            as_raw(2, 1, chain(roots[2], 4)),
        ])
        reply = link.send(message)
        got = decode(reply)
        assert [r.session_id for r in got] == [5, 1, 5, 6, 7, 8, 2]
        assert_error(got[2], 5, "INVALID_ARGUMENT", "two entries for this session")
        assert_error(got[3], 6, "INVALID_ARGUMENT", "0 nodes")
        assert_error(got[4], 7, "INVALID_ARGUMENT", f"{MAX_TREE_NODES + 1} nodes")
        assert_error(got[5], 8, "INVALID_ARGUMENT", "open, extend or close")
        for i in (2, 3, 4, 5):
            assert_error_code(reply, i, grpc.StatusCode.INVALID_ARGUMENT)
        want = local([TreeEntry(1, 1, small_tree(roots[1])), TreeEntry(2, 1, chain(roots[2], 4))])
        assert_same([outcome(got[1]), outcome(got[6])], [outcome(r) for r in want], exact=False)
        again = link.step([TreeEntry(1, 2, root_only(got[1].outcome.next_token))])
        assert isinstance(again[0].outcome, Verified)
        link.send([CloseEntry(1), CloseEntry(2), CloseEntry(5)])
        link.end()


DECODE_CASES = {  # session 1 is open at root r1, session 2 at r2: the message's entries, and the needle
    "two trees": (lambda r1, r2: [as_raw(1, 1, root_only(r1)), as_raw(2, 1, root_only(r2)), as_raw(1, 1, root_only(r1))],
                  "two entries"),
    "tree and close": (lambda r1, r2: [as_raw(1, 1, root_only(r1)), _entry(1, close=pb.Close()),
                                       as_raw(2, 1, root_only(r2))], "two entries"),
    "empty tree": (lambda r1, r2: [(1, 1, [], [], []), as_raw(2, 1, root_only(r2))], "0 nodes"),
    "too many nodes": (lambda r1, r2: [(1, 1, *([[r1] * (MAX_TREE_NODES + 1)] * 3)), as_raw(2, 1, root_only(r2))],
                       "nodes, expected"),
    "no kind": (lambda r1, r2: [_entry(1), as_raw(2, 1, root_only(r2))], "open, extend or close"),
    "buffers short": (lambda r1, r2: [(1, 1, [], [], [], 3)], "add up to 3"),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_time_error_closes_the_session(stub, layers, case):
    """An Error result means the session failed and is closed: its slot is free, a later tree is NOT_FOUND."""
    build, needle = DECODE_CASES[case]
    with LinkStream(stub) as link:
        (r1, r2) = link.step([opening(1, layers), opening(2, layers)])
        got = link.step(raw_message(build(r1.outcome.token, r2.outcome.token)))
        assert_error([r for r in got if r.session_id == 1][-1], 1, "INVALID_ARGUMENT", needle)
        assert all(isinstance(r.outcome, Verified) for r in got if r.session_id == 2)
        assert free_sessions(stub) == MAX_SESSIONS - 1
        assert_error(link.step([TreeEntry(1, 1, root_only(r1.outcome.token))])[0], 1, "NOT_FOUND", "no open session")
        link.send([CloseEntry(2)])
        assert free_sessions(stub) == MAX_SESSIONS
        link.end()


# -- framing and link limits -----------------------------------------------------------------------


def _short_tokens(msg):
    msg.tree_tokens.CopyFrom(pack_ints([1, 2, 3, 4]))


def _short_links(msg):
    msg.tree_next_token.CopyFrom(pack_ints([-1] * 4))


def _long_buffers(msg):
    for name in ("tokens", "next_token", "next_sibling"):
        getattr(msg, f"tree_{name}").CopyFrom(pack_ints([-1] * 6))


def _width_3(msg):
    msg.tree_tokens.width = 3


def _ragged(msg):
    msg.tree_tokens.CopyFrom(pb.PackedInts(data=b"\x01\x00\x02", width=2))


def _unset(msg):
    msg.ClearField("tree_next_sibling")


FRAMING = {  # the message's trees have 2 + 3 = 5 nodes
    "tokens short": (_short_tokens, "hold [4, 5, 5] values"),
    "next_token short": (_short_links, "hold [5, 4, 5] values"),
    "all too long": (_long_buffers, "add up to 5"),
    "width 3": (_width_3, "width 3"),
    "bytes not a multiple of width": (_ragged, "not a multiple of width 2"),
    "buffer missing": (_unset, "hold [5, 5, 0] values"),
}


@pytest.mark.parametrize("case", list(FRAMING))
def test_tree_buffers_that_do_not_frame_fail_the_trees_not_the_link(stub, layers, case):
    spoil, needle = FRAMING[case]
    with LinkStream(stub) as link:
        (r1, r2) = link.step([opening(1, layers), opening(2, layers, PROMPTS[1])])
        message = raw_message([as_raw(1, 1, chain(r1.outcome.token, 1)), _entry(3, open=_open_pb(layers)),
                               as_raw(2, 1, chain(r2.outcome.token, 2))])
        spoil(message)
        reply = link.send(message)
        got = decode(reply)
        assert [r.session_id for r in got] == [1, 3, 2]
        for i, sid in ((0, 1), (2, 2)):
            assert_error(got[i], sid, "INVALID_ARGUMENT", "malformed tree")
            assert needle in got[i].outcome.message
            assert_error_code(reply, i, grpc.StatusCode.INVALID_ARGUMENT)
        assert isinstance(got[1].outcome, Prefilled)  # the message's open is unaffected
        again = link.step([TreeEntry(3, 1, small_tree(got[1].outcome.token))])  # the link goes on
        assert isinstance(again[0].outcome, Verified)
        link.send([CloseEntry(1), CloseEntry(2), CloseEntry(3)])
        link.end()


def test_message_of_max_link_entries_is_served(stub, config, layers):
    limit = config.max_link_entries()
    with LinkStream(stub) as link:
        ids = [MAX_SESSION_ID - i for i in range(MAX_SESSIONS)]
        entries = [opening(sid, layers) for sid in ids] + [CloseEntry(1000 + i) for i in range(limit - MAX_SESSIONS)]
        got = link.step(entries)
        assert [r.session_id for r in got] == ids and all(isinstance(r.outcome, Prefilled) for r in got)
        link.send([CloseEntry(sid) for sid in ids])
        link.end()


LINK_BREAKERS = {
    "too many entries": (lambda limit: [_entry(1000 + i, close=pb.Close()) for i in range(limit + 1)],
                         "the limit is"),
    "session id 0": (lambda limit: [_entry(0, close=pb.Close())], "session id 0 is outside"),
    "session id 2^63": (lambda limit: [_entry(2**63, close=pb.Close())], f"session id {2**63} is outside"),
}


@pytest.mark.parametrize("case", list(LINK_BREAKERS))
def test_message_past_the_link_limits_ends_the_link(stub, config, layers, case):
    """INVALID_ARGUMENT for the whole link; its sessions are closed."""
    build, needle = LINK_BREAKERS[case]
    with LinkStream(stub) as link:
        link.step([opening(1, layers), opening(2, layers)])
        assert free_sessions(stub) == MAX_SESSIONS - 2
        link.post(raw_message(build(config.max_link_entries()) + [_entry(3, open=_open_pb(layers))]))
        link.expect_abort(grpc.StatusCode.INVALID_ARGUMENT, needle)
    wait_free(stub)
    with LinkStream(stub) as other:  # the verifier goes on
        assert isinstance(other.step([opening(1, layers)])[0].outcome, Prefilled)
        other.end()


# -- capacity and slots -----------------------------------------------------------------------


def test_resource_exhausted_when_all_slots_are_taken(stub, layers):
    with LinkStream(stub) as a, LinkStream(stub) as b:
        got = a.step([opening(sid, layers) for sid in range(1, MAX_SESSIONS + 2)])
        assert all(isinstance(r.outcome, Prefilled) for r in got[:MAX_SESSIONS])
        assert_error(got[MAX_SESSIONS], MAX_SESSIONS + 1, "RESOURCE_EXHAUSTED", "slots")
        assert free_sessions(stub) == 0
        assert_error(b.step([opening(1, layers)])[0], 1, "RESOURCE_EXHAUSTED", "slots")
        a.send([CloseEntry(2)])
        assert free_sessions(stub) == 1
        assert isinstance(b.step([opening(1, layers)])[0].outcome, Prefilled)  # the slot is back
        a.end()  # the stream end closes a's sessions
        wait_free(stub, 3)
        b.end()


def _end_by_half_close(link):
    link.end()


def _end_by_cancel(link):
    link.call.cancel()


def _end_by_deadline(link):
    with pytest.raises(grpc.RpcError) as info:
        next(link.call)  # nothing more comes: the deadline ends the call
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("end", [_end_by_half_close, _end_by_cancel, _end_by_deadline],
                         ids=["stream end", "cancel", "deadline"])
def test_link_end_frees_its_slots(stub, layers, end):
    with LinkStream(stub, timeout=2.0 if end is _end_by_deadline else None) as link:
        (r1, _) = link.step([opening(1, layers), opening(2, layers, PROMPTS[1])])
        link.step([TreeEntry(1, 1, small_tree(r1.outcome.token))])
        assert free_sessions(stub) == MAX_SESSIONS - 2
        end(link)
        wait_free(stub)


@pytest.fixture(scope="module")
def idle_stub(config, tracing):
    """A second verifier, of two slots, that closes the sessions of a link silent for IDLE_S."""
    idle = dataclasses.replace(config, max_sessions=2, idle_timeout_s=IDLE_S)
    with ServerThread(lambda: serve(idle)) as running, _connect(running.port) as ch:
        yield pb_grpc.VerifierStub(ch)


def _open_two_and_go_on(link, layers, rounds: int) -> dict[int, int]:
    """Open sessions 1 and 2, then verify `rounds` root-only trees of both, IDLE_S / 4 apart."""
    (r1, r2) = link.step([opening(1, layers), opening(2, layers)])
    roots = {1: r1.outcome.token, 2: r2.outcome.token}
    for rnd in range(1, rounds + 1):
        time.sleep(IDLE_S / 4)
        for r in link.step([TreeEntry(sid, rnd, root_only(roots[sid])) for sid in (1, 2)]):
            assert isinstance(r.outcome, Verified), r.outcome
            roots[r.session_id] = r.outcome.next_token
    return roots


def test_idle_timeout_closes_the_sessions_of_a_silent_link(idle_stub, layers):
    wait_free(idle_stub, 2)
    with LinkStream(idle_stub) as quiet, LinkStream(idle_stub) as link:
        _open_two_and_go_on(link, layers, rounds=6)  # 1.5 IDLE_S of messages keep the sessions open
        assert free_sessions(idle_stub) == 0
        wait_free(idle_stub, 2, timeout=8 * IDLE_S)  # then silence closes them
        # A link without sessions is never timed out: `quiet` has been silent all along.
        assert isinstance(quiet.step([opening(1, layers)])[0].outcome, Prefilled)
        quiet.send([CloseEntry(1)])
        quiet.end()
    wait_free(idle_stub, 2)


def test_idle_timeout_after_an_open_and_silence(idle_stub, layers):
    wait_free(idle_stub, 2)
    with LinkStream(idle_stub) as link:
        link.step([opening(1, layers), opening(2, layers)])
        wait_free(idle_stub, 2, timeout=5 * IDLE_S)
    wait_free(idle_stub, 2)


def test_link_stays_usable_after_an_idle_timeout(idle_stub, layers):
    """The idle sessions are gone (NOT_FOUND), the link still serves new opens."""
    wait_free(idle_stub, 2)
    with LinkStream(idle_stub) as link:
        roots = _open_two_and_go_on(link, layers, rounds=1)
        wait_free(idle_stub, 2, timeout=8 * IDLE_S)
        got = link.step([TreeEntry(1, 2, root_only(roots[1])), opening(3, layers)])
        assert_error(got[0], 1, "NOT_FOUND", "no open session 1")
        assert isinstance(got[1].outcome, Prefilled)
        assert free_sessions(idle_stub) == 1
        link.end()
    wait_free(idle_stub, 2)


def test_pipelined_messages_are_answered_in_order(stub, twin, layers, config):
    """A drafter may send several messages before reading; each reply echoes its step, in order,
    also past max_inflight (flow control holds the drafter back, nothing is lost)."""
    local = twin()
    with LinkStream(stub) as link:
        steps = [10, 3, 7]
        for step, entries in zip(steps, ([opening(1, layers)], [opening(2, layers, PROMPTS[1], SEEDED)],
                                         [CloseEntry(99)])):
            link.post(encode_link_request(step, entries))
        replies = [link.recv() for _ in steps]
        assert [r.step for r in replies] == steps
        assert [len(r.results) for r in replies] == [1, 1, 0]
        opened = [decode(r)[0] for r in replies[:2]]
        want = local([opening(1, layers)]) + local([opening(2, layers, PROMPTS[1], SEEDED)])
        assert_same([outcome(r) for r in opened], [outcome(r) for r in want], exact=True)

        trees = [TreeEntry(1, 1, small_tree(opened[0].outcome.token)),
                 TreeEntry(2, 1, chain(opened[1].outcome.token, 5))]
        for i, tree in enumerate(trees):
            link.post(encode_link_request(20 + i, [tree]))
        replies = [link.recv() for _ in trees]
        assert [r.step for r in replies] == [20, 21]
        # Each message was held from its decoding to its reply's encoding: around its whole step.
        assert all(0 < r.step_seconds <= r.held_seconds for r in replies)
        want = local(trees[:1]) + local(trees[1:])  # one message of a link per worker step
        assert_same([outcome(decode(r)[0]) for r in replies], [outcome(r) for r in want], exact=True)
        link.send([CloseEntry(1), CloseEntry(2)])

        count = 2 * config.max_inflight + 3
        opens = {0: 3, count // 2: 4, count - 1: 5}  # message index -> session opened; closes of unknown ids else
        for i in range(count):
            link.post(encode_link_request(100 + i, [opening(opens[i], layers)] if i in opens else [CloseEntry(1000 + i)]))
        replies = [link.recv() for _ in range(count)]
        assert [r.step for r in replies] == [100 + i for i in range(count)]
        assert [len(r.results) for r in replies] == [int(i in opens) for i in range(count)]
        got = [decode(replies[i])[0] for i in opens]
        assert [r.session_id for r in got] == list(opens.values())
        assert len({r.outcome.token for r in got}) == 1  # the same prompt, greedy
        assert free_sessions(stub) == MAX_SESSIONS - 3
        link.send([CloseEntry(sid) for sid in opens.values()])
        link.end()


PIPELINED = {  # session 1 is open at root r: two messages for one session, sent before reading either
    "open then close": (lambda r, layers: ([opening(5, layers)], [CloseEntry(5)]), Prefilled),
    "tree then close": (lambda r, layers: ([TreeEntry(1, 1, small_tree(r))], [CloseEntry(1)]), Verified),
}


@pytest.mark.parametrize("case", list(PIPELINED))
def test_pipelined_messages_for_one_session_keep_their_order(stub, layers, worker_gate, case):
    """Each message may carry one entry per session; two pipelined messages for one session
    mean what they mean one after the other, even when the worker serves them in one step."""
    build, kind = PIPELINED[case]
    with LinkStream(stub) as other, LinkStream(stub) as link:
        (opened,) = link.step([opening(1, layers)])
        first, second = build(opened.outcome.token, layers)
        worker_gate.hold(other)
        link.post(first)
        link.post(second)
        worker_gate.release(queued=2)
        assert list(other.recv().results) == []
        one, two = decode(link.recv()), decode(link.recv())
        assert len(one) == 1 and isinstance(one[0].outcome, kind), one
        assert two == []  # a Close has no result
        if case == "tree then close":
            assert free_sessions(stub) == MAX_SESSIONS
        else:
            assert free_sessions(stub) == MAX_SESSIONS - 1
        link.send([CloseEntry(1)])
        link.end()
        other.end()


# -- tracing ------------------------------------------------------------------------------------


def test_spans_are_parented_to_the_drafter(stub, layers, tracing):
    """Each traced open gets a `prefill` span and each traced tree a `verify` span under the
    drafter's span, linked to the `verify_step` span of the worker step that served it; the
    step's spans hold its one batched prefill (forward + sample) or forward and commit."""
    drafter = tracer("tests")
    parents, traceparents = [], []
    for i in range(2):
        with drafter.start_as_current_span(f"drafter-session-{i}") as span:
            parents.append(span.get_span_context())
            traceparents.append(current_traceparent())
    prompts = [PROMPT, PROMPTS[1]]
    with LinkStream(stub) as link:
        opened = link.step([opening(1, layers, prompts[0], traceparent=traceparents[0]),
                            opening(2, layers, prompts[1], traceparent=traceparents[1]),
                            opening(3, layers)])
        trees = [small_tree(opened[0].outcome.token), chain(opened[1].outcome.token, 5)]
        got = link.step([TreeEntry(1, 1, trees[0], traceparents[0]), TreeEntry(2, 1, trees[1], traceparents[1])])
        failed = link.step([TreeEntry(1, 5, root_only(got[0].outcome.next_token), traceparents[0])])
        assert_error(failed[0], 1, "INVALID_ARGUMENT", "out of order")
        link.send([CloseEntry(2), CloseEntry(3)])
        link.end()
    spans = tracing.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    def children(span_id, name=None):
        return [s for s in spans if s.parent is not None and s.parent.span_id == span_id
                and (name is None or s.name == name)]

    def step_of(span):
        (link_to_step,) = span.links
        step = by_id[link_to_step.context.span_id]
        assert step.name == "verify_step" and step.parent is None
        assert span.start_time <= step.start_time < span.end_time  # it covers the step's work
        return step

    open_steps, tree_steps = [], []
    for i, parent in enumerate(parents):
        mine = children(parent.span_id)
        assert all(s.context.trace_id == parent.trace_id for s in mine)
        assert sorted(s.name for s in mine) == ["prefill"] + ["verify"] * (2 if i == 0 else 1)
        (prefill,) = children(parent.span_id, "prefill")
        assert prefill.attributes["prompt.tokens"] == len(prompts[i]) and prefill.status.is_ok
        open_steps.append(step_of(prefill))
        (verify,) = [s for s in children(parent.span_id, "verify") if s.attributes["round"] == 1]
        attrs = verify.attributes
        assert (attrs["round"], attrs["tree.nodes"], attrs["accepted"]) == (
            1, trees[i].num_nodes, len(got[i].outcome.accepted_tokens))
        assert verify.status.is_ok
        tree_steps.append(step_of(verify))
    # The three opens went through one step and one batched prefill ...
    assert open_steps[0] is open_steps[1]
    step = open_steps[0]
    assert (step.attributes["links"], step.attributes["entries"]) == (1, 3)
    (batched,) = children(step.context.span_id, "prefill")
    assert sorted(s.name for s in children(batched.context.span_id)) == ["forward", "sample"]
    assert not children(step.context.span_id, "forward")
    # ... both trees through one step: one forward, one commit.
    assert tree_steps[0] is tree_steps[1]
    step = tree_steps[0]
    assert (step.attributes["links"], step.attributes["entries"]) == (1, 2)
    names = [s.name for s in children(step.context.span_id)]
    assert names.count("forward") == 1 and names.count("commit") == 1 and "prefill" not in names, names
    # The bad tree's span says so.
    (bad,) = [s for s in children(parents[0].span_id, "verify") if s.attributes["round"] == 5]
    assert bad.status.status_code == trace.StatusCode.ERROR and "out of order" in bad.status.description
    assert "accepted" not in bad.attributes


# -- shutdown ----------------------------------------------------------------------------------


def test_shutdown_drains_and_refuses(config, tracing, caplog):
    """On stop the verifier drains: NOT_SERVING, Info says `draining` (the port stays open), an
    open session runs on while a new one is refused with UNAVAILABLE (its drafter opens it on
    another replica), and after the grace the link left is cut."""
    with ServerThread(lambda: serve(config)) as running, _connect(running.port) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                                      timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.VerifierStub(ch)
        assert not stub.Info(pb.InfoRequest(), timeout=5).draining
        with LinkStream(stub) as link, caplog.at_level(logging.WARNING, logger="verifier_svc.server"):
            (opened,) = link.step([opening(1, config.feature_layer_ids)])
            began = time.monotonic()
            stopping = asyncio.run_coroutine_threadsafe(running.server.stop(2.0), running.loop)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert stub.Info(pb.InfoRequest(), timeout=5).draining
            # Draining: the open session is still served, a new one is refused ...
            got = link.step([TreeEntry(1, 1, small_tree(opened.outcome.token)), opening(2, config.feature_layer_ids)])
            assert isinstance(got[0].outcome, Verified)
            assert (got[1].outcome.status, got[1].outcome.message) == ("UNAVAILABLE", "the verifier is shutting down")
            # ... and after the grace period the link, with its session left open, is cut.
            with pytest.raises(grpc.RpcError) as info:
                next(link.call)
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                                 "the verifier is shutting down")
            assert time.monotonic() - began >= 1.9
        said = [r.getMessage() for r in caplog.records]
        assert "the grace ended with 1 sessions open: their links are cut" in said, said
        stopping.result(10)

        async def submit_after_stop():
            with pytest.raises(VerifierError) as info:
                await running.server.worker.submit(LinkStep("late", 1, [CloseEntry(1)]))
            return info.value.status

        assert running.call(submit_after_stop()) == "UNAVAILABLE"


def test_shutdown_ends_once_the_last_session_closes(config, caplog):
    """A drain lasts as long as the open sessions do, not the whole grace; a second signal's
    `cut` ends one at once."""
    for ending in ("close", "cut"):
        caplog.clear()
        with ServerThread(lambda: serve(config)) as running, _connect(running.port) as ch, \
                caplog.at_level(logging.INFO, logger="verifier_svc.server"):
            with LinkStream(pb_grpc.VerifierStub(ch)) as link:
                (opened,) = link.step([opening(1, config.feature_layer_ids)])
                began = time.monotonic()
                stopping = asyncio.run_coroutine_threadsafe(running.server.stop(30.0), running.loop)
                (got,) = link.step([TreeEntry(1, 1, small_tree(opened.outcome.token))])
                assert isinstance(got.outcome, Verified)
                assert not stopping.done()
                if ending == "close":
                    link.step([CloseEntry(1)])
                else:
                    running.loop.call_soon_threadsafe(running.server.cut)
                stopping.result(10)
                assert time.monotonic() - began < 10
                with pytest.raises(grpc.RpcError):
                    next(link.call)
        said = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("drained in ") for m in said) == (ending == "close"), said
        assert ("a second signal came with 1 sessions open: their links are cut" in said) == (ending == "cut"), said


@contextlib.contextmanager
def hung_steps(verifier):
    """While inside, every step the model worker begins blocks (a hung device) until the block
    ends (for at most 30 s); then steps run again."""
    hang, begin = threading.Event(), verifier.begin

    def hung_begin(*args, **kwargs):
        hang.wait(30)
        return begin(*args, **kwargs)

    verifier.begin = hung_begin
    try:
        yield
    finally:
        hang.set()
        verifier.begin = begin


def test_a_hung_model_worker_does_not_hold_the_shutdown(config, caplog, monkeypatch):
    """A model worker stuck in a step (a hung device) is left behind after STOP_WORKER_S: the
    stop returns, with one logged error."""
    monkeypatch.setattr(VerifierServer, "STOP_WORKER_S", 0.5)
    with ServerThread(lambda: serve(config)) as running, _connect(running.port) as ch, \
            caplog.at_level(logging.ERROR, logger="verifier_svc.server"):
        with hung_steps(running.server.worker.verifier), LinkStream(pb_grpc.VerifierStub(ch)) as link:
            link.post([opening(1, config.feature_layer_ids)])
            time.sleep(0.2)
            began = time.monotonic()
            asyncio.run_coroutine_threadsafe(running.server.stop(0), running.loop).result(10)
            assert time.monotonic() - began < 5
        running.server.worker._thread.join(10)  # released: it answers its step while the loop still runs
    said = [r.getMessage() for r in caplog.records]
    assert "the model worker did not stop within 0.5 s (a hung device?): leaving it behind" in said, said


def test_a_stalled_model_worker_turns_the_verifier_not_serving(config, caplog):
    """A model worker that has work and makes no progress (a hung device) for --stall-timeout turns
    health NOT_SERVING and Info UNAVAILABLE, so that drafters move its sessions; both come back
    once it does progress, and the held message is answered."""
    cfg = dataclasses.replace(config, stall_timeout_s=0.5)
    with ServerThread(lambda: serve(cfg)) as running, _connect(running.port) as ch, \
            caplog.at_level(logging.WARNING, logger="verifier_svc.server"):
        health = health_pb2_grpc.HealthStub(ch)
        stub = pb_grpc.VerifierStub(ch)

        def serving() -> bool:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING

        assert serving() and running.server.worker.stalled_s == 0.0
        with LinkStream(stub) as link:
            with hung_steps(running.server.worker.verifier):
                link.post([opening(1, cfg.feature_layer_ids)])
                time.sleep(0.2)
                assert serving()  # not yet: 0.5 s
                deadline = time.monotonic() + 10
                while serving():
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Info(pb.InfoRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert info.value.details().startswith("the model worker has made no progress for ")
                (stalled,) = [s.value for f in text_string_to_metric_families(metrics.render("verifier").decode())
                              for s in f.samples if s.name == "ddtree_verifier_worker_stalled_seconds"]
                assert stalled > 0.5
            (opened,) = decode(link.recv())
            assert isinstance(opened.outcome, Prefilled)
            while not serving():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert stub.Info(pb.InfoRequest(), timeout=5).max_sessions == cfg.max_sessions
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("the model worker has made no progress for ") for m in said), said
    assert "the model worker makes progress again: serving" in said, said


# -- the feature ring (common/feature_ring.py) -------------------------------------------------


def _ring_rows(reader: RingReader, reply: pb.LinkResponse) -> torch.Tensor:
    """A reply's rows read out of the ring it says they lie in."""
    nbytes = tensor_bytes(reply.features)
    rows = decode_tensor(reply.features, max_elements=nbytes, data=reader.rows(reply.features_at, nbytes)).clone()
    reader.done(reply.features_at + nbytes)
    return rows


def test_a_feature_ring_carries_the_rows_a_reply_would(stub, layers):
    """A link that asks gets a ring in its first reply (rows still inline); once it releases (it
    mapped the ring) the rows go there, the file is unlinked, and they equal the rows a link
    without a ring gets inline, step for step."""
    trees = [small_tree, lambda r: chain(r, 6), root_only]
    with LinkStream(stub) as ring_link, LinkStream(stub) as plain:
        asking = encode_link_request(1, [opening(1, layers, PROMPTS[0])])
        asking.feature_ring = True
        first = ring_link.send(asking)
        want = plain.send([opening(1, layers, PROMPTS[0])])
        assert first.HasField("ring") and not first.HasField("features_at")
        assert first.features.data == want.features.data
        offer = RingOffer(first.ring.path, first.ring.capacity, first.ring.nonce)
        assert offer.capacity == 64 << 20 and os.stat(offer.path).st_mode & 0o777 == 0o600
        reader = RingReader(offer)
        roots, plain_roots = first.results[0].prefilled.token, want.results[0].prefilled.token
        for rnd in range(1, 13):
            message = encode_link_request(rnd + 1, [TreeEntry(1, rnd, trees[rnd % 3](roots))])
            message.ring_released = reader.read_to
            got = ring_link.send(message)
            assert not os.path.exists(offer.path)  # unlinked once the drafter answered
            inline = plain.send([TreeEntry(1, rnd, trees[rnd % 3](plain_roots))])
            assert got.HasField("features_at") and not got.features.data
            assert torch.equal(_ring_rows(reader, got), decode_tensor(inline.features, max_elements=1 << 20))
            assert got.verified.accepted_tokens.data == inline.verified.accepted_tokens.data
            assert got.verified.fields == inline.verified.fields
            roots = plain_roots = int(unpack_ints(got.verified.fields, max_count=VERIFIED_COLUMNS,
                                                  what="verified")[3])  # the bonus token
        ring_link.send([CloseEntry(1)])
        plain.send([CloseEntry(1)])
        ring_link.end()
        plain.end()


def test_a_refused_ring_leaves_the_rows_inline_and_no_file(stub, layers):
    with LinkStream(stub) as link:
        asking = encode_link_request(1, [opening(1, layers)])
        asking.feature_ring = True
        first = link.send(asking)
        refusing = encode_link_request(2, [TreeEntry(1, 1, small_tree(first.results[0].prefilled.token))])
        refusing.ring_refused = True
        got = link.send(refusing)
        assert not os.path.exists(first.ring.path) and not got.HasField("features_at") and got.features.data
        link.send([CloseEntry(1)])
        link.end()


@pytest.mark.parametrize("case", ["released without a ring", "released past the rows", "refused twice"])
def test_bad_ring_fields_end_the_link(stub, layers, case):
    """Ring fields that do not fit the link's ring end the link with INVALID_ARGUMENT (one line)."""
    with LinkStream(stub) as link:
        message = encode_link_request(1, [opening(1, layers)])
        if case == "released without a ring":
            message.ring_released = 0
            link.post(message)
        else:
            message.feature_ring = True
            link.send(message)
            second = encode_link_request(2, [CloseEntry(1)])
            if case == "released past the rows":
                second.ring_released = 1 << 40
            else:
                second.ring_refused = True
                link.send(second)
                second = encode_link_request(3, [])
                second.ring_refused = True
            link.post(second)
        link.expect_abort(grpc.StatusCode.INVALID_ARGUMENT, "ring")


def test_no_ring_past_the_cap_or_without_room(stub, layers, monkeypatch, tmp_path):
    """A link past MAX_FEATURE_RINGS, or one whose ring cannot be allocated (a full tmpfs), gets
    no offer and no file is left: its rows travel inline."""
    import verifier_svc.server as server_module

    def ask(link: LinkStream) -> pb.LinkResponse:
        message = encode_link_request(1, [opening(1, layers)])
        message.feature_ring = True
        return link.send(message)

    monkeypatch.setattr(server_module, "MAX_FEATURE_RINGS", 1)
    with LinkStream(stub) as first, LinkStream(stub) as second:
        assert ask(first).HasField("ring")
        reply = ask(second)
        assert not reply.HasField("ring") and reply.features.data
        for link in (first, second):
            link.send([CloseEntry(1)])
            link.end()
    monkeypatch.setattr(server_module, "MAX_FEATURE_RINGS", 16)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with LinkStream(stub) as link:
        assert not ask(link).HasField("ring")
        link.send([CloseEntry(1)])
        link.end()
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) <= before


# -- the Unix socket (common/socket_link.py) ----------------------------------------------------


def _socket_link(server, unix_socket: bool) -> GrpcLink:
    """A drafter's link to the shared server, through its Unix socket or through gRPC."""
    return GrpcLink(verifier_stub(_connect(server.port)), vocab_size=VOCAB, feature_dim=FEATURE_DIM,
                    max_seq_len=MAX_SEQ_LEN, feature_ring=False, unix_socket=unix_socket)


def test_a_unix_socket_carries_the_link_as_the_stream_does(server, stub, layers, monkeypatch):
    """A link that asks takes the socket offered (its file and directory removed once connected),
    and its sessions, greedy and seeded, opened in one message and verified over rounds of
    different trees, get the results a link through gRPC gets, step for step. Replies the link's
    writer waits for go out from the model worker's thread (`SocketStream.send_now`)."""
    sent_now = []
    send_now = SocketStream.send_now
    monkeypatch.setattr(SocketStream, "send_now", lambda stream, data: sent_now.append(send_now(stream, data))
                        or sent_now[-1])
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    over_socket, over_grpc = _socket_link(server, True), _socket_link(server, False)
    samplings = SAMPLINGS["mixed"][:2]
    steps = []
    for link in (over_socket, over_grpc):
        opened = link.step([opening(i + 1, layers, PROMPTS[i], samplings[i]) for i in range(2)])
        roots = [r.outcome.token for r in opened]
        rounds = [opened]
        for rnd in range(1, 7):
            trees = [(small_tree, lambda r: chain(r, 5), root_only)[(rnd + i) % 3](roots[i]) for i in range(2)]
            results = link.step([TreeEntry(i + 1, rnd, trees[i]) for i in range(2)])
            roots = [r.outcome.next_token for r in results]
            rounds.append(results)
        link.step([CloseEntry(1), CloseEntry(2)])
        steps.append(rounds)
    assert over_socket._socket is not None and over_grpc._socket is None
    assert any(rest is not None and not rest for rest in sent_now)  # whole frames sent by the worker
    for got, want in zip(*steps):
        assert [r.session_id for r in got] == [r.session_id for r in want]
        assert_same([outcome(r) for r in got], [outcome(r) for r in want], exact=True)
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) <= before
    for link in (over_socket, over_grpc):
        link.close()


def test_a_hello_to_a_verifier_without_the_socket_goes_on_through_the_stream(server, layers, monkeypatch):
    """A verifier from before the socket link does not know `LinkRequest.unix_socket`: it reads the
    hello as an empty message at step 0 and answers it with an empty reply. The drafter takes that
    as no offer, and its link works through gRPC."""
    from verifier_svc import server as server_module

    def without_the_field(cls, data):
        message = decode_message(cls, data)
        if cls is pb.LinkRequest:
            message.ClearField("unix_socket")
        return message

    monkeypatch.setattr(server_module, "decode_message", without_the_field)
    link, direct = _socket_link(server, True), _socket_link(server, False)
    got = []
    for each in (link, direct):
        opened = each.step([opening(1, layers, PROMPTS[0])])
        results = each.step([TreeEntry(1, 1, chain(opened[0].outcome.token, 5))])
        each.step([CloseEntry(1)])
        got.append([outcome(r) for r in opened + results])
    assert link._socket is None
    assert_same(got[0], got[1], exact=True)
    for each in (link, direct):
        each.close()


def test_the_verifier_s_error_reaches_a_drafter_on_the_socket(server, stub, layers):
    """A message that breaks the link's rules ends it: the drafter, reading the socket, gets the
    verifier's status from the stream (not just a closed socket)."""
    link = _socket_link(server, True)
    link.send([opening(MAX_SESSION_ID + 1, layers)])
    with pytest.raises(StatusError) as info:
        link.receive()
    assert info.value.status == "INVALID_ARGUMENT" and "session id" in info.value.message
    link.close()


@pytest.mark.parametrize("case", ["second message", "with entries", "at step 2"])
def test_a_hello_comes_first_and_alone(stub, layers, case):
    with LinkStream(stub) as link:
        hello = pb.LinkRequest(unix_socket=True)
        if case == "second message":
            link.send([opening(1, layers)])
            link.send([CloseEntry(1)])
        elif case == "with entries":
            hello = encode_link_request(0, [opening(1, layers)])
            hello.unix_socket = True
        else:
            hello.step = 2
        link.post(hello)
        link.expect_abort(grpc.StatusCode.INVALID_ARGUMENT, "hello")


def _offer(link: LinkStream) -> pb.UnixSocket:
    reply = link.send(pb.LinkRequest(unix_socket=True))
    assert reply.HasField("unix_socket") and not reply.results
    assert stat.S_IMODE(os.stat(os.path.dirname(reply.unix_socket.path)).st_mode) == 0o700
    return reply.unix_socket


def test_an_offer_not_taken_is_withdrawn(stub, layers):
    """A drafter that goes on through the stream (it could not reach the socket) keeps the link
    there, and the socket's directory is gone."""
    with LinkStream(stub) as link:
        offer = _offer(link)
        link.steps = 0
        opened = link.step([opening(1, layers)])
        assert isinstance(opened[0].outcome, Prefilled)
        assert not os.path.exists(os.path.dirname(offer.path))
        link.send([CloseEntry(1)])
        link.end()


def test_a_connection_without_the_nonce_ends_the_link(stub):
    with LinkStream(stub) as link:
        offer = _offer(link)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(offer.path)
        send_frame(raw, bytes(16))
        link.expect_abort(grpc.StatusCode.PERMISSION_DENIED, "nonce")
        raw.close()


def test_a_message_through_the_stream_after_the_switch_ends_the_link(stub, layers):
    with LinkStream(stub) as link:
        offer = _offer(link)
        sock = socket_connect(SocketOffer(offer.path, offer.nonce), 2.0)
        send_frame(sock, encode_link_request(1, [opening(1, layers)]).SerializeToString())
        reply = pb.LinkResponse.FromString(bytes(recv_frame(sock)))  # the link has moved to the socket
        if reply.notice:  # first tokens ahead of the reply
            reply = pb.LinkResponse.FromString(bytes(recv_frame(sock)))
        assert reply.step == 1 and not reply.notice and reply.results[0].WhichOneof("kind") == "prefilled"
        link.post(encode_link_request(2, [CloseEntry(1)]))
        link.expect_abort(grpc.StatusCode.INVALID_ARGUMENT, "Unix socket")
        assert recv_frame(sock) is None  # the verifier closed its end
        sock.close()


def test_no_socket_offered_when_off(config, tracing, layers):
    with ServerThread(lambda: serve(dataclasses.replace(config, unix_socket=False))) as running:
        with _connect(running.port) as channel, LinkStream(pb_grpc.VerifierStub(channel)) as link:
            assert not link.send(pb.LinkRequest(unix_socket=True)).HasField("unix_socket")
            link.steps = 0
            assert isinstance(link.step([opening(1, layers)])[0].outcome, Prefilled)
            link.send([CloseEntry(1)])
            link.end()


def test_a_drafter_that_leaves_with_replies_owed_ends_its_link_quietly(server, stub, layers, caplog):
    """A drafter that closes its socket link before reading its replies: the verifier ends the
    link as the drafter's doing (its sessions freed: `no_leaks`), with no warning or error logged."""
    link = _socket_link(server, True)
    link.step([opening(1, layers)])
    for sid in (2, 3):
        link.send([opening(sid, layers, PROMPTS[sid])])
    with caplog.at_level(logging.INFO, logger="verifier_svc.server"):
        link.close()
        wait_free(stub)
        deadline = time.monotonic() + 5
        while not any("link" in r.getMessage() and "closed after" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
