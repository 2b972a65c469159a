"""An eager prompt chunk's host time against its device time (`TargetRunner.prefill`), alone and two in a row.

    PYTHONPATH=. python bench/prefill_host.py [--chunk 1024] [--pasts 0,1024,3072] [--reps 5]
        [--profile] [--out-json F]
    PYTHONPATH=. python bench/prefill_host.py --small     # toy sizes, runs on CPU too

Builds the target at Qwen3-8B dimensions with random bf16 weights (bench/verify.py's model, no
CUDA graphs: a long chunk runs eagerly) and, for each past length in `--pasts`, times one chunk
of `--chunk` tokens after that many cached ones:

* host: the call alone, from its start to its return (it returns once its work is queued,
  unless something in it waits for the device); device: from the call's start to the device's
  end (a sync after it);
* two in a row: a second chunk (another slot) called as soon as the first returns: when the
  first call returned, when the second did, and when the device was done. A second call that
  returns only near the device's end waits for the device (or for the launch queue), and so
  holds its caller (the verifier's worker) through both chunks;
* mask on the host: `prefill_mask` of the chunk computed on the CPU (one thread), which the
  prefill built on the host ahead of every chunk's launch before it built it on the device.

Also lists, on CUDA, every operation of one call that synchronises the device
(`torch.cuda.set_sync_debug_mode`), and with `--profile` the torch profiler's host ops of one
call by their own host time (where the host time goes: launches, allocations, waits).
On the CPU host and device are one: a smoke test of the code, not a measurement.
Prints a table (ms, medians) and writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import statistics
import time
import warnings

import torch

from bench.bench_timing import number_list, out_json, sync, write_json
from bench.verify import feature_layers, qwen3_8b_config, random_target
from verifier_svc.target_runner import TargetRunner, prefill_mask


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def time_chunk(runner: TargetRunner, prompt: torch.Tensor, past: int, reps: int) -> dict:
    """Host and device time of one chunk after `past` cached tokens (slot 0), and of two in a row
    (slots 0 and 1)."""
    dev = runner.device
    host, device, first, second, both = [], [], [], [], []
    for _ in range(reps):
        sync(dev)
        start = time.perf_counter()
        runner.prefill([0], [prompt], [past])
        returned = time.perf_counter()
        sync(dev)
        host.append(returned - start)
        device.append(time.perf_counter() - start)
    for _ in range(reps):
        sync(dev)
        start = time.perf_counter()
        runner.prefill([0], [prompt], [past])
        one = time.perf_counter()
        runner.prefill([1], [prompt], [past])
        two = time.perf_counter()
        sync(dev)
        first.append(one - start)
        second.append(two - start)
        both.append(time.perf_counter() - start)
    return {"past": past, "host_ms": _median_ms(host), "device_ms": _median_ms(device),
            "two_first_returned_ms": _median_ms(first), "two_second_returned_ms": _median_ms(second),
            "two_device_ms": _median_ms(both)}


def host_mask_ms(chunk: int, past: int, reps: int) -> float:
    """`prefill_mask` of one chunk after `past` tokens on the CPU, one thread (median ms)."""
    positions = torch.arange(past, past + chunk)[None]
    in_prompt = torch.ones(1, chunk, dtype=torch.bool)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            prefill_mask(positions, in_prompt, past + chunk)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return _median_ms(times)


def syncing_ops(runner: TargetRunner, prompt: torch.Tensor, past: int) -> list[str]:
    """The warnings of PyTorch's sync debug mode for one call: each names an op that waited for the device."""
    if runner.device.type != "cuda":
        return []
    sync(runner.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.prefill([0], [prompt], [past])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(runner.device)
    return [str(w.message).splitlines()[0] for w in caught]


def profile_ops(runner: TargetRunner, prompt: torch.Tensor, past: int, rows: int) -> str:
    """The torch profiler's table of one call's ops, by their own host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    sync(runner.device)
    with profile(activities=activities) as prof:
        runner.prefill([0], [prompt], [past])
        sync(runner.device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (CPU or GPU): a smoke test")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default 1024; 32 with --small)")
    p.add_argument("--pasts", default=None, help="cached tokens before the chunk, comma-separated "
                   "(default 0,1024,3072; 0,32 with --small)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (default 5)")
    p.add_argument("--profile", action="store_true", help="print the torch profiler's host ops of one call per past")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is one, else cpu)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    chunk = a.chunk or (32 if a.small else 1024)
    pasts = number_list((a.pasts or ("0,32" if a.small else "0,1024,3072")), "--pasts")
    if chunk < 1 or not pasts or min(pasts) < 0 or a.reps < 1:
        p.error("--chunk and --reps must be >= 1, --pasts >= 0")
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = qwen3_8b_config(a.small)
    max_seq_len = max(pasts) + chunk + 1
    model = random_target(cfg, feature_layers(cfg), device, dtype)
    runner = TargetRunner(model, 2, max_seq_len, 17, cuda_graphs=False)
    prompt = torch.randint(0, cfg.vocab_size, (chunk,), generator=torch.Generator().manual_seed(0))
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "chunk": chunk,
           "dtype": str(dtype).removeprefix("torch."), "layers": cfg.num_layers, "rows": []}
    print(f"# eager prefill of {chunk}-token chunks, {cfg.num_layers} layers, {res['device']}", flush=True)
    for past in pasts:
        runner.prefill([0], [prompt], [past])  # warm-up (and fills the cache up to the chunk)
        row = time_chunk(runner, prompt, past, a.reps)
        row["syncs"] = syncing_ops(runner, prompt, past)
        row["host_mask_ms"] = host_mask_ms(chunk, past, a.reps)
        res["rows"].append(row)
        print(f"  past {past}: host {row['host_ms']:.2f} ms, device {row['device_ms']:.2f} ms; two in a row: "
              f"{row['two_first_returned_ms']:.2f} / {row['two_second_returned_ms']:.2f} / "
              f"{row['two_device_ms']:.2f} ms; {len(row['syncs'])} syncing ops; the mask on the host "
              f"{row['host_mask_ms']:.2f} ms", flush=True)
        for message in row["syncs"]:
            print(f"    sync: {message}")
        if a.profile:
            print(profile_ops(runner, prompt, past, 30), flush=True)
        write_json(a.out_json, res)
    print(f"\n{'past':>6} {'host':>8} {'device':>8} {'1st ret':>8} {'2nd ret':>8} {'2 dev':>8} {'syncs':>6} {'mask':>7}")
    for row in res["rows"]:
        print(f"{row['past']:6d} {row['host_ms']:8.2f} {row['device_ms']:8.2f} {row['two_first_returned_ms']:8.2f} "
              f"{row['two_second_returned_ms']:8.2f} {row['two_device_ms']:8.2f} {len(row['syncs']):6d} "
              f"{row['host_mask_ms']:7.2f}")
    print("(ms; host: one call's return; device: its work done; two in a row: the first call's return, the "
          "second's, and the device's end, from the first call's start; mask: the chunk's mask built on the "
          "host, one thread)")
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
