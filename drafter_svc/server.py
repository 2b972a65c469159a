"""The drafter's gRPC server: the public Generation API.

A Generate call only parses and validates the request (in a worker thread: a long prompt
takes seconds to tokenise, and one past max_prompt_bytes is refused before that), submits it
to the `DraftScheduler` (which owns the draft model and the verifier link, and batches every
session into one draft step and one link message per step) and streams what the scheduler delivers: deliveries
come back to the event loop through an asyncio queue, so the handlers never wait on the
model. Stop strings are cut here (`TextStream`), and the scheduler ends the session in the
round that completes one (`_StopWatch`, on its thread), so no round runs past a stop.

`GenerationService.generate` is that one path, shared by the gRPC servicer and the
OpenAI-compatible HTTP API (`drafter_svc.http_api`, on `--http-port`), and counts the request
metrics (`common.metrics`).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from common.auth import ApiKeyInterceptor
from common import metrics
from common.checkpoint import load_tokenizer
from common.cli import fail
from common.config import load_draft_config, load_target_config
from common.devices import device_id
from common.feature_wire import feature_reader
from common.grpc_server import MIB, start_grpc_server
from common.logs import memory_summary
from common.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, ContextTooLong, StatusError, TokenLogprob
from common.rpc import GENERATION_SERVICE, decode_message, pb, pb_grpc
from common.tls import ChannelTls, ServerTls
from common.wire import decode_sampling
from ddtree_kernels import pdl
from drafter_svc.budget import BudgetPlanner
from drafter_svc.chat import ChatPrompt, ChatTemplate, load_chat_template
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.oracle import ControlledAcceptance
from drafter_svc.link import GrpcLink, LocalLink, check_verifier, open_channel, verifier_stub
from drafter_svc.replicas import Replica, ReplicaLink, State, check_replica, verifier_addresses, wait_for_verifier
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.session import GenerationConfig, GenerationResult, QueueFull, RoundUpdate
from drafter_svc.text_stream import TextStream
from verifier_svc import __main__ as verifier_cli
from verifier_svc.server import VerifierConfig, load_verifier, verifier_info

log = logging.getLogger("drafter_svc")
LOCAL = "local"  # --verifier local: the target in this process (`_local_link`)


@dataclass(frozen=True)
class DrafterConfig:
    """Every drafter setting, with its default; the CLI and env vars fill it."""
    draft_dir: str = ""
    target_dir: str = ""
    verifier: str = "localhost:50051"  # HOST:PORT[,HOST:PORT...], or "local": the target in this process
    # --verifier local: the in-process verifier's settings (the verifier service's flags); None =
    # its defaults for --target and --draft, on --device, with --max-concurrent sessions.
    local_verifier: VerifierConfig | None = None
    host: str = "0.0.0.0"
    port: int = 50050
    device: str = "cpu"
    dtype: str = "auto"
    tree_budget: int = 15            # drafted nodes a tree (with the root, 16 tokens: a verifier tree bucket)
    chain: bool = False
    max_new_tokens: int = 128        # used when a request leaves it unset
    max_concurrent: int = 64         # sessions drafting at once (draft context slots); more wait in the queue
    max_message_mb: int = 8          # inbound message cap of the public API in MiB (larger: RESOURCE_EXHAUSTED)
    max_prompt_bytes: int = 4 << 20  # text prompts (and rendered chats) past this many UTF-8 bytes are not tokenised
    verifier_wait_s: float = 60.0    # how long start-up waits for the verifier
    queue_timeout_s: float = 30.0    # how long a request waits for a free session slot
    max_queue: int = 256             # requests waiting beyond the free slots; more get RESOURCE_EXHAUSTED at once
    # Prompt tokens one step may prefill, over every session: longer prompts go in chunks over
    # several steps, so that a long prompt stalls the others' rounds by one chunk at most (0 = no limit).
    prefill_chunk: int = 1024
    # While no session decodes (no round waits for a chunk), prompt tokens one step may prefill,
    # when more than prefill_chunk: a prompt up to this long in one piece, its first token after one
    # forward instead of one per chunk (0 = prefill_chunk). Off by default: on the CPU a 2,048-token
    # prompt's first token came up to 28% later in one piece than in two chunks (bench/RESULTS.md);
    # not measured on a GPU.
    prefill_chunk_idle: int = 0
    # While no session decodes, a prompt's next chunks may go this many messages ahead of the reply
    # to its earlier ones, so that the verifier prefills one while the last sends its features back.
    prefill_ahead: int = 1
    recovery_timeout_s: float = 30.0  # after a lost verifier link, how long sessions try to re-open (0 = fail)
    grace_s: float = 25.0  # on SIGTERM, how long running generations may finish (compose waits 30 s)
    trace_console: bool = False
    cuda_graphs: bool = True         # on CUDA, replay captured graphs for the draft step (False = eager)
    # "on": `pipeline_groups` link messages in flight, each with that share of the sessions; "off": lockstep rounds;
    # "auto": on when the draft runs on a GPU; on the verifier's own GPU only from
    # `shared_gpu_pipeline_sessions` running sessions (below that, two half-size verify passes
    # on one device cost more than the host work they hide; on an H100 lockstep gave 1.23-1.42x the
    # pipelined throughput at 16 sessions, 1.02-1.11x at 32, and the two were even at 64), or 16
    # while no session drafts (`DraftScheduler.PLAIN_PIPELINE_SESSIONS`); off on a CPU.
    pipelining: str = "auto"
    shared_gpu_pipeline_sessions: int = 64
    pipeline_groups: int = 2  # pipelined: link messages in flight, each with 1 / this of the sessions
    # Ask each verifier for a shared-memory ring for its replies' feature rows (`common.feature_ring`):
    # on the verifier's host they then skip gRPC; elsewhere the drafter refuses the ring.
    feature_ring: bool = True
    # Ask each verifier, as each link begins, for a Unix socket for its messages (`common.socket_link`):
    # on the verifier's host they then skip gRPC; elsewhere the drafter cannot connect and keeps gRPC.
    unix_socket: bool = True
    # "auto"/"on": each step's DDTrees are cut to the budget that the verifier's cost table and
    # the observed acceptance promise the most tokens per second for (`drafter_svc.budget`;
    # a request's tree_budget is then a cap); "auto" falls back to the fixed budget when the
    # verifier sends no cost table, "on" refuses to start. "off": every request's budget as given.
    adaptive_budget: str = "auto"
    bench_oracle: str = ""           # benchmarks only: controlled-acceptance file (drafter_svc.oracle)
    http_port: int = 0               # the OpenAI-compatible HTTP API and /metrics; 0 = no HTTP server
    served_model_name: str = ""      # the model id of the HTTP API; "" = the target folder's name
    tls: ServerTls = ServerTls()     # the public port: plaintext, TLS, or mutual TLS (--tls-*)
    verifier_tls: ChannelTls = ChannelTls(flag_prefix="--verifier-")  # the link: plaintext or (m)TLS
    api_key: str = field(default="", repr=False)  # set = Generation calls need "authorization: Bearer <key>"
    log_level: str = "INFO"          # DEBUG, INFO, WARNING or ERROR (common.logs)
    log_format: str = "text"         # text lines, or json: one object per line


    def budget_planner(self, info: pb.InfoResponse) -> BudgetPlanner | None:
        """The adaptive budget's planner over the verifier's cost table, or None (fixed budgets)."""
        if self.adaptive_budget not in ("auto", "on", "off"):
            raise ValueError(f"adaptive_budget must be auto, on or off, got {self.adaptive_budget!r}")
        if self.adaptive_budget == "off" or (self.adaptive_budget == "auto" and not info.verify_costs):
            return None
        if not info.verify_costs:
            raise StatusError("FAILED_PRECONDITION", "--adaptive-budget on needs a verifier that measures its verify "
                                                     "costs (start it with --measure-costs on)")
        if len(info.verify_costs) > 4096:
            raise StatusError("FAILED_PRECONDITION", f"the verifier sent {len(info.verify_costs)} verify costs")
        try:
            return BudgetPlanner({(c.batch, c.tokens): c.seconds for c in info.verify_costs})
        except ValueError as exc:
            raise StatusError("FAILED_PRECONDITION", f"the verifier's cost table: {exc}") from None

    @property
    def model_name(self) -> str:
        """The model id the HTTP API lists and answers with."""
        return self.served_model_name or Path(self.target_dir).resolve().name or "target"

    def pipelined(self, verifier_device_id: str) -> bool:
        """Whether to pipeline rounds (from `pipeline_min_sessions` sessions on), given the
        verifier's InfoResponse.device_id. Never with an in-process verifier: on one H200 at 8B
        dimensions its pipelined rounds were no faster than lockstep ones (bench/RESULTS.md)."""
        if self.pipelining not in ("auto", "on", "off"):
            raise ValueError(f"pipelining must be auto, on or off, got {self.pipelining!r}")
        if self.verifier == LOCAL:
            if self.pipelining == "on":
                raise ValueError("--pipelining on needs a verifier service: with --verifier local rounds go in lockstep")
            return False
        if self.pipelining != "auto":
            return self.pipelining == "on"
        return self.device.startswith("cuda")

    def pipeline_min_sessions(self, verifier_device_id: str) -> int:
        """The running sessions from which pipelined rounds split into two halves."""
        if self.shared_gpu_pipeline_sessions < 2:
            raise ValueError(f"shared_gpu_pipeline_sessions must be >= 2, got {self.shared_gpu_pipeline_sessions}")
        shared = self.device.startswith("cuda") and device_id(self.device) == verifier_device_id
        return self.shared_gpu_pipeline_sessions if self.pipelining == "auto" and shared else 2


@dataclass
class _Request:
    prompt_ids: list[int]
    config: GenerationConfig
    stop: list[str]


def _remote_link(cfg: DrafterConfig, torch_dtype, target_cfg, draft_cfg
                 ) -> tuple[ReplicaLink, pb.InfoResponse, DFlashProposer, list[grpc.Channel]]:
    """Wait for a verifier replica that serves our target, load the draft with one context slot per
    session the replicas admit, and link every replica (the others join as they answer)."""
    addresses = verifier_addresses(cfg.verifier, cfg.verifier_tls)
    channels = [open_channel(a.address, a.tls) for a in addresses]
    stubs = [verifier_stub(channel) for channel in channels]
    try:
        # The first replica to answer (and serve our target) sets what the others must match.
        first, info, refused = wait_for_verifier([a.address for a in addresses], stubs, cfg.verifier_wait_s,
                                                 lambda answer: check_verifier(answer, target_cfg, draft_cfg))
        # One context slot per session that can be drafting at once: the verifiers admit no more
        # (replicas are taken to be alike).
        slots = max(1, min(info.max_sessions * (len(addresses) - len(refused)), cfg.max_concurrent))
        proposer = _load_proposer(cfg, torch_dtype, info, slots)
    except BaseException:
        for channel in channels:
            channel.close()
        raise

    def check(answer: pb.InfoResponse) -> None:  # a replica that (re)answers must serve as the first does
        check_verifier(answer, target_cfg, draft_cfg)
        check_replica(info, answer)

    # Each reply's feature rows go to the draft's device in one copy (unpacked there under --feature-wire fp8).
    features = feature_reader(info.feature_wire, proposer.device, proposer.draft.fc.weight.dtype)
    link = ReplicaLink([Replica(a.address, GrpcLink(stub, vocab_size=info.vocab_size, feature_dim=proposer.feature_dim,
                                                    max_seq_len=info.max_seq_len, features=features,
                                                    feature_ring=cfg.feature_ring, unix_socket=cfg.unix_socket),
                                functools.partial(stub.Info, pb.InfoRequest(), timeout=2.0),
                                State.UP if i == first else State.REFUSED if i in refused else State.NEW,
                                info.max_sessions if i == first else 0)
                        for i, (a, stub) in enumerate(zip(addresses, stubs))], check)
    return link, info, proposer, channels


def _load_proposer(cfg: DrafterConfig, torch_dtype, info: pb.InfoResponse, slots: int,
                   target_weights=None) -> DFlashProposer:
    """The draft with `slots` context slots, taking context rows when the verifier projects the
    features (InfoResponse.feature_projection), which it must do with this draft's weights."""
    proposer = DFlashProposer.from_pretrained(cfg.draft_dir, cfg.target_dir, cfg.device, torch_dtype,
                                              info.max_seq_len, slots, cfg.cuda_graphs,
                                              projected_features=bool(info.feature_projection),
                                              target_weights=target_weights)
    if info.feature_projection and info.feature_projection != proposer.projection_fingerprint():
        raise StatusError("FAILED_PRECONDITION", (
            f"the verifier projects features with another draft's fc + hidden_norm (fingerprint "
            f"{info.feature_projection}, this draft's {proposer.projection_fingerprint()}): start it with "
            f"--draft pointing at this draft, or with --raw-features"))
    return proposer


