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

MIN_SUB = 16  # logits per sub-chunk at least: the Triton path needs the vocabulary to be a multiple of it
MAX_SUB = 128  # and at most
# Lanes of the row program's two searches, at most: its sub-chunk maxima (V / SUB) and its candidates
# (k * SUB). Wider ones spill registers: at SUB = 16, V = 151,936 the maxima took 16,384 lanes.
CANDIDATE_LANES = 2048
CHUNK_V = 4096  # vocabulary per program of the pass (a power of two); tests lower it
# Where `top_logprobs` takes the Triton path (H200, V = 151,936, us per call, bench/draft_topk.py): at
# k <= WIDE_K at any row count (15 rows: k = 16 81-88 against the reference's 142-144, k = 32 105-116
# against 142-146; 480 rows, k = 16: 147 against 1,488), above it from TRITON_MIN_ROWS rows (k = 64:
# 15 rows 175-182 against 142-146, 30 rows 209-221 against 180-184, 60 rows 210-253 against 281-286).
WIDE_K = 32
TRITON_MIN_ROWS = 48


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


@triton.jit(do_not_specialize=["K"])
def _row_top_kernel(x_ptr, sub_max_ptr, part_max_ptr, part_sum_ptr, value_ptr, token_ptr, V, C, NSUB, K,
                    CHUNKS: tl.constexpr, SUBS: tl.constexpr, KP: tl.constexpr, SUB: tl.constexpr):
    """Per row: its log-sum-exp from the chunks' partials, the K sub-chunks with the largest
    maxima, then the K largest of their K * SUB logits, each written as (logit - log-sum-exp,
    token), descending. Ties go to the smaller index; a NaN ranks above everything, as in
    torch.topk (its row's log-sum-exp is NaN, so are its log-probs)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    part_max = tl.load(part_max_ptr + row * C + c, mask=c < C, other=-float("inf"))
    part_sum = tl.load(part_sum_ptr + row * C + c, mask=c < C, other=0.0)
    row_max = tl.max(part_max, axis=0)
    lse = row_max + tl.log(tl.sum(tl.where(c < C, part_sum * tl.exp(part_max - row_max), 0.0), axis=0))
    subs = tl.arange(0, SUBS)
    sub_max = tl.load(sub_max_ptr + row * NSUB + subs, mask=subs < NSUB, other=-float("inf"))
    sub_max = tl.where(sub_max != sub_max, float("inf"), sub_max)
    alive = subs < NSUB
    ranks = tl.arange(0, KP)
    chosen = tl.zeros([KP], dtype=tl.int32)
    for i in range(K):
        best = tl.max(tl.where(alive, sub_max, -float("inf")), axis=0)
        pos = tl.min(tl.where(alive & (sub_max == best), subs, SUBS), axis=0)
        chosen = tl.where(ranks == i, pos, chosen)
        alive = alive & (subs != pos)
    candidates = chosen[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [KP, SUB] token ids
    live = (ranks < K)[:, None] & (candidates >= 0) & (candidates < V)
    x = tl.load(x_ptr + row * V + candidates, mask=live, other=-float("inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    for i in range(K):
        best = tl.max(tl.max(tl.where(live, x, -float("inf")), axis=1), axis=0)
        token = tl.min(tl.min(tl.where(live & (x == best), candidates, V), axis=1), axis=0)
        tl.store(value_ptr + row * K + i, best - lse)
        tl.store(token_ptr + row * K + i, token.to(tl.int64))
        live = live & (candidates != token)


def sub_chunk(vocab: int, k: int) -> int:
    """Logits per sub-chunk for this vocabulary and k: the most, up to MAX_SUB, that divide the
    vocabulary, keep the candidates (k * SUB, k rounded to its `rank_lanes`) within
    CANDIDATE_LANES and at most a quarter of the vocabulary (so there are k sub-chunks to take);
    fewer sub-chunks make a shorter search over their maxima. At least MIN_SUB (the caller checks
    the vocabulary is a multiple of it, and k * MIN_SUB against it)."""
    sub = max(MIN_SUB, min(MAX_SUB, CANDIDATE_LANES // rank_lanes(k)))
    while sub > MIN_SUB and (vocab % sub or 4 * k * sub > vocab):
        sub //= 2
    return sub


def top_logprobs_triton(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`top_logprobs_reference` in one pass over the logits and one program per row for the rest
    (see the module); V % MIN_SUB == 0, k <= V // MIN_SUB. Two launches, so the host's cost does
    not grow with the steps: it runs on the drafter's critical path every step."""
    *lead, vocab = logits.shape
    if vocab % MIN_SUB or not 0 < k <= vocab // MIN_SUB:
        raise ValueError(f"the Triton top-k needs a vocabulary that is a multiple of {MIN_SUB} and "
                         f"0 < k <= vocabulary / {MIN_SUB}; got vocabulary {vocab}, k {k}")
    sub = sub_chunk(vocab, k)
    x = logits.reshape(-1, vocab).contiguous()
    rows, dev = x.shape[0], x.device
    chunk = max(sub, min(CHUNK_V, triton.next_power_of_2(vocab)))
    num_chunks, num_subs = triton.cdiv(vocab, chunk), vocab // sub
    sub_max = torch.empty((rows, num_subs), dtype=torch.float32, device=dev)
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    values = torch.empty((rows, k), dtype=torch.float32, device=dev)
    tokens = torch.empty((rows, k), dtype=torch.int64, device=dev)
    if rows:
        _row_partials_kernel[(rows, num_chunks)](x, sub_max, part_max, part_sum, vocab, num_chunks, num_subs,
                                                 CHUNK=chunk, SUB=sub)
        _row_top_kernel[(rows,)](x, sub_max, part_max, part_sum, values, tokens, vocab, num_chunks, num_subs, k,
                                 CHUNKS=triton.next_power_of_2(num_chunks), SUBS=triton.next_power_of_2(num_subs),
                                 KP=rank_lanes(k), SUB=sub, num_warps=8)
    return values.view(*lead, k), tokens.view(*lead, k)


