"""The whole sampling + accept stage of a verify round, from the target's logits to the path.

Per batch row b of logits [B, T, V] (one tree of T nodes, node i in slot b * T + i),
`tree_accept` writes exactly what these references write, with accept_index of width T
(so a path may hold every node):

    greedy:   verify_tree_greedy on logits.argmax(-1) (the first maximum on ties);
    sampling: process_probs (temperature, top-k, top-p), then
              tree_speculative_sampling_target_only with zero draft_probs and thresholds
              (1, 1), i.e. exact target-only sampling with coins[b, i] at node i and
              final_coins[b] for the bonus token.

`tree_accept_reference` is that composition. `tree_accept_triton` never materialises the
probabilities: it works on the logits in their storage dtype, in parallel over (row,
vocabulary chunk) programs, and only evaluates p where the walk or the bonus needs it:

    p(x) = exp2((x - M) * log2(e) / T) / Z   for x >= floor, else 0,

where M is the row's maximum logit, floor the smallest kept logit and Z the mass of the
kept logits (the whole row without filters). p is non-decreasing in x for T > 0, so the
top-k and top-p sets are thresholds on the logit itself: floor is found by a radix search
over a monotone integer key of the logit (16 bits for bf16/fp16, 32 for fp32; -0.0 and
+0.0 share a key), RADIX_BITS = 4 bits per level, each level a (row, chunk) pass that counts
the keys and their mass per digit, then a one-program-per-row pick of the digit. The top-k
search keeps the k-th largest logit and its ties; the top-p search then runs over the kept
logits with the goal top_p * (their mass) and keeps the smallest head that reaches it, ties
included, as process_probs does.

Differences to the references are float rounding only: Z and the masses are float32 sums
in another order, and exp2 replaces torch's exp, so a sampled outcome can only differ where
a coin falls within rounding of a boundary. The thresholds match exactly, except where two
different logits round to the same float32 probability (or both underflow to 0): the
reference then ties them, this does not; such a pair is never at a top-k / top-p boundary
unless the logits are within a few float32 ulps of each other (or the token cannot be
sampled because its probability is 0). The temperature must be positive, the logits
finite (-inf allowed).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.probs import process_probs_reference
from kernels.tree_sampling import (
    expect_tensor,
    kernel_backend,
    tree_speculative_sampling_target_only_reference,
    verify_tree_greedy_reference,
)

# Vocabulary chunk of one program in the parallel passes (a power of two). Tests lower it
# to exercise several chunks, and a ragged last one, with a small vocabulary.
CHUNK_V = 4096
# Logits per inner step of a histogram pass: [HIST_BLOCK, RADIX] one-hot tiles.
HIST_BLOCK = 256
RADIX_BITS = 4
KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
LOG2E = tl.constexpr(1.4426950408889634)


def chunk_size(vocab_size: int) -> int:
    """Vocabulary chunk of one program: a power of two, at most CHUNK_V."""
    return min(triton.next_power_of_2(vocab_size), CHUNK_V)


# ---------------------------------------------------------------------------------------
# Argument checking and the reference.
# ---------------------------------------------------------------------------------------


def _check_accept_args(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num,
                       greedy, coins, final_coins, temperature, top_k, top_p,
                       filters) -> tuple[int, int, int]:
    """Check tree_accept's arguments; return (B, T, V)."""
    if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.dtype not in KEY_BITS:
        raise ValueError("logits must be a 3-D bfloat16, float16 or float32 tensor [B, T, V]")
    bs, nodes, vocab = logits.shape
    if nodes < 1 or vocab < 1:
        raise ValueError(f"logits need T >= 1 nodes and V >= 1 columns, got {list(logits.shape)}")
    dev = logits.device
    expect_tensor("logits", logits, logits.dtype, (bs, nodes, vocab), dev)
    for name, t in (("tokens", tokens), ("next_token", next_token), ("next_sibling", next_sibling)):
        expect_tensor(name, t, torch.int64, (bs, nodes), dev)
    expect_tensor("predicts", predicts, torch.int32, (bs * nodes,), dev)
    expect_tensor("accept_index", accept_index, torch.int32, (bs, nodes), dev)
    expect_tensor("accept_num", accept_num, torch.int32, (bs,), dev)
    if greedy:
        return bs, nodes, vocab
    sampling = [("coins", coins, torch.float32, (bs, nodes)), ("final_coins", final_coins, torch.float32, (bs,)),
                ("temperature", temperature, torch.float32, (bs,))]
    if filters:
        sampling += [("top_k", top_k, torch.int64, (bs,)), ("top_p", top_p, torch.float32, (bs,))]
    for name, t, dtype, shape in sampling:
        if t is None:
            raise ValueError(f"sampling needs {name}" + (" (or filters=False)" if name.startswith("top") else ""))
        expect_tensor(name, t, dtype, shape, dev)
    return bs, nodes, vocab