# The verifier service's flags that mean nothing in the drafter's process: its listening and
# shutdown, its link's bytes and flow, and ranks in processes of their own.
SERVICE_ONLY_FLAGS = ("--host", "--port", "--metrics-port", "--grace", "--max-inflight", "--max-message-mb",
                      "--feature-wire", "--tensor-parallel", "--tls-cert", "--tls-key", "--tls-client-ca")


def local_verifier_config(cfg: DrafterConfig, flags: Sequence[str] = ()) -> VerifierConfig:
    """The in-process verifier's settings: the drafter's target, draft, device, dtype and
    concurrency, then `flags` (`python -m verifier_svc` flags: the service's own parser, checks
    and VERIFIER_* fallbacks; a bad one, or one of `SERVICE_ONLY_FLAGS`, exits with one line)."""
    moot = [f for f in flags if f.split("=", 1)[0] in SERVICE_ONLY_FLAGS]
    if moot:
        fail(f"--local-verifier-flags: {', '.join(moot)} would have no effect: with --verifier local the "
             "verifier runs in this process (no port, link or ranks of its own)")
    dtype = [] if cfg.dtype == "auto" else ["--dtype", cfg.dtype]
    return verifier_cli.parse_config(["--target", cfg.target_dir, "--draft", cfg.draft_dir, "--device", cfg.device,
                                      *dtype, "--max-sessions", str(cfg.max_concurrent), *flags])


