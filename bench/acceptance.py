"""Acceptance length and speed of AR, chain and DDTree budgets on held-out prompts.

    python bench/acceptance.py --target models/default/target --draft models/default/draft
        [--prompts 16] [--max-new-tokens 128] [--device cpu] [--temperatures 0,1]
        [--budgets 4,8,16,32,64] [--projected] [--feature-wire model|fp8] [--presence-penalty X]
        [--frequency-penalty X] [--repetition-penalty X] [--out-json FILE] [--out-png FILE]

Prompts are the beginnings (first `--prompt-tokens` tokens) of the held-out standard-library
files that scripts/train_target.py wrote into TARGET/corpus.json (their first characters are
stored there, so the prompts do not depend on this machine's Python); without that file
the same held-out rule is applied to this interpreter's stdlib. For every prompt, every
mode runs back to back (so background load hits all modes alike) with `LocalEngine`;
temperature > 0 runs use seed `--seed + prompt index`. Reported per temperature and mode:
mean acceptance length (tokens per round, bonus included, averaged over prompts), tokens/s
(all tokens / all generation time), speed-up over AR, and at T=0 the fraction of prompts
whose output equals AR's token for token. The repetition penalty flags apply to every run (the
acceptance they cost shows against a run without them).

`--feature-wire fp8`: the drafts read the target's features rounded as a verifier started with
`--feature-wire fp8` sends them (`common.feature_wire`: packed, then unpacked by the drafter),
which the in-process link otherwise hands over as they are; the acceptance it costs shows
against a run without it. (The rounding is part of the target's forward here, inside its CUDA
graphs on a GPU.) `--projected`: the target applies the draft's fc + hidden_norm and the rows are
context rows, as the verifier service sends them given `--draft`; without it they are the raw
layer features, the draft's fc after them (and after the rounding).
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from common.devices import parse_device  # noqa: E402
from common.feature_wire import FORMATS, dequantize, pack_rows  # noqa: E402
from bench.bench_timing import number_list  # noqa: E402
from common.cli import add_penalty_flags, penalty_options  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from drafter_svc.drafter import DraftMode  # noqa: E402
from drafter_svc.generate import LocalEngine  # noqa: E402
from drafter_svc.session import GenerationConfig  # noqa: E402
from verifier_svc.target_model import TargetModel  # noqa: E402
from verifier_svc.tree_verifier import VerifierLimits  # noqa: E402


def heldout_texts(target_dir: Path) -> list[tuple[str, str]]:
    """(name, text) of the held-out files, in sorted order."""
    corpus = target_dir / "corpus.json"
    if corpus.is_file():
        heads = json.loads(corpus.read_text()).get("heldout_heads") or {}
        if heads:
            return sorted(heads.items())
    from scripts.train_target import corpus_files, read_texts, split_corpus

    _, heldout = split_corpus(corpus_files())
    return list(zip(heldout, read_texts(heldout)))


def load_prompts(target_dir: Path, tokenizer, n: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    prompts = []
    for name, text in heldout_texts(target_dir):
        ids = tokenizer.encode(text).ids[:prompt_tokens]
        if len(ids) >= min(8, prompt_tokens):
            prompts.append((name, ids))
        if len(prompts) == n:
            break
    return prompts


def as_sent(features: torch.Tensor) -> torch.Tensor:
    """`features` as the drafter's `unpack_rows` gives them back from `pack_rows` (without its
    check of the scales, a host read that a CUDA graph cannot hold)."""
    return dequantize(pack_rows(features), features.dtype)


@contextlib.contextmanager
def features_as_sent():
    """Within the block, target models built and run round their features with `as_sent`."""
    forward = TargetModel.forward

    def rounded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return dataclasses.replace(out, features=as_sent(out.features)) if out.features.shape[-1] else out

    TargetModel.forward = rounded
    try:
        yield
    finally:
        TargetModel.forward = forward


def mode_name(mode: DraftMode) -> str:
    return mode.kind if mode.kind != "tree" else f"tree{mode.budget}"


def run(engine: LocalEngine, prompts, modes, temperature: float, max_new: int, seed: int, log,
        penalties: dict[str, float] | None = None) -> dict:
    """Every mode on every prompt at one temperature, with the repetition penalties `penalties`
    (SamplingParams' names; none by default)."""
    per_mode = {mode_name(m): {"acc": [], "rounds": [], "tokens": 0, "elapsed": 0.0, "outputs": []} for m in modes}
    for i, (name, ids) in enumerate(prompts):
        sampling = SamplingParams(temperature, 0, 1.0, seed + i if temperature > 0 else None, **(penalties or {}))
        for mode in modes:
            res = engine.generate(ids, GenerationConfig(max_new, sampling, mode=mode))
            rec = per_mode[mode_name(mode)]
            rec["acc"].append(res.mean_acceptance)
            rec["rounds"].extend(res.acceptance_lengths)
            rec["tokens"] += len(res.tokens)
            rec["elapsed"] += res.elapsed_s
            rec["outputs"].append(res.tokens)
        log(f"  T={temperature:g} prompt {i + 1}/{len(prompts)} ({name}) done")
    ar = per_mode.get("ar")
    out = {}
    for name, rec in per_mode.items():
        tps = rec["tokens"] / rec["elapsed"] if rec["elapsed"] else 0.0
        # Two averages: over responses (the DDTree paper's tau) and over all rounds (tokens per verify).
        row = {"mean_acceptance": sum(rec["acc"]) / len(rec["acc"]),
               "mean_acceptance_per_round": sum(rec["rounds"]) / max(1, len(rec["rounds"])), "tokens_per_s": tps,
               "tokens": rec["tokens"], "elapsed_s": rec["elapsed"]}
        if ar is not None:
            ar_tps = ar["tokens"] / ar["elapsed"] if ar["elapsed"] else 0.0
            row["speedup_vs_ar"] = tps / ar_tps if ar_tps else 0.0
            if temperature == 0:
                row["equals_ar"] = sum(o == a for o, a in zip(rec["outputs"], ar["outputs"])) / len(rec["outputs"])
        out[name] = row
    return out


def print_table(results: dict) -> None:
    for temp, rows in results.items():
        print(f"\n{temp}")
        print(f"{'mode':>8} | {'mean acc':>8} | {'per round':>9} | {'tokens/s':>9} | {'vs AR':>6} | {'== AR':>6}")
        print("-" * 62)
        for name, r in rows.items():
            eq = f"{r['equals_ar']:.0%}" if "equals_ar" in r else ""
            print(f"{name:>8} | {r['mean_acceptance']:8.3f} | {r['mean_acceptance_per_round']:9.3f} | "
                  f"{r['tokens_per_s']:9.1f} | "
                  f"{r.get('speedup_vs_ar', 0):5.2f}x | {eq:>6}")


def plot(results: dict, budgets: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for color, (temp, rows) in zip(colors, results.items()):
        tree = [b for b in budgets if f"tree{b}" in rows]
        ax1.plot(tree, [rows[f"tree{b}"]["mean_acceptance"] for b in tree], "o-", color=color, label=f"DDTree {temp}")
        ax2.plot(tree, [rows[f"tree{b}"]["tokens_per_s"] for b in tree], "o-", color=color, label=f"DDTree {temp}")
        if "chain" in rows:
            ax1.axhline(rows["chain"]["mean_acceptance"], color=color, ls="--", lw=1, label=f"chain {temp}")
            ax2.axhline(rows["chain"]["tokens_per_s"], color=color, ls="--", lw=1, label=f"chain {temp}")
        if "ar" in rows:
            ax2.axhline(rows["ar"]["tokens_per_s"], color=color, ls=":", lw=1, label=f"AR {temp}")
    for ax, label in ((ax1, "mean acceptance length (tokens/round)"), (ax2, "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("tree budget (drafted nodes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="models/default/target",
                   help="target checkpoint folder (default the bundled one)")
    p.add_argument("--draft", default="models/default/draft", help="DFlash draft folder (default the bundled one)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens taken from the start of each held-out file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--device", default="auto",
                   help="torch device: auto (cuda when there is a GPU, else cpu), cpu, cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype (default float32)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    p.add_argument("--budgets", default="4,8,16,32,64", help="comma-separated DDTree budgets")
    p.add_argument("--no-ar", action="store_true", help="skip the AR baseline")
    p.add_argument("--no-chain", action="store_true", help="skip the chain")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the temperature > 0 runs (default 0)")
    p.add_argument("--projected", action="store_true",
                   help="the target projects its features (the draft's fc + hidden_norm), as the verifier service does")
    p.add_argument("--feature-wire", choices=tuple(FORMATS), default="model",
                   help="the drafts read the features as a verifier with this --feature-wire sends them")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    add_penalty_flags(p)
    p.add_argument("--out-json", default=None, help="write the summary here (its folder is made)")
    p.add_argument("--out-png", default=None, help="plot mean acceptance per budget here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    if min(a.prompts, a.prompt_tokens, a.max_new_tokens) < 1 or a.threads < 0:
        p.error("--prompts, --prompt-tokens and --max-new-tokens must be >= 1, --threads >= 0")
    try:
        a.device = str(parse_device(a.device))
    except ValueError as exc:
        p.error(f"--device: {exc}")
    if a.threads:
        torch.set_num_threads(a.threads)
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    budgets = number_list(a.budgets, "--budgets")
    temps = number_list(a.temperatures, "--temperatures", float)
    if any(b < 0 for b in budgets) or not all(t >= 0 for t in temps):
        p.error("--budgets and --temperatures must be >= 0")
    modes = ([] if a.no_ar else [DraftMode("ar", 0)]) + ([] if a.no_chain else [DraftMode("chain", 0)])
    modes += [DraftMode("tree", b) for b in budgets]

    with features_as_sent() if a.feature_wire == "fp8" else contextlib.nullcontext():
        summary = measure(a, modes, budgets, temps, log)
    if a.out_json:
        Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out_json).write_text(json.dumps(summary, indent=2))
    if a.out_png:
        Path(a.out_png).parent.mkdir(parents=True, exist_ok=True)
        plot(summary["results"], budgets, Path(a.out_png),
             f"{Path(a.draft).name} on {Path(a.target).name}: {len(summary['prompts'])} held-out prompts, "
             f"{a.max_new_tokens} new tokens, {a.device}")
    return summary


def measure(a: argparse.Namespace, modes: list[DraftMode], budgets: list[int], temps: list[float], log) -> dict:
    """Load the pair, run every mode on every prompt at every temperature, print the table."""
    engine = LocalEngine.load(a.target, a.draft, a.device, getattr(torch, a.dtype),
                              VerifierLimits(max_sessions=1, max_seq_len=a.prompt_tokens + a.max_new_tokens
                                             + max(budgets + [16]) + 64), projected=a.projected)
    prompts = load_prompts(Path(a.target), engine.tokenizer, a.prompts, a.prompt_tokens)
    if not prompts:
        print("error: no held-out prompts found", file=sys.stderr)
        raise SystemExit(2)
    log(f"{len(prompts)} held-out prompts of {a.prompt_tokens} tokens, {a.max_new_tokens} new tokens, "
        f"modes {[mode_name(m) for m in modes]}, torch threads {torch.get_num_threads()}")
    # Warm-up (allocations, first-call costs) so the first timed mode is not penalised.
    for mode in modes:
        engine.generate(prompts[0][1], GenerationConfig(8, SamplingParams(0.0), mode=mode))
    t0 = time.time()
    penalties = penalty_options(a)
    results = {f"T={t:g}": run(engine, prompts, modes, t, a.max_new_tokens, a.seed, log, penalties) for t in temps}
    print_table(results)
    return {"target": a.target, "draft": a.draft, "device": a.device, "dtype": a.dtype,
            "threads": torch.get_num_threads(), "projected": a.projected, "feature_wire": a.feature_wire,
            "penalties": penalties,
            "prompts": [n for n, _ in prompts],
            "prompt_tokens": a.prompt_tokens, "max_new_tokens": a.max_new_tokens, "budgets": budgets,
            "wall_s": round(time.time() - t0, 1), "results": results}


if __name__ == "__main__":
    main()
