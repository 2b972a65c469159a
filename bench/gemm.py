"""The few-row GEMM (`ddtree_kernels/skinny_gemm.py`) against cuBLAS (F.linear) at Qwen3-8B's weight shapes.

    PYTHONPATH=. python bench/gemm.py [--rows 1,16,32,64] [--reps 5] [--out-json gemm.json]

For each weight shape and row count: microseconds per GEMM and the weight-read bandwidth, as
CUDA-graph replays over enough copies of the weight (>= 1.2 GB) that none is read from L2, for
cuBLAS, for the kernel with `skinny_config`'s tiles (where it has some; "-" where
`common.layers.linear` keeps cuBLAS) and for the K-split kernel with `split_config`'s (o_proj
and down; its partial sums are added by the next add_rms_norm, whose time is not counted
here: bench/pdl.py and bench/verify.py time whole passes). CUDA only.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import math

import torch
import torch.nn.functional as F

from bench.bench_timing import number_list, out_json, write_json
from ddtree_kernels.skinny_gemm import skinny_config, skinny_linear, split_config, split_linear

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}
COPY_BYTES = 1.2e9


def graph_us(fn, calls: int, reps: int) -> float:
    """Best of `reps` replays of a graph of fn (which makes `calls` GEMMs), in us per GEMM."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best * 1e3 / calls


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    p.add_argument("--rows", default="1,16,32,48,64", help="rows (M) per GEMM, comma-separated (default 1,16,32,48,64)")
    p.add_argument("--reps", type=int, default=5, help="graph replays per point, the fastest kept (default 5)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    rows = number_list(a.rows, "--rows")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    out = {"bench": "gemm", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "points": []}
    print(f"us per GEMM (weight read TB/s) on {out['device']}, bf16; '-': no tiles for this shape")
    print(f"{'weight':>8} {'N x K':>15} {'M':>4} {'cuBLAS':>16} {'kernel':>16} {'ratio':>6} {'split':>16} {'ratio':>6}")
    for name, (n, k) in SHAPES.items():
        copies = max(1, math.ceil(COPY_BYTES / (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            cublas = graph_us(lambda: [F.linear(x, w) for w in weights], copies, a.reps)
            tiles, split_tiles = skinny_config(m, n, k), split_config(m, n, k)
            kernel = (graph_us(lambda: [skinny_linear(x, w) for w in weights], copies, a.reps)
                      if tiles is not None else None)
            split = (graph_us(lambda: [split_linear(x, w) for w in weights], copies, a.reps)
                     if split_tiles is not None else None)
            point = {"weight": name, "n": n, "k": k, "m": m, "cublas_us": cublas, "kernel_us": kernel, "tiles": tiles,
                     "split_us": split, "split_tiles": split_tiles, "cublas_TBps": n * k * 2 / cublas / 1e6,
                     "kernel_TBps": n * k * 2 / kernel / 1e6 if kernel else None,
                     "split_TBps": n * k * 2 / split / 1e6 if split else None}
            out["points"].append(point)
            shown = ""
            for us in (kernel, split):
                shown += (f" {us:8.1f} ({n * k * 2 / us / 1e6:4.2f}) {us / cublas:6.2f}" if us
                          else f" {'-':>16} {'':>6}")
            print(f"{name:>8} {f'{n} x {k}':>15} {m:4d} {cublas:8.1f} ({point['cublas_TBps']:4.2f}){shown}")
        del weights
        torch.cuda.empty_cache()
    if a.out_json:
        write_json(a.out_json, out)
    return out


if __name__ == "__main__":
    main()
