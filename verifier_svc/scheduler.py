"""The model worker: one thread that owns the `TreeVerifier` and runs every session's jobs.

gRPC handlers run on the asyncio event loop and must never wait on the model, or one slow
forward would stall every stream. So a handler turns each message into a job (open,
verify or close), puts it on the worker's queue and awaits an asyncio future; the worker
thread runs the job and resolves the future through `loop.call_soon_threadsafe`.

When the worker is idle and nothing is queued, a handler runs a verify job right away on the
event loop's thread instead (`_submit`): the hand-off to another thread and back costs a few
tenths of a millisecond per round, several percent of a decoding round. Prefills (long for
long prompts) always go to the worker, so they never hold up the loop. Only one job runs at a
time either way (`_busy`), and a session never has two jobs pending, so its jobs keep their
order.

The worker's loop takes *all* pending jobs at once and dispatches them. Today it runs them
one forward each, in arrival order; batching several sessions' trees into one forward only
changes `_dispatch` (see the comment there), not the handlers or the queue.

Jobs run inside tracing spans (`prefill` / `verify`, with `forward`, `sample`, `commit`
children) parented to the drafter's span named by the message's `traceparent`, and they
return wire-ready replies, so the encoding (a device-to-host copy) stays off the loop too.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams
from common.rpc import pb
from common.tracing import context_from_traceparent, tracer
from common.tree import DraftTree
from common.wire import encode_tensor
from verifier_svc.tree_verifier import TreeVerifier, VerifierError

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class SessionHandle:
    """One stream's session as the worker knows it.

    `session_id` is written only by the worker thread (by the open job). Because the queue
    is FIFO and there is one worker, a close job queued after an open job always sees the
    id that open assigned, even if the handler was cancelled while the open was running.
    """

    def __init__(self) -> None:
        self.session_id: int | None = None
        self.closed = False  # set on the event loop when the close job is queued

    @property
    def is_open(self) -> bool:
        return self.session_id is not None and not self.closed


@dataclass
class OpenJob:
    handle: SessionHandle
    prompt_ids: list[int]
    sampling: SamplingParams
    traceparent: str
    bytes_received: int


@dataclass
class VerifyJob:
    handle: SessionHandle
    tree: DraftTree
    round: int
    traceparent: str
    bytes_received: int


@dataclass
class CloseJob:
    handle: SessionHandle


Job = OpenJob | VerifyJob | CloseJob

_WAKE = None  # queued by stop() to wake the thread


class ModelWorker:
    """Runs jobs for all sessions on one thread; async methods are called from the event loop."""

    def __init__(self, verifier: TreeVerifier, name: str = "model-worker"):
        self.verifier = verifier
        self._queue: queue.SimpleQueue[tuple[Job, asyncio.Future | None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against stop()
        self._busy = threading.Lock()  # held while a job runs, on whichever thread runs it
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Spans of model steps measure device time: wait for the device before they end.
        cuda = verifier.runner.device.type == "cuda"
        self._sync = torch.cuda.synchronize if cuda else None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the running job, then fail everything still queued with UNAVAILABLE.

        Blocks until the thread ends; call it from a worker thread (`asyncio.to_thread`)
        when on the event loop.
        """
        with self._lock:
            self._stopped = True
            self._queue.put(_WAKE)
        self._thread.join(timeout)
        for _, future in self._drain():
            self._fail_unavailable(future)

    @property
    def free_sessions(self) -> int:
        """Free KV slots. Read without the worker: a list length, atomic under the GIL."""
        return self.verifier.free_capacity

    # -- called on the event loop ------------------------------------------------------------

    async def open(self, job: OpenJob) -> pb.VerifierMessage:
        """Prefill; the reply carries `Prefilled`. Raises VerifierError."""
        return await self._submit(job)

    async def verify(self, job: VerifyJob) -> pb.VerifierMessage:
        """Verify one tree; the reply carries `Verified`. Raises VerifierError."""
        return await self._submit(job)

    def close(self, handle: SessionHandle) -> None:
        """Free the session's KV slot (queued, not awaited); repeated calls are no-ops."""
        if handle.closed:
            return
        handle.closed = True
        with self._lock:
            if not self._stopped:
                self._queue.put((CloseJob(handle), None))

    def _submit(self, job: Job) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopped:
                future.set_exception(VerifierError("UNAVAILABLE", "the verifier is shutting down"))
                return future
            inline = isinstance(job, VerifyJob) and self._queue.empty() and self._busy.acquire(blocking=False)
            if not inline:
                self._queue.put((job, future))
                return future
        try:  # idle worker, empty queue: run it here (blocks the loop for one job, as the GPU would anyway)
            self._execute(job, future)
        finally:
            self._busy.release()
        return future

    # -- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._dispatch(self._take_pending())

    def _take_pending(self) -> list[tuple[Job, asyncio.Future | None]]:
        """Block for one job, then take every other job already queued."""
        first = self._queue.get()
        return ([] if first is _WAKE else [first]) + list(self._drain())

    def _drain(self) -> Iterator[tuple[Job, asyncio.Future | None]]:
        """The queued jobs, without blocking (wake-ups skipped)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _WAKE:
                yield item

    def _dispatch(self, jobs: list[tuple[Job, asyncio.Future | None]]) -> None:
        # Batching goes here: pick out the VerifyJobs of distinct sessions and run their
        # trees as one forward (padded to a common node count), then sample and commit each.
        # Keep each session's jobs in arrival order: its Close must run after its Open.
        # For now, one job per forward, in arrival order.
        for job, future in jobs:
            if self._stopped:
                self._fail_unavailable(future)
            else:
                with self._busy:
                    self._execute(job, future)

    def _execute(self, job: Job, future: asyncio.Future | None) -> None:
        try:
            if isinstance(job, OpenJob):
                result = self._open(job)
            elif isinstance(job, VerifyJob):
                result = self._verify(job)
            else:
                result = self._close(job)
        except VerifierError as exc:
            _resolve(future, error=exc)
        except Exception:
            log.exception("model worker: %s failed", type(job).__name__)
            _resolve(future, error=VerifierError("INTERNAL", f"internal error in the verifier ({type(job).__name__})"))
        else:
            _resolve(future, result=result)

    def _open(self, job: OpenJob) -> pb.VerifierMessage:
        if job.handle.closed:  # the stream went away before its turn: skip the prefill
            raise VerifierError("CANCELLED", "the session was closed before it opened")
        parent = context_from_traceparent(job.traceparent)
        with _tracer.start_as_current_span("prefill", context=parent) as span:
            span.set_attributes({"prompt.tokens": len(job.prompt_ids), "bytes.received": job.bytes_received})
            session_id, prefilled = self.verifier.open(job.prompt_ids, job.sampling, stage=self._stage)
            job.handle.session_id = session_id
            reply = pb.VerifierMessage(prefilled=pb.Prefilled(
                token=prefilled.token, features=encode_tensor(prefilled.features),
                max_seq_len=prefilled.max_seq_len))
            span.set_attribute("bytes.sent", reply.ByteSize())
            return reply

    def _verify(self, job: VerifyJob) -> pb.VerifierMessage:
        if not job.handle.is_open:
            raise VerifierError("FAILED_PRECONDITION", "the session is not open")
        parent = context_from_traceparent(job.traceparent)
        with _tracer.start_as_current_span("verify", context=parent) as span:
            span.set_attributes({"round": job.round, "tree.nodes": job.tree.num_nodes,
                                 "bytes.received": job.bytes_received})
            verified = self.verifier.verify(job.handle.session_id, job.tree, stage=self._stage)
            reply = pb.VerifierMessage(verified=pb.Verified(
                round=job.round, accepted_tokens=verified.accepted_tokens, next_token=verified.next_token,
                features=encode_tensor(verified.features)))
            span.set_attributes({"accepted": len(verified.accepted_tokens), "bytes.sent": reply.ByteSize()})
            return reply

    def _close(self, job: CloseJob) -> None:
        if job.handle.session_id is not None:
            self.verifier.close(job.handle.session_id)

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        """A child span for one model step (the TreeVerifier's `stage` hook)."""
        with _tracer.start_as_current_span(name) as span:
            yield
            if self._sync is not None and span.is_recording():
                self._sync()

    @staticmethod
    def _fail_unavailable(future: asyncio.Future | None) -> None:
        _resolve(future, error=VerifierError("UNAVAILABLE", "the verifier is shutting down"))


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

    loop = future.get_loop()
    if _running_loop() is loop:  # a job run inline on the loop's own thread
        settle()
        return
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