def tree_accept_reference(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                          predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy: bool,
                          coins: Tensor | None = None, final_coins: Tensor | None = None,
                          temperature: Tensor | None = None, top_k: Tensor | None = None,
                          top_p: Tensor | None = None, filters: bool = True) -> None:
    """The specification: the existing references composed (see the module docstring).

    filters=False ignores top_k / top_p (temperature only).
    """
    bs, nodes, vocab = _check_accept_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                          accept_num, greedy, coins, final_coins, temperature, top_k, top_p,
                                          filters)
    slots = torch.arange(bs * nodes, device=logits.device).view(bs, nodes)
    tree = (tokens, slots, next_token, next_sibling)
    if greedy:
        verify_tree_greedy_reference(predicts, accept_index, accept_num, *tree, logits.argmax(-1))
        return
    if not filters:
        top_k, top_p = torch.zeros_like(temperature, dtype=torch.int64), torch.ones_like(temperature)
    per_row = [t.repeat_interleave(nodes) for t in (temperature, top_k, top_p)]
    probs = process_probs_reference(logits.view(bs * nodes, vocab), *per_row).view(bs, nodes, vocab)
    tree_speculative_sampling_target_only_reference(predicts, accept_index, accept_num, *tree, coins,
                                                    final_coins, probs, torch.zeros_like(probs))


# ---------------------------------------------------------------------------------------
# Triton kernels. Rows are flattened: row = b * T + i; per-row partials are [R, C, ...].
# ---------------------------------------------------------------------------------------


@triton.jit
def _log2_scale(temperature_ptr, b):
    """log2(e) / T of batch row b: exp(x / T) = exp2(x * scale)."""
    return tl.math.div_rn(LOG2E, tl.load(temperature_ptr + b))


@triton.jit
def _exp_from(x, ref, scale):
    """exp2((x - ref) * scale); 0 where x is -inf, also when ref is (an all -inf chunk)."""
    return tl.exp2((x - tl.where(ref == -float("inf"), 0.0, ref)) * scale)


@triton.jit
def _key(raw, KEY_BITS: tl.constexpr):
    """int64 key in [0, 2**KEY_BITS) ordered like the float values of raw (its storage dtype)."""
    if KEY_BITS == 16:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits = raw.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(1 << (KEY_BITS - 1)), 0, bits)  # -0.0 -> +0.0
    ordered = tl.where(bits < 0, bits ^ ((1 << (KEY_BITS - 1)) - 1), bits)  # two's-complement order
    return ordered.to(tl.int64) + (1 << (KEY_BITS - 1))


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperature_ptr, part_max_ptr, part_aux_ptr, T, V, C,
                        GREEDY: tl.constexpr, CHUNK: tl.constexpr):
    """Per (row, chunk): the maximum logit, and its first index (GREEDY) or sum exp2((x - max) * scale)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if GREEDY:
        chunk_max, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        aux = chunk * CHUNK + index
    else:
        chunk_max = tl.max(x, axis=0)
        aux = tl.sum(_exp_from(x, chunk_max, _log2_scale(temperature_ptr, row // T)), axis=0)
    tl.store(part_max_ptr + row * C + chunk, chunk_max)
    tl.store(part_aux_ptr + row * C + chunk, aux)


@triton.jit
def _row_max(part_max_ptr, row, C, BLOCK_C: tl.constexpr):
    chunks = tl.arange(0, BLOCK_C)
    return tl.max(tl.load(part_max_ptr + row * C + chunks, mask=chunks < C, other=-float("inf")), axis=0)


@triton.jit
def _row_argmax(part_max_ptr, part_arg_ptr, row, C, BLOCK_C: tl.constexpr):
    """First index of the row's maximum: the first chunk holding it has its first index."""
    chunks = tl.arange(0, BLOCK_C)
    maxima = tl.load(part_max_ptr + row * C + chunks, mask=chunks < C, other=-float("inf"))
    first = tl.load(part_arg_ptr + row * C + chunks, mask=chunks < C, other=0)
    best = tl.max(maxima, axis=0)
    return tl.min(tl.where((maxima == best) & (chunks < C), first, 2**31 - 1), axis=0)


