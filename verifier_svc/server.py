"""The Verifier gRPC service: one bidirectional `Link` stream per drafter connection, and `Info`.

The servicer runs on the asyncio event loop and only does I/O and cheap checks: it reads a
link message, decodes and checks its entries (`common.wire.decode_link_request`), hands the
model work to the `ModelWorker` thread, which batches the messages of every link into one
step, and writes the reply. A bad entry fails its own session (an in-band `Error` result);
a malformed message, or one that breaks the link's limits, ends the link with INVALID_ARGUMENT
(one log line, no traceback); one over the inbound cap gets RESOURCE_EXHAUSTED from gRPC. A
session's KV slot is freed however it ends: Close, error, open or idle timeout, or the end of
its link.

    server, port = await serve(VerifierConfig(target_dir="...", port=0))
    ...
    await server.stop(grace=1)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from common import metrics
from common.config import CheckpointError, load_target_config
from common.devices import device_id, parse_device
from common.feature_projection import FeatureProjection
from common.feature_ring import RingError, RingOffer, RingWriter, default_dir
from common.feature_wire import FORMATS, FP8, SCALE_BYTES
from common.grpc_server import MIB, start_grpc_server
from common.socket_link import SocketLinkError, SocketListener, SocketStream
from common.logs import memory_summary
from common.rpc import VERIFIER_SERVICE, decode_message, pb, pb_grpc
from common.tls import ServerTls
from common.wire import LinkLimits, decode_link_request
from ddtree_kernels import batch_invariant, pdl
from verifier_svc.cuda_graphs import GraphConfig
from verifier_svc.scheduler import LinkStep, ModelWorker, SessionTimers
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tensor_parallel import rank_device, shard_config, shard_target
from verifier_svc.tree_verifier import SHUTTING_DOWN, TreeVerifier, VerifierError, VerifierLimits

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _whole_mib(size: int) -> int:
    """`size` bytes in MiB, rounded up."""
    return -(-size // MIB)


@dataclass(frozen=True)
class VerifierConfig:
    """Everything the verifier is started with; the defaults here are the only defaults."""

    target_dir: str
    feature_layer_ids: tuple[int, ...] = ()  # target layers whose hidden states go to the drafter
    # A draft checkpoint folder whose fc + hidden_norm the verifier applies to those features, so
    # that the drafter gets hidden-size context rows (5x fewer bytes for Qwen3-8B); "" = raw features.
    projection_dir: str = ""
    host: str = "0.0.0.0"
    port: int = 50051  # 0 = any free port (tests)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    max_sessions: int = VerifierLimits.max_sessions  # KV slots = concurrent sessions
    max_seq_len: int = VerifierLimits.max_seq_len  # tokens per session (prompt + generated + one tree)
    max_tree_nodes: int = VerifierLimits.max_tree_nodes  # root included
    max_tree_depth: int = VerifierLimits.max_tree_depth
    idle_timeout_s: float = 300.0  # a session with no message for this long is closed
    open_timeout_s: float = 10.0  # a session opened that sends no tree for this long is closed
    grace_s: float = 25.0  # on shutdown, how long the open sessions may run on (`VerifierServer.stop`)
    # A model worker with work that makes no progress for this long (a hung device or kernel) turns
    # health NOT_SERVING and Info UNAVAILABLE, so drafters move its sessions elsewhere; 0 = never.
    stall_timeout_s: float = 30.0
    trace_console: bool = False  # also print spans to stdout
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for the verify step (False = eager)
    graph_batches: tuple[int, ...] = GraphConfig.batch_buckets  # batch buckets of the verify graphs
    graph_trees: tuple[int, ...] = GraphConfig.tree_buckets  # tree buckets (drafted nodes) of the verify graphs
    max_inflight: int = 4  # unanswered messages per link before the verifier stops reading it
    # Inbound message cap in MiB (larger ones get RESOURCE_EXHAUSTED); 0 = what the limits need
    # (`link_message_bytes`), rounded up to a whole MiB.
    max_message_mb: int = 0
    # A shared-memory ring per link for the replies' feature rows, offered to drafters that ask
    # (those on this host map it; `common.feature_ring`): its size in MiB, 0 = none offered; and
    # where its file goes ("" = /dev/shm, or the temp dir without one).
    feature_ring_mb: int = 64
    feature_ring_dir: str = ""
    # A Unix socket per link for its messages, offered to drafters that ask in a hello (those on
    # this host connect; `common.socket_link`), in a directory of its own under `unix_socket_dir`
    # ("" = /dev/shm, or the temp dir without one).
    unix_socket: bool = True
    unix_socket_dir: str = ""
    # "keyed": position-keyed sampling (a seeded output does not depend on the trees, the budget or
    # the batch; fused: 2.1 ms vs the coin walk's 1.7 ms at 32 x 17 nodes, H200); "coins": the
    # target-only coin walk (SGLang's tree_speculative_sampling_target_only semantics, fused).
    sampling: str = "keyed"
    # Batch-invariant kernels (`ddtree_kernels.batch_invariant`): a token's logits do not depend on the
    # tree bucket, the batch or its padding, so greedy tree decoding equals greedy plain decoding
    # bit for bit in bf16 too (the default mode promises that in float32; bf16 near-ties may flip).
    deterministic: bool = False
    # Prompt chunks of up to 4 sessions per step prefill through captured "forward" CUDA graphs
    # (chain trees at the tree buckets) instead of eagerly: more graphs to capture at start-up
    # (H200, 8B dimensions, 128-token prompts: 8% more tokens/s at 32 clients; bench/RESULTS.md).
    prefill_graphs: bool = True
    # A step's prompt chunks ride its verify's forward as prompt segments (rows of the trees' width)
    # when that costs less than a prefill of their own, sparing that forward's weight pass
    # (`TreeVerifier`'s mixed prompts); False: always a prefill of their own.
    mixed_prompts: bool = True
    # Ranks of a tensor parallel target (`verifier_svc.tensor_parallel`): one process and GPU each
    # (cuda:N .. cuda:N + ranks - 1 from --device cuda:N), rank 0 serving; 1 = one process.
    tensor_parallel: int = 1
    # Time the verify step per (batch bucket, tree bucket) at start-up and send the table to
    # drafters (InfoResponse.verify_costs) for their adaptive tree budget: "on", "off", or
    # "auto" = on when CUDA graphs are captured (a few seconds; on a CPU it would take longer).
    measure_costs: str = "auto"
    # How feature rows travel on the link (`common.feature_wire`): "model" = in the model's dtype;
    # "fp8" = packed, each row fp8 values and a float32 scale: half the bytes of bf16 rows, the
    # drafts (not the output) changed by the rounding. An in-process drafter's features stay on the device.
    feature_wire: str = "model"
    tls: ServerTls = ServerTls()  # plaintext, TLS, or mutual TLS with a client CA (--tls-cert, --tls-key, --tls-client-ca)
    metrics_port: int = 0  # Prometheus /metrics over HTTP on `host`; 0 = not served
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR (common.logs)
    log_format: str = "text"  # text lines, or json: one object per line

    def check(self) -> None:
        """Raise ValueError with a one-line message for out-of-range values."""
        for name, low in (("max_sessions", 1), ("max_seq_len", 2), ("max_tree_nodes", 1), ("max_tree_depth", 1),
                          ("max_inflight", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "open_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("grace_s", "stall_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.graph_config().check()  # checked where graphs are off too: the same flags fail on every machine
        if self.feature_ring_mb < 0:
            raise ValueError(f"feature_ring_mb must be >= 0 (0 = no ring), got {self.feature_ring_mb}")
        if self.feature_ring_mb and self.feature_ring_dir and not os.path.isdir(self.feature_ring_dir):
            raise ValueError(f"feature_ring_dir {self.feature_ring_dir!r} is not a directory")
        if self.unix_socket and self.unix_socket_dir and not os.path.isdir(self.unix_socket_dir):
            raise ValueError(f"unix_socket_dir {self.unix_socket_dir!r} is not a directory")
        if self.max_message_mb < 0:
            raise ValueError(f"max_message_mb must be >= 0 (0 = what the limits need), got {self.max_message_mb}")
        if 0 < self.max_message_mb < _whole_mib(self.link_message_bytes()):
            raise ValueError(f"max_message_mb {self.max_message_mb} is below the {_whole_mib(self.link_message_bytes())} "
                             f"MiB a link message may take at max_sessions {self.max_sessions}, max_seq_len "
                             f"{self.max_seq_len} and max_tree_nodes {self.max_tree_nodes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.measure_costs not in ("auto", "on", "off"):
            raise ValueError(f"measure_costs must be auto, on or off, got {self.measure_costs!r}")
        if self.feature_wire not in FORMATS:
            raise ValueError(f"feature_wire must be one of {', '.join(FORMATS)}, got {self.feature_wire!r}")
        if self.sampling not in ("keyed", "coins"):
            raise ValueError(f"sampling must be keyed or coins, got {self.sampling!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        device = self.torch_device()  # ValueError: malformed, or a GPU this machine lacks
        if self.tensor_parallel > 1 and device.type == "cuda":
            last = (device.index or 0) + self.tensor_parallel - 1
            if last >= torch.cuda.device_count():
                raise ValueError(f"tensor_parallel {self.tensor_parallel} from {self.device} needs cuda:{last}, "
                                 f"but {torch.cuda.device_count()} GPUs are visible")
        if any(i < 0 for i in self.feature_layer_ids):
            raise ValueError(f"feature layer ids must be >= 0, got {list(self.feature_layer_ids)}")
        self.tls.check()  # TlsError, a ValueError: incomplete settings, unreadable or mismatched files

    def torch_device(self) -> torch.device:
        return parse_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32

    def limits(self) -> VerifierLimits:
        return VerifierLimits(self.max_sessions, self.max_seq_len, self.max_tree_nodes, self.max_tree_depth)

    def max_link_entries(self) -> int:
        """Entries one link message may carry: every session's, and as many opens again."""
        return 2 * self.max_sessions + 16

    def link_message_bytes(self) -> int:
        """An upper bound on a well-formed link message at these limits: max_link_entries entries,
        each an Open of max_seq_len tokens (10 bytes each at most, as varints) with a tree of
        max_tree_nodes nodes (three arrays of 8-byte integers), and 1 KiB of other fields."""
        return self.max_link_entries() * (10 * self.max_seq_len + 24 * self.max_tree_nodes + 1024)

    def max_receive_bytes(self) -> int:
        """The inbound message cap: max_message_mb MiB, or (0) link_message_bytes rounded up to a whole MiB."""
        return (self.max_message_mb or _whole_mib(self.link_message_bytes())) * MIB

    def accept_mode(self) -> str:
        """The accept mode of sampled steps (`verifier_svc.accept.accept_batch`)."""
        return {"keyed": "keyed", "coins": "sample"}[self.sampling]

    def graph_config(self) -> GraphConfig:
        return GraphConfig(tree_buckets=self.graph_trees, batch_buckets=self.graph_batches,
                           modes=("greedy", self.accept_mode()),
                           prefill_batches=(1, 2, 4) if self.prefill_graphs else ())


