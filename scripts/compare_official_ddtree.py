"""Compare the engine with the official DDTree code (github.com/liranringel/ddtree) on a pair.

    python scripts/compare_official_ddtree.py SNAPSHOT_PATH [--target models/default/target]
        [--draft models/default/draft] [--prompts 8] [--prompt-tokens 64] [--max-new-tokens 96]
        [--budget 16] [--threads 2] [--out-json FILE]

SNAPSHOT_PATH is a copy of that repository (its `ddtree.py`, `dflash.py` and `model/`). Not part
of CI: the official code is not shipped here. Both sides run greedy, float32, on the CPU, on
the held-out prompts `bench/acceptance.py` uses, with no stop tokens (every run generates
`--max-new-tokens` tokens):

- reference: the official `dflash_generate` (chain, vanilla DFlash) and `ddtree_generate`
  (`tree_budget=--budget`), the target loaded with transformers (SDPA, which takes the
  official 4D tree mask), the draft with the official `DFlashDraftModel` class straight from
  the z-lab-format folder (the same tensor names) with SDPA instead of FlashAttention. Three
  adapters, none touching the algorithm: the official timer calls `torch.cuda.synchronize`, a
  plain clock replaces it; its `DynamicCache.crop(n)` means "keep the first n positions" (the
  transformers 4 meaning; transformers 5 refuses a positive n), a subclass restores that;
  `datasets` and `loguru`, used only by its benchmark and logging, are stubbed when missing.
- ours: `LocalEngine` with `--chain` and `--tree-budget`.

Per mode it reports the prompts whose generated tokens are identical and the fraction of the
reference's rounds whose acceptance length (tokens per round, bonus included) ours equals.
Rounds are matched by where they start (the offset of their root token): a reference round
counts as equal when ours has a round starting at the same offset with the same length. Only
rounds that start with room for a full draft count (block_size - 1 chain tokens, or `budget`
tree nodes, plus the bonus, before `--max-new-tokens`): the reference drafts a full block even
at the length limit, ours drafts only what fits. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from acceptance import load_prompts  # noqa: E402
from common.config import load_draft_config  # noqa: E402
from drafter_svc.drafter import DraftMode  # noqa: E402
from drafter_svc.generate import LocalEngine  # noqa: E402
from drafter_svc.session import GenerationConfig  # noqa: E402
from verifier_svc.tree_verifier import VerifierLimits  # noqa: E402


@dataclasses.dataclass
class Official:
    """The official entry points and model class, loaded from a snapshot."""
    dflash_generate: object
    ddtree_generate: object
    draft_class: type


@dataclasses.dataclass
class Run:
    tokens: list[int]
    acceptance_lengths: list[int]


def _stub_if_missing(name: str, **attrs) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("stubbed: not needed for this comparison")


def legacy_crop_cache_class():
    """DynamicCache whose crop(n) keeps the first n positions of every layer (n < 0: drops -n)."""
    from transformers import DynamicCache

    class LegacyCropCache(DynamicCache):
        def crop(self, max_length: int) -> None:
            for layer in self.layers:
                length = layer.get_seq_length()
                keep = max_length if max_length >= 0 else length + max_length
                if length > keep:
                    layer.crop(keep - length)

    return LegacyCropCache


def load_official(snapshot: Path) -> Official:
    """Import the snapshot's code without letting it shadow anything: its top-level `ddtree.py`
    is loaded under another name, so that it cannot be mistaken for anything named `ddtree`."""
    for name in ("ddtree.py", "dflash.py", "model/dflash.py", "model/utils.py"):
        if not (snapshot / name).is_file():
            sys.exit(f"{snapshot} is not a DDTree snapshot: {name} is missing")
    _stub_if_missing("datasets", load_dataset=_unavailable, Features=_unavailable, Sequence=_unavailable,
                     Value=_unavailable)
    _stub_if_missing("loguru", logger=logging.getLogger("official_ddtree"))
    sys.path.append(str(snapshot))
    model_pkg = importlib.import_module("model")
    dflash_mod = importlib.import_module("dflash")
    for mod in (model_pkg, dflash_mod):
        if snapshot.resolve() not in Path(mod.__file__).resolve().parents:
            sys.exit(f"module {mod.__name__} came from {mod.__file__}, not from the snapshot")
    spec = importlib.util.spec_from_file_location("official_ddtree", snapshot / "ddtree.py")
    ddtree_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddtree_mod)
    cache_class = legacy_crop_cache_class()
    for mod in (dflash_mod, ddtree_mod):
        mod.cuda_time = time.perf_counter  # CPU: no CUDA to synchronise with
        mod.DynamicCache = cache_class
    return Official(dflash_mod.dflash_generate, ddtree_mod.ddtree_generate, model_pkg.DFlashDraftModel)


def load_reference_models(official: Official, target_dir: str, draft_dir: str):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = official.draft_class.from_pretrained(draft_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours = load_draft_config(draft_dir)
    if list(draft.target_layer_ids) != list(ours.target_layer_ids) or draft.block_size != ours.block_size:
        sys.exit(f"the official class read layers {draft.target_layer_ids}, block {draft.block_size}; "
                 f"the engine reads {list(ours.target_layer_ids)}, block {ours.block_size}")
    return target, draft


def run_reference(official: Official, target, draft, prompt: list[int], max_new: int, budget: int | None) -> Run:
    kwargs = dict(model=draft, target=target, input_ids=torch.tensor([prompt]), mask_token_id=draft.mask_token_id,
                  max_new_tokens=max_new, block_size=draft.block_size, stop_token_ids=None, temperature=0.0)
    if budget is None:
        out = official.dflash_generate(**kwargs)
    else:
        out = official.ddtree_generate(**kwargs, tree_budget=budget)
    tokens = out.output_ids[0, out.num_input_tokens:].tolist()
    return Run(tokens[:max_new], [int(a) for a in out.acceptance_lengths])


def run_ours(engine: LocalEngine, prompt: list[int], max_new: int, budget: int | None) -> Run:
    mode = DraftMode("chain", 0) if budget is None else DraftMode("tree", budget)
    out = engine.generate(prompt, GenerationConfig(max_new, mode=mode))
    return Run(list(out.tokens), list(out.acceptance_lengths))


def round_starts(acceptance_lengths: list[int]) -> dict[int, int]:
    """Offset of each round's root token (the first generated token is offset 0) -> its length."""
    starts, offset = {}, 0
    for length in acceptance_lengths:
        starts[offset] = length
        offset += length
    return starts