@triton.jit
def _row_params(part_max_ptr, part_sum_ptr, floor_ptr, kept_ptr, row, C, scale,
                FILTERS: tl.constexpr, BLOCK_C: tl.constexpr):
    """(M, Z, floor) of a row: p(x) = exp2((x - M) * scale) / Z where key(x) >= floor."""
    if FILTERS:
        row_max = _row_max(part_max_ptr, row, C, BLOCK_C)
        norm = tl.load(kept_ptr + row)
        floor = tl.load(floor_ptr + row)
    else:
        row_max, norm = _row_softmax(part_max_ptr, part_sum_ptr, row, C, scale, BLOCK_C)
        floor = tl.full([], 0, tl.int64)
    return row_max, norm, floor


@triton.jit
def _row_softmax(part_max_ptr, part_sum_ptr, row, C, scale, BLOCK_C: tl.constexpr):
    """Row maximum M and sum of exp2((x - M) * scale), from the per-chunk partials."""
    chunks = tl.arange(0, BLOCK_C)
    maxima = tl.load(part_max_ptr + row * C + chunks, mask=chunks < C, other=-float("inf"))
    sums = tl.load(part_sum_ptr + row * C + chunks, mask=chunks < C, other=0.0)
    row_max = tl.max(maxima, axis=0)
    return row_max, tl.sum(_exp_from(maxima, row_max, scale) * sums, axis=0)


@triton.jit
def _search_on(top_k_ptr, top_p_ptr, b, V, TOP_P: tl.constexpr):
    if TOP_P:
        on = tl.load(top_p_ptr + b) < 1.0
    else:
        k = tl.load(top_k_ptr + b)
        on = (k > 0) & (k < V)
    return on