def _local_link(cfg: DrafterConfig, torch_dtype) -> tuple[LocalLink, pb.InfoResponse, DFlashProposer]:
    """`--verifier local`: the target in this process, on the draft's device (`cfg.local_verifier`,
    the verifier service's settings), linked in memory: one CUDA context, no gRPC, no codec. Its
    steps run on the scheduler's thread, in lockstep rounds (`DrafterConfig.pipelined`)."""
    vcfg = cfg.local_verifier or local_verifier_config(cfg)
    verifier = load_verifier(vcfg)
    link = LocalLink(verifier)  # before the Info: its features stay on the device, never packed
    info = verifier_info(verifier, vcfg)
    model = verifier.runner.model
    proposer = _load_proposer(cfg, torch_dtype, info, max(1, min(info.max_sessions, cfg.max_concurrent)),
                              (model.embed_tokens.weight, model.lm_head.weight))
    return link, info, proposer


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of any one token's text (0: a tokenizer without a
    vocabulary to read): each vocabulary entry's own UTF-8, which is at least the bytes of the
    text it stands for (a byte-level BPE entry writes each byte as one character of one or two)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(piece.encode("utf-8")) for piece in vocab), default=0)


class DrafterEngine:
    """Draft model, tokenizer, verifier link and the scheduler shared by all requests."""

    def __init__(self, cfg: DrafterConfig, scheduler: DraftScheduler, tokenizer, channels: list[grpc.Channel],
                 info: pb.InfoResponse, chat_template: ChatTemplate):
        self.cfg, self.scheduler, self.tokenizer = cfg, scheduler, tokenizer
        self.channels = channels  # one per verifier replica
        self.info = info  # the first replica's
        self.chat_template = chat_template
        self.vocab_size = info.vocab_size
        self.longest_token_bytes = longest_token_bytes(tokenizer)

    @classmethod
    def start(cls, cfg: DrafterConfig, torch_dtype) -> "DrafterEngine":
        """Load the draft, wait for a verifier replica, check it serves our target, start the scheduler
        over every replica (`drafter_svc.replicas`: the others join as they answer); with
        `--verifier local`, load the target here instead (`_local_link`)."""
        target_cfg = load_target_config(cfg.target_dir)
        draft_cfg = load_draft_config(cfg.draft_dir)
        tokenizer = load_tokenizer(cfg.target_dir)
        chat_template = load_chat_template(cfg.target_dir)
        if cfg.verifier == LOCAL:
            link, info, proposer = _local_link(cfg, torch_dtype)
            channels = []
        else:
            link, info, proposer, channels = _remote_link(cfg, torch_dtype, target_cfg, draft_cfg)
        slots = proposer.pool.num_slots - 1
        hook = ControlledAcceptance.load(cfg.bench_oracle) if cfg.bench_oracle else None
        scheduler = DraftScheduler(link, proposer, max_sessions=slots,
                                   feature_layer_ids=draft_cfg.target_layer_ids,
                                   eos_token_ids=target_cfg.eos_token_ids, queue_timeout_s=cfg.queue_timeout_s,
                                   logits_hook=hook, pipelined=cfg.pipelined(info.device_id),
                                   pipeline_min_sessions=cfg.pipeline_min_sessions(info.device_id),
                                   pipeline_groups=cfg.pipeline_groups,
                                   recovery_timeout_s=cfg.recovery_timeout_s, planner=cfg.budget_planner(info),
                                   adapt_sampled=info.sampling == "keyed", max_queue=cfg.max_queue,
                                   prefill_chunk=cfg.prefill_chunk, prefill_ahead=cfg.prefill_ahead,
                                   prefill_chunk_idle=cfg.prefill_chunk_idle)
        plain = scheduler.PLAIN_PIPELINE_SESSIONS
        log.info("rounds %s (--pipelining %s; verifier %son %s); tree budget %s",
                 f"pipelined in {scheduler.pipeline_groups} groups from {scheduler.pipeline_min_sessions} sessions"
                 + (f" ({plain} while none drafts)" if scheduler.pipeline_min_sessions > plain else "")
                 if scheduler.pipelined
                 else "in lockstep", cfg.pipelining, "in this process " if cfg.verifier == LOCAL else "",
                 info.device_id or "?",
                 "adaptive (requests' budgets are caps)" if scheduler.planner else "as each request sets it")
        scheduler.start()
        return cls(cfg, scheduler, tokenizer, channels, info, chat_template)

    def summary(self) -> str:
        """The start-up line's facts: device, dtype, draft context slots, CUDA graphs, memory."""
        proposer = self.scheduler.proposer
        if proposer is None:
            return f"no draft model, verifier {self.cfg.verifier}"
        pool = proposer.pool
        graphs = proposer.graphs.num_graphs if proposer.graphs is not None else 0
        return (f"device {proposer.device}, dtype {str(pool.kv.dtype).removeprefix('torch.')}, "
                f"{pool.num_slots - 1} draft context slots x {pool.capacity} positions, "
                f"{graphs} draft CUDA graphs{'' if graphs else ' (eager)'}, kernels: {pdl.describe(proposer.device)}, "
                f"verifier {self.cfg.verifier} "
                f"({self.info.max_sessions} sessions x {self.info.max_seq_len} tokens), {memory_summary(proposer.device)}")

    def stop(self) -> None:
        self.scheduler.stop()
        for channel in self.channels:
            channel.close()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids; ValueError, before tokenising, past max_prompt_bytes (tokenising
        takes about a second per MB). Through `encode_batch`, which lets go of the interpreter lock
        while it works (`encode` holds it: a long prompt would stall the event loop's every stream
        and health check, though it runs in a worker thread)."""
        size = len(text.encode("utf-8"))
        if size > self.cfg.max_prompt_bytes:
            raise ValueError(f"prompt of {size} bytes exceeds the server's limit of {self.cfg.max_prompt_bytes} bytes")
        # A text longer than the context's tokens at the longest token's bytes each cannot fit,
        # however it tokenises: refused without the seconds that tokenising it would take. (x 4:
        # a normaliser may write a character of up to 4 bytes as one of 1.)
        if self.longest_token_bytes and size > 4 * (self.info.max_seq_len - 1) * self.longest_token_bytes:
            raise ContextTooLong(f"prompt of {size} bytes cannot fit the verifier's max_seq_len {self.info.max_seq_len}: "
                                 f"no token holds more than {self.longest_token_bytes} bytes", "prompt")
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def parse(self, request: pb.GenerateRequest) -> _Request:
        """Validate a request; ValueError with a one-line message when it is bad (ContextTooLong, a
        StatusError, when it overflows a session's context). It may take seconds (a long prompt is
        tokenised): call it off the event loop."""
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
            raise ContextTooLong(f"prompt of {len(prompt_ids)} tokens does not fit the verifier's max_seq_len "
                                 f"{self.info.max_seq_len}", "prompt")
        if len(request.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in request.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters "
                             f"each, got {len(request.stop)} of up to {max(len(s) for s in request.stop)}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        # A session holds max_seq_len tokens in its cache, and its last token needs none.
        fits = self.info.max_seq_len + 1 - len(prompt_ids)
        if request.HasField("max_new_tokens") and request.max_new_tokens > fits:
            raise ContextTooLong(f"max_new_tokens {request.max_new_tokens} and a prompt of {len(prompt_ids)} tokens "
                                 f"exceed the verifier's max_seq_len {self.info.max_seq_len}: at most {fits} new "
                                 f"tokens fit", "max_new_tokens")
        if request.min_tokens > fits:
            raise ContextTooLong(f"min_tokens {request.min_tokens} and a prompt of {len(prompt_ids)} tokens exceed the "
                                 f"verifier's max_seq_len {self.info.max_seq_len}: at most {fits} new tokens fit",
                                 "min_tokens")
        # Unset: the server's default (at least min_tokens), which the context may cut short (finish
        # reason "length").
        max_new = (request.max_new_tokens if request.HasField("max_new_tokens")
                   else max(self.cfg.max_new_tokens, request.min_tokens))
        budget = request.tree_budget if request.HasField("tree_budget") else self.cfg.tree_budget
        if budget > self.info.max_tree_nodes - 1:
            raise ValueError(f"tree_budget {budget} exceeds the verifier's limit of {self.info.max_tree_nodes - 1}")
        mode = DraftMode("chain", 0) if self.cfg.chain and not request.HasField("tree_budget") else DraftMode("tree", budget)
        config = GenerationConfig(max_new_tokens=max_new, sampling=decode_sampling(request.sampling),
                                  stop_token_ids=tuple(request.stop_token_ids), mode=mode,
                                  logprobs=request.logprobs if request.HasField("logprobs") else None,
                                  ignore_eos=request.ignore_eos, min_tokens=request.min_tokens,
                                  logit_bias=tuple(sorted(request.logit_bias.items())))
        bad = [t for t, _ in config.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        config.check()
        return _Request(prompt_ids, config, list(request.stop))


class _StopWatch:
    """A delivery callback for a request with stop strings: it follows the text on the
    scheduler's thread (a TextStream of its own, so the same decision as the handler's) and
    tells the scheduler when a stop string has matched, before another round is drafted."""

    def __init__(self, text: TextStream, forward: Callable[[object], None]):
        self.text, self.forward = text, forward

    def __call__(self, item) -> bool:
        self.forward(item)
        if isinstance(item, RoundUpdate) and not self.text.stopped:
            self.text.push(item.tokens)
        return self.text.stopped


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


@dataclass
class TextDelta:
    """Newly final output: a round's delivered tokens and the text they completed (round -1: the
    text released at the end)."""
    tokens: list[int]
    text: str
    round: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them


@dataclass
class Finished:
    """A generation's end: the scheduler's result (its tokens cut at a stop string) and the prompt's length."""
    result: GenerationResult
    prompt_tokens: int


