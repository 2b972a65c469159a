"""Position-keyed sampling: the token sampled at a position depends on (seed, position, the
target's filtered distribution) alone, never on which tree or batch asked.

Gumbel-max: with g(v) i.i.d. standard Gumbel noise, argmax_v (logit_v / T + g(v)) over the
tokens the top-k / top-p filters keep is an exact sample of the filtered softmax. Here the
noise of token v at absolute position q is a counter-based hash of (seed, q, v), so every
node of a tree at the same position shares it, and a tree's walk becomes the greedy walk
over the perturbed scores: accept the child that holds the node's perturbed argmax, and
the bonus token is the perturbed argmax at the last accepted node. Acceptance at a node is
then P(sample in children), as with the target-only coin walk, and a seeded speculative run
samples exactly what seeded plain decoding samples, whatever the trees (up to float
rounding of the logits themselves).

The hash: a 31-bit integer mixer (two multiply-xorshift rounds, as in the well-known 32-bit
integer hash, on values below 2^31 so that int64 products never overflow), keyed by the
seed's two 31-bit halves, the position and the token; 24 bits of it give u in (0, 1) and
g = -log(-log(u)) in float32. This is the plain PyTorch implementation (it materialises
[rows, V] tensors); the filters are `ddtree_kernels.probs.process_probs_reference`'s.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ddtree_kernels.probs import process_probs_reference

_M31 = (1 << 31) - 1
_MUL = 0x45D9F3B
_SEED_SALT, _TOKEN_SALT = 0x2545F491, 0x68E31DA4


def _mix(x: Tensor) -> Tensor:
    """Scramble int64 values in [0, 2^32) into [0, 2^31)."""
    x = (((x >> 16) ^ x) * _MUL) & _M31
    x = (((x >> 16) ^ x) * _MUL) & _M31
    return (x >> 16) ^ x


def position_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """int64 keys in [0, 2^31) of (seed, position) pairs: seeds int64 >= 0, positions int64, same shape."""
    lo, hi = seeds & _M31, seeds >> 31  # hi < 2^32: _mix's products stay below 2^63
    return _mix(_mix(lo ^ _mix(hi ^ _SEED_SALT)) ^ (positions & _M31))


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """float32 [*keys.shape, V]: the standard Gumbel noise of every token under each key."""
    tokens = _mix(torch.arange(vocab_size, device=keys.device) ^ _TOKEN_SALT)
    h = _mix(keys[..., None] ^ tokens)
    u = ((h >> 7).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in float32, in (0, 1)
    return -torch.log(-torch.log(u))


def keyed_scores(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor,
                 top_p: Tensor) -> Tensor:
    """Perturbed scores float32 [R, V] whose argmax is the keyed sample of each row.

    logits [R, V]; per row: seeds int64 (>= 0), positions int64 (the position of the token
    being sampled), temperature / top_p float32 (> 0), top_k int64 (0 = off). Tokens the
    filters drop score -inf.
    """
    probs = process_probs_reference(logits, temperature, top_k, top_p)
    scores = logits.float() / temperature[:, None] + gumbel_noise(position_keys(seeds, positions), logits.shape[-1])
    return torch.where(probs > 0, scores, float("-inf"))


def keyed_sample_reference(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor,
                           top_p: Tensor) -> Tensor:
    """The sampled token of each row, int64 [R]."""
    return keyed_scores(logits, seeds, positions, temperature, top_k, top_p).argmax(dim=-1)
