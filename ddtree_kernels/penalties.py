"""The repetition penalties (`common.penalties`) on the device.

`penalize_dense_triton`: the dense part alone (`common.penalties.penalize_dense`, the prefill's
first tokens). One program per (batch row, vocabulary chunk): it reads the row's penalties and
leaves at once when it has none (presence 0, frequency 0, repetition 1: most rows, so a step
without penalties costs the launch alone); else it reads its slot's counts for the chunk once and
penalises the chunk in each of the row's T nodes, in place.

`penalize_nodes_triton`: a verify step's whole `common.penalties.penalize`, one program per tree
node, leaving at once for rows without penalties: it finds the first node of each token on its
path ([W, W] tile of the tree's tokens and its ancestor row), keeps those tokens' values, computed
from their raw logits with the path's occurrences added, in registers, penalises its whole row
with the slot's counts, then writes the path values over it. `count_paths_triton`: the accepted
paths' tokens added to the penalised rows' slot counts (atomics; rows without penalties are not
counted, and no one reads their counts).

The arithmetic is `common.penalties.penalized`'s, rounded the same way: float32, one IEEE
operation at a time (no fused multiply-add: the kernel is compiled without floating-point
fusion; `div_rn` for the division), so that a token penalised here and the same token penalised
by the reference (the tree paths' values) get the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels.tree_sampling import unspecialised

BLOCK = 1024
MAX_WIDTH = 128  # the widest tree a node program takes; wider ones take the torch path part


@triton.jit
def _penalized(x, count, seen, presence, frequency, repetition):
    """`common.penalties.penalized`, one IEEE operation at a time (launched without fusion)."""
    repeated = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    subtract = frequency * count
    subtract = subtract + tl.where(count > 0, presence, 0.0)
    return repeated - subtract


@triton.jit
def _row_penalties(penalties_ptr, b):
    """Row b's (presence, frequency, repetition) from penalties float32 [B, 3]."""
    return tl.load(penalties_ptr + b * 3), tl.load(penalties_ptr + b * 3 + 1), tl.load(penalties_ptr + b * 3 + 2)


@triton.jit(**unspecialised(["T", "V", "STRIDE_B", "STRIDE_T", "STATE_STRIDE"],
                            ["logits_ptr", "generated_ptr", "context_ptr", "slots_ptr", "penalties_ptr"]))
def _dense_kernel(logits_ptr, generated_ptr, context_ptr, slots_ptr, penalties_ptr, T, V, STRIDE_B, STRIDE_T,
                  STATE_STRIDE, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    presence, frequency, repetition = _row_penalties(penalties_ptr, b)
    if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):  # else the row has none: leave at once
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        slot = tl.load(slots_ptr + b).to(tl.int64)
        count = tl.load(generated_ptr + slot * STATE_STRIDE + cols, mask=inside, other=0.0)
        seen = tl.load(context_ptr + slot * STATE_STRIDE + cols, mask=inside, other=0.0) > 0
        subtract = frequency * count
        subtract = subtract + tl.where(count > 0, presence, 0.0)
        row = logits_ptr + b.to(tl.int64) * STRIDE_B + cols
        for t in range(T):
            raw = tl.load(row + t * STRIDE_T, mask=inside, other=0.0)
            x = raw.to(tl.float32)
            repeated = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
            tl.store(row + t * STRIDE_T, (repeated - subtract).to(raw.dtype), mask=inside)


@triton.jit(**unspecialised(["T", "V", "STRIDE_B", "STRIDE_T", "STATE_STRIDE"],
                            ["logits_ptr", "generated_ptr", "context_ptr", "slots_ptr", "penalties_ptr", "tokens_ptr",
                             "ancestors_ptr"]))
def _nodes_kernel(logits_ptr, generated_ptr, context_ptr, slots_ptr, penalties_ptr, tokens_ptr, ancestors_ptr, T, V,
                  STRIDE_B, STRIDE_T, STATE_STRIDE, W: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    n = tl.program_id(1)
    presence, frequency, repetition = _row_penalties(penalties_ptr, b)
    if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):  # else the row has none: leave at once
        state = tl.load(slots_ptr + b).to(tl.int64) * STATE_STRIDE
        a = tl.arange(0, W)
        inside = a < T
        tok = tl.load(tokens_ptr + b * T + a, mask=inside, other=-1)
        on_path = (tl.load(ancestors_ptr + (b * T + n) * T + a, mask=inside, other=0) != 0) & inside
        # same[a, a']: node a' is on n's path and has a's token
        same = (tok[:, None] == tok[None, :]) & on_path[None, :]
        k = tl.sum(same.to(tl.int32), axis=1)
        before = tl.sum((same & (a[None, :] < a[:, None])).to(tl.int32), axis=1)
        first = on_path & (before == 0)  # the first node of its token on n's path
        safe = tl.where(first, tok, 0)
        row = logits_ptr + b.to(tl.int64) * STRIDE_B + n.to(tl.int64) * STRIDE_T
        raw = tl.load(row + safe, mask=first, other=0.0)
        extra = k.to(tl.float32)
        count = tl.load(generated_ptr + state + safe, mask=first, other=0.0) + extra
        seen = (tl.load(context_ptr + state + safe, mask=first, other=0.0) + extra) > 0
        value = _penalized(raw.to(tl.float32), count, seen, presence, frequency, repetition)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < V
            c = tl.load(generated_ptr + state + cols, mask=m, other=0.0)
            s = tl.load(context_ptr + state + cols, mask=m, other=0.0) > 0
            x = tl.load(row + cols, mask=m, other=0.0)
            tl.store(row + cols, _penalized(x.to(tl.float32), c, s, presence, frequency, repetition).to(x.dtype),
                     mask=m)
        tl.debug_barrier()  # every thread's dense stores before the path values go over them
        tl.store(row + safe, value.to(raw.dtype), mask=first)


