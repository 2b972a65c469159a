"""The drafter's draft step at Qwen3-8B dimensions: eager vs CUDA graphs.

    PYTHONPATH=. python bench/draft_step.py [--contexts 512,1024,1920] [--rows 1,4,16] [--out-json draft_step.json]
    PYTHONPATH=. python bench/draft_step.py --small      # toy sizes, runs on CPU too

Builds the random-weight DFlash draft of bench/round.py (5 layers, block 16, hidden 4096,
the target's 151,936-row embedding and head; nothing is written to disk) and times one
`DFlashProposer.block_logits` call, the drafter's per-round step (extend the context by
`rows` feature rows, block forward, head), for each context length and number of new rows:

* eager: `cuda_graphs=False`, the dynamic path;
* graph: the captured graph of the smallest fitting KV bucket, the whole call (input copies,
  replay, copy of the logits). Without CUDA the same static-shape code runs eagerly.

Times are medians of synchronised wall time and of CUDA-event time per call; the context is
reset to its length after each call, so every call sees the same shapes. New feature rows
come from the host in the model's dtype, as they come off the wire. Also reports the
weights read per step (the draft plus the head) and, on CUDA, the weight-streaming floor
at the read bandwidth measured in this run. Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time

import torch

from bench.bench_timing import device_ms, measure_bandwidth, wall_ms, write_json
from bench.round import random_proposer
from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs
from drafter_svc.drafter import DFlashProposer


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def graph_proposer(eager: DFlashProposer, max_seq_len: int) -> DFlashProposer:
    """The same weights with the graph path: captured on CUDA, the static-shape code run eagerly elsewhere."""
    graphed = DFlashProposer(eager.draft, eager.embed_tokens, eager.lm_head, max_seq_len, True,
                             DraftGraphConfig(slots=1))
    if graphed.graphs is None:
        graphed.graphs = DraftGraphs(graphed.draft, graphed.embed_tokens, graphed.lm_head, max_seq_len,
                                     DraftGraphConfig(slots=1), capture=False)
    return graphed


def time_step(proposer: DFlashProposer, context: int, rows: int, reps: int, seed: int) -> dict:
    """Median wall and device ms of one draft step on a context of `context` rows plus `rows` new ones."""
    device = proposer.embed_tokens.device
    dim = proposer.draft.fc.weight.shape[1]
    dtype = proposer.draft.fc.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randn(context, dim, generator=gen).to(dtype)
    new = torch.randn(rows, dim, generator=gen).to(dtype)
    ctx = proposer.start([], prompt)
    try:
        def step():
            ctx.length = context
            proposer.block_logits(ctx, 1, [], new)

        return {"wall_ms": wall_ms(step, device, reps), "device_ms": device_ms(step, device, reps)}
    finally:
        proposer.finish(ctx)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default=None, help="context rows before the step (default 512,1024,1920; "
                                                    "64,256 with --small)")
    p.add_argument("--rows", default=None, help="new feature rows per step (default 1,4,16; 1,4,8 with --small)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=None, help="timed calls per point (default 50; 5 with --small)")
    p.add_argument("--out-json", help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    contexts = _int_list(a.contexts or ("64,256" if a.small else "512,1024,1920"))
    rows = _int_list(a.rows or ("1,4,8" if a.small else "1,4,16"))
    reps = a.reps or (5 if a.small else 50)
    max_seq = min(a.max_seq_len, 512) if a.small else a.max_seq_len
    if max(contexts) + max(rows) > max_seq:
        p.error(f"contexts + rows must fit --max-seq-len {max_seq}")

    eager = random_proposer(a.small, device, dtype, max_seq, cuda_graphs=False, cls=DFlashProposer)
    t0 = time.perf_counter()
    graphed = graph_proposer(eager, max_seq)
    graphs = graphed.graphs
    weights = sum(t.numel() * t.element_size() for t in eager.draft.state_dict().values())
    weights += eager.lm_head.numel() * eager.lm_head.element_size()
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                 "block_size": eager.block_size, "max_seq_len": max_seq, "captured": graphs.capture,
                 "graphs": graphs.num_graphs, "kv_buckets": list(graphs.kv_buckets),
                 "setup_s": time.perf_counter() - t0, "capture_s": graphs.capture_s, "weight_bytes": weights,
                 "points": []}
    if device.type == "cuda":
        bandwidth = measure_bandwidth(device, 2.0)
        res["read_TBps"] = bandwidth["read_TBps"]
        res["floor_ms"] = weights / bandwidth["read_TBps"] / 1e9
    for context in contexts:
        for n in rows:
            row = {"context": context, "rows": n, "kv_bucket": graphs.select(context, n)}
            for name, proposer in (("eager", eager), ("graph", graphed)):
                timed = time_step(proposer, context, n, reps, seed=context + n)
                row |= {f"{name}_{key}": value for key, value in timed.items()}
            row["speedup"] = row["eager_wall_ms"] / row["graph_wall_ms"]
            res["points"].append(row)
            write_json(a.out_json, res)  # keep what is done even if the run is cut short
    print_table(res)
    write_json(a.out_json, res)
    return res


def print_table(res: dict) -> None:
    how = "captured CUDA graphs" if res["captured"] else "static-shape path run eagerly (no CUDA)"
    floor = f", weight floor {res['floor_ms']:.3f} ms" if "floor_ms" in res else ""
    print(f"\ndraft step, medians in ms ({res['device']}, {res['dtype']}, block {res['block_size']}, "
          f"{res['weight_bytes'] / 1e6:.1f} MB of weights{floor}); graph = {how}")
    cols = [("context", "context"), ("rows", "rows"), ("L", "kv_bucket"), ("eager", "eager_wall_ms"),
            ("graph", "graph_wall_ms"), ("eager-dev", "eager_device_ms"), ("graph-dev", "graph_device_ms"),
            ("speedup", "speedup")]
    print(" ".join(f"{h:>9}" for h, _ in cols))
    for r in res["points"]:
        print(" ".join(f"{r[key]:9.3f}" if isinstance(r[key], float) else f"{str(r[key]):>9}" for _, key in cols))


if __name__ == "__main__":
    main(sys.argv[1:])
