"""The model worker: one thread that owns the `TreeVerifier` and runs its steps.

gRPC handlers run on the asyncio event loop and never wait on the model. A link handler
turns each decoded LinkRequest into a `LinkStep` (its entries, plus results already known
from decoding), puts it on the worker's queue and awaits an asyncio future. The worker
takes *every* pending LinkStep, from every link, and runs them as one verifier step: all
their trees go through one batched forward (`TreeVerifier.step`). It then serialises each
link's LinkResponse off the event loop (`EncodedReply`: the features copied once, into the
reply) and resolves the futures through `loop.call_soon_threadsafe`. A step takes one message
per link (a link's later ones wait for the next step, first in line), so a link with a backlog
delays no other. On CUDA the next step's host work overlaps the running step's forward when a
link pipelines (`ModelWorker`).

`SessionTimers` (used by each link, on the event loop) closes, through the worker, the sessions
a drafter opened and never sent a tree for (the open timeout) or stopped sending for (the idle
timeout), freeing their KV slots.

Tracing: each step is a `verify_step` span with `launch` (queuing the batched forward, accept
and KV compaction: one graph replay on CUDA), `forward` (waiting for its results), `commit`
(the sessions' bookkeeping), `prefill` (the batched prefill of the step's opens, with
`forward` and `sample`) and `encode` (the replies) children; each tree entry that carries a
`traceparent` gets a `verify` span under the drafter's span, each open a `prefill` span, covering the step and linked to its span.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from common import metrics
from common.feature_ring import RingOffer, RingWriter
from common.feature_wire import wire_rows
from common.protocol import CloseEntry, Entry, ExtendEntry, OpenEntry, StatusError, StepResult, TreeEntry, Verified
from common.tracing import context_from_traceparent, current_span, tracer, use_span
from common.wire import EncodedReply, RingPlace, encode_link_notice, encode_link_response, feature_bytes
from verifier_svc.tree_verifier import SHUTTING_DOWN, PendingStep, TreeVerifier, VerifierError

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


@dataclass
class LinkStep:
    """One LinkRequest's work: `items` in message order, each an entry to run or a result
    already known (an entry refused while decoding)."""

    owner: Hashable
    step: int
    items: list[Entry | StepResult]
    future: asyncio.Future | None = None  # its reply (an EncodedReply)
    notice: asyncio.Future | None = None  # for a message that ends a prompt: the notice ahead of its reply, or None
    received_bytes: int = 0
    decoded: float = field(default_factory=time.perf_counter)  # its message decoded (LinkResponse.held_seconds)
    ring: RingWriter | None = None  # the link's feature ring: the reply's rows go there when it has room
    offer: RingOffer | None = None  # a ring offered in the reply
    # The link's `_Link.send_in_turn`, where it can take a reply from the thread that encoded it:
    # called with this step and the reply's bytes before its future is resolved; None: the link's
    # writer sends it.
    send_in_turn: Callable[[LinkStep, bytes], None] | None = None
    unsent: memoryview | None = None  # what the socket did not take of the reply's frame (None: it took none)

    @property
    def ends_prompts(self) -> bool:
        """Whether some entry is a prompt's last chunk (its reply may be preceded by a notice)."""
        return any(isinstance(item, (OpenEntry, ExtendEntry)) and not item.more for item in self.items)


