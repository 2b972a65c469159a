"""One generation, round by round, against any verifier link.

The loop is the same whether the verifier lives in this process (`LocalVerifierLink`) or
behind a gRPC stream: open -> (draft, build tree, verify) per round -> close. However the
loop ends (done, error, or the caller dropping it), the link is closed and the proposer's
session state finished (a draft context slot goes back to its pool). It yields a
`RoundUpdate` per round so servers can stream tokens as they are accepted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from opentelemetry import trace

from common.protocol import Prefilled, SamplingParams, Verified
from common.tree import DraftTree
from common.tracing import current_traceparent, tracer
from drafter_svc.drafter import BlockProposer, DraftMode, build_tree

_tracer = tracer("drafter_svc.session")


class VerifierLink(Protocol):
    """One session with a verifier: exactly one call (one message each way) per step.

    `traceparent` names the drafter's span the verifier's work belongs under; failures
    raise `common.protocol.StatusError`.
    """

    def open(self, prompt_ids: list[int], sampling: SamplingParams, traceparent: str = "") -> Prefilled: ...

    def verify(self, tree: DraftTree, round_index: int, traceparent: str = "") -> Verified: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    mode: DraftMode = DraftMode()

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.sampling.check()


@dataclass
class RoundUpdate:
    """Tokens emitted by one step (the prefill's first token counts as round 0)."""
    round: int
    tokens: list[int]
    tree_nodes: int = 0
    draft_s: float = 0.0
    tree_build_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per round, bonus included
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


class DecodeSession:
    """Iterate to run the generation; `result` holds the totals afterwards."""

    def __init__(self, link: VerifierLink, proposer: BlockProposer | None, prompt_ids: list[int],
                 config: GenerationConfig, eos_token_ids: tuple[int, ...] = ()):
        config.check()
        if config.mode.kind != "ar" and proposer is None:
            raise ValueError(f"draft mode {config.mode.kind!r} needs a draft model")
        self.link, self.proposer, self.prompt_ids, self.config = link, proposer, list(prompt_ids), config
        self.stop_ids = frozenset(config.stop_token_ids) | frozenset(eos_token_ids)
        self.result = GenerationResult()
        self._draft_state: object | None = None  # the proposer's per-session state, finished at the end

    def _emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stop token or the length limit; sets finish_reason."""
        room = self.config.max_new_tokens - len(self.result.tokens)
        out = []
        for tok in tokens[:room]:
            out.append(tok)
            if tok in self.stop_ids:
                self.result.finish_reason = "stop"
                break
        self.result.tokens.extend(out)
        if not self.result.finish_reason and len(self.result.tokens) >= self.config.max_new_tokens:
            self.result.finish_reason = "length"
        return out

    def __iter__(self) -> Iterator[RoundUpdate]:
        # Spans get explicit parents: a generator must not keep a context attached across yields.
        root = _tracer.start_span("generate", attributes={"prompt.tokens": len(self.prompt_ids),
                                                          "mode": self.config.mode.kind,
                                                          "tree.budget": self.config.mode.budget})
        self._trace_ctx = trace.set_span_in_context(root)
        start = time.perf_counter()
        try:
            yield from self._rounds(start)
        except Exception as exc:
            root.record_exception(exc)
            root.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            self.result.elapsed_s = time.perf_counter() - start
            if self._draft_state is not None:
                state, self._draft_state = self._draft_state, None
                self.proposer.finish(state)
            self.link.close()
            root.set_attributes({"completion.tokens": len(self.result.tokens), "rounds": self.result.rounds,
                                 "mean_acceptance": self.result.mean_acceptance,
                                 "finish_reason": self.result.finish_reason})
            root.end()

    def _rounds(self, start: float) -> Iterator[RoundUpdate]:
        cfg = self.config
        with _tracer.start_as_current_span("prefill_rpc", context=self._trace_ctx):
            prefilled = self.link.open(self.prompt_ids, cfg.sampling, current_traceparent())
        self.result.time_to_first_token_s = time.perf_counter() - start
        length = len(self.prompt_ids)  # tokens committed on the verifier
        root = prefilled.token
        yield RoundUpdate(0, self._emit([root]))
        use_draft = cfg.mode.kind == "chain" or (cfg.mode.kind == "tree" and cfg.mode.budget > 0)
        state = self._draft_state = self.proposer.start(self.prompt_ids, prefilled.features) if use_draft else None
        new_tokens, new_features = [root], prefilled.features[:0]
        r = 0
        while not self.result.finish_reason:
            r += 1
            # Room for drafted nodes: the verifier's capacity and the tokens still wanted.
            room = min(prefilled.max_seq_len - length - 1, cfg.max_new_tokens - len(self.result.tokens) - 1)
            if prefilled.max_seq_len - length - 1 < 0:
                self.result.finish_reason = "length"
                break
            with _tracer.start_as_current_span("round", context=self._trace_ctx,
                                               attributes={"round": r}) as span:
                round_parent = current_traceparent()
                t0 = time.perf_counter()
                logits = None
                with _tracer.start_as_current_span("draft"):
                    if use_draft and room > 0:
                        logits = self.proposer.block_logits(state, root, new_tokens, new_features)
                t1 = time.perf_counter()
                with _tracer.start_as_current_span("tree_build"):
                    tree = build_tree(cfg.mode, logits, root, room)
                t2 = time.perf_counter()
                with _tracer.start_as_current_span("verify_rpc"):
                    verified = self.link.verify(tree, r, round_parent)
                t3 = time.perf_counter()
                span.set_attributes({"tree.nodes": tree.num_nodes, "accepted": len(verified.accepted_tokens)})
            emitted = verified.accepted_tokens + [verified.next_token]
            length += len(emitted)
            self.result.acceptance_lengths.append(len(emitted))
            root = verified.next_token
            new_tokens, new_features = emitted, verified.features
            yield RoundUpdate(r, self._emit(emitted), tree.num_nodes, t1 - t0, t2 - t1, t3 - t2)


class LocalVerifierLink:
    """The in-process verifier: calls a `TreeVerifier` directly."""

    def __init__(self, verifier):
        self.verifier = verifier
        self.session_id: int | None = None

    def open(self, prompt_ids: list[int], sampling: SamplingParams, traceparent: str = "") -> Prefilled:
        self.session_id, prefilled = self.verifier.open(prompt_ids, sampling)
        return prefilled

    def verify(self, tree: DraftTree, round_index: int, traceparent: str = "") -> Verified:
        return self.verifier.verify(self.session_id, tree)

    def close(self) -> None:
        if self.session_id is not None:
            self.verifier.close(self.session_id)
            self.session_id = None


def generate(link: VerifierLink, proposer: BlockProposer | None, prompt_ids: list[int],
             config: GenerationConfig, eos_token_ids: tuple[int, ...] = ()) -> GenerationResult:
    session = DecodeSession(link, proposer, prompt_ids, config, eos_token_ids)
    for _ in session:
        pass
    return session.result
