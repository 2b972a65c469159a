"""The drafter's batched draft step at Qwen3-8B dimensions: eager vs CUDA graphs.

    PYTHONPATH=. python bench/draft_step.py [--batches 1,4,16,32] [--contexts 512,1024,1920] [--rows 1,4,16]
                                            [--prompts 1,2,4,8] [--prompt-len 128]
                                            [--out-json draft_step.json]
    PYTHONPATH=. python bench/draft_step.py --small      # toy sizes, runs on CPU too

Builds a random-weight DFlash draft of the published Qwen3-8B shape (5 layers, block 16,
hidden 4096, 32 / 8 heads x 128, MLP 12288, target layers 1, 9, 17, 25, 33; the shape
bench/round.py drafts with) and the target's 151,936-row embedding and head, in memory
(nothing is written to disk). For every batch size B in `--batches`, context length and
number of new rows, it starts B sessions holding `context` feature rows each and times one
`DFlashProposer.propose` call for all B at once: the drafter's per-step work (every
session's context grows by `rows` feature rows, one batched block forward, the head over
block_size - 1 positions for each session):

* eager: `cuda_graphs=False`, the static-shape step run at the batch's own shape (fresh
  input buffers each call);
* graph: the captured graph of the smallest fitting (batch, KV) bucket, the whole call (input
  staging and copies, replay, copy of the logits). Graphs are captured for batch buckets =
  `--batches` and the automatic KV ladder. Without CUDA the same static-shape code runs
  eagerly at the bucket shapes (`DraftGraphs(capture=False)`): a smoke test, not a measurement.

A second table times what a reply that prefills K prompts costs the drafter: their feature
rows (`--prompt-len` each, on the device, as an in-process verifier hands them over) go into
K new contexts in one batched extension (`DFlashProposer.take_prompts` of K, as the scheduler
does) against one call per session (as it did before): the synchronised wall time and the
host time (the calls' own, before the sync; the extension is eager, so its launches are paid
per call).

Times are medians of synchronised wall time and of CUDA-event time per call, per step and
per session (step time / B). After each call every session's length is reset to `context`,
so every call sees the same shapes. New feature rows come from the host in the model's
dtype, as they come off the wire. Also reports the weights read per step (the draft plus the
head) and, on CUDA, the weight-streaming floor at the read bandwidth measured in this run.
Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import statistics
import time

import torch

from bench.bench_timing import device_ms, measure_bandwidth, number_list, out_json, sync, wall_ms, write_json
from bench.verify import draft_config, qwen3_8b_config, random_draft
from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs
from drafter_svc.drafter import DFlashProposer, DraftState


def proposers(small: bool, device, dtype, max_seq_len: int,
              batches: list[int]) -> tuple[DFlashProposer, DFlashProposer]:
    """(eager, graphed) proposers over the same weights, max(batches) context slots each; the
    graphed one captures graphs for batch buckets `batches` on CUDA, else runs their static
    code eagerly."""
    draft, embed, head = random_draft(small, device, dtype)
    slots = max(batches)
    config = DraftGraphConfig(batch_buckets=tuple(batches))
    eager = DFlashProposer(draft, embed, head, max_seq_len, slots, cuda_graphs=False)
    graphed = DFlashProposer(draft, embed, head, max_seq_len, slots, cuda_graphs=True, graph_config=config)
    if graphed.graphs is None:
        graphed.graphs = DraftGraphs(draft, embed, head, graphed.pool, graphed.scratch_slot, config, capture=False)
    return eager, graphed


def time_step(proposer: DFlashProposer, batch: int, context: int, rows: int, reps: int, seed: int) -> dict:
    """Median wall and device ms of one draft step of `batch` sessions, each holding `context`
    rows and getting `rows` new ones."""
    device = proposer.embed_tokens.device
    dim = proposer.draft.fc.weight.shape[1]
    dtype = proposer.draft.fc.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    states: list[DraftState] = []
    try:
        for _ in range(batch):
            states.append(proposer.start([], torch.randn(context, dim, generator=gen).to(dtype)))
        new = [torch.randn(rows, dim, generator=gen).to(dtype) for _ in range(batch)]
        roots = [1 + i for i in range(batch)]
        tokens = [[r] * rows for r in roots]

        def step():
            for s in states:
                s.length = context
            proposer.propose(states, roots, tokens, new)

        return {"wall_ms": wall_ms(step, device, reps), "device_ms": device_ms(step, device, reps)}
    finally:
        for s in states:
            proposer.finish(s)


def time_prompts(proposer: DFlashProposer, sessions: int, prompt_len: int, reps: int, seed: int) -> dict:
    """Median wall and host ms of taking `sessions` prompts of `prompt_len` rows into new
    contexts: together (one `take_prompts`) and apart (one call per session)."""
    device = proposer.embed_tokens.device
    gen = torch.Generator().manual_seed(seed)
    dim, dtype = proposer.draft.fc.weight.shape[1], proposer.draft.fc.weight.dtype
    features = [torch.randn(prompt_len, dim, generator=gen).to(device, dtype) for _ in range(sessions)]
    ids = [[0] * prompt_len] * sessions
    out = {}
    for name in ("together", "apart"):
        walls, hosts = [], []
        for rep in range(reps + 2):  # two warm-up calls
            sync(device)
            start = time.perf_counter()
            if name == "together":
                states = proposer.take_prompts([None] * sessions, ids, features)
            else:
                states = [proposer.take_prompts([None], ids[:1], [f])[0] for f in features]
            host = time.perf_counter()
            sync(device)
            if rep >= 2:
                walls.append((time.perf_counter() - start) * 1e3)
                hosts.append((host - start) * 1e3)
            for state in states:
                proposer.finish(state)
        out[f"{name}_wall_ms"], out[f"{name}_host_ms"] = statistics.median(walls), statistics.median(hosts)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default=None, help="sessions per step (default 1,4,16,32; 1,4 with --small)")
    p.add_argument("--contexts", default=None, help="context rows of each session before the step (default "
                                                    "512,1024,1920; 64,256 with --small)")
    p.add_argument("--rows", default=None, help="new feature rows per session per step (default 1,4,16; 1,4,8 "
                                                "with --small; at most the block size)")
    p.add_argument("--prompts", default=None, help="prompts one reply prefills, for the second table (default "
                                                   "1,2,4,8; 1,2,4 with --small; at most the largest batch)")
    p.add_argument("--prompt-len", type=int, default=None, help="feature rows of each prompt (default 128; 32 "
                                                                "with --small)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV capacity per session in tokens")
    p.add_argument("--reps", type=int, default=None, help="timed calls per point (default 50; 5 with --small)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = sorted(set(number_list(a.batches or ("1,4" if a.small else "1,4,16,32"), "--batches")))
    contexts = number_list(a.contexts or ("64,256" if a.small else "512,1024,1920"), "--contexts")
    rows = number_list(a.rows or ("1,4,8" if a.small else "1,4,16"), "--rows")
    reps = a.reps or (5 if a.small else 50)
    prompts = sorted(set(number_list(a.prompts or ("1,2,4" if a.small else "1,2,4,8"), "--prompts")))
    prompt_len = a.prompt_len or (32 if a.small else 128)
    max_seq = min(a.max_seq_len, 512) if a.small else a.max_seq_len
    block = draft_config(a.small, qwen3_8b_config(a.small)).block_size
    if not batches or min(batches) < 1:
        p.error("--batches must be positive")
    if max(contexts) + max(rows) > max_seq:
        p.error(f"contexts + rows must fit --max-seq-len {max_seq}")
    if max(rows) > block:
        p.error(f"at most {block} new rows per session per step (the block size)")
    if not prompts or min(prompts) < 1 or max(prompts) > max(batches) or not 0 < prompt_len <= max_seq:
        p.error(f"--prompts must be in [1, {max(batches)}] (the context slots) and --prompt-len in [1, {max_seq}]")

    t0 = time.perf_counter()
    eager, graphed = proposers(a.small, device, dtype, max_seq, batches)
    graphs = graphed.graphs
    weights = sum(t.numel() * t.element_size() for t in eager.draft.state_dict().values())
    weights += eager.lm_head.numel() * eager.lm_head.element_size()
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                 "block_size": eager.block_size, "max_seq_len": max_seq, "captured": graphs.capture,
                 "graphs": graphs.num_graphs, "batch_buckets": list(graphs.batch_buckets),
                 "kv_buckets": list(graphs.kv_buckets), "context_slots": eager.pool.num_slots - 1,
                 "setup_s": time.perf_counter() - t0, "capture_s": graphs.capture_s, "weight_bytes": weights,
                 "points": [], "prompt_points": []}
    if device.type == "cuda":
        bandwidth = measure_bandwidth(device, 2.0)
        res["read_TBps"] = bandwidth["read_TBps"]
        res["floor_ms"] = weights / bandwidth["read_TBps"] / 1e9
    for batch in batches:
        for context in contexts:
            for n in rows:
                bucket = graphs.select(batch, context)
                row = {"batch": batch, "context": context, "rows": n,
                       "bucket": "eager" if bucket is None else f"{bucket[0]}x{bucket[1]}"}
                for name, proposer in (("eager", eager), ("graph", graphed)):
                    timed = time_step(proposer, batch, context, n, reps, seed=batch + context + n)
                    row |= {f"{name}_{key}": value for key, value in timed.items()}
                    row[f"{name}_session_ms"] = timed["wall_ms"] / batch
                row["speedup"] = row["eager_wall_ms"] / row["graph_wall_ms"]
                res["points"].append(row)
                write_json(a.out_json, res)  # keep what is done even if the run is cut short
    for k in prompts:
        timed = time_prompts(eager, k, prompt_len, reps, seed=k)
        res["prompt_points"].append({"prompts": k, "prompt_len": prompt_len, **timed,
                                     "host_ratio": timed["apart_host_ms"] / timed["together_host_ms"]})
        write_json(a.out_json, res)
    print_table(res)
    write_json(a.out_json, res)
    return res


def print_table(res: dict) -> None:
    how = "captured CUDA graphs" if res["captured"] else "static-shape path run eagerly (no CUDA)"
    floor = f", weight floor {res['floor_ms']:.3f} ms" if "floor_ms" in res else ""
    print(f"\ndraft step, medians in ms ({res['device']}, {res['dtype']}, block {res['block_size']}, "
          f"{res['weight_bytes'] / 1e6:.1f} MB of weights{floor}); graph = {how}; /sess = wall / batch")
    cols = [("batch", "batch"), ("context", "context"), ("rows", "rows"), ("BxL", "bucket"),
            ("eager", "eager_wall_ms"), ("graph", "graph_wall_ms"), ("eager-dev", "eager_device_ms"),
            ("graph-dev", "graph_device_ms"), ("eager/sess", "eager_session_ms"), ("graph/sess", "graph_session_ms"),
            ("speedup", "speedup")]
    _rows(cols, res["points"])
    if res.get("prompt_points"):
        print("\na reply's prompts into new draft contexts, medians in ms: together = one take_prompts call, "
              "apart = one per session; host = the calls' own time, wall = with the device synchronised")
        _rows([("prompts", "prompts"), ("rows", "prompt_len"), ("together", "together_wall_ms"),
               ("apart", "apart_wall_ms"), ("tog-host", "together_host_ms"), ("apart-host", "apart_host_ms"),
               ("host ratio", "host_ratio")], res["prompt_points"])


def _rows(cols: list[tuple[str, str]], rows: list[dict]) -> None:
    print(" ".join(f"{h:>10}" for h, _ in cols))
    for r in rows:
        print(" ".join(f"{r[key]:10.3f}" if isinstance(r[key], float) else f"{str(r[key]):>10}" for _, key in cols))


if __name__ == "__main__":
    main(sys.argv[1:])