def compare_rounds(ref: Run, ours: Run, max_new: int, needed: int) -> dict:
    """Reference rounds with room for a full draft (`needed` drafted tokens plus the bonus after
    the root), and how many of them ours matches (same start, same length)."""
    mine = round_starts(ours.acceptance_lengths)
    counted = [(s, n) for s, n in round_starts(ref.acceptance_lengths).items() if s + 1 + needed + 1 <= max_new]
    equal = sum(mine.get(s) == n for s, n in counted)
    unaligned = sum(s not in mine for s, _ in counted)
    return {"rounds": len(counted), "equal": equal, "unaligned": unaligned}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", type=Path, help="copy of github.com/liranringel/ddtree")
    p.add_argument("--target", default=str(ROOT / "models/default/target"),
                   help="target checkpoint folder (default the bundled one)")
    p.add_argument("--draft", default=str(ROOT / "models/default/draft"),
                   help="DFlash draft checkpoint folder (default the bundled one)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens taken from the start of each held-out file")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--budget", type=int, default=16, help="DDTree budget of the tree mode")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out-json", default=None, help="write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated", category=FutureWarning)
    torch.manual_seed(0)

    official = load_official(a.snapshot)
    target, draft = load_reference_models(official, a.target, a.draft)
    max_seq_len = a.prompt_tokens + a.max_new_tokens + a.budget + 2 * draft.block_size
    limits = VerifierLimits(max_sessions=1, max_seq_len=max_seq_len)
    engine = LocalEngine.load(a.target, a.draft, "cpu", torch.float32, limits)
    engine = dataclasses.replace(engine, eos_token_ids=())  # no stop tokens, as the reference runs
    prompts = load_prompts(Path(a.target), engine.tokenizer, a.prompts, a.prompt_tokens)
    if not prompts:
        sys.exit(f"no held-out prompts for {a.target}")

    modes = {"chain": None, f"tree{a.budget}": a.budget}
    results: dict = {}
    for name, budget in modes.items():
        needed = draft.block_size - 1 if budget is None else budget
        rows = []
        for prompt_name, ids in prompts:
            ref = run_reference(official, target, draft, ids, a.max_new_tokens, budget)
            ours = run_ours(engine, ids, a.max_new_tokens, budget)
            rows.append({"prompt": prompt_name, "same_tokens": ref.tokens == ours.tokens,
                         **compare_rounds(ref, ours, a.max_new_tokens, needed),
                         "reference_acceptance": ref.acceptance_lengths, "our_acceptance": ours.acceptance_lengths,
                         "reference_mean": mean(ref.acceptance_lengths), "our_mean": mean(ours.acceptance_lengths)})
            print(f"  {name:>7} {prompt_name}: same tokens {rows[-1]['same_tokens']}, rounds equal "
                  f"{rows[-1]['equal']}/{rows[-1]['rounds']}", flush=True)
        rounds = sum(r["rounds"] for r in rows)
        results[name] = {
            "same_tokens": sum(r["same_tokens"] for r in rows), "prompts": len(rows),
            "rounds": rounds, "rounds_equal": sum(r["equal"] for r in rows),
            "rounds_unaligned": sum(r["unaligned"] for r in rows),
            "equal_fraction": sum(r["equal"] for r in rows) / rounds if rounds else 0.0,
            "reference_mean_acceptance": mean(r["reference_mean"] for r in rows),
            "our_mean_acceptance": mean(r["our_mean"] for r in rows),
            "per_prompt": rows,
        }

    print()
    print("| mode | same tokens | rounds with equal acceptance | unaligned rounds | "
          "mean acceptance (official / ours) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['same_tokens']}/{r['prompts']} | {r['rounds_equal']}/{r['rounds']} "
              f"({r['equal_fraction']:.1%}) | {r['rounds_unaligned']} | "
              f"{r['reference_mean_acceptance']:.3f} / {r['our_mean_acceptance']:.3f} |")
    report = {"target": a.target, "draft": a.draft, "target_layer_ids": list(draft.target_layer_ids),
              "block_size": draft.block_size, "prompts": a.prompts, "prompt_tokens": a.prompt_tokens,
              "max_new_tokens": a.max_new_tokens, "budget": a.budget, "torch": torch.__version__,
              "transformers": importlib.import_module("transformers").__version__, "results": results}
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.out_json}")
    return report


if __name__ == "__main__":
    main()
