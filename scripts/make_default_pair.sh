#!/usr/bin/env bash
# Make the shipped default model pair end to end:
#   1. scripts/train_target.py     small Qwen3 code model trained from scratch on the stdlib
#   2. drafter_svc.train --generate  the target's greedy continuations of held-in prompts
#   3. drafter_svc.train             DFlash draft trained on them (+ held-out engine evaluation)
#   4. bench/acceptance.py           held-out acceptance / tokens/s table, JSON and PNG (CPU)
# and write $PAIR_OUT/{target,draft}, $PAIR_OUT/logs/ and $PAIR_OUT/README.md (how the pair was made).
#
#   bash scripts/make_default_pair.sh                    # one CUDA GPU: about 5 minutes
#   DRAFT_ONLY=1 bash scripts/make_default_pair.sh       # keep $PAIR_OUT/target, retrain the draft
#   STEPS_TARGET=20 STEPS_DRAFT=20 TINY=1 bash scripts/make_default_pair.sh   # CPU smoke run
#
# Environment (defaults in brackets):
#   PAIR_OUT [models/default; build/tiny_pair with TINY=1]   WORK [build/default_pair(_tiny)]
#   TINY [0]  tiny model sizes and data, for a CPU check of the pipeline
#   DRAFT_ONLY [0]  skip step 1: keep the target already in $PAIR_OUT/target (its train_log.json,
#                   logs/train_target.log and the command in $PAIR_OUT/README.md)
#   DEVICE [cuda if available else cpu]   PY [.venv/bin/python, else python3]
#   STEPS_TARGET [800]   TIME_TARGET [60 s]    target optimizer steps / wall-clock cap
#   STEPS_DRAFT [6000]   TIME_DRAFT [160 s]    draft optimizer steps / wall-clock cap
#   BLOCK [8]  DRAFT_LAYERS [2]  TARGET_LAYER_IDS [auto]  LR_DRAFT [1e-3]
#   (auto: DFlash's build_target_layer_ids, DRAFT_LAYERS ids spread evenly from 1 to L-3: [1, 3]
#   for the 6-layer target; [0, 3] for TINY's 4-layer one, too shallow for that rule. Feature
#   id l is transformers' hidden_states[l + 1], the last layer's after the final norm.)
#   GEN_PROMPTS [16384]  GEN_TOKENS [256]  GEN_BATCH [1024]
#   BENCH [1]  BENCH_PROMPTS [8]  BENCH_TOKENS [128]  BENCH_THREADS [2]  BENCH_TEMPS [0]
# Training stops at the step count or the time cap, whichever comes first; the learning-rate
# schedule follows whichever is further along, so a slower machine trains fewer steps but
# still finishes on time.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