def load_runner(config: VerifierConfig, rank: int = 0, world: int = 1) -> TargetRunner:
    """Load the target (rank `rank`'s shard of it when `world` > 1, on its own GPU) and allocate
    its KV cache and graphs (blocking; CheckpointError/ValueError)."""
    config.check()
    batch_invariant.set_enabled(config.deterministic)  # before any forward or graph capture
    target = load_target_config(config.target_dir)
    bad = [i for i in config.feature_layer_ids if i >= target.num_layers]
    if bad:
        raise CheckpointError(f"feature layer ids {bad} outside the target's {target.num_layers} layers")
    device, dtype = rank_device(config.torch_device(), rank), config.torch_dtype()
    if world > 1:
        shard_config(target, world)  # ValueError before loading anything when the heads do not split
        full = TargetModel.from_pretrained(config.target_dir, config.feature_layer_ids, device="cpu", dtype=dtype)
        model = shard_target(full, rank, world).to(device)
    else:
        model = TargetModel.from_pretrained(config.target_dir, config.feature_layer_ids, device=device, dtype=dtype)
    if config.projection_dir and config.feature_layer_ids:
        projection = FeatureProjection.from_draft(config.projection_dir, device, dtype)
        raw = len(config.feature_layer_ids) * target.hidden_size
        if projection.in_dim != raw:
            raise CheckpointError(f"{config.projection_dir}: fc takes {projection.in_dim} features, the target's "
                                  f"{len(config.feature_layer_ids)} feature layers give {raw}")
        model.feature_projection = projection
    if config.feature_wire != "model" and model.feature_dim % SCALE_BYTES:
        raise ValueError(f"--feature-wire {config.feature_wire} packs rows of a multiple of {SCALE_BYTES} values, "
                         f"this target's feature rows have {model.feature_dim}")
    runner = TargetRunner(model, config.max_sessions, config.max_seq_len, config.max_tree_nodes,
                          cuda_graphs=config.cuda_graphs, graph_config=config.graph_config(),
                          sampling=config.accept_mode())
    runner.feature_wire = FORMATS[config.feature_wire]
    return runner


