"""The drafter's gRPC server: the public Generation API.

A Generate call only parses and validates the request (in a worker thread: a long prompt
takes seconds to tokenise, and one past max_prompt_bytes is refused before that), submits it
to the `DraftScheduler` (which owns the draft model and the verifier link, and batches every
session into one draft step and one link message per step) and streams what the scheduler delivers: deliveries
come back to the event loop through an asyncio queue, so the handlers never wait on the
model. Stop strings are cut here (`TextStream`); the session is then cancelled.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from common.checkpoint import load_tokenizer
from common.config import load_draft_config, load_target_config
from common.devices import device_id
from common.grpc_server import MIB, start_grpc_server
from common.protocol import StatusError
from common.rpc import GENERATION_SERVICE, decode_message, pb, pb_grpc
from common.wire import decode_sampling
from drafter_svc.chat import ChatPrompt, ChatTemplate, load_chat_template
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.oracle import ControlledAcceptance
from drafter_svc.link import GrpcLink, check_verifier, open_channel, status_error
from drafter_svc.scheduler import DraftScheduler, GenerationConfig, GenerationResult, RoundUpdate
from drafter_svc.text_stream import TextStream

log = logging.getLogger("drafter_svc")


@dataclass(frozen=True)
class DrafterConfig:
    """Every drafter setting, with its default; the CLI and env vars fill it."""
    draft_dir: str = ""
    target_dir: str = ""
    verifier: str = "localhost:50051"
    host: str = "0.0.0.0"
    port: int = 50050
    device: str = "cpu"
    dtype: str = "auto"
    tree_budget: int = 16
    chain: bool = False
    max_new_tokens: int = 128        # used when a request leaves it unset
    max_concurrent: int = 64         # sessions drafting at once (draft context slots); more wait in the queue
    max_message_mb: int = 8          # inbound message cap of the public API in MiB (larger: RESOURCE_EXHAUSTED)
    max_prompt_bytes: int = 4 << 20  # text prompts (and rendered chats) past this many UTF-8 bytes are not tokenised
    verifier_wait_s: float = 60.0    # how long start-up waits for the verifier
    queue_timeout_s: float = 30.0    # how long a request waits for a free session slot
    recovery_timeout_s: float = 30.0  # after a lost verifier link, how long sessions try to re-open (0 = fail)
    grace_s: float = 25.0  # on SIGTERM, how long running generations may finish (compose waits 30 s)
    trace_console: bool = False
    cuda_graphs: bool = True         # on CUDA, replay captured graphs for the draft step (False = eager)
    # "on": two link messages in flight, each with half the sessions; "off": lockstep rounds;
    # "auto": on when the draft runs on a GPU other than the verifier's (on a CPU, or on the
    # verifier's own GPU, the two halves would only compete for the same device).
    pipelining: str = "auto"
    bench_oracle: str = ""           # benchmarks only: controlled-acceptance file (drafter_svc.oracle)


    def pipelined(self, verifier_device_id: str) -> bool:
        """Whether to pipeline rounds, given the verifier's InfoResponse.device_id."""
        if self.pipelining not in ("auto", "on", "off"):
            raise ValueError(f"pipelining must be auto, on or off, got {self.pipelining!r}")
        if self.pipelining != "auto":
            return self.pipelining == "on"
        return self.device.startswith("cuda") and device_id(self.device) != verifier_device_id


@dataclass
class _Request:
    prompt_ids: list[int]
    config: GenerationConfig
    stop: list[str]


