"""The drafter's side of the Verifier service: `GrpcVerifierLink` and the start-up check.

A link is one bidirectional `Session` stream, driven synchronously from the session
loop's thread: each call puts one message on the request queue and reads one reply.
gRPC failures become `StatusError`s carrying the status name and the verifier's message.
"""
from __future__ import annotations

import queue
import threading
import time

import grpc
from opentelemetry import trace

from common.config import DraftConfig, TargetConfig
from common.protocol import Prefilled, SamplingParams, StatusError, Verified
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tree import DraftTree
from common.wire import WireError, decode_tensor, encode_sampling, encode_tree

_END = object()
_MAX_FEATURE_ELEMENTS = 1 << 31
_CLOSE_TIMEOUT_S = 5.0


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def status_error(exc: grpc.RpcError) -> StatusError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return StatusError(code.name, f"verifier: {details}")


class GrpcVerifierLink:
    """One verifier session over gRPC (implements `session_loop.VerifierLink`)."""

    def __init__(self, stub: pb_grpc.VerifierStub, feature_layer_ids: tuple[int, ...],
                 timeout_s: float | None = None, admission_timeout_s: float = 30.0):
        self.stub = stub
        self.feature_layer_ids = list(feature_layer_ids)
        self.timeout_s = timeout_s
        self.admission_timeout_s = admission_timeout_s
        self._requests: queue.Queue = queue.Queue()
        self._call = None
        self._replies = None

    def _exchange(self, message: pb.DrafterMessage, expect: str) -> pb.VerifierMessage:
        size = message.ByteSize()
        self._requests.put(message)
        try:
            reply = next(self._replies)
        except grpc.RpcError as exc:
            raise status_error(exc) from None
        except StopIteration:
            raise StatusError("UNAVAILABLE", "verifier closed the session stream") from None
        span = trace.get_current_span()
        span.set_attributes({"bytes.sent": size, "bytes.received": reply.ByteSize()})
        kind = reply.WhichOneof("kind")
        if kind == "error":
            raise StatusError(_code_name(reply.error.code),
                              f"verifier: {reply.error.message}")
        if kind != expect:
            raise StatusError("INTERNAL", f"verifier replied {kind!r}, expected {expect!r}")
        return reply

    def open(self, prompt_ids: list[int], sampling: SamplingParams, traceparent: str = "") -> Prefilled:
        """Open the session; while the verifier's slots are all taken, wait and retry (bounded)."""
        msg = pb.DrafterMessage(open=pb.Open(prompt_token_ids=prompt_ids, sampling=encode_sampling(sampling),
                                             traceparent=traceparent, feature_layer_ids=self.feature_layer_ids))
        deadline = time.monotonic() + self.admission_timeout_s
        delay = 0.01
        while True:
            self._requests = queue.Queue()
            self._call = self.stub.Session(iter(self._requests.get, _END), timeout=self.timeout_s)
            self._replies = iter(self._call)
            try:
                reply = self._exchange(msg, "prefilled").prefilled
                break
            except StatusError as exc:
                self._call.cancel()
                self._call = None
                if exc.status != "RESOURCE_EXHAUSTED" or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        return Prefilled(token=reply.token, features=self._features(reply.features), max_seq_len=reply.max_seq_len)

    def verify(self, tree: DraftTree, round_index: int, traceparent: str = "") -> Verified:
        msg = pb.DrafterMessage(tree=encode_tree(tree, round_index, traceparent))
        reply = self._exchange(msg, "verified").verified
        return Verified(accepted_tokens=list(reply.accepted_tokens), next_token=reply.next_token,
                        features=self._features(reply.features))

    def close(self) -> None:
        """Send Close and end the stream; safe to call more than once."""
        if self._call is None:
            return
        call, self._call = self._call, None
        self._requests.put(pb.DrafterMessage(close=pb.Close()))
        self._requests.put(_END)
        guard = threading.Timer(_CLOSE_TIMEOUT_S, call.cancel)  # never hang on a stuck verifier
        guard.start()
        try:
            for _ in self._replies:  # the verifier ends the stream after Close
                pass
        except grpc.RpcError:
            pass
        finally:
            guard.cancel()

    def cancel(self) -> None:
        """Abort the stream from another thread (the client went away)."""
        call = self._call
        if call is not None:
            call.cancel()

    @staticmethod
    def _features(msg: pb.Tensor):
        try:
            return decode_tensor(msg, max_elements=_MAX_FEATURE_ELEMENTS)
        except WireError as exc:
            raise StatusError("INTERNAL", f"bad features from verifier: {exc}") from None


def _code_name(code: int) -> str:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return "UNKNOWN"


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
    if problems:
        raise StatusError("FAILED_PRECONDITION", "; ".join(problems))
