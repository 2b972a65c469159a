"""The probability step before tree sampling: temperature, top-k, top-p, renormalisation.

Per row of logits [R, V]:

    p = softmax(logits.float() / T)
    top-k (k in 1..V-1): keep p >= the k-th largest p (ties at the boundary kept),
        zero the rest, renormalise;
    top-p (top_p < 1): keep p >= pivot, where pivot is the largest value v with
        sum(p[p >= v]) >= top_p * sum(p), i.e. the smallest head of the sorted
        distribution whose mass reaches top_p (ties kept); zero the rest, renormalise.

top_k <= 0 or >= V and top_p >= 1 switch the filters off. `process_probs_reference`
sorts; `process_probs_triton` (one program per row) finds both thresholds by binary
search over the float32 bit pattern, which orders non-negative floats like their values,
so it needs only passes over the row and no sort. `process_probs` dispatches like the
tree kernels (Triton on CUDA, DDTREE_KERNELS overrides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.tree_sampling import block_size, expect_tensor, kernel_backend


def _check_probs_args(logits, temperature, top_k, top_p) -> tuple[int, int]:
    """Check process_probs' arguments; return (R, V)."""
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


@triton.jit
def _process_probs_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, probs_ptr, V,
                          BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + r * V
    row = probs_ptr + r * V
    temperature = tl.load(temperature_ptr + r)
    top_k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)

    # Softmax in three passes: max, sum of exponentials, write p.
    row_max = -float("inf")
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        row_max = tl.maximum(row_max, tl.max(x / temperature, axis=0))
    denom = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        denom += tl.sum(tl.exp(x / temperature - row_max), axis=0)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        tl.store(row + offs, tl.exp(x / temperature - row_max) / denom, mask=offs < V)

    if (top_k > 0) & (top_k < V):
        kth = _largest_threshold(row, V, top_k.to(tl.float32), False, BLOCK_V)
        _keep_at_least_kernel(row, V, kth, BLOCK_V)
    if top_p < 1.0:
        goal = top_p * _measure_at_least(row, V, 0, True, BLOCK_V)
        pivot = _largest_threshold(row, V, goal, True, BLOCK_V)
        _keep_at_least_kernel(row, V, pivot, BLOCK_V)


@triton.jit
def _measure_at_least(row, V, threshold_bits, MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Mass (MASS) or count (not MASS) of the row's entries whose bits are >= threshold_bits."""
    acc = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row + offs, mask=offs < V, other=0.0)
        keep = (p.to(tl.int32, bitcast=True) >= threshold_bits) & (offs < V)
        if MASS:
            acc += tl.sum(tl.where(keep, p, 0.0), axis=0)
        else:
            acc += tl.sum(keep.to(tl.float32), axis=0)  # exact below 2**24 entries
    return acc


@triton.jit
def _largest_threshold(row, V, goal, MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Bits of the largest float t with measure(p >= t) >= goal (a value of the row).

    Invariant: measure(lo) >= goal (lo = 0 keeps everything) and measure(hi) < goal
    (hi = +inf keeps nothing); 31 halvings of [0, 0x7F800000] leave hi = lo + 1.
    """
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0x7F800000, tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        ok = _measure_at_least(row, V, mid, MASS, BLOCK_V) >= goal
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _keep_at_least_kernel(row, V, threshold_bits, BLOCK_V: tl.constexpr):
    """Zero the entries below the threshold and renormalise, in place."""
    mass = _measure_at_least(row, V, threshold_bits, True, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(row + offs, mask=offs < V, other=0.0)
        keep = p.to(tl.int32, bitcast=True) >= threshold_bits
        tl.store(row + offs, tl.where(keep, p / mass, 0.0), mask=offs < V)


def process_probs_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Triton version of process_probs_reference (one program per row, no sort)."""
    rows, vocab = _check_probs_args(logits, temperature, top_k, top_p)
    probs = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows > 0:
        _process_probs_kernel[(rows,)](logits, temperature, top_k, top_p, probs, vocab,
                                       BLOCK_V=block_size(vocab))
    return probs


def process_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature / top-k / top-p probabilities: Triton on CUDA, the reference elsewhere."""
    if kernel_backend(logits.device) == "triton":
        return process_probs_triton(logits, temperature, top_k, top_p)
    return process_probs_reference(logits, temperature, top_k, top_p)
