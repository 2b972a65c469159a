"""x @ w^T for few rows: the weight-streaming GEMMs of a small verify pass and draft step.

With at most 32 rows (one session's tree of 16 tokens, plain decoding, the drafter's block at
one session) a GEMM is bound by reading the weight once. Each program here owns BLOCK_N rows of
the weight and all M rows of x, so each weight byte is read once, in a software-pipelined loop
over K, and multiplies w_tile @ x_tile^T, so that the weight rows fill the MMA's wide side.
cuBLAS picks tiles made for more rows: on an H200, at Qwen3-8B's shapes, this kernel takes
0.84-0.97x cuBLAS's time at 1 to 32 rows (bench/RESULTS.md, "A GEMM for few rows"); where it
is not faster (over 32 rows, or K over 8192 at 17-32 rows) `skinny_config` says None and
`common.layers.linear` keeps F.linear.

With few output columns (o_proj and down: N = 4096) that is 64 programs on an H200's 132 SMs,
too few to stream the weight at full speed. `split_linear` then splits K in two: twice the
programs, each writing float32 partial sums of its half (a `SplitSum`), which the consumer, the
next residual add + RMSNorm (`ddtree_kernels.layer_ops.add_rms_norm`), adds and rounds as the
GEMM would have. From 16 to 64 rows (trees of 16 to 64 tokens) the pass is then faster.

Reference: F.linear(x, w); tests/test_skinny_gemm.py compares them on fresh random inputs.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ddtree_kernels import pdl
from ddtree_kernels.pdl import pdl_enter
from ddtree_kernels.tree_sampling import kernel_backend

MAX_ROWS = 32  # the one-pass GEMM
MIN_SPLIT_ROWS, MAX_SPLIT_ROWS = 16, 64  # the K-split GEMM
SPLITS = 2  # slices of K in the K-split GEMM


@dataclass(frozen=True)
class SplitSum:
    """A GEMM's result as float32 partial sums over slices of K, [splits, ..., N]; `total()`
    is the result, rounded to `dtype` as the GEMM rounds it."""
    partials: Tensor
    dtype: torch.dtype

    def total(self) -> Tensor:
        return self.partials.sum(0).to(self.dtype)


# Not specialised on M (Triton would specialise M == 1 and M % 16 == 0, and M only bounds a mask):
# one compiled kernel serves every row count, so an eager pass at a count no graph had (the head of
# a one-session prompt chunk over the graphs' lengths: 1 row) compiles nothing while serving.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SLICE, s_xm, s_wn, s_om, s_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    """Program (i, s): columns i * BLOCK_N .. of the product over K[s * K_SLICE, (s + 1) * K_SLICE),
    stored at out + s * s_split (one slice: the whole product)."""
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_SLICE
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    x_cols = x_ptr + rm[None, :] * s_xm
    x_valid = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_lo + K_SLICE, BLOCK_K):
        kk = k + rk
        if EVEN:  # N and each slice of K whole tiles: the weight loads need no mask
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        a = tl.load(x_cols + kk[:, None], mask=x_valid & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
    out = out_ptr + tl.program_id(1) * s_split + rm[None, :] * s_om + rn[:, None]
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


def split_config(m: int, n: int, k: int) -> dict | None:
    """The tiles for an m-row GEMM with an [n, k] weight split over K (`split_linear`), or None
    where it does not pay: more rows, enough output columns to fill the GPU in one pass, or
    fewer than 16 rows, where the whole verify pass was no faster with it (measured on an H200
    at Qwen3-8B's o_proj and down shapes: bench/gemm.py for the GEMMs, bench/pdl.py for the
    pass: 1 row 0.5% slower, 16 rows 1.3% faster, 64 rows 3.6% faster)."""
    if MIN_SPLIT_ROWS <= m <= MAX_SPLIT_ROWS and n <= 4096 and k >= 2048:
        return dict(BLOCK_N=64, BLOCK_K=128, num_stages=4)
    return None


def tiles_for(x: Tensor, weight: Tensor, split: bool = False) -> dict | None:
    """The tiles `skinny_linear` (or with split, `split_linear`) takes this GEMM with, or None
    where it does not: CUDA (unless DDTREE_KERNELS=reference), half precision, few rows, a tile
    config."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.stride(-1) == 1 and kernel_backend(x.device) == "triton"):
        return None
    m = x.numel() // max(x.shape[-1], 1)
    if not m:
        return None
    return (split_config if split else skinny_config)(m, weight.shape[0], weight.shape[1])


