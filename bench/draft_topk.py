"""The drafter's candidates: torch.topk over log_softmax against the one-pass Triton top-k (ddtree_kernels/draft_topk.py).

    PYTHONPATH=. python bench/draft_topk.py [--batches 1,4,16,32] [--ks 16,64] [--out-json draft_topk.json]
    PYTHONPATH=. python bench/draft_topk.py --small      # toy sizes, runs on CPU too (Triton interpreted)

Random bf16 block logits [B, 15, V] (V = 151,936, Qwen3's vocabulary), as the drafter's tree
build takes them: per B and k, the time per call of `top_logprobs_reference` and
`top_logprobs_triton` (CUDA events around back-to-back calls; where the launches' host time
exceeds the device time, that is what it shows), whether both take the same logit values
(ties may pick other tokens of the same value) and their largest log-prob difference; then
the host wall time of `drafter_svc.ddtree.top_candidates` (the dispatch, the copy to the
host) and of the whole batched tree build (`build_trees`, budget 16): medians, synchronised
after each call. Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton pass runs interpreted on the CPU

from bench.bench_timing import device_ms, number_list, out_json, wall_ms, write_json
from drafter_svc.ddtree import top_candidates
from drafter_svc.drafter import DraftMode, build_trees
from ddtree_kernels.draft_topk import top_logprobs_reference, top_logprobs_triton

DEPTHS = 15


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default=None, help="comma-separated sessions B (default 1,4,16,32; 1,2 with --small)")
    p.add_argument("--ks", default=None, help="comma-separated k (default 16,64; 4 with --small)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 151936; 1024 with --small)")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 50 on GPU, 3 on CPU)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    vocab = a.vocab or (1024 if a.small else 151_936)
    batches = number_list(a.batches, "--batches") if a.batches else ([1, 2] if a.small else [1, 4, 16, 32])
    ks = number_list(a.ks, "--ks") if a.ks else ([4] if a.small else [16, 64])
    reps = a.reps or (50 if cuda else 3)
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "vocab": vocab, "depths": DEPTHS, "rows": []}
    print(f"# draft top-k bench on {res['device']}, vocab {vocab}, {DEPTHS} depths per session", flush=True)
    for batch in batches:
        gen = torch.Generator(device=device).manual_seed(batch)
        logits = (torch.randn(batch, DEPTHS, vocab, generator=gen, device=device) * 3).to(torch.bfloat16)
        for k in ks:
            want_logq, want_tokens = top_logprobs_reference(logits, k)
            got_logq, got_tokens = top_logprobs_triton(logits, k)
            row = {"batch": batch, "rows": batch * DEPTHS, "k": k,
                   "same_values": bool(torch.equal(logits.gather(-1, got_tokens), logits.gather(-1, want_tokens))),
                   "max_logq_diff": float((got_logq - want_logq).abs().max()),
                   "reference_us": 1e3 * device_ms(lambda: top_logprobs_reference(logits, k), device, reps),
                   "triton_us": 1e3 * device_ms(lambda: top_logprobs_triton(logits, k), device, reps),
                   "top_candidates_wall_us": 1e3 * wall_ms(lambda: top_candidates(logits, k), device, reps)}
            if k == ks[0]:
                modes = [DraftMode("tree", k)] * batch
                row["build_trees_wall_us"] = 1e3 * wall_ms(
                    lambda: build_trees(modes, logits, [0] * batch, [10**6] * batch), device, reps)
            res["rows"].append(row)
            print("  " + "  ".join(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}"
                                   for key, v in row.items()), flush=True)
            write_json(a.out_json, res)
    print(f"\n{'B':>4} {'rows':>5} {'k':>4} {'reference us':>13} {'triton us':>10} {'same':>5} "
          f"{'top_candidates us':>18} {'build_trees us':>15}")
    for r in res["rows"]:
        build = f"{r['build_trees_wall_us']:15.1f}" if "build_trees_wall_us" in r else f"{'-':>15}"
        print(f"{r['batch']:>4} {r['rows']:>5} {r['k']:>4} {r['reference_us']:13.1f} {r['triton_us']:10.1f} "
              f"{str(r['same_values']):>5} {r['top_candidates_wall_us']:18.1f} {build}")
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
