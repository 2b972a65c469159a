"""The verify pass with programmatic dependent launch between its kernels, against without.

    PYTHONPATH=. python bench/pdl.py [--batches 1] [--trees 0,15,63] [--rounds 5] [--out-json F]
    PYTHONPATH=. python bench/pdl.py --small    # toy sizes; runs on the CPU (no PDL there: a smoke test)

Builds `bench/verify.py`'s random Qwen3-8B-sized target once. With PDL off and on
(`DDTREE_PDL`; ddtree_kernels/pdl.py) it captures the "forward" CUDA graphs of every batch x
tree bucket, then times each graph's bare replay (device time), off and on taking turns round
after round so that clock drift hits both alike. Reports the replay against the
weight-streaming floor (weights read once / read bandwidth measured in this run), and checks
that the logits and features with PDL on equal those with it off bit for bit.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import statistics

import torch

from bench.bench_timing import measure_bandwidth, out_json, sync, write_json
from bench.verify import (_ints, feature_layers, fill_slots, make_batch, make_runner, qwen3_8b_config, random_target,
                          replay_ms, weight_bytes)
from common.buckets import auto_kv_buckets
from common.protocol import SamplingParams
from ddtree_kernels import pdl
from ddtree_kernels.tree_sampling import reread_environment
from verifier_svc.cuda_graphs import GraphConfig, cache_length


OFF = "off"
SETTINGS = {OFF: "0", "pdl": "1"}  # label -> DDTREE_PDL when the runner's graphs are captured


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default="1", help="sessions per step, comma-separated (default 1)")
    p.add_argument("--trees", default="0,15,63", help="drafted nodes per tree, comma-separated (default 0,15,63)")
    p.add_argument("--past", type=int, default=None, help="tokens in each session's KV slot (default 128; small 48)")
    p.add_argument("--max-seq-len", type=int, default=512, help="KV capacity per session in tokens")
    p.add_argument("--rounds", type=int, default=None,
                   help="timing rounds, off and on taking turns (default 5; CPU 1)")
    p.add_argument("--reps", type=int, default=None, help="replays per timing (default 20; CPU 2)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    batches, trees = sorted(set(_ints(a.batches, [1], "--batches"))), sorted(set(_ints(a.trees, [0], "--trees")))
    if min(batches) < 1 or min(trees) < 0:
        p.error("--batches must be >= 1 and --trees >= 0")
    cfg = qwen3_8b_config(a.small)
    past = a.past if a.past is not None else (48 if a.small else 128)
    max_seq = min(a.max_seq_len, 256) if a.small else a.max_seq_len
    if past + 1 + max(trees) > max_seq:
        p.error(f"--past {past} + the largest tree do not fit --max-seq-len {max_seq}")
    rounds, reps = a.rounds or (5 if cuda else 1), a.reps or (20 if cuda else 2)
    res: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                 "dtype": str(dtype).removeprefix("torch."), "past": past, "settings": SETTINGS, "batches": batches,
                 "trees": trees, "rounds": rounds, "reps": reps}
    res["bandwidth"] = measure_bandwidth(device, 2.0 if cuda else 0.05)
    read_bw = res["bandwidth"]["read_TBps"] * 1e12
    model = random_target(cfg, feature_layers(cfg), device, dtype)
    wb = weight_bytes(model)
    res["floor_ms"] = wb["streamed"] / read_bw * 1e3
    print(f"# PDL bench on {res['device']}: read {res['bandwidth']['read_TBps']:.2f} TB/s, "
          f"weights-only floor {res['floor_ms']:.3f} ms", flush=True)

    buckets = tuple(sorted({0, *trees}))
    headroom = 1 + max(buckets)
    ladder = auto_kv_buckets(cache_length(max_seq, headroom))
    kv = tuple(sorted({min(k for k in ladder if k >= past + 1 + b) for b in buckets}))
    config = GraphConfig(tree_buckets=buckets, batch_buckets=tuple(batches), kv_buckets=kv, modes=("forward",),
                         max_tokens=max(batches) * headroom)
    prompt = torch.randint(cfg.vocab_size, (past,), generator=torch.Generator().manual_seed(0))
    runners = {}
    saved = os.environ.get(pdl.ENV)
    try:
        for label, flag in SETTINGS.items():  # each runner's graphs keep the launches of their capture
            os.environ[pdl.ENV] = flag if cuda else "0"  # (off CUDA no launch takes PDL)
            reread_environment()  # the kernels read it once per process
            runners[label] = make_runner(model, max(batches), max_seq, headroom, config=config)
            fill_slots(runners[label], prompt, max(batches))
    finally:
        os.environ.pop(pdl.ENV) if saved is None else os.environ.__setitem__(pdl.ENV, saved)
        reread_environment()
    sync(device)

    rows_out = []
    for batch in batches:
        for budget in trees:
            rows, masks = make_batch(cfg, batch, budget, past, SamplingParams())
            outputs, times = {}, {label: [] for label in SETTINGS}
            for label in SETTINGS:
                out = runners[label].graphs.run("forward", rows, masks)  # stages this step's inputs
                sync(device)
                outputs[label] = (out.logits.clone(), out.features.clone())
            for _ in range(rounds):
                for label in SETTINGS:  # None on the CPU, where the graph code runs eagerly
                    times[label].append(replay_ms(runners[label], "forward", rows, masks, reps))
            n = max(r.tree.num_nodes for r in rows)
            off = _median(times[OFF])
            for label in SETTINGS:
                same = all(torch.equal(x, y) for x, y in zip(outputs[label], outputs[OFF]))
                ms = _median(times[label])
                row = {"batch": batch, "tokens": n, "setting": label, "replay_ms": ms, "replay_ms_all": times[label],
                       "over_floor": ms and ms / res["floor_ms"], "vs_off": ms and ms / off, "same_as_off": same}
                rows_out.append(row)
                print(f"  B {batch:3d} tokens {n:4d} {label:>12}: replay {_num(ms)} ms  "
                      f"{_num(row['over_floor'])}x floor  {_num(row['vs_off'])}x off  same {same}", flush=True)
            res["rows"] = rows_out
            write_json(a.out_json, res)
    print_table(res)
    write_json(a.out_json, res)
    return res


def _median(values: list) -> float | None:
    return statistics.median(values) if values and None not in values else None


def _num(value: float | None) -> str:
    return f"{value:7.3f}" if value is not None else f"{'-':>7}"


def print_table(res: dict) -> None:
    print(f"\nverify forward replay (device ms, median of {res['rounds']} rounds), floor {res['floor_ms']:.3f} ms "
          f"({res['device']}, {res['dtype']}, past {res['past']})")
    print(f"{'B':>4} {'tokens':>7} {'setting':>12} {'replay':>8} {'/floor':>7} {'/off':>7} {'same':>5}")
    for r in res["rows"]:
        print(f"{r['batch']:4d} {r['tokens']:7d} {r['setting']:>12} {_num(r['replay_ms']):>8} {_num(r['over_floor'])} "
              f"{_num(r['vs_off'])} {str(r['same_as_off']):>5}")


if __name__ == "__main__":
    main()
