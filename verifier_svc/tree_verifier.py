"""Verifier sessions: prefill, validate and verify draft trees, sample, commit.

Everything that arrives from a drafter is checked here before it touches the model:
prompt ids, sampling values, the tree's buffers, its root, and its fit in the session's KV
capacity. Errors are `VerifierError`s that carry a gRPC-style status name.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from common.protocol import Prefilled, SamplingParams, StatusError, Verified
from common.tree import DraftTree, TreeError, ancestor_mask, walk_tree
from verifier_svc.accept import Stage, accept_tree, draw_coins, no_stage
from verifier_svc.target_runner import TargetRunner

class VerifierError(StatusError):
    """A request the verifier refuses; `status` names the gRPC status code."""


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
    generator: torch.Generator
    length: int = 0        # tokens whose K/V are committed
    next_token: int = -1   # the bonus token the next tree must start from


class TreeVerifier:
    def __init__(self, runner: TargetRunner, limits: VerifierLimits):
        self.runner = runner
        self.limits = limits
        self.vocab_size = runner.model.cfg.vocab_size
        self._free_slots = list(range(runner.cache.num_slots - 1, -1, -1))
        self._sessions: dict[int, _Session] = {}
        self._next_id = 1

    # -- session lifecycle -------------------------------------------------------------

    @property
    def free_capacity(self) -> int:
        return len(self._free_slots)

    def open(self, prompt_ids: list[int], sampling: SamplingParams, *,
             stage: Stage = no_stage) -> tuple[int, Prefilled]:
        if not prompt_ids:
            raise VerifierError("INVALID_ARGUMENT", "prompt is empty")
        if len(prompt_ids) >= self.limits.max_seq_len:
            raise VerifierError(
                "INVALID_ARGUMENT",
                f"prompt of {len(prompt_ids)} tokens does not fit max_seq_len {self.limits.max_seq_len} "
                "(room for at least one generated token is needed)",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VerifierError("INVALID_ARGUMENT", f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        try:
            sampling.check()
        except ValueError as exc:
            raise VerifierError("INVALID_ARGUMENT", str(exc)) from None
        if not self._free_slots:
            raise VerifierError("RESOURCE_EXHAUSTED", f"all {self.limits.max_sessions} session slots are in use")
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        session = _Session(self._free_slots.pop(), sampling, torch.Generator().manual_seed(seed))
        session_id = self._next_id
        self._next_id += 1
        self._sessions[session_id] = session
        try:
            prompt = torch.tensor(prompt_ids, dtype=torch.int64)
            with stage("forward"):
                out = self.runner.prefill(session.slot, prompt)
            session.length = len(prompt_ids)
            root_only = DraftTree(prompt[-1:], torch.tensor([-1]), torch.tensor([-1]))
            with stage("sample"):
                coins = None if sampling.greedy else draw_coins(session.generator, 1)
                bonus = accept_tree(root_only, out.logits[0], out.features[0, -1:], sampling, coins).bonus
        except Exception:
            self.close(session_id)
            raise
        session.next_token = bonus
        return session_id, Prefilled(token=bonus, features=out.features[0], max_seq_len=self.limits.max_seq_len)

    def close(self, session_id: int) -> None:
        """Free the session's slot; closing an unknown or closed session is a no-op."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._free_slots.append(session.slot)

    # -- one round -----------------------------------------------------------------------

    def verify(self, session_id: int, tree: DraftTree, *, stage: Stage = no_stage) -> Verified:
        session = self._sessions.get(session_id)
        if session is None:
            raise VerifierError("NOT_FOUND", f"no open session {session_id}")
        try:
            layout = walk_tree(tree, vocab_size=self.vocab_size, max_nodes=self.limits.max_tree_nodes,
                               max_depth=self.limits.max_tree_depth)
        except TreeError as exc:
            raise VerifierError("INVALID_ARGUMENT", f"malformed tree: {exc}") from None
        if int(tree.tokens[0]) != session.next_token:
            raise VerifierError(
                "INVALID_ARGUMENT",
                f"tree root token {int(tree.tokens[0])} is not the last bonus token {session.next_token}",
            )
        n = tree.num_nodes
        if session.length + n > self.limits.max_seq_len:
            raise VerifierError(
                "INVALID_ARGUMENT",
                f"tree of {n} nodes does not fit: session holds {session.length} of {self.limits.max_seq_len} tokens",
            )
        coins = None if session.sampling.greedy else draw_coins(session.generator, n)
        mask = ancestor_mask(layout.parents, layout.depths)
        result = self.runner.verify_accept(session.slot, session.length, tree, layout.depths, mask,
                                           session.sampling, coins, stage=stage)
        with stage("commit"):
            self.runner.commit(session.slot, session.length, result.path)
            session.length += result.path.shape[0]
            session.next_token = result.bonus
        return Verified(accepted_tokens=tree.tokens[result.path[1:]].tolist(), next_token=result.bonus,
                        features=result.features)