def load_verifier(config: VerifierConfig, runner: TargetRunner | None = None) -> TreeVerifier:
    """The verifier over `runner` (default: `load_runner(config)`), its step costs measured if asked."""
    runner = runner or load_runner(config)
    verifier = TreeVerifier(runner, config.limits())
    verifier.mix_prompts = config.mixed_prompts
    if config.measure_costs == "on" or (config.measure_costs == "auto" and runner.graphs is not None):
        verifier.verify_costs = runner.measure_verify_costs()
        log.info("measured %d verify step costs (batch x tokens)", len(verifier.verify_costs))
    return verifier


def startup_summary(verifier: TreeVerifier) -> str:
    """The start-up line's facts: device, dtype, KV capacity, CUDA graphs, measured costs, memory."""
    runner = verifier.runner
    graphs = runner.graphs.num_graphs if runner.graphs is not None else 0
    prefills = ("prefills through graphs" if runner.graphs is not None and runner.graphs.forward_batches
                else "eager prefills")
    features = (f"{len(verifier.feature_layer_ids)} feature layers"
                + (" projected" if runner.model.feature_projection is not None else "")
                + (" sent as fp8" if runner.feature_wire == FP8 else "")
                if verifier.feature_layer_ids else "no features")
    return (f"device {runner.device}, dtype {str(runner.cache.k.dtype).removeprefix('torch.')}, "
            f"KV {runner.num_slots} sessions x {runner.max_seq_len} tokens, "
            f"{graphs} verify CUDA graphs{'' if graphs else ' (eager)'}, {prefills}, "
            f"{'deterministic' if batch_invariant.enabled() else 'default'} kernels ({pdl.describe(runner.device)}), "
            f"{len(verifier.verify_costs)} verify costs measured, {features}, {memory_summary(runner.device)}")