@dataclass
class _Close:
    """Close sessions of one link: all of them (`session_ids` None: the link ended) or those timed out."""
    owner: Hashable
    session_ids: tuple[int, ...] | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SessionTimers:
    """A link's open sessions, and when each must next be heard from.

    A session's timer runs only while the verifier waits on the drafter for it: from the reply
    to its open (`open_timeout_s`, at most `idle_timeout_s`) or to its last tree (`idle_timeout_s`)
    until its next entry arrives; a session in a message not yet answered has none (a prompt's
    next chunk may come ahead of the reply to the one before it). So a session
    opened and never sent a tree holds its KV slot for `open_timeout_s` only, and one that
    stops sending (while the link goes on for others) for `idle_timeout_s`. The link closes
    the sessions that `expire` returns (`ModelWorker.close_sessions`); a later tree for one of
    them gets NOT_FOUND saying why. Runs on the event loop.
    """

    max_remembered = 4096  # timed-out ids kept for that NOT_FOUND message (oldest forgotten first)

    def __init__(self, open_timeout_s: float, idle_timeout_s: float):
        self.open_timeout_s, self.idle_timeout_s = min(open_timeout_s, idle_timeout_s), idle_timeout_s
        self.sessions: set[int] = set()  # ids opened and neither closed nor failed, as far as the link knows
        # Waited-on sessions: monotonic time each is closed at, and whether it has not sent a tree yet.
        self._deadlines: dict[int, tuple[float, bool]] = {}
        self._unanswered: collections.Counter[int] = collections.Counter()  # id -> its entries not yet answered
        self._timed_out: collections.OrderedDict[int, str] = collections.OrderedDict()  # id -> why it was closed

    def heard(self, items: list[Entry | StepResult]) -> list[Entry | StepResult]:
        """Note one message's decoded entries; a tree for a timed-out session becomes its NOT_FOUND result."""
        out = []
        for item in items:
            sid = item.session_id
            self._deadlines.pop(sid, None)
            if isinstance(item, OpenEntry):
                self.sessions.add(sid)
                self._timed_out.pop(sid, None)
            elif isinstance(item, CloseEntry):
                self.sessions.discard(sid)
                self._timed_out.pop(sid, None)
            elif isinstance(item, (TreeEntry, ExtendEntry)) and sid not in self.sessions and sid in self._timed_out:
                item = StepResult(sid, VerifierError("NOT_FOUND", f"no open session {sid}: {self._timed_out[sid]}"))
            if not isinstance(item, CloseEntry):  # a close has no result in the reply
                self._unanswered[sid] += 1
            out.append(item)
        return out

    def answered(self, reply: EncodedReply, now: float) -> None:
        """Note a reply written to the drafter: start the timers of its sessions that have no
        later entry on the way."""
        for sid, kind in reply.results:
            self._unanswered[sid] -= 1
            if self._unanswered[sid] <= 0:
                del self._unanswered[sid]
            if kind == "error":
                self.sessions.discard(sid)
                self._deadlines.pop(sid, None)
            elif sid in self.sessions and sid not in self._unanswered:
                opened = kind in ("prefilled", "extended")  # no tree yet: the open timeout
                self._deadlines[sid] = (now + (self.open_timeout_s if opened else self.idle_timeout_s), opened)

    def wait_s(self, now: float) -> float | None:
        """How long the link may wait for its next message before calling `expire`: until the
        first timer expires, and at most open_timeout_s while it has sessions (a timer started
        meanwhile, by a reply, expires no sooner than that); None without sessions."""
        if not self.sessions and not self._deadlines:
            return None
        first = min((d for d, _ in self._deadlines.values()), default=float("inf"))
        return max(0.0, min(first - now, self.open_timeout_s))

    def expire(self, now: float) -> tuple[list[int], list[int]]:
        """Forget the sessions whose timers expired; returns their ids: (never sent a tree, stopped sending)."""
        unstarted, idle = [], []
        for sid, (deadline, opened) in list(self._deadlines.items()):
            if deadline > now:
                continue
            del self._deadlines[sid]
            self.sessions.discard(sid)
            (unstarted if opened else idle).append(sid)
            self._timed_out[sid] = (f"closed after {self.open_timeout_s:g} s without a tree since its open "
                                    "(open timeout)" if opened else
                                    f"closed after {self.idle_timeout_s:g} s without a message (idle timeout)")
            while len(self._timed_out) > self.max_remembered:
                self._timed_out.popitem(last=False)
        return unstarted, idle


_WAKE = None  # queued to wake the thread: by stop(), and by the waiter when a step's results land


@dataclass
class _Running:
    """A verifier step begun (its verify queued on the device) and not yet finished."""
    steps: list[LinkStep]
    span: trace.Span
    start_ns: int
    began: float  # perf_counter at its begin: the step's time runs from here to the end of its finish
    pending: PendingStep | None = None
    launched: float | None = None  # perf_counter at its verify's launch (the forward histogram runs from here)
    in_prefill: bool = False  # inside a "prefill" stage: its "forward" is not a verify's
    prefill_launched: float | None = None  # perf_counter at its first prefill's launch (until its "prefilled")

    @property
    def owners(self) -> set[Hashable]:
        return {s.owner for s in self.steps}


