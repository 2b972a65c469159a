"""Verifier sessions: prefill, validate and verify draft trees, sample, commit.

Everything that arrives from a drafter is checked here before it touches the model:
prompt ids, sampling values, the tree's buffers, its root, and its fit in the session's KV
capacity. Errors are `VerifierError`s that carry a gRPC-style status name.
"""
from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from common.protocol import Prefilled, SamplingParams, StatusError, Verified
from common.tree import DraftTree, TreeError, ancestor_mask, walk_tree
from kernels.probs import process_probs
from kernels.tree_sampling import tree_speculative_sampling_target_only, verify_tree_greedy
from verifier_svc.target_runner import TargetRunner

# Coins are kept inside (0, 1): a coin of exactly 0 would accept a zero-probability child
# (the test is `coin <= mass`), one of exactly 1 could pick a zero-probability bonus token.
_COIN_MIN = torch.finfo(torch.float32).tiny
_COIN_MAX = 1.0 - 2.0**-24

# An optional hook around each step of a request ("forward", "sample", "commit"): called
# with the step's name, it returns a context manager that wraps the step (a tracing span, a
# timer). It only observes; results are the same with or without it.
Stage = Callable[[str], AbstractContextManager]


def no_stage(name: str) -> AbstractContextManager:
    return contextlib.nullcontext()


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
                path, bonus = self._accept(session, root_only, out.logits[0])
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
        with stage("forward"):
            mask = ancestor_mask(layout.parents, layout.depths)
            out = self.runner.verify(session.slot, session.length, tree.tokens, layout.depths, mask)
        with stage("sample"):
            path, bonus = self._accept(session, tree, out.logits[0], max_depth=layout.max_depth)
        with stage("commit"):
            self.runner.commit(session.slot, session.length, path)
            session.length += path.shape[0]
            session.next_token = bonus
            accepted = tree.tokens[path[1:].cpu()].tolist()
            features = out.features[0, path.to(out.features.device)]
        return Verified(accepted_tokens=accepted, next_token=bonus, features=features)

    def _accept(self, session: _Session, tree: DraftTree, logits: torch.Tensor, max_depth: int = 0):
        """Run the tree-acceptance kernel: returns (accepted node path incl. root, bonus token)."""
        device = logits.device
        n = tree.num_nodes
        s = max_depth + 1
        candidates = tree.tokens[None].to(device)
        retrive_index = torch.arange(n, device=device)[None]
        next_token = tree.next_token[None].to(device)
        next_sibling = tree.next_sibling[None].to(device)
        predicts = torch.full((n,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((1, s), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros(1, dtype=torch.int32, device=device)
        sp = session.sampling
        if sp.greedy:
            target_predict = logits.argmax(-1)[None]
            verify_tree_greedy(predicts, accept_index, accept_num, candidates, retrive_index,
                               next_token, next_sibling, target_predict)
        else:
            rows = logits.shape[0]
            probs = process_probs(
                logits,
                torch.full((rows,), sp.temperature, device=device),
                torch.full((rows,), sp.top_k, dtype=torch.int64, device=device),
                torch.full((rows,), sp.top_p, device=device),
            )
            coins = torch.rand(n + 1, generator=session.generator).clamp_(_COIN_MIN, _COIN_MAX).to(device)
            tree_speculative_sampling_target_only(
                predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling,
                coins[None, :n], coins[n:], probs[None], torch.zeros_like(probs)[None],
            )
        path = accept_index[0, : int(accept_num[0]) + 1].long()
        bonus = int(predicts[path[-1]])
        return path, bonus
