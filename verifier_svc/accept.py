"""The accept step of a verified tree: run the tree-acceptance kernel on the target's logits.

Greedy: argmax + the greedy tree walk. Sampling with coins (the default): the probability
step (temperature, top-k, top-p) + target-only tree sampling with one coin per node and a
final coin. Position-keyed sampling (selectable): the greedy walk over logits perturbed by
Gumbel noise keyed by (seed, position, token) (`ddtree_kernels.keyed_sampling`), so a seeded output
does not depend on the trees. The walks run through
`ddtree_kernels.fused_accept.tree_accept` (`tree_accept_keyed` for keyed sampling), batched over
the sessions of a step, which on the GPU read the logits in their own dtype and never
materialise the probabilities or the perturbed scores. The same
code runs eagerly (CPU, or GPU without graphs) and inside the verifier's CUDA graphs: static
shapes, no host synchronisation until the caller copies the small result back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from common.protocol import SamplingParams, TokenLogprob
from common.staging import to_device
from common.tree import DraftTree
from ddtree_kernels.fused_accept import tree_accept, tree_accept_keyed
from ddtree_kernels.probs import process_probs_reference

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
                 top_p: Tensor | None = None, seeds: Tensor | None = None,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The accept kernels on B trees of T rows, with static shapes and no host sync on CUDA.

    tokens / next_token / next_sibling: int64 [B, T]; logits [B, T, V]; features [B, T, F].
    mode "greedy": every row greedy. The sampled modes mix rows: rows with `greedy` (bool [B])
    True take the greedy walk, the others sample with temperature / top_p float32 [B] (> 0 on
    every row, greedy rows included) and top_k int64 [B]:
    * "keyed" (position-keyed, `ddtree_kernels.keyed_sampling`): seeds int64 [B] and the nodes'
      positions int64 [B, T]; the token after a node at position q is keyed by (seed, q + 1),
      and the walk is the greedy walk over the perturbed scores;
    * "sample" (the target-only coin walk): coins float32 [B, T] and final_coin [B].
    Returns (result int64 [B, T + 2] = [accepted, bonus, path padded with -1] per row, features
    of the path rows [B, T, F] (rows past the path repeat row 0)).
    """
    if mode not in ("greedy", "sample", "keyed"):
        raise ValueError(f"unknown accept mode {mode!r}")
    b, t = tokens.shape
    offsets = (torch.arange(b, device=logits.device) * t)[:, None]

    def walk(is_greedy: bool | None, extra: dict) -> Tensor:
        """One accept kernel's walk: greedy, the coin walk, or (is_greedy None) position-keyed."""
        # (The accept stage writes every entry of its outputs: no fills needed.)
        predicts = torch.empty(b * t, dtype=torch.int32, device=logits.device)
        accept_index = torch.empty((b, t), dtype=torch.int32, device=logits.device)
        accept_num = torch.empty(b, dtype=torch.int32, device=logits.device)
        if is_greedy is None:
            tree_accept_keyed(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, **extra)
        else:
            tree_accept(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num,
                        greedy=is_greedy, **extra)
        # accept_index holds flattened slots b * T + i (SGLang's layout): back to node indices.
        num = accept_num.long()[:, None]
        slots = accept_index.long()
        bonus = predicts.long().gather(0, slots.gather(1, num).view(-1))[:, None]
        path = torch.where(slots >= 0, slots - offsets, -1)
        return torch.cat([num, bonus, path], dim=1)

    if mode == "keyed":
        result = walk(None, dict(greedy_rows=greedy, seeds=seeds, positions=(positions + 1).contiguous(),
                                 temperature=temperature, top_k=top_k, top_p=top_p))
    else:
        result = walk(True, {})
    if mode == "sample":
        sampled = walk(False, dict(coins=coins, final_coins=final_coin, temperature=temperature, top_k=top_k,
                                   top_p=top_p))
        result = torch.where(greedy[:, None], result, sampled)
    path = result[:, 2:].clamp(min=0)
    return result, features.gather(1, path[:, :, None].expand(b, t, features.shape[2]))