@dataclass
class RequestRecord:
    """What the drafter logs, in one line, when a request ends (however it ends)."""
    request_id: str
    api: str
    arrived: float  # time.perf_counter()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    mean_acceptance: float | None = None  # known when the generation finished
    finish_reason: str = ""
    status: str = "CANCELLED"  # a gRPC status name; CANCELLED unless it ends otherwise
    error: str = ""

    def log(self) -> None:
        latency = time.perf_counter() - self.arrived
        ended = f"{self.status} {self.finish_reason}" if self.finish_reason else self.status
        if self.error:
            ended += f" ({self.error[:200]})"
        acceptance = f", mean acceptance {self.mean_acceptance:.2f}" if self.mean_acceptance is not None else ""
        fields = {"request_id": self.request_id, "api": self.api, "status": self.status,
                  "finish_reason": self.finish_reason or None, "prompt_tokens": self.prompt_tokens,
                  "completion_tokens": self.completion_tokens, "rounds": self.rounds,
                  "mean_acceptance": self.mean_acceptance, "latency_s": round(latency, 6)}
        # A client's mistake or leaving is routine; anything else failed on the server's side.
        level = logging.INFO if self.status in ("OK", "CANCELLED", "INVALID_ARGUMENT") else logging.WARNING
        log.log(level, "request %s (%s) %s: %d prompt + %d completion tokens, %d rounds%s, %.3f s", self.request_id,
                self.api, ended, self.prompt_tokens, self.completion_tokens, self.rounds, acceptance, latency,
                extra=fields)


