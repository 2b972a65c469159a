"""The probability step before tree sampling: temperature, top-k, top-p, renormalisation.

Per row of logits [R, V]:

    p = softmax(logits.float() / T)
    top-k (k in 1..V-1): keep p >= the k-th largest p (ties at the boundary kept),
        zero the rest, renormalise;
    top-p (top_p < 1): keep p >= pivot, where pivot is the largest value v with
        sum(p[p >= v]) >= top_p * sum(p), i.e. the smallest head of the sorted
        distribution whose mass reaches top_p (ties kept); zero the rest, renormalise.

top_k <= 0 or >= V and top_p >= 1 switch the filters off. `process_probs_reference` is
the plain PyTorch specification (it sorts) that ddtree_kernels/fused_accept.py's
`tree_accept_reference` composes; the Triton stage there finds the same thresholds on the
logits without materialising the probabilities.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ddtree_kernels.tree_sampling import expect_tensor


def _check_probs_args(logits, temperature, top_k, top_p) -> tuple[int, int]:
    """Check process_probs_reference's arguments; return (R, V)."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a 2-D floating-point tensor [R, V]")
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits need at least one column")
    expect_tensor("logits", logits, logits.dtype, (rows, vocab), logits.device)
    expect_tensor("temperature", temperature, torch.float32, (rows,), logits.device)
    expect_tensor("top_k", top_k, torch.int64, (rows,), logits.device)
    expect_tensor("top_p", top_p, torch.float32, (rows,), logits.device)
    return rows, vocab


def process_probs_reference(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Softmax with temperature, then top-k, then top-p, by sorting; float32 [R, V]."""
    _, vocab = _check_probs_args(logits, temperature, top_k, top_p)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)

    # top-k: the k-th largest value is the threshold.
    sorted_desc = probs.sort(dim=-1, descending=True).values
    k_on = (top_k > 0) & (top_k < vocab)
    kth = sorted_desc.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
    probs = torch.where(k_on[:, None], _keep_at_least(probs, kth), probs)

    # top-p: the pivot is the sorted value at the first position whose cumulative mass
    # reaches top_p * total (the cumsum is non-decreasing, so count the positions below).
    sorted_desc = probs.sort(dim=-1, descending=True).values
    goal = top_p[:, None] * probs.sum(dim=-1, keepdim=True)
    first = (sorted_desc.cumsum(dim=-1) < goal).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    pivot = sorted_desc.gather(1, first)
    return torch.where((top_p < 1)[:, None], _keep_at_least(probs, pivot), probs)


def _keep_at_least(probs: Tensor, threshold: Tensor) -> Tensor:
    """Zero the entries below each row's threshold [R, 1] and renormalise."""
    kept = torch.where(probs >= threshold, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