def _rows_and_weight(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """x as contiguous-feature rows [M, K], and the weight with contiguous rows."""
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight takes {k}")
    rows = x.reshape(-1, k)
    return (rows if rows.stride(-1) == 1 else rows.contiguous(),
            weight if weight.stride(-1) == 1 else weight.contiguous())


def _launch(rows: Tensor, weight: Tensor, result: Tensor, splits: int, tiles: dict) -> None:
    """rows [M, K] @ weight^T into result ([M, N], or [splits, M, N] of float32 partials)."""
    (m, k), n = rows.shape, weight.shape[0]
    if not m:
        return
    cfg = dict(tiles)
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    k_slice = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    _skinny_kernel[(triton.cdiv(n, block_n), splits)](
        rows, weight, result, m, n, k, k_slice, rows.stride(0), weight.stride(0), result.stride(-2),
        m * n, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k == k_slice * splits, IEEE=rows.dtype == torch.float32, num_warps=4,
        **pdl.launch_options(rows.device), **cfg)


def skinny_linear(x: Tensor, weight: Tensor, out: Tensor | None = None, tiles: dict | None = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] (or into `out`, contiguous), for at most MAX_ROWS
    rows; `tiles` overrides `skinny_config` (tests, benchmarks)."""
    rows, weight = _rows_and_weight(x, weight)
    (m, k), n = rows.shape, weight.shape[0]
    cfg = tiles or skinny_config(m, n, k)
    if m > MAX_ROWS or cfg is None:
        raise ValueError(f"no skinny GEMM tiles for {m} rows of a [{n}, {k}] weight")
    result = out.view(-1, n) if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(rows, weight, result, 1, cfg)
    return out if out is not None else result.view(*x.shape[:-1], n)


def split_linear(x: Tensor, weight: Tensor, tiles: dict | None = None, splits: int = SPLITS) -> SplitSum:
    """x [..., K] @ weight[N, K]^T as `splits` float32 partial sums over slices of K, for at most
    MAX_SPLIT_ROWS rows; `tiles` overrides `split_config` (tests, benchmarks)."""
    rows, weight = _rows_and_weight(x, weight)
    (m, k), n = rows.shape, weight.shape[0]
    cfg = tiles or split_config(m, n, k)
    if m > MAX_SPLIT_ROWS or cfg is None or splits < 1:
        raise ValueError(f"no split GEMM tiles for {m} rows of a [{n}, {k}] weight in {splits} slices")
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _launch(rows, weight, partials, splits, cfg)
    return SplitSum(partials.view(splits, *x.shape[:-1], n), x.dtype)


# Row counts at which the GEMMs compile a variant of their own: BLOCK_M = max(16, next power of two
# of the rows) is a compile-time constant, and the tiles change at 17 rows (`skinny_config`).
SKINNY_WARM_ROWS = (1, MAX_ROWS // 2 + 1)
SPLIT_WARM_ROWS = (MIN_SPLIT_ROWS, MIN_SPLIT_ROWS + 1, 2 * MIN_SPLIT_ROWS + 1)


def warm_up(weights: Iterable[Tensor]) -> int:
    """Compile, now, every variant the few-row GEMMs may launch with these weights: each tile
    config and BLOCK_M that some row count takes, of `skinny_linear` and of `split_linear` with
    `add_rms_norm` over its partial sums. CUDA graphs compile the row counts they were captured
    at; an eager pass (a prompt chunk of any length, the head over its last rows) would otherwise
    compile at a new one while serving, stalling every session's step for about 0.3 s (measured
    on an H200). Launches each variant once per weight shape (the layers share a few); returns
    the number of launches. Nothing to do where `tiles_for` takes no GEMM (a CPU, float32,
    DDTREE_KERNELS=reference)."""
    from ddtree_kernels.layer_ops import add_rms_norm_triton  # the K-split's consumer (it imports this module)

    seen, launches = set(), 0
    for weight in weights:
        if weight.dim() != 2 or weight.stride(-1) != 1:
            continue
        (n, k), shape = weight.shape, (tuple(weight.shape), weight.stride(0), weight.dtype, weight.device)
        if shape in seen:
            continue
        seen.add(shape)
        for split, rows in ((False, SKINNY_WARM_ROWS), (True, SPLIT_WARM_ROWS)):
            for m in rows:
                x = torch.zeros(m, k, dtype=weight.dtype, device=weight.device)
                tiles = tiles_for(x, weight, split=split)
                if tiles is None:
                    continue
                if split:
                    residual = torch.zeros(m, n, dtype=weight.dtype, device=weight.device)
                    add_rms_norm_triton(residual, split_linear(x, weight, tiles=tiles), torch.ones_like(residual[0]),
                                        1e-6)
                else:
                    skinny_linear(x, weight, tiles=tiles)
                launches += 1
    return launches