class InFlight:
    """Work in progress on an event loop, counted so that a graceful stop can wait until none
    runs (for at most its grace)."""

    def __init__(self):
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until none runs, for at most `timeout` seconds; whether none does."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()


class GenerationService:
    """The one path of a generation request, shared by the gRPC servicer and the HTTP API:
    validate it (off the event loop), submit it to the scheduler, cut stop strings and yield
    what the scheduler delivers; the request metrics are counted here."""

    def __init__(self, engine: DrafterEngine):
        self.engine = engine
        self.draining = False  # set on shutdown: new requests get UNAVAILABLE, health reports not serving
        self._mailbox: _Mailbox | None = None
        self.running = InFlight()  # generations in progress, either API

    @property
    def serving(self) -> bool:
        """What health reports: the verifier answers and the drafter is not shutting down."""
        return self.engine.scheduler.link_up and not self.draining

    async def _parse(self, request: pb.GenerateRequest | bytes) -> _Request:
        """Decode and check a request in a worker thread, so that tokenising a long prompt stalls
        no other stream and no health check. StatusError INVALID_ARGUMENT when it is bad."""
        def parse() -> _Request:
            message = decode_message(pb.GenerateRequest, request) if isinstance(request, bytes) else request
            return self.engine.parse(message)
        try:
            return await asyncio.to_thread(parse)
        except ValueError as exc:
            raise StatusError("INVALID_ARGUMENT", str(exc)) from None

    async def generate(self, request: pb.GenerateRequest | bytes, api: str) -> AsyncIterator[TextDelta | Finished]:
        """Yield a TextDelta per round with new output, then one Finished. Raises StatusError for a
        bad request (INVALID_ARGUMENT, before anything is yielded) or a failed generation. `api`
        labels the metrics ("grpc", "http"). Close the generator to cancel the generation."""
        arrived = time.perf_counter()
        outcome = ("cancelled", "CANCELLED")  # unless it ends otherwise: the consumer went away
        record = RequestRecord(uuid.uuid4().hex[:16], api, arrived)
        self.running.enter()
        try:
            if self.draining:
                raise StatusError("UNAVAILABLE", "the drafter is shutting down")
            req = await self._parse(request)
            record.prompt_tokens = len(req.prompt_ids)
            metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
            async with contextlib.aclosing(self._run(req, arrived)) as items:  # closed with this one
                async for item in items:
                    if isinstance(item, GenerationResult):
                        outcome = (item.finish_reason, "OK")
                        record.status, record.finish_reason = "OK", item.finish_reason
                        record.completion_tokens, record.rounds = len(item.tokens), item.rounds
                        record.mean_acceptance = item.mean_acceptance
                        metrics.REQUEST_LATENCY.observe(time.perf_counter() - arrived)
                        yield Finished(item, len(req.prompt_ids))
                    else:
                        record.completion_tokens += len(item.tokens)
                        record.rounds = max(record.rounds, item.round)
                        metrics.GENERATED_TOKENS.inc(len(item.tokens))
                        yield item
        except StatusError as exc:
            outcome = ("none", exc.status)
            record.status, record.error = exc.status, exc.message
            raise
        except Exception as exc:  # unexpected: the request's line says what it was
            outcome = ("none", "INTERNAL")
            record.status, record.error = "INTERNAL", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            metrics.REQUESTS.labels(api, *outcome).inc()
            record.log()
            self.running.leave()

    async def _run(self, req: _Request, arrived: float) -> AsyncIterator[TextDelta | GenerationResult]:
        """Submit, then yield a TextDelta per round with new output, then the GenerationResult."""
        if self._mailbox is None:
            self._mailbox = _Mailbox(asyncio.get_running_loop())
        updates: asyncio.Queue = asyncio.Queue()
        scheduler = self.engine.scheduler
        try:
            deliver = functools.partial(self._mailbox.put, updates)
            if req.stop:  # ends the session in the round that completes a stop string
                deliver = _StopWatch(TextStream(self.engine.tokenizer, req.stop, req.config.min_tokens), deliver)
            sid = scheduler.submit(req.prompt_ids, req.config, deliver, watches_text=bool(req.stop))
        except ValueError as exc:
            raise StatusError("INVALID_ARGUMENT", str(exc)) from None
        metrics.ACTIVE_SESSIONS.inc()
        text = TextStream(self.engine.tokenizer, req.stop, req.config.min_tokens)
        finished = stopped = False
        last_round = 0.0  # when the last round with tokens arrived; 0 before the first token
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
                        yield TextDelta([], tail, -1)
                    if text.stopped:  # the result counts only the tokens up to the stop string's end
                        item.finish_reason = "stop"
                        item.tokens = item.tokens[:text.kept]
                        if item.logprobs is not None:
                            item.logprobs = item.logprobs[:text.kept]
                    yield item
                    return
                assert isinstance(item, RoundUpdate)
                if item.round > 0:
                    metrics.ROUNDS.inc()
                    metrics.ACCEPTED_TOKENS.inc(len(item.tokens))
                if stopped:  # a round delivered before the cancel took effect: dropped
                    continue
                tokens, delta = text.push(item.tokens)  # after a stop, the round's later tokens are dropped
                if tokens:
                    now = time.perf_counter()
                    if last_round:
                        metrics.observe_inter_token_latency(len(tokens), now - last_round)
                    else:
                        metrics.TIME_TO_FIRST_TOKEN.observe(now - arrived)
                    last_round = now
                if tokens or delta:
                    yield TextDelta(tokens, delta, item.round,
                                    item.logprobs[: len(tokens)] if item.logprobs is not None else None)
                if text.stopped:
                    stopped = True
                    scheduler.cancel(sid, "stop")  # the scheduler closes the session and sends the result
        finally:
            metrics.ACTIVE_SESSIONS.dec()
            if not finished:  # the client went away
                scheduler.cancel(sid)


