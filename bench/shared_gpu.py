"""Two processes on one GPU: how a verifier-like and a drafter-like loop share the device.

    python bench/shared_gpu.py [--seconds 6] [--out-json FILE]

One process replays a CUDA graph of ten 8192^3 bf16 GEMMs (about 16 ms, like a verify pass at
32 sessions) and reads one value back after each replay; the other runs twenty small GEMMs
([32, 4096] x [4096, 4096]), reads one value back (a host wait, like the drafter's top-k
copy), then spends 2 ms on the host. Each runs alone, then both at once (no MPS: the GPU
time-slices between the two contexts). Printed and written: iterations per second and the
median (and the small loop's p90) latency per iteration. What it shows is what each host
wait costs while the other process holds the device, the reason the drafter's hot path
makes one wait per step (`common.staging`) and pipelines on a shared GPU only from many
sessions (`--shared-gpu-pipeline-sessions`).
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.bench_timing import out_json  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _big(out: mp.Queue, seconds: float, start) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            torch.matmul(a, b, out=c)
    graph.replay()
    torch.cuda.synchronize()
    start.wait()
    times, began = [], time.perf_counter()
    while time.perf_counter() - began < seconds:
        t = time.perf_counter()
        graph.replay()
        c[0, 0].item()
        times.append(time.perf_counter() - t)
    out.put(("graph loop", len(times) / (time.perf_counter() - began), sorted(times)))


def _small(out: mp.Queue, seconds: float, start) -> None:
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ w).sum().item()
    start.wait()
    times, began = [], time.perf_counter()
    while time.perf_counter() - began < seconds:
        t = time.perf_counter()
        y = x
        for _ in range(20):
            y = torch.tanh(y @ w)
        y[0, 0].item()
        times.append(time.perf_counter() - t)
        time.sleep(0.002)  # host work between waits
    out.put(("small loop", len(times) / (time.perf_counter() - began), sorted(times)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per case (default 6)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/shared_gpu.py needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    results = {}
    print(f"{'case':>12} {'loop':>11} {'iter/s':>8} {'p50 ms':>8} {'p90 ms':>8}")
    for case, roles in (("alone", [_big]), ("alone ", [_small]), ("both", [_big, _small])):
        out, start = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=role, args=(out, a.seconds, start)) for role in roles]
        for proc in procs:
            proc.start()
        time.sleep(8.0)  # both set up (CUDA context, graph capture) before the clock starts
        start.set()
        for _ in procs:
            name, rate, times = out.get()
            row = {"iterations_per_s": rate, "p50_ms": 1e3 * times[len(times) // 2],
                   "p90_ms": 1e3 * times[int(0.9 * len(times))]}
            results[f"{case.strip()}: {name}"] = row
            print(f"{case.strip():>12} {name:>11} {rate:8.1f} {row['p50_ms']:8.2f} {row['p90_ms']:8.2f}")
        for proc in procs:
            proc.join()
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "seconds": a.seconds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
