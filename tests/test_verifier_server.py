"""The Verifier gRPC server on loopback: same results as in-process, strict validation,
no leaked KV slots, health, reflection and tracing.

The server runs in this process, on its own event loop in a background thread
(`ServerThread`); tests talk to it with the sync gRPC client, as the drafter does.
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.config import load_draft_config
from common.protocol import Prefilled, SamplingParams, Verified
from common.rpc import CHANNEL_OPTIONS, VERIFIER_SERVICE, pb, pb_grpc
from common.tracing import current_traceparent, setup_tracing, tracer
from common.tree import DraftTree
from common.wire import decode_tensor, encode_sampling, encode_tree, pack_ints
from drafter_svc.ddtree import build_ddtree
from tests.reference import OracleProposer
from tests.servers import ServerThread
from verifier_svc.scheduler import OpenJob, SessionHandle
from verifier_svc.server import VerifierConfig, load_verifier, serve
from verifier_svc.tree_verifier import VerifierError

MAX_SESSIONS = 2
MAX_SEQ_LEN = 128
MAX_TREE_NODES = 33
PROMPT = [5, 17, 42, 99, 3]
EXPORTER = InMemorySpanExporter()


class Stream:
    """One Session call, driven a message at a time from the test thread."""

    def __init__(self, stub: pb_grpc.VerifierStub, timeout: float | None = None):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Session(iter(self._requests.get, None), timeout=timeout)

    def send(self, **kind) -> pb.VerifierMessage:
        """Send one DrafterMessage (e.g. `tree=...`) and return the one reply."""
        self._requests.put(pb.DrafterMessage(**kind))
        return next(self.call)

    def close(self) -> None:
        """Send Close: the server ends the stream with OK and no further reply."""
        self._requests.put(pb.DrafterMessage(close=pb.Close()))
        self._requests.put(None)
        assert list(self.call) == []
        assert self.call.code() == grpc.StatusCode.OK

    def __enter__(self) -> Stream:
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
                          idle_timeout_s=30)


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


# -- helpers --------------------------------------------------------------------------------


def open_message(layers, prompt=PROMPT, sampling: pb.SamplingParams | None = None, traceparent="") -> dict:
    return {"open": pb.Open(prompt_token_ids=prompt, sampling=sampling or pb.SamplingParams(),
                            feature_layer_ids=layers, traceparent=traceparent)}


def wait_free(stub, expected: int = MAX_SESSIONS, timeout: float = 10.0) -> None:
    """Poll Info until `expected` slots are free (slots are released by a queued job)."""
    deadline = time.monotonic() + timeout
    while (free := stub.Info(pb.InfoRequest(), timeout=5).free_sessions) != expected:
        assert time.monotonic() < deadline, f"free_sessions stuck at {free}, expected {expected}"
        time.sleep(0.02)


def expect_error(stream: Stream, code: grpc.StatusCode, needle: str, **kind) -> None:
    """The reply is an in-band Error, then the RPC ends with the same status."""
    reply = stream.send(**kind)
    assert reply.WhichOneof("kind") == "error", reply
    assert reply.error.code == code.value[0] and needle in reply.error.message, reply.error
    with pytest.raises(grpc.RpcError) as info:
        next(stream.call)
    assert info.value.code() == code and needle in info.value.details()
    assert "Traceback" not in info.value.details()


def chain_tree(root: int, tokens: list[int]) -> DraftTree:
    return DraftTree.from_parents([root] + tokens, list(range(-1, len(tokens))))


def good_session(stub, layers) -> None:
    """A short valid session works and leaves every slot free."""
    with Stream(stub) as s:
        root = s.send(**open_message(layers)).prefilled.token
        verified = s.send(tree=encode_tree(chain_tree(root, [1, 2]), 1)).verified
        assert verified.round == 1 and verified.features.shape[0] == 1 + len(verified.accepted_tokens)
        s.close()
    wait_free(stub)


# -- tests ----------------------------------------------------------------------------------


def test_info(stub, config, local):
    info = stub.Info(pb.InfoRequest(), timeout=5)
    cfg = local.runner.model.cfg
    assert (info.architecture, info.vocab_size, info.hidden_size, info.num_layers) == (
        cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers)
    assert info.dtype == "float32" and info.config_fingerprint == cfg.fingerprint()
    assert tuple(info.feature_layer_ids) == config.feature_layer_ids
    assert (info.max_seq_len, info.max_sessions, info.max_tree_nodes, info.free_sessions) == (
        MAX_SEQ_LEN, MAX_SESSIONS, MAX_TREE_NODES, MAX_SESSIONS)


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


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=50, seed=7)],
                         ids=["greedy", "seeded"])
def test_session_matches_in_process_verifier(stub, local, layers, sampling):
    session_id, want = local.open(PROMPT, sampling)
    oracle = OracleProposer(local.runner.model, block_size=8, rank1_every=3)
    accepted = 0
    with Stream(stub) as s:
        got = s.send(**open_message(layers, sampling=encode_sampling(sampling))).prefilled
        assert got.token == want.token and got.max_seq_len == MAX_SEQ_LEN
        torch.testing.assert_close(decode_tensor(got.features, max_elements=1 << 20), want.features)
        state, root, new_tokens = oracle.start(PROMPT, want.features), want.token, [want.token]
        for r in range(1, 6):
            tree = build_ddtree(oracle.block_logits(state, root, new_tokens, None), root, budget=12)
            want = local.verify(session_id, tree)
            got = s.send(tree=encode_tree(tree, r)).verified
            assert got.round == r
            assert (list(got.accepted_tokens), got.next_token) == (want.accepted_tokens, want.next_token)
            torch.testing.assert_close(decode_tensor(got.features, max_elements=1 << 20), want.features)
            root, new_tokens = want.next_token, want.accepted_tokens + [want.next_token]
            accepted += len(want.accepted_tokens)
        s.close()
    local.close(session_id)
    if sampling.greedy:
        assert accepted > 5  # the oracle draft is mostly right: the trees were really walked
    wait_free(stub)


def test_stage_hook_sees_each_step(local):
    stages = []

    def stage(name):
        stages.append(name)
        return contextlib.nullcontext()

    session_id, pre = local.open(PROMPT, SamplingParams(), stage=stage)
    local.verify(session_id, chain_tree(pre.token, [1]), stage=stage)
    local.close(session_id)
    assert stages == ["forward", "sample", "forward", "sample", "commit"]


def _tree(root, tokens, next_token, next_sibling, round_index=1, width=None) -> pb.Tree:
    msg = pb.Tree(round=round_index, tokens=pack_ints(tokens), next_token=pack_ints(next_token),
                  next_sibling=pack_ints(next_sibling))
    if width is not None:
        msg.tokens.width = width
    return msg


BAD_TREES = {
    "link backwards": (lambda r: _tree(r, [r, 5, 6], [1, 0, -1], [-1, -1, -1]), "does not point forward"),
    "self loop": (lambda r: _tree(r, [r, 5], [1, 1], [-1, -1]), "does not point forward"),
    "index out of range": (lambda r: _tree(r, [r, 5], [7, -1], [-1, -1]), "out of range"),
    "buffer lengths differ": (lambda r: _tree(r, [r, 5, 6], [1, -1], [-1, -1, -1]), "differ in length"),
    "too many nodes": (lambda r: encode_tree(chain_tree(r, [7] * MAX_TREE_NODES), 1), "limit of 33"),
    "token outside vocab": (lambda r: _tree(r, [r, 9999], [1, -1], [-1, -1]), "outside the vocabulary"),
    "negative token": (lambda r: _tree(r, [r, -4], [1, -1], [-1, -1]), "outside the vocabulary"),
    "root is not the bonus": (lambda r: encode_tree(chain_tree((r + 1) % 512, [3]), 1), "last bonus token"),
    "bad packed width": (lambda r: _tree(r, [r, 5, 6], [1, 2, -1], [-1, -1, -1], width=3), "width 3"),
    "empty tree": (lambda r: _tree(r, [], [], []), "no nodes"),
    "round out of order": (lambda r: encode_tree(chain_tree(r, [3]), 2), "out of order"),
    "root has a sibling": (lambda r: _tree(r, [r, 5], [-1, -1], [1, -1]), "root node 0 has a sibling"),
}


@pytest.mark.parametrize("case", list(BAD_TREES))
def test_malformed_tree_is_invalid_argument(stub, layers, case):
    build, needle = BAD_TREES[case]
    with Stream(stub) as s:
        root = s.send(**open_message(layers)).prefilled.token
        expect_error(s, grpc.StatusCode.INVALID_ARGUMENT, needle, tree=build(root))
    good_session(stub, layers)


def test_round_must_follow_the_previous(stub, layers):
    with Stream(stub) as s:
        root = s.send(**open_message(layers)).prefilled.token
        root = s.send(tree=encode_tree(chain_tree(root, [4]), 1)).verified.next_token
        expect_error(s, grpc.StatusCode.INVALID_ARGUMENT, "expected round 2", tree=encode_tree(chain_tree(root, [4]), 1))
    good_session(stub, layers)


BAD_OPENS = {
    "tree first": ({"tree": pb.Tree(round=1)}, "first message must be Open"),
    "close first": ({"close": pb.Close()}, "first message must be Open"),
    "top_p 0": ({"sampling": pb.SamplingParams(top_p=0.0)}, "top_p"),
    "negative temperature": ({"sampling": pb.SamplingParams(temperature=-0.5)}, "temperature"),
    "empty prompt": ({"prompt": []}, "prompt is empty"),
    "prompt too long": ({"prompt": [1] * MAX_SEQ_LEN}, "does not fit max_seq_len"),
    "id >= vocab": ({"prompt": [1, 512]}, "outside the vocabulary"),
    "id < 0": ({"prompt": [-1, 2]}, "outside the vocabulary"),
}


@pytest.mark.parametrize("case", list(BAD_OPENS))
def test_bad_open_is_invalid_argument(stub, layers, case):
    fields, needle = BAD_OPENS[case]
    message = {k: v for k, v in fields.items() if k in ("tree", "close")} or open_message(layers, **fields)
    with Stream(stub) as s:
        expect_error(s, grpc.StatusCode.INVALID_ARGUMENT, needle, **message)
    good_session(stub, layers)


def test_feature_layer_mismatch_is_failed_precondition(stub, layers):
    with Stream(stub) as s:
        expect_error(s, grpc.StatusCode.FAILED_PRECONDITION, "features of target layers",
                     **open_message(layers[:1]))
    good_session(stub, layers)


def test_resource_exhausted_when_all_slots_are_taken(stub, layers):
    streams = [Stream(stub) for _ in range(MAX_SESSIONS)]
    for s in streams:
        assert s.send(**open_message(layers)).WhichOneof("kind") == "prefilled"
    assert stub.Info(pb.InfoRequest(), timeout=5).free_sessions == 0
    with Stream(stub) as extra:
        expect_error(extra, grpc.StatusCode.RESOURCE_EXHAUSTED, "slots", **open_message(layers))
    for s in streams:
        with s:
            s.close()
    wait_free(stub)
    good_session(stub, layers)


def test_client_cancel_frees_the_slot(stub, layers):
    with Stream(stub) as s:
        root = s.send(**open_message(layers)).prefilled.token
        s.send(tree=encode_tree(chain_tree(root, [4, 5]), 1))
        assert stub.Info(pb.InfoRequest(), timeout=5).free_sessions == MAX_SESSIONS - 1
        s.call.cancel()
    wait_free(stub)


def test_client_deadline_frees_the_slot(stub, layers):
    with Stream(stub, timeout=1.0) as s:
        s.send(**open_message(layers))
        with pytest.raises(grpc.RpcError) as info:
            next(s.call)  # nothing more comes: the deadline ends the call
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_free(stub)


def test_stream_end_without_close_frees_the_slot(stub, layers):
    s = Stream(stub)
    s.send(**open_message(layers))
    s._requests.put(None)  # half-close without a Close message
    assert list(s.call) == [] and s.call.code() == grpc.StatusCode.OK
    wait_free(stub)


def test_idle_timeout_closes_the_session(config, tracing):
    idle = VerifierConfig(**{**config.__dict__, "max_sessions": 1, "idle_timeout_s": 0.5})
    with ServerThread(lambda: serve(idle)) as running, _connect(running.port) as ch:
        stub = pb_grpc.VerifierStub(ch)
        with Stream(stub) as s:
            s.send(**open_message(config.feature_layer_ids))
            reply = next(s.call)  # the server speaks first: the session went idle
            assert reply.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            with pytest.raises(grpc.RpcError) as info:
                next(s.call)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no message for" in info.value.details()
        wait_free(stub, expected=1)


def test_spans_are_parented_to_the_drafter(stub, layers, tracing):
    with tracer("tests").start_as_current_span("drafter-round") as parent:
        traceparent = current_traceparent()
    with Stream(stub) as s:
        root = s.send(**open_message(layers, traceparent=traceparent)).prefilled.token
        tree = encode_tree(chain_tree(root, [4, 5, 6]), 1, traceparent)
        reply = s.send(tree=tree)
        s.close()
    spans = tracing.get_finished_spans()

    def children(span_id):
        return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == span_id}

    roots = children(parent.get_span_context().span_id)
    assert {"prefill", "verify"} <= set(roots)
    verify = roots["verify"]
    assert verify.context.trace_id == parent.get_span_context().trace_id
    assert set(children(verify.context.span_id)) == {"forward", "sample", "commit"}
    assert set(children(roots["prefill"].context.span_id)) == {"forward", "sample"}
    attrs = verify.attributes
    assert (attrs["round"], attrs["tree.nodes"], attrs["accepted"]) == (1, 4, len(reply.verified.accepted_tokens))
    assert attrs["bytes.received"] == tree.ByteSize() and attrs["bytes.sent"] == reply.ByteSize()


def _random_session(stub, layers, prompt: list[int], rounds: int = 6) -> list[tuple]:
    """A greedy session over trees built from seeded random logits; returns every reply."""
    gen = torch.Generator().manual_seed(sum(prompt))
    with Stream(stub) as s:
        root = s.send(**open_message(layers, prompt=prompt)).prefilled.token
        out = [root]
        for r in range(1, rounds + 1):
            tree = build_ddtree(torch.randn(7, 512, generator=gen), root, budget=8)
            v = s.send(tree=encode_tree(tree, r)).verified
            out.append((list(v.accepted_tokens), v.next_token, bytes(v.features.data)))
            root = v.next_token
        s.close()
    return out


def test_concurrent_sessions_do_not_interfere(stub, layers):
    prompts = [PROMPT, list(range(60, 90))]
    alone = [_random_session(stub, layers, p) for p in prompts]
    together: list = [None, None]

    def run(i):
        together[i] = _random_session(stub, layers, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert together == alone
    wait_free(stub)


def test_shutdown_drains_and_refuses(config, tracing):
    with ServerThread(lambda: serve(config)) as running, _connect(running.port) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                                      timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with Stream(pb_grpc.VerifierStub(ch)) as s:
            s.send(**open_message(config.feature_layer_ids))
            stopping = asyncio.run_coroutine_threadsafe(running.server.stop(0.5), running.loop)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError):  # the open session is ended after the grace period
                next(s.call)
        stopping.result(10)

        async def open_after_stop():
            job = OpenJob(SessionHandle(), PROMPT, SamplingParams(), "", 0)
            with pytest.raises(VerifierError) as info:
                await running.server.worker.open(job)
            return info.value.status

        assert running.call(open_after_stop()) == "UNAVAILABLE"


class _ThreadRecordingVerifier:
    """A stand-in TreeVerifier that records which thread ran each job."""

    runner = type("Runner", (), {"device": torch.device("cpu")})()
    free_capacity = 1

    def __init__(self):
        self.threads: dict[str, str] = {}

    def open(self, prompt_ids, sampling, *, stage):
        self.threads["open"] = threading.current_thread().name
        return 1, Prefilled(token=5, features=torch.zeros(len(prompt_ids), 4), max_seq_len=64)

    def verify(self, session_id, tree, *, stage):
        self.threads["verify"] = threading.current_thread().name
        return Verified(accepted_tokens=[], next_token=5, features=torch.zeros(1, 4))

    def close(self, session_id):
        pass


def _run_worker(body) -> tuple[_ThreadRecordingVerifier, str]:
    """Run `await body(worker, handle)` against a started ModelWorker over a recording verifier;
    return the verifier and the event loop's thread name."""
    from verifier_svc.scheduler import ModelWorker, SessionHandle

    verifier = _ThreadRecordingVerifier()

    async def run() -> str:
        worker = ModelWorker(verifier)
        worker.start()
        try:
            await body(worker, SessionHandle())
        finally:
            await asyncio.to_thread(worker.stop)
        return threading.current_thread().name

    return verifier, asyncio.run(run())


