"""Verifier sessions: open (prefill), verify many sessions' draft trees in one step, close.

A prompt may come in chunks (chunked prefill): an Open with `more` carries its first chunk,
each ExtendEntry the next, prefilled after the ones before it in the step's batched prefill;
the chunk that ends the prompt samples the first token (`Prefilled`), the others are answered
with their features (`Extended`). No tree is taken until then. Chunks that come beside trees
ride the trees' verify instead, where that costs less than a prefill of their own (`mix_prompts`,
`_segments`): cut into prompt-segment rows of the trees' width (`VerifyRow.segment`), whose K/V
stay where the forward writes them and whose features are every row's; a prompt's first token is
sampled from its last row's logits as a prefill's is.

Everything that arrives from a drafter is checked here before it touches the model:
prompt ids, sampling values, feature layers, the trees' buffers (`common.tree.walk_trees`,
vectorised over the step), each tree's root, round and fit in its session's KV capacity.
A bad entry fails its own session only (it is closed; its result is a `VerifierError`);
the rest of the step goes on.

Sessions are keyed by (owner, session id): the owner is the link they came over, the id
the drafter's, so several drafters can share one verifier and their sessions batch together.
When the KV slots run short, a drafter refused a slot gets the next free ones while it holds
less than its fair share (`TreeVerifier.prefill`): a drafter that closes a session and opens
another in one message cannot keep every slot while the others wait.
"""
from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.protocol import (ALWAYS, MAX_LOGPROBS, MAX_TOKEN_BIAS, CloseEntry, Entry, Extended, ExtendEntry,
                             OpenEntry, Prefilled, SamplingParams, StatusError, StepResult, TokenBias, TreeEntry,
                             Verified, VerifiedRows)
from common.logit_bias import bias_rows
from common.staging import HostCopy, rows_of
from common.tree import DeviceTree, DraftTree, TreeError, TreeLayout, ancestor_masks, walk_trees
from verifier_svc.accept import Stage, accept_roots, draw_coins, emitted_logprobs, no_stage
from verifier_svc.cuda_graphs import VerifyRow
from verifier_svc.target_runner import PendingVerify, TargetRunner


class VerifierError(StatusError):
    """A request the verifier refuses; `status` names the gRPC status code."""


SHUTTING_DOWN = "the verifier is shutting down"  # UNAVAILABLE: a new session's open, or a message after the stop


@dataclass(frozen=True)
class VerifierLimits:
    max_sessions: int = 8
    max_seq_len: int = 2048
    max_tree_nodes: int = 1025  # root + budget
    max_tree_depth: int = 64


@dataclass
class _Session:
    slot: int
    sampling: SamplingParams
    seed: int              # keys the position-keyed sampling noise
    generator: torch.Generator  # draws the coins of the coin walk
    length: int = 0        # tokens whose K/V are committed
    next_token: int = -1   # the bonus token the next tree must start from
    rounds: int = 0        # trees verified
    features: bool = True  # the drafter wants the target features of its tokens
    logprobs: int | None = None  # its emitted tokens' logprobs and the top N are wanted (None: not)
    prefilling: bool = False  # more prompt chunks are to come (ExtendEntry); no tree until the last
    token_bias: tuple[TokenBias, ...] = ()  # logit_bias, and min_tokens' stop ids at -inf
    output_start: int = ALWAYS  # the context position its generated tokens start at (repetition penalties)


Key = tuple[Hashable, int]  # (owner, session id)
_Chunk = tuple[int, Key, OpenEntry | ExtendEntry, torch.Tensor]  # (position among the entries, key, entry, tokens)
# The layout a `DeviceTree` stands in with for the host's masks: one node, seeing itself (its
# rows are built on the device).
_ON_DEVICE = TreeLayout(np.array([-1]), np.array([0]), 0)
_ONE_NODE = torch.ones(1, 1, 1, dtype=torch.bool)  # the host masks of a step whose trees are all on the device
_GREEDY = SamplingParams()  # a prompt segment's: the accept's cheapest walk (its result is not read)