# Links that may hold a feature ring at once (each --feature-ring-mb of the host's shared memory,
# allocated when offered); later links get their rows inline.
MAX_FEATURE_RINGS = 16


# A drafter offered a socket link connects within this long, or the offer is withdrawn (its socket removed).
SOCKET_ACCEPT_S = 30.0


class _Link:
    """One `Link` RPC: reads messages, hands each to the worker, writes the replies in order.

    A reader and a writer run concurrently, so a drafter may keep up to `max_inflight`
    messages unanswered (pipelining); past that the reader stops reading, and gRPC's flow
    control holds the drafter back. The messages come through the stream, or, once a drafter
    on this host has taken the socket link offered in reply to its hello, through that socket
    (`common.socket_link`); the stream then only says when the drafter ends the link. The link's
    sessions are closed however it ends.
    """

    def __init__(self, context: grpc.aio.ServicerContext, worker: ModelWorker, config: VerifierConfig, owner: int,
                 peers: set[_Link] = frozenset()):
        """`peers`: the verifier's other links (their feature rings count against MAX_FEATURE_RINGS)."""
        self.context, self.worker, self.config, self.owner, self.peers = context, worker, config, owner, peers
        self.limits = LinkLimits(max_entries=config.max_link_entries(), max_tree_nodes=config.max_tree_nodes)
        self.timers = SessionTimers(config.open_timeout_s, config.idle_timeout_s)  # its sessions, and their timeouts
        self.messages = 0
        self.cut = asyncio.Event()  # set on shutdown, once the drain is over: the link ends with UNAVAILABLE
        self.ring: RingWriter | None = None  # the link's feature ring, once offered (`take_ring_fields`)
        self._ring_offered = False
        self.listener: SocketListener | None = None  # the socket link offered, until the drafter connects
        self.socket: SocketStream | None = None  # the socket the messages come through, once connected
        self.received = 0  # messages read
        # The message whose reply the writer waits for next (`send_in_turn`), under a lock: the
        # model worker's threads read it.
        self._turn_lock = threading.Lock()
        self._turn: LinkStep | None = None

    async def run(self) -> str:
        """Serve the link until the drafter ends it; returns why. Raises VerifierError.

        The read of the next message and the writer run at once: a failed step (the writer's
        error) ends the link at once, even while the drafter, waiting for that reply, sends
        nothing. A session the verifier has answered and then hears nothing more of is closed
        after open_timeout_s (if it has sent no tree yet) or idle_timeout_s, and the same read
        goes on (the link stays usable; `SessionTimers`)."""
        pending: asyncio.Queue = asyncio.Queue(maxsize=self.config.max_inflight)
        writer = asyncio.create_task(self._write(pending))
        cut = asyncio.create_task(self.cut.wait())
        read = None  # the next message, from the stream or the socket link
        stream = None  # with the socket link: the stream's read, whose end ends the link
        accept = None  # the socket link offered: the drafter's connection
        try:
            while True:
                read = read or asyncio.ensure_future(self.socket.read() if self.socket else self.context.read())
                timeout = self.timers.wait_s(time.monotonic())
                waits = {read, writer, cut} | {f for f in (stream, accept) if f is not None}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if cut in done:
                    raise VerifierError("UNAVAILABLE", SHUTTING_DOWN)
                if writer in done:
                    await writer  # raises the step's error
                    raise VerifierError("INTERNAL", "the link's writer ended early")
                if stream in done:
                    if stream.result() is grpc.aio.EOF:
                        break
                    raise VerifierError("INVALID_ARGUMENT", "a message through the stream after the link moved to "
                                                            "its Unix socket")
                if accept in done:
                    local, accept = accept.result(), None
                    if local is not None:  # from now on the stream's read only watches for its end
                        self.socket, stream, read = local, read, None
                    continue
                if not done:
                    self._close_expired()
                    continue
                try:
                    data, read = read.result(), None
                except SocketLinkError as exc:
                    raise VerifierError("INVALID_ARGUMENT", f"bad link message: {exc}") from None
                if data is None or data is grpc.aio.EOF:
                    break
                self.received += 1
                try:  # decode_link_request's WireError and RingError are ValueErrors
                    message = decode_message(pb.LinkRequest, data)
                    if message.unix_socket:
                        await self._hello(message)
                        accept = asyncio.ensure_future(self._accept()) if self.listener is not None else None
                        continue
                    items = decode_link_request(message, self.limits)
                    offer = self.take_ring_fields(message)
                except ValueError as exc:
                    raise VerifierError("INVALID_ARGUMENT", f"bad link message: {exc}") from None
                if accept is not None:  # the drafter went on through the stream: no socket link
                    self._withdraw("the drafter sent through the stream, where its messages stay", accept)
                    accept = None
                items = self.timers.heard(items)
                job = LinkStep(self.owner, message.step, items, received_bytes=len(data), ring=self.ring, offer=offer,
                               send_in_turn=self.send_in_turn if self.socket is not None else None)
                self.worker.submit(job)
                await pending.put(job)
            await pending.put(None)
            await writer
        finally:
            for task in (writer, cut, read, stream):
                if task is not None:
                    task.cancel()
            if accept is not None:
                self._withdraw("the link ended", accept)
            if self.ring is not None:
                self.ring.close()
            if self.socket is not None:
                self.socket.close()
        return "the drafter ended the link"

    async def _hello(self, message: pb.LinkRequest) -> None:
        """Answer a drafter's hello (`LinkRequest.unix_socket`: its first message, step 0, nothing
        else in it) with a socket link's offer, or with nothing (none offered, or none could be made)."""
        if self.received != 1 or message.step or message.ListFields() != [(pb.LinkRequest.DESCRIPTOR.fields_by_name[
                "unix_socket"], True)]:
            raise ValueError("unix_socket must come alone, in a hello: the stream's first message, at step 0")
        reply = pb.LinkResponse(step=0)
        if self.config.unix_socket:
            try:
                self.listener = SocketListener(self.config.unix_socket_dir or default_dir(),
                                              self.config.max_receive_bytes())
                reply.unix_socket.path, reply.unix_socket.nonce = self.listener.path, self.listener.nonce
            except OSError as exc:
                log.warning("link %d: no socket link (%s); its messages go through the stream", self.owner, exc)
        await self.context.write(reply.SerializeToString())

    async def _accept(self) -> SocketStream | None:
        """The drafter's connection to the socket link offered, or None when it does not come in
        SOCKET_ACCEPT_S (the offer is withdrawn). VerifierError when the connection is not the
        drafter's (its first frame not the nonce)."""
        try:
            local = await asyncio.wait_for(self.listener.accept(), SOCKET_ACCEPT_S)
        except asyncio.TimeoutError:
            self._withdraw(f"no connection in {SOCKET_ACCEPT_S:g} s; the messages stay on the stream")
            return None
        except SocketLinkError as exc:
            raise VerifierError("PERMISSION_DENIED", str(exc)) from None
        self.listener = None
        log.info("link %d: its messages go through a Unix socket", self.owner)
        return local

    def _withdraw(self, why: str, accept: asyncio.Future | None = None) -> None:
        """Withdraw the socket link offered (and stop `accept`, the wait for it; a connection it
        made is closed): the messages keep coming through the stream."""
        if accept is not None:
            accept.cancel()
            if accept.done() and not accept.cancelled() and accept.exception() is None and accept.result():
                accept.result().close()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            log.info("link %d: the socket link offered is withdrawn: %s", self.owner, why)

    def take_ring_fields(self, message: pb.LinkRequest) -> RingOffer | None:
        """A message's feature-ring fields (`common.feature_ring`): the drafter's answer to the
        offer and its release of rows read (ValueError when they do not fit the ring), or its
        request for a ring, which returns the offer for the reply (None: none made)."""
        ring = self.ring
        if message.ring_refused:
            if ring is None or ring.mapped:
                raise RingError("ring_refused without a ring offered")
            ring.close()
            self.ring = None
            log.info("link %d: the drafter could not map the feature ring; its rows travel inline", self.owner)
        if message.HasField("ring_released"):
            if ring is None or ring is not self.ring:
                raise RingError("ring_released without a ring offered")
            if not ring.mapped:
                ring.answered(mapped=True)
                log.info("link %d: feature rows go through a shared-memory ring of %d MiB", self.owner,
                         ring.capacity >> 20)
            ring.release(message.ring_released)
        if not message.feature_ring or self._ring_offered or not self.config.feature_ring_mb:
            return None
        self._ring_offered = True
        if sum(link.ring is not None for link in self.peers) >= MAX_FEATURE_RINGS:
            log.warning("link %d: no feature ring (%d links hold one already); its rows travel inline", self.owner,
                        MAX_FEATURE_RINGS)
            return None
        try:
            self.ring = RingWriter(self.config.feature_ring_mb << 20, self.config.feature_ring_dir or default_dir())
        except OSError as exc:
            log.warning("link %d: no feature ring (%s); its rows travel inline", self.owner, exc)
            return None
        return self.ring.offer()

    async def _write(self, pending: asyncio.Queue) -> None:
        """Write each message's reply in order, after its notice (first tokens) when there is one.
        Through the socket link, the thread that encodes the reply the writer waits for sends it
        at once (`send_in_turn`); the writer then sends what the socket did not take."""
        while (job := await pending.get()) is not None:
            if job.notice is not None and (notice := await job.notice) is not None:
                await self._send(notice)
            with self._turn_lock:
                self._turn = job
            try:
                reply = await job.future
            finally:
                with self._turn_lock:
                    self._turn = None
            # (The session timers count each session's unanswered entries, so a next message
            # heard before this reply is noted, its frame being out already, changes nothing.)
            self.timers.answered(reply, time.monotonic())
            if job.unsent is None:
                await self._send(reply.data)
            else:
                await self.socket.write_rest(job.unsent)
            self.messages += 1

    def send_in_turn(self, job: LinkStep, data: bytes) -> None:
        """Send a reply's frame through the socket link from the calling thread (the model
        worker's), when the writer waits for exactly this reply: every reply before it is out, and
        the writer writes nothing until this one's future is resolved. Else the writer sends it."""
        with self._turn_lock:
            if self._turn is job and self.socket is not None:
                job.unsent = self.socket.send_now(data)

    async def _send(self, data: bytes) -> None:
        """A reply or notice, by the way the messages come (the replies to a link's messages all
        follow its switch to the socket link: the drafter sends nothing between hello and switch)."""
        if self.socket is not None:
            await self.socket.write(data)
        else:
            await self.context.write(data)

    def _close_expired(self) -> None:
        """Close the sessions whose timers ran out (one log line)."""
        unstarted, idle = self.timers.expire(time.monotonic())
        if unstarted or idle:
            log.warning("link %d: closing %d sessions opened without a tree for %g s (open timeout) and %d with no "
                        "message for %g s (idle timeout)", self.owner, len(unstarted), self.timers.open_timeout_s,
                        len(idle), self.config.idle_timeout_s)
            self.worker.close_sessions(self.owner, unstarted + idle)