@triton.jit
def _digit_hist_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, prefix_ptr, floor_ptr,
                       count_ptr, mass_ptr, T, V, C, shift, high_mask,
                       TOP_P: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_C: tl.constexpr, RADIX: tl.constexpr):
    """Per (row, chunk): count and mass per digit (key >> shift) % RADIX of the keys that
    match the row's prefix on the bits above the digit (and are >= floor when TOP_P)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // T
    if _search_on(top_k_ptr, top_p_ptr, b, V, TOP_P):
        row_max = _row_max(part_max_ptr, row, C, BLOCK_C)
        scale = _log2_scale(temperature_ptr, b)
        prefix = tl.load(prefix_ptr + row)
        floor = tl.full([], 0, tl.int64)
        if TOP_P:
            floor = tl.load(floor_ptr + row)
        digits = tl.arange(0, RADIX)
        counts = tl.zeros([RADIX], dtype=tl.int32)
        masses = tl.zeros([RADIX], dtype=tl.float32)
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            raw = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=0.0)
            key = _key(raw, KEY_BITS)
            live = (offs < V) & ((key & high_mask) == prefix) & (key >= floor)
            if tl.max(live.to(tl.int32), axis=0) > 0:  # past the first level, most blocks have none
                hot = live[:, None] & (((key >> shift) % RADIX)[:, None] == digits[None, :])
                counts += tl.sum(hot.to(tl.int32), axis=0)
                e = _exp_from(raw.to(tl.float32), row_max, scale)
                masses += tl.sum(tl.where(hot, e[:, None], 0.0), axis=0)
        out = (row * C + chunk) * RADIX + digits
        tl.store(count_ptr + out, counts)
        tl.store(mass_ptr + out, masses)


@triton.jit
def _digit_pick_kernel(count_ptr, mass_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, part_sum_ptr,
                       prefix_ptr, above_count_ptr, above_mass_ptr, floor_ptr, kept_ptr, T, V, C, shift,
                       TOP_P: tl.constexpr, BLOCK_C: tl.constexpr, RADIX: tl.constexpr):
    """Per row: the largest digit whose keys at or above it (with those above the prefix) reach
    the goal: count >= k (top-k), or count >= 1 and mass >= top_p * kept (top-p); digit 0 if
    none does (rounding). The last level (shift 0) writes the threshold and its kept mass."""
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    if _search_on(top_k_ptr, top_p_ptr, b, V, TOP_P):
        chunks = tl.arange(0, BLOCK_C)[:, None]
        digits = tl.arange(0, RADIX)
        at = (row * C + chunks) * RADIX + digits[None, :]
        counts = tl.sum(tl.load(count_ptr + at, mask=chunks < C, other=0), axis=0)
        masses = tl.sum(tl.load(mass_ptr + at, mask=chunks < C, other=0.0), axis=0)
        at_or_above = digits[None, :] >= digits[:, None]  # [threshold digit, bin]
        count_from = tl.sum(tl.where(at_or_above, counts[None, :], 0), axis=1)
        mass_from = tl.sum(tl.where(at_or_above, masses[None, :], 0.0), axis=1)
        above_count = tl.load(above_count_ptr + row)
        above_mass = tl.load(above_mass_ptr + row)
        if TOP_P:
            ok = (above_count + count_from >= 1) & \
                (above_mass + mass_from >= tl.load(top_p_ptr + b) * tl.load(kept_ptr + row))
        else:
            ok = above_count + count_from >= tl.load(top_k_ptr + b)
        digit = tl.max(tl.where(ok, digits, 0), axis=0)
        kept = above_mass + tl.sum(tl.where(digits == digit, mass_from, 0.0), axis=0)
        tl.store(above_count_ptr + row, above_count + tl.sum(tl.where(digits > digit, counts, 0), axis=0))
        tl.store(above_mass_ptr + row, above_mass + tl.sum(tl.where(digits > digit, masses, 0.0), axis=0))
        prefix = tl.load(prefix_ptr + row) | (digit.to(tl.int64) << shift)
        tl.store(prefix_ptr + row, prefix)
        if shift == 0:
            tl.store(floor_ptr + row, prefix)
            tl.store(kept_ptr + row, kept)
    elif not TOP_P:
        if shift == 0:  # no top-k: floor stays 0, everything is kept
            _, total = _row_softmax(part_max_ptr, part_sum_ptr, row, C, _log2_scale(temperature_ptr, b), BLOCK_C)
            tl.store(kept_ptr + row, total)


# T is never specialised: with T == 1 the walk loop folds away and Triton 3.6 fails to
# compile what is left (the prefill's one-node accept hits this).
@triton.jit(do_not_specialize=["T"])
def _tree_walk_kernel(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr,
                      predicts_ptr, accept_index_ptr, accept_num_ptr, last_ptr,
                      part_max_ptr, part_aux_ptr, floor_ptr, kept_ptr, coins_ptr, temperature_ptr,
                      T, V, C, GREEDY: tl.constexpr, FILTERS: tl.constexpr, KEY_BITS: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """Per batch row: the walk of tree_sampling's kernel on p (or the argmax) evaluated on demand.

    Greedy also writes the bonus; sampling leaves it to the residual kernels (last_ptr)."""
    b = tl.program_id(0).to(tl.int64)
    nodes = b * T  # the first row and slot of tree b
    tl.store(accept_index_ptr + nodes, nodes.to(tl.int32))
    row = tl.full([], 0, tl.int64)  # last accepted node
    n = tl.full([], 0, tl.int32)
    if GREEDY:
        target = _row_argmax(part_max_ptr, part_aux_ptr, nodes, C, BLOCK_C)
    else:
        scale = _log2_scale(temperature_ptr, b)
        row_max, norm, floor = _row_params(part_max_ptr, part_aux_ptr, floor_ptr, kept_ptr, nodes, C, scale,
                                           FILTERS, BLOCK_C)
        coin = tl.load(coins_ptr + nodes)
        prob_acc = tl.full([], 0.0, tl.float32)
    cur = tl.load(next_token_ptr + nodes)
    while (cur != -1) & (n < T - 1):
        tok = tl.load(tokens_ptr + nodes + cur)
        if GREEDY:
            accepted = tok == target
        else:
            raw = tl.load(logits_ptr + (nodes + row) * V + tok)
            e = _exp_from(raw.to(tl.float32), row_max, scale)
            q = tl.where(_key(raw, KEY_BITS) >= floor, tl.math.div_rn(e, norm), 0.0)
            prob_acc += q
            accepted = (coin <= prob_acc) | (q >= 1.0)
        if accepted:
            tl.store(predicts_ptr + nodes + row, tok.to(tl.int32))
            n += 1
            tl.store(accept_index_ptr + nodes + n, (nodes + cur).to(tl.int32))
            row = cur
            if GREEDY:
                target = _row_argmax(part_max_ptr, part_aux_ptr, nodes + row, C, BLOCK_C)
            else:
                row_max, norm, floor = _row_params(part_max_ptr, part_aux_ptr, floor_ptr, kept_ptr, nodes + row,
                                                   C, scale, FILTERS, BLOCK_C)
                coin = tl.load(coins_ptr + nodes + row)
                prob_acc = 0.0
            cur = tl.load(next_token_ptr + nodes + cur)
        else:
            cur = tl.load(next_sibling_ptr + nodes + cur)
    tl.store(accept_num_ptr + b, n)
    if GREEDY:
        tl.store(predicts_ptr + nodes + row, target)
    else:
        tl.store(last_ptr + b, row)


@triton.jit
def _residual_chunk(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr, part_max_ptr, part_sum_ptr,
                    floor_ptr, kept_ptr, temperature_ptr, last_ptr, b, chunk, T, V, C,
                    FILTERS: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """(offsets, residual) on one chunk of tree b's last accepted row: p with the tokens of that
    node's children zeroed. They were all tried and rejected, unless the path holds all T
    nodes, and then the last node has no children: the reference's residual exactly."""
    nodes = b * T
    last = tl.load(last_ptr + b)
    row = nodes + last
    scale = _log2_scale(temperature_ptr, b)
    row_max, norm, floor = _row_params(part_max_ptr, part_sum_ptr, floor_ptr, kept_ptr, row, C, scale,
                                       FILTERS, BLOCK_C)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=0.0)
    e = _exp_from(raw.to(tl.float32), row_max, scale)
    r = tl.where((offs < V) & (_key(raw, KEY_BITS) >= floor), tl.math.div_rn(e, norm), 0.0)
    child = tl.load(next_token_ptr + row)
    while child != -1:
        r = tl.where(offs == tl.load(tokens_ptr + nodes + child), 0.0, r)
        child = tl.load(next_sibling_ptr + nodes + child)
    return offs, r