def accept_roots(roots: list[DraftTree], logits: Tensor, sampling: list[SamplingParams], *,
                 seeds: list[int] | None = None, positions: list[int] | None = None,
                 coins: list[Tensor | None] | None = None) -> Tensor:
    """The first token of B new sessions [B], on the logits' device (queued, not waited for):
    root-only trees (their prompts' last tokens) accepted in one batched call on the prompts'
    last logits [B, V]. Greedy rows take the argmax, sampled
    rows a sample of their filtered distribution: position-keyed with `seeds` and the roots'
    `positions` (prompt length - 1), or with coins from `draw_coins(g, 1)`."""
    b, dev = len(roots), logits.device
    tokens = to_device(torch.stack([r.tokens for r in roots]), dev)
    links = torch.full((b, 1), -1, dtype=torch.int64, device=dev)
    greedy = [s.greedy for s in sampling]
    extra = {}
    mode = "greedy" if all(greedy) else "keyed" if seeds is not None else "sample"
    if mode != "greedy":
        extra = dict(greedy=to_device(greedy, dev, torch.bool),
                     temperature=to_device([1.0 if s.greedy else s.temperature for s in sampling], dev, torch.float32),
                     top_k=to_device([s.top_k for s in sampling], dev, torch.int64),
                     top_p=to_device([s.top_p for s in sampling], dev, torch.float32))
    if mode == "keyed":
        extra.update(seeds=to_device(seeds, dev, torch.int64), positions=to_device(positions, dev, torch.int64)[:, None])
    elif mode == "sample":
        c = to_device(torch.stack([x if x is not None else torch.full((2,), 0.5) for x in coins]), dev)
        extra.update(coins=c[:, :1].contiguous(), final_coin=c[:, 1].contiguous())
    with torch.inference_mode():
        result, _ = accept_batch(mode, tokens, links, links, logits[:, None], logits.new_zeros(b, 1, 0), **extra)
    return result[:, 1]


def emitted_logprobs(logits: Tensor, tokens: list[int], sampling: list[SamplingParams],
                     top_n: list[int]) -> list[TokenLogprob]:
    """Log probabilities of emitted tokens, each under the distribution it was drawn from.

    Row r of logits [R, V] is the target's at the position that emitted tokens[r], for a
    session with sampling[r], asking for the top_n[r] most likely tokens. A greedy row's
    distribution is the target's softmax; a sampled row's is the accept step's
    (`ddtree_kernels.probs.process_probs_reference`: temperature, top-k, top-p, renormalised), and the
    tokens it drops are never listed. One batched call for all rows; only rounds that ask run it.
    """
    dev = logits.device
    greedy = [s.greedy for s in sampling]
    temperature = torch.tensor([1.0 if g else s.temperature for g, s in zip(greedy, sampling)],
                               dtype=torch.float32, device=dev)
    top_k = torch.tensor([0 if g else s.top_k for g, s in zip(greedy, sampling)], dtype=torch.int64, device=dev)
    top_p = torch.tensor([1.0 if g else s.top_p for g, s in zip(greedy, sampling)], dtype=torch.float32, device=dev)
    with torch.inference_mode():
        scaled = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
        kept = process_probs_reference(logits, temperature, top_k, top_p) > 0
        mass = torch.where(kept, scaled.exp(), 0.0).sum(dim=-1, keepdim=True)
        logp = torch.where(kept, (scaled - mass.log()).clamp(max=0.0), float("-inf"))
        # Unmasked: should the filters here and the accept kernel's part at a near-tie, the token
        # still gets its finite share.
        chosen = (scaled - mass.log()).clamp(max=0.0).gather(1, torch.tensor(tokens, device=dev)[:, None])[:, 0]
        n = max(top_n)
        values, ids = logp.topk(n, dim=-1) if n else (logp[:, :0], logp[:, :0].long())
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
    out = []
    for r, token in enumerate(tokens):
        top = tuple((i, v) for i, v in zip(ids[r][: top_n[r]], values[r][: top_n[r]]) if v > float("-inf"))
        out.append(TokenLogprob(token, chosen[r], top))
    return out
