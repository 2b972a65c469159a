"""Sampling + accept stage of a verify round: the fused Triton stage vs the PyTorch references.

    PYTHONPATH=. python bench/kernels.py [--batches 1,2,4,8,16,32] [--trees 16,32,64,128] [--out-json k.json]
    PYTHONPATH=. python bench/kernels.py --small        # toy sizes, runs on CPU too

For each batch B and tree of T = 1 + N nodes over a vocabulary of 151,936, on random bf16
target logits [B, T, V] and random trees:

* sample:      temperature 0.8, top-k 50, top-p 0.9, then target-only tree sampling
* sample-p:    the same with top-p 0.9 alone (on these logits its head is longer than the
               candidates the stage keeps per chunk, so every row takes the radix search)
* sample-temp: the same with temperature only (no top-k / top-p filter)
* greedy:      argmax, then greedy tree verification

each with its output buffers allocated as the verifier does (left unset: the stage writes them), run by
ddtree_kernels/fused_accept.py: tree_accept_triton (which never materialises the probabilities)
and tree_accept_reference (the plain PyTorch references composed). Times: the eager Triton
stage (device time), the stage captured in a CUDA graph (device time of a replay), and the
reference (slow, so only where B * T is small and with few repetitions). The yardstick is
reading the logits once: bytes / read bandwidth measured in this run (a sum over a 2 GiB
bf16 tensor). Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs ddtree_kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse

import numpy as np
import torch

from bench.bench_timing import device_ms, measure_bandwidth, number_list, out_json, write_json
from common.tree import DraftTree
from ddtree_kernels.fused_accept import tree_accept_reference, tree_accept_triton
from tests.reference import distinct_sibling_tokens

VOCAB = 151_936
STAGES = ("sample", "sample-p", "sample-temp", "greedy")


def random_trees(rng: np.random.Generator, batch: int, nodes: int, vocab: int, depth: int = 15):
    """Batched retrieve buffers [B, T] of random DDTree-like trees (depth <= `depth`)."""
    tokens, next_token, next_sibling = [], [], []
    for _ in range(batch):
        parents, depths = [-1], [0]
        for i in range(1, nodes):
            open_nodes = [j for j in range(max(0, i - 6), i) if depths[j] < depth] or \
                [j for j in range(i) if depths[j] < depth]  # the root always qualifies
            parent = int(open_nodes[int(rng.integers(len(open_nodes)))])
            parents.append(parent)
            depths.append(depths[parent] + 1)
        tree = DraftTree.from_parents(distinct_sibling_tokens(rng, parents, vocab), parents)
        tokens.append(tree.tokens)
        next_token.append(tree.next_token)
        next_sibling.append(tree.next_sibling)
    return torch.stack(tokens), torch.stack(next_token), torch.stack(next_sibling)


class Stage:
    """One batch of trees with its logits; `run(stage, impl)` runs the whole stage once with
    impl = tree_accept_triton or tree_accept_reference."""

    def __init__(self, batch: int, nodes: int, vocab: int, device, seed: int):
        rng = np.random.default_rng(seed)
        self.batch, self.nodes, self.device = batch, nodes, device
        cand, nt, ns = random_trees(rng, batch, nodes, vocab)
        self.candidates, self.next_token, self.next_sibling = cand.to(device), nt.to(device), ns.to(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.logits = (torch.randn(batch, nodes, vocab, generator=gen, device=device) * 3).to(torch.bfloat16)
        # Make the drafted tokens likely under the target, so walks go deep sometimes.
        rows = torch.arange(batch, device=device)[:, None]
        parent_rows = torch.where(self.next_token >= 0, self.next_token, 0)
        self.logits[rows, torch.arange(nodes, device=device)[None], self.candidates.gather(1, parent_rows)] += 8.0
        self.coins = torch.rand(batch, nodes, generator=gen, device=device)
        self.final = torch.rand(batch, generator=gen, device=device)
        # (temperature, top_k, top_p) per tree of each sampling stage.
        self.filters = {stage: (torch.full((batch,), t, device=device),
                                torch.full((batch,), k, dtype=torch.int64, device=device),
                                torch.full((batch,), p, device=device))
                        for stage, (t, k, p) in (("sample", (0.8, 50, 0.9)), ("sample-p", (0.8, 0, 0.9)),
                                                 ("sample-temp", (0.8, 0, 1.0)))}

    def run(self, stage: str, impl):
        b, t = self.batch, self.nodes
        dev = self.device
        # Left unset, as the verifier leaves them: the stage writes every entry.
        predicts = torch.empty(b * t, dtype=torch.int32, device=dev)
        accept_index = torch.empty((b, t), dtype=torch.int32, device=dev)
        accept_num = torch.empty(b, dtype=torch.int32, device=dev)
        temperature, top_k, top_p = self.filters.get(stage, (None, None, None))
        impl(self.logits, self.candidates, self.next_token, self.next_sibling, predicts, accept_index, accept_num,
             greedy=stage == "greedy", coins=self.coins, final_coins=self.final, temperature=temperature,
             top_k=top_k, top_p=top_p, filters=stage in ("sample", "sample-p"))
        return predicts, accept_index, accept_num


def graphed(fn, device):
    """Capture fn() in a CUDA graph (warm-up on a side stream first); returns the replay function."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--trees", default=None, help="drafted nodes per tree (default 16,32,64,128)")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {VOCAB})")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 30 on GPU, 3 on CPU)")
    p.add_argument("--ref-max-rows", type=int, default=None,
                   help="time the PyTorch reference only where B * T <= this (default 129; it is slow)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    vocab = a.vocab or (2048 if a.small else VOCAB)
    batches = number_list(a.batches, "--batches") if a.batches else ([1, 2] if a.small else [1, 2, 4, 8, 16, 32])
    trees = number_list(a.trees, "--trees") if a.trees else ([8, 16] if a.small else [16, 32, 64, 128])
    reps = a.reps or (30 if cuda else 3)
    ref_max_rows = a.ref_max_rows if a.ref_max_rows is not None else 129
    triton_ok = cuda or os.environ.get("TRITON_INTERPRET") == "1"

    bw = measure_bandwidth(device, 2.0 if cuda else 0.05)["read_TBps"] * 1e12
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "vocab": vocab, "read_TBps": bw / 1e12, "rows": []}
    print(f"# kernels bench on {res['device']}, vocab {vocab}, read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for batch in batches:
        for budget in trees:
            nodes = 1 + budget
            st = Stage(batch, nodes, vocab, device, seed=batch * 1000 + nodes)
            logits_bytes = st.logits.numel() * 2
            read_ms = logits_bytes / bw * 1e3
            for stage in STAGES:
                row = {"batch": batch, "tokens": nodes, "stage": stage, "logits_MB": logits_bytes / 1e6,
                       "read_once_ms": read_ms}
                if triton_ok:
                    row["fused_ms"] = device_ms(lambda: st.run(stage, tree_accept_triton), device, reps, budget_ms=150)
                    if cuda:
                        replay = graphed(lambda: st.run(stage, tree_accept_triton), device)
                        row["fused_graph_ms"] = device_ms(replay, device, reps, budget_ms=150)
                    row["fused_over_read"] = row.get("fused_graph_ms", row["fused_ms"]) / read_ms
                if batch * nodes <= ref_max_rows:
                    row["reference_ms"] = device_ms(lambda: st.run(stage, tree_accept_reference), device, min(reps, 3),
                                                    warmup=1, budget_ms=150)
                    if triton_ok:  # they must agree (greedy exactly; sampling up to float rounding)
                        want = [x.cpu() for x in st.run(stage, tree_accept_reference)]
                        got = st.run(stage, tree_accept_triton)
                        row["fused_same"] = all(torch.equal(x.cpu(), y) for x, y in zip(got, want))
                res["rows"].append(row)
                write_json(a.out_json, res)  # keep what is done even if the run is cut short
                print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)
            del st
    print_table(res)
    write_json(a.out_json, res)
    return res


def print_table(res: dict) -> None:
    print(f"\nsampling + accept stage, vocab {res['vocab']} ({res['device']}); ms; read-once = logits bytes / "
          f"{res['read_TBps']:.2f} TB/s; fused = ddtree_kernels/fused_accept.py's Triton stage, fused-x-read = its best "
          "time / read-once")
    head = ("batch", "tokens", "stage", "MB", "read-once", "fused", "fused-graph", "fused-x-read", "reference",
            "fused-same")
    print(" ".join(f"{h:>11}" for h in head))
    for r in res["rows"]:
        vals = (r["batch"], r["tokens"], r["stage"], r["logits_MB"], r["read_once_ms"], r.get("fused_ms"),
                r.get("fused_graph_ms"), r.get("fused_over_read"), r.get("reference_ms"), r.get("fused_same", "-"))
        print(" ".join(f"{'-':>11}" if v is None else f"{v:11.4f}" if isinstance(v, float) else f"{str(v):>11}"
                       for v in vals))


if __name__ == "__main__":
    main(sys.argv[1:])
