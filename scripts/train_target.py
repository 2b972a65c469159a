"""Train a small Qwen3-architecture code model from scratch on the Python standard library.

    python scripts/train_target.py --out DIR [--steps N] [--batch B] [--seq-len T] [--lr LR]
        [--device cuda|cpu] [--seed S] [--vocab V] [--hidden H] [--layers L] [--heads N]
        [--kv-heads K] [--head-dim D] [--intermediate I] [--time-budget SECONDS]
    python scripts/train_target.py --measure-cpu [--sizes 256x6,320x8] [--tokens 64]
    python scripts/train_target.py --list-files train|heldout

Corpus (the same rule on every machine; the lists depend on the interpreter's version):
every `*.py` file under `sysconfig.get_paths()["stdlib"]`, sorted by its POSIX relative
path, except files inside a folder named in `EXCLUDED_DIRS` (tests, site-packages, IDLE,
turtle demos, codec tables, pydoc's prose, bundled pip), folders named `config-*`, files
named `test_*.py` or `_sysconfigdata*.py`, files over 1 MB, and files that are not UTF-8.
A file is held out for evaluation when crc32 of its relative path is 0 modulo
`HELDOUT_MODULUS` (about 1 file in 20); the split is by name, so it is the same for every
Python version. The held-out list, with the first characters of each held-out file (the
benchmark's prompts, so they do not depend on the benchmarking machine's Python), goes to
`DIR/corpus.json`.

Output in DIR: config.json (Qwen3ForCausalLM), model.safetensors (bf16), tokenizer.json
(byte-level BPE trained on the held-in files, with `<|endoftext|>` and `<|mask|>`),
corpus.json and train_log.json (steps, time, losses, data sizes). Documents are joined
with `<|endoftext|>`; training samples random windows of that stream. The weights kept are
those of the evaluation with the lowest held-out loss (the corpus is small and a long run
overfits).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.cli import fail  # noqa: E402
from common.config import load_target_config  # noqa: E402
from common.make_tiny import TinySizes, _save, target_config_json, train_tokenizer  # noqa: E402
from verifier_svc.target_model import KVCache, TargetModel  # noqa: E402

EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",
    "test", "tests", "idle_test",             # test suites
    "idlelib", "turtledemo",                  # IDLE and the turtle demos
    "encodings",                              # generated codec tables, not code
    "pydoc_data",                             # prose (the help topics)
    "ensurepip",                              # bundled pip
})
HELDOUT_MODULUS = 20
HEAD_CHARS = 2000  # characters of each held-out file kept in corpus.json for prompts
MAX_FILE_BYTES = 1 << 20


# -- corpus ------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _included(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    return not (rel.name.startswith("test_") or rel.name.startswith("_sysconfigdata"))


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELDOUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted (the rule in the module docstring)."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _included(rel) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split_corpus(files: list[str]) -> tuple[list[str], list[str]]:
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read_texts(files: list[str], root: Path | None = None) -> list[str]:
    root = root or stdlib_root()
    return [(root / f).read_text(encoding="utf-8") for f in files]


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All documents as one int32 stream, each followed by <|endoftext|>."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


# -- model ---------------------------------------------------------------------------------

def sizes_from_args(a) -> TinySizes:
    return TinySizes(arch="qwen3", vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                     kv_heads=a.kv_heads, head_dim=a.head_dim, intermediate=a.intermediate,
                     tie_embeddings=False, max_positions=a.max_positions)


def write_config(folder: Path, sizes: TinySizes, vocab_size: int, eos_id: int, dtype: str) -> None:
    cfg = target_config_json(sizes, vocab_size, eos_id)
    cfg["torch_dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def init_weights(model: TargetModel, seed: int) -> None:
    """GPT-style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 L)."""
    gen = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * model.cfg.num_layers)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            torch.nn.init.ones_(p)
            continue
        std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def lm_logits(model: TargetModel, ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM training forward [B, T] -> logits [B, T, vocab] through the target's own modules.

    The same layers and numerics as `TargetModel.forward`, without the KV cache: attention
    is causal SDPA over the sequence itself (flash attention on CUDA).
    """
    b, t = ids.shape
    h = model.embed_tokens(ids)
    positions = torch.arange(t, device=ids.device)[None].expand(b, t)
    cos, sin = model.rotary(positions, h.dtype)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                             enable_gqa=attn.num_heads != attn.num_kv_heads)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))