_ONE_NODE = DraftTree(torch.tensor([5]), torch.tensor([-1]), torch.tensor([-1]))


def test_idle_worker_runs_verify_inline_and_prefill_on_its_thread():
    """A verify job on an idle worker skips the thread hand-off; prefills never block the loop."""
    from verifier_svc.scheduler import OpenJob, VerifyJob

    async def body(worker, handle):
        await worker.open(OpenJob(handle, [1, 2], SamplingParams(), "", 0))
        while worker._busy.locked():  # the worker thread may still be leaving the open job
            await asyncio.sleep(0.001)
        reply = await worker.verify(VerifyJob(handle, _ONE_NODE, 1, "", 0))
        assert reply.verified.next_token == 5

    verifier, loop_thread = _run_worker(body)
    assert verifier.threads == {"open": "model-worker", "verify": loop_thread}


def test_busy_worker_queues_verify_jobs():
    """While a job runs (the worker is busy), a verify job waits in the queue for the worker thread."""
    from verifier_svc.scheduler import VerifyJob

    async def body(worker, handle):
        handle.session_id = 1
        worker._busy.acquire()  # as if another session's job were running
        queued = asyncio.ensure_future(worker.verify(VerifyJob(handle, _ONE_NODE, 1, "", 0)))
        await asyncio.sleep(0.05)
        assert not queued.done()
        worker._busy.release()
        await queued

    verifier, loop_thread = _run_worker(body)
    assert verifier.threads["verify"] == "model-worker" != loop_thread