class ModelWorker:
    """Runs verifier steps on one thread; `submit` is called from the event loop.

    With `overlap` (default on CUDA), a step runs in two halves (`TreeVerifier.begin`, `finish`):
    while one step's forward runs on the device, a message from a link that pipelines (one with
    a message in that step) begins the next step at once (its trees checked, its forward queued
    behind the running one, with every other message waiting then that may go), so the device
    does not wait for that host work. A message from another link alone waits for the running
    step and goes into the next one with whatever arrives meanwhile, as without overlap, so
    that messages batch; so does a message that touches a running step's sessions, and every
    message behind an `exclusive` step (one whose verify's logits are read for logprobs when it
    finishes) or a close (a step's prefills are queued with its verify and do not hold the next
    step back). A waiter thread wakes the worker when a step's results are on the host; steps
    finish in the order they began.
    """

    max_running = 2  # steps begun and not finished: the one on the device and the next, queued behind it

    def __init__(self, verifier: TreeVerifier, name: str = "model-worker", overlap: bool | None = None):
        self.verifier = verifier
        model = verifier.runner.model
        # The width and dtype of the feature rows its replies carry (packed ones under --feature-wire fp8).
        self.feature_dim, self.dtype = wire_rows(model.feature_dim, verifier.runner.feature_wire,
                                                 model.embed_tokens.weight.dtype)
        self.overlap = verifier.runner.device.type == "cuda" if overlap is None else overlap
        self._queue: queue.SimpleQueue[LinkStep | _Close | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against stop()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._waits: queue.SimpleQueue[_Running | None] = queue.SimpleQueue()  # begun steps, for the waiter
        self._waiter = (threading.Thread(target=self._wait_for_results, name=f"{name}-waiter", daemon=True)
                        if self.overlap else None)
        # Encodes the replies of steps with prompts (`_answer`) while the next step runs; each link's
        # writer sends its replies in message order whichever thread finished them.
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-encoder")
        # Spans of model steps measure device time: wait for the device before they end.
        self._sync = torch.cuda.synchronize if verifier.runner.device.type == "cuda" else None
        self.steps = 0
        self.busy_s = 0.0  # wall time with a verifier step begun and not finished, for metrics
        self._open_steps = 0  # begun and not finished
        self._busy_since = 0.0  # when the last of them began that found none open
        self._beat = time.monotonic()  # the worker loop's last turn (`stalled_s`)
        self._idle = False  # waiting for a message with no step running

    def start(self) -> None:
        if self._waiter is not None:
            self._waiter.start()
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Finish the running steps, then fail everything still queued with UNAVAILABLE; whether
        the thread ended (within `timeout` seconds: a hung step may keep it).

        Blocks until then; call it from a worker thread (`asyncio.to_thread`) when on the event loop.
        """
        with self._lock:
            self._stopped = True
            self._queue.put(_WAKE)
        self._thread.join(timeout)
        self._waits.put(None)
        for job in self._drain():
            if isinstance(job, LinkStep):
                _settle(job, error=VerifierError("UNAVAILABLE", SHUTTING_DOWN))
        self._encoder.shutdown(wait=True)
        return not self._thread.is_alive()

    @property
    def stalled_s(self) -> float:
        """How long the worker has had work (a step on the device, or a message or wake-up queued)
        without a turn of its loop; 0 while it has none. A hung device or worker makes it grow
        while the event loop, Info included, still answers. Read from any thread."""
        if self._idle or not self._open_steps and self._queue.empty():
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    @property
    def free_sessions(self) -> int:
        """Free KV slots. Read without the worker: a list length, atomic under the GIL."""
        return self.verifier.free_capacity

    # -- called on the event loop ------------------------------------------------------------

    def submit(self, job: LinkStep) -> asyncio.Future:
        """Queue one link message's work; the future's result is its reply (an EncodedReply), and
        `job.notice`'s (for a message that ends prompts) the notice ahead of it, or None."""
        loop = asyncio.get_running_loop()
        job.future = loop.create_future()
        job.notice = loop.create_future() if job.ends_prompts else None
        with self._lock:
            if self._stopped:
                _settle(job, error=VerifierError("UNAVAILABLE", SHUTTING_DOWN))
            else:
                self._queue.put(job)
                metrics.track_inflight_step(job.future)
        return job.future

    def close_owner(self, owner: Hashable) -> threading.Event:
        """Close every session of a link (queued); the event is set once done."""
        return self._close(_Close(owner))

    def close_sessions(self, owner: Hashable, session_ids: Sequence[int]) -> threading.Event:
        """Close some sessions of a link (queued behind its earlier messages); the event is set once done."""
        return self._close(_Close(owner, tuple(session_ids)))

    def _close(self, job: _Close) -> threading.Event:
        with self._lock:
            if self._stopped:
                job.done.set()
            else:
                self._queue.put(job)
        return job.done

    # -- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        waiting: list[LinkStep | _Close] = []  # received, not begun
        running: collections.deque[_Running] = collections.deque()  # begun, oldest first
        while not self._stopped:
            self._beat = time.monotonic()
            while running and self._ready(running[0]):
                self._finish(running.popleft())
                self._beat = time.monotonic()
            if not (waiting and (not running or self._begins_early(waiting, running))):
                self._idle = not running
                item = self._queue.get()  # a job, or a wake-up (a step's results landed, or stop())
                self._beat = time.monotonic()  # before `_idle`: `stalled_s` must not read an old beat as work's
                self._idle = False
                waiting += [item] if isinstance(item, (LinkStep, _Close)) else []
            waiting += self._drain()
            if self._stopped:
                break
            if not waiting or (running and not self._begins_early(waiting, running)):
                continue  # the oldest step's results first
            steps, waiting = self._next_step(waiting, running)
            if steps:
                run = self._begin(steps)
                if run is not None and self.overlap:
                    running.append(run)
                    self._waits.put(run)
                elif run is not None:
                    self._finish(run)
        while running:
            self._finish(running.popleft())
        for job in waiting:
            if isinstance(job, LinkStep):
                _settle(job, error=VerifierError("UNAVAILABLE", SHUTTING_DOWN))
            else:
                job.done.set()

    def _begins_early(self, waiting: list[LinkStep | _Close], running: collections.deque[_Running]) -> bool:
        """Whether to begin a step now, while `running` ones are on the device: when the next
        message of a link that pipelines (it has a message running) may go (no close is waiting,
        and there is room behind steps that are not exclusive)."""
        if len(running) >= self.max_running or any(r.pending.exclusive for r in running):
            return False
        if any(isinstance(job, _Close) for job in waiting):
            return False
        owners = set().union(*(r.owners for r in running))
        first = {}  # each link's next message: a later one waits behind it
        for job in waiting:
            first.setdefault(job.owner, job)
        return any(job.owner in owners and self._may_begin(job, running) for job in first.values())

    @staticmethod
    def _ready(run: _Running) -> bool:
        """Whether a begun step's results are on the host; True if asking fails (a device error:
        finishing the step reports it to its links)."""
        try:
            return run.pending.ready()
        except Exception:
            return True

    @staticmethod
    def _may_begin(job: LinkStep, running: collections.deque[_Running]) -> bool:
        """Whether every running step admits a message (`PendingStep.admits`)."""
        keys = {(job.owner, item.session_id) for item in job.items}
        return all(r.pending.admits(keys) for r in running)

    def _next_step(self, waiting: list[LinkStep | _Close], running: collections.deque[_Running]
                   ) -> tuple[list[LinkStep], list[LinkStep | _Close]]:
        """The messages of the next step (one per link; none that touches a running step's sessions),
        running the closes met on the way; returns (the step's messages, those left waiting)."""
        steps, left, busy = [], [], set()
        for job in waiting:
            # One message per link per step: a session's entries keep their order across a link's
            # pipelined messages; a link's close waits behind its earlier messages.
            if job.owner in busy:
                left.append(job)
            elif isinstance(job, _Close):
                if job.session_ids is None:
                    closed = self.verifier.close_owner(job.owner)
                    if closed:
                        log.info("link %s ended: closed %d sessions", job.owner, closed)
                else:
                    for sid in job.session_ids:
                        self.verifier.close((job.owner, sid))
                job.done.set()
            elif running and not self._may_begin(job, running):
                busy.add(job.owner)
                left.append(job)
            else:
                busy.add(job.owner)
                steps.append(job)
        return steps, left

    def _wait_for_results(self) -> None:
        """The waiter thread: wake the worker when each begun step's results are on the host."""
        while (run := self._waits.get()) is not None:
            try:
                run.pending.wait()
            except Exception:  # the worker's own wait reports it
                pass
            self._queue.put(_WAKE)

    def _drain(self) -> Iterator[LinkStep | _Close]:
        """The queued jobs, without blocking (wake-ups skipped)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _WAKE:
                yield item

    def _begin(self, steps: list[LinkStep]) -> _Running | None:
        """Begin one verifier step over the messages: None if it failed (their futures are resolved)."""
        entries = [(s.owner, item) for s in steps for item in s.items if not isinstance(item, StepResult)]
        metrics.VERIFIER_STEP_BATCH_SIZE.observe(sum(isinstance(item, TreeEntry) for _, item in entries))
        start_ns = time.time_ns()  # the session spans cover the step span
        span = _tracer.start_span("verify_step", attributes={"links": len(steps), "entries": len(entries)})
        run = _Running(steps, span, start_ns, time.perf_counter())
        if not self._open_steps:
            self._busy_since = run.began
        self._open_steps += 1
        try:
            with use_span(span):
                run.pending = self.verifier.begin(entries, stage=functools.partial(self._stage, run))
        except Exception:
            log.exception("verifier step failed")
            self._fail(steps)
            span.end()
            self._closed()
            return None
        return run

    def _finish(self, run: _Running) -> None:
        """Finish a begun step and answer its messages."""
        try:
            with use_span(run.span):
                outcomes = self.verifier.finish(run.pending, stage=functools.partial(self._stage, run))
        except Exception:
            log.exception("verifier step failed")
            self._fail(run.steps)
            run.span.end()
            return
        finally:
            self._closed()
        step_s = time.perf_counter() - run.began  # overlapped, it includes waiting for the step before
        metrics.VERIFIER_STEP.observe(step_s)
        try:
            self._answer(run, outcomes, step_s)
        except Exception:  # a bug: the links of this step fail, the worker goes on
            log.exception("model worker step failed")
            self._fail(run.steps)

    def _answer(self, run: _Running, outcomes: list[StepResult | None], step_s: float) -> None:
        """Close the sessions refused while decoding, send the notices of the prompts completed
        (`encode_link_notice`), then encode and send each message's reply: on this thread, or for a
        step with prompts, whose replies carry their features (megabytes), on the encoder thread, so
        that the next step (a prompt's next chunk, say) need not wait for that."""
        steps, span = run.steps, run.span
        for s in steps:  # an entry refused while decoding fails its session too
            for item in s.items:
                if isinstance(item, StepResult):
                    self.verifier.close((s.owner, item.session_id))
        self.steps += 1
        end_ns = time.time_ns()
        results = iter(outcomes)
        answers = []
        for s in steps:
            out = []
            for item in s.items:
                result = item if isinstance(item, StepResult) else next(results)
                if result is None:  # a close
                    continue
                out.append(result)
                if isinstance(item, (OpenEntry, ExtendEntry, TreeEntry)) and item.traceparent:
                    _session_span(item, result, span.get_span_context(), run.start_ns, end_ns)
            if s.notice is not None:
                try:
                    notice = encode_link_notice(s.step, out, self.feature_dim, self.dtype)
                except Exception:  # the reply still carries the tokens
                    log.exception("encoding a link notice failed")
                    notice = None
                _resolve(s.notice, result=notice)
            answers.append((s, out, self._ring_place(s, out)))
        encode = functools.partial(self._encode_replies, answers, span, step_s)
        if run.pending.has_prompts:
            self._encoder.submit(encode)
        else:
            encode()

    def _ring_place(self, s: LinkStep, out: list[StepResult]) -> RingPlace | None:
        """Where the reply's feature rows go in its link's ring, reserved here (the replies of a
        link are reserved in their order, as the ring needs), or None: inline."""
        nbytes = feature_bytes(out, self.feature_dim, self.dtype) if s.ring is not None else 0
        at = s.ring.reserve(nbytes) if nbytes else None
        return None if at is None else RingPlace(s.ring, at)

    def _encode_replies(self, answers: list[tuple[LinkStep, list[StepResult], RingPlace | None]], span: trace.Span,
                        step_s: float) -> None:
        """Serialise each message's reply and hand it to its link, one message after another (the
        first link's reply goes before the next is encoded); ends the step's span."""
        with use_span(span, end_on_exit=True), current_span(_tracer, "encode"):
            for s, out, place in answers:
                try:
                    reply = encode_link_response(s.step, out, self.feature_dim, self.dtype, step_s,
                                                 held_seconds=time.perf_counter() - s.decoded, place=place,
                                                 offer=s.offer)
                except Exception:
                    log.exception("encoding a link response failed")
                    _settle(s, error=VerifierError("INTERNAL", "internal error in the verifier; see its log"))
                    continue
                if s.send_in_turn is not None and s.notice is None:  # (a notice goes first, from the link's writer)
                    s.send_in_turn(s, reply.data)
                _settle(s, result=reply)

    def _closed(self) -> None:
        """A begun step is finished (or failed): the busy time ends with the last open one."""
        self._open_steps -= 1
        if not self._open_steps:
            self.busy_s += time.perf_counter() - self._busy_since

    @staticmethod
    def _fail(steps: list[LinkStep]) -> None:
        for s in steps:
            _settle(s, error=VerifierError("INTERNAL", "internal error in the verifier; see its log"))

    @contextlib.contextmanager
    def _stage(self, run: _Running, name: str) -> Iterator[None]:
        """A span for one part of a step (the TreeVerifier's `stage` hook), and the histograms of its
        prefills (from the first one's "prefill", where it is queued, to the end of each
        "prefilled": its first tokens on the host) and of its verify (from its "launch" to the end of its
        "forward": its results on the host)."""
        prefill = name == "prefill"
        verify = not run.in_prefill
        run.in_prefill |= prefill
        start = time.perf_counter()
        if verify and name == "launch":
            run.launched = start
        if prefill and run.prefill_launched is None:
            run.prefill_launched = start
        try:
            with current_span(_tracer, name) as span:
                yield
                if self._sync is not None and span.is_recording():
                    self._sync()
        finally:
            if prefill:
                run.in_prefill = False
        end = time.perf_counter()
        if name == "prefilled" and run.prefill_launched is not None:
            metrics.VERIFIER_PREFILL.observe(end - run.prefill_launched)
        elif verify and name == "forward" and run.launched is not None:
            metrics.VERIFIER_FORWARD.observe(end - run.launched)


def _session_span(entry: OpenEntry | ExtendEntry | TreeEntry, result: StepResult, step_context, start_ns: int,
                  end_ns: int) -> None:
    """A `prefill` or `verify` span under the drafter's span for the session, covering the step
    it was batched in, linked to the step's span."""
    parent = context_from_traceparent(entry.traceparent)
    if parent is None:
        return
    name = "verify" if isinstance(entry, TreeEntry) else "prefill"
    span = _tracer.start_span(name, context=parent, links=[trace.Link(step_context)], start_time=start_ns)
    if not isinstance(entry, TreeEntry):
        attributes = {"prompt.tokens": len(entry.prompt_ids)}
    else:
        attributes = {"round": entry.round, "tree.nodes": entry.tree.num_nodes}
    if isinstance(result.outcome, Verified):
        attributes["accepted"] = len(result.outcome.accepted_tokens)
    elif isinstance(result.outcome, StatusError):
        span.set_status(trace.Status(trace.StatusCode.ERROR, result.outcome.message))
    span.set_attributes(attributes)
    span.end(end_time=end_ns)


def _settle(job: LinkStep, *, result=None, error: BaseException | None = None) -> None:
    """Complete a message's reply future, and its notice's (None) unless already sent."""
    _resolve(job.notice)
    _resolve(job.future, result=result, error=error)


def _resolve(future: asyncio.Future | None, *, result=None, error: BaseException | None = None) -> None:
    """Complete `future` on its own event loop (called from any thread)."""
    if future is None:
        return

    def settle() -> None:
        if future.done():  # the handler was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