def rank_lanes(k: int) -> int:
    """The row kernel's lanes for k ranks: one compiled variant for every k up to 16 (the budgets
    the adaptive planner moves between), a power of two above."""
    return max(16, triton.next_power_of_2(k))


def warm_up(device: torch.device, vocab: int, dtype: torch.dtype, max_k: int = 64) -> None:
    """Compile both kernels for logits of this vocabulary and dtype, for every k up to `max_k`
    that `top_logprobs` gives them (one variant per `rank_lanes` and `sub_chunk`), so that no step
    waits for a compile (about half a second each, which a serving step would pay, and the
    adaptive budget would read as cost)."""
    if vocab % MIN_SUB:
        return
    logits = torch.zeros((1, vocab), dtype=dtype, device=device)
    for k in variants(vocab, max_k).values():
        top_logprobs_triton(logits, k)


def variants(vocab: int, max_k: int) -> dict[tuple[int, int], int]:
    """The compiled variants the Triton path takes for k up to `max_k` at this vocabulary (as
    `top_logprobs` dispatches): (rank lanes, sub-chunk) -> the first k that takes it."""
    out: dict[tuple[int, int], int] = {}
    for k in range(1, max_k + 1):
        if 4 * k * MIN_SUB <= vocab:
            out.setdefault((rank_lanes(k), sub_chunk(vocab, k)), k)
    return out


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest log-probs of each row of logits [..., V] (float32) and their tokens (int64),
    descending: the Triton pass where `kernel_backend` says so and the shape suits it (k at most
    WIDE_K or at least TRITON_MIN_ROWS rows, V a multiple of MIN_SUB, k * MIN_SUB at most a quarter
    of V), else the reference."""
    vocab = logits.shape[-1]
    rows = logits.numel() // max(vocab, 1)
    if (kernel_backend(logits.device) == "triton" and (k <= WIDE_K or rows >= TRITON_MIN_ROWS)
            and vocab % MIN_SUB == 0 and 0 < k * MIN_SUB * 4 <= vocab):
        return top_logprobs_triton(logits, k)
    return top_logprobs_reference(logits, k)
