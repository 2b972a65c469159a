"""Benchmark only: controlled acceptance, so random-weight models can be measured at a set τ.

Random weights accept almost nothing, which says nothing about serving speed at a real
acceptance rate. With `--bench-oracle FILE` the drafter still runs its real draft forward
(so its cost is real), then edits the block logits so that each tree contains the target's
own greedy continuation up to a random depth: at depth d = 1, 2, ... the true next token is
made the top candidate with probability `accept_prob` each, until the first miss, where it
is removed (so the verifier rejects there). A greedy chain then accepts sum_d p^d tokens on
average, i.e. τ = 1 + p (1 - p^D) / (1 - p) tokens per round for D = block_size - 1.

The file is JSON: {"accept_prob": p, "seed": s, "continuations": [{"prompt_token_ids": [...],
"tokens": [...]}, ...]}, the continuations taken from a plain greedy pass over the same
prompts (bench/serve.py writes it). Prompts without a continuation are left alone.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from common.staging import to_device


class ControlledAcceptance:
    def __init__(self, accept_prob: float, continuations: dict[tuple[int, ...], list[int]], seed: int = 0):
        if not 0.0 <= accept_prob <= 1.0:
            raise ValueError(f"accept_prob must be in [0, 1], got {accept_prob}")
        self.accept_prob, self.continuations, self.seed = accept_prob, continuations, seed

    @classmethod
    def load(cls, path: str | Path) -> "ControlledAcceptance":
        try:
            raw = json.loads(Path(path).read_text())
            table = {tuple(int(t) for t in c["prompt_token_ids"]): [int(t) for t in c["tokens"]]
                     for c in raw["continuations"]}
            return cls(float(raw["accept_prob"]), table, int(raw.get("seed", 0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad --bench-oracle file {path}: {exc}") from None

    def __call__(self, prompts: Sequence[list[int]], emitted: Sequence[list[int]], depths: int
                 ) -> Callable[[torch.Tensor], None] | None:
        """Decide the edits of a draft step's block logits [S, depths, V] for sessions with a known
        continuation (the scheduler asks once the step is queued, so this runs while the device
        drafts); returns what applies them (two scatters for the whole batch, queued behind the
        step), or None when there is nothing to edit."""
        hits, misses = [], []  # (session, depth, token)
        for i, (prompt, out) in enumerate(zip(prompts, emitted)):
            truth = self.continuations.get(tuple(prompt))
            n = len(out)  # the root is out[-1] == truth[n - 1]; the block proposes truth[n:]
            if truth is None or out != truth[:n]:
                continue
            rng = random.Random(hash((self.seed, len(prompt), n, tuple(prompt[-8:]))))
            for d in range(min(depths, len(truth) - n)):
                if rng.random() < self.accept_prob:
                    hits.append((i, d, truth[n + d]))
                else:
                    misses.append((i, d, truth[n + d]))
                    break
        if not hits and not misses:
            return None
        edits = [h + (True,) for h in hits] + [m + (False,) for m in misses]

        @torch.inference_mode()  # the block logits are inference tensors
        def apply(logits: torch.Tensor) -> None:
            # One asynchronous copy of every edit (no wait for the draft forward); a (session, depth)
            # is edited at most once, so one scatter applies them all.
            i, d, t, hit = to_device(edits, logits.device, torch.int64).T
            logits[i, d, t] = torch.where(hit.bool(), logits[i, d].amax(-1) + 10.0, float("-inf")).to(logits.dtype)

        return apply
