"""The whole sampling + accept stage of a verify round, from the target's logits to the path.

Per batch row b of logits [B, T, V] (one tree of T nodes, node i in slot b * T + i),
`tree_accept` writes exactly what these references write into outputs pre-filled with -1
(accept_num with 0), with accept_index of width T (so a path may hold every node); it
writes every entry itself, so its callers need not fill them:

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
top-k and top-p sets are thresholds on the logit itself, compared as a monotone integer key
(16 bits for bf16/fp16, 32 for fp32; -0.0 and +0.0 share a key). Most rows get them from a
candidate set: the stats pass also keeps each chunk's CANDIDATES largest keys and the largest
key it left out (taken from the CANDIDATES + 1 sub-chunks of SUB_CHUNK keys with the largest
maxima), and one program per row sorts its chunks' candidates and finds the top-k key
(the k-th) and the top-p key (the first whose running mass reaches top_p * the mass top-k
keeps) among them, ties included. That is exact whenever the threshold found is above every
key left out, since the candidates then hold every key at or above it. The other rows (top-k
beyond the candidates, or a top-p head longer than them, as on a flat distribution) take a
radix search over the whole row, RADIX_BITS = 4 bits per level, in one launch that returns at
once where no row needs it: each level is one pass over the (row, chunk) pairs of those rows
(listed by the per-row program, claimed a few at a time by a fixed number of programs that
wait until every pair is done before the next level) that first picks the previous level's
digit (every program reduces that level's per-chunk counts of its row, which is cheap) and
then counts the chunk's keys per digit (tl.histogram), with their mass in the top-p search;
the last digit is picked after the last level. A pass reads only the blocks of logits whose
maximum key (noted by the stats pass) reaches its level's range. The top-k search keeps the k-th
largest logit and its ties; the top-p search then runs over the kept logits with the goal
top_p * (their mass) and keeps the smallest head that reaches it, ties included, as
process_probs does.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.keyed_sampling import _M31, _MUL, _SEED_SALT, _TOKEN_SALT, keyed_scores
from ddtree_kernels.probs import process_probs_reference
from ddtree_kernels.tree_sampling import (
    expect_tensor,
    kernel_backend,
    tree_speculative_sampling_target_only_reference,
    verify_tree_greedy_reference,
)

# Vocabulary chunk of one program in the parallel passes (a power of two). Tests lower it
# to exercise several chunks, and a ragged last one, with a small vocabulary.
CHUNK_V = 4096
# Logits per block of a chunk whose maximum key the stats pass notes: the unit the search's
# passes skip; tests lower it to have several per chunk.
HIST_BLOCK = 256
RADIX_BITS = 4
# Largest keys each chunk keeps as top-k / top-p candidates (a power of two); tests change it.
CANDIDATES = 8
# Sub-chunk of the stats pass's candidate selection (a power of two): the candidates are taken
# from the CANDIDATES + 1 sub-chunks with the largest maxima (see `_chunk_stats_kernel`).
SUB_CHUNK = 16
# Programs of the radix search's launch: they share the (row, chunk) work of the rows the
# candidates left undecided (see `_search_kernel`); tests lower it.
SEARCH_PROGRAMS = 512
# Warps of a search program: each pass over a pair holds the whole chunk at once.
SEARCH_WARPS = 8
# Warps of a stats-pass program with filters on: its candidate selection's passes of a max run
# faster on few warps (H200: B = 32, T = 65, 631 -> 564 us for the whole stage on 2 against 4).
FILTER_STATS_WARPS = 2
# Warps of the bonus pick's one program per tree (its scan of one chunk; 8 against 4: 5.95 -> 4.8 us).
RESIDUAL_PICK_WARPS = 8
KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
LOG2E = tl.constexpr(1.4426950408889634)
# ddtree_kernels.keyed_sampling's hash constants, as the kernels see them.
HASH_M31, HASH_MUL, HASH_SEED_SALT, HASH_TOKEN_SALT = (tl.constexpr(v) for v in (_M31, _MUL, _SEED_SALT, _TOKEN_SALT))


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
    _clear_outputs(predicts, accept_index, accept_num)
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


def _clear_outputs(predicts: Tensor, accept_index: Tensor, accept_num: Tensor) -> None:
    """What the references' callers do first (they write only the path and its tokens)."""
    predicts.fill_(-1)
    accept_index.fill_(-1)
    accept_num.zero_()


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
    """Key in [0, 2**KEY_BITS) ordered like the float values of raw (its storage dtype): int32
    for 16-bit keys, int64 for 32-bit ones."""
    if KEY_BITS == 16:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits = raw.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(1 << (KEY_BITS - 1)), 0, bits)  # -0.0 -> +0.0
    ordered = tl.where(bits < 0, bits ^ ((1 << (KEY_BITS - 1)) - 1), bits)  # two's-complement order
    if KEY_BITS == 16:
        key = ordered + (1 << 15)
    else:
        key = ordered.to(tl.int64) + (1 << 31)
    return key


@triton.jit
def _key_zero(KEY_BITS: tl.constexpr):
    """0 in `_key`'s dtype."""
    if KEY_BITS == 16:
        zero = tl.full([], 0, tl.int32)
    else:
        zero = tl.full([], 0, tl.int64)
    return zero


@triton.jit
def _filters_on(top_k_ptr, top_p_ptr, b, V):
    """(top-k on, top-p on) for batch row b."""
    k = tl.load(top_k_ptr + b)
    return (k > 0) & (k < V), tl.load(top_p_ptr + b) < 1.0


