"""x @ w^T for few rows: the weight-streaming GEMMs of a small verify pass and draft step.

With at most 32 rows (one session's tree of 16 tokens, plain decoding, the drafter's block at
one session) a GEMM is bound by reading the weight once. Each program here owns BLOCK_N rows of
the weight and all M rows of x, so each weight byte is read once, in a software-pipelined loop
over K, and multiplies w_tile @ x_tile^T, so that the weight rows fill the MMA's wide side.
cuBLAS picks tiles made for more rows: on an H200, at Qwen3-8B's shapes, this kernel takes
0.84-0.97x cuBLAS's time at 1 to 32 rows (bench/RESULTS.md, "A GEMM for few rows"); where it
is not faster (over 32 rows, or K over 8192 at 17-32 rows) `skinny_config` says None and
`common.layers.linear` keeps F.linear.

Reference: F.linear(x, w); tests/test_skinny_gemm.py compares them on fresh random inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.tree_sampling import kernel_backend

MAX_ROWS = 32


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    x_cols = x_ptr + rm[None, :] * s_xm
    x_valid = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        if EVEN:  # N and K whole tiles: the weight loads need no mask
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        a = tl.load(x_cols + kk[:, None], mask=x_valid & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
    out = out_ptr + rm[None, :] * s_om + rn[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=x_valid & (rn[:, None] < N))


def skinny_config(m: int, n: int, k: int) -> dict | None:
    """The tiles for an m-row GEMM with an [n, k] weight, or None where cuBLAS is as fast
    (measured on an H200 at Qwen3-8B's q/k/v, o, gate/up, down and head shapes)."""
    if m <= 16:
        if n >= 16384:  # gate/up, the head
            return dict(BLOCK_N=64, BLOCK_K=128, num_stages=3 if n < 65536 else 5)
        return dict(BLOCK_N=64, BLOCK_K=256, num_stages=5)
    if m <= MAX_ROWS and k <= 8192:
        return dict(BLOCK_N=128 if n >= 65536 else 64, BLOCK_K=128, num_stages=3 if 16384 <= n < 65536 else 5)
    return None


def tiles_for(x: Tensor, weight: Tensor) -> dict | None:
    """The tiles `skinny_linear` takes this GEMM with, or None where it does not: CUDA (unless
    DDTREE_KERNELS=reference), half precision, few rows, a tile config."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.stride(-1) == 1 and kernel_backend(x.device) == "triton"):
        return None
    m = x.numel() // max(x.shape[-1], 1)
    return skinny_config(m, weight.shape[0], weight.shape[1]) if m else None


def skinny_linear(x: Tensor, weight: Tensor, out: Tensor | None = None, tiles: dict | None = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] (or into `out`, contiguous), for at most MAX_ROWS
    rows; `tiles` overrides `skinny_config` (tests, benchmarks)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight takes {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    cfg = tiles or skinny_config(m, n, k)
    if m > MAX_ROWS or cfg is None:
        raise ValueError(f"no skinny GEMM tiles for {m} rows of a [{n}, {k}] weight")
    result = out.view(-1, n) if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = dict(cfg)
        block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        _skinny_kernel[(triton.cdiv(n, block_n),)](
            rows, weight, result, m, n, k, rows.stride(0), weight.stride(0), result.stride(0),
            BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN=n % block_n == 0 and k % block_k == 0, IEEE=x.dtype == torch.float32, num_warps=4,
            **pdl.launch_options(x.device), **cfg)
    return out if out is not None else result.view(*x.shape[:-1], n)
