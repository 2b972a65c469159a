"""Wall time of the batched DDTree selection (`drafter_svc.ddtree.select_ddtrees`) and of making its trees.

    PYTHONPATH=. python bench/tree_select.py [--sessions 1,16,32] [--budget 16] [--peak 0,6] [--reps 20]
                                             [--device cpu] [--vocab 256] [--out-json tree_select.json]
    PYTHONPATH=. python bench/tree_select.py --device cuda --vocab 151936   # host against device selection

Random block logits [S, 15, V] (by default a small vocabulary, so the top-k costs next to
nothing and what is timed is the selection), made peaked like a trained draft's: 5 tokens
raised by 8, and token 0 by `--peak` more (0: trees 5 to 8 levels deep; 6: deep chains, 12 to
15 levels, as the benchmark oracle makes them). Median wall time of `--reps` calls, top-k
and copies included. On a GPU each point runs twice: path "host" (the candidates copied back,
numpy selects) and "device" (`ddtree_kernels.ddtree_select`, only the trees copied back); on a CPU
the host path only.
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

import drafter_svc.ddtree as ddtree
from bench.bench_timing import number_list, out_json, write_json
from drafter_svc.ddtree import select_ddtrees
from ddtree_kernels.tree_sampling import kernel_backend

DEPTHS, VOCAB = 15, 256


def block_logits(sessions: int, peak: float, seed: int = 0, vocab: int = VOCAB, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sessions, DEPTHS, vocab, generator=generator) * 2
    logits[:, :, :5] += 8
    logits[:, :, 0] += peak
    return logits.to(device)


def select_on(path: str, logits: torch.Tensor, roots: list[int], budgets: list[int]) -> ddtree.DDTreeSelection:
    """`select_ddtrees` with the selection on the host ("host": no budget fits the device kernel) or as it
    chooses ("device")."""
    kept = ddtree.MAX_WIDTH
    ddtree.MAX_WIDTH = kept if path == "device" else -1
    try:
        return select_ddtrees(logits, roots, budgets)
    finally:
        ddtree.MAX_WIDTH = kept


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    p.add_argument("--sessions", default="1,16,32", help="sessions per call, comma-separated (default 1,16,32)")
    p.add_argument("--budget", type=int, default=16, help="drafted nodes per tree (default 16)")
    p.add_argument("--peak", default="0,6", help="how much token 0 is raised, comma-separated (default 0,6)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per point (default 20)")
    p.add_argument("--device", default="cpu", help="where the block logits are (default cpu)")
    p.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary of the block logits (default {VOCAB})")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    try:
        sessions = number_list(a.sessions, "--sessions")
        peaks = number_list(a.peak, "--peak", float)
    except ValueError:
        p.error("--sessions takes integers and --peak numbers, comma-separated")
    if not sessions or min(sessions) < 1 or a.budget < 1 or a.reps < 1 or not peaks or a.vocab < 1:
        p.error("--sessions, --budget, --reps and --vocab must be >= 1")
    paths = ["host", "device"] if kernel_backend(torch.device(a.device)) == "triton" else ["host"]
    rows = []
    print(f"{'path':>6} {'peak':>6} {'sessions':>9} {'select ms':>10} {'trees ms':>9} {'nodes':>6} {'depth':>6}")
    for peak in peaks:
        for s in sessions:
            logits = block_logits(s, peak, vocab=a.vocab, device=a.device)
            roots, budgets = [1] * s, [a.budget] * s
            for path in paths:
                selection = select_on(path, logits, roots, budgets)
                depth = max(_depth(selection.parents[i, :selection.num_nodes[i]]) for i in range(s))
                select_ms = median_ms(lambda: select_on(path, logits, roots, budgets), a.reps)
                trees_ms = median_ms(selection.trees, a.reps)
                rows.append({"path": path, "peak": peak, "sessions": s, "budget": a.budget, "select_ms": select_ms,
                             "trees_ms": trees_ms, "nodes": int(selection.num_nodes.mean()), "max_depth": depth})
                print(f"{path:>6} {peak:6g} {s:9d} {select_ms:10.3f} {trees_ms:9.3f} {rows[-1]['nodes']:6d} {depth:6d}")
    res = {"device": a.device, "torch": torch.__version__, "depths": DEPTHS, "vocab": a.vocab, "reps": a.reps,
           "rows": rows}
    write_json(a.out_json, res)
    return res


def _depth(parents) -> int:
    """The deepest node's depth in one tree (parents: node indices, -1 for the root)."""
    depths = [0] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0:
            depths[i] = depths[parent] + 1
    return max(depths)


if __name__ == "__main__":
    main(sys.argv[1:])
