"""The drafter's side of the verifier link: messages of entries up, results down, in order.

`GrpcLink` is one long-lived bidirectional `Link` stream to a verifier, driven from the
scheduler's thread: `send` sends one LinkRequest, `receive` reads the LinkResponse of the
oldest unanswered one (replies come in order), so the scheduler may keep two messages in
flight (pipelining); `step` is the two in a row. It checks
what comes back before any of it reaches the draft model: one result per open and tree
entry, in order, for the same sessions; token ids inside the vocabulary; feature rows that
add up, of the draft's width. A reply that completes prompts may come after a notice of their
first tokens (without the features, which follow in the reply): `receive` hands it to its
`on_notice` while it waits for the reply. A broken stream raises `StatusError` (every session
on it is lost); the next step opens a new stream. `LocalLink` is the in-process twin over a
`TreeVerifier`, for the local engine and tests. `check_verifier` is the start-up check.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from common import metrics
from common.config import DraftConfig, TargetConfig
from common import socket_link
from common.feature_ring import RingError, RingOffer, RingReader
from common.feature_wire import FORMATS, FeatureReader
from common.protocol import (CloseEntry, Entry, Extended, ExtendEntry, OpenEntry, Prefilled, StatusError, StepResult,
                             TreeEntry, Verified, VerifiedRows)
from common.rpc import CHANNEL_OPTIONS, decode_message, pb, pb_grpc
from common.tls import ChannelTls
from common.tls import open_channel as open_tls_channel
from common.wire import WireError, decode_link_response, encode_link_request, parse_link_response, tensor_bytes

log = logging.getLogger(__name__)
_END = object()
# Takes a notice's results: Prefilled results, without their features, of the message being received.
OnNotice = Callable[[list[StepResult]], None]
# A verifier that comes back is dialled again within a second (gRPC's own backoff grows to 2 minutes).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
# A reply carries megabytes of features. gRPC's default flow control sizes the stream's window
# from the measured bandwidth-delay product, tiny on a fast link, so such a reply crossed in many
# window updates (about 2 ms of a 1.8 MB reply's write, loopback); a fixed 8 MiB window lets it
# go at once, and covers 1.6 GB/s at a 5 ms round trip.
FLOW_OPTIONS = [("grpc.http2.lookahead_bytes", 8 << 20), ("grpc.http2.bdp_probe", 0)]
# A reply this late: ask the verifier for its Info (in PROBE_TIMEOUT_S); one that does not answer
# is lost. gRPC's keepalive alone took 80 s to notice a verifier that was stopped (SIGSTOP) or a
# link that stalled, and never noticed a 45 s stall, while its sessions froze. One that answers
# (a long prefill) is waited for again.
STALL_PROBE_S = 5.0
PROBE_TIMEOUT_S = 2.0
# After the verifier closes a socket link, how long its stream gets to say why (the status it ended the link with).
SOCKET_END_WAIT_S = 2.0
LINK_METHOD = "/ddtree.v1.Verifier/Link"


class VerifierLink(Protocol):
    """One verifier. `send` queues a message, `receive` returns the results of the oldest
    unanswered one; both raise StatusError when the link itself fails."""

    verifier_step_s: float  # the verifier's step that answered the last message received (0: unknown)
    # That message's own time on the link: gRPC both ways and the encoding and decoding at both
    # ends, i.e. its round trip to its reply's arrival less the time the verifier held it
    # (`LinkResponse.held_seconds`), plus the reply's decoding (0: unknown, or no wire in between).
    link_s: float
    up: bool  # False once the link knows that no verifier answers (a failure that raised says so itself)

    def send(self, entries: Sequence[Entry]) -> None: ...

    def receive(self, on_notice: OnNotice | None = None) -> list[StepResult]:
        """The results of the oldest unanswered message; first tokens that come ahead of them
        (a notice: Prefilled results without features, checked) go to `on_notice` meanwhile."""
        ...

    def step(self, entries: Sequence[Entry]) -> list[StepResult]: ...

    def probe(self) -> bool:
        """Whether the verifier answers now (a cheap call, outside any stream)."""
        ...

    def close(self) -> None: ...

    # An in-process link also offers `verified_on_device()`: the last message's verify results
    # while still on the device (`LocalLink`), for the next draft step to be queued behind it.


class _Lockstep:
    """What a link to one verifier shares: its failures raise, so it counts as `up` otherwise."""

    up = True

    def step(self, entries: Sequence[Entry]) -> list[StepResult]:
        """Send one message and wait for its reply (nothing else in flight)."""
        self.send(entries)
        return self.receive()


def open_channel(address: str, tls: ChannelTls | None = None) -> grpc.Channel:
    """The channel to a verifier: plaintext, or TLS / mutual TLS per `tls` (`--verifier-ca`, ...)."""
    return open_tls_channel(address, tls, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, *FLOW_OPTIONS])


def verifier_stub(channel: grpc.Channel) -> pb_grpc.VerifierStub:
    """The verifier's stub, its Link stream carrying raw bytes both ways: `GrpcLink` serializes
    and parses the messages itself, so it knows their sizes without encoding them twice
    (protobuf's ByteSize serializes the message to count it: a copy of megabytes per reply)."""
    stub = pb_grpc.VerifierStub(channel)
    stub.Link = channel.stream_stream(LINK_METHOD)
    return stub


def connect_error(stub: pb_grpc.VerifierStub, exc: grpc.RpcError) -> grpc.RpcError:
    """Why the verifier does not answer: a call that does not wait for the connection reports
    its last error (refused, a failed TLS handshake, ...) where a waiting one, `exc`, only says
    that its deadline passed."""
    try:
        stub.Info(pb.InfoRequest(), timeout=2.0)
    except grpc.RpcError as fresh:
        return fresh
    return exc


def status_error(exc: grpc.RpcError) -> StatusError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return StatusError(code.name, f"verifier: {details}")


def check_results(entries: Sequence[Entry], results: Sequence[StepResult]) -> None:
    """Raise StatusError(INTERNAL) unless `results` answer the open, extend and tree entries one
    by one (a prompt chunk with more to come by an Extended, the last by the Prefilled), and
    every Verified fits the tree it answers."""
    asked = [e for e in entries if not isinstance(e, CloseEntry)]
    if [r.session_id for r in results] != [e.session_id for e in asked]:
        raise StatusError("INTERNAL", f"verifier answered sessions {[r.session_id for r in results][:8]}, "
                                      f"expected {[e.session_id for e in asked][:8]}")
    for e, r in zip(asked, results):
        chunk = isinstance(e, (OpenEntry, ExtendEntry))
        if isinstance(r.outcome, Prefilled) and not (chunk and not e.more):
            raise StatusError("INTERNAL", f"verifier sent a Prefilled that answers no open of session {e.session_id}")
        if isinstance(r.outcome, Extended) and not (chunk and e.more):
            raise StatusError("INTERNAL", f"verifier sent an Extended that answers no prompt chunk of session "
                                          f"{e.session_id}")
        if isinstance(r.outcome, Verified):
            if not isinstance(e, TreeEntry) or r.outcome.round != e.round:
                raise StatusError("INTERNAL", f"verifier sent a Verified that answers no tree of session {e.session_id}")
            if len(r.outcome.accepted_tokens) >= e.tree.num_nodes:
                raise StatusError("INTERNAL", f"verifier accepted {len(r.outcome.accepted_tokens)} tokens of a "
                                              f"{e.tree.num_nodes}-node tree")


def check_notice(entries: Sequence[Entry], results: Sequence[StepResult]) -> None:
    """Raise StatusError(INTERNAL) unless a notice's `results` are Prefilled results without
    features, each for a different session whose last prompt chunk is among `entries`."""
    last_chunks = {e.session_id for e in entries if isinstance(e, (OpenEntry, ExtendEntry)) and not e.more}
    seen = set()
    for r in results:
        if not isinstance(r.outcome, Prefilled) or r.outcome.features.shape[0]:
            raise StatusError("INTERNAL", f"a notice may hold only first tokens, not a {type(r.outcome).__name__} "
                                          f"for session {r.session_id}")
        if r.session_id not in last_chunks or r.session_id in seen:
            raise StatusError("INTERNAL", f"a notice for session {r.session_id}, which the message does not end "
                                          "the prompt of (or twice)")
        seen.add(r.session_id)


def _seconds(value: float) -> float:
    """A time the verifier reports, used only in statistics: a bad value becomes unknown (0)."""
    return value if math.isfinite(value) and 0.0 <= value < 3600.0 else 0.0


def _read_replies(call, replies: queue.SimpleQueue) -> None:
    """A link stream's reader thread: each reply's bytes and the time they arrived, as they come
    (the scheduler may be drafting then: the link's time is measured to the arrival, not to the
    read), then a StatusError saying why the stream ended."""
    try:
        for data in call:
            replies.put((data, time.perf_counter()))
        replies.put(StatusError("UNAVAILABLE", "verifier closed the link"))
    except grpc.RpcError as exc:
        replies.put(status_error(exc))
    except Exception as exc:  # noqa: BLE001 (whatever ends the stream ends the link, with a status)
        replies.put(StatusError("UNAVAILABLE", f"verifier link failed: {exc}"))


class GrpcLink(_Lockstep):
    """A verifier behind gRPC (implements `VerifierLink`); `stub` comes from `verifier_stub`."""

    def __init__(self, stub: pb_grpc.VerifierStub, *, vocab_size: int, feature_dim: int, max_seq_len: int,
                 features: FeatureReader = FeatureReader(), feature_ring: bool = True, unix_socket: bool = False):
        """`features`: how the replies' feature rows are read (`common.feature_wire.feature_reader`:
        packed or not, and brought to the draft's device). `feature_ring`: ask each stream's verifier
        for a shared-memory ring for them (`common.feature_ring`; used where this host reaches it).
        `unix_socket`: ask each stream's verifier, in a hello, for a Unix socket for the messages
        (`common.socket_link`; used where this host reaches it)."""
        self.stub = stub
        self.vocab_size, self.feature_dim, self.max_seq_len = vocab_size, feature_dim, max_seq_len
        self.features = features
        # Rows read out of the ring are copied out before it is released: to the draft's device, or a copy.
        self._ring_features = FeatureReader(features.packed, features.to_draft or torch.Tensor.clone)
        self.feature_ring = feature_ring
        self.unix_socket = unix_socket
        self._socket = None  # this stream's socket link (connected), once taken
        self._early: collections.deque[tuple[bytes, float]] = collections.deque()  # replies read while sending
        self._ring: RingReader | None = None  # this stream's ring, mapped
        self._ring_ask = self._ring_offered = self._ring_refuse = False
        self._requests: queue.SimpleQueue | None = None
        self._call = None
        self._replies = None
        self._steps = 0
        # (step, entries, when it was sent) of each message not yet answered, oldest first
        self._unanswered: collections.deque[tuple[int, Sequence[Entry], float]] = collections.deque()
        self._lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0
        self.verifier_step_s = self.link_s = 0.0
        self.probe_error = ""  # why the last probe failed

    def _connect(self) -> None:
        self._requests = queue.SimpleQueue()
        self._call = self.stub.Link(iter(self._requests.get, _END))
        self._replies = queue.SimpleQueue()
        self._ring, self._ring_ask, self._ring_offered, self._ring_refuse = None, self.feature_ring, False, False
        threading.Thread(target=_read_replies, args=(self._call, self._replies), name="verifier-link-reader",
                         daemon=True).start()
        if self.unix_socket:
            self._hello()

    def _hello(self) -> None:
        """The stream's first message: ask for a socket link (`common.socket_link`), and take the one
        offered where this host reaches it. Raises StatusError when the stream fails meanwhile."""
        self._requests.put(pb.LinkRequest(step=0, unix_socket=True).SerializeToString())
        try:
            item = self._replies.get(timeout=STALL_PROBE_S)
        except queue.Empty:
            item = StatusError("UNAVAILABLE", f"the verifier did not answer the link's hello in {STALL_PROBE_S:g} s")
        if not isinstance(item, StatusError):
            try:
                reply = decode_message(pb.LinkResponse, item[0])
                if reply.step != 0 or reply.results:
                    raise ValueError(f"step {reply.step} with {len(reply.results)} results answers the link's hello")
            except ValueError as exc:
                item = StatusError("INTERNAL", f"bad reply from the verifier: {exc}")
        if isinstance(item, StatusError):
            self._drop()
            raise item
        if not reply.HasField("unix_socket"):
            return
        offer = socket_link.SocketOffer(reply.unix_socket.path, reply.unix_socket.nonce)
        try:
            self._socket = socket_link.connect(offer, PROBE_TIMEOUT_S)
        except (OSError, socket_link.SocketLinkError) as exc:  # another host, user or container: the stream it is
            log.info("the verifier's Unix socket is not reachable from here (%s); the link's messages go through "
                     "gRPC", exc)
            return
        self._socket.settimeout(STALL_PROBE_S)

    def send(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            if self._call is None:
                self._connect()
            sent = time.perf_counter()
            self._steps += 1
            message = encode_link_request(self._steps, entries)
            self._ring_fields(message, entries)
            data = message.SerializeToString()
            self.bytes_sent += len(data)
            metrics.LINK_BYTES.labels("up").inc(len(data))
            self._unanswered.append((self._steps, entries, sent))
            if self._socket is None:
                self._requests.put(data)
                return
            try:
                socket_link.send_frame(self._socket, data, functools.partial(self._waiting, self._socket))
            except (OSError, socket_link.SocketLinkError) as exc:
                self._drop()
                raise StatusError("UNAVAILABLE", f"verifier link lost: {exc}") from None

    def receive(self, on_notice: OnNotice | None = None) -> list[StepResult]:
        with self._lock:
            if self._call is None:  # the stream broke (or was closed) after the message was sent
                raise StatusError("UNAVAILABLE", "verifier link lost")
            if not self._unanswered:
                raise RuntimeError("receive() without a message in flight")
            step, entries, sent = self._unanswered.popleft()
        noticed = False
        while True:
            data, arrived = self._next_reply()
            decoding = time.perf_counter()
            try:
                reply, feature_data = parse_link_response(data)  # ValueError (a WireError's base) when corrupt
                if reply.step != step:
                    raise WireError(f"reply to step {reply.step}, expected {step}")
                if reply.HasField("ring"):
                    self._take_offer(reply.ring)
                reader, ring_end = self.features, None
                if reply.HasField("features_at"):  # the rows lie in the ring (RingError is a ValueError)
                    if self._ring is None:
                        raise WireError("features in a feature ring that is not mapped")
                    nbytes = tensor_bytes(reply.features)
                    feature_data = self._ring.rows(reply.features_at, nbytes)
                    reader, ring_end = self._ring_features, reply.features_at + nbytes
                results = decode_link_response(reply, vocab_size=self.vocab_size, feature_dim=self.feature_dim,
                                               max_feature_rows=(len(entries) + 1) * self.max_seq_len,
                                               feature_data=feature_data, reader=reader)
                if ring_end is not None:  # copied out: the next message releases them
                    self._ring.done(ring_end)
                    metrics.LINK_BYTES.labels("ring").inc(nbytes)
                if not reply.notice:
                    check_results(entries, results)
                    break
                if noticed:
                    raise WireError(f"a second notice ahead of the reply to step {step}")
                noticed = True
                check_notice(entries, results)
            except (ValueError, StatusError) as exc:
                self.close()
                raise StatusError("INTERNAL", f"bad reply from the verifier: {exc}") from None
            if on_notice is not None:
                on_notice(results)
        self.verifier_step_s = _seconds(reply.step_seconds)
        held = _seconds(reply.held_seconds)
        self.link_s = max(arrived - sent - held, 0.0) + time.perf_counter() - decoding if held else 0.0
        return results

    def _ring_fields(self, message: pb.LinkRequest, entries: Sequence[Entry]) -> None:
        """The feature ring's fields of a message: the request for one (with a stream's first open
        of a session that takes features: plain decoding needs none), then the rows read from
        it, or the refusal of one this host cannot map."""
        if self._ring_ask and any(isinstance(e, OpenEntry) and e.feature_layer_ids for e in entries):
            message.feature_ring, self._ring_ask = True, False
        if self._ring is not None:
            message.ring_released = self._ring.read_to
        elif self._ring_refuse:
            message.ring_refused, self._ring_refuse = True, False

    def _take_offer(self, offer: pb.FeatureRing) -> None:
        """Map the ring the verifier offers (or refuse it, in the next message, where it cannot be)."""
        if not self.feature_ring or self._ring_offered:
            raise WireError("a feature ring offered unasked")
        self._ring_offered = True
        try:
            self._ring = RingReader(RingOffer(offer.path, offer.capacity, offer.nonce))
        except (OSError, RingError) as exc:
            self._ring_refuse = True
            log.info("the verifier's feature ring is not reachable from here (%s); its rows come inline", exc)

    def _next_reply(self) -> tuple[bytes, float]:
        """The next message on the stream and when it arrived; raises StatusError (and drops the
        link) when the stream broke."""
        with self._lock:
            if self._call is None:  # closed meanwhile
                raise StatusError("UNAVAILABLE", "verifier link lost")
            replies, sock = self._replies, self._socket
        while sock is None:
            try:
                item = replies.get(timeout=STALL_PROBE_S)
                break
            except queue.Empty:
                if not self.probe():
                    item = self._stalled()
                    break
        else:
            item = self._socket_reply(sock, replies)
        if isinstance(item, StatusError):
            with self._lock:
                closed = self._call is None or self._replies is not replies  # closed (or reconnected) meanwhile
                if not closed:
                    self._drop()
            raise StatusError("UNAVAILABLE", "verifier link lost") if closed else item
        data, arrived = item
        self.bytes_received += len(data)
        metrics.LINK_BYTES.labels("down").inc(len(data))
        return data, arrived

    def _stalled(self) -> StatusError:
        return StatusError("UNAVAILABLE", f"the verifier does not answer: no reply for {STALL_PROBE_S:g} s, and "
                                          f"Info got {self.probe_error}")

    def _waiting(self, sock: socket.socket, waited: float) -> None:
        """While a message waits to go out through the socket: the replies that have come are read
        and kept (a verifier whose replies wait for this drafter stops reading), and past each
        STALL_PROBE_S the verifier is asked whether it lives (TimeoutError when not)."""
        while socket_link.readable(sock):
            data = socket_link.recv_frame(sock)
            if data is None:
                raise socket_link.SocketLinkError("the verifier closed the link")
            self._early.append((data, time.perf_counter()))
        if waited % STALL_PROBE_S < socket_link.WAIT_POLL_S <= waited and not self.probe():
            raise TimeoutError(f"the verifier does not read: nothing taken for {waited:.0f} s, and Info got "
                               f"{self.probe_error}")

    def _socket_reply(self, sock: socket.socket, replies: queue.SimpleQueue) -> tuple[bytes, float] | StatusError:
        """The next reply through the socket link, read on this thread, and when it came; or why the
        link ended: the status on the stream, when the verifier closed the socket."""
        if self._early:
            return self._early.popleft()
        while True:
            try:
                data = socket_link.recv_frame(sock)
                break
            except TimeoutError:
                if not self.probe():
                    return self._stalled()
            except (OSError, socket_link.SocketLinkError) as exc:
                return StatusError("UNAVAILABLE", f"verifier link lost: {exc}")
        if data is not None:
            return data, time.perf_counter()
        try:  # closed: the stream says why
            item = replies.get(timeout=SOCKET_END_WAIT_S)
        except queue.Empty:
            return StatusError("UNAVAILABLE", "verifier closed the link")
        return item if isinstance(item, StatusError) else StatusError(
            "INTERNAL", "bad reply from the verifier: a message through the stream after the link moved to its "
                        "Unix socket")

    def probe(self) -> bool:
        """Whether the verifier answers Info (why not: `probe_error`)."""
        try:
            self.stub.Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            return True
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None  # a call's error has a status
            self.probe_error = (f"{code.name}: {exc.details()}" if code not in (None, grpc.StatusCode.DEADLINE_EXCEEDED)
                                else f"no answer within {PROBE_TIMEOUT_S:g} s")
            return False

    def _drop(self) -> None:
        """Cancel the stream; messages still unanswered are lost (a receive raises UNAVAILABLE)."""
        call, self._call = self._call, None
        sock, self._socket = self._socket, None
        self._unanswered.clear()
        self._early.clear()
        if sock is not None:  # a read blocked on it wakes with its end
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """End the stream (the verifier closes every session on it); safe to call more than once."""
        with self._lock:
            if self._call is not None:
                self._requests.put(_END)
                self._drop()


@dataclass
class _LocalMessage:
    """A message `LocalLink` sent and not yet received: its step until finished, then its results,
    and the seconds its step has taken (begin and finish, not the time between)."""
    step: object  # verifier_svc.tree_verifier.PendingStep
    seconds: float
    results: list[StepResult] | None = None


class LocalLink(_Lockstep):
    """The in-process verifier: calls a `TreeVerifier` directly (implements `VerifierLink`).
    Sending a message begins its step (checks, the verify and prefills queued on the device),
    receiving it finishes the step (waits for the device, commits, reads the prefills): between
    the two the sender's host is free while the device works. A message that may not begin
    beside an unfinished one (`PendingStep.admits`) finishes that one first. In process the
    whole reply is there at once: no notices. The target features it hands over stay on the
    verifier's device, where the draft model reads them (`TargetRunner.features_on_device`), and
    the drafter may queue its next draft step right behind a verify, from its results there
    (`verified_on_device`)."""

    OWNER = "local"
    takes_device_trees = True  # the DDTrees stay on the device (`common.tree.DeviceTrees`)
    # A step's prompt chunks may come in a message of their own, sent behind its trees: their prefill
    # is queued after the verify, and the trees' reply does not wait for it.
    takes_prompts_apart = True

    def __init__(self, verifier):
        self.verifier = verifier
        verifier.runner.take_device_trees(verifier.limits.max_tree_nodes)
        self._sent: collections.deque[_LocalMessage] = collections.deque()
        self.verifier_step_s = 0.0
        self.link_s = 0.0  # no wire

    @property
    def mixes_prompts(self) -> bool:
        """Whether the verifier takes prompt chunks that come beside trees into their verify
        (`TreeVerifier.mix_prompts`), where that costs less than a prefill of their own."""
        return self.verifier.mix_prompts

    @property
    def in_flight(self) -> int:
        """Messages sent and not yet received."""
        return len(self._sent)

    def send(self, entries: Sequence[Entry]) -> None:
        keys = {(self.OWNER, e.session_id) for e in entries}
        if any(m.results is None and not m.step.admits(keys) for m in self._sent):
            for message in self._sent:
                self._finish(message)
        start = time.perf_counter()
        step = self.verifier.begin([(self.OWNER, e) for e in entries])
        self._sent.append(_LocalMessage(step, time.perf_counter() - start))

    def _finish(self, message: _LocalMessage) -> None:
        if message.results is None:
            start = time.perf_counter()
            message.results = [r for r in self.verifier.finish(message.step) if r is not None]
            message.seconds += time.perf_counter() - start

    def verified_on_device(self) -> VerifiedRows | None:
        """The verify results of the message sent last, still on the device (None: it verified no
        tree). Valid to queue work behind until the next `send`."""
        return self._sent[-1].step.verified_on_device() if self._sent else None

    def receive(self, on_notice: OnNotice | None = None) -> list[StepResult]:
        message = self._sent.popleft()
        self._finish(message)
        self.verifier_step_s = message.seconds
        return message.results

    def probe(self) -> bool:
        return True

    def close(self) -> None:
        """The verifier closes this link's sessions; replies not yet received are dropped (their
        steps finished first: the device work they queued completes, their KV slots are freed)."""
        for message in self._sent:
            self._finish(message)
        self._sent.clear()
        self.verifier.close_owner(self.OWNER)


def check_verifier(info: pb.InfoResponse, target: TargetConfig, draft: DraftConfig | None) -> None:
    """Raise StatusError(FAILED_PRECONDITION) when the verifier does not serve our target."""
    problems = []
    if info.config_fingerprint != target.fingerprint():
        problems.append(
            f"target mismatch: verifier serves {info.architecture} (vocab {info.vocab_size}, hidden "
            f"{info.hidden_size}, {info.num_layers} layers, fingerprint {info.config_fingerprint}), the drafter "
            f"expects {target.architecture} (vocab {target.vocab_size}, hidden {target.hidden_size}, "
            f"{target.num_layers} layers, fingerprint {target.fingerprint()})"
        )
    if draft is not None and tuple(info.feature_layer_ids) != draft.target_layer_ids:
        problems.append(f"verifier returns features of layers {list(info.feature_layer_ids)}, "
                        f"the draft needs {list(draft.target_layer_ids)}")
    if info.feature_wire not in FORMATS.values():
        problems.append(f"verifier sends features as {info.feature_wire!r}, this drafter reads "
                        f"{' or '.join(repr(f) for f in FORMATS.values())}")
    if not info.token_bias:
        problems.append("verifier predates token biases (logit_bias, min_tokens) and would ignore them: upgrade it")
    elif not info.penalties:
        problems.append("verifier predates the repetition penalties (presence_penalty, frequency_penalty, "
                        "repetition_penalty) and would ignore them: upgrade it")
    elif not info.columns:
        problems.append("verifier predates the link's trees and results as columns: upgrade it")
    if problems:
        raise StatusError("FAILED_PRECONDITION", "; ".join(problems))
