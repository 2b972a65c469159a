"""Typed messages between the drafter's scheduler and the verifier.

One drafter step sends a batch of entries (open / tree / close, one per session at most)
and gets back one result per open and tree entry (DESIGN.md, "Batching"). The gRPC layer
(`common.wire`) converts them to and from protobuf; the in-process link passes them as
they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.staging import rows_of
from common.tree import DraftTree


class StatusError(Exception):
    """A refused request or failed peer; `status` names the gRPC status code (e.g. "UNAVAILABLE")."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ContextTooLong(StatusError):
    """A request whose prompt, or prompt plus the new tokens it asks for, does not fit a session's
    context (INVALID_ARGUMENT); `field` is the request field at fault ("prompt", "max_new_tokens")."""

    def __init__(self, message: str, field: str):
        super().__init__("INVALID_ARGUMENT", message)
        self.field = field


class LinkLost(StatusError):
    """A session's verifier went away with it (its link broke): the session may re-open elsewhere."""

    def __init__(self, message: str):
        super().__init__("UNAVAILABLE", message)


# Temperatures under this decode greedily: sampling there is argmax but for near-ties, and
# logits / T overflows float32 (NaN probabilities) for the tiniest.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # < GREEDY_BELOW (0 included) = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int | None = None    # None = a fresh random seed
    presence_penalty: float = 0.0    # subtracted from a token's logit once it has been generated
    frequency_penalty: float = 0.0   # subtracted once per time it has been generated
    repetition_penalty: float = 1.0  # a logit of a token in the prompt or output: divided (> 0) or multiplied

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty applies (`common.penalties`)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Every consumer of the temperature asks this first, so a tiny T never reaches a softmax."""
        return self.temperature < GREEDY_BELOW

    def check(self) -> None:
        """Raise ValueError with a one-line message for out-of-range values."""
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not abs(value) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        if not 0.0 < self.repetition_penalty <= REPETITION_LIMIT:
            raise ValueError(f"repetition_penalty must be in (0, {REPETITION_LIMIT:g}], got {self.repetition_penalty}")


# |presence_penalty| and |frequency_penalty| at most PENALTY_LIMIT (OpenAI's range); repetition_penalty
# in (0, REPETITION_LIMIT].
PENALTY_LIMIT, REPETITION_LIMIT = 2.0, 100.0

# Seeds are in [0, 2^63): the verifier keys its sampling on them as int64 (the wire's field is uint64).
SEED_LIMIT = 1 << 63

# Most alternatives a request may ask for per token (GenerateRequest.logprobs), as in OpenAI's API.
MAX_LOGPROBS = 20
# Token biases a session may have (GenerateRequest.logit_bias, and the stop token ids that
# min_tokens holds back), a static dimension of the verify step's inputs; |logit_bias| at most
# BIAS_LIMIT (OpenAI's); ALWAYS: a bias's `until` for every position.
MAX_TOKEN_BIAS = 64
BIAS_LIMIT = 100.0
ALWAYS = (1 << 32) - 1


@dataclass(frozen=True)
class TokenBias:
    """`value` added to the target's logit of `token` at every context position before `until`
    (-inf: never that token there; a request's min_tokens)."""
    token: int
    value: float
    until: int = ALWAYS

    def check(self, vocab_size: int) -> None:
        """Raise ValueError with a one-line message for an entry out of range."""
        if not 0 <= self.token < vocab_size:
            raise ValueError(f"biased token id {self.token} outside the vocabulary [0, {vocab_size})")
        if not (abs(self.value) <= BIAS_LIMIT or self.value == float("-inf")):
            raise ValueError(f"a token bias must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}] (or -inf), got {self.value}")
        if not 0 <= self.until <= ALWAYS:
            raise ValueError(f"a token bias's position bound must be in [0, 2^32), got {self.until}")

# Stop strings a request may give: each is scanned for every round, and a stream holds back
# the text that could still begin one (the longest's length less one character).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log probability under the distribution it was drawn from, and the most
    likely tokens there, most likely first (`top`: (token, logprob) pairs)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Prefilled:
    """Verifier's reply to an Open (or to the Extend of a prompt's last chunk): the first
    generated token and the features of the entry's prompt tokens."""
    token: int
    features: torch.Tensor  # [the entry's prompt tokens, feature_dim]
    max_seq_len: int        # the session can hold this many tokens in all
    logprobs: list[TokenLogprob] | None = None  # [token's], when the Open asked for them


@dataclass
class Verified:
    """Verifier's reply to a tree: what was accepted and the features of the new context."""
    accepted_tokens: list[int]  # drafted tokens accepted, in order (may be empty)
    next_token: int             # the bonus token; root of the next tree
    features: torch.Tensor      # [1 + len(accepted_tokens), feature_dim] for [root, accepted...]
    round: int = 0              # the tree's round
    logprobs: list[TokenLogprob] | None = None  # of accepted_tokens + [next_token], when the Open asked


@dataclass(frozen=True, eq=False)
class VerifiedRows:
    """A verify step's results while they are still on the device, for a drafter in the same
    process to queue its next draft step behind the verify (`LocalLink.verified_on_device`).
    Row i answers session `session_ids[i]`: `result` int64 [n, T + 2] = [accepted, bonus, path
    padded with -1], `features` [n, W, F] its path's rows (root first; rows past it repeat the root's)."""
    session_ids: list[int]
    result: torch.Tensor
    features: torch.Tensor

    def rows(self, index: list[int]) -> VerifiedRows:
        """These rows, in this order (no copy when it is all of them)."""
        return VerifiedRows([self.session_ids[i] for i in index], rows_of(self.result, index),
                            rows_of(self.features, index))


@dataclass
class OpenEntry:
    """Open a session: prefill the prompt (the reply is `Prefilled`)."""
    session_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    traceparent: str = ""
    feature_layer_ids: tuple[int, ...] = ()  # what the drafter needs; must equal the verifier's
    logprobs: int | None = None  # None: none; N in [0, MAX_LOGPROBS]: emitted tokens' logprobs and the top N
    more: bool = False  # prompt_ids is the prompt's first chunk, the rest follows in ExtendEntry's
    token_bias: tuple[TokenBias, ...] = ()  # logit_bias, and min_tokens' stop ids at -inf
    # The context position the generated tokens start at (the repetition penalties count them): a
    # re-opened session's prompt holds its tokens so far. ALWAYS: none of the prompt was generated.
    output_start: int = ALWAYS


@dataclass
class ExtendEntry:
    """The next chunk of a session's prompt (chunked prefill); the reply is `Extended`, or
    `Prefilled` for the last chunk (`more` False)."""
    session_id: int
    prompt_ids: list[int]
    more: bool = False
    traceparent: str = ""


@dataclass
class Extended:
    """Verifier's reply to a prompt chunk that is not the last: the chunk's features."""
    features: torch.Tensor  # [chunk tokens, feature_dim]


@dataclass
class TreeEntry:
    """Verify one draft tree of an open session (the reply is `Verified`)."""
    session_id: int
    round: int
    tree: DraftTree
    traceparent: str = ""


@dataclass
class CloseEntry:
    """Free the session (no reply)."""
    session_id: int


Entry = OpenEntry | ExtendEntry | TreeEntry | CloseEntry


@dataclass
class StepResult:
    """The outcome of one open, extend or tree entry; a StatusError means the session failed and is closed."""
    session_id: int
    outcome: Prefilled | Extended | Verified | StatusError
