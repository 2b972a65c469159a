"""The drafter's scheduler: one loop owns the draft model and the verifier link.

Request handlers only feed it (`submit`, `cancel`, from any thread) and read what it
delivers (a callback per session, called on the scheduler's thread). Each step:

1. takes new requests and cancellations;
2. closes the sessions that ended (Close entries; their draft slots go back);
3. admits waiting requests while draft slots are free (Open entries);
4. drafts every running session in one batched draft step and builds all their trees in one
   batched call (`DFlashProposer.propose`, `drafter.build_trees`), all cut to the step's
   adaptive budget when there is a planner (`drafter_svc.budget`);
5. sends everything as one link message and waits for its one reply (`VerifierLink.step`);
6. hands each session its new tokens, and finishes those that reached a stop token, their
   length limit or the verifier's capacity.

The next draft step of the sessions a message carries trees for is queued before their reply is
applied, and the next message's trees take those rows (`_block`): with the verifier in process,
right behind the verify, from its results on the device (`_draft_behind`), so the device goes
from the verify to the draft while the host waits for and applies the reply; over a link, as
soon as the reply comes (`_draft_ahead`). The in-process verifier also takes the trees where
the selection leaves them, on the device (`common.tree.DeviceTrees`): the next verify is queued
behind the draft and its tree selection without waiting for either. A session's first draft
step is queued as soon as its context holds the prompt (`_draft_started`), and the prompts a
reply prefilled go into their contexts in one batched call (`_grow_contexts`). In process,
requests that arrive while the host waits for a reply are opened at once, their prompts in a
message of their own queued behind the verify (`_take_arrivals`), so their first tokens do not
wait for the next message of trees.

A running session's tokens wait in an outbox until the next step's message is sent, and go to
the clients while the verifier works on it: their host work (and the request handlers' on
other threads, which want the interpreter lock) then hides behind the verify (`_flush_outbox`).
A session's last round, first token and result go at once, after anything of it still waiting,
and so do all rounds of a session whose receiver may end it (`watches_text`).

Requests beyond the free slots wait in a queue of at most `max_queue`; one arriving when it
is full is refused at once (`QueueFull`: RESOURCE_EXHAUSTED with a retry hint). An open the
verifier refuses for capacity (RESOURCE_EXHAUSTED) goes back to the queue and is retried
until `queue_timeout_s`. A failed session gets its error. A session whose verifier is lost
(the link failed, or one replica of several: `drafter_svc.replicas`) re-opens on one that
answers, prefilling its prompt plus the tokens so far, until `recovery_timeout_s`. Sampling
coins live on the verifier, per session, so a seeded request gives the same tokens whatever
else is batched with it.

Tracing: a `generate` span per request; per step a `draft_step` span with `draft`,
`tree_build` and `verify_rpc` children, and per session a `round` span under its `generate`
span, linked to the step; the round's traceparent rides on its tree, so the verifier's
`verify` span for it lands in the request's trace.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from torch import Tensor

from common.protocol import (MAX_TOKEN_BIAS, CloseEntry, Entry, ExtendEntry, Extended, LinkLost, OpenEntry, Prefilled,
                             StatusError, StepResult, TreeEntry, Verified)
from common import metrics
from common.tracing import current_span, traceparent_of, tracer, use_span
from common.tree import DeviceTree, DraftTree
from drafter_svc.budget import BudgetChoice, BudgetPlanner
from drafter_svc.drafter import BlockProposer, build_trees, join_blocks
from drafter_svc.link import VerifierLink
from drafter_svc.session import Delivery, GenerationConfig, QueueFull, RoundStats, RoundUpdate, Session

log = logging.getLogger(__name__)
_tracer = tracer("drafter_svc.scheduler")


# Benchmarks only (`drafter_svc.oracle`): given the drafted sessions' prompts, the tokens they
# have emitted so far and the block's depths D, what edits the draft step's block logits
# [S, D, V] in place (None: nothing to edit). Called once the step is queued on the device.
LogitsHook = Callable[[Sequence[list[int]], Sequence[list[int]], int], Callable[[Tensor], None] | None]


@dataclass
class _Drafted:
    """A step's trees, the adaptive budget's choice for them, how long drafting and building took,
    and the sessions drafted (their new feature rows taken into their contexts)."""
    entries: list[TreeEntry]
    budget: BudgetChoice | None = None
    draft_s: float = 0.0
    build_s: float = 0.0
    drafted: list[Session] = field(default_factory=list)


@dataclass
class _DraftAhead:
    """A draft step queued before a reply was applied: behind its verify, on an in-process
    verifier's device (`DraftScheduler._draft_behind`), or as soon as the reply came
    (`DraftScheduler._draft_ahead`). Its block logits [S, D, V], each session's row in it with
    the epoch and round count it was drafted for (`Session.epoch`, `Session.rounds` once the
    reply is applied), and its seconds."""
    block: Tensor
    rows: dict[int, tuple[int, int, int]]  # session id -> (row, epoch, rounds)
    seconds: float

    def row(self, s: Session) -> int | None:
        """The session's row, if it was drafted for the session's current state."""
        found = self.rows.get(s.sid)
        return found[0] if found is not None and found[1:] == (s.epoch, s.rounds) else None


@dataclass
class _InFlight:
    """A link message awaiting its reply: the sessions it carries an entry for (with each one's
    `Session.epoch` then: a reply to an earlier admission is stale), and spans."""
    sessions: list[Session]
    epochs: dict[int, int]
    rounds: dict[int, trace.Span]
    step_span: trace.Span
    rpc_span: trace.Span
    started: float = 0.0  # perf_counter when its step began drafting
    budget: BudgetChoice | None = None  # the adaptive budget's choice for its trees
    draft_s: float = 0.0  # its step's batched draft and tree build
    build_s: float = 0.0
    rpc_started: float = field(default_factory=time.perf_counter)  # made as its verify RPC starts (metrics)
    behind: _DraftAhead | None = None  # the next draft step of its sessions, queued behind its verify
    apart: bool = False  # prompt chunks sent apart from a message of trees (`DraftScheduler._send`)
    trees: int = 0  # the trees it carries

    def end(self) -> None:
        for span in (*self.rounds.values(), self.rpc_span, self.step_span):
            span.end()


class DraftScheduler:
    """Continuous batching on the drafter: `start()` runs it on its own thread, `run_until_idle()`
    in the caller's (the local engine)."""

    # The share of a reply's expected round trip during which requests that arrive are opened at
    # once (`_take_arrivals`).
    ARRIVALS_SHARE = 0.8
    PLAIN_PIPELINE_SESSIONS = 16  # `_pipelining`: the threshold while no session drafts, when higher

    def __init__(self, link: VerifierLink, proposer: BlockProposer | None, *, max_sessions: int,
                 feature_layer_ids: tuple[int, ...] = (), eos_token_ids: tuple[int, ...] = (),
                 queue_timeout_s: float = 30.0, logits_hook: LogitsHook | None = None, pipelined: bool = True,
                 pipeline_min_sessions: int = 2, pipeline_groups: int = 2, recovery_timeout_s: float = 0.0,
                 planner: BudgetPlanner | None = None, adapt_sampled: bool = False, max_queue: int = 256,
                 prefill_chunk: int = 0, prefill_ahead: int = 1, prefill_chunk_idle: int = 0):
        self.link, self.proposer = link, proposer
        # The adaptive tree budget (None: each request's budget as given). It adapts greedy
        # sessions, and sampled ones only when `adapt_sampled` (the verifier samples keyed by
        # position): under the coin walk a seeded output depends on its trees, and a budget
        # that follows the batch would make it depend on the other sessions.
        self.planner, self.adapt_sampled = planner, adapt_sampled
        # Pipelined rounds split the sessions into `pipeline_groups` messages in flight once this many
        # run or wait.
        self.pipelined, self.pipeline_min_sessions = pipelined, max(2, pipeline_min_sessions)
        if pipeline_groups < 2:
            raise ValueError(f"pipeline_groups must be >= 2, got {pipeline_groups}")
        self.pipeline_groups = pipeline_groups
        # Prompt tokens one step may prefill, over every session (0: no limit): a longer prompt is
        # sent in chunks over several steps, so that no round waits more than one chunk for it.
        self.prefill_chunk = prefill_chunk
        # While no session decodes, no round waits for a chunk: a step may then take up to this many
        # prompt tokens, when more (0: prefill_chunk). A prompt that long is prefilled in one piece,
        # its first token after one forward instead of one per chunk; a session that begins to
        # decode meanwhile waits for at most one such chunk.
        if prefill_chunk_idle < 0:
            raise ValueError(f"prefill_chunk_idle must be >= 0, got {prefill_chunk_idle}")
        self.prefill_chunk_idle = prefill_chunk_idle
        # While no session decodes, a prompt's next chunks may go this many messages ahead of the
        # reply to its earlier ones (0: one chunk in flight at a time): the verifier prefills a chunk
        # while the one before it sends its features back. Decoding sessions never wait more than
        # one chunk per round, so there is no running ahead of them.
        if prefill_ahead < 0:
            raise ValueError(f"prefill_ahead must be >= 0, got {prefill_ahead}")
        self.prefill_ahead = prefill_ahead
        self._prompt_tokens = 0  # prompt tokens sent since the last message of trees (within the step's budget)
        # How long the last messages with trees took from their send to their reply (`_take_arrivals`).
        self._replies: collections.deque[float] = collections.deque(maxlen=8)
        self._last_trees_reply = float("-inf")  # when the last message with trees was answered (perf_counter)
        # After the link fails with UNAVAILABLE, sessions re-open for this long (0: they fail).
        self.recovery_timeout_s = recovery_timeout_s
        self._retry_at = 0.0  # no opens before this (backoff after a failed link)
        self._backoff = 0.0
        # Whether the verifier answered last time; `on_link_state(up)` hears every change (health).
        self.link_up = True
        self.on_link_state: Callable[[bool], None] | None = None
        self.probe_interval_s = 2.0  # while idle, how often to check that the verifier answers
        self.logits_hook = logits_hook
        self.max_sessions = max_sessions
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queue_timeout_s = queue_timeout_s
        # Requests submitted and not yet admitted, beyond the free slots, at most max_queue (0 = none wait).
        self.max_queue = max_queue
        self._queued = 0  # submitted, not yet admitted for the first time nor ended (under _queue_lock)
        self._queue_lock = threading.Lock()
        self._mean_run_s = 0.0  # moving average of how long admitted sessions run (the retry hint)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Session] = collections.deque()
        self._running: dict[int, Session] = {}  # open or opening on the verifier
        self._ending: list[int] = []  # ended sessions still open on the verifier: Close in the next step
        self._inflight: collections.deque[_InFlight] = collections.deque()  # oldest first
        self._outbox: list[tuple[Session, RoundUpdate]] = []  # updates waiting for the next message sent
        self._growing: list[tuple[Session, list[int], Tensor]] = []  # prompt chunks for `_grow_contexts`
        self._ahead: list[_DraftAhead] = []  # the next step's draft steps, queued before it is built
        self._started: list[Session] = []  # sessions a reply's prompts just started (`_draft_started`)
        # An in-process verifier's results on the device, and a proposer that drafts from them:
        # the next draft step goes right behind each verify (`_draft_behind`).
        self._verified_on_device = getattr(link, "verified_on_device", None)
        self._propose_verified = getattr(proposer, "propose_verified", None)
        # It also takes the trees where the selection leaves them, on the device (`DeviceTrees`),
        # and a step's prompt chunks in a message of their own (`_send`).
        self._device_trees = bool(getattr(link, "takes_device_trees", False))
        self._prompts_apart = bool(getattr(link, "takes_prompts_apart", False))
        self._mixes_prompts = bool(getattr(link, "mixes_prompts", False))  # ... unless they ride the trees
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.steps = 0

    # -- called from any thread --------------------------------------------------------------

    def submit(self, prompt_ids: list[int], config: GenerationConfig, deliver: Callable[[Delivery], None],
               watches_text: bool = False) -> int:
        """Queue a request; returns its session id. `deliver` is called on the scheduler's thread;
        `watches_text`: it may return True to end the session (see `Delivery`)."""
        config.check()
        if config.mode.kind != "ar" and self.proposer is None:
            raise ValueError(f"draft mode {config.mode.kind!r} needs a draft model")
        stop_ids = frozenset(config.stop_token_ids) | (frozenset() if config.ignore_eos else self.eos_token_ids)
        held_back = len(stop_ids) if config.min_tokens else 0
        if len(config.logit_bias) + held_back > MAX_TOKEN_BIAS:
            raise ValueError(f"min_tokens holds back {held_back} stop and end-of-sequence ids, which with "
                             f"{len(config.logit_bias)} logit_bias entries exceed the {MAX_TOKEN_BIAS} biased tokens "
                             f"a request may have" if held_back else
                             f"logit_bias has {len(config.logit_bias)} entries, at most {MAX_TOKEN_BIAS}")
        with self._queue_lock:  # len() of the running dict is atomic: a snapshot of the free slots
            waiting = self._queued - max(0, self.max_sessions - len(self._running))
            if waiting >= self.max_queue:
                raise QueueFull(max(waiting, 0), self.retry_after_s(max(waiting, 0)))
            self._queued += 1
        sid = next(self._ids)
        session = Session(sid, list(prompt_ids), config, stop_ids, deliver,
                           time.monotonic() + self.queue_timeout_s, watches_text)
        self._commands.put(("submit", session))
        return sid

    def retry_after_s(self, waiting: int) -> float:
        """When a refused request may find room: how long the queue takes to drain at the recent
        session run time (waiting / slots x the mean run time), within [0.1 s, queue_timeout_s];
        1 s before any session has ended."""
        if self._mean_run_s <= 0:
            return min(1.0, self.queue_timeout_s)
        drain = self._mean_run_s * max(1, waiting) / self.max_sessions
        return max(0.1, min(drain, self.queue_timeout_s))

    def _dequeued(self, s: Session) -> None:
        """`s` leaves the queue bound: admitted for the first time, or ended while waiting."""
        if s.queued:
            s.queued = False
            with self._queue_lock:
                self._queued -= 1

    def cancel(self, sid: int, reason: str = "cancelled") -> None:
        """End a session after its current step; it is delivered its result with `reason` as the
        finish reason ("stop" for a stop string, else nobody is listening any more)."""
        self._commands.put(("cancel", sid, reason))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="draft-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; sessions still running get UNAVAILABLE, and the link is closed."""
        self._stopped.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        self._take_commands()
        error = StatusError("UNAVAILABLE", "the drafter is shutting down")
        for s in list(self._waiting) + list(self._running.values()):
            self._dequeued(s)
            self._fail(s, error)
        self._waiting.clear()
        self._running.clear()
        self.link.close()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        delay = 0.0
        while not self._stopped.is_set():
            if not (self._waiting or self._running or self._ending or self._inflight):
                self._flush_outbox()
                self._ahead = []  # its sessions are gone
                if not self._take_commands(block=True, timeout=self.probe_interval_s):  # idle: is it still there?
                    self._set_link(self.link.probe())
                continue
            try:
                progressed = self.step()
            except Exception:  # a bug: fail what is in flight rather than die silently
                log.exception("drafter step failed")
                self._fail_all(StatusError("INTERNAL", "internal error in the drafter; see its log"), link_lost=False)
                progressed = True
            if progressed:
                delay = 0.0
            else:  # only refused opens: wait for the verifier to free capacity
                self._flush_outbox()
                delay = min(max(2 * delay, 0.005), 0.25)
                self._take_commands(block=True, timeout=delay)

    def run_until_idle(self) -> None:
        """Run steps in this thread until every submitted session has been delivered its end."""
        while True:
            self._take_commands()
            if not (self._waiting or self._running or self._ending or self._inflight):
                self._flush_outbox()
                return
            if not self.step():
                self._flush_outbox()
                time.sleep(0.01)

    def _take_commands(self, block: bool = False, timeout: float | None = None) -> bool:
        """Take every queued command (waiting for the first one when `block`); False if there was none."""
        took = False
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return took
            block, took = False, True
            if command[0] == "submit":
                self._waiting.append(command[1])
            elif command[0] == "cancel":
                self._cancel(command[1], command[2])

    def _cancel(self, sid: int, reason: str) -> None:
        for s in self._waiting:
            if s.sid == sid:
                self._waiting.remove(s)
                self._dequeued(s)
                s.result.finish_reason = reason
                self._finish(s)
                return
        s = self._running.get(sid)
        if s is not None and not s.result.finish_reason:
            s.result.finish_reason = reason

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Send one link message, or read the reply of the oldest one in flight, or both;
        returns False when there was nothing to do.

        Lockstep (pipelining off, or fewer than `pipeline_min_sessions` sessions): each
        message's reply is read before the next is sent. Pipelined: up to `pipeline_groups`
        messages are in flight (two by default, each with about half of the running sessions),
        so the draft of one group overlaps the others' verification, its round trip included.
        Over a link that takes prompts apart (in process), a step's prompt chunks follow its
        trees in a message of their own, which holds no place among those, and requests that
        arrive while the host waits for a reply are opened at once (`_take_arrivals`).
        """
        self._take_commands()
        for s in [s for s in self._running.values() if s.result.finish_reason and not s.in_flight]:
            self._finish(s)  # cancelled meanwhile
        depth = self.pipeline_groups if self._pipelining() else 1
        sent = self._holding() < depth and self._send()
        while len(self._inflight) < depth + self.prefill_ahead and self._send_chunks_ahead():
            sent = True
        if self._inflight and (self._holding() >= depth or not sent):
            self._take_arrivals()
            if self._inflight:  # (a failed send clears it: `_link_failed`)
                self._receive()
            return True
        return sent

    def _holding(self) -> int:
        """Messages in flight that hold one of the `depth` places (prompts sent apart do not)."""
        return sum(1 for m in self._inflight if not m.apart)

    def _pipelining(self) -> bool:
        """Whether this step's message takes one group of the sessions. While no running session
        drafts (plain decoding only), the draft model leaves a shared GPU to the verifier, and a
        threshold above `PLAIN_PIPELINE_SESSIONS` gives way to it (on one H100 plain decoding gave
        1.15x lockstep's throughput pipelined at 32 sessions, where trees gave 1.02-1.04x less)."""
        need = self.pipeline_min_sessions
        if need > self.PLAIN_PIPELINE_SESSIONS and not any(s.drafts for s in self._running.values()):
            need = self.PLAIN_PIPELINE_SESSIONS
        return self.pipelined and len(self._running) + len(self._waiting) >= need

    def _send(self) -> bool:
        """Build and send one message: closes, opens, and trees for the ready sessions (all of
        them, or in pipelined mode about 1 / `pipeline_groups` of the running ones). False if it
        would be empty."""
        entries: list[Entry] = [CloseEntry(sid) for sid in self._ending]
        self._ending = []
        self._expire_waiting()
        self._prompt_tokens = 0
        chunking, chunks = self._prompt_chunks()
        entries += chunks
        ready = [s for s in self._running.values() if s.open_on_verifier and s.prompt_done and not s.in_flight]
        if self._pipelining() and ready:
            in_flight = sum(1 for s in self._running.values() if s.in_flight and s.open_on_verifier)
            total = len(ready) + in_flight
            ready = ready[: -(-total // self.pipeline_groups)]
        if not entries and not ready:
            return False
        if self._prompts_apart and chunks and ready and not self._prompts_ride(ready):
            # The trees first, their next draft step queued behind their verify, then the prompts:
            # their prefill runs on the device after that, and the trees' reply need not wait for
            # it, so the next message is built and queued while the device prefills.
            self._send_message(entries[: len(entries) - len(chunks)], [], ready)
            if not self._inflight:  # the link failed: the sessions recover (`_link_failed`)
                return True
            return self._send_message(chunks, chunking, [], apart=True)
        return self._send_message(entries, chunking, ready)

    def _prompts_ride(self, sessions) -> bool:
        """Whether prompt chunks go beside these sessions' trees, not apart from them, over a link that
        could take them apart: where its verifier takes chunks into the trees' verify and some of
        the sessions draft (plain decoding's root-only rows are too narrow for a prompt's)."""
        return self._mixes_prompts and any(s.drafts for s in sessions)

    def _take_arrivals(self) -> None:
        """Over a link that takes prompts apart (in process), while the oldest message, one of
        trees, is not due (`ARRIVALS_SHARE` of the shortest of the last few such round trips): open
        the sessions that arrive at once, their prompts (within what is left of the step's
        `prefill_chunk`) in a message of their own. It is queued behind the verify the host waits
        for, so their prefill runs before the next verify, and their first tokens come with the
        next reply read instead of a step later. A reply that comes sooner waits until it is due.
        Nothing waits while no session could open, nor where the arrivals ride the next message's
        trees (`_prompts_ride`)."""
        if not (self._prompts_apart and self._replies and self._inflight and self._inflight[0].trees) \
                or self._free_slots() <= 0:  # no arrival could open
            return
        if self._prompts_ride(self._running.values()):
            return
        due = self._inflight[0].rpc_started + self.ARRIVALS_SHARE * min(self._replies)
        while True:
            chunking, chunks = self._prompt_chunks(arrivals_only=True) if self._waiting else ([], [])
            if chunks:
                self._send_message(chunks, chunking, [], apart=True)
                if not self._inflight:  # the link failed: the sessions recover (`_link_failed`)
                    return
            left = due - time.perf_counter()
            if left <= 0 or not self._take_commands(block=True, timeout=left):
                return

    def _send_chunks_ahead(self) -> bool:
        """While no session decodes, send the next prompt chunks of sessions whose earlier chunks
        await their reply, in a message of their own (`prefill_ahead`). False if there are none."""
        if not self.prefill_ahead:
            return False
        chunking, entries = self._prompt_chunks(ahead_only=True)
        return bool(entries) and self._send_message(entries, chunking, [])

    def _send_message(self, entries: list[Entry], chunking: list[Session], ready: list[Session],
                      apart: bool = False) -> bool:
        """Draft the ready sessions' trees, add them to `entries` and send the message (`apart`:
        prompt chunks sent behind a message of trees)."""
        started = time.perf_counter()
        step_span = _tracer.start_span("draft_step", attributes={"sessions": len(ready)})
        with use_span(step_span, end_on_exit=False):
            rounds = self._round_spans(ready, step_span)
            drafted = self._trees(ready, rounds)
            entries += drafted.entries
            rpc_span = _tracer.start_span("verify_rpc")
        for s in chunking + ready:
            s.in_flight += 1
        message = _InFlight(chunking + ready, {s.sid: s.epoch for s in chunking + ready}, rounds, step_span,
                            rpc_span, started, drafted.budget, drafted.draft_s, drafted.build_s, apart=apart,
                            trees=len(ready))
        self._inflight.append(message)
        try:
            self.link.send(entries)
        except StatusError as exc:
            self._link_failed(exc)
        else:
            message.behind = self._draft_behind(drafted.drafted)
        self._flush_outbox()  # while the verifier works on the message
        return True

    def _receive(self) -> None:
        """Read the reply of the oldest message in flight and apply it."""
        message = self._inflight.popleft()
        try:
            results = self.link.receive(on_notice=functools.partial(self._notice, message.epochs))
        except StatusError as exc:
            message.end()
            self._link_failed(exc)
            return
        message.rpc_span.end()
        rpc_s = time.perf_counter() - message.rpc_started
        metrics.VERIFY_RPC.observe(rpc_s)
        if self.link.link_s > 0.0:
            metrics.LINK.observe(self.link.link_s)
        if message.trees:
            self._replies.append(rpc_s)
        ahead = (self._confirm_behind(message.behind, results, message.epochs) if message.behind is not None
                 else self._draft_ahead(results, message.epochs))
        verify_s = min(self.link.verifier_step_s, rpc_s)
        timing = (message.draft_s, message.build_s, verify_s, rpc_s - verify_s)
        for s in message.sessions:
            if s.epoch == message.epochs[s.sid]:
                s.in_flight -= 1
        self.steps += 1
        if not any(isinstance(r.outcome, LinkLost) for r in results):
            self._backoff = 0.0  # no session lost its verifier in this step
        self._set_link(self.link.up)
        with use_span(message.step_span, end_on_exit=True):
            self._apply(results, message.rounds, timing, message.epochs, ahead)
        now = time.perf_counter()
        if message.budget is not None:
            adapted = {s.sid for s in message.sessions if self._adapts(s)}
            accepted = sum(len(r.outcome.accepted_tokens) for r in results
                           if isinstance(r.outcome, Verified) and r.session_id in adapted)
            # What the step cost the pipeline: its own round trip, or with messages of trees in
            # flight side by side the time since the last one's reply (the round trip then also
            # holds the other messages' verifies, which grow with the budget too).
            self.planner.observe(message.budget, min(now - message.started, now - self._last_trees_reply), accepted)
            metrics.BUDGET_CALIBRATION.set(self.planner.alpha)
        if message.trees:
            self._last_trees_reply = now
        metrics.STEP.observe(now - message.started)

    def _adapts(self, s: Session) -> bool:
        """Whether the adaptive budget may cut this session's DDTree."""
        return s.config.mode.kind == "tree" and (s.config.sampling.greedy or self.adapt_sampled)

    def _set_link(self, up: bool) -> None:
        if up != self.link_up:
            self.link_up = up
            log.info("verifier link %s", "up" if up else "down")
            if self.on_link_state is not None:
                self.on_link_state(up)

    def _link_failed(self, exc: StatusError) -> None:
        """The link itself failed: every session on it is gone on the verifier, and recovers (`_recover`)."""
        log.warning("verifier link failed: %s: %s", exc.status, exc.message)
        self._set_link(False)
        for message in self._inflight:
            message.end()
        self._inflight.clear()
        self._ahead = []
        self._ending = []
        for s in reversed(list(self._running.values())):  # appendleft keeps their order
            self._recover(s, exc)
        self._back_off()

    def _recover(self, s: Session, exc: StatusError) -> None:
        """`s` is gone on its verifier (its link was lost). With a recovery timeout and an UNAVAILABLE
        loss it goes back to the front of the queue to re-open (prompt + tokens so far,
        `Session.open_prompt`) until its deadline, behind the backoff; otherwise it fails with `exc`."""
        s.open_on_verifier, s.in_flight = False, 0
        s.chunks_in_flight.clear()
        s.epoch += 1  # its messages still in flight, if any, are answered for nothing
        if s.result.finish_reason:
            self._finish(s)
            return
        if exc.status != "UNAVAILABLE" or self.recovery_timeout_s <= 0:
            self._fail(s, exc)
            return
        now = time.monotonic()
        s.lost_why = exc.message
        if s.recovery_deadline is None:
            # A request that has had no token yet counts from its arrival: it waits for a verifier
            # one --recovery-timeout in all, its time in the queue included.
            since = s.arrived if not s.result.tokens and s.first_token is None else now
            s.recovery_deadline, s.recovery_start = since + self.recovery_timeout_s, since
        if now >= s.recovery_deadline:
            self._fail(s, StatusError("UNAVAILABLE", f"verifier unavailable for {now - s.recovery_start:.0f} s: "
                                                     f"{exc.message}"))
            return
        self._end(s)
        s.admission_deadline = s.recovery_deadline
        self._waiting.appendleft(s)

    def _back_off(self) -> None:
        """After sessions lost their verifier, open none for a while (0.05 s, doubling up to 1 s)."""
        self._backoff = min(max(2 * self._backoff, 0.05), 1.0)
        self._retry_at = time.monotonic() + self._backoff

    def _prompt_chunks(self, ahead_only: bool = False, arrivals_only: bool = False
                       ) -> tuple[list[Session], list[Entry]]:
        """This step's prompt tokens, within its budget of them (`_prompt_budget`): the next chunk of each prompt
        already being prefilled (oldest first; while no session decodes, also of prompts whose
        earlier chunks await their reply, up to `prefill_ahead` chunks ahead), then, unless
        `ahead_only`, Open entries for waiting sessions admitted (each with its prompt's first
        chunk); `ahead_only` takes only prompts with a chunk in flight, `arrivals_only` only the
        opens, within what the step's earlier messages left of that budget. Returns the sessions
        and their entries."""
        decoding = any(s.prompt_done for s in self._running.values())
        budget = self._prompt_budget(decoding) - (self._prompt_tokens if arrivals_only else 0)
        ahead = 0 if decoding else self.prefill_ahead
        sessions, entries = [], []

        def take(s: Session) -> tuple[list[int], bool]:
            nonlocal budget
            n = int(min(len(s.chunk_prompt) - s.prompt_sent, budget))
            chunk = s.chunk_prompt[s.prompt_sent: s.prompt_sent + n]
            s.chunks_in_flight.append(n)
            s.prompt_sent += n
            budget -= n
            self._prompt_tokens += n
            sessions.append(s)
            return chunk, s.prompt_sent < len(s.chunk_prompt)

        for s in ([] if arrivals_only else self._running.values()):
            # Opened, or its open on the way, with chunks left to send and few enough in flight.
            if (s.chunks_in_flight or s.open_on_verifier and not ahead_only) and budget > 0 \
                    and s.prompt_sent < len(s.chunk_prompt) and len(s.chunks_in_flight) <= ahead \
                    and not s.result.finish_reason:
                chunk, more = take(s)
                entries.append(ExtendEntry(s.sid, chunk, more, traceparent_of(s.span)))
        for s in ([] if ahead_only else self._admit(budget)):
            s.epoch += 1  # replies to its messages before this admission are stale
            s.in_flight, s.chunks_in_flight, s.prompt_answered, s.first_token = 0, collections.deque(), 0, None
            s.chunk_prompt, s.prompt_sent, s.prompt_done = s.open_prompt(), 0, False
            chunk, more = take(s)
            entries.append(OpenEntry(s.sid, chunk, s.config.sampling, traceparent_of(s.span),
                                     self.feature_layer_ids if s.drafts else (),  # plain decoding needs no features
                                     s.config.logprobs, more, s.token_bias, output_start=len(s.prompt_ids)))
        return sessions, entries

    def _prompt_budget(self, decoding: bool) -> float:
        """Prompt tokens one step may take: `prefill_chunk` while a session decodes, else the larger
        of it and `prefill_chunk_idle`; no limit when `prefill_chunk` is 0."""
        if not self.prefill_chunk:
            return float("inf")
        return self.prefill_chunk if decoding else max(self.prefill_chunk, self.prefill_chunk_idle)

    def _admit(self, tokens: float = float("inf")) -> list[Session]:
        """Waiting sessions to open now: as many as free draft slots and the session limit allow,
        until their prompts hold `tokens` (the last one admitted may hold more: it is chunked)."""
        opening = []
        if time.monotonic() < self._retry_at:  # the link just failed: wait before opening again
            return opening
        free = self._free_slots()
        while self._waiting and free > 0 and tokens > 0:
            s = self._waiting.popleft()
            tokens -= len(s.open_prompt())
            self._running[s.sid] = s
            s.admitted = time.perf_counter()
            self._dequeued(s)
            opening.append(s)
            free -= 1
        return opening

    def _free_slots(self) -> int:
        """How many more sessions may open now: within `max_sessions` and the free draft slots."""
        free = self.max_sessions - len(self._running)
        if self.proposer is not None:
            free = min(free, self.proposer.free_slots - sum(1 for s in self._running.values() if s.draft_state is None
                                                          and s.drafts))
        return free

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for s in [s for s in self._waiting if s.admission_deadline < now]:
            self._waiting.remove(s)
            self._dequeued(s)
            if s.recovery_deadline is not None:
                self._fail(s, StatusError("UNAVAILABLE", f"verifier unavailable for {now - s.recovery_start:.0f} s: "
                                                         f"{s.lost_why}"))
            else:
                self._fail(s, StatusError("RESOURCE_EXHAUSTED",
                                          f"no verifier capacity within {self.queue_timeout_s:g} s"))

    def _round_spans(self, drafting: Sequence[Session], step_span) -> dict[int, trace.Span]:
        if not step_span.is_recording():
            return {}
        link = [trace.Link(step_span.get_span_context())]
        return {s.sid: _tracer.start_span("round", context=trace.set_span_in_context(s.span), links=link,
                                          attributes={"round": s.rounds + 1})
                for s in drafting if s.span.is_recording()}

    def _trees(self, drafting: Sequence[Session], rounds: dict[int, trace.Span]) -> _Drafted:
        """Draft every session that drafts and has room, in one batched step (taking the rows drafted
        ahead: `_block`); build all trees (under the adaptive budget's choice, when there is a
        planner)."""
        if not drafting:
            return _Drafted([])
        metrics.STEP_BATCH_SIZE.observe(len(drafting))
        rooms = [s.room() for s in drafting]
        busy = [i for i, s in enumerate(drafting) if s.drafts and rooms[i] > 0]
        trees: list[DraftTree | None] = [None] * len(drafting)  # None: a root-only tree (below)
        budget, draft_s, build_s = None, 0.0, 0.0
        if busy:
            sessions = [drafting[i] for i in busy]
            ahead, self._ahead = self._ahead, []
            start = time.perf_counter()
            with current_span(_tracer, "draft"):
                block, order, ahead_s = self._block(sessions, ahead)
                busy, sessions = [busy[j] for j in order], [sessions[j] for j in order]
                # The benchmark's edit: decided while the device drafts.
                edit = (self.logits_hook([s.prompt_ids for s in sessions], [s.result.tokens for s in sessions],
                                         self.proposer.block_size - 1) if self.logits_hook is not None else None)
                if edit is not None:
                    edit(block)
            for s in sessions:
                s.new_features = s.new_features[:0]
            drafted = time.perf_counter()
            draft_s = drafted - start + ahead_s
            metrics.DRAFT_STEP.observe(draft_s)
            with current_span(_tracer, "tree_build"):
                built = build_trees([s.config.mode for s in sessions], block, [s.root for s in sessions],
                                    [rooms[i] for i in busy], self.planner, len(drafting),
                                    [self._adapts(s) for s in sessions], on_device=self._device_trees,
                                    prior_gains=[s.gains for s in sessions],
                                    token_bias=[(s.token_bias, s.length + 1) for s in sessions],
                                    penalties=[(j, s.token_counts(block), s.config.sampling)
                                               for j, s in enumerate(sessions) if s.config.sampling.penalized])
                budget = built.choice
                if budget is not None:
                    trace.get_current_span().set_attribute("tree.budget", budget.budget)
                    metrics.TREE_BUDGET.observe(budget.budget)
            build_s = time.perf_counter() - drafted
            metrics.TREE_BUILD.observe(build_s)
            for i, s, tree, gains in zip(busy, sessions, built.trees, built.gains):
                trees[i] = tree
                if gains is not None:
                    s.gains = gains
        entries = []
        for s, tree in zip(drafting, trees):
            s.tree = tree = tree if tree is not None else DraftTree.root_only(s.root)
            span = rounds.get(s.sid)
            entries.append(TreeEntry(s.sid, s.rounds - s.round_base + 1, tree, traceparent_of(span) if span else ""))
        return _Drafted(entries, budget, draft_s, build_s, [drafting[i] for i in busy])

    def _block(self, sessions: Sequence[Session], ahead: Sequence[_DraftAhead]) -> tuple[Tensor, list[int], float]:
        """The sessions' block logits: the rows drafted ahead for them (in any of the blocks
        `ahead`), the others' drafted now. Returns the block, the sessions' order in it (indices
        into `sessions`) and the seconds the blocks drafted ahead that it uses took."""
        found: dict[int, list[tuple[int, int]]] = {}  # block index -> (session index, row), in session order
        missing = []
        for j, s in enumerate(sessions):
            hit = next(((k, row) for k, a in enumerate(ahead) if (row := a.row(s)) is not None), None)
            if hit is None:
                missing.append(j)
            else:
                found.setdefault(hit[0], []).append((j, hit[1]))
        fresh = None
        if missing:
            late = [sessions[j] for j in missing]
            fresh = self.proposer.propose([s.draft_state for s in late], [s.root for s in late],
                                          [s.new_tokens for s in late], [s.new_features for s in late])
        parts = [(ahead[k].block, [row for _, row in hits]) for k, hits in sorted(found.items())]
        order = [j for _, hits in sorted(found.items()) for j, _ in hits] + missing
        return join_blocks(parts, fresh), order, sum(ahead[k].seconds for k in found)

    def _draft_behind(self, sessions: Sequence[Session]) -> _DraftAhead | None:
        """With an in-process verifier: queue the next draft step of the sessions just drafted and
        sent right behind their verify, from its results on the device (`VerifiedRows`), before the
        host has read them. The device goes from the verify straight to the draft while the host
        waits for, reads and applies the reply; `_confirm_behind` keeps the rows of the sessions
        the reply lets go on. None when there is nothing to queue."""
        if self._verified_on_device is None or self._propose_verified is None or not sessions:
            return None
        verified = self._verified_on_device()
        if verified is None:
            return None
        index = {sid: i for i, sid in enumerate(verified.session_ids)}
        picked = [s for s in sessions if s.sid in index]
        if not picked:
            return None
        start = time.perf_counter()
        block = self._propose_verified([s.draft_state for s in picked], verified.rows([index[s.sid] for s in picked]))
        return _DraftAhead(block, {s.sid: (i, s.epoch, s.rounds + 1) for i, s in enumerate(picked)},
                           time.perf_counter() - start)

    def _confirm_behind(self, behind: _DraftAhead, results: Sequence[StepResult], epochs: dict[int, int]
                        ) -> frozenset[int]:
        """The sessions whose draft step queued behind their verify (`_draft_behind`) stands: their
        reply verified the tree and will be applied to them (as `_apply` sees it). Their contexts
        grow by their accepted paths; the other sessions' rows are dropped (their contexts are as
        they were: the rows written past them are overwritten later). Returns the sessions kept."""
        kept = {}
        for r in results:
            s, v, row = self._running.get(r.session_id), r.outcome, behind.rows.get(r.session_id)
            if row is None or s is None or not isinstance(v, Verified) or s.epoch != epochs.get(r.session_id):
                continue
            rows = len(v.accepted_tokens) + 1
            if v.features.shape[0] == rows:  # else `_verified` fails the session
                self.proposer.grow(s.draft_state, rows)
                kept[r.session_id] = row
        if kept:
            self._ahead.append(_DraftAhead(behind.block, kept, behind.seconds))
        return frozenset(kept)

    def _draft_started(self) -> None:
        """Queue the first draft step of the sessions a reply's prompts just started, as soon as
        their contexts hold the prompts (`_grow_contexts`): the device drafts while the host goes
        on with the reply and builds the next message, whose trees take these rows (`_block`)."""
        started = [s for s in self._started if self._running.get(s.sid) is s and s.draft_state is not None
                   and not s.result.finish_reason and s.room() > 0]
        self._started = []
        if not started:
            return
        start = time.perf_counter()
        block = self.proposer.propose([s.draft_state for s in started], [s.root for s in started],
                                      [s.new_tokens for s in started], [s.new_features for s in started])
        for s in started:
            s.new_features = s.new_features[:0]
        self._ahead.append(_DraftAhead(block, {s.sid: (i, s.epoch, s.rounds) for i, s in enumerate(started)},
                                       time.perf_counter() - start))

    def _draft_ahead(self, results: Sequence[StepResult], epochs: dict[int, int]) -> frozenset[int]:
        """Queue the next draft step of the sessions a reply verified before the reply is applied:
        the device drafts while the host applies it, delivers and schedules the next message, whose
        trees take these rows (`_block`). Left out: sessions this round ends or may end (no room
        left, a stop token, a receiver watching the text), or that `_verified` fails. Returns the
        sessions drafted; their new feature rows are in their draft context then."""
        if self.proposer is None:
            return frozenset()
        picked: list[tuple[Session, Verified, list[int]]] = []  # (session, result, its emitted tokens)
        for r in results:
            s, v = self._running.get(r.session_id), r.outcome
            if not isinstance(v, Verified) or s is None or s.epoch != epochs.get(r.session_id) or not s.drafts \
                    or s.draft_state is None or s.watches_text or s.result.finish_reason:
                continue
            emitted = v.accepted_tokens + [v.next_token]
            if v.features.shape[0] == len(emitted) and s.room(len(emitted)) > 0 \
                    and not any(t in s.stop_ids for t in emitted):
                picked.append((s, v, emitted))
        if not picked:
            return frozenset()
        start = time.perf_counter()
        block = self.proposer.propose([s.draft_state for s, _, _ in picked], [v.next_token for _, v, _ in picked],
                                      [emitted for _, _, emitted in picked], [v.features for _, v, _ in picked])
        self._ahead.append(_DraftAhead(block, {s.sid: (i, s.epoch, s.rounds + 1) for i, (s, _, _) in enumerate(picked)},
                                       time.perf_counter() - start))
        return frozenset(s.sid for s, _, _ in picked)

    def _apply(self, results: Sequence[StepResult], rounds: dict[int, trace.Span],
               timing: tuple[float, float, float, float], epochs: dict[int, int],
               ahead: frozenset[int] = frozenset()) -> None:
        """Hand every result to its session; `timing` (draft, build, verify, network seconds) is the step's.
        A result for a session that ended, or was admitted again since (`epochs`: its epoch when the
        message went), is dropped. Sessions whose verifier was lost under them (LinkLost: one replica
        of several) recover. `ahead`: the sessions drafted ahead of this reply (`_draft_ahead`)."""
        lost = []
        for r in results:
            s = self._running.get(r.session_id)
            span = rounds.pop(r.session_id, None)
            if s is None or s.epoch != epochs.get(r.session_id, s.epoch):
                if span is not None:
                    span.end()
                continue
            o = r.outcome
            if isinstance(o, LinkLost):
                lost.append((s, o))
            elif isinstance(o, StatusError):
                s.open_on_verifier = False
                if o.status == "RESOURCE_EXHAUSTED" and (s.recovery_deadline is not None or s.rounds == 0
                                                         and not s.result.tokens) \
                        and time.monotonic() < s.admission_deadline:
                    del self._running[s.sid]  # the verifier is full: retry the open (or re-open) later
                    s.epoch += 1  # a prompt chunk sent ahead of this reply is answered for nothing
                    self._waiting.appendleft(s)
                else:
                    self._fail(s, o)
            elif isinstance(o, Prefilled):
                self._prefilled(s, o)
            elif isinstance(o, Extended):
                self._extended(s, o)
            else:
                self._verified(s, o, span, timing, s.sid in ahead)
            if span is not None:
                span.end()
        for span in rounds.values():
            span.end()
        self._grow_contexts()
        self._draft_started()
        for s, o in reversed(lost):  # appendleft keeps their order
            self._recover(s, o)
        if lost:
            self._back_off()

    def _notice(self, epochs: dict[int, int], results: Sequence[StepResult]) -> None:
        """First tokens ahead of the reply that completes their prompts (a notice; the reply has
        them again, with the prompts' features): they go to the clients now. A session that its
        first token ends is finished when that reply comes (its entry is still in flight)."""
        for r in results:
            s = self._running.get(r.session_id)
            p = r.outcome
            if s is None or s.epoch != epochs.get(r.session_id) or s.result.finish_reason or s.first_token is not None \
                    or (s.config.logprobs is not None and (p.logprobs is None or len(p.logprobs) != 1)):
                continue  # stale, ending, or not as asked for: the reply tells
            self._first_token_out(s, p.token, p.logprobs)

    def _first_token_out(self, s: Session, token: int, logprobs: list | None) -> None:
        """Send a prompt's first token to the client (the session is not finished here)."""
        if not s.result.tokens:  # the request's first token: its wait for the admission that made it, once
            metrics.QUEUE_WAIT.observe(s.admitted - s.start)
            s.result.time_to_first_token_s = time.perf_counter() - s.start
        if s.recovery_deadline is not None:  # re-opened after a lost verifier: carry on
            log.info("session %d re-opened after %d tokens, %.2f s after its verifier was lost (%s)", s.sid,
                     len(s.result.tokens), time.monotonic() - s.recovery_start, s.lost_why)
            s.recovery_deadline = None
        s.first_token = token
        self._hand(s, s.emit(s.rounds, [token], logprobs))

    def _extended(self, s: Session, e: Extended) -> None:
        """A chunk of the session's prompt is prefilled, more are to come (chunked prefill)."""
        s.open_on_verifier = True
        self._context_grows(s, e.features)

    def _context_grows(self, s: Session, features) -> None:
        """The oldest prompt chunk in flight is answered: its features are to extend the session's
        draft context (its first chunk takes a context slot), with the other chunks the reply
        answers once it is applied (`_grow_contexts`)."""
        start = s.prompt_answered
        n = s.chunks_in_flight.popleft() if s.chunks_in_flight else 0
        s.prompt_answered += n
        if not s.drafts or s.result.finish_reason:  # no draft, or ending anyway
            return
        if features.shape[0] != n:
            self._fail(s, StatusError("INTERNAL", f"verifier sent {features.shape[0]} feature rows for a "
                                                  f"{n}-token prompt chunk"))
            return
        self._growing.append((s, s.chunk_prompt[start: start + n], features))

    def _grow_contexts(self) -> None:
        """The prompt chunks a reply answered into their sessions' draft contexts, in one batched
        call (`BlockProposer.take_prompts`: the draft's launches once per reply, not per session);
        a session whose context cannot take its chunk fails."""
        growing = [item for item in self._growing
                   if self._running.get(item[0].sid) is item[0] and not item[0].result.finish_reason]
        self._growing = []
        if not growing:
            return
        states = self.proposer.take_prompts([s.draft_state for s, _, _ in growing], [ids for _, ids, _ in growing],
                                            [f for _, _, f in growing])
        for (s, _, _), state in zip(growing, states, strict=True):
            if isinstance(state, Exception):
                self._fail(s, state if isinstance(state, StatusError) else StatusError("INVALID_ARGUMENT", str(state)))
            else:
                s.draft_state = state

    def _prefilled(self, s: Session, p: Prefilled) -> None:
        """The prompt is prefilled: the first token goes to the client at once (unless a notice
        brought it already), then the last chunk's features extend the draft context."""
        s.open_on_verifier = True
        early, s.first_token = s.first_token, None
        if early is None:
            if self._lacks_logprobs(s, p.logprobs, 1):
                return
            self._first_token_out(s, p.token, p.logprobs)  # round 0, or the last one before a re-open
        elif p.token != early:
            self._fail(s, StatusError("INTERNAL", f"verifier's first token {p.token} differs from its notice's {early}"))
            return
        if s.result.finish_reason:  # ended by its first token (or cancelled meanwhile)
            self._finish(s)
            return
        s.prompt_done = True
        s.max_seq_len, s.length, s.root = p.max_seq_len, len(s.chunk_prompt), p.token
        s.round_base = s.rounds
        self._context_grows(s, p.features)
        if s.drafts:
            s.new_tokens, s.new_features = [p.token], p.features[:0]
            self._started.append(s)

    def _verified(self, s: Session, v: Verified, span: trace.Span | None,
                  timing: tuple[float, float, float, float], drafted_ahead: bool = False) -> None:
        """A verified round: its tokens to the session, its features to the next draft step (unless
        that was queued already: `drafted_ahead`)."""
        emitted = v.accepted_tokens + [v.next_token]
        if s.drafts and v.features.shape[0] != len(emitted):
            self._fail(s, StatusError("INTERNAL", f"verifier sent {v.features.shape[0]} feature rows for "
                                                  f"{len(emitted)} tokens"))
            return
        if self._lacks_logprobs(s, v.logprobs, len(emitted)):
            return
        s.rounds += 1
        s.length += len(emitted)
        s.result.acceptance_lengths.append(len(emitted))
        s.result.round_stats.append(RoundStats(len(emitted), s.tree.num_nodes, *timing))
        s.root, s.new_tokens, s.new_features = v.next_token, emitted, v.features[:0] if drafted_ahead else v.features
        if isinstance(s.tree, DeviceTree):
            s.gains = s.tree.gains
        if span is not None:
            span.set_attributes({"tree.nodes": s.tree.num_nodes, "accepted": len(v.accepted_tokens)})
        cancelled = bool(s.result.finish_reason)  # ended while this step was in flight: drop its tokens
        if not cancelled:
            self._deliver(s, s.emit(s.rounds, emitted, v.logprobs, s.tree.num_nodes))
        if not s.result.finish_reason and s.max_seq_len - s.length - 1 < 0:
            s.result.finish_reason = "length"

    def _lacks_logprobs(self, s: Session, logprobs: list | None, tokens: int) -> bool:
        """Fail the session (True) when it asks for logprobs and the verifier sent none for its tokens."""
        if s.config.logprobs is None or (logprobs is not None and len(logprobs) == tokens):
            return False
        self._fail(s, StatusError("INTERNAL", f"verifier sent {len(logprobs or ())} logprobs for {tokens} tokens"))
        return True

    def _deliver(self, s: Session, update: RoundUpdate) -> None:
        """A verified round's tokens: into the outbox while the session goes on, at once (then its
        result, if this round ended it) when this round ended it or its receiver watches the text."""
        if not (s.result.finish_reason or s.watches_text):
            self._outbox.append((s, update))
            s.undelivered += 1
            return
        self._hand(s, update)
        if s.result.finish_reason:
            self._finish(s)

    def _flush_outbox(self) -> None:
        """Deliver the waiting updates; a session whose receiver matched a stop string in them ends
        ("stop") once its step in flight, if any, is answered."""
        outbox, self._outbox = self._outbox, []
        for s, update in outbox:
            s.undelivered -= 1
            self._hand(s, update)

    def _hand(self, s: Session, item: Delivery) -> None:
        """Deliver `item` now, after the session's updates still in the outbox; a receiver that
        answers True to an update ends the session ("stop": it matched a stop string)."""
        if s.undelivered:
            self._flush_outbox()
        if s.deliver(item) is True and isinstance(item, RoundUpdate) and not s.result.finish_reason:
            s.result.finish_reason = "stop"

    # -- endings ----------------------------------------------------------------------------

    def _end(self, s: Session) -> None:
        """Take an ended session off the running set, free its draft slot, queue its Close."""
        self._running.pop(s.sid, None)
        if s.draft_state is not None:
            state, s.draft_state = s.draft_state, None
            self.proposer.finish(state)
        if s.open_on_verifier:
            s.open_on_verifier = False
            self._ending.append(s.sid)
        s.result.elapsed_s = time.perf_counter() - s.start
        if s.admitted:
            run, s.admitted = time.perf_counter() - s.admitted, 0.0
            self._mean_run_s = run if self._mean_run_s <= 0 else 0.9 * self._mean_run_s + 0.1 * run

    def _finish(self, s: Session) -> None:
        """Deliver the result of a session that ended normally (or was cancelled)."""
        self._end(s)
        s.span.set_attributes({"completion.tokens": len(s.result.tokens), "rounds": s.result.rounds,
                               "mean_acceptance": s.result.mean_acceptance, "finish_reason": s.result.finish_reason})
        s.span.end()
        self._hand(s, s.result)

    def _fail(self, s: Session, error: StatusError) -> None:
        """Deliver an error; a session the verifier still holds is closed there."""
        self._end(s)
        s.span.record_exception(error)
        s.span.set_status(trace.Status(trace.StatusCode.ERROR, error.message))
        s.span.end()
        self._hand(s, error)

    def _fail_all(self, error: StatusError, link_lost: bool = True) -> None:
        """Fail every running session. When the link failed they are gone on the verifier too;
        otherwise their Close entries go in the next step."""
        for s in list(self._running.values()):
            if link_lost:
                s.open_on_verifier = False
            self._fail(s, error)
        self._running.clear()
        if link_lost:
            self._ending = []
