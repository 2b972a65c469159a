"""The deterministic mode (`--deterministic`): how often greedy tree decoding equals plain
decoding, and what the batch-invariant kernels cost, against the default kernels.

    python3 bench/deterministic.py [--dims 8b|small] [--prompts 60] [--new-tokens 48] \
        [--budgets 0,16,64] [--concurrency 1,8,32] [--out-json FILE]

One random-weight target (Qwen3-8B dimensions, or toy ones; std-0.02 weights, so the greedy
margins are as thin as an untrained model's), in each mode in turn, in one process:

* **Reference:** plain greedy decoding of every prompt alone: its prefill, then one token per
  forward (batch 1, no padding), the target's own greedy decoding.
* **Trees:** the same prompts in waves of N concurrent sessions through the batched verify
  step (`TargetRunner.verify_batch`, CUDA graphs of batch buckets 1/8/32 and tree buckets
  0/16/64), each round's tree holding `budget` drafted nodes: a path that follows the
  reference continuation for a geometric number of nodes (`--accept-prob`) and random
  branches around it. Counted: sessions whose 48 tokens equal the reference's.
* **Cost:** the verify step's graph replay per (batch, tree) bucket (`measure_verify_costs`), and
  the GEMMs of the 8B shapes, batch-invariant Triton against cuBLAS, per number of rows.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.verify import qwen3_8b_config, random_target  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from bench.bench_timing import out_json
from common.tree import DraftTree, ancestor_masks, walk_trees  # noqa: E402
from ddtree_kernels import batch_invariant as bi  # noqa: E402
from verifier_svc.cuda_graphs import GraphConfig, VerifyRow  # noqa: E402
from verifier_svc.target_runner import TargetRunner  # noqa: E402

GREEDY = SamplingParams()


def log(message: str) -> None:
    print(f"[deterministic] {message}", file=sys.stderr, flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def oracle_tree(root: int, truth: list[int], budget: int, rng: np.random.Generator, vocab: int,
                accept_prob: float) -> DraftTree:
    """`budget` drafted nodes below `root`: first a chain along `truth` for a geometric number of
    nodes, then random nodes under random parents (siblings' tokens distinct)."""
    tokens, parents = [root], [-1]
    children: dict[int, set[int]] = {}
    while len(tokens) - 1 < min(budget, len(truth)) and rng.random() < accept_prob:
        children.setdefault(len(tokens) - 1, set()).add(truth[len(tokens) - 1])
        parents.append(len(tokens) - 1)
        tokens.append(truth[len(tokens) - 1])
    while len(tokens) - 1 < budget:
        parent = int(rng.integers(len(tokens)))
        token = int(rng.integers(vocab))
        if token in children.setdefault(parent, set()):
            continue
        children[parent].add(token)
        parents.append(parent)
        tokens.append(token)
    return DraftTree.from_parents(tokens, parents)


def plain_decode(runner: TargetRunner, prompt: torch.Tensor, n: int) -> list[int]:
    """Prefill alone, then one root-only tree (one token) per forward."""
    logits, _ = runner.prefill([0], [prompt])
    out = [int(logits[0].argmax())]
    past = prompt.shape[0]
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    while len(out) < n:
        tree = DraftTree.from_parents([out[-1]], [-1])
        batch = runner.verify_batch([VerifyRow(0, past, tree, np.zeros(1, dtype=np.int64), GREEDY,
                                               wants_features=False)], one)
        out.append(batch.bonus[0])
        past += 1
    return out


def tree_decode(runner: TargetRunner, prompts: list[torch.Tensor], references: list[list[int]], n: int,
                budget: int, accept_prob: float, seed: int) -> tuple[list[list[int]], float]:
    """All prompts as sessions of one wave (slots 0 .. len - 1); returns outputs and tokens per round."""
    vocab = runner.model.cfg.vocab_size
    rng = np.random.default_rng(seed)
    logits, _ = runner.prefill(list(range(len(prompts))), prompts)
    outs = [[int(x)] for x in logits.argmax(-1).tolist()]
    pasts = [p.shape[0] for p in prompts]
    rounds = emitted = 0
    while True:
        live = [i for i, o in enumerate(outs) if len(o) < n]
        if not live:
            break
        trees = [oracle_tree(outs[i][-1], references[i][len(outs[i]):], budget, rng, vocab, accept_prob) for i in live]
        layouts = walk_trees(trees, vocab_size=vocab, max_nodes=1 << 12, max_depth=1 << 12)
        masks = ancestor_masks(layouts, max(t.num_nodes for t in trees))
        rows = [VerifyRow(i, pasts[i], tree, lay.depths, GREEDY, wants_features=False)
                for i, tree, lay in zip(live, trees, layouts)]
        batch = runner.verify_batch(rows, masks)
        for i, accepted, bonus in zip(live, batch.accepted, batch.bonus):
            outs[i] += accepted + [bonus]
            pasts[i] += 1 + len(accepted)
            emitted += 1 + len(accepted)
        rounds += len(live)
    return [o[:n] for o in outs], emitted / max(1, rounds)


# Tile shapes the GEMM table also times (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), to choose `bi._tiles` from.
CANDIDATE_TILES = [(64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3)]


def gemm_table(cfg, rows: list[int], device: str, dtype: torch.dtype, reps: int = 20) -> list[dict]:
    """ms per GEMM, cuBLAS (F.linear) against the batch-invariant Triton GEMM (its tiles, and the
    candidates), at the target's shapes."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, h), "o_proj": (h, cfg.num_heads * cfg.head_dim), "gate_up": (2 * i, h),
              "down": (h, i), "lm_head": (cfg.vocab_size, h)}
    table = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            row = {"gemm": name, "M": m, "N": n, "K": k}
            candidates = [("cublas", lambda: F.linear(x, w)), ("invariant", lambda: bi.linear(x, w))]
            for bm, bn, bk, warps, stages in CANDIDATE_TILES:
                tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
                candidates.append((f"tiles {bm}x{bn}x{bk} w{warps} s{stages}",
                                   lambda tiles=tiles: bi.linear_triton(x, w, tiles=tiles)))
            for label, fn in candidates:
                fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                torch.cuda.synchronize()
                row[f"{label}_ms"] = start.elapsed_time(end) / reps
            row["ratio"] = row["invariant_ms"] / row["cublas_ms"]
            table.append(row)
        del w
    return table


def run_mode(model, deterministic: bool, a: argparse.Namespace, prompts: list[torch.Tensor]) -> dict:
    bi.set_enabled(deterministic)
    gc.collect()
    torch.cuda.empty_cache() if a.device == "cuda" else None
    config = GraphConfig(tree_buckets=tuple(sorted({0, *a.budgets})), batch_buckets=tuple(a.concurrency),
                         modes=("greedy",), max_kv_buckets=1)
    start = time.perf_counter()
    runner = TargetRunner(model, max(a.concurrency), a.prompt_len + a.new_tokens + 2, 1 + max(a.budgets),
                          cuda_graphs=a.device == "cuda", graph_config=config)
    setup_s = time.perf_counter() - start
    label = "deterministic" if deterministic else "default"
    log(f"{label}: runner ready in {setup_s:.1f} s ({runner.graphs.num_graphs if runner.graphs else 0} graphs)")
    start = time.perf_counter()
    references = [plain_decode(runner, p, a.new_tokens) for p in prompts]
    log(f"{label}: plain decoding of {len(prompts)} prompts in {time.perf_counter() - start:.1f} s")
    result = {"mode": label, "setup_s": setup_s, "runs": []}
    for budget in a.budgets:
        for n in a.concurrency:
            equal, per_round, start = 0, [], time.perf_counter()
            for wave in range(0, len(prompts), n):
                chunk = list(range(wave, min(wave + n, len(prompts))))
                outs, tau = tree_decode(runner, [prompts[i] for i in chunk], [references[i] for i in chunk],
                                        a.new_tokens, budget, a.accept_prob, a.seed + wave)
                equal += sum(o == references[i] for o, i in zip(outs, chunk))
                per_round.append(tau)
            row = {"budget": budget, "concurrency": n, "equal": equal, "prompts": len(prompts),
                   "tokens_per_round": float(np.mean(per_round)), "wall_s": time.perf_counter() - start}
            result["runs"].append(row)
            log(f"{label}: budget {budget}, N={n}: {equal}/{len(prompts)} equal plain decoding, "
                f"{row['tokens_per_round']:.2f} tokens per round")
    if runner.graphs is not None:
        costs = runner.measure_verify_costs(iters=5)
        result["verify_ms"] = {f"{b}x{t}": 1000 * s for (b, t), s in sorted(costs.items())}
    del runner
    bi.set_enabled(False)
    return result


def print_tables(res: dict) -> None:
    modes = {m["mode"]: m for m in res["modes"]}
    if len(modes) == 2:
        print_decode_tables(modes)
    if res.get("gemms"):
        print("\n| GEMM | M | N x K | cuBLAS ms | invariant ms | ratio | best candidate tiles |")
        print("|---|---|---|---|---|---|---|")
        for g in res["gemms"]:
            tiles = {k: v for k, v in g.items() if k.startswith("tiles")}
            best = min(tiles, key=tiles.get) if tiles else None
            extra = f"{best.removeprefix('tiles ').removesuffix('_ms')}: {tiles[best]:.4f}" if best else "-"
            print(f"| {g['gemm']} | {g['M']} | {g['N']} x {g['K']} | {g['cublas_ms']:.4f} | {g['invariant_ms']:.4f} | "
                  f"{g['ratio']:.2f} | {extra} |")


def print_decode_tables(modes: dict) -> None:
    print("\n| budget | N | default: equal plain | deterministic: equal plain | tokens/round (det) |")
    print("|---|---|---|---|---|")
    for d, r in zip(modes["default"]["runs"], modes["deterministic"]["runs"]):
        print(f"| {r['budget']} | {r['concurrency']} | {d['equal']}/{d['prompts']} | {r['equal']}/{r['prompts']} | "
              f"{r['tokens_per_round']:.2f} |")
    if "verify_ms" in modes["default"]:
        print("\n| verify step B x T | default ms | deterministic ms | ratio |")
        print("|---|---|---|---|")
        for key, ms in modes["default"]["verify_ms"].items():
            det = modes["deterministic"]["verify_ms"].get(key)
            if det is not None:
                print(f"| {key} | {ms:.3f} | {det:.3f} | {det / ms:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dims", choices=("8b", "small"), default="8b", help="Qwen3-8B dimensions or toy ones (CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model dtype")
    p.add_argument("--prompts", type=int, default=60, help="prompts (sessions) per setting (default 60)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--budgets", type=ints, default=[0, 16, 64], help="drafted nodes per tree (default 0,16,64)")
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32], help="sessions per wave (default 1,8,32)")
    p.add_argument("--accept-prob", type=float, default=0.8,
                   help="chance that each next node of a tree's main path is the reference's token (default 0.8)")
    p.add_argument("--gemm-rows", type=ints, default=[17, 65, 136, 272, 544, 2080],
                   help="row counts of the GEMM table (GPU only; default 17,65,136,272,544,2080)")
    p.add_argument("--parts", default="decode,gemm", help="decode (equality and verify steps) and/or gemm (GPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    cfg = qwen3_8b_config(small=a.dims == "small")
    parts = set(a.parts.split(","))
    res = {"bench": "deterministic", "argv": sys.argv[1:] if argv is None else argv, "options": vars(a),
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "modes": []}
    if "decode" in parts:
        torch.manual_seed(a.seed)
        model = random_target(cfg, (), torch.device(a.device), dtype, seed=a.seed)
        gen = torch.Generator().manual_seed(a.seed + 1)
        prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=gen) for _ in range(a.prompts)]
        for det in (False, True):
            res["modes"].append(run_mode(model, det, a, prompts))
            write(a.out_json, res)
        del model
        gc.collect()
    if "gemm" in parts and a.device == "cuda":
        torch.cuda.empty_cache()
        res["gemms"] = gemm_table(cfg, a.gemm_rows, a.device, dtype)
    print_tables(res)
    write(a.out_json, res)
    return res


def write(path: str | None, res: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
