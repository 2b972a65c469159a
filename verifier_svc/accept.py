"""The accept step of a verified tree: run the tree-acceptance kernel on the target's logits.

Greedy: argmax + `verify_tree_greedy`. Sampling: the probability step (temperature, top-k,
top-p) + `tree_speculative_sampling_target_only` with one coin per node and a final coin.
Both through `kernels.fused_accept.tree_accept`, which on the GPU reads the logits in their
own dtype and never materialises the probabilities. The same
code runs eagerly (CPU, or GPU without graphs) and inside the verifier's CUDA graphs: static
shapes, no host synchronisation until `unpack_accept` copies the small result back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from common.protocol import SamplingParams
from common.tree import DraftTree
from kernels.fused_accept import tree_accept

# Coins are kept inside (0, 1): a coin of exactly 0 would accept a zero-probability child
# (the test is `coin <= mass`), one of exactly 1 could pick a zero-probability bonus token.
COIN_MIN = torch.finfo(torch.float32).tiny
COIN_MAX = 1.0 - 2.0**-24


# An optional hook around each step of a request ("forward", "sample", "commit"): called
# with the step's name, it returns a context manager that wraps the step (a tracing span, a
# timer). It only observes; results are the same with or without it.
Stage = Callable[[str], AbstractContextManager]


def no_stage(name: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def draw_coins(generator: torch.Generator, num_nodes: int) -> Tensor:
    """float32 [num_nodes + 1] uniforms for one tree: one per node, then the final coin."""
    return torch.rand(num_nodes + 1, generator=generator).clamp_(COIN_MIN, COIN_MAX)


@dataclass
class AcceptResult:
    """One verified tree: accepted node path (root first), bonus token, features of the path."""

    path: Tensor  # int64 [1 + accepted], CPU, node indices
    bonus: int
    features: Tensor  # [1 + accepted, feature_dim] on the model's device (a copy)


def accept_step(mode: str, tokens: Tensor, next_token: Tensor, next_sibling: Tensor, logits: Tensor,
                features: Tensor, *, coins: Tensor | None = None, final_coin: Tensor | None = None,
                temperature: Tensor | None = None, top_k: Tensor | None = None,
                top_p: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The accept kernels on one tree of T rows, with static shapes and no host sync on CUDA.

    tokens / next_token / next_sibling: int64 [T]; logits [T, V]; features [T, F];
    coins float32 [T], final_coin [1], temperature / top_p float32 [1], top_k int64 [1]
    (sampling only). Returns (result int64 [T + 2] = [accepted, bonus, path padded with -1],
    features of the path rows [T, F] (rows past the path repeat row 0)).
    """
    t = tokens.shape[0]
    device = logits.device
    predicts = torch.full((t,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((1, t), -1, dtype=torch.int32, device=device)
    accept_num = torch.zeros(1, dtype=torch.int32, device=device)
    if mode not in ("greedy", "sample"):
        raise ValueError(f"unknown accept mode {mode!r}")
    extra = {}
    if mode == "sample":
        extra = dict(coins=coins[None], final_coins=final_coin, temperature=temperature, top_k=top_k, top_p=top_p)
    tree_accept(logits[None], tokens[None], next_token[None], next_sibling[None], predicts, accept_index, accept_num,
                greedy=mode == "greedy", **extra)
    num = accept_num.long()
    path = accept_index[0].long()
    bonus = predicts.long().gather(0, path.gather(0, num))
    result = torch.cat([num, bonus, path])
    return result, features.index_select(0, path.clamp(min=0))


def unpack_accept(result: Tensor, features: Tensor) -> AcceptResult:
    """Host side of `accept_step`'s outputs (one device-to-host copy of T + 2 integers)."""
    values = result.cpu()
    accepted = int(values[0])
    path = values[2: 3 + accepted].clone()
    return AcceptResult(path=path, bonus=int(values[1]), features=features[: accepted + 1].clone())


def accept_tree(tree: DraftTree, logits: Tensor, features: Tensor, sampling: SamplingParams,
                coins: Tensor | None = None) -> AcceptResult:
    """Eager accept of one tree: logits [n, V] and features [n, F] of its nodes; `coins` from
    `draw_coins` when sampling. Returns the accepted path, the bonus token and the path's features."""
    dev = logits.device
    extra = {}
    if not sampling.greedy:
        if coins is None:
            raise ValueError("sampling needs coins: float32 [num_nodes + 1]")
        n = tree.num_nodes
        extra = dict(coins=coins[:n].to(dev), final_coin=coins[n:n + 1].to(dev),
                     temperature=torch.tensor([sampling.temperature], dtype=torch.float32, device=dev),
                     top_k=torch.tensor([sampling.top_k], dtype=torch.int64, device=dev),
                     top_p=torch.tensor([sampling.top_p], dtype=torch.float32, device=dev))
    with torch.inference_mode():
        result, path_features = accept_step("greedy" if sampling.greedy else "sample", tree.tokens.to(dev),
                                            tree.next_token.to(dev), tree.next_sibling.to(dev), logits, features,
                                            **extra)
    return unpack_accept(result, path_features)