@dataclass
class _CheckedTrees:
    """A step's trees (each at `positions[j]` among the step's entries), which of them passed the
    checks (`good`), the failed ones' errors, and the good ones' verify queued on the device
    (None when none passed), with the prompt chunks it took in as segment rows (`mixed`: their
    features come from the verify's rows, after the trees')."""
    positions: list[int]
    items: list[tuple[Key, TreeEntry]]
    good: list[int]
    outcomes: list[Verified | VerifierError | None]
    launched: PendingVerify | None
    mixed: _LaunchedPrefill | None = None


@dataclass
class _LaunchedPrefill:
    """One batched prefill queued on the device (`TreeVerifier._launch_prefill`), or chunks taken
    into a verify's forward (`TreeVerifier._mixed_prompts`): its chunks (each at its position among
    the step's entries), the first tokens of the prompts it ends and the chunks' features on their
    way to the host, and a copy of the ending rows' logits while a session wants their logprobs (a
    later step may replay the graph that wrote them)."""
    group: list[_Chunk]
    sessions: list[_Session]
    last: list[int]  # the chunks (indices into `group`) that end their prompts
    copy: HostCopy  # the first tokens [len(last)], then the features unless `features` holds them
    sizes: list[int]  # each chunk's feature rows (0 for a session that wants none)
    # [sum of sizes, F]: on the device (`features_on_device`), or for chunks taken into a verify its
    # rows (set when the verify is finished)
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # the ending rows' last logits [len(last), V], for logprobs


@dataclass
class PendingStep:
    """A step between `TreeVerifier.begin` and `finish`: results known so far, its trees' verify
    and its prompt chunks' prefills queued on the device."""
    keys: frozenset[Key]  # the sessions it touches
    size: int  # entries
    results: dict[int, StepResult] = field(default_factory=dict)
    prefills: list[_LaunchedPrefill] = field(default_factory=list)
    verify: _CheckedTrees | None = None

    @property
    def _launched(self) -> PendingVerify | None:
        return self.verify.launched if self.verify is not None else None

    @property
    def has_prompts(self) -> bool:
        """Whether it prefills prompt chunks (its replies carry their features)."""
        return bool(self.prefills)

    @property
    def exclusive(self) -> bool:
        """Whether no other step may begin before this one is finished: its verify's logits, read
        when it finishes (for logprobs), would be overwritten."""
        return self._launched is not None and self._launched.exclusive

    def admits(self, keys: frozenset[Key] | set[Key]) -> bool:
        """Whether a step touching the sessions `keys` may begin before this one is finished."""
        return not self.exclusive and self.keys.isdisjoint(keys)

    def ready(self) -> bool:
        """Whether `finish` would find the results on the host without waiting."""
        return (self._launched is None or self._launched.ready()) and all(p.copy.ready() for p in self.prefills)

    def wait(self) -> None:
        """Wait until `ready` (any thread)."""
        if self._launched is not None:
            self._launched.wait()
        for p in self.prefills:
            p.copy.wait()

    def verified_on_device(self) -> VerifiedRows | None:
        """Its verify's results while still on the device, one row per tree that passed the checks
        (`TargetRunner.features_on_device` only; None without them, or without a verify). Work
        that reads them must be queued before the next step is launched, which may overwrite them."""
        launched = self._launched
        if launched is None or launched.result is None:
            return None
        checked = self.verify
        trees = len(checked.good)  # (prompt segments mixed in follow the trees' rows)
        return VerifiedRows([checked.items[i][1].session_id for i in checked.good], launched.result[:trees],
                            launched.features[:trees])