@triton.jit
def _largest(x, COUNT: tl.constexpr, SLOTS: tl.constexpr):
    """The COUNT largest entries of the 1-D x (keys >= -1; ties are taken once each, the first
    index first): their values, descending, and their indices in slots 0 .. COUNT - 1 of [SLOTS]
    tensors (-1 and 0 past them), and the largest key left (-1 if none). By COUNT passes of a
    max over x packed with its index into one distinct integer (cheaper here than an argmax,
    and than a bitonic top-k)."""
    N: tl.constexpr = x.shape[0]
    slots, lanes = tl.arange(0, SLOTS), tl.arange(0, N)
    packed = (x + 2) * N + (lanes ^ (N - 1))  # >= 0, ordered by (key, -index): N - 1 - index
    values = tl.full([SLOTS], -1, x.dtype)
    indices = tl.full([SLOTS], 0, tl.int32)
    for i in tl.static_range(COUNT):
        best = tl.max(packed, axis=0)
        values = tl.where(slots == i, best // N - 2, values)
        indices = tl.where(slots == i, (best % N ^ (N - 1)).to(tl.int32), indices)
        packed = tl.where(packed == best, -1, packed)
    return tl.maximum(values, -1), indices, tl.maximum(tl.max(packed, axis=0) // N - 2, -1)


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, part_aux_ptr,
                        block_max_ptr, cand_ptr, left_out_ptr, counters_ptr, T, V, C, GREEDY: tl.constexpr,
                        FILTERS: tl.constexpr, KEY_BITS: tl.constexpr, CAND: tl.constexpr, SUB: tl.constexpr,
                        PICKED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, COUNTERS: tl.constexpr):
    """Per (row, chunk): the maximum logit, and its first index (GREEDY) or sum exp2((x - max) * scale).

    FILTERS, where a filter is on, also writes the maximum key of each BLOCK of the chunk (the
    searches skip the blocks below their range) and the candidates: the chunk's CAND largest
    keys, descending (-1 past its last key), and the largest key it leaves out (-1 if none).
    Where SUB < CHUNK they are taken from the CAND + 1 sub-chunks of SUB keys with the largest
    maxima (PICKED >= CAND + 1 rows, the rest masked), read again: exact, ties included, since
    every key of another sub-chunk is at most those CAND + 1 maxima. (Program (0, 0) also
    clears the searches' COUNTERS counters: their count of undecided rows, see
    `_filter_floor_kernel`, and those of `_search_kernel`.)"""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=-float("inf"))
    x = raw.to(tl.float32)
    if GREEDY:
        chunk_max, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        aux = chunk * CHUNK + index
    else:
        chunk_max = tl.max(x, axis=0)
        aux = tl.sum(_exp_from(x, chunk_max, _log2_scale(temperature_ptr, row // T)), axis=0)
    tl.store(part_max_ptr + row * C + chunk, chunk_max)
    tl.store(part_aux_ptr + row * C + chunk, aux)
    if FILTERS:
        if (row == 0) & (chunk == 0):
            tl.store(counters_ptr + tl.arange(0, COUNTERS), tl.full([COUNTERS], 0, tl.int32))
        top_k_on, top_p_on = _filters_on(top_k_ptr, top_p_ptr, row // T, V)
        if top_k_on | top_p_on:
            key = _key(raw, KEY_BITS)
            NB: tl.constexpr = CHUNK // BLOCK
            tl.store(block_max_ptr + (row * C + chunk) * NB + tl.arange(0, NB),
                     tl.max(tl.reshape(key, (NB, BLOCK)), axis=1))
            key = tl.where(offs < V, key, -1)
            if SUB < CHUNK:
                sub_max = tl.max(tl.reshape(key, (CHUNK // SUB, SUB)), axis=1)
                _, sub, _ = _largest(sub_max, CAND + 1, PICKED)
                sub_offs = chunk * CHUNK + sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
                live = (tl.arange(0, PICKED)[:, None] < CAND + 1) & (sub_offs < V)
                sub_raw = tl.load(logits_ptr + row * V + sub_offs, mask=live, other=0.0)
                key = tl.reshape(tl.where(live, _key(sub_raw, KEY_BITS), -1), (PICKED * SUB,))
            cand, _, left_out = _largest(key, CAND, CAND)
            tl.store(cand_ptr + (row * C + chunk) * CAND + tl.arange(0, CAND), cand)
            tl.store(left_out_ptr + row * C + chunk, left_out)


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
def _key_value(key, KEY_BITS: tl.constexpr, DTYPE: tl.constexpr):
    """The float32 logit of a key (`_key`'s inverse; DTYPE: the logits' storage dtype)."""
    if KEY_BITS == 16:
        ordered = key - (1 << 15)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFF, ordered)
        value = bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    else:
        ordered = (key - (1 << 31)).to(tl.int32)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
        value = bits.to(tl.float32, bitcast=True)
    return value


@triton.jit
def _filter_floor_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, part_sum_ptr,
                         cand_ptr, left_out_ptr, floor_ptr, kept_ptr, exact_ptr, top_k_floor_ptr, todo_ptr,
                         todo_count_ptr, T, V, C,
                         KEY_BITS: tl.constexpr, CAND: tl.constexpr, SORTED: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per row: the key floor and kept mass of its filters: top-p's where it is on (its
    threshold, the mass at and above it), else top-k's (its threshold, the mass it keeps),
    else 0 and the row's whole mass, where the sorted candidates decide them (exact_ptr 1);
    elsewhere (0) the radix search writes them after: such a row is appended to the searches'
    list (todo_ptr, its length at todo_count_ptr; the order does not matter) and its top-k
    search's floor (top_k_floor_ptr) is cleared: it stays 0 where top-k is off."""
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    scale = _log2_scale(temperature_ptr, b)
    k = tl.load(top_k_ptr + b)
    top_k_on = (k > 0) & (k < V)  # as _filters_on, inline: the interpreter's calls are slow
    top_p = tl.load(top_p_ptr + b)
    top_p_on = top_p < 1.0
    row_max, kept = _row_softmax(part_max_ptr, part_sum_ptr, row, C, scale, BLOCK_C)
    floor = _key_zero(KEY_BITS)
    exact = tl.full([], 1, tl.int32)
    if top_k_on | top_p_on:
        index = tl.arange(0, SORTED)
        keys = tl.load(cand_ptr + row * C * CAND + index, mask=index < C * CAND, other=-1)
        keys = tl.sort(keys, descending=True)
        chunks = tl.arange(0, BLOCK_C)
        left_out = tl.max(tl.load(left_out_ptr + row * C + chunks, mask=chunks < C, other=-1), axis=0)
        e = _exp_from(_key_value(keys, KEY_BITS, logits_ptr.dtype.element_ty), row_max, scale)
        e = tl.where(keys >= 0, e, 0.0)
        total = kept
        if top_k_on:
            floor = tl.max(tl.where(index == k - 1, keys, -1), axis=0)  # -1 past the candidates
            exact = (floor > left_out).to(tl.int32)
            total = tl.sum(tl.where(keys >= floor, e, 0.0), axis=0)
        if top_p_on:
            through = tl.cumsum(tl.where(keys >= floor, e, 0.0), axis=0)
            first = tl.sum((through < top_p * total).to(tl.int32), axis=0)
            at_first = tl.max(tl.where(index == first, keys, -1), axis=0)
            # A head that never reaches the goal keeps every key top-k keeps (rounding; all of
            # them where top-k is off): exact if nothing past the candidates could belong to it.
            reached = first < SORTED
            exact = tl.where(reached, exact & (at_first > left_out).to(tl.int32),
                             tl.where(top_k_on, exact, (left_out < 0).to(tl.int32)))
            floor = tl.where(reached, at_first, tl.where(top_k_on, floor, 0))
        kept = tl.sum(tl.where(keys >= floor, e, 0.0), axis=0)
    tl.store(floor_ptr + row, floor.to(tl.int64))
    tl.store(kept_ptr + row, kept)
    tl.store(exact_ptr + row, exact.to(tl.int32))
    if exact == 0:
        tl.store(top_k_floor_ptr + row, tl.full([], 0, tl.int64))
        tl.store(todo_ptr + tl.atomic_add(todo_count_ptr, 1), row.to(tl.int32))


# The searches' levels are numbered 0 .. 2 * LEVELS - 1: top-k's, then top-p's, LEVELS =
# KEY_BITS // RADIX_BITS each; level j's digit is bits [shift, shift + RADIX_BITS) of the key,
# shift = KEY_BITS - RADIX_BITS * (j % LEVELS + 1).


@triton.jit
def _takes_part(top_k_ptr, top_p_ptr, b, V, level, LEVELS: tl.constexpr):
    """Whether batch row b takes part in level - 1 (none before level 0) and in level. A row
    takes part in the top-k levels where top-k is on, in the top-p levels where top-p is on,
    and in the first top-p level also where top-k alone is (its masses sum to the mass that
    top-k keeps)."""
    k = tl.load(top_k_ptr + b)
    top_k_on = (k > 0) & (k < V)  # as _filters_on, inline: the interpreter's calls are slow
    top_p_on = tl.load(top_p_ptr + b) < 1.0
    before = (level > 0) & ((top_k_on & (level <= LEVELS + 1)) | (top_p_on & (level > LEVELS)))
    at = (top_k_on & (level <= LEVELS)) | (top_p_on & (level >= LEVELS))
    return before, at


@triton.jit
def _pick_digit(count_ptr, mass_ptr, prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr, top_k_ptr, top_p_ptr,
                row, b, R, C, level, shift, KEY_BITS: tl.constexpr, RADIX_BITS: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """The digit of a row at a level, from the level's per-chunk counts and masses [R, C, RADIX]:
    the largest digit whose keys at or above it (with those above the prefix) reach the goal:
    count >= k (top-k), or count >= 1 and mass >= top_p * total (top-p; total: the mass of the
    first top-p level, i.e. of the keys top-k keeps); digit 0 if none does (rounding).

    The state before (prefix, count and mass of the keys above the prefix) is the previous
    level's, empty at a search's first level. Returns the state after, total, and the mass of
    the keys at or above the digit."""
    LEVELS: tl.constexpr = KEY_BITS // RADIX_BITS
    RADIX: tl.constexpr = 1 << RADIX_BITS
    top_p = level >= LEVELS
    chunks = tl.arange(0, BLOCK_C)[:, None]
    digits = tl.arange(0, RADIX)
    at = (row * C + chunks) * RADIX + digits[None, :]
    at_or_above = digits[None, :] >= digits[:, None]  # [threshold digit, bin]
    counts = tl.sum(tl.load(count_ptr + at, mask=chunks < C, other=0, cache_modifier=".cg"), axis=0)
    count_from = tl.sum(tl.where(at_or_above, counts[None, :], 0), axis=1)
    prefix = tl.full([], 0, tl.int64)
    above_count = tl.full([], 0, tl.int32)
    above_mass = tl.full([], 0.0, tl.float32)
    later = level % LEVELS != 0  # not the search's first level: continue from the previous one
    if later:
        state = (level - 1) * R + row
        prefix = tl.load(prefix_ptr + state, cache_modifier=".cg")
        above_count = tl.load(above_count_ptr + state, cache_modifier=".cg")
        above_mass = tl.load(above_mass_ptr + state, cache_modifier=".cg")
    # (tl.full, not tl.zeros, and no reductions the search does not use: in the interpreter,
    # the tests' CPU path, each call of a @triton.jit function such as tl.zeros or tl.sum is slow.)
    masses = tl.full([RADIX], 0.0, tl.float32)
    mass_from = tl.full([RADIX], 0.0, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    if top_p:
        masses = tl.sum(tl.load(mass_ptr + at, mask=chunks < C, other=0.0, cache_modifier=".cg"), axis=0)
        mass_from = tl.sum(tl.where(at_or_above, masses[None, :], 0.0), axis=1)
        if later:
            total = tl.load(total_ptr + row, cache_modifier=".cg")
        else:
            total = tl.sum(masses, axis=0)
        ok = (above_count + count_from >= 1) & (above_mass + mass_from >= tl.load(top_p_ptr + b) * total)
    else:
        ok = above_count + count_from >= tl.load(top_k_ptr + b)
    digit = tl.max(tl.where(ok, digits, 0), axis=0)
    kept = above_mass
    above_count += tl.sum(tl.where(digits > digit, counts, 0), axis=0)
    if top_p:
        kept += tl.sum(tl.where(digits == digit, mass_from, 0.0), axis=0)
        above_mass += tl.sum(tl.where(digits > digit, masses, 0.0), axis=0)
    prefix |= digit.to(tl.int64) << shift
    return prefix, above_count, above_mass, total, kept


@triton.jit
def _chunk_histogram(logits_ptr, block_max_ptr, row, chunk, V, C, prefix, floor, shift, row_max, scale,
                     masses_on, KEY_BITS: tl.constexpr, RADIX_BITS: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Counts (and masses_on: sums of exp2((x - row_max) * scale)) per digit (key >> shift) % RADIX of
    the chunk's keys that equal prefix on the bits above the digit and are >= floor. The chunk
    is read in one masked load (one memory round trip, not one per block) that leaves out the
    blocks whose maximum key is below both; the masses are one reduction per digit."""
    RADIX: tl.constexpr = 1 << RADIX_BITS
    digits = tl.arange(0, RADIX)
    lowest = tl.maximum(prefix, floor)
    above = shift + RADIX_BITS
    index = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + index
    block_max = tl.load(block_max_ptr + (row * C + chunk) * (CHUNK // BLOCK) + index // BLOCK)
    needed = (offs < V) & (block_max >= lowest)
    raw = tl.load(logits_ptr + row * V + offs, mask=needed, other=0.0)
    key = _key(raw, KEY_BITS)
    live = needed & ((key >> above) == (prefix >> above)) & (key >= floor)
    digit = ((key >> shift) & (RADIX - 1)).to(tl.int32)
    counts = tl.histogram(digit, RADIX, mask=live)
    masses = tl.full([RADIX], 0.0, tl.float32)
    if masses_on:
        e = tl.where(live, _exp_from(raw.to(tl.float32), row_max, scale), 0.0)
        for d in tl.static_range(RADIX):
            masses = tl.where(digits == d, tl.sum(tl.where(digit == d, e, 0.0), axis=0), masses)
    return counts, masses


@triton.jit
def _search_item(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, block_max_ptr,
                 count_in_ptr, mass_in_ptr, count_out_ptr, mass_out_ptr,
                 prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr, todo_ptr, item,
                 T, V, C, R, level, KEY_BITS: tl.constexpr, RADIX_BITS: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (row, chunk) pair of a level (a top-p level from level LEVELS on) of the rows the
    candidates left undecided: pick the previous level's digit (every pair of the row does, from
    that level's partials; chunk 0 stores the state), then write the chunk's counts (and
    masses, top-p) per digit of this level: of the keys with the search's prefix, and at or
    above top-k's floor in the top-p search.

    The previous level's keys are at or above a bound (the prefix before it, and top-k's floor
    in the top-p search): a chunk whose maximum key is below it skips the pick (except chunk 0)
    and the histogram. What other programs wrote in this launch is read past L1 (".cg")."""
    LEVELS: tl.constexpr = KEY_BITS // RADIX_BITS
    RADIX: tl.constexpr = 1 << RADIX_BITS
    NB: tl.constexpr = CHUNK // BLOCK
    top_p = level >= LEVELS
    shift = KEY_BITS - RADIX_BITS * (level % LEVELS + 1)
    row = tl.load(todo_ptr + item // C).to(tl.int64)
    chunk = item % C
    b = row // T
    pick_on, count_on = _takes_part(top_k_ptr, top_p_ptr, b, V, level, LEVELS)
    counts = tl.full([RADIX], 0, tl.int32)
    masses = tl.full([RADIX], 0.0, tl.float32)
    if pick_on | count_on:
        prefix = tl.full([], 0, tl.int64)
        if pick_on & (level >= 2):  # (else this level starts the row's search)
            prefix = tl.load(prefix_ptr + (level - 2) * R + row, cache_modifier=".cg")
        floor = tl.full([], 0, tl.int64)
        if level > LEVELS:
            floor = tl.load(prefix_ptr + (LEVELS - 1) * R + row, cache_modifier=".cg")
        chunk_max = tl.max(tl.load(block_max_ptr + (row * C + chunk) * NB + tl.arange(0, NB)), axis=0)
        if (chunk == 0) | (chunk_max >= tl.maximum(prefix, floor)):
            prefix = tl.full([], 0, tl.int64)
            if pick_on:
                prefix, above_count, above_mass, total, _ = _pick_digit(
                    count_in_ptr, mass_in_ptr, prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr,
                    top_k_ptr, top_p_ptr, row, b, R, C, level - 1, (shift + RADIX_BITS) % KEY_BITS, KEY_BITS,
                    RADIX_BITS, BLOCK_C)
                if chunk == 0:
                    state = (level - 1) * R + row
                    tl.store(prefix_ptr + state, prefix)
                    tl.store(above_count_ptr + state, above_count)
                    tl.store(above_mass_ptr + state, above_mass)
                    if level == LEVELS + 1:
                        tl.store(total_ptr + row, total)
            if level == LEVELS:  # the top-p search starts at top-k's floor (0 without top-k)
                floor = prefix
                prefix = tl.full([], 0, tl.int64)
            if count_on:
                row_max = tl.full([], 0.0, tl.float32)
                scale = tl.full([], 0.0, tl.float32)
                if top_p:
                    row_max = _row_max(part_max_ptr, row, C, BLOCK_C)
                    scale = _log2_scale(temperature_ptr, b)
                counts, masses = _chunk_histogram(logits_ptr, block_max_ptr, row, chunk, V, C, prefix, floor,
                                                  shift, row_max, scale, top_p, KEY_BITS, RADIX_BITS, CHUNK, BLOCK)
    if count_on:
        out = (row * C + chunk) * RADIX + tl.arange(0, RADIX)
        tl.store(count_out_ptr + out, counts)
        if top_p:
            tl.store(mass_out_ptr + out, masses)


@triton.jit
def _search_result(count_ptr, mass_ptr, top_k_ptr, top_p_ptr, prefix_ptr, above_count_ptr, above_mass_ptr,
                   total_ptr, todo_ptr, todo, floor_ptr, kept_ptr, T, V, C, R, KEY_BITS: tl.constexpr,
                   RADIX_BITS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per row the candidates left undecided (the programs share them): pick the last level's
    digit; write the key floor and the kept mass: top-p's where it is on (its threshold, the
    mass at and above it), else top-k's (its threshold, the first top-p level's total)."""
    LEVELS: tl.constexpr = KEY_BITS // RADIX_BITS
    for item in range(tl.program_id(0), todo, tl.num_programs(0)):
        row = tl.load(todo_ptr + item).to(tl.int64)
        b = row // T
        top_k_on, top_p_on = _filters_on(top_k_ptr, top_p_ptr, b, V)
        if top_p_on:
            floor, above_count, above_mass, total, kept = _pick_digit(
                count_ptr, mass_ptr, prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr, top_k_ptr, top_p_ptr,
                row, b, R, C, 2 * LEVELS - 1, 0, KEY_BITS, RADIX_BITS, BLOCK_C)
        else:
            floor = tl.load(prefix_ptr + (LEVELS - 1) * R + row, cache_modifier=".cg")
            kept = tl.load(total_ptr + row, cache_modifier=".cg")
        tl.store(floor_ptr + row, floor)
        tl.store(kept_ptr + row, kept)


@triton.jit
def _wait_for(done_ptr, target):
    """Returns once the counter at done_ptr reaches target, with what was stored before each
    of its (release) increments visible to every thread of this program."""
    count = tl.load(done_ptr, volatile=True)
    while count < target:
        count = tl.load(done_ptr, volatile=True)
    tl.atomic_add(done_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _search_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, block_max_ptr,
                   count_ptr, mass_ptr, prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr, todo_ptr,
                   counters_ptr, floor_ptr, kept_ptr, T, V, C, R, KEY_BITS: tl.constexpr,
                   RADIX_BITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """The top-k, then top-p, radix searches of the rows `_filter_floor_kernel` listed, in one
    launch that returns at once where it listed none (most steps): levels 0 .. 2 * LEVELS - 1,
    each reading the counts the one before wrote into the other half of count_ptr / mass_ptr
    [2, R, C, RADIX], then the last digit (`_search_result`).

    counters_ptr: the number of listed rows, then per level a count of the (row, chunk) pairs
    claimed and one of those done (all 0 at the start). A program claims a few pairs at a time
    until none is left, then waits until all are done before the next level. It only ever waits
    for pairs that running programs hold, so the programs need not all be resident at once."""
    todo = tl.load(counters_ptr)
    if todo > 0:
        LEVELS: tl.constexpr = KEY_BITS // RADIX_BITS
        half = R * C * (1 << RADIX_BITS)
        pairs = todo * C
        group = tl.maximum(pairs // (4 * tl.num_programs(0)), 1)
        for level in range(0, 2 * LEVELS):
            before, after = ((level + 1) % 2) * half, (level % 2) * half
            claimed_ptr = counters_ptr + 1 + 2 * level
            start = tl.atomic_add(claimed_ptr, group)
            while start < pairs:
                end = tl.minimum(start + group, pairs)
                for item in range(start, end):
                    _search_item(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, part_max_ptr, block_max_ptr,
                                 count_ptr + before, mass_ptr + before, count_ptr + after, mass_ptr + after,
                                 prefix_ptr, above_count_ptr, above_mass_ptr, total_ptr, todo_ptr, item, T, V, C,
                                 R, level, KEY_BITS, RADIX_BITS, CHUNK, BLOCK, BLOCK_C)
                tl.debug_barrier()  # every thread's stores issued before the release
                tl.atomic_add(claimed_ptr + 1, end - start, sem="release")
                start = tl.atomic_add(claimed_ptr, group)
            _wait_for(claimed_ptr + 1, pairs)
        last = ((2 * LEVELS - 1) % 2) * half
        _search_result(count_ptr + last, mass_ptr + last, top_k_ptr, top_p_ptr, prefix_ptr, above_count_ptr,
                       above_mass_ptr, total_ptr, todo_ptr, todo, floor_ptr, kept_ptr, T, V, C, R, KEY_BITS,
                       RADIX_BITS, BLOCK_C)


# T is never specialised: with T == 1 the walk loop folds away and Triton 3.6 fails to
# compile what is left (the prefill's one-node accept hits this).
@triton.jit(do_not_specialize=["T"])
def _tree_walk_kernel(logits_ptr, tokens_ptr, next_token_ptr, next_sibling_ptr,
                      predicts_ptr, accept_index_ptr, accept_num_ptr, last_ptr,
                      part_max_ptr, part_aux_ptr, floor_ptr, kept_ptr, coins_ptr, temperature_ptr,
                      T, V, C, GREEDY: tl.constexpr, FILTERS: tl.constexpr, KEY_BITS: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per batch row: the walk of tree_sampling's references on p (or the argmax), p evaluated on demand.

    It first writes the tree's predicts and accept_index as the references' callers fill them
    (-1; the root's slot at accept_index[b, 0]). Greedy also writes the bonus; sampling leaves
    it to the residual kernels (last_ptr)."""
    b = tl.program_id(0).to(tl.int64)
    nodes = b * T  # the first row and slot of tree b
    slots = tl.arange(0, BLOCK_T)
    tl.store(predicts_ptr + nodes + slots, tl.full([BLOCK_T], -1, tl.int32), mask=slots < T)
    tl.store(accept_index_ptr + nodes + slots, tl.where(slots == 0, nodes.to(tl.int32), -1), mask=slots < T)
    tl.debug_barrier()  # those stores before the walk's own to the same entries
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
    last accepted row of each tree twice). Filters add one per-row launch over the candidates
    (`_filter_floor_kernel`), then one launch of the radix search (see `_run_searches`), which
    returns at once unless the candidates left rows undecided (mostly they leave none); each of
    its 2 * KEY_BITS / RADIX_BITS levels (8 for bf16/fp16 logits, 16 for float32) reads only the
    blocks of those rows' logits that hold a key in its range, at most those logits once.
    """
    bs, nodes, vocab = _check_accept_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                          accept_num, greedy, coins, final_coins, temperature, top_k, top_p,
                                          filters)
    if bs == 0:
        return
    chunk = chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    block_c = triton.next_power_of_2(num_chunks)
    key_bits = KEY_BITS[logits.dtype]
    stats = _row_stats(logits, nodes, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                       filters=filters and not greedy)
    part_max, part_aux = stats.part_max, stats.part_aux
    tree = (tokens, next_token, next_sibling)
    if greedy:
        _tree_walk_kernel[(bs,)](logits, *tree, predicts, accept_index, accept_num, accept_num,
                                 part_max, part_aux, part_max, part_max, part_max, part_max,
                                 nodes, vocab, num_chunks, GREEDY=True, FILTERS=False, KEY_BITS=key_bits,
                                 BLOCK_C=block_c, BLOCK_T=triton.next_power_of_2(nodes))
        return

    floor, kept = (stats.floor, stats.kept) if filters else (part_max, part_max)  # (not read without filters)
    dev = logits.device
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    _tree_walk_kernel[(bs,)](logits, *tree, predicts, accept_index, accept_num, last,
                             part_max, part_aux, floor, kept, coins, temperature,
                             nodes, vocab, num_chunks, GREEDY=False, FILTERS=filters, KEY_BITS=key_bits,
                             BLOCK_C=block_c, BLOCK_T=triton.next_power_of_2(nodes))
    residual = (logits, *tree, part_max, part_aux, floor, kept, temperature, last)
    sums = torch.empty((bs, num_chunks), dtype=torch.float32, device=dev)
    meta = dict(FILTERS=filters, KEY_BITS=key_bits, CHUNK=chunk, BLOCK_C=block_c)
    _residual_sums_kernel[(bs, num_chunks)](*residual, sums, nodes, vocab, num_chunks, **meta)
    _residual_pick_kernel[(bs,)](*residual, sums, final_coins, predicts, nodes, vocab, num_chunks, **meta,
                                 num_warps=RESIDUAL_PICK_WARPS)


class _SearchBuffers:
    """Device buffers of the top-k / top-p searches (see `_run_searches`)."""

    def __init__(self, rows: int, num_chunks: int, blocks_per_chunk: int, key_bits: int, dev: torch.device):
        self.levels = 2 * (key_bits // RADIX_BITS)
        # Per (row, chunk): its CANDIDATES largest keys, descending (-1 past its last), and the
        # largest key it leaves out (-1 where none).
        key_dtype = torch.int32 if key_bits == 16 else torch.int64
        self.candidates = torch.empty((rows, num_chunks, CANDIDATES), dtype=key_dtype, device=dev)
        self.left_out = torch.empty((rows, num_chunks), dtype=key_dtype, device=dev)
        self.exact = torch.empty(rows, dtype=torch.int32, device=dev)
        # The rows the candidates left to the searches; their number, then per level the
        # search's counts of (row, chunk) pairs claimed and done (all cleared by the stats pass).
        self.todo = torch.empty(rows, dtype=torch.int32, device=dev)
        self.counters = torch.empty(triton.next_power_of_2(1 + 2 * self.levels), dtype=torch.int32, device=dev)
        self.key_bits = key_bits
        self.block_max = torch.empty((rows, num_chunks, blocks_per_chunk), dtype=torch.int64, device=dev)
        # Per-chunk counts / masses per digit; level j writes [j % 2], level j + 1 reads them.
        self.counts = torch.empty((2, rows, num_chunks, 1 << RADIX_BITS), dtype=torch.int32, device=dev)
        self.masses = torch.empty((2, rows, num_chunks, 1 << RADIX_BITS), dtype=torch.float32, device=dev)
        # The state after each level's digit (the floor kernel clears top-k's floor, the last
        # top-k level's prefix: 0 where top-k is off).
        self.prefix = torch.empty((self.levels, rows), dtype=torch.int64, device=dev)
        self.above_count = torch.empty((self.levels, rows), dtype=torch.int32, device=dev)
        self.above_mass = torch.empty((self.levels, rows), dtype=torch.float32, device=dev)
        self.total = torch.empty(rows, dtype=torch.float32, device=dev)

    def state(self) -> tuple[Tensor, ...]:
        return self.prefix, self.above_count, self.above_mass, self.total


def _run_searches(search: _SearchBuffers, logits, temperature, top_k, top_p, part_max, part_sum, floor, kept,
                  nodes, chunk, block) -> None:
    """Each row's key floor and kept mass: from its candidates where they decide them, else by
    the top-k, then top-p, radix searches.

    A search finds its threshold key RADIX_BITS at a time, most significant first: each level
    counts the keys with the digits found so far per value of the next digit, and picks the
    largest digit whose keys and those above reach the goal. The top-p search only counts keys
    >= the top-k floor: that changes nothing (the head it keeps never reaches below the floor)
    but lets its levels skip the other blocks; its first level also runs where top-p is off
    but top-k on, for the mass top-k keeps. Two launches: `_filter_floor_kernel` lists the rows
    the candidates leave undecided, and `_search_kernel`, a static grid of SEARCH_PROGRAMS
    programs at most, searches them (L = 2 * KEY_BITS / RADIX_BITS levels: level j picks level
    j - 1's digit and counts level j; the last digit after level L - 1), or returns at once
    where none is listed.
    """
    rows, num_chunks = part_max.shape
    block_c = triton.next_power_of_2(num_chunks)
    filters = (temperature, top_k, top_p)
    levels = search.levels // 2  # per search
    _filter_floor_kernel[(rows,)](logits, *filters, part_max, part_sum, search.candidates, search.left_out, floor,
                                  kept, search.exact, search.prefix[levels - 1], search.todo, search.counters, nodes,
                                  logits.shape[2], num_chunks, KEY_BITS=search.key_bits, CAND=CANDIDATES,
                                  SORTED=triton.next_power_of_2(num_chunks * CANDIDATES), BLOCK_C=block_c)
    _search_kernel[(min(rows * num_chunks, SEARCH_PROGRAMS),)](
        logits, *filters, part_max, search.block_max, search.counts, search.masses, *search.state(), search.todo,
        search.counters, floor, kept, nodes, logits.shape[2], num_chunks, rows, KEY_BITS=search.key_bits,
        RADIX_BITS=RADIX_BITS, CHUNK=chunk, BLOCK=block, BLOCK_C=block_c, num_warps=SEARCH_WARPS)


@dataclass
class _RowStats:
    """Per row (b * T + i) and chunk: the maximum logit and its first index (greedy) or the sum
    of exp2((x - max) * scale); with filters, per row: the key floor (int64), the mass it keeps
    and whether the candidates decided them (int32 1) or the radix search did (0)."""
    part_max: Tensor
    part_aux: Tensor
    floor: Tensor | None = None
    kept: Tensor | None = None
    exact: Tensor | None = None


def _row_stats(logits: Tensor, nodes: int, *, greedy: bool, temperature: Tensor | None, top_k: Tensor | None,
               top_p: Tensor | None, filters: bool) -> _RowStats:
    """The stats pass over logits [B, T, V], and with filters the floors found from it."""
    dev, (bs, _, vocab) = logits.device, logits.shape
    rows, chunk = bs * nodes, chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    key_bits = KEY_BITS[logits.dtype]
    block = min(chunk, HIST_BLOCK)
    stats = _RowStats(torch.empty((rows, num_chunks), dtype=torch.float32, device=dev),
                      torch.empty((rows, num_chunks), dtype=torch.int32 if greedy else torch.float32, device=dev))
    search = _SearchBuffers(rows, num_chunks, chunk // block, key_bits, dev) if filters else None
    unused = stats.part_max  # stands in for the pointers a variant does not read
    # The candidates' sub-chunks (see `_chunk_stats_kernel`): SUB_CHUNK, or the whole chunk
    # where the CANDIDATES + 1 picked (a power of two of them) would cover it.
    picked = triton.next_power_of_2(CANDIDATES + 1)
    sub = SUB_CHUNK if picked * SUB_CHUNK < chunk else chunk
    _chunk_stats_kernel[(rows, num_chunks)](
        logits, unused if greedy else temperature, top_k if search else unused, top_p if search else unused,
        stats.part_max, stats.part_aux, *((search.block_max, search.candidates, search.left_out, search.counters)
                                          if search else (unused,) * 4),
        nodes, vocab, num_chunks, GREEDY=greedy, FILTERS=filters, KEY_BITS=key_bits, CAND=CANDIDATES, SUB=sub,
        PICKED=picked, CHUNK=chunk, BLOCK=block, COUNTERS=search.counters.numel() if search else 1,
        num_warps=FILTER_STATS_WARPS if filters else 4)
    if search:
        stats.floor = torch.empty(rows, dtype=torch.int64, device=dev)  # every row written by `_run_searches`
        stats.kept = torch.empty(rows, dtype=torch.float32, device=dev)
        _run_searches(search, logits, temperature, top_k, top_p, stats.part_max, stats.part_aux, stats.floor,
                      stats.kept, nodes, chunk, block)
        stats.exact = search.exact
    return stats


# ---------------------------------------------------------------------------------------
# Position-keyed sampling (ddtree_kernels/keyed_sampling.py): the greedy walk over perturbed scores.
# ---------------------------------------------------------------------------------------


def _check_keyed_args(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, greedy_rows,
                      seeds, positions, temperature, top_k, top_p) -> tuple[int, int, int]:
    bs, nodes, vocab = _check_accept_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                          accept_num, True, None, None, None, None, None, False)
    dev = logits.device
    for name, t, dtype, shape in (("greedy_rows", greedy_rows, torch.bool, (bs,)), ("seeds", seeds, torch.int64, (bs,)),
                                  ("positions", positions, torch.int64, (bs, nodes)),
                                  ("temperature", temperature, torch.float32, (bs,)),
                                  ("top_k", top_k, torch.int64, (bs,)), ("top_p", top_p, torch.float32, (bs,))):
        expect_tensor(name, t, dtype, shape, dev)
    return bs, nodes, vocab


def tree_accept_keyed_reference(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                                predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy_rows: Tensor,
                                seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor,
                                top_p: Tensor) -> None:
    """The specification: each sampled node's scores are `keyed_scores` at its `positions` entry
    (the position of the token it samples), a greedy row's its logits, and the greedy walk
    follows their argmax (the first maximum)."""
    bs, nodes, vocab = _check_keyed_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                         accept_num, greedy_rows, seeds, positions, temperature, top_k, top_p)
    _clear_outputs(predicts, accept_index, accept_num)
    per_node = [t.repeat_interleave(nodes) for t in (seeds, temperature, top_k, top_p)]
    scores = keyed_scores(logits.reshape(bs * nodes, vocab), per_node[0], positions.reshape(-1), *per_node[1:])
    scores = torch.where(greedy_rows[:, None, None], logits.float(), scores.view(bs, nodes, vocab))
    slots = torch.arange(bs * nodes, device=logits.device).view(bs, nodes)
    verify_tree_greedy_reference(predicts, accept_index, accept_num, tokens, slots, next_token, next_sibling,
                                 scores.argmax(-1))


@triton.jit
def _mix(x):
    """ddtree_kernels.keyed_sampling._mix on uint32 x: its int64 values in [0, 2^32) -> [0, 2^31). The
    same bits: only a product's low 31 bits are kept, and 32-bit products wrap modulo 2^32."""
    x = (((x >> 16) ^ x) * HASH_MUL) & HASH_M31
    x = (((x >> 16) ^ x) * HASH_MUL) & HASH_M31
    return (x >> 16) ^ x


@triton.jit
def _keyed_chunk_kernel(logits_ptr, floor_ptr, greedy_ptr, seeds_ptr, positions_ptr, temperature_ptr,
                        part_max_ptr, part_arg_ptr, T, V, C, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
    """Per (row, chunk): the maximum perturbed score and its first index. A sampled row's score
    is logit / T + Gumbel noise hashed from (seed, position, token) where its key reaches the
    filters' floor, -inf elsewhere (`keyed_scores`); a greedy row's is its logit."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // T
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=-float("inf"))
    x = raw.to(tl.float32)
    if tl.load(greedy_ptr + b) == 0:
        seed = tl.load(seeds_ptr + b)  # >= 0: seed >> 31 < 2^32
        position = (tl.load(positions_ptr + row) & HASH_M31).to(tl.uint32)
        low, high = (seed & HASH_M31).to(tl.uint32), (seed >> 31).to(tl.uint32)
        key = _mix(_mix(low ^ _mix(high ^ HASH_SEED_SALT)) ^ position)
        h = _mix(key ^ _mix(offs.to(tl.uint32) ^ HASH_TOKEN_SALT))
        u = ((h >> 7).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        score = tl.math.div_rn(x, tl.load(temperature_ptr + b)) - tl.log(-tl.log(u))
        x = tl.where((offs < V) & (_key(raw, KEY_BITS) >= tl.load(floor_ptr + row)), score, -float("inf"))
    chunk_max, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_max_ptr + row * C + chunk, chunk_max)
    tl.store(part_arg_ptr + row * C + chunk, chunk * CHUNK + index)


def tree_accept_keyed_triton(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                             predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy_rows: Tensor,
                             seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor,
                             top_p: Tensor) -> None:
    """Triton version of tree_accept_keyed_reference; static shapes, no host synchronisation.

    The filters' floors come from the coin walk's stats pass (`_row_stats`: the same kept sets as
    `process_probs_reference`); then one pass over the logits scores every token with its noise
    (nothing materialised) and the greedy walk reads the chunks' maxima."""
    bs, nodes, vocab = _check_keyed_args(logits, tokens, next_token, next_sibling, predicts, accept_index,
                                         accept_num, greedy_rows, seeds, positions, temperature, top_k, top_p)
    if bs == 0:
        return
    dev, rows = logits.device, bs * nodes
    chunk = chunk_size(vocab)
    num_chunks = triton.cdiv(vocab, chunk)
    key_bits = KEY_BITS[logits.dtype]
    floor = _row_stats(logits, nodes, greedy=False, temperature=temperature, top_k=top_k, top_p=top_p,
                       filters=True).floor
    score_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    score_arg = torch.empty((rows, num_chunks), dtype=torch.int32, device=dev)
    _keyed_chunk_kernel[(rows, num_chunks)](logits, floor, greedy_rows, seeds, positions, temperature, score_max,
                                            score_arg, nodes, vocab, num_chunks, KEY_BITS=key_bits, CHUNK=chunk)
    unused = score_max
    _tree_walk_kernel[(bs,)](logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, accept_num,
                             score_max, score_arg, unused, unused, unused, unused,
                             nodes, vocab, num_chunks, GREEDY=True, FILTERS=False, KEY_BITS=key_bits,
                             BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_T=triton.next_power_of_2(nodes))


def tree_accept_keyed(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                      predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy_rows: Tensor,
                      seeds: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> None:
    """The position-keyed accept stage: Triton on CUDA, the reference elsewhere.

    logits [B, T, V] and the tree / output tensors as `tree_accept`'s; greedy_rows bool [B]
    (those rows take the plain greedy walk), seeds int64 [B] (>= 0), positions int64 [B, T]
    (each node's sampled token's position: the node's own + 1), temperature float32 [B] (> 0
    on every row), top_k int64 [B], top_p float32 [B]."""
    impl = tree_accept_keyed_triton if kernel_backend(logits.device) == "triton" else tree_accept_keyed_reference
    impl(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, greedy_rows=greedy_rows,
         seeds=seeds, positions=positions, temperature=temperature, top_k=top_k, top_p=top_p)


def tree_accept(logits: Tensor, tokens: Tensor, next_token: Tensor, next_sibling: Tensor,
                predicts: Tensor, accept_index: Tensor, accept_num: Tensor, *, greedy: bool,
                coins: Tensor | None = None, final_coins: Tensor | None = None,
                temperature: Tensor | None = None, top_k: Tensor | None = None,
                top_p: Tensor | None = None, filters: bool = True) -> None:
    """The fused sampling + accept stage: Triton on CUDA, the reference elsewhere (see module doc).

    logits [B, T, V] (bf16, fp16 or fp32); tokens / next_token / next_sibling int64 [B, T]
    (node i of tree b in slot b * T + i); outputs predicts int32 [B * T], accept_index int32
    [B, T], accept_num int32 [B], every entry written (see the module docstring)
    Sampling (greedy=False) needs coins float32 [B, T], final_coins float32 [B] and
    temperature float32 [B] (> 0), and with filters top_k int64 [B] (off: <= 0 or >= V) and
    top_p float32 [B] (off: >= 1); filters=False promises that every row has both off and
    skips them (top_k / top_p are then not read).
    """
    impl = tree_accept_triton if kernel_backend(logits.device) == "triton" else tree_accept_reference
    impl(logits, tokens, next_token, next_sibling, predicts, accept_index, accept_num, greedy=greedy,
         coins=coins, final_coins=final_coins, temperature=temperature, top_k=top_k, top_p=top_p,
         filters=filters)
