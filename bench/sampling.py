"""The batched accept step per sampling mode: greedy, the coin walk, position-keyed sampling.

    PYTHONPATH=. python bench/sampling.py [--batches 1,32] [--nodes 17] [--vocab 151936] [--out-json sampling.json]

Times `verifier_svc.accept.accept_batch` on random bf16 logits [B, T, V] and random trees of
T nodes, every row sampled (temperature 0.8, top-k 50, top-p 0.9) except in "greedy":
"greedy" (argmax + walk, fused), "sample" (the target-only coin walk, fused: never
materialises probabilities), "keyed" (position-keyed, fused: the filters' floors as the coin
walk finds them, then one pass scoring every token with its hashed Gumbel noise, then the
greedy walk over the chunks' maxima; the scores are never materialised). Each case is captured in a CUDA graph
on CUDA (as the verifier runs it) and timed over `--reps` replays; on the CPU it runs eagerly
(a smoke test, not a measurement). Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time

import torch

from bench.bench_timing import out_json, write_json
from bench.kernels import graphed
from tests.test_fused_accept import random_stage
from verifier_svc.accept import accept_batch

MODES = ("greedy", "sample", "keyed")


def case(batch: int, nodes: int, vocab: int, device: torch.device):
    """accept_batch's arguments for one random batch on `device`."""
    stage = random_stage(batch * 1000 + nodes, batch, nodes, vocab, torch.bfloat16)
    logits = stage["logits"].to(device)
    tokens, nt, ns = (stage[k].to(device) for k in ("tokens", "next_token", "next_sibling"))
    full = lambda value, dtype=torch.float32: torch.full((batch,), value, dtype=dtype, device=device)  # noqa: E731
    extra = dict(greedy=torch.zeros(batch, dtype=torch.bool, device=device), coins=stage["coins"].to(device),
                 final_coin=stage["final_coins"].to(device), temperature=full(0.8), top_k=full(50, torch.int64),
                 top_p=full(0.9), seeds=torch.arange(batch, dtype=torch.int64, device=device) + 12345,
                 positions=torch.arange(nodes, device=device)[None].expand(batch, nodes).contiguous() + 100)
    features = torch.zeros(batch, nodes, 1, device=device)
    return (tokens, nt, ns, logits, features), extra


def time_mode(mode: str, args, extra, device: torch.device, reps: int) -> float:
    """ms per call: graph replays on CUDA, eager calls elsewhere."""
    def call():
        return accept_batch(mode, *args, **extra)

    with torch.inference_mode():
        call()
        run = graphed(call, device) if device.type == "cuda" else call
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default 1,32)")
    p.add_argument("--nodes", type=int, default=17, help="tree nodes T, root included (default 17)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 151936; 4096 on CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 50 on CUDA, 2 on CPU)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    vocab = a.vocab or (151_936 if device.type == "cuda" else 4096)
    reps = a.reps or (50 if device.type == "cuda" else 2)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "vocab": vocab, "nodes": a.nodes, "reps": reps, "rows": []}
    print(f"accept step per sampling mode on {res['device']}: T = {a.nodes}, V = {vocab}, bf16 logits, ms per call")
    print(f"{'B':>4} " + " ".join(f"{m:>9}" for m in MODES) + "  keyed/sample")
    for batch in (int(x) for x in a.batches.split(",") if x.strip()):
        args, extra = case(batch, a.nodes, vocab, device)
        row = {"batch": batch} | {f"{m}_ms": time_mode(m, args, extra, device, reps) for m in MODES}
        res["rows"].append(row)
        print(f"{batch:>4} " + " ".join(f"{row[f'{m}_ms']:>9.3f}" for m in MODES)
              + f"  {row['keyed_ms'] / row['sample_ms']:>12.2f}", flush=True)
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
