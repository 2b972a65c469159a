"""A request as the drafter's scheduler tracks it (`Session`), what the request asks for
(`GenerationConfig`) and what it is handed (`RoundUpdate`s, then a `GenerationResult` or a
`StatusError`: a `Delivery`). The scheduler (`drafter_svc.scheduler`) moves sessions through
their rounds; this module holds only their state and the rules that need no scheduler: where a
session's tokens stop, what room its next tree has, and its token counts for the penalties.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from common.penalties import TokenCounts
from common.protocol import BIAS_LIMIT, MAX_LOGPROBS, SamplingParams, StatusError, TokenBias, TokenLogprob
from common.tracing import tracer
from drafter_svc.drafter import DraftMode

_tracer = tracer("drafter_svc.scheduler")  # a request's `generate` span, beside the scheduler's own


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    mode: DraftMode = DraftMode()
    logprobs: int | None = None  # None: none; N: each emitted token's logprob and the N most likely tokens
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not stop the generation
    min_tokens: int = 0  # the first min_tokens tokens are never a stop token (taken out of the distribution)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the target's logits

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, the {self.max_new_tokens} tokens to generate], "
                             f"got {self.min_tokens}")
        for token, value in self.logit_bias:
            if not abs(value) <= BIAS_LIMIT:
                raise ValueError(f"logit_bias of token {token} must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], "
                                 f"got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self.sampling.check()


@dataclass
class RoundUpdate:
    """Tokens emitted by one step (the prefill's first token counts as round 0)."""
    round: int
    tokens: list[int]
    tree_nodes: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them


@dataclass(frozen=True)
class RoundStats:
    """Where one verify round's time went, as the drafter saw its step (the step's sessions share it)."""
    tokens: int       # emitted, bonus included
    tree_nodes: int   # root included
    draft_s: float    # the step's batched draft
    build_s: float    # the step's batched tree build
    verify_s: float   # the verifier's step (as it reported it)
    network_s: float  # the link round trip minus the verifier's step


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per round, bonus included
    round_stats: list[RoundStats] = field(default_factory=list)  # one per verify round
    finish_reason: str = ""
    elapsed_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0


# What a session's callback receives: updates, then exactly one GenerationResult or StatusError.
# A callback that returns True for an update ends the session after it ("stop": a stop string
# matched); submitted with `watches_text`, its updates are delivered as they come, so that no
# further round is drafted for it.
Delivery = RoundUpdate | GenerationResult | StatusError


class QueueFull(StatusError):
    """A request refused at once because the queue is full; `retry_after_s` hints when to try again."""

    def __init__(self, waiting: int, retry_after_s: float):
        self.retry_after_ms = max(1, round(retry_after_s * 1000))
        self.retry_after_s = self.retry_after_ms / 1000
        super().__init__("RESOURCE_EXHAUSTED", f"the drafter's queue is full ({waiting} requests wait for a "
                                               f"session slot); retry in {self.retry_after_s:g} s")


class Session:
    """One request as the scheduler tracks it."""

    def __init__(self, sid: int, prompt_ids: list[int], config: GenerationConfig, stop_ids: frozenset[int],
                 deliver: Callable[[Delivery], None], admission_deadline: float, watches_text: bool = False):
        self.sid, self.prompt_ids, self.config, self.stop_ids = sid, prompt_ids, config, stop_ids
        # What the verifier adds to its logits: logit_bias everywhere, and -inf for the stop ids before
        # the context position min_tokens past the prompt (the same after a re-open, whose prompt
        # holds the tokens so far). The draft's block logits take them too (`build_trees`).
        held_back = sorted(stop_ids) if config.min_tokens else []
        self.token_bias = (*(TokenBias(t, v) for t, v in config.logit_bias),
                           *(TokenBias(t, float("-inf"), len(prompt_ids) + config.min_tokens) for t in held_back))
        self.deliver = deliver
        self.watches_text = watches_text  # its callback may end it (stop strings): no outbox
        self.admission_deadline = admission_deadline
        self.result = GenerationResult(logprobs=[] if config.logprobs is not None else None)
        self.start = time.perf_counter()
        self.arrived = time.monotonic()
        self.queued = True  # counted in the queue bound until first admitted (or ended)
        self.admitted = 0.0  # perf_counter when last admitted
        self.open_on_verifier = False
        self.in_flight = 0  # messages awaiting their reply that carry an entry of it
        self.epoch = 0  # admissions so far: replies to messages sent before the last one are stale
        # Set once the verifier link failed under it: until then it re-opens (prompt + tokens so far).
        self.recovery_deadline: float | None = None
        self.recovery_start = 0.0
        self.lost_why = ""  # what the last loss of its verifier said
        self.round_base = 0  # rounds before the last open: the verifier counts rounds from its open
        self.draft_state: object | None = None
        self.max_seq_len = 0
        self.length = 0  # tokens committed on the verifier
        self.root = -1
        self.counts: TokenCounts | None = None  # with repetition penalties: `token_counts`
        self.new_tokens: list[int] = []
        self.new_features = None
        self.rounds = 0
        self.tree = None  # the tree in flight
        self.gains = None  # its last DDTree's expected gains as selected: the adaptive budget's prior
        self.undelivered = 0  # its updates waiting in the scheduler's outbox
        # The prompt being prefilled since the last open (chunked prefill: `DraftScheduler.prefill_chunk`),
        # how much of it has been sent and answered, and the sizes of its chunks in flight, oldest first.
        self.chunk_prompt: list[int] = []
        self.prompt_sent = 0
        self.prompt_answered = 0
        self.chunks_in_flight: collections.deque[int] = collections.deque()
        self.prompt_done = False  # the verifier answered its last chunk (Prefilled): trees may go
        self.first_token: int | None = None  # delivered from a notice, its Prefilled not yet received
        self.span = _tracer.start_span("generate", attributes={
            "prompt.tokens": len(prompt_ids), "mode": config.mode.kind, "tree.budget": config.mode.budget})

    @property
    def drafts(self) -> bool:
        mode = self.config.mode
        return mode.kind == "chain" or (mode.kind == "tree" and mode.budget > 0)

    def token_counts(self, block: Tensor) -> TokenCounts:
        """Its prompt's and emitted tokens' counts, on the device of the block logits [S, D, V] (the
        repetition penalties its proposals take)."""
        if self.counts is None:
            self.counts = TokenCounts(block.shape[-1], block.device, self.prompt_ids)
        return self.counts.catch_up(self.result.tokens)

    def open_prompt(self) -> list[int]:
        """What an open prefills: the prompt, and after a lost verifier the tokens emitted so far."""
        return self.prompt_ids + self.result.tokens

    def room(self, emitting: int = 0) -> int:
        """Drafted nodes the next tree may hold (once `emitting` more tokens are emitted): the
        verifier's capacity and the tokens still wanted."""
        return min(self.max_seq_len - self.length - emitting - 1,
                   self.config.max_new_tokens - len(self.result.tokens) - emitting - 1)

    def emit(self, round: int, tokens: list[int], logprobs: list[TokenLogprob] | None,
             tree_nodes: int = 0) -> RoundUpdate:
        """Append tokens (and their logprobs) up to the first stop token or the length limit;
        sets finish_reason. Returns the round's update."""
        room = self.config.max_new_tokens - len(self.result.tokens)
        out = []
        for tok in tokens[:room]:
            out.append(tok)
            if tok in self.stop_ids:
                self.result.finish_reason = "stop"
                break
        self.result.tokens.extend(out)
        kept = None
        if self.result.logprobs is not None and logprobs is not None:
            kept = logprobs[: len(out)]
            self.result.logprobs.extend(kept)
        if not self.result.finish_reason and len(self.result.tokens) >= self.config.max_new_tokens:
            self.result.finish_reason = "length"
        return RoundUpdate(round, out, tree_nodes, kept)
