"""The drafter's candidates: the k largest log-probabilities of each row of draft logits, and their tokens.

The DDTree build needs, per session and depth, the top k = budget log-probs of the draft's
distribution and their tokens (`drafter_svc.ddtree.top_candidates`). The reference is what
the definition says: torch.topk over torch.log_softmax(logits.float()). On an H200 it costs
0.83 ms for 16 sessions x 15 depths over 151,936 tokens (float conversion, log_softmax,
and a top-k that reads each long row several times), on the drafter's critical path.

The Triton path reads the logits once. One pass per (row, vocabulary chunk) writes the
maximum of every sub-chunk of SUB logits, and the chunk's maximum and sum of exp(x - max)
(the log-sum-exp, combined per row in float32). The row's k largest logits lie in the k
sub-chunks with the largest maxima: each of those holds a logit at least the k-th largest
maximum, and every logit elsewhere is at most it. So a top-k over the sub-chunk maxima
(1/SUB of the row), then over those k * SUB logits, gives the row's top k; their log-probs
are logit - log-sum-exp. Same tokens and log-probs as the reference up to float rounding
(the sums run in another order); among equal logits either may be taken, as torch.topk
leaves open too. A row with a NaN gets NaN log-probs, as log_softmax gives it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.tree_sampling import kernel_backend

SUB = 16  # logits per sub-chunk: the Triton path needs the vocabulary to be a multiple of it
CHUNK_V = 4096  # vocabulary per program of the pass (a power of two); tests lower it
# Rows from which `top_logprobs` takes the Triton path. Its ~20 small launches cost about 0.35 ms
# of host time, more than the reference's device time on few rows (H200, V = 151,936, k = 16:
# 15 rows 0.18 ms reference against 0.45 ms; 60 rows 0.27 against 0.34; 240 rows 0.83 against
# 0.45; 480 rows 1.46 against 0.47; bench/draft_topk.py).
TRITON_MIN_ROWS = 128


def top_logprobs_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(log-probs float32, tokens int64), each [..., k], descending, of logits [..., V]."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.values, top.indices


@triton.jit
def _row_partials_kernel(x_ptr, sub_max_ptr, part_max_ptr, part_sum_ptr, V, C, NSUB,
                         CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Per (row, chunk): the maximum of each SUB-logit sub-chunk, the chunk's maximum, and its
    sum of exp(x - max) (NaN if the chunk holds a NaN)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    subs = chunk * (CHUNK // SUB) + tl.arange(0, CHUNK // SUB)
    tl.store(sub_max_ptr + row * NSUB + subs, tl.max(tl.reshape(x, (CHUNK // SUB, SUB)), axis=1), mask=subs < NSUB)
    chunk_max = tl.max(x, axis=0)
    total = tl.sum(tl.where(x > -float("inf"), tl.exp(x - chunk_max), 0.0), axis=0)
    has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    tl.store(part_max_ptr + row * C + chunk, chunk_max)
    tl.store(part_sum_ptr + row * C + chunk, tl.where(has_nan, float("nan"), total))


def top_logprobs_triton(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`top_logprobs_reference` in one pass over the logits (see the module); V % SUB == 0, k <= V // SUB."""
    *lead, vocab = logits.shape
    if vocab % SUB or not 0 < k <= vocab // SUB:
        raise ValueError(f"the Triton top-k needs a vocabulary that is a multiple of {SUB} and "
                         f"0 < k <= vocabulary / {SUB}; got vocabulary {vocab}, k {k}")
    x = logits.reshape(-1, vocab).contiguous()
    rows, dev = x.shape[0], x.device
    chunk = min(CHUNK_V, triton.next_power_of_2(vocab))
    num_chunks, num_subs = triton.cdiv(vocab, chunk), vocab // SUB
    sub_max = torch.empty((rows, num_subs), dtype=torch.float32, device=dev)
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    if rows:
        _row_partials_kernel[(rows, num_chunks)](x, sub_max, part_max, part_sum, vocab, num_chunks, num_subs,
                                                 CHUNK=chunk, SUB=SUB)
    row_max = part_max.amax(dim=1, keepdim=True)
    lse = row_max[:, 0] + torch.log((part_sum * torch.exp(part_max - row_max)).sum(dim=1))
    subs = torch.topk(sub_max, k, dim=1).indices
    candidates = (subs[:, :, None] * SUB + torch.arange(SUB, device=dev)).view(rows, k * SUB)
    top = torch.topk(x.gather(1, candidates).float(), k, dim=1)
    tokens = candidates.gather(1, top.indices)
    return (top.values - lse[:, None]).view(*lead, k), tokens.view(*lead, k)


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest log-probs of each row of logits [..., V] (float32) and their tokens (int64),
    descending: the Triton pass where `kernel_backend` says so and the shape suits it (at least
    TRITON_MIN_ROWS rows, V a multiple of SUB, k * SUB at most a quarter of V), else the reference."""
    vocab = logits.shape[-1]
    rows = logits.numel() // max(vocab, 1)
    if (kernel_backend(logits.device) == "triton" and rows >= TRITON_MIN_ROWS and vocab % SUB == 0
            and 0 < k * SUB * 4 <= vocab):
        return top_logprobs_triton(logits, k)
    return top_logprobs_reference(logits, k)