def save_target(model: TargetModel, folder: Path, dtype=torch.bfloat16) -> None:
    tensors = {}
    for name, p in model.state_dict().items():
        key = name if name.startswith("lm_head.") else f"model.{name}"
        tensors[key] = p.detach().to("cpu", dtype)
    _save(tensors, folder, 1)


def cached_forward_loss(model: TargetModel, windows: torch.Tensor) -> float:
    """Mean next-token loss with the serving forward (KV cache + explicit mask)."""
    n, t = windows.shape
    device = model.embed_tokens.weight.device
    cache = KVCache(model.cfg, n, t, device, model.embed_tokens.weight.dtype)
    ids = windows.to(device).long()
    pos = torch.arange(t, device=device)[None].expand(n, t)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None].expand(n, t, t)
    with torch.inference_mode():
        logits = model(ids, pos, cache, torch.arange(n, device=device), pos, mask).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).item()


def lr_at(progress: float, warmup: float, min_ratio: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` fraction, then cosine down to `min_ratio`."""
    if progress < warmup:
        return (progress + 1e-9) / warmup
    frac = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


# -- CPU sizing -------------------------------------------------------------------------------

def measure_cpu(size_specs: list[str], tokens: int, vocab: int) -> list[dict]:
    """AR tokens/s of the real engine on this CPU for random models of each `HIDDENxLAYERS` size."""
    from common.protocol import SamplingParams
    from common.tree import DraftTree
    from drafter_svc.drafter import DraftMode
    from drafter_svc.generate import LocalEngine
    from drafter_svc.session import GenerationConfig
    from verifier_svc.cuda_graphs import VerifyRow
    from verifier_svc.tree_verifier import VerifierLimits

    tok = train_tokenizer(vocab)
    results = []
    for spec in size_specs:
        hidden, layers = (int(x) for x in spec.lower().split("x"))
        head_dim = 32
        heads = max(2, hidden // head_dim)
        sizes = TinySizes(arch="qwen3", vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                          kv_heads=max(1, heads // 2), head_dim=head_dim, intermediate=3 * hidden)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_config(folder, sizes, vocab, tok.token_to_id("<|endoftext|>"), "float32")
            tok.save(str(folder / "tokenizer.json"))
            model = TargetModel(load_target_config(folder))
            init_weights(model, 0)
            save_target(model, folder, torch.float32)
            params = sum(p.numel() for p in model.parameters())
            engine = LocalEngine.load(str(folder), None, "cpu", torch.float32,
                                      VerifierLimits(max_sessions=1, max_seq_len=512))
            prompt = tok.encode("import os\n\ndef main(argv):\n    ").ids
            cfg = GenerationConfig(tokens, SamplingParams(), stop_token_ids=(), mode=DraftMode("ar", 0))
            engine.eos_token_ids = ()
            engine.generate(prompt, cfg)  # warm-up
            # Best of 3: the machine is shared, the best run is the least disturbed one.
            tps = max(engine.generate(prompt, cfg).tokens_per_s for _ in range(3))
            # Raw forward cost of 1 vs 17 vs 33 tokens after a 128-token past.
            runner = engine.verifier.runner
            fwd = {}
            for t in (1, 17, 33):
                chain = DraftTree.from_parents(torch.randint(0, vocab, (t,)).tolist(), list(range(-1, t - 1)))
                rows = [VerifyRow(0, 128, chain, np.arange(t), SamplingParams())]  # slot 0, 128 tokens past
                tri = torch.ones(1, t, t, dtype=torch.bool).tril()
                for _ in range(3):
                    runner.forward_batch(rows, tri)
                times = []
                for _ in range(20):
                    start = time.perf_counter()
                    runner.forward_batch(rows, tri)
                    times.append(time.perf_counter() - start)
                fwd[t] = sorted(times)[len(times) // 4] * 1e3  # lower quartile
        row = {"size": spec, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": max(1, heads // 2),
               "head_dim": head_dim, "intermediate": 3 * hidden, "vocab": vocab, "params": params,
               "ar_tokens_per_s": round(tps, 1), "forward_ms": {str(k): round(v, 2) for k, v in fwd.items()}}
        print(f"{spec:>8}: {params / 1e6:5.2f}M params  AR {tps:6.1f} tokens/s  forward 1/17/33 tokens "
              f"{fwd[1]:.2f}/{fwd[17]:.2f}/{fwd[33]:.2f} ms", flush=True)
        results.append(row)
    return results


# -- training ---------------------------------------------------------------------------------

def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, length: int, max_windows: int) -> torch.Tensor:
    n = min(max_windows, stream.numel() // length)
    return stream[: n * length].view(n, length)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output checkpoint folder")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (upper bound with --time-budget)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="stop after this many seconds of training; the LR schedule follows the larger "
                        "of step and time progress (0 = off)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the schedule")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (specials included)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=6, help="transformer layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension")
    p.add_argument("--intermediate", type=int, default=768, help="MLP intermediate size")
    p.add_argument("--max-positions", type=int, default=4096, help="longest position the model is trained for")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N held-in files (0 = all)")
    p.add_argument("--eval-every", type=int, default=250, help="held-out loss every N steps")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq-len tokens")
    p.add_argument("--log-every", type=int, default=50, help="a training log line every N steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--measure-cpu", action="store_true",
                   help="report AR tokens/s of random models of --sizes on this CPU and exit")
    p.add_argument("--sizes", default="192x6,256x6,320x8", help="HIDDENxLAYERS list for --measure-cpu")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per --measure-cpu run")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for --measure-cpu (0 = default)")
    p.add_argument("--list-files", choices=["train", "heldout"],
                   help="print the absolute paths of the held-in or held-out corpus files and exit")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.list_files:
        train, heldout = split_corpus(corpus_files())
        root = stdlib_root()
        files = train if a.list_files == "train" else heldout
        if a.list_files == "train" and a.max_files:
            files = files[: a.max_files]
        print("\n".join(str(root / f) for f in files))
        return
    if a.measure_cpu:
        torch.manual_seed(a.seed)
        if a.threads:
            torch.set_num_threads(a.threads)
        print(f"CPU: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
        rows = measure_cpu([s for s in a.sizes.split(",") if s], a.tokens, a.vocab)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "cpu_sizing.json").write_text(json.dumps(rows, indent=2))
        return
    if not a.out:
        fail("--out is required")
    if a.heads % a.kv_heads:
        fail("--heads must be a multiple of --kv-heads")
    train_on(a)


def train_on(a) -> None:
    t_start = time.time()
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    files = corpus_files()
    train_files, heldout_files = split_corpus(files)
    if a.max_files:
        train_files = train_files[: a.max_files]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    print(f"corpus: {len(train_files)} held-in files ({sum(map(len, train_texts)) / 1e6:.2f} MB), "
          f"{len(heldout_files)} held-out ({sum(map(len, heldout_texts)) / 1e6:.2f} MB) from {stdlib_root()}",
          flush=True)
    tok = train_tokenizer(a.vocab, train_texts)
    eos_id = tok.token_to_id("<|endoftext|>")
    train_stream = encode_stream(tok, train_texts, eos_id)
    heldout_stream = encode_stream(tok, heldout_texts, eos_id)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; train {train_stream.numel():,} tokens, "
          f"held-out {heldout_stream.numel():,} tokens ({time.time() - t_start:.1f}s)", flush=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "corpus.json").write_text(json.dumps({
        "rule": __doc__.split("\n\n")[2],
        "stdlib": str(stdlib_root()), "python": platform.python_version(),
        "excluded_dirs": sorted(EXCLUDED_DIRS), "heldout_modulus": HELDOUT_MODULUS,
        "train_files": train_files, "heldout_files": heldout_files,
        "heldout_heads": {f: t[:HEAD_CHARS] for f, t in zip(heldout_files, heldout_texts)},
    }, indent=1))

    sizes = sizes_from_args(a)
    vocab_size = max(a.vocab, tok.get_vocab_size())
    write_config(out, sizes, vocab_size, eos_id, "bfloat16")
    cfg = load_target_config(out)
    model = TargetModel(cfg)
    init_weights(model, a.seed)
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({a.layers} layers, hidden {a.hidden}, vocab {vocab_size})",
          flush=True)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    use_amp = device.type == "cuda"
    forward = torch.compile(lm_logits) if a.compile else lm_logits
    gen = torch.Generator().manual_seed(a.seed)
    eval_windows = fixed_windows(heldout_stream, a.seq_len + 1, a.eval_windows)

    def heldout_loss() -> float:
        model.eval()
        losses = []
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=use_amp):
            for chunk in eval_windows.split(16):
                ids = chunk.to(device).long()
                logits = forward(model, ids[:, :-1])
                losses.append(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).item())
        model.train()
        return sum(losses) / max(1, len(losses))

    best = (float("inf"), -1, None)
    history = []
    step, tokens_seen = 0, 0
    train_start = time.time()
    progress = 0.0
    while step < a.steps and progress < 1.0:
        elapsed = time.time() - train_start
        progress = max(step / a.steps, elapsed / a.time_budget if a.time_budget > 0 else 0.0)
        if progress >= 1.0:
            break
        lr = a.lr * lr_at(max(progress, (step + 1) / a.steps), a.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = sample_windows(train_stream, a.batch, a.seq_len + 1, gen).to(device, non_blocking=True).long()
        with torch.autocast("cuda", torch.bfloat16, enabled=use_amp):
            logits = forward(model, ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += ids[:, :-1].numel()
        if step % a.log_every == 0 or step == 1:
            el = time.time() - train_start
            print(f"step {step:>6}/{a.steps} | loss {loss.item():.4f} | lr {lr:.2e} | "
                  f"{tokens_seen / max(el, 1e-9) / 1e3:8.1f}k tok/s | {el:6.1f}s", flush=True)
        if step % a.eval_every == 0:
            hl = heldout_loss()
            history.append({"step": step, "train_loss": loss.item(), "heldout_loss": hl,
                            "time_s": round(time.time() - train_start, 1)})
            print(f"  eval step {step}: held-out loss {hl:.4f}", flush=True)
            if hl < best[0]:
                best = (hl, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    train_time = time.time() - train_start
    final_train_loss = loss.item() if step else float("nan")
    hl = heldout_loss()
    history.append({"step": step, "train_loss": final_train_loss, "heldout_loss": hl,
                    "time_s": round(train_time, 1)})
    if hl <= best[0]:
        best = (hl, step, None)
    else:
        model.load_state_dict(best[2])
        print(f"keeping the weights of step {best[1]} (held-out loss {best[0]:.4f} < final {hl:.4f})")
    save_target(model, out)

    # Reload through the serving path (bf16 file -> float32) and recompute the held-out loss.
    served = TargetModel.from_pretrained(out, dtype=torch.float32, device=device)
    check = eval_windows[:8, : min(256, a.seq_len + 1)]
    served_loss = cached_forward_loss(served, check)
    with torch.no_grad():
        ids = check.to(device).long()
        train_fwd_loss = F.cross_entropy(lm_logits(served, ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).item()
    if abs(served_loss - train_fwd_loss) > 1e-3:
        print(f"warning: serving forward loss {served_loss:.5f} != training forward loss {train_fwd_loss:.5f}")
    log = {
        "params": params, "sizes": sizes.__dict__, "vocab_size": vocab_size,
        "steps": step, "batch": a.batch, "seq_len": a.seq_len, "lr": a.lr, "seed": a.seed,
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "train_time_s": round(train_time, 1), "total_time_s": round(time.time() - t_start, 1),
        "tokens_seen": tokens_seen, "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(heldout_stream.numel()), "train_files": len(train_files),
        "heldout_files": len(heldout_files), "epochs": round(tokens_seen / max(1, train_stream.numel()), 2),
        "final_train_loss": final_train_loss, "final_heldout_loss": hl,
        "kept_step": best[1], "kept_heldout_loss": best[0],
        "served_heldout_loss_fp32": served_loss, "training_forward_loss_fp32_same_windows": train_fwd_loss, "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2))
    print(f"wrote {out}: {step} steps in {train_time:.0f}s, {tokens_seen / 1e6:.1f}M tokens "
          f"({log['epochs']} epochs); held-out loss {best[0]:.4f}; reloaded in float32, serving forward on "
          f"{check.shape[0]} held-out windows: {served_loss:.4f} (training forward: {train_fwd_loss:.4f})", flush=True)


if __name__ == "__main__":
    main()
