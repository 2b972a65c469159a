"""The dense part of the repetition penalties (`common.penalties.penalize_dense`) in one launch.

One program per (batch row, vocabulary chunk): it reads the row's penalties and leaves at once
when it has none (presence 0, frequency 0, repetition 1: most rows, so a step without penalties
costs the launch alone); else it reads its slot's counts for the chunk once and penalises the
chunk in each of the row's T nodes, in place.

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


@triton.jit(**unspecialised(["T", "V", "STRIDE_B", "STRIDE_T", "STATE_STRIDE"],
                            ["logits_ptr", "generated_ptr", "context_ptr", "slots_ptr", "penalties_ptr"]))
def _dense_kernel(logits_ptr, generated_ptr, context_ptr, slots_ptr, penalties_ptr, T, V, STRIDE_B, STRIDE_T,
                  STATE_STRIDE, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    presence = tl.load(penalties_ptr + b * 3)
    frequency = tl.load(penalties_ptr + b * 3 + 1)
    repetition = tl.load(penalties_ptr + b * 3 + 2)
    if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):
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


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile the kernel for logits of `dtype` now, not in the first step that has penalties."""
    logits = torch.zeros(1, 1, 8, dtype=dtype, device=device)
    state = torch.zeros(1, 8, dtype=torch.float32, device=device)
    penalize_dense_triton(logits, state, state, torch.zeros(1, dtype=torch.int64, device=device),
                          torch.tensor([[0.5, 0.5, 1.5]], device=device))
