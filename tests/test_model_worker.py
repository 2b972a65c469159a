"""The verifier's model worker with `overlap` on (as on CUDA), run on the CPU: when the running
step's results are not there yet, the next message of a link that pipelines begins at once
(its trees checked and its verify queued), while other links' messages, messages that touch the
running step's sessions and anything behind an exclusive step wait for it; steps finish in the
order they began, and the results are those of the same messages one step after another.

Every step's "device work" is held by a gate per step (its `PendingStep` reports not ready until
the test opens the gate), so the order of begins and finishes is the test's to observe.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from common.config import load_draft_config
from common.protocol import CloseEntry, OpenEntry, SamplingParams, StepResult, TreeEntry, Verified
from common.tree import DraftTree
from verifier_svc.scheduler import LinkStep, ModelWorker
from verifier_svc.server import VerifierConfig, load_verifier

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 90)), [7, 300, 12, 450, 33, 8, 2], [100, 200, 300]]


@pytest.fixture(scope="module")
def config(qwen3_pair) -> VerifierConfig:
    layers = load_draft_config(qwen3_pair[1]).target_layer_ids
    return VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, host="127.0.0.1", port=0,
                          max_sessions=6, max_seq_len=128, max_tree_nodes=33, max_tree_depth=16)


def opening(sid: int, config: VerifierConfig) -> OpenEntry:
    return OpenEntry(sid, PROMPTS[(sid - 1) % len(PROMPTS)], SamplingParams(), "", tuple(config.feature_layer_ids))


def tree(root: int) -> DraftTree:
    """root -> 11 -> 13, root -> 12."""
    return DraftTree.from_parents([root, 11, 12, 13], [-1, 0, 0, 1])


class GatedWorker:
    """A ModelWorker (overlap on) over a fresh verifier whose steps stay "on the device" until
    `release`; records begins and finishes in order. Runs its own event loop thread."""

    def __init__(self, config: VerifierConfig):
        self.verifier = load_verifier(config)
        self.events: list[tuple[str, int]] = []  # ("begin" | "finish", step number)
        self.gates: list[threading.Event] = []
        self.pendings: list = []  # the steps begun, in order
        self.outcomes: dict[int, list] = {}
        real_begin, real_finish = self.verifier.begin, self.verifier.finish

        def begin(entries, **kw):
            pending = real_begin(entries, **kw)
            n = len(self.gates)
            gate = threading.Event()
            pending.ready, pending.wait = gate.is_set, gate.wait  # the device work, held
            pending.number = n
            self.pendings.append(pending)
            self.events.append(("begin", n))
            self.gates.append(gate)  # last: the test sees a step as begun once its gate is there
            return pending

        def finish(pending, **kw):
            self.events.append(("finish", pending.number))
            out = real_finish(pending, **kw)
            self.outcomes[pending.number] = out
            return out

        self.verifier.begin, self.verifier.finish = begin, finish
        self.worker = ModelWorker(self.verifier, overlap=True)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        self.worker.start()
        return self

    def __exit__(self, *exc):
        for gate in self.gates:
            gate.set()
        self.worker.stop(30)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), self.loop).result(10)  # let the replies land
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def post(self, owner: str, step: int, entries: list) -> asyncio.Future:
        """Submit one link message; returns the concurrent future of its reply."""
        async def submit():
            return await self.worker.submit(LinkStep(owner, step, list(entries)))
        return asyncio.run_coroutine_threadsafe(submit(), self.loop)

    def wait_begun(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.gates) < n:
            assert time.monotonic() < deadline, f"{n} steps did not begin: {self.events}"
            time.sleep(0.002)

    def release(self, n: int) -> None:
        self.wait_begun(n + 1)
        self.gates[n].set()

    def open_all(self, owner: str, sids: list[int], config: VerifierConfig, step: int = 1) -> dict[int, int]:
        """Open sessions in one message (released at once); their first tokens."""
        n = len(self.gates)  # counted before the post: the step may begin before the next line runs
        reply = self.post(owner, step, [opening(s, config) for s in sids])
        self.release(n)
        reply.result(30)
        return {r.session_id: r.outcome.token for r in self.outcomes[n]}


def sequential(config: VerifierConfig, messages: list[tuple[str, list]]) -> list[list[StepResult]]:
    """The same messages, one `TreeVerifier.step` after another, on a fresh verifier."""
    verifier = load_verifier(config)
    return [[r for r in verifier.step([(owner, e) for e in entries]) if r is not None] for owner, entries in messages]


def same(got: list[StepResult], want: list[StepResult]) -> None:
    assert [r.session_id for r in got] == [r.session_id for r in want]
    for g, w in zip(got, want):
        if isinstance(w.outcome, Verified):
            assert isinstance(g.outcome, Verified)
            assert (g.outcome.accepted_tokens, g.outcome.next_token) == (w.outcome.accepted_tokens, w.outcome.next_token)
            assert torch.equal(g.outcome.features, w.outcome.features)
        else:
            assert type(g.outcome) is type(w.outcome) and getattr(g.outcome, "token", None) == w.outcome.token


def test_a_pipelining_links_next_message_begins_while_its_step_runs(config):
    with GatedWorker(config) as w:
        roots = w.open_all("L", [1, 2, 3, 4], config)
        first = [TreeEntry(1, 1, tree(roots[1])), TreeEntry(2, 1, tree(roots[2]))]
        second = [TreeEntry(3, 1, tree(roots[3])), TreeEntry(4, 1, tree(roots[4]))]
        a = w.post("L", 2, first)
        w.wait_begun(2)
        b = w.post("L", 3, second)  # the other half of the link's sessions: begins at once
        w.wait_begun(3)
        assert w.events[-2:] == [("begin", 1), ("begin", 2)] and not a.done()
        w.gates[2].set()  # the later step is done first: it still waits for the earlier one
        time.sleep(0.2)
        assert not a.done() and not b.done()
        w.gates[1].set()
        a.result(30), b.result(30)
        assert w.events[-2:] == [("finish", 1), ("finish", 2)]
    want = sequential(config, [("L", [opening(s, config) for s in (1, 2, 3, 4)]), ("L", first), ("L", second)])
    same(w.outcomes[1], want[1])
    same(w.outcomes[2], want[2])


def test_other_links_and_the_running_sessions_wait_for_the_running_step(config):
    with GatedWorker(config) as w:
        roots = w.open_all("L", [1, 2], config)
        roots.update(w.open_all("M", [5], config))
        a = w.post("L", 3, [TreeEntry(1, 1, tree(roots[1]))])
        w.wait_begun(3)
        other = w.post("M", 2, [TreeEntry(5, 1, tree(roots[5]))])  # a link with nothing running: batches later
        again = w.post("L", 4, [TreeEntry(2, 1, tree(roots[2])), CloseEntry(1)])  # touches session 1: waits
        time.sleep(0.3)
        assert len(w.gates) == 3 and not a.done()
        w.gates[2].set()
        a.result(30)
        w.wait_begun(4)  # both waiting messages, together in the next step
        w.gates[3].set()
        other.result(30), again.result(30)
        assert len(w.gates) == 4
        results = [r for r in w.outcomes[3] if r is not None]  # the close has none
        assert [r.session_id for r in results] == [5, 2] and all(isinstance(r.outcome, Verified) for r in results)


def test_a_message_begins_behind_a_step_with_prefills(config):
    """A step's prefills are queued on the device with its verify (a first token's logprobs are
    read from a copy of its logits): the link's next message begins behind it at once, and the
    results are those of the messages one step after another."""
    with GatedWorker(config) as w:
        roots = w.open_all("L", [1], config)
        asking = OpenEntry(4, PROMPTS[1], SamplingParams(), "", tuple(config.feature_layer_ids), 2)
        first = [TreeEntry(1, 1, tree(roots[1])), opening(2, config), asking]
        a = w.post("L", 2, first)
        w.wait_begun(2)
        b = w.post("L", 3, [opening(3, config)])
        w.wait_begun(3)
        assert w.events[-2:] == [("begin", 1), ("begin", 2)] and not a.done()
        w.gates[1].set()
        w.gates[2].set()
        a.result(30), b.result(30)
        assert w.events[-2:] == [("finish", 1), ("finish", 2)]
    want = sequential(config, [("L", [opening(1, config)]), ("L", first), ("L", [opening(3, config)])])
    same(w.outcomes[1], want[1])
    same(w.outcomes[2], want[2])
    (got,), (wanted,) = w.outcomes[1][2].outcome.logprobs, want[1][2].outcome.logprobs
    assert got.logprob == pytest.approx(wanted.logprob, abs=1e-5) and len(got.top) == 2


def test_a_prefill_steps_replies_are_encoded_while_the_next_step_runs(config, monkeypatch):
    """The replies of a step with prefills (megabytes of prompt features) are encoded on the
    encoder thread: the next step begins while that encoding still runs, and the notice of
    the prompt's first token is out before the reply."""
    from verifier_svc import scheduler

    encoding, done = threading.Event(), threading.Event()
    real = scheduler.encode_link_response

    def slow(step, results, *args, **kwargs):
        if not kwargs.get("notice") and step == 1:
            encoding.set()
            assert threading.current_thread().name.startswith("model-worker-encoder")
            done.wait(30)
        return real(step, results, *args, **kwargs)

    monkeypatch.setattr(scheduler, "encode_link_response", slow)
    with GatedWorker(config) as w:
        jobs = [LinkStep("L", 1, [opening(1, config)]), LinkStep("L", 2, [opening(2, config)])]
        replies = [asyncio.run_coroutine_threadsafe(_submit(w.worker, job), w.loop) for job in jobs[:1]]
        w.release(0)
        assert encoding.wait(10)
        replies.append(asyncio.run_coroutine_threadsafe(_submit(w.worker, jobs[1]), w.loop))
        w.release(1)  # the second step begins (and runs) while the first one's reply is being encoded
        assert asyncio.run_coroutine_threadsafe(_result(jobs[0].notice), w.loop).result(10) is not None
        assert not replies[0].done()
        done.set()
        got = [r.result(30) for r in replies]
        assert [kind for reply in got for _, kind in reply.results] == ["prefilled", "prefilled"]
        assert w.events == [("begin", 0), ("finish", 0), ("begin", 1), ("finish", 1)]


