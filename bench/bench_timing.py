"""Timing and bandwidth helpers shared by the benchmark scripts, and their arguments' checks."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from common.cli import number_list  # noqa: F401  (the benches' list flags go through it)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device, reps: int, warmup: int = 2) -> float:
    """Median wall time of fn() in ms, synchronising the device after each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def device_ms(fn, device, reps: int, warmup: int = 2, budget_ms: float | None = None) -> float:
    """Median time of fn() in ms: CUDA events on the GPU, wall time on CPU. With `budget_ms`,
    slow calls get fewer repetitions (at least 3) so one measurement takes about that long."""
    if budget_ms is not None:
        once = wall_ms(fn, device, 1, warmup)
        reps, warmup = max(3, min(reps, int(budget_ms / max(once, 1e-3)))), 0
    if device.type != "cuda":
        return wall_ms(fn, device, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_bandwidth(device: torch.device, gib: float) -> dict:
    """Read bandwidth (float32 sum over a bf16 tensor) and copy bandwidth (read + write), in TB/s."""
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    reps = 20 if device.type == "cuda" else 3
    read = device_ms(lambda: x.sum(dtype=torch.float32), device, reps)
    copy = device_ms(lambda: y.copy_(x), device, reps)
    return {"bytes": n * 2, "read_ms": read, "copy_ms": copy,
            "read_TBps": n * 2 / read / 1e9, "copy_TBps": 2 * n * 2 / copy / 1e9}


def write_json(path: str | None, obj) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def out_json(path: str) -> str:
    """argparse type of --out-json: a file in a folder that exists and may be written, checked
    before the run rather than after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: {folder} is not a writable folder")
    return path