@triton.jit
def _residual_sums_kernel(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr, part_max_ptr, part_sum_ptr,
                          floor_ptr, kept_ptr, temperature_ptr, last_ptr, sums_ptr, T, V, C,
                          FILTERS: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    _, r = _residual_chunk(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr, part_max_ptr, part_sum_ptr,
                           floor_ptr, kept_ptr, temperature_ptr, last_ptr, b, chunk, T, V, C,
                           FILTERS, KEY_BITS, CHUNK, BLOCK_C)
    tl.store(sums_ptr + b * C + chunk, tl.sum(r, axis=0))


@triton.jit
def _residual_pick_kernel(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr, part_max_ptr, part_sum_ptr,
                          floor_ptr, kept_ptr, temperature_ptr, last_ptr, sums_ptr, final_coins_ptr, predicts_ptr,
                          T, V, C, FILTERS: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Bonus of tree b by inverse CDF of the residual r: u = coin * sum(r); the first v with
    r[v] > 0 and cumsum(r)[v] > u, else the last v with r[v] > 0, else V - 1. The chunk is
    found from the chunk sums, the token by a scan of that chunk."""
    b = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    sums = tl.load(sums_ptr + b * C + chunks, mask=chunks < C, other=0.0)
    u = tl.load(final_coins_ptr + b) * tl.sum(sums, axis=0)
    through = tl.cumsum(sums, axis=0)
    first = tl.min(tl.where((sums > 0) & (through > u), chunks, BLOCK_C), axis=0)
    last_positive = tl.max(tl.where(sums > 0, chunks, -1), axis=0)
    chunk = tl.where(first < BLOCK_C, first, last_positive)
    bonus = tl.full([], V - 1, tl.int32)
    if chunk >= 0:
        before = tl.sum(tl.where(chunks == chunk, through - sums, 0.0), axis=0)
        offs, r = _residual_chunk(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr, part_max_ptr,
                                  part_sum_ptr, floor_ptr, kept_ptr, temperature_ptr, last_ptr, b, chunk, T, V, C,
                                  FILTERS, KEY_BITS, CHUNK, BLOCK_C)
        hit = tl.min(tl.where((r > 0) & (before + tl.cumsum(r, axis=0) > u), offs, V), axis=0)
        bonus = tl.where(hit < V, hit, tl.max(tl.where(r > 0, offs, -1), axis=0))
    tl.store(predicts_ptr + b * T + tl.load(last_ptr + b), bonus.to(tl.int32))


def tree_accept_triton(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                       predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy: bool,
                       coins: Tensor | None = None, final_coins: Tensor | None = None,
                       temperature: Tensor | None = None, top_k: Tensor | None = None,
                       top_p: Tensor | None = None, filters: bool = True) -> None:
    """Triton version of tree_accept_reference; static shapes, no host synchronisation.

    Launches: greedy 2 (chunk maxima, walk; the logits are read once); temperature only 4
    (chunk softmax partials, walk, residual chunk sums, bonus: the logits once, plus the
    last accepted row of each tree twice). Filters add a histogram pass and a pick per level
    of each search, KEY_BITS / RADIX_BITS levels: 16 more launches for bf16/fp16 logits
    (8 more reads of the logits, of which the top-p ones skip the blocks with no kept
    token), 32 for float32.
    """
    bs, nodes, vocab = _check_accept_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                          accept_num, greedy, coins, final_coins, temperature, top_k, top_p,
                                          filters)
    if bs == 0:
        return
    dev, rows = logits.device, bs * nodes
    chunk = chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    block_c = triton.next_power_of_2(num_chunks)
    key_bits = KEY_BITS[logits.dtype]
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_aux = torch.empty((rows, num_chunks), dtype=torch.int32 if greedy else torch.float32, device=dev)
    scale_source = part_max if greedy else temperature  # greedy reads no temperature
    _chunk_stats_kernel[(rows, num_chunks)](logits, scale_source, part_max, part_aux, nodes, vocab, num_chunks,
                                            GREEDY=greedy, CHUNK=chunk)
    tree = (tokens, next_token, next_sibling)
    if greedy:
        _tree_walk_kernel[(bs,)](logits, *tree, predicts, accept_index, accept_num, accept_num,
                                 part_max, part_aux, part_max, part_max, part_max, part_max,
                                 nodes, vocab, num_chunks, GREEDY=True, FILTERS=False, KEY_BITS=key_bits,
                                 BLOCK_C=block_c)
        return

    floor = torch.zeros(rows, dtype=torch.int64, device=dev)
    kept = torch.empty(rows, dtype=torch.float32, device=dev)
    if filters:
        _run_searches(logits, temperature, top_k, top_p, part_max, part_aux, floor, kept, nodes, num_chunks,
                      chunk, key_bits)
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    _tree_walk_kernel[(bs,)](logits, *tree, predicts, accept_index, accept_num, last,
                             part_max, part_aux, floor, kept, coins, temperature,
                             nodes, vocab, num_chunks, GREEDY=False, FILTERS=filters, KEY_BITS=key_bits,
                             BLOCK_C=block_c)
    residual = (logits, *tree, part_max, part_aux, floor, kept, temperature, last)
    sums = torch.empty((bs, num_chunks), dtype=torch.float32, device=dev)
    meta = dict(FILTERS=filters, KEY_BITS=key_bits, CHUNK=chunk, BLOCK_C=block_c)
    _residual_sums_kernel[(bs, num_chunks)](*residual, sums, nodes, vocab, num_chunks, **meta)
    _residual_pick_kernel[(bs,)](*residual, sums, final_coins, predicts, nodes, vocab, num_chunks, **meta)


def _run_searches(logits, temperature, top_k, top_p, part_max, part_sum, floor, kept, nodes, num_chunks,
                  chunk, key_bits) -> None:
    """Top-k, then top-p, radix searches: write each row's key floor and kept mass.

    The top-p search only counts keys >= the top-k floor: that changes nothing (the head it
    keeps never reaches below the floor) but lets its passes skip the other blocks.
    """
    rows, vocab = part_max.shape[0], logits.shape[2]
    dev = logits.device
    radix = 1 << RADIX_BITS
    counts = torch.empty((rows, num_chunks, radix), dtype=torch.int32, device=dev)
    masses = torch.empty((rows, num_chunks, radix), dtype=torch.float32, device=dev)
    block_c = triton.next_power_of_2(num_chunks)
    for top_p_search in (False, True):
        prefix = torch.zeros(rows, dtype=torch.int64, device=dev)
        above_count = torch.zeros(rows, dtype=torch.int32, device=dev)
        above_mass = torch.zeros(rows, dtype=torch.float32, device=dev)
        for shift in range(key_bits - RADIX_BITS, -1, -RADIX_BITS):
            high_mask = (1 << key_bits) - (1 << (shift + RADIX_BITS))  # the bits above the digit
            _digit_hist_kernel[(rows, num_chunks)](
                logits, temperature, top_k, top_p, part_max, prefix, floor, counts, masses,
                nodes, vocab, num_chunks, shift, high_mask, TOP_P=top_p_search, KEY_BITS=key_bits, CHUNK=chunk,
                BLOCK=min(chunk, HIST_BLOCK), BLOCK_C=block_c, RADIX=radix)
            _digit_pick_kernel[(rows,)](
                counts, masses, temperature, top_k, top_p, part_max, part_sum, prefix, above_count, above_mass,
                floor, kept, nodes, vocab, num_chunks, shift, TOP_P=top_p_search, BLOCK_C=block_c, RADIX=radix)


def tree_accept(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy: bool,
                coins: Tensor | None = None, final_coins: Tensor | None = None,
                temperature: Tensor | None = None, top_k: Tensor | None = None,
                top_p: Tensor | None = None, filters: bool = True) -> None:
    """The fused sampling + accept stage: Triton on CUDA, the reference elsewhere (see module doc).

    logits [B, T, V] (bf16, fp16 or fp32); tokens / next_token / next_sibling int64 [B, T]
    (node i of tree b in slot b * T + i); outputs predicts int32 [B * T], accept_index int32
    [B, T], accept_num int32 [B], written like the tree_sampling kernels write them.
    Sampling (greedy=False) needs coins float32 [B, T], final_coins float32 [B] and
    temperature float32 [B] (> 0), and with filters top_k int64 [B] (off: <= 0 or >= V) and
    top_p float32 [B] (off: >= 1); filters=False promises that every row has both off and
    skips them (top_k / top_p are then not read).
    """
    impl = tree_accept_triton if kernel_backend(logits.device) == "triton" else tree_accept_reference
    impl(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, greedy=greedy,
         coins=coins, final_coins=final_coins, temperature=temperature, top_k=top_k, top_p=top_p,
         filters=filters)