class DrafterEngine:
    """Draft model, tokenizer, verifier link and the scheduler shared by all requests."""

    def __init__(self, cfg: DrafterConfig, scheduler: DraftScheduler, tokenizer, channel: grpc.Channel | None,
                 info: pb.InfoResponse, chat_template: ChatTemplate):
        self.cfg, self.scheduler, self.tokenizer, self.channel, self.info = cfg, scheduler, tokenizer, channel, info
        self.chat_template = chat_template
        self.vocab_size = info.vocab_size

    @classmethod
    def start(cls, cfg: DrafterConfig, torch_dtype) -> "DrafterEngine":
        """Load the draft, wait for the verifier, check it serves our target, start the scheduler."""
        target_cfg = load_target_config(cfg.target_dir)
        draft_cfg = load_draft_config(cfg.draft_dir)
        tokenizer = load_tokenizer(cfg.target_dir)
        chat_template = load_chat_template(cfg.target_dir)
        channel = open_channel(cfg.verifier)
        stub = pb_grpc.VerifierStub(channel)
        deadline = time.monotonic() + cfg.verifier_wait_s
        while True:
            try:
                info = stub.Info(pb.InfoRequest(), timeout=5.0, wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                if time.monotonic() >= deadline:
                    channel.close()
                    raise StatusError("UNAVAILABLE", f"verifier at {cfg.verifier} did not answer within "
                                                     f"{cfg.verifier_wait_s:.0f} s: {status_error(exc).message}")
        check_verifier(info, target_cfg, draft_cfg)
        # One context slot per session that can be drafting at once: the verifier admits no more.
        slots = max(1, min(info.max_sessions, cfg.max_concurrent))
        # A verifier that projects the features (InfoResponse.feature_projection) sends context rows.
        proposer = DFlashProposer.from_pretrained(cfg.draft_dir, cfg.target_dir, cfg.device, torch_dtype,
                                                  info.max_seq_len, slots, cfg.cuda_graphs,
                                                  projected_features=bool(info.feature_projection))
        if info.feature_projection and info.feature_projection != proposer.projection_fingerprint():
            channel.close()
            raise StatusError("FAILED_PRECONDITION", (
                f"the verifier projects features with another draft's fc + hidden_norm (fingerprint "
                f"{info.feature_projection}, this draft's {proposer.projection_fingerprint()}): start it with "
                f"--draft pointing at this draft, or with --raw-features"))
        link = GrpcLink(stub, vocab_size=info.vocab_size, feature_dim=proposer.feature_dim,
                        max_seq_len=info.max_seq_len)
        hook = ControlledAcceptance.load(cfg.bench_oracle) if cfg.bench_oracle else None
        scheduler = DraftScheduler(link, proposer, max_sessions=slots,
                                   feature_layer_ids=draft_cfg.target_layer_ids,
                                   eos_token_ids=target_cfg.eos_token_ids, queue_timeout_s=cfg.queue_timeout_s,
                                   logits_hook=hook, pipelined=cfg.pipelined(info.device_id),
                                   recovery_timeout_s=cfg.recovery_timeout_s)
        log.info("rounds %s (--pipelining %s; verifier on %s)", "pipelined" if scheduler.pipelined else "in lockstep",
                 cfg.pipelining, info.device_id or "?")
        scheduler.start()
        return cls(cfg, scheduler, tokenizer, channel, info, chat_template)

    def stop(self) -> None:
        self.scheduler.stop()
        if self.channel is not None:
            self.channel.close()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids; ValueError, before tokenising, past max_prompt_bytes (tokenising
        takes about a second per MB)."""
        size = len(text.encode("utf-8"))
        if size > self.cfg.max_prompt_bytes:
            raise ValueError(f"prompt of {size} bytes exceeds the server's limit of {self.cfg.max_prompt_bytes} bytes")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def parse(self, request: pb.GenerateRequest) -> _Request:
        """Validate a request; ValueError with a one-line message when it is bad. It may take
        seconds (a long prompt is tokenised): call it off the event loop."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            prompt_ids = self.tokenize(request.text)
        elif kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        elif kind == "chat":
            # The template writes the special tokens (BOS included), so none are added here, as in transformers.
            text = self.chat_template.render(ChatPrompt.from_proto(request.chat))
            prompt_ids = self.tokenize(text, add_special_tokens=False)
        else:
            raise ValueError("request has no prompt (set text, token_ids or chat)")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.info.max_seq_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the verifier's max_seq_len "
                             f"{self.info.max_seq_len}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else self.cfg.max_new_tokens
        budget = request.tree_budget if request.HasField("tree_budget") else self.cfg.tree_budget
        if budget > self.info.max_tree_nodes - 1:
            raise ValueError(f"tree_budget {budget} exceeds the verifier's limit of {self.info.max_tree_nodes - 1}")
        mode = DraftMode("chain", 0) if self.cfg.chain and not request.HasField("tree_budget") else DraftMode("tree", budget)
        config = GenerationConfig(max_new_tokens=max_new, sampling=decode_sampling(request.sampling),
                                  stop_token_ids=tuple(request.stop_token_ids), mode=mode)
        config.check()
        return _Request(prompt_ids, config, list(request.stop))


class _Mailbox:
    """Hands the scheduler's deliveries to the handlers' asyncio queues with one event-loop
    wake-up per batch of them (a step delivers to every session at once), not one per session."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, queue: asyncio.Queue, item) -> None:
        """Called on the scheduler's thread."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _flush(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: DrafterEngine):
        self.engine = engine
        self._mailbox: _Mailbox | None = None

    async def _parse(self, data: bytes, context) -> _Request:
        """Decode and check a request (it arrives as bytes: `add_raw_servicer`) in a worker thread,
        so that tokenising a long prompt stalls no other stream and no health check."""
        try:
            return await asyncio.to_thread(lambda: self.engine.parse(decode_message(pb.GenerateRequest, data)))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _run(self, req: _Request) -> AsyncIterator[tuple[list[int], str, int] | GenerationResult]:
        """Yield (tokens, text delta, round) per round, then the GenerationResult."""
        if self._mailbox is None:
            self._mailbox = _Mailbox(asyncio.get_running_loop())
        updates: asyncio.Queue = asyncio.Queue()
        scheduler = self.engine.scheduler
        sid = scheduler.submit(req.prompt_ids, req.config, functools.partial(self._mailbox.put, updates))
        text = TextStream(self.engine.tokenizer, req.stop)
        finished = stopped = False
        try:
            while True:
                item = await updates.get()
                if isinstance(item, StatusError):
                    finished = True
                    raise item
                if isinstance(item, GenerationResult):
                    finished = True
                    tail = text.finish()
                    if tail:
                        yield [], tail, -1
                    if text.stopped:  # the result counts only the tokens up to the stop string's end
                        item.finish_reason = "stop"
                        item.tokens = item.tokens[:text.kept]
                    yield item
                    return
                if stopped:  # a round delivered before the cancel took effect: dropped
                    continue
                assert isinstance(item, RoundUpdate)
                tokens, delta = text.push(item.tokens)  # after a stop, the round's later tokens are dropped
                if tokens or delta:
                    yield tokens, delta, item.round
                if text.stopped:
                    stopped = True
                    scheduler.cancel(sid, "stop")  # the scheduler closes the session and sends the result
        finally:
            if not finished:  # the client went away
                scheduler.cancel(sid)

    @staticmethod
    def _final(result: GenerationResult, prompt_len: int) -> pb.GenerateFinal:
        return pb.GenerateFinal(
            finish_reason=result.finish_reason,
            usage=pb.Usage(prompt_tokens=prompt_len, completion_tokens=len(result.tokens)),
            stats=pb.Stats(rounds=result.rounds, mean_acceptance=result.mean_acceptance,
                           time_to_first_token_s=result.time_to_first_token_s, tokens_per_s=result.tokens_per_s,
                           elapsed_s=result.elapsed_s, acceptance_lengths=result.acceptance_lengths),
        )

    async def Generate(self, request: bytes, context):
        req = await self._parse(request, context)
        try:
            async for item in self._run(req):
                if isinstance(item, GenerationResult):
                    yield pb.GenerateResponse(final=self._final(item, len(req.prompt_ids)))
                else:
                    tokens, delta, r = item
                    yield pb.GenerateResponse(delta=pb.TokenDelta(round=max(r, 0), token_ids=tokens, text=delta))
        except StatusError as exc:
            await context.abort(grpc.StatusCode[exc.status], exc.message)

    async def GenerateOnce(self, request: bytes, context):
        req = await self._parse(request, context)
        tokens, text = [], []
        try:
            async for item in self._run(req):
                if isinstance(item, GenerationResult):
                    return pb.GenerateOnceResponse(token_ids=tokens, text="".join(text),
                                                   final=self._final(item, len(req.prompt_ids)))
                tokens.extend(item[0])
                text.append(item[1])
        except StatusError as exc:
            await context.abort(grpc.StatusCode[exc.status], exc.message)


class DrafterServer:
    """A running drafter: the gRPC server, its scheduler and its health status."""

    def __init__(self, server: grpc.aio.Server, health_servicer, engine: DrafterEngine):
        self.server, self.health, self.engine = server, health_servicer, engine

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await asyncio.to_thread(self.engine.stop)


async def serve(engine: DrafterEngine, host: str, port: int) -> tuple[DrafterServer, int]:
    """Start the Generation server (plus health and reflection); returns it and its bound port.

    The server owns the engine: it is stopped with it, or at once when the server cannot start
    (OSError: the address cannot be bound)."""
    try:
        server, bound, health_servicer = await start_grpc_server(
            GenerationServicer(engine), GENERATION_SERVICE, host, port, engine.cfg.max_message_mb * MIB)
    except BaseException:
        await asyncio.to_thread(engine.stop)
        raise
    loop = asyncio.get_running_loop()

    def link_state(up: bool) -> None:  # on the scheduler's thread
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            try:
                asyncio.run_coroutine_threadsafe(health_servicer.set(service, status), loop)
            except RuntimeError:  # the server's loop is gone: it is shutting down
                return

    # Health follows the verifier: NOT_SERVING while it does not answer (load balancers look elsewhere).
    engine.scheduler.on_link_state = link_state
    if not engine.scheduler.link_up:
        link_state(False)
    return DrafterServer(server, health_servicer, engine), bound