class GenerationServicer(pb_grpc.GenerationServicer):
    """The gRPC Generation API over `GenerationService`."""

    def __init__(self, service: GenerationService):
        self.service = service

    @staticmethod
    def _final(end: Finished) -> pb.GenerateFinal:
        result = end.result
        return pb.GenerateFinal(
            finish_reason=result.finish_reason,
            usage=pb.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=len(result.tokens)),
            stats=pb.Stats(rounds=result.rounds, mean_acceptance=result.mean_acceptance,
                           time_to_first_token_s=result.time_to_first_token_s, tokens_per_s=result.tokens_per_s,
                           elapsed_s=result.elapsed_s, acceptance_lengths=result.acceptance_lengths,
                           round_stats=[pb.RoundStats(tokens=r.tokens, tree_nodes=r.tree_nodes, draft_ms=1e3 * r.draft_s,
                                                      build_ms=1e3 * r.build_s, verify_ms=1e3 * r.verify_s,
                                                      network_ms=1e3 * r.network_s) for r in result.round_stats]),
        )

    async def Generate(self, request: bytes, context):
        try:
            async with contextlib.aclosing(self.service.generate(request, "grpc")) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        yield pb.GenerateResponse(final=self._final(item))
                    else:
                        yield pb.GenerateResponse(delta=pb.TokenDelta(round=max(item.round, 0),
                                                                      token_ids=item.tokens, text=item.text,
                                                                      logprobs=encode_logprobs(item.logprobs)))
        except StatusError as exc:
            await _abort(context, exc)

    async def GenerateOnce(self, request: bytes, context):
        tokens, text = [], []
        try:
            async with contextlib.aclosing(self.service.generate(request, "grpc")) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        return pb.GenerateOnceResponse(token_ids=tokens, text="".join(text), final=self._final(item),
                                                       logprobs=encode_logprobs(item.result.logprobs))
                    tokens.extend(item.tokens)
                    text.append(item.text)
        except StatusError as exc:
            await _abort(context, exc)