@triton.jit(**unspecialised(["T", "RESULT_STRIDE", "STATE_STRIDE"],
                            ["generated_ptr", "context_ptr", "slots_ptr", "penalties_ptr", "tokens_ptr",
                             "result_ptr"]))
def _count_kernel(generated_ptr, context_ptr, slots_ptr, penalties_ptr, tokens_ptr, result_ptr, T, RESULT_STRIDE,
                  STATE_STRIDE, W: tl.constexpr):
    b = tl.program_id(0)
    presence, frequency, repetition = _row_penalties(penalties_ptr, b)
    if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):  # else the row has none: leave at once
        state = tl.load(slots_ptr + b).to(tl.int64) * STATE_STRIDE
        i = tl.arange(0, W)
        keep = (i < T) & (i <= tl.load(result_ptr + b * RESULT_STRIDE))
        node = tl.load(result_ptr + b * RESULT_STRIDE + 2 + i, mask=keep, other=0)
        tok = tl.load(tokens_ptr + b * T + node, mask=keep, other=0)
        ones = tl.full((W,), 1.0, tl.float32)
        tl.atomic_add(generated_ptr + state + tok, ones, mask=keep)
        tl.atomic_add(context_ptr + state + tok, ones, mask=keep)


def penalize_dense_triton(logits: Tensor, generated: Tensor, context: Tensor, slots: Tensor, penalties: Tensor) -> None:
    """logits [B, T, V] (last dimension contiguous) in place; generated / context float32 [slots, V]
    contiguous; slots int64 [B]; penalties float32 [B, 3] contiguous."""
    b, t, v = logits.shape
    if logits.stride(2) != 1 or not (generated.is_contiguous() and context.is_contiguous()
                                     and penalties.is_contiguous()):
        raise ValueError("penalize_dense_triton needs contiguous rows")
    _dense_kernel[(b, triton.cdiv(v, BLOCK))](logits, generated, context, slots, penalties, t, v, logits.stride(0),
                                              logits.stride(1), generated.stride(0), BLOCK=BLOCK,
                                              enable_fp_fusion=False)


def penalize_nodes_triton(logits: Tensor, generated: Tensor, context: Tensor, slots: Tensor, tokens: Tensor,
                          ancestors: Tensor, penalties: Tensor) -> None:
    """`common.penalties.penalize` in one launch: logits [B, T, V] (last dimension contiguous), tokens
    int64 [B, T] and ancestors bool [B, T, T] contiguous, T <= MAX_WIDTH."""
    b, t, v = logits.shape
    if t > MAX_WIDTH or logits.stride(2) != 1 or not (tokens.is_contiguous() and ancestors.is_contiguous()):
        raise ValueError("penalize_nodes_triton needs contiguous inputs of at most MAX_WIDTH nodes")
    _nodes_kernel[(b, t)](logits, generated, context, slots, penalties, tokens, ancestors.view(torch.uint8), t, v,
                          logits.stride(0), logits.stride(1), generated.stride(0),
                          W=max(16, triton.next_power_of_2(t)), BLOCK=BLOCK, enable_fp_fusion=False)


def count_paths_triton(generated: Tensor, context: Tensor, slots: Tensor, penalties: Tensor, tokens: Tensor,
                       result: Tensor) -> None:
    """Add each penalised row's accepted path (result int64 [B, T + 2] = [accepted, bonus, path...]:
    its nodes' tokens [B, T]) to its slot's counts."""
    b, t = tokens.shape
    _count_kernel[(b,)](generated, context, slots, penalties, tokens, result, t, result.stride(0),
                        generated.stride(0), W=max(16, triton.next_power_of_2(t)))


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile the kernels for logits of `dtype` now, every tile width included, not in the first
    step that has penalties."""
    logits = torch.zeros(1, 1, 8, dtype=dtype, device=device)
    state = torch.zeros(1, 8, dtype=torch.float32, device=device)
    slots, penalties = torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([[0.5, 0.5, 1.5]], device=device)
    penalize_dense_triton(logits, state, state, slots, penalties)
    width = 16
    while width <= MAX_WIDTH:
        logits = torch.zeros(1, width, 8, dtype=dtype, device=device)
        tokens = torch.zeros(1, width, dtype=torch.int64, device=device)
        ancestors = torch.eye(width, dtype=torch.bool, device=device)[None]
        penalize_nodes_triton(logits, state, state, slots, tokens, ancestors, penalties)
        result = torch.zeros(1, width + 2, dtype=torch.int64, device=device)
        count_paths_triton(state, state, slots, penalties, tokens, result)
        width *= 2