async def _submit(worker: ModelWorker, job: LinkStep):
    return await worker.submit(job)


async def _result(future: asyncio.Future):
    return await future


def test_stop_finishes_the_running_steps_and_fails_the_rest(config):
    w = GatedWorker(config)
    with w:
        roots = w.open_all("L", [1, 2], config)
        a = w.post("L", 2, [TreeEntry(1, 1, tree(roots[1]))])
        w.wait_begun(2)
        b = w.post("L", 3, [TreeEntry(2, 1, tree(roots[2]))])
        w.wait_begun(3)
        late = w.post("M", 1, [opening(5, config)])
        time.sleep(0.1)
        threading.Timer(0.2, lambda: [g.set() for g in w.gates]).start()
        w.worker.stop(30)
        assert a.result(10) and b.result(10)  # both answered
        with pytest.raises(Exception, match="shutting down"):
            late.result(10)


def test_a_links_later_message_waits_behind_its_earlier_one(config):
    """A link's message that must wait for the running step (it touches its sessions) holds back
    the link's later messages too, even one that could go: they keep their order, and the worker
    sleeps meanwhile rather than spinning."""
    with GatedWorker(config) as w:
        roots = w.open_all("L", [1, 2, 3], config)
        a = w.post("L", 2, [TreeEntry(1, 1, tree(roots[1]))])
        w.wait_begun(2)
        checks = []
        real = w.worker._begins_early
        w.worker._begins_early = lambda *args: checks.append(1) or real(*args)
        held = w.post("L", 3, [CloseEntry(1)])  # session 1 is in a: after it
        later = w.post("L", 4, [TreeEntry(3, 1, tree(roots[3]))])
        time.sleep(0.3)
        assert len(w.gates) == 2 and len(checks) < 20, (len(w.gates), len(checks))
        w.gates[1].set()
        a.result(30)
        w.release(2)
        w.release(3)
        held.result(30), later.result(30)
        assert [e for e in w.events if e[1] >= 1] == [("begin", 1), ("finish", 1), ("begin", 2), ("begin", 3),
                                                      ("finish", 2), ("finish", 3)]


def test_a_device_error_fails_its_step_only(config):
    """A step whose results cannot be waited for (a device error: its readiness check and its
    finish raise) fails its own link messages with INTERNAL; the worker goes on with the next."""
    with GatedWorker(config) as w:
        roots = w.open_all("L", [1, 2], config)
        real_finish = w.verifier.finish

        def broken(*args):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        a = w.post("L", 2, [TreeEntry(1, 1, tree(roots[1]))])
        w.wait_begun(2)
        w.verifier.finish = lambda pending, **kw: broken() if pending.number == 1 else real_finish(pending, **kw)
        w.pendings[1].ready = broken
        w.gates[1].set()
        with pytest.raises(Exception, match="internal error"):
            a.result(30)
        b = w.post("L", 3, [TreeEntry(2, 1, tree(roots[2]))])
        w.release(2)
        assert isinstance(b.result(30), object) and isinstance(w.outcomes[2][0].outcome, Verified)
