"""Admission limits: sessions opened without a tree are closed after the verifier's short
open timeout, the verifier keeps free slots for a drafter refused one while another holds
more than its share, its model worker serves every link's message in the next step, and the
drafter's bounded queue refuses a request at once with a retry hint (gRPC trailing metadata
`retry-after-ms`, HTTP `Retry-After`).

Both services run in this process on loopback (`ServerThread`) with a tiny random pair."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.config import load_draft_config
from common.protocol import (
    CloseEntry,
    Entry,
    ExtendEntry,
    OpenEntry,
    Prefilled,
    SamplingParams,
    StatusError,
    StepResult,
    TreeEntry,
    Verified,
)
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tree import DraftTree
from common.wire import EncodedReply, decode_link_response, encode_link_request
from drafter_svc.drafter import DraftMode
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from drafter_svc.session import GenerationConfig, QueueFull
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.scheduler import SessionTimers
from verifier_svc.server import serve as serve_verifier

PROMPT = [5, 17, 42, 99, 3]
OPEN_TIMEOUT_S = 0.5


def verifier_config(pair, **changes) -> VerifierConfig:
    fields = {"target_dir": str(pair[0]), "feature_layer_ids": load_draft_config(pair[1]).target_layer_ids,
              "host": "127.0.0.1", "port": 0, "max_sessions": 2, "max_seq_len": 512, "max_tree_nodes": 17,
              "idle_timeout_s": 120, "open_timeout_s": OPEN_TIMEOUT_S}
    return VerifierConfig(**(fields | changes))


class Link:
    """One Link call driven from the test thread: a message, then its reply."""

    def __init__(self, stub: pb_grpc.VerifierStub, vocab: int, feature_dim: int):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Link(iter(self._requests.get, None))
        self.vocab, self.feature_dim, self.steps = vocab, feature_dim, 0

    def post(self, entries: Sequence[Entry]) -> None:
        self.steps += 1
        self._requests.put(encode_link_request(self.steps, entries))

    def recv(self) -> list[StepResult]:
        """The next reply's results (a notice of first tokens ahead of it is skipped)."""
        reply = next(self.call)
        if reply.notice:
            reply = next(self.call)
        return decode_link_response(reply, vocab_size=self.vocab, feature_dim=self.feature_dim,
                                    max_feature_rows=(len(reply.results) + 1) * 512)

    def step(self, entries: Sequence[Entry]) -> list[StepResult]:
        self.post(entries)
        return self.recv()

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


@pytest.fixture(scope="module")
def sizes(qwen3_pair):
    layers = load_draft_config(qwen3_pair[1]).target_layer_ids
    config = json.loads((qwen3_pair[0] / "config.json").read_text())
    return layers, config["vocab_size"], config["hidden_size"] * len(layers)


@pytest.fixture(scope="module")
def verifier(qwen3_pair):
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair))) as running:
        yield running