TINY=${TINY:-0}
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEVICE=${DEVICE:-$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
if [[ "$TINY" == 1 ]]; then
  PAIR_OUT=${PAIR_OUT:-build/tiny_pair}
  WORK=${WORK:-build/default_pair_tiny}
  TARGET_SIZE=(--max-files 40 --vocab 1024 --hidden 64 --layers 4 --heads 4 --kv-heads 2 --head-dim 16
               --intermediate 192 --batch 8 --seq-len 128 --eval-every 10 --eval-windows 8 --log-every 10)
  DRAFT_SIZE=(--batch 8 --seq-len 128 --anchors 16 --log-every 5 --save-every 10
              --eval-prompts 3 --eval-tokens 24 --eval-prompt-len 32)
  GEN=(--gen-prompts "${GEN_PROMPTS:-64}" --gen-tokens "${GEN_TOKENS:-48}" --gen-prompt-len 32
       --gen-batch "${GEN_BATCH:-32}")
  TARGET_LAYER_IDS=${TARGET_LAYER_IDS:-auto}
  BLOCK=${BLOCK:-8}
  BENCH_ARGS=(--prompts "${BENCH_PROMPTS:-2}" --max-new-tokens "${BENCH_TOKENS:-24}" --prompt-tokens 32)
else
  PAIR_OUT=${PAIR_OUT:-models/default}
  WORK=${WORK:-build/default_pair}
  TARGET_SIZE=(--vocab 4096 --hidden 256 --layers 6 --heads 8 --kv-heads 4 --head-dim 32
               --intermediate 768 --batch 128 --seq-len 512 --lr 2e-3 --eval-every 250 --log-every 100)
  DRAFT_SIZE=(--batch 64 --seq-len 320 --anchors 48 --log-every 50 --save-every 1000
              --eval-prompts 16 --eval-tokens 128 --eval-prompt-len 64)
  GEN=(--gen-prompts "${GEN_PROMPTS:-16384}" --gen-tokens "${GEN_TOKENS:-256}" --gen-prompt-len 64
       --gen-batch "${GEN_BATCH:-1024}")
  TARGET_LAYER_IDS=${TARGET_LAYER_IDS:-auto}
  BLOCK=${BLOCK:-8}
  BENCH_ARGS=(--prompts "${BENCH_PROMPTS:-8}" --max-new-tokens "${BENCH_TOKENS:-128}" --prompt-tokens 64)
fi
STEPS_TARGET=${STEPS_TARGET:-800}
STEPS_DRAFT=${STEPS_DRAFT:-6000}
TIME_TARGET=${TIME_TARGET:-60}
TIME_DRAFT=${TIME_DRAFT:-160}
DRAFT_ONLY=${DRAFT_ONLY:-0}
DRAFT_LAYERS=${DRAFT_LAYERS:-2}
LR_DRAFT=${LR_DRAFT:-1e-3}
BENCH=${BENCH:-1}
SEED=${SEED:-0}
LOGS="$PAIR_OUT/logs"
mkdir -p "$PAIR_OUT/target" "$PAIR_OUT/draft" "$LOGS" "$WORK"
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

stamp "device $DEVICE, out $PAIR_OUT, work $WORK, tiny $TINY, draft only $DRAFT_ONLY"
if [[ "$DRAFT_ONLY" == 1 ]]; then
  if [[ ! -f "$PAIR_OUT/target/train_log.json" ]]; then
    echo "DRAFT_ONLY=1 needs a target made by this script in $PAIR_OUT/target" >&2; exit 1
  fi
  # The command that made the kept target, from the README of the run that made it.
  TARGET_CMD=("$(grep -m1 -o '[^ ]*python[^ ]* scripts/train_target.py .*' "$PAIR_OUT/README.md" 2>/dev/null \
                 || echo "scripts/train_target.py (command not recorded)")")
  stamp "1/4 keep the target in $PAIR_OUT/target: ${TARGET_CMD[*]}"
else
  TARGET_CMD=($PY scripts/train_target.py --out "$PAIR_OUT/target" --device "$DEVICE" --seed "$SEED"
              --steps "$STEPS_TARGET" --time-budget "$TIME_TARGET" "${TARGET_SIZE[@]}")
  stamp "1/4 train the target: ${TARGET_CMD[*]}"
  "${TARGET_CMD[@]}" 2>&1 | tee "$LOGS/train_target.log"
fi

MAX_FILES=()
if [[ "$TINY" == 1 ]]; then MAX_FILES=(--max-files 40); fi
$PY scripts/train_target.py --list-files train "${MAX_FILES[@]}" > "$WORK/train_files.txt"
$PY scripts/train_target.py --list-files heldout > "$WORK/heldout_files.txt"

DRAFT_CMD=($PY -m drafter_svc.train --target "$PAIR_OUT/target" --data "@$WORK/train_files.txt" --out "$PAIR_OUT/draft"
           --layers "$DRAFT_LAYERS" --block-size "$BLOCK" --target-layer-ids "$TARGET_LAYER_IDS"
           --device "$DEVICE" --seed "$SEED" --lr "$LR_DRAFT" --steps "$STEPS_DRAFT" --time-budget "$TIME_DRAFT"
           --generate "${GEN[@]}" --gen-file "$WORK/generated.pt" --ckpt "$WORK/draft_state.pt"
           --eval-data "@$WORK/heldout_files.txt" "${DRAFT_SIZE[@]}")
stamp "2-3/4 generate the draft's data with the target, train the draft, evaluate: ${DRAFT_CMD[*]}"
"${DRAFT_CMD[@]}" 2>&1 | tee "$LOGS/train_draft.log"

if [[ "$BENCH" == 1 ]]; then
  BENCH_CMD=($PY bench/acceptance.py --target "$PAIR_OUT/target" --draft "$PAIR_OUT/draft" --device cpu
             --threads "${BENCH_THREADS:-2}" --temperatures "${BENCH_TEMPS:-0}" "${BENCH_ARGS[@]}"
             --out-json "$LOGS/bench.json" --out-png "$LOGS/bench.png")
  stamp "4/4 held-out benchmark on CPU: ${BENCH_CMD[*]}"
  "${BENCH_CMD[@]}" 2>&1 | tee "$LOGS/bench.log"
fi
TOTAL=$(( $(date +%s) - START ))

# README: how the pair was made, with the numbers from the logs.
$PY - "$PAIR_OUT" "$TOTAL" "$DEVICE" "${TARGET_CMD[*]}" "${DRAFT_CMD[*]}" "${BENCH_CMD[*]:-}" "$DRAFT_ONLY" <<'EOF'
import json, sys
from pathlib import Path

out, total, device, target_cmd, draft_cmd, bench_cmd, draft_only = sys.argv[1:8]
out = Path(out)
t = json.loads((out / "target/train_log.json").read_text())
d = json.loads((out / "draft/train_log.json").read_text())
corpus = json.loads((out / "target/corpus.json").read_text())
dev_name = device
try:
    import torch
    if device.startswith("cuda"):
        dev_name = f"{device} ({torch.cuda.get_device_name(0)})"
except Exception:
    pass
size = lambda p: sum(f.stat().st_size for f in p.iterdir() if f.is_file())
cfg = d["config"]
lines = [
    "# Default model pair",
    "",
    "A small Qwen3-architecture code model trained from scratch on the Python standard library",
    "(`target/`) and a DFlash block-diffusion draft trained for it (`draft/`). Made by",
    "`scripts/make_default_pair.sh` in "
    f"{int(total)} s on {dev_name}, torch {t['torch']}, Python {t['python']}"
    + (" (the draft only; the target was kept from an earlier run)." if draft_only == "1" else "."),
    "",
    "## Target",
    "",
    f"- {t['params'] / 1e6:.2f}M parameters: {t['sizes']['layers']} layers, hidden {t['sizes']['hidden']}, "
    f"{t['sizes']['heads']}/{t['sizes']['kv_heads']} heads x {t['sizes']['head_dim']}, MLP "
    f"{t['sizes']['intermediate']}, vocabulary {t['vocab_size']} (byte-level BPE, untied LM head), bf16 weights.",
    f"- Corpus: {t['train_files']} held-in stdlib files ({t['train_tokens']:,} tokens), {t['heldout_files']} held out "
    f"({t['heldout_tokens']:,} tokens); the rule and both lists are in `target/corpus.json`.",
    f"- {t['steps']} steps of {t['batch']} x {t['seq_len']} tokens ({t['epochs']} epochs) in {t['train_time_s']} s; "
    f"final train loss {t['final_train_loss']:.3f}, held-out loss {t['final_heldout_loss']:.3f}; kept the weights of "
    f"step {t['kept_step']} (held-out loss {t['kept_heldout_loss']:.3f}). Reloaded in float32, the serving forward "
    f"gives {t['served_heldout_loss_fp32']:.4f} on a held-out sample, the training forward "
    f"{t['training_forward_loss_fp32_same_windows']:.4f}.",
    "",
    "## Draft",
    "",
    f"- DFlash, {cfg['num_hidden_layers']} layers, block size {cfg['block_size']}, target layers "
    f"{cfg['dflash_config']['target_layer_ids']}"
    + (" (`--target-layer-ids auto`)" if d["args"]["target_layer_ids"] == "auto" else "")
    + f", mask token {cfg['dflash_config']['mask_token_id']}; "
    f"{d['draft_params'] / 1e6:.2f}M parameters (embedding and LM head shared with the target, not stored).",
    "- Features: target layer id l is transformers' `hidden_states[l + 1]` (DFlash's `extract_context_feature`; "
    "the last layer's is taken after the final norm).",
    f"- Data: the target's greedy continuations of prompts cut from the held-in files: {d['train_sequences']} "
    f"sequences, {d['train_tokens']:,} tokens.",
    f"- {d['steps']} steps in {d['train_time_s']} s; validation loss {d['validation']['loss']:.3f}, per-position "
    "accuracy " + " ".join(f"{x:.2f}" for x in d["validation"]["accuracy"])
    + f", implied chain acceptance {d['validation']['chain_estimate']:.2f}.",
]
if "eval" in d:
    e = d["eval"]
    lines += ["", f"Held-out engine evaluation at training time ({e['prompts']} prompts, greedy, {device}):", "",
              "| mode | mean acceptance | tokens/s | greedy == AR |", "|---|---|---|---|"]
    for name, r in e.items():
        if isinstance(r, dict):
            lines.append(f"| {name} | {r['mean_acceptance']:.3f} | {r['tokens_per_s']:.1f} | {r['equals_ar']:.0%} |")
bench = out / "logs/bench.json"
if bench.is_file():
    b = json.loads(bench.read_text())
    lines += ["", f"## Benchmark (`bench/acceptance.py`, {len(b['prompts'])} held-out prompts, {b['max_new_tokens']} "
              f"new tokens, CPU, {b['threads']} threads)", ""]
    for temp, rows in b["results"].items():
        lines += [f"{temp}:", "", "| mode | mean acceptance | tokens/s | vs AR | == AR |", "|---|---|---|---|---|"]
        for name, r in rows.items():
            eq = f"{r['equals_ar']:.0%}" if "equals_ar" in r else ""
            lines.append(f"| {name} | {r['mean_acceptance']:.3f} | {r['tokens_per_s']:.1f} | "
                         f"{r.get('speedup_vs_ar', 0):.2f}x | {eq} |")
        lines.append("")
lines += ["", "## How it was made", "", "```", target_cmd, draft_cmd] + ([bench_cmd] if bench_cmd else []) + ["```", "",
          f"Sizes: target {size(out / 'target') / 1e6:.1f} MB, draft {size(out / 'draft') / 1e6:.1f} MB. Logs in `logs/`.",
          ""]
(out / "README.md").write_text("\n".join(lines))
print(f"wrote {out / 'README.md'}")
EOF
stamp "done: $PAIR_OUT/target, $PAIR_OUT/draft, $LOGS, $PAIR_OUT/README.md"