class TreeVerifier:
    max_prefill_tokens = 8192  # padded prompt tokens per prefill forward
    # How long an owner refused a slot counts as waiting for one (its drafter retries well within it).
    contention_window_s = 2.0

    def __init__(self, runner: TargetRunner, limits: VerifierLimits):
        self.runner = runner
        self.limits = limits
        self.vocab_size = runner.model.cfg.vocab_size
        self.feature_layer_ids = runner.model.feature_layer_ids
        self._free_slots = list(range(runner.num_slots - 1, -1, -1))
        self._sessions: dict[Key, _Session] = {}
        self._refused: dict[Hashable, float] = {}  # owner -> when an open of it was last refused for capacity
        # Set on shutdown (from another thread): opens are refused with UNAVAILABLE, open sessions go on.
        self.draining = False
        # A step's prompt chunks ride its verify's forward as prompt segments when that costs less
        # than a prefill of their own (`_segments`); False: always a prefill of their own.
        self.mix_prompts = True
        # (batch, tokens) -> seconds of a verify step, when measured (`TargetRunner.measure_verify_costs`).
        self.verify_costs: dict[tuple[int, int], float] = {}

    @property
    def free_capacity(self) -> int:
        return len(self._free_slots)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # -- one step ------------------------------------------------------------------------

    def step(self, entries: Sequence[tuple[Hashable, Entry]], *, stage: Stage = no_stage) -> list[StepResult | None]:
        """Run one step: closes first, then every tree in one batched verify, then the opens and
        prompt chunks (extends) in batched prefills, or in that verify (`mix_prompts`).

        Returns a list aligned with `entries`: a result for each open and tree entry, None for
        a close. A session may have one entry per step. An error result means the session has
        failed and is closed. `stage` wraps the parts: "launch" (queuing the batched verify:
        forward, accept and KV compaction), "forward" (waiting for its results) and "commit"
        (bookkeeping), and each batched prefill of opens ("prefill", around its "forward" and
        "sample" queued; then "prefilled", its first tokens and features read). `begin` then
        `finish`.
        """
        return self.finish(self.begin(entries, stage=stage), stage=stage)

    def begin(self, entries: Sequence[tuple[Hashable, Entry]], *, stage: Stage = no_stage) -> PendingStep:
        """The first half of `step`: the closes, the checks, and the batched verify and then the
        prefills queued on the device without waiting for them. Until `finish`, another step may
        begin only if it touches none of this one's sessions and this one is not `exclusive`
        (`PendingStep.admits`); the device runs it after this one."""
        pending = PendingStep(keys=frozenset((owner, e.session_id) for owner, e in entries), size=len(entries))
        counts = collections.Counter((owner, e.session_id) for owner, e in entries)
        trees: list[tuple[int, Key, TreeEntry]] = []  # (position among the entries, key, entry)
        chunks: list[tuple[int, Key, OpenEntry | ExtendEntry]] = []
        for i, (owner, e) in enumerate(entries):
            key = (owner, e.session_id)
            if counts[key] > 1:  # every entry of the session fails, and it is closed
                pending.results[i] = _failed(e.session_id, "FAILED_PRECONDITION",
                                             "the session has another entry in this step")
                self.close(key)
                continue
            if isinstance(e, CloseEntry):
                self.close(key)
            elif isinstance(e, TreeEntry):
                trees.append((i, key, e))
            else:
                chunks.append((i, key, e))
        ready = self._admit_chunks(chunks, pending.results) if chunks else []
        if trees:
            pending.verify = self._launch_verify(trees, ready if self.mix_prompts else [], stage)
            if pending.verify.mixed is not None:  # the chunks ride the verify's forward
                pending.prefills.append(pending.verify.mixed)
                ready = []
        if ready:
            pending.prefills += self._launch_prefills(ready, stage)
        return pending

    def finish(self, pending: PendingStep, *, stage: Stage = no_stage) -> list[StepResult | None]:
        """The second half of `step`: the verify's results committed, then the prefills' read."""
        results = pending.results
        if pending.verify is not None:
            checked = pending.verify
            for i, (_, e), outcome in zip(checked.positions, checked.items, self._finish_verify(checked, stage)):
                results[i] = StepResult(e.session_id, outcome)
        for launched in pending.prefills:
            for (i, _, e, _), outcome in zip(launched.group, self._finish_prefill(launched, stage)):
                results[i] = StepResult(e.session_id, outcome)
        return [results.get(i) for i in range(pending.size)]

    # -- session lifecycle -------------------------------------------------------------

    def _admit_chunks(self, items: Sequence[tuple[int, Key, OpenEntry | ExtendEntry]],
                      results: dict[int, StepResult]) -> list[_Chunk]:
        """Open new sessions and take prompt chunks (each at its position among the step's entries):
        check each (a refused one's error goes to `results`, and its session is closed); the good
        ones, their sessions open, each with its tokens."""
        ready: list[_Chunk] = []
        now = time.monotonic()
        self._refused = {o: t for o, t in self._refused.items() if now - t < self.contention_window_s}
        held = collections.Counter(owner for owner, _ in self._sessions)
        opening = 0  # slots taken by the opens admitted so far
        for i, key, e in items:
            try:
                chunk = self._check_open(key, e) if isinstance(e, OpenEntry) else self._check_extend(key, e)
                if isinstance(e, OpenEntry):
                    if self.draining:  # the drafter opens it on another replica
                        raise VerifierError("UNAVAILABLE", SHUTTING_DOWN)
                    owner, free = key[0], len(self._free_slots) - opening
                    if free <= 0 or free <= self._kept_for_others(owner, held):
                        self._refused[owner] = now
                        raise VerifierError("RESOURCE_EXHAUSTED",
                                            f"all {self.limits.max_sessions} session slots are in use" if free <= 0
                                            else "the free session slots are kept for other drafters below their "
                                                 "fair share")
                    opening += 1
                    held[owner] += 1
                    self._refused.pop(owner, None)
            except VerifierError as exc:  # the session fails, and is closed if it was open
                results[i] = StepResult(e.session_id, exc)
                self.close(key)
                continue
            ready.append((i, key, e, chunk))
        self._open_sessions([(key, e) for _, key, e, _ in ready if isinstance(e, OpenEntry)])
        return ready

    def _launch_prefills(self, ready: Sequence[_Chunk], stage: Stage) -> list[_LaunchedPrefill]:
        """Queue the admitted chunks' prefills together (in groups of at most `max_prefill_tokens`
        padded tokens), each with the first token of every prompt it ends."""
        ready = sorted(ready, key=lambda item: item[3].shape[0])  # similar lengths together: less padding
        launched: list[_LaunchedPrefill] = []
        group: list[_Chunk] = []
        for item in ready:
            if group and not self._fits(group + [item]):
                launched.append(self._launch_prefill(group, stage))
                group = []
            group.append(item)
        if group:
            launched.append(self._launch_prefill(group, stage))
        return launched

    def _fits(self, group: Sequence[_Chunk]) -> bool:
        """Whether one prefill may take these chunks: at most `max_prefill_tokens` padded tokens, and
        every row's padding columns inside its cache slot."""
        width = max(c.shape[0] for *_, c in group)
        longest_past = max(self._sessions[key].length for _, key, _, _ in group)
        return len(group) * width <= self.max_prefill_tokens and longest_past + width <= self.runner.cache.max_seq_len

    def _kept_for_others(self, owner: Hashable, held: collections.Counter) -> int:
        """Free slots kept for the other owners refused a slot lately, up to their fair share
        (the slots over the owners that hold or want some); none while `owner` is below its own."""
        waiting = [o for o in self._refused if o != owner]
        if not waiting:
            return 0
        share = max(1, self.runner.num_slots // len(set(held) | set(waiting) | {owner}))
        if held[owner] < share:
            return 0
        return sum(max(0, share - held[o]) for o in waiting)

    def _check_open(self, key: Key, e: OpenEntry) -> torch.Tensor:
        """The prompt as a tensor, or VerifierError."""
        if key in self._sessions:
            raise VerifierError("ALREADY_EXISTS", f"session {e.session_id} is already open")
        if tuple(e.feature_layer_ids) not in ((), self.feature_layer_ids):
            raise VerifierError(
                "FAILED_PRECONDITION",
                f"the drafter asks for features of target layers {list(e.feature_layer_ids)}, this verifier "
                f"returns layers {list(self.feature_layer_ids)}; start both with the same draft checkpoint")
        prompt = self._checked_chunk(e.prompt_ids, 0)
        try:
            e.sampling.check()
        except ValueError as exc:
            raise VerifierError("INVALID_ARGUMENT", str(exc)) from None
        if e.logprobs is not None and not 0 <= e.logprobs <= MAX_LOGPROBS:
            raise VerifierError("INVALID_ARGUMENT", f"logprobs must be in [0, {MAX_LOGPROBS}], got {e.logprobs}")
        if not 0 <= e.output_start <= ALWAYS:
            raise VerifierError("INVALID_ARGUMENT", f"output_start must be in [0, 2^32), got {e.output_start}")
        if len(e.token_bias) > MAX_TOKEN_BIAS:
            raise VerifierError("INVALID_ARGUMENT", f"{len(e.token_bias)} token biases, at most {MAX_TOKEN_BIAS}")
        try:
            for bias in e.token_bias:
                bias.check(self.vocab_size)
        except ValueError as exc:
            raise VerifierError("INVALID_ARGUMENT", str(exc)) from None
        return prompt

    def _check_extend(self, key: Key, e: ExtendEntry) -> torch.Tensor:
        """The next prompt chunk of a session that is prefilling, as a tensor, or VerifierError."""
        session = self._sessions.get(key)
        if session is None:
            raise VerifierError("NOT_FOUND", f"no open session {e.session_id}")
        if not session.prefilling:
            raise VerifierError("FAILED_PRECONDITION", f"session {e.session_id} has no prompt chunk to come")
        return self._checked_chunk(e.prompt_ids, session.length)

    def _checked_chunk(self, ids: list[int], past: int) -> torch.Tensor:
        """Prompt tokens that go after `past` committed ones, as a tensor, or VerifierError."""
        if not ids:
            raise VerifierError("INVALID_ARGUMENT", "prompt is empty" if not past else "prompt chunk is empty")
        if past + len(ids) >= self.limits.max_seq_len:
            raise VerifierError(
                "INVALID_ARGUMENT",
                f"prompt of {past + len(ids)} tokens does not fit max_seq_len {self.limits.max_seq_len} "
                "(room for at least one generated token is needed)",
            )
        chunk = torch.tensor(ids, dtype=torch.int64)
        bad = chunk[(chunk < 0) | (chunk >= self.vocab_size)]
        if bad.numel():
            raise VerifierError("INVALID_ARGUMENT",
                                f"token ids {bad[:5].tolist()} outside the vocabulary [0, {self.vocab_size})")
        return chunk

    def _open_sessions(self, opens: Sequence[tuple[Key, OpenEntry]]) -> None:
        """Give each admitted open a slot and its sampling state (its length counts its chunks once queued)."""
        for key, e in opens:
            seed = e.sampling.seed if e.sampling.seed is not None else secrets.randbits(63)
            self._sessions[key] = _Session(self._free_slots.pop(), e.sampling, seed,
                                           torch.Generator().manual_seed(seed), features=bool(e.feature_layer_ids),
                                           logprobs=e.logprobs, prefilling=True,
                                           token_bias=tuple(e.token_bias), output_start=e.output_start)

    def _launch_prefill(self, group: Sequence[_Chunk], stage: Stage) -> _LaunchedPrefill:
        """Queue one batched prefill of the chunks, then the first token of every prompt it ends (one
        batched accept of root-only trees) and the copies of both to the host. The sessions' lengths
        count the chunks from here on (a later step's chunks go after them)."""
        sessions = [self._sessions[key] for _, key, _, _ in group]
        last = [j for j, (_, _, e, _) in enumerate(group) if not e.more]  # chunks that end their prompt
        try:
            with stage("prefill"):
                self._count_prompts(group, sessions)
                with stage("forward"):
                    logits, features = self.runner.prefill([s.slot for s in sessions], [c for *_, c in group],
                                                           [s.length for s in sessions])
                with stage("sample"):
                    tokens, kept = self._sample_first(group, sessions, last, rows_of(logits, last))
                    wanted = [f if s.features else f[:0] for s, f in zip(sessions, features)]
                    # One copy for the group, not one per session; on the device it also frees them
                    # from a prefill graph's buffers, which the next step may replay.
                    rows = torch.cat(wanted)
                    on_device = self.runner.features_on_device
                    copied = [t for t in (tokens, None if on_device else self.runner.features_for_host(rows))
                              if t is not None]
                    launched = _LaunchedPrefill(list(group), sessions, last, HostCopy(*copied),
                                                [f.shape[0] for f in wanted], rows if on_device else None, kept)
        except Exception:
            for _, key, _, _ in group:
                self.close(key)
            raise
        self._chunks_queued(group, sessions)
        return launched

    def _count_prompts(self, group: Sequence[_Chunk], sessions: Sequence[_Session]) -> None:
        """Queue the chunks' tokens into their slots' counts (only sessions with repetition penalties
        read them)."""
        counted = [j for j, s in enumerate(sessions) if s.sampling.penalized]
        if counted:
            self.runner.count_prompts([sessions[j].slot for j in counted], [group[j][3] for j in counted],
                                      [sessions[j].length for j in counted],
                                      [sessions[j].output_start for j in counted])

    def _sample_first(self, group: Sequence[_Chunk], sessions: Sequence[_Session], last: list[int],
                      logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The first tokens of the prompts that the chunks `last` end, queued from their last tokens'
        logits [len(last), V] (changed in place): biases, penalties, one batched accept of
        root-only trees. Returns them (None without any), and the logits kept for the sessions that
        want logprobs (None when none does)."""
        if not last:
            return None, None
        ending = [sessions[j] for j in last]
        # (each prompt's first token goes to the position of the prompt's length)
        bias_rows(logits[:, None], [s.token_bias for s in ending],
                  [s.length + group[j][3].shape[0] for s, j in zip(ending, last)])
        self.runner.penalize_last(logits, [s.slot for s in ending], [s.sampling for s in ending])
        tokens = self._first_tokens(ending, logits, [group[j][3] for j in last])
        return tokens, logits.clone() if any(s.logprobs is not None for s in ending) else None

    @staticmethod
    def _chunks_queued(group: Sequence[_Chunk], sessions: Sequence[_Session]) -> None:
        """The sessions' lengths count their queued chunks from here on (a later step's go after them)."""
        for (_, _, e, chunk), s in zip(group, sessions):
            s.length += chunk.shape[0]
            s.prefilling = bool(e.more)  # no chunk after the last one (its first token comes with `finish`)

    def _finish_prefill(self, launched: _LaunchedPrefill, stage: Stage) -> list[Prefilled | Extended]:
        """A queued prefill's outcomes, in its group's order: the first token (and its logprobs) of
        each prompt it ended, and every chunk's features."""
        sessions, last = launched.sessions, launched.last
        try:
            with stage("prefilled"):
                copied = launched.copy.wait()
                first = copied[0].tolist() if last else []
                logprobs = self._first_logprobs([sessions[j] for j in last], launched.logits, first) if last else []
                rows = launched.features if launched.features is not None else copied[-1]
        except Exception:
            for _, key, _, _ in launched.group:
                self.close(key)
            raise
        ends = dict(zip(last, zip(first, logprobs)))
        outcomes: list[Prefilled | Extended] = []
        for j, (s, f) in enumerate(zip(sessions, rows.split(launched.sizes))):
            if j not in ends:
                outcomes.append(Extended(features=f))
                continue
            s.next_token = ends[j][0]
            outcomes.append(Prefilled(token=ends[j][0], features=f, max_seq_len=self.limits.max_seq_len,
                                      logprobs=ends[j][1]))
        return outcomes

    def _first_tokens(self, sessions: Sequence[_Session], logits: torch.Tensor, chunks: Sequence[torch.Tensor]
                      ) -> torch.Tensor:
        """The first generated token of each session whose prompt ends with `chunks` [i], from
        its last logits [B, V], in one batched accept of root-only trees (on the device, queued)."""
        roots = [DraftTree.root_only(c[-1]) for c in chunks]
        sampling = [s.sampling for s in sessions]
        if self.runner.sampling == "keyed":  # the first token's position: the prompt length
            return accept_roots(roots, logits, sampling, seeds=[s.seed for s in sessions],
                                positions=[s.length + c.shape[0] - 1 for s, c in zip(sessions, chunks)])
        return accept_roots(roots, logits, sampling,
                            coins=[None if s.sampling.greedy else draw_coins(s.generator, 1) for s in sessions])

    @staticmethod
    def _first_logprobs(sessions: Sequence[_Session], logits: torch.Tensor, tokens: list[int]) -> list:
        """The first tokens' logprobs for the sessions that ask (None for the others)."""
        asking = [j for j, s in enumerate(sessions) if s.logprobs is not None]
        out: list = [None] * len(sessions)
        if asking:
            flat = emitted_logprobs(logits[asking], [tokens[j] for j in asking], [sessions[j].sampling for j in asking],
                                    [sessions[j].logprobs for j in asking])
            for j, lp in zip(asking, flat):
                out[j] = [lp]
        return out

    def close(self, key: Key) -> None:
        """Free the session's slot; closing an unknown or closed session is a no-op."""
        session = self._sessions.pop(key, None)
        if session is not None:
            self._free_slots.append(session.slot)

    def close_owner(self, owner: Hashable) -> int:
        """Close every session of one owner (its link ended); returns how many."""
        self._refused.pop(owner, None)
        keys = [k for k in self._sessions if k[0] == owner]
        for key in keys:
            self.close(key)
        return len(keys)

    # -- verify ----------------------------------------------------------------------------

    def _launch_verify(self, trees: Sequence[tuple[int, Key, TreeEntry]], chunks: Sequence[_Chunk],
                       stage: Stage) -> _CheckedTrees:
        """Check every tree (a bad one closes its session) and queue the good ones' batched verify;
        `trees` holds (position among the step's entries, key, entry). Trees from the wire are
        walked (`walk_trees`); an in-process drafter's `DeviceTree`s are trusted, and their
        fields are built on the device (`BatchInputs.fill`). The admitted prompt `chunks` ride the
        verify's forward as prompt segments when that costs less than a prefill of their own
        (`_segments`; `_CheckedTrees.mixed`)."""
        items = [(key, e) for _, key, e in trees]
        outcomes: list[Verified | VerifierError | None] = [None] * len(items)
        wire = [i for i, (_, e) in enumerate(items) if not isinstance(e.tree, DeviceTree)]
        layouts: list[TreeLayout | TreeError] = [_ON_DEVICE] * len(items)
        walked = walk_trees([items[i][1].tree for i in wire], vocab_size=self.vocab_size,
                            max_nodes=self.limits.max_tree_nodes, max_depth=self.limits.max_tree_depth)
        for i, layout in zip(wire, walked):
            layouts[i] = layout
        good: list[int] = []
        for i, ((key, e), layout) in enumerate(zip(items, layouts)):
            try:
                self._check(key, e, layout)
                good.append(i)
            except VerifierError as exc:
                outcomes[i] = exc
                self.close(key)
        checked = _CheckedTrees([i for i, _, _ in trees], items, good, outcomes, None)
        if not good:
            return checked
        rows = []
        for i in good:
            key, e = items[i]
            s = self._sessions[key]
            coins = (None if s.sampling.greedy or self.runner.sampling != "sample"
                     else draw_coins(s.generator, e.tree.num_nodes))
            depths = layouts[i].depths if layouts[i] is not _ON_DEVICE else None
            rows.append(VerifyRow(s.slot, s.length, e.tree, depths, s.sampling, coins, s.seed, s.logprobs,
                                  s.token_bias, s.features))
        walked = [layouts[i] for i in good]
        segments = self._segments(rows, chunks) if chunks else []
        walked += [TreeLayout(np.arange(-1, r.segment - 1), r.depths, r.segment - 1) for r in segments]
        rows += segments
        masks = (ancestor_masks(walked, max(r.tree.num_nodes for r in rows))
                 if any(layout is not _ON_DEVICE for layout in walked) else _ONE_NODE.expand(len(rows), 1, 1))
        try:
            with stage("launch"):
                checked.launched = self.runner.launch_verify(rows, masks)
            if segments:
                checked.mixed = self._mixed_prompts(chunks, checked.launched, len(good), stage)
        except Exception:
            for _, key, _, _ in chunks if segments else ():
                self.close(key)
            raise
        return checked

    def _segments(self, trees: Sequence[VerifyRow], chunks: Sequence[_Chunk]) -> list[VerifyRow]:
        """The chunks cut into prompt-segment rows (`VerifyRow.segment`) of the verify's row width,
        each chunk's in order (all but its last full: a segment's padding columns go to the cache
        positions after it), when a verify that takes them in costs less than the trees' and a
        prefill of the chunks apart (`TargetRunner.mixing_pays`); else none."""
        width = self.runner.row_width(max(r.tree.num_nodes for r in trees))
        segments = []
        for _, key, _, chunk in chunks:
            s = self._sessions[key]
            for start in range(0, chunk.shape[0], width):
                piece = chunk[start: start + width]
                unlinked = torch.full_like(piece, -1)  # no tree: no path to accept, every K/V stays
                segments.append(VerifyRow(s.slot, s.length + start, DraftTree(piece, unlinked, unlinked),
                                          np.arange(piece.shape[0]), _GREEDY, wants_features=s.features,
                                          segment=piece.shape[0]))
        end = max(r.past for r in (*trees, *segments)) + width
        if not self.runner.mixing_pays(self.runner.verify_mode(trees), len(trees), len(segments), width, end,
                                       [chunk.shape[0] for *_, chunk in chunks]):
            return []
        return segments

    def _mixed_prompts(self, chunks: Sequence[_Chunk], launched: PendingVerify, first_row: int,
                       stage: Stage) -> _LaunchedPrefill:
        """After a verify that took the chunks in as segments (rows `first_row` on, each chunk's in
        order): queue their counts and the first token of every prompt they end, from its last
        token's logits in the verify's; their features come with the verify's rows."""
        group = list(chunks)
        sessions = [self._sessions[key] for _, key, _, _ in group]
        last = [j for j, (_, _, e, _) in enumerate(group) if not e.more]
        width = launched.logits.shape[1]
        ends, row = [], first_row  # each chunk's last token: its node's flat index in the logits [B * T]
        for *_, chunk in group:  # (its segments fill whole rows but the last)
            ends.append(row * width + chunk.shape[0] - 1)
            row += -(-chunk.shape[0] // width)
        with stage("prefill"):
            self._count_prompts(group, sessions)
            with stage("sample"):
                logits = launched.logits.reshape(-1, launched.logits.shape[-1])
                # (`rows_of`: the index goes over through pinned memory, without waiting for the device)
                tokens, kept = self._sample_first(group, sessions, last, rows_of(logits, [ends[j] for j in last]))
        mixed = _LaunchedPrefill(group, sessions, last, HostCopy(*([tokens] if tokens is not None else [])),
                                 [chunk.shape[0] if s.features else 0 for (*_, chunk), s in zip(group, sessions)],
                                 logits=kept)
        self._chunks_queued(group, sessions)
        return mixed

    def _finish_verify(self, pending: _CheckedTrees, stage: Stage) -> list[Verified | VerifierError]:
        """Wait for a launched verify and commit every good tree's accepted path."""
        items, outcomes = pending.items, pending.outcomes
        if pending.launched is None:
            return outcomes
        with stage("forward"):
            batch = self.runner.finish_verify(pending.launched)
        with stage("commit"):
            offset = 0
            for j, i in enumerate(pending.good):
                key, e = items[i]
                s = self._sessions[key]
                path = batch.paths[j]
                if isinstance(e.tree, DeviceTree) and e.tree.failed:  # run as a root-only tree
                    outcomes[i] = VerifierError("INTERNAL", f"the drafter's tree for session {e.session_id}: "
                                                "its draft logits contain NaN")
                    self.close(key)
                    offset += len(path) if s.features else 0
                    continue
                s.length += len(path)
                s.next_token = batch.bonus[j]
                s.rounds += 1
                accepted = batch.accepted[j]
                taken = len(path) if s.features else 0
                outcomes[i] = Verified(accepted_tokens=accepted, next_token=batch.bonus[j],
                                       features=batch.features[offset: offset + taken], round=e.round,
                                       logprobs=batch.logprobs[j])
                offset += taken
            if pending.mixed is not None:  # the prompt segments' rows follow the trees'
                pending.mixed.features = batch.features[offset: offset + sum(pending.mixed.sizes)]
        return outcomes

    def _check(self, key: Key, e: TreeEntry, layout: TreeLayout | TreeError) -> None:
        session = self._sessions.get(key)
        if session is None:
            raise VerifierError("NOT_FOUND", f"no open session {e.session_id}")
        if session.prefilling:
            raise VerifierError("FAILED_PRECONDITION", f"session {e.session_id}'s prompt is not all prefilled yet")
        if isinstance(layout, TreeError):
            raise VerifierError("INVALID_ARGUMENT", f"malformed tree: {layout}")
        if e.round != session.rounds + 1:
            raise VerifierError("INVALID_ARGUMENT",
                                f"tree round {e.round} is out of order: expected round {session.rounds + 1}")
        root = e.tree.root
        if root != session.next_token:
            raise VerifierError("INVALID_ARGUMENT",
                                f"tree root token {root} is not the last bonus token {session.next_token}")
        n = e.tree.num_nodes
        if session.length + n > self.limits.max_seq_len:
            raise VerifierError(
                "INVALID_ARGUMENT",
                f"tree of {n} nodes does not fit: session holds {session.length} of {self.limits.max_seq_len} tokens")


def _failed(session_id: int, status: str, message: str) -> StepResult:
    return StepResult(session_id, VerifierError(status, message))

