"""The Verifier gRPC service: one bidirectional `Session` stream per generation, and `Info`.

The servicer runs on the asyncio event loop and only does I/O and cheap checks: it reads a
message, checks its kind, order and sizes, hands the model work to the `ModelWorker`
thread and writes the reply. Every refusal goes out twice, as the protocol asks: in-band as
`VerifierMessage.error`, then as the RPC's status. A session's KV slot is freed however its
stream ends: Close, end of stream, client cancel or deadline, error, or idle timeout.

    server, port = await serve(VerifierConfig(target_dir="...", port=0))
    ...
    await server.stop(grace=1)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1.health import aio as health_aio

from common.config import CheckpointError, load_target_config
from common.grpc_server import start_grpc_server
from common.rpc import VERIFIER_SERVICE, pb, pb_grpc
from common.wire import WireError, decode_sampling, decode_tree
from verifier_svc.scheduler import ModelWorker, OpenJob, SessionHandle, VerifyJob
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierError, VerifierLimits

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VerifierConfig:
    """Everything the verifier is started with; the defaults here are the only defaults."""

    target_dir: str
    feature_layer_ids: tuple[int, ...] = ()  # target layers whose hidden states go to the drafter
    host: str = "0.0.0.0"
    port: int = 50051  # 0 = any free port (tests)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    max_sessions: int = VerifierLimits.max_sessions  # KV slots = concurrent sessions
    max_seq_len: int = VerifierLimits.max_seq_len  # tokens per session (prompt + generated + one tree)
    max_tree_nodes: int = VerifierLimits.max_tree_nodes  # root included
    max_tree_depth: int = VerifierLimits.max_tree_depth
    idle_timeout_s: float = 300.0  # a session with no message for this long is closed
    grace_s: float = 5.0  # on shutdown, how long running RPCs may finish
    trace_console: bool = False  # also print spans to stdout
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for the verify forward (False = eager)

    def check(self) -> None:
        """Raise ValueError with a one-line message for out-of-range values."""
        for name, low in (("max_sessions", 1), ("max_seq_len", 2), ("max_tree_nodes", 1), ("max_tree_depth", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if any(i < 0 for i in self.feature_layer_ids):
            raise ValueError(f"feature layer ids must be >= 0, got {list(self.feature_layer_ids)}")
        if self.torch_device().type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")

    def torch_device(self) -> torch.device:
        try:
            return torch.device(self.device if self.device != "auto" else
                                "cuda" if torch.cuda.is_available() else "cpu")
        except RuntimeError as exc:
            raise ValueError(f"bad device {self.device!r}: {exc}") from None

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32

    def limits(self) -> VerifierLimits:
        return VerifierLimits(self.max_sessions, self.max_seq_len, self.max_tree_nodes, self.max_tree_depth)


def load_verifier(config: VerifierConfig) -> TreeVerifier:
    """Load the target checkpoint and allocate the KV cache (blocking; CheckpointError/ValueError)."""
    config.check()
    target = load_target_config(config.target_dir)
    bad = [i for i in config.feature_layer_ids if i >= target.num_layers]
    if bad:
        raise CheckpointError(f"feature layer ids {bad} outside the target's {target.num_layers} layers")
    model = TargetModel.from_pretrained(config.target_dir, config.feature_layer_ids,
                                        device=config.torch_device(), dtype=config.torch_dtype())
    runner = TargetRunner(model, config.max_sessions, config.max_seq_len, cuda_graphs=config.cuda_graphs)
    return TreeVerifier(runner, config.limits())


def _status_code(name: str) -> grpc.StatusCode:
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)


def _invalid(message: str) -> VerifierError:
    return VerifierError("INVALID_ARGUMENT", message)


class _SessionStream:
    """One `Session` RPC: reads messages in order, runs them on the worker, writes the replies."""

    def __init__(self, context: grpc.aio.ServicerContext, worker: ModelWorker, config: VerifierConfig):
        self.context, self.worker, self.config = context, worker, config
        self.handle = SessionHandle()
        self.rounds = 0

    async def run(self) -> str:
        """Serve the session until it ends normally; returns why. Raises VerifierError."""
        first = await self._read()
        if first is None:
            return self._ended("before Open")
        if first.WhichOneof("kind") != "open":
            raise _invalid(f"the first message must be Open, got {self._kind(first)}")
        await self.context.write(await self.worker.open(self._open_job(first.open)))
        log.info("session %d opened for %s: %d prompt tokens", self.handle.session_id, self.context.peer(),
                 len(first.open.prompt_token_ids))
        while True:
            message = await self._read()
            if message is None:
                return self._ended("without Close")
            kind = message.WhichOneof("kind")
            if kind == "close":
                return "Close received"
            if kind != "tree":
                raise _invalid(f"expected Tree or Close, got {self._kind(message)}")
            await self.context.write(await self.worker.verify(self._verify_job(message.tree)))
            self.rounds += 1

    def _ended(self, when: str) -> str:
        # A client's cancel or deadline first shows up as the end of the request stream.
        remaining = self.context.time_remaining()
        if remaining is not None and remaining <= 0:
            return "the client's deadline passed"
        return f"stream ended {when} (or the client cancelled)"

    async def _read(self) -> pb.DrafterMessage | None:
        """The next message, None at the end of the stream; enforces the idle timeout."""
        try:
            message = await asyncio.wait_for(self.context.read(), self.config.idle_timeout_s)
        except asyncio.TimeoutError:
            raise VerifierError("DEADLINE_EXCEEDED",
                                f"no message for {self.config.idle_timeout_s:g} s: session closed") from None
        return None if message is grpc.aio.EOF else message

    def _open_job(self, msg: pb.Open) -> OpenJob:
        layers = tuple(msg.feature_layer_ids)
        ours = self.worker.verifier.runner.model.feature_layer_ids
        if layers != ours:
            raise VerifierError(
                "FAILED_PRECONDITION",
                f"the drafter asks for features of target layers {list(layers)}, this verifier returns layers "
                f"{list(ours)}; start both with the same draft checkpoint",
            )
        try:
            sampling = decode_sampling(msg.sampling)
        except ValueError as exc:
            raise _invalid(f"bad sampling parameters: {exc}") from None
        return OpenJob(self.handle, list(msg.prompt_token_ids), sampling, msg.traceparent, msg.ByteSize())

    def _verify_job(self, msg: pb.Tree) -> VerifyJob:
        expected = self.rounds + 1
        if msg.round != expected:
            raise _invalid(f"tree round {msg.round} is out of order: expected round {expected}")
        try:
            tree = decode_tree(msg, max_nodes=self.config.max_tree_nodes)
        except WireError as exc:
            raise _invalid(f"malformed tree: {exc}") from None
        return VerifyJob(self.handle, tree, msg.round, msg.traceparent, msg.ByteSize())

    @staticmethod
    def _kind(message: pb.DrafterMessage) -> str:
        kind = message.WhichOneof("kind")
        return kind.capitalize() if kind else "an empty message"


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, worker: ModelWorker, config: VerifierConfig):
        self.worker, self.config = worker, config
        model = worker.verifier.runner.model
        cfg = model.cfg
        self._info = pb.InfoResponse(
            architecture=cfg.architecture, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers, dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
            config_fingerprint=cfg.fingerprint(), feature_layer_ids=model.feature_layer_ids,
            max_seq_len=config.max_seq_len, max_sessions=config.max_sessions,
            max_tree_nodes=config.max_tree_nodes,
        )

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        reply = pb.InfoResponse()
        reply.CopyFrom(self._info)
        reply.free_sessions = self.worker.free_sessions
        return reply

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        stream = _SessionStream(context, self.worker, self.config)
        reason = "?"
        try:
            reason = await stream.run()
        except asyncio.CancelledError:
            reason = "cancelled by the client (or its deadline passed)"
            raise
        except Exception as exc:
            error = exc if isinstance(exc, VerifierError) else self._internal(exc)
            reason = f"{error.status}: {error.message}"
            self.worker.close(stream.handle)  # free the slot before the client hears of the error
            await self._abort(context, error)
        finally:
            self.worker.close(stream.handle)
            if stream.handle.session_id is not None:
                log.info("session %d closed after %d rounds: %s", stream.handle.session_id, stream.rounds, reason)
            else:
                log.info("session from %s not opened: %s", context.peer(), reason)

    @staticmethod
    def _internal(exc: Exception) -> VerifierError:
        log.exception("Session failed unexpectedly")
        return VerifierError("INTERNAL", f"internal error in the verifier ({type(exc).__name__}); see its log")

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: VerifierError) -> None:
        """Send the error in-band, then end the RPC with the same status (raises AbortError)."""
        code = _status_code(error.status)
        try:
            await context.write(pb.VerifierMessage(error=pb.Error(code=code.value[0], message=error.message)))
        except Exception:  # the peer may already be gone; the status below is what matters
            pass
        await context.abort(code, error.message)


class VerifierServer:
    """A running verifier: the gRPC server, its model worker and its health status."""

    def __init__(self, server: grpc.aio.Server, worker: ModelWorker, health: health_aio.HealthServicer, port: int):
        self.server, self.worker, self.health, self.port = server, worker, health, port

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, let running RPCs finish for `grace` seconds, then stop the worker."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await asyncio.to_thread(self.worker.stop)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve(config: VerifierConfig, verifier: TreeVerifier | None = None) -> tuple[VerifierServer, int]:
    """Start a verifier and return it with its bound port (config.port 0 picks a free one).

    Loads the model unless `verifier` is given (off the event loop). Raises CheckpointError
    or ValueError for a bad configuration, OSError when the address cannot be bound.
    """
    config.check()
    if verifier is None:
        verifier = await asyncio.to_thread(load_verifier, config)
    worker = ModelWorker(verifier)
    worker.start()
    try:
        server, port, health = await start_grpc_server(
            lambda srv: pb_grpc.add_VerifierServicer_to_server(VerifierServicer(worker, config), srv),
            VERIFIER_SERVICE, config.host, config.port)
    except BaseException:
        await asyncio.to_thread(worker.stop)
        raise
    return VerifierServer(server, worker, health, port), port