@pytest.fixture(scope="module")
def stub(verifier):
    with grpc.insecure_channel(f"127.0.0.1:{verifier.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.VerifierStub(channel)


@pytest.fixture
def links(stub, sizes):
    """Makes links to the shared verifier; all are ended after the test, which leaves every slot free."""
    made = []

    def make() -> Link:
        made.append(Link(stub, sizes[1], sizes[2]))
        return made[-1]

    yield make
    for link in made:
        link.close()
    wait_free(stub, 2)


def free_sessions(stub) -> int:
    return stub.Info(pb.InfoRequest(), timeout=5).free_sessions


def wait_free(stub, expected: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (free := free_sessions(stub)) != expected:
        assert time.monotonic() < deadline, f"free_sessions stuck at {free}, expected {expected}"
        time.sleep(0.02)


def opening(sid: int, layers) -> OpenEntry:
    return OpenEntry(sid, list(PROMPT), SamplingParams(), "", tuple(layers))


def root_only(token: int) -> DraftTree:
    return DraftTree(torch.tensor([token]), torch.tensor([-1]), torch.tensor([-1]))


def error_of(result: StepResult) -> StatusError:
    assert isinstance(result.outcome, StatusError), result.outcome
    assert "\n" not in result.outcome.message
    return result.outcome


# -- 1. the open timeout ------------------------------------------------------------------------


def test_opens_without_a_tree_free_their_slots_after_the_open_timeout(stub, links, sizes, caplog):
    """Two links that only open hold both slots for the open timeout, not the idle timeout; a
    third link gets a slot then, and a tree sent late gets NOT_FOUND naming the open timeout."""
    caplog.set_level(logging.INFO)
    layers = sizes[0]
    squatters, newcomer = [links(), links()], links()
    for sid, link in enumerate(squatters, 1):
        assert isinstance(link.step([opening(sid, layers)])[0].outcome, Prefilled)
    assert error_of(newcomer.step([opening(7, layers)])[0]).status == "RESOURCE_EXHAUSTED"
    wait_free(stub, 2)  # the idle timeout is 120 s: only the open timeout frees them this soon
    assert isinstance(newcomer.step([opening(7, layers)])[0].outcome, Prefilled)
    late = error_of(squatters[0].step([TreeEntry(1, 1, root_only(0))])[0])
    assert late.status == "NOT_FOUND" and "no open session 1" in late.message and "open timeout" in late.message
    assert isinstance(squatters[1].step([opening(3, layers)])[0].outcome, Prefilled)  # the link stays usable
    closing = [r.getMessage() for r in caplog.records if "(open timeout)" in r.getMessage()]
    assert closing and all("\n" not in m for m in closing)
    assert not [r for r in caplog.records if r.exc_info]


def test_the_open_timeout_is_per_session(stub, links, sizes):
    """On a link busy with one session's trees, another session opened without a tree is closed."""
    layers = sizes[0]
    link = links()
    busy, idle = link.step([opening(1, layers), opening(2, layers)])
    token, rounds = busy.outcome.token, 0
    while free_sessions(stub) != 1:
        (r,) = link.step([TreeEntry(1, rounds + 1, root_only(token))])
        assert isinstance(r.outcome, Verified), r.outcome
        token, rounds = r.outcome.next_token, rounds + 1
        assert rounds < 400, "the session opened without a tree was not closed"
        time.sleep(0.02)
    (r,) = link.step([TreeEntry(1, rounds + 1, root_only(token))])
    assert isinstance(r.outcome, Verified), r.outcome  # the busy session carries on
    assert error_of(link.step([TreeEntry(2, 1, root_only(idle.outcome.token))])[0]).status == "NOT_FOUND"


def test_no_timer_runs_for_a_session_with_an_entry_on_the_way():
    """A prompt's next chunk may come ahead of the reply to the one before it: that reply starts
    no timer (the verifier is not waiting on the drafter), the reply to the last chunk does."""
    timers = SessionTimers(open_timeout_s=1.0, idle_timeout_s=5.0)
    timers.heard([OpenEntry(1, PROMPT, SamplingParams(), more=True), OpenEntry(2, PROMPT, SamplingParams())])
    timers.heard([ExtendEntry(1, PROMPT, more=False), CloseEntry(3)])
    timers.answered(EncodedReply(b"", ((1, "extended"), (2, "prefilled"))), now=0.0)
    assert timers.expire(now=100.0) == ([2], [])  # session 1's last chunk is still on the way
    timers.answered(EncodedReply(b"", ((1, "prefilled"),)), now=100.0)
    assert timers.expire(now=100.5) == ([], []) and timers.expire(now=101.0) == ([1], [])
    timers.heard([OpenEntry(4, PROMPT, SamplingParams()), TreeEntry(4, 1, root_only(0))])  # one fails
    timers.answered(EncodedReply(b"", ((4, "error"), (4, "error"))), now=101.0)
    assert timers.expire(now=1000.0) == ([], []) and not timers.sessions


def test_open_timeout_flag_and_check():
    import verifier_svc.__main__ as cli

    assert cli.parse_config(["--target", "t", "--device", "cpu"]).open_timeout_s == VerifierConfig.open_timeout_s
    assert cli.parse_config(["--target", "t", "--device", "cpu", "--open-timeout", "3"]).open_timeout_s == 3
    with pytest.raises(ValueError, match="open_timeout_s must be > 0"):
        VerifierConfig(target_dir="t", open_timeout_s=0).check()


# -- 2. fairness across drafters ------------------------------------------------------------------


@pytest.fixture
def patient(verifier, monkeypatch):
    """The shared verifier, counting a refused drafter as waiting for the whole test (not 2 s)."""
    monkeypatch.setattr(verifier.server.worker.verifier, "contention_window_s", 600.0)


def test_a_drafter_refused_a_slot_gets_the_next_free_one(links, sizes, patient):
    """A drafter that closes a session and opens another in one message no longer keeps every
    slot while a second drafter retries its open."""
    layers = sizes[0]
    hog, other = links(), links()
    assert all(isinstance(r.outcome, Prefilled) for r in hog.step([opening(1, layers), opening(2, layers)]))
    assert "all 2 session slots are in use" in error_of(other.step([opening(10, layers)])[0]).message
    (r,) = hog.step([CloseEntry(1), opening(3, layers)])  # its slot goes to the drafter that waits
    assert error_of(r).status == "RESOURCE_EXHAUSTED" and "fair share" in r.outcome.message
    assert isinstance(other.step([opening(10, layers)])[0].outcome, Prefilled)
    # One slot each is the fair share: the next slot freed goes to whoever asks.
    (r,) = other.step([CloseEntry(10), opening(11, layers)])
    assert isinstance(r.outcome, Prefilled)


def test_nothing_is_kept_for_a_drafter_that_went_away(links, sizes, patient, caplog):
    caplog.set_level(logging.INFO)
    layers = sizes[0]
    hog, other = links(), links()
    assert all(isinstance(r.outcome, Prefilled) for r in hog.step([opening(1, layers), opening(2, layers)]))
    assert error_of(other.step([opening(10, layers)])[0]).status == "RESOURCE_EXHAUSTED"
    ended = lambda: sum("closed after" in r.getMessage() for r in caplog.records)
    before = ended()
    other.close()
    poll(lambda: ended() > before)  # its sessions' close is queued on the worker before what follows
    (r,) = hog.step([CloseEntry(1), opening(3, layers)])
    assert isinstance(r.outcome, Prefilled), r.outcome


def test_every_link_is_served_in_the_next_step(verifier, links, monkeypatch):
    """With the model worker busy, one link queues three messages and another one: the next step
    serves the first message of each, so a link's backlog delays no other link."""
    worker = verifier.server.worker
    real, calls = worker.verifier.begin, []
    entered, gate = threading.Event(), threading.Event()

    def step(entries, **kw):
        calls.append(sorted(e.session_id for _, e in entries))
        if len(calls) == 1:
            entered.set()
            assert gate.wait(30)
        return real(entries, **kw)

    monkeypatch.setattr(worker.verifier, "begin", step)
    busy, backlog, other = links(), links(), links()
    busy.post([CloseEntry(99)])  # closes of unknown sessions: steps without results
    assert entered.wait(10)
    for sid in (1, 2, 3):
        backlog.post([CloseEntry(sid)])
    other.post([CloseEntry(50)])
    deadline = time.monotonic() + 10
    while worker._queue.qsize() < 4:
        assert time.monotonic() < deadline, "the messages did not reach the worker"
        time.sleep(0.005)
    gate.set()
    for link, replies in ((busy, 1), (backlog, 3), (other, 1)):
        for _ in range(replies):
            assert link.recv() == []
    assert calls == [[99], [1, 50], [2], [3]]


# -- 3. the drafter's bounded queue ---------------------------------------------------------------


class _NoLink:
    def probe(self) -> bool:
        return True

    def close(self) -> None:
        pass


def test_a_full_queue_refuses_at_once_with_a_retry_hint():
    """One slot and a queue of two: three requests are taken, the fourth is refused."""
    scheduler = DraftScheduler(_NoLink(), None, max_sessions=1, max_queue=2, queue_timeout_s=30)
    config = GenerationConfig(max_new_tokens=4, mode=DraftMode("ar", 0))
    for _ in range(3):
        scheduler.submit([1, 2], config, lambda _: None)
    with pytest.raises(QueueFull) as info:
        scheduler.submit([1, 2], config, lambda _: None)
    exc = info.value
    assert exc.status == "RESOURCE_EXHAUSTED" and "queue is full (2 requests wait" in exc.message
    assert f"retry in {exc.retry_after_s:g} s" in exc.message and exc.retry_after_ms == round(exc.retry_after_s * 1000)
    assert exc.retry_after_s == 1.0  # no session has run yet
    scheduler._mean_run_s = 4.0  # sessions take 4 s: two waiting for one slot drain in 8 s
    assert scheduler.retry_after_s(2) == 8.0 and scheduler.retry_after_s(100) == 30.0
    assert DraftScheduler(_NoLink(), None, max_sessions=1, max_queue=0).submit([1], config, lambda _: None) == 1
    scheduler.stop(timeout=1)  # fails the queued ones and frees the queue
    assert scheduler._queued == 0


def test_max_queue_flag():
    import drafter_svc.__main__ as cli

    assert cli.parse_args(["--draft", "d", "--target", "t"]).max_queue == DrafterConfig.max_queue
    assert cli.parse_args(["--draft", "d", "--target", "t", "--max-queue", "0"]).max_queue == 0
    with pytest.raises(SystemExit):
        cli.parse_args(["--draft", "d", "--target", "t", "--max-queue", "-1"])


def test_full_queue_over_grpc_and_http(qwen3_pair, monkeypatch):
    """A drafter with one slot and a queue of one, its verifier held mid-step: the first request
    runs, the second waits, the third gets RESOURCE_EXHAUSTED at once with `retry-after-ms`
    (gRPC) or 429 with Retry-After (HTTP); once the verifier goes on, the first two finish."""
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair))) as verifier:
        cfg = DrafterConfig(draft_dir=str(qwen3_pair[1]), target_dir=str(qwen3_pair[0]),
                            verifier=f"127.0.0.1:{verifier.port}", host="127.0.0.1", port=0, tree_budget=4,
                            max_new_tokens=4, verifier_wait_s=10, max_concurrent=1, max_queue=1)
        engine = DrafterEngine.start(cfg, torch.float32)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0, http_port=0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel, \
                ThreadPoolExecutor(2) as pool:
            gate = threading.Event()
            real = verifier.server.worker.verifier.begin

            def held_step(entries, **kw):
                assert gate.wait(60)
                return real(entries, **kw)

            monkeypatch.setattr(verifier.server.worker.verifier, "begin", held_step)
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=4)
            scheduler = engine.scheduler
            try:
                running = pool.submit(stub.GenerateOnce, request, timeout=60)
                poll(lambda: len(scheduler._running) == 1)
                waiting = pool.submit(stub.GenerateOnce, request, timeout=60)
                poll(lambda: scheduler._queued == 1)
                with pytest.raises(grpc.RpcError) as info:
                    stub.GenerateOnce(request, timeout=10)
                exc = info.value
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "\n" not in exc.details()
                hint = dict(exc.trailing_metadata())["retry-after-ms"]
                assert int(hint) > 0 and f"retry in {int(hint) / 1000:g} s" in exc.details(), exc.details()
                status, headers, body = http_post(drafter.server.http_port, "/v1/completions",
                                                  {"prompt": PROMPT, "max_tokens": 4})
                assert status == 429 and int(headers["Retry-After"]) >= 1, (status, body)
                assert body["error"]["type"] == "rate_limit_error" and "queue is full" in body["error"]["message"]
            finally:
                gate.set()
            assert len(running.result(60).token_ids) == 4 and len(waiting.result(60).token_ids) == 4
            assert scheduler._queued == 0


def poll(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def http_post(port: int, path: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())
