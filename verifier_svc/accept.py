"""The accept step of a verified tree: run the tree-acceptance kernel on the target's logits.

Greedy: argmax + the greedy tree walk. Sampling: the probability step (temperature, top-k,
top-p) + target-only tree sampling with one coin per node and a final coin. Both through
`kernels.fused_accept.tree_accept`, batched over the sessions of a step, which on the GPU
reads the logits in their own dtype and never materialises the probabilities. The same
code runs eagerly (CPU, or GPU without graphs) and inside the verifier's CUDA graphs: static
shapes, no host synchronisation until the caller copies the small result back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from common.protocol import SamplingParams
from common.tree import DraftTree
from kernels.fused_accept import tree_accept

# Coins are kept inside (0, 1): a coin of exactly 0 would accept a zero-probability child
# (the test is `coin <= mass`), one of exactly 1 could pick a zero-probability bonus token.
COIN_MIN = torch.finfo(torch.float32).tiny
COIN_MAX = 1.0 - 2.0**-24


# An optional hook around each part of a verifier step ("forward", "sample", "commit",
# "prefill"): called with the part's name, it returns a context manager that wraps the part
# (a tracing span, a timer). It only observes; results are the same with or without it.
Stage = Callable[[str], AbstractContextManager]


def no_stage(name: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def draw_coins(generator: torch.Generator, num_nodes: int) -> Tensor:
    """float32 [num_nodes + 1] uniforms for one tree: one per node, then the final coin."""
    return torch.rand(num_nodes + 1, generator=generator).clamp_(COIN_MIN, COIN_MAX)


def accept_batch(mode: str, tokens: Tensor, next_token: Tensor, next_sibling: Tensor, logits: Tensor,
                 features: Tensor, *, greedy: Tensor | None = None, coins: Tensor | None = None,
                 final_coin: Tensor | None = None, temperature: Tensor | None = None, top_k: Tensor | None = None,
                 top_p: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The accept kernels on B trees of T rows, with static shapes and no host sync on CUDA.

    tokens / next_token / next_sibling: int64 [B, T]; logits [B, T, V]; features [B, T, F].
    mode "greedy": every row greedy. mode "sample": rows with `greedy` (bool [B]) False sample
    with coins float32 [B, T], final_coin [B], temperature / top_p float32 [B] (> 0 on every row,
    greedy rows included), top_k int64 [B]; rows with `greedy` True take the greedy walk.
    Returns (result int64 [B, T + 2] = [accepted, bonus, path padded with -1] per row, features
    of the path rows [B, T, F] (rows past the path repeat row 0)).
    """
    if mode not in ("greedy", "sample"):
        raise ValueError(f"unknown accept mode {mode!r}")
    b, t = tokens.shape
    offsets = (torch.arange(b, device=logits.device) * t)[:, None]

    def walk(is_greedy: bool, extra: dict) -> Tensor:
        predicts = torch.full((b * t,), -1, dtype=torch.int32, device=logits.device)
        accept_index = torch.full((b, t), -1, dtype=torch.int32, device=logits.device)
        accept_num = torch.zeros(b, dtype=torch.int32, device=logits.device)
        tree_accept(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num,
                    greedy=is_greedy, **extra)
        # accept_index holds flattened slots b * T + i (SGLang's layout): back to node indices.
        num = accept_num.long()[:, None]
        slots = accept_index.long()
        bonus = predicts.long().gather(0, slots.gather(1, num).view(-1))[:, None]
        path = torch.where(slots >= 0, slots - offsets, -1)
        return torch.cat([num, bonus, path], dim=1)

    result = walk(True, {})
    if mode == "sample":
        sampled = walk(False, dict(coins=coins, final_coins=final_coin, temperature=temperature, top_k=top_k,
                                   top_p=top_p))
        result = torch.where(greedy[:, None], result, sampled)
    path = result[:, 2:].clamp(min=0)
    return result, features.gather(1, path[:, :, None].expand(b, t, features.shape[2]))


def accept_roots(roots: list[DraftTree], logits: Tensor, sampling: list[SamplingParams],
                 coins: list[Tensor | None]) -> list[int]:
    """The first token of B new sessions: root-only trees (their prompts' last tokens) accepted
    in one batched call on the prompts' last logits [B, V]; coins from `draw_coins(g, 1)` where
    sampling. Greedy rows take the argmax, sampled rows a sample of their filtered distribution."""
    b, dev = len(roots), logits.device
    tokens = torch.stack([r.tokens for r in roots]).to(dev)
    links = torch.full((b, 1), -1, dtype=torch.int64, device=dev)
    greedy = [s.greedy for s in sampling]
    extra = {}
    mode = "greedy" if all(greedy) else "sample"
    if mode == "sample":
        c = torch.stack([x if x is not None else torch.full((2,), 0.5) for x in coins]).to(dev)
        extra = dict(greedy=torch.tensor(greedy, device=dev), coins=c[:, :1].contiguous(),
                     final_coin=c[:, 1].contiguous(),
                     temperature=torch.tensor([1.0 if s.greedy else s.temperature for s in sampling],
                                              dtype=torch.float32, device=dev),
                     top_k=torch.tensor([s.top_k for s in sampling], dtype=torch.int64, device=dev),
                     top_p=torch.tensor([s.top_p for s in sampling], dtype=torch.float32, device=dev))
    with torch.inference_mode():
        result, _ = accept_batch(mode, tokens, links, links, logits[:, None], logits.new_zeros(b, 1, 0), **extra)
    return result[:, 1].tolist()