def encode_logprobs(logprobs: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    """The public API's per-token logprobs (none when the request did not ask)."""
    return [pb.TokenLogprob(token_id=t.token, logprob=t.logprob,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in t.top]) for t in logprobs or ()]


async def _abort(context, exc: StatusError) -> None:
    """End the call with the error's status; a full queue's retry hint rides as `retry-after-ms`."""
    metadata = (("retry-after-ms", str(exc.retry_after_ms)),) if isinstance(exc, QueueFull) else ()
    await context.abort(grpc.StatusCode[exc.status], exc.message, trailing_metadata=metadata)


class DrafterServer:
    """A running drafter: the gRPC server, the HTTP API when enabled, the scheduler and health."""

    FLUSH_S = 1.0  # at the grace's end: how long the calls the scheduler failed have to send their status

    def __init__(self, server: grpc.aio.Server, health_servicer, service: GenerationService, http=None):
        self.server, self.health, self.service, self.engine = server, health_servicer, service, service.engine
        self.http = http  # drafter_svc.http_api.HttpServer, or None
        self.http_port = http.port if http is not None else 0
        self._stopping = False

    async def stop(self, grace: float | None = None) -> None:
        """Report not serving (health, on both ports, which stay open) and refuse new requests
        with UNAVAILABLE; give running ones `grace` seconds; then stop the scheduler, which fails
        those still running with UNAVAILABLE "the drafter is shutting down" (a gRPC call's status,
        an HTTP stream's error event or a 503), and close the ports. Later calls do nothing."""
        if self._stopping:
            return
        self._stopping = True
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        draining = [self.service.running.wait_idle(grace or 0.0)]
        if self.http is not None:
            draining.append(self.http.drain(grace or 0.0))
        await asyncio.gather(*draining)
        await asyncio.to_thread(self.engine.stop)
        await self.server.stop(self.FLUSH_S)  # the calls failed just now send their status
        if self.http is not None:
            await self.http.close()


