"""Benchmark only: controlled acceptance, so random-weight models can be measured at a set τ.

Random weights accept almost nothing, which says nothing about serving speed at a real
acceptance rate. With `--bench-oracle FILE` the drafter still runs its real draft forward
(so its cost is real), then edits the block logits so that each tree contains the target's
own greedy continuation up to a random depth: at depth d = 1, 2, ... the true next token is
made the top candidate with probability `accept_prob` each, until the first miss, where it
is removed (so the verifier rejects there). A greedy chain then accepts sum_d p^d tokens on
average, i.e. τ = 1 + p (1 - p^D) / (1 - p) tokens per round for D = block_size - 1. The edited
block is a calibrated draft of that acceptance (see `__call__`).

The file is JSON: {"accept_prob": p, "seed": s, "continuations": [{"prompt_token_ids": [...],
"tokens": [...]}, ...]}, the continuations taken from a plain greedy pass over the same
prompts (bench/serve.py writes it). Prompts without a continuation are left alone.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.staging import to_device


_MASK = (1 << 64) - 1


def _uniform(key: int) -> float:
    """A uniform float in (0, 1] for `key`: splitmix64's mixing. Seeding a `random.Random` per
    session and step, as this did before, cost more than the rest of the edit."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return 1.0 - ((z ^ (z >> 31)) >> 11) / (1 << 53)


@dataclass
class _Followed:
    """A session's prompt, its continuation (None: unknown) and how much of its output is known
    to follow it: the output list it checked and up to where (or that it left the continuation)."""
    prompt: list[int]  # held so that its id stays this session's while the entry lives
    truth: list[int] | None
    output: list[int] | None = None
    checked: int = 0
    diverged: bool = False

    def follows(self, out: list[int]) -> bool:
        """Whether `out` is a prefix of the continuation, checking only what was appended since
        the last call (outputs only grow; another list or a shorter one is checked whole)."""
        n = len(out)
        if out is not self.output or n < self.checked:
            self.output, self.checked, self.diverged = out, 0, False
        if not self.diverged and n > self.checked:
            self.diverged = out[self.checked:n] != self.truth[self.checked:n]
            self.checked = n
        return not self.diverged


class ControlledAcceptance:
    MAX_FOLLOWED = 4096  # sessions remembered (the table is cleared past it)

    def __init__(self, accept_prob: float, continuations: dict[tuple[int, ...], list[int]], seed: int = 0):
        if not 0.0 <= accept_prob <= 1.0:
            raise ValueError(f"accept_prob must be in [0, 1], got {accept_prob}")
        self.accept_prob, self.continuations, self.seed = accept_prob, continuations, seed
        self._followed: dict[int, _Followed] = {}  # id(prompt list) -> its session's state

    @classmethod
    def load(cls, path: str | Path) -> "ControlledAcceptance":
        try:
            raw = json.loads(Path(path).read_text())
            table = {tuple(int(t) for t in c["prompt_token_ids"]): [int(t) for t in c["tokens"]]
                     for c in raw["continuations"]}
            return cls(float(raw["accept_prob"]), table, int(raw.get("seed", 0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad --bench-oracle file {path}: {exc}") from None

    def _follow(self, prompt: list[int]) -> _Followed:
        """The state of the session whose prompt list this is (looked up by identity: a session
        keeps its prompt list, so the continuation's lookup and the output's check run once)."""
        entry = self._followed.get(id(prompt))
        if entry is None or entry.prompt is not prompt:
            if len(self._followed) >= self.MAX_FOLLOWED:
                self._followed.clear()
            entry = self._followed[id(prompt)] = _Followed(prompt, self.continuations.get(tuple(prompt)))
        return entry

    def _run(self, key: int, span: int) -> int:
        """How many depths from the first hit before the first miss (at most `span`): each depth
        hits with `accept_prob`, independently, which makes the run geometric; drawn by inverting
        its distribution, P(run >= j) = p^j, with one uniform per (session, step)."""
        p = self.accept_prob
        if p >= 1.0 or span == 0:
            return span
        if p <= 0.0:
            return 0
        return min(span, int(math.log(_uniform(key)) / math.log(p)))

    def __call__(self, prompts: Sequence[list[int]], emitted: Sequence[list[int]], depths: int
                 ) -> Callable[[torch.Tensor], None] | None:
        """Decide the edits of a draft step's block logits [S, depths, V] for sessions with a known
        continuation (the scheduler asks once the step is queued, so this runs while the device
        drafts); returns what applies them (a few batched operations queued behind the step, no
        wait), or None when there is nothing to edit. Each (prompt, output length) draws its own
        coins, so a session's edits do not depend on the batch it is in.

        Every depth of an edited session's block is replaced by a calibrated draft of this
        acceptance: the top candidate has probability `accept_prob` (the continuation's next token
        up to the run; at the miss, where the true token is removed, and past it, another one)
        and the others share the rest evenly. Its path probabilities are then what the
        acceptance makes of them on average: they neither tell where a run ends nor give the
        other candidates, which this acceptance never takes, a chance; the adaptive budget
        weighs trees as it would with a calibrated real draft."""
        table = []  # per edited session: its row, its run, and the continuation's next `depths` tokens (-1 past it)
        for i, (prompt, out) in enumerate(zip(prompts, emitted)):
            entry = self._follow(prompt)
            truth = entry.truth
            n = len(out)  # the root is out[-1] == truth[n - 1]; the block proposes truth[n:]
            if truth is None or not entry.follows(out):
                continue
            span = min(depths, len(truth) - n)
            run = self._run(hash((self.seed, len(prompt), n, tuple(prompt[-8:]))), span)
            table.append([i, run, *truth[n: n + span], *([-1] * (depths - span))])
        if not table:
            return None
        p = min(max(self.accept_prob, 1e-6), 1.0 - 1e-6)

        @torch.inference_mode()  # the block logits are inference tensors
        def apply(logits: torch.Tensor) -> None:
            # The others' logits 0 and the top's log(p / (1 - p) * (V - 1)): P(top) = p. Only
            # operations that queue without waiting for the device (no indexed assignment of a
            # Python number, whose value would be copied from the host).
            boost = math.log(p / (1.0 - p) * (logits.shape[-1] - 1))
            packed = to_device(table, logits.device, torch.int64)  # one asynchronous copy, no wait
            rows, run, truth = packed[:, 0], packed[:, 1:2], packed[:, 2:]
            depth = torch.arange(truth.shape[1], device=logits.device)
            top = torch.where(depth < run, truth, torch.where(truth == 0, 1, 0))  # past the run, not the true one
            miss = (depth == run) & (truth >= 0)
            block = torch.zeros(len(table), *logits.shape[1:], dtype=logits.dtype, device=logits.device)
            block.scatter_(-1, top[..., None], boost)
            gone = torch.where(miss, truth, top)[..., None]  # the miss's true token, else the top again
            block.scatter_(-1, gone, torch.where(miss, float("-inf"), boost)[..., None].to(block.dtype))
            logits.index_copy_(0, rows, block)

        return apply