def verifier_info(verifier: TreeVerifier, config: VerifierConfig) -> pb.InfoResponse:
    """What a verifier tells drafters about itself (InfoResponse), less its live load
    (free_sessions, busy_s): for the Info RPC, and for a drafter's in-process verifier."""
    model = verifier.runner.model
    cfg = model.full_cfg  # the whole target's, also under tensor parallelism
    return pb.InfoResponse(
        architecture=cfg.architecture, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers, dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        config_fingerprint=cfg.fingerprint(), feature_layer_ids=model.feature_layer_ids,
        feature_projection=model.feature_projection.fingerprint() if model.feature_projection is not None else "",
        device_id=device_id(model.embed_tokens.weight.device),
        max_seq_len=config.max_seq_len, max_sessions=config.max_sessions,
        max_tree_nodes=config.max_tree_nodes,
        verify_costs=[pb.VerifyCost(batch=b, tokens=t, seconds=seconds)
                      for (b, t), seconds in sorted(verifier.verify_costs.items())],
        sampling=config.sampling, deterministic=config.deterministic, feature_wire=verifier.runner.feature_wire,
        token_bias=True, penalties=True, columns=True,
    )


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, worker: ModelWorker, config: VerifierConfig):
        self.worker, self.config = worker, config
        self._info = verifier_info(worker.verifier, config)
        self._links = 0
        self.stopping = False  # set on shutdown (Info says `draining`): links cancelled from then on were cut
        self.stalled = False  # set while the model worker makes no progress (`VerifierServer.watch_worker`)
        self.links: set[_Link] = set()  # running

    def cut_links(self) -> None:
        """End every running link with UNAVAILABLE (shutdown, after the drain)."""
        for link in self.links:
            link.cut.set()

    async def Info(self, request: bytes, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        try:
            decode_message(pb.InfoRequest, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.stalled:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model worker has made no progress for "
                                                             f"{self.worker.stalled_s:.0f} s")
        reply = pb.InfoResponse()
        reply.CopyFrom(self._info)
        reply.free_sessions = self.worker.free_sessions
        reply.busy_s = self.worker.busy_s
        reply.draining = self.stopping
        return reply

    async def Link(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """Serve one drafter link; its messages arrive as bytes (`add_raw_servicer`) and `_Link` parses them."""
        self._links += 1
        link = _Link(context, self.worker, self.config, self._links, self.links)
        log.info("link %d opened by %s", link.owner, context.peer())
        reason = "?"
        self.links.add(link)
        try:
            reason = await link.run()
        except asyncio.CancelledError:
            reason = ("cancelled by the verifier's shutdown" if self.stopping else
                      "cancelled by the drafter (or its deadline passed)")
            raise
        except Exception as exc:
            error = exc if isinstance(exc, VerifierError) else self._internal(exc)
            reason = f"{error.status}: {error.message}"
            await context.abort(grpc.StatusCode.__members__.get(error.status, grpc.StatusCode.UNKNOWN), error.message)
        finally:
            self.links.discard(link)
            self.worker.close_owner(link.owner)
            log.info("link %d closed after %d messages: %s", link.owner, link.messages, reason)

    @staticmethod
    def _internal(exc: Exception) -> VerifierError:
        log.exception("Link failed unexpectedly")
        return VerifierError("INTERNAL", f"internal error in the verifier ({type(exc).__name__}); see its log")


class VerifierServer:
    """A running verifier: the gRPC server, its model worker and its health status."""

    DRAIN_POLL_S = 0.05  # how often a drain looks whether the last session has closed
    FLUSH_S = 1.0  # after the drain: the most the links cut may take to send their status
    STOP_WORKER_S = 10.0  # then the most the model worker may take to stop (a hung one is left behind)

    def __init__(self, server: grpc.aio.Server, servicer: VerifierServicer, health: health_aio.HealthServicer,
                 port: int):
        self.server, self.servicer, self.health, self.port = server, servicer, health, port
        self.worker = servicer.worker
        self.metrics: metrics.MetricsServer | None = None  # the /metrics endpoint, when served
        self._cut = asyncio.Event()  # ends a drain early (`cut`)
        self._watch: asyncio.Task | None = None  # `watch_worker`, when started

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then stop. Health reports NOT_SERVING and Info `draining`, new sessions are refused
        with UNAVAILABLE (a drafter opens them on another replica), and the open ones run on, over
        links that stay connected on a port that stays open, until none is left or `grace` seconds
        pass (or `cut`); then the links left end with UNAVAILABLE "the verifier is shutting down"
        and the worker stops (one that does not within `STOP_WORKER_S`, a hung one, is left
        behind). The stall watch goes on meanwhile. Later calls do nothing."""
        if self.servicer.stopping:
            return
        self.servicer.stopping = True
        metrics.VERIFIER_DRAINING.set(1)
        self.worker.verifier.draining = True
        await self.health.enter_graceful_shutdown()
        began = time.monotonic()
        left = await self._drain(grace or 0.0)
        if left:
            log.warning("%s with %d sessions open: their links are cut",
                        "a second signal came" if self._cut.is_set() else "the grace ended", left)
        elif grace:
            log.info("drained in %.1f s", time.monotonic() - began)
        self.servicer.cut_links()
        await self.server.stop(self.FLUSH_S)  # returns once the links cut have sent their status
        if self._watch is not None:
            self._watch.cancel()
        if not await asyncio.to_thread(self.worker.stop, self.STOP_WORKER_S):
            log.error("the model worker did not stop within %g s (a hung device?): leaving it behind",
                      self.STOP_WORKER_S)
        if self.metrics is not None:
            await self.metrics.stop()

    async def watch_worker(self, stall_s: float) -> None:
        """Turn health NOT_SERVING (and Info UNAVAILABLE) while the model worker has work and has
        made no progress for `stall_s` seconds, and back once it does (a log line each way): an
        orchestrator's health check and the drafters' stall probe then see a hung device."""
        servicer = self.servicer
        while True:
            await asyncio.sleep(min(1.0, stall_s / 4))
            stalled = self.worker.stalled_s > stall_s
            if stalled == servicer.stalled:
                continue
            servicer.stalled = stalled
            if stalled:
                log.error("the model worker has made no progress for %.0f s with work pending (a hung device?): "
                          "not serving until it does", self.worker.stalled_s)
            else:
                log.warning("the model worker makes progress again%s", "" if servicer.stopping else ": serving")
            if servicer.stopping:  # health stays NOT_SERVING; Info still fails while stalled
                continue
            status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
            for service in ("", VERIFIER_SERVICE):
                await self.health.set(service, status)

    def cut(self) -> None:
        """End a drain now (a second SIGTERM): the sessions still open are cut."""
        self._cut.set()

    async def _drain(self, grace: float) -> int:
        """Wait until the verifier holds no session, for at most `grace` seconds; the sessions left."""
        deadline = time.monotonic() + grace
        if (left := self.worker.verifier.num_sessions) and grace > 0:
            log.info("draining: %d sessions open, new ones refused; waiting up to %g s for them to end", left, grace)
        while (left := self.worker.verifier.num_sessions) and time.monotonic() < deadline and not self._cut.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cut.wait(), min(self.DRAIN_POLL_S, deadline - time.monotonic()))
        return left

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve(config: VerifierConfig, verifier: TreeVerifier | None = None,
                metrics_port: int | None = None) -> tuple[VerifierServer, int]:
    """Start a verifier and return it with its bound port (config.port 0 picks a free one);
    given `metrics_port` (0 = any free port; the CLI passes --metrics-port unless 0) also
    Prometheus /metrics on config.host (`VerifierServer.metrics.port`).

    Loads the model unless `verifier` is given (off the event loop). Raises CheckpointError
    or ValueError for a bad configuration, OSError when the address cannot be bound.
    """
    config.check()
    if verifier is None:
        verifier = await asyncio.to_thread(load_verifier, config)
    worker = ModelWorker(verifier)
    worker.start()
    try:
        servicer = VerifierServicer(worker, config)
        server, port, health = await start_grpc_server(servicer, VERIFIER_SERVICE, config.host, config.port,
                                                       config.max_receive_bytes(), tls=config.tls)
    except BaseException:
        await asyncio.to_thread(worker.stop)
        raise
    running = VerifierServer(server, servicer, health, port)
    if config.stall_timeout_s > 0:
        running._watch = asyncio.create_task(running.watch_worker(config.stall_timeout_s))
    metrics.VERIFIER_KV_SLOTS.set(verifier.runner.num_slots)
    metrics.VERIFIER_SESSIONS.set_function(lambda: verifier.num_sessions)  # a dict's length: read at scrape time
    metrics.VERIFIER_STALLED.set_function(lambda: worker.stalled_s)
    metrics.VERIFIER_DRAINING.set(0)
    if metrics_port is not None:
        try:
            running.metrics = await metrics.serve_metrics(config.host, metrics_port)
        except BaseException:
            await running.stop(0)
            raise
    log.info("verifier ready on %s:%d: %s", config.host, port, startup_summary(verifier))
    return running, port