async def serve(engine: DrafterEngine, host: str, port: int,
                http_port: int | None = None) -> tuple[DrafterServer, int]:
    """Start the Generation server (plus health and reflection) and, given `http_port` (0 = any
    free port), the OpenAI-compatible HTTP API on the same host; returns the server (its
    `http_port` is the HTTP one) and the bound gRPC port.

    The server owns the engine: it is stopped with it, or at once when the server cannot start
    (OSError: an address cannot be bound)."""
    from drafter_svc.http_api import serve_http  # it imports this module's domain types

    service = GenerationService(engine)
    http = None
    try:
        # An API key guards the Generation API only: health and reflection stay open.
        interceptors = (ApiKeyInterceptor(engine.cfg.api_key, (GENERATION_SERVICE,)),) if engine.cfg.api_key else ()
        server, bound, health_servicer = await start_grpc_server(
            GenerationServicer(service), GENERATION_SERVICE, host, port, engine.cfg.max_message_mb * MIB,
            tls=engine.cfg.tls, interceptors=interceptors)
        if http_port is not None:
            try:
                http = await serve_http(service, host, http_port)
            except BaseException:
                await server.stop(0)
                raise
    except BaseException:
        await asyncio.to_thread(engine.stop)
        raise
    loop = asyncio.get_running_loop()

    def link_state(up: bool) -> None:  # on the scheduler's thread
        metrics.VERIFIER_UP.set(1 if up else 0)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for service_name in ("", GENERATION_SERVICE):
            try:
                asyncio.run_coroutine_threadsafe(health_servicer.set(service_name, status), loop)
            except RuntimeError:  # the server's loop is gone: it is shutting down
                return

    # Health follows the verifier: NOT_SERVING while it does not answer (load balancers look elsewhere).
    # The HTTP API's /health reads the same state (GenerationService.serving).
    engine.scheduler.on_link_state = link_state
    metrics.VERIFIER_UP.set(1 if engine.scheduler.link_up else 0)
    if not engine.scheduler.link_up:
        link_state(False)
    served = f", HTTP on {host}:{http.port}" if http is not None else ""
    log.info("drafter ready on %s:%d%s: %s", host, bound, served, engine.summary())
    return DrafterServer(server, health_servicer, service, http), bound
