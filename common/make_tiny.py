"""Write a tiny random target + DFlash draft pair in the real checkpoint formats.

    python -m common.make_tiny --out DIR --seed S [--arch qwen3|llama] [sizes...]

writes DIR/target (config.json, model.safetensors or shards, tokenizer.json) and
DIR/draft (config.json, model.safetensors). The tokenizer is a byte-level BPE trained on a
fixed slice of the Python standard library's source, so every machine can rebuild it
offline. Tests and the demo use these checkpoints.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.cli import FlagParser, fail

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]
TOKENIZER_SOURCES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "fractions.py", "shlex.py")


@dataclass
class TinySizes:
    arch: str = "qwen3"
    vocab: int = 512
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (0, 2)
    tie_embeddings: bool = False
    max_positions: int = 2048
    init_std: float = 0.25


MIN_VOCAB = 258  # the byte-level BPE's 256 bytes and its 2 special tokens


def train_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """A byte-level BPE tokenizer (tokenizers library) with <|endoftext|> and <|mask|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if texts is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [(stdlib / name).read_text(encoding="utf-8") for name in TOKENIZER_SOURCES]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _random_linear(gen: torch.Generator, out_dim: int, in_dim: int, std: float) -> torch.Tensor:
    return torch.randn(out_dim, in_dim, generator=gen) * (std / in_dim**0.5 * 8)


def _layer_tensors(gen, prefix: str, s: TinySizes, qk_norm: bool) -> dict[str, torch.Tensor]:
    h, hd = s.hidden, s.head_dim
    t = {
        f"{prefix}self_attn.q_proj.weight": _random_linear(gen, s.heads * hd, h, s.init_std),
        f"{prefix}self_attn.k_proj.weight": _random_linear(gen, s.kv_heads * hd, h, s.init_std),
        f"{prefix}self_attn.v_proj.weight": _random_linear(gen, s.kv_heads * hd, h, s.init_std),
        f"{prefix}self_attn.o_proj.weight": _random_linear(gen, h, s.heads * hd, s.init_std),
        f"{prefix}mlp.gate_proj.weight": _random_linear(gen, s.intermediate, h, s.init_std),
        f"{prefix}mlp.up_proj.weight": _random_linear(gen, s.intermediate, h, s.init_std),
        f"{prefix}mlp.down_proj.weight": _random_linear(gen, h, s.intermediate, s.init_std),
        f"{prefix}input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = 1 + 0.1 * torch.randn(hd, generator=gen)
        t[f"{prefix}self_attn.k_norm.weight"] = 1 + 0.1 * torch.randn(hd, generator=gen)
    return t


def _save(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """The tensors as safetensors in `folder`: one file, or `shards` files and their index. The
    files get the umask's permissions (safetensors writes 0600, which a container's user could
    not read)."""
    try:
        _write_shards(tensors, folder, shards)
    finally:
        umask = os.umask(0)
        os.umask(umask)
        for f in folder.glob("model*.safetensors*"):
            f.chmod(0o666 & ~umask)


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards <= 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def target_config_json(s: TinySizes, vocab_size: int, eos_id: int) -> dict:
    arch = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}[s.arch]
    return {
        "architectures": [arch[0]],
        "model_type": arch[1],
        "vocab_size": vocab_size,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": s.max_positions,
        "tie_word_embeddings": s.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def draft_config_json(s: TinySizes, vocab_size: int, mask_id: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.draft_layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": s.max_positions,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": s.block_size,
        "num_target_layers": s.layers,
        "dflash_config": {"target_layer_ids": list(s.target_layer_ids), "mask_token_id": mask_id},
        "torch_dtype": "float32",
    }


def make_tiny(out: str | Path, seed: int, sizes: TinySizes, shards: int = 1, tokenizer=None) -> tuple[Path, Path]:
    """Write out/target and out/draft; returns their paths."""
    out = Path(out)
    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer(sizes.vocab)
    vocab_size = tok.get_vocab_size()
    eos_id, mask_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|mask|>")
    gen = torch.Generator().manual_seed(seed)

    target = {"model.embed_tokens.weight": torch.randn(vocab_size, sizes.hidden, generator=gen)}
    for i in range(sizes.layers):
        target.update(_layer_tensors(gen, f"model.layers.{i}.", sizes, qk_norm=sizes.arch == "qwen3"))
    target["model.norm.weight"] = 1 + 0.1 * torch.randn(sizes.hidden, generator=gen)
    if not sizes.tie_embeddings:
        target["lm_head.weight"] = _random_linear(gen, vocab_size, sizes.hidden, sizes.init_std)
    _save(target, target_dir, shards)
    (target_dir / "config.json").write_text(json.dumps(target_config_json(sizes, vocab_size, eos_id), indent=2))
    tok.save(str(target_dir / "tokenizer.json"))

    draft = {}
    for i in range(sizes.draft_layers):
        draft.update(_layer_tensors(gen, f"layers.{i}.", sizes, qk_norm=True))
    draft["norm.weight"] = 1 + 0.1 * torch.randn(sizes.hidden, generator=gen)
    draft["hidden_norm.weight"] = 1 + 0.1 * torch.randn(sizes.hidden, generator=gen)
    draft["fc.weight"] = _random_linear(gen, sizes.hidden, sizes.hidden * len(sizes.target_layer_ids), sizes.init_std)
    _save(draft, draft_dir, 1)
    (draft_dir / "config.json").write_text(json.dumps(draft_config_json(sizes, vocab_size, mask_id), indent=2))
    return target_dir, draft_dir


def main(argv: list[str] | None = None) -> None:
    d = TinySizes()
    p = FlagParser(prog="python -m common.make_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder; target/ and draft/ are written inside")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--arch", choices=["qwen3", "llama"], default=d.arch, help="target architecture")
    p.add_argument("--vocab", type=int, default=d.vocab, help="tokenizer vocabulary size (BPE target)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size of both models")
    p.add_argument("--layers", type=int, default=d.layers, help="target layers")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="head dimension")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="MLP intermediate size")
    p.add_argument("--draft-layers", type=int, default=d.draft_layers, help="draft layers")
    p.add_argument("--block-size", type=int, default=d.block_size, help="DFlash block size (>= 2)")
    p.add_argument("--target-layer-ids", default=",".join(map(str, d.target_layer_ids)),
                   help="comma-separated target layers whose hidden states feed the draft")
    p.add_argument("--tie-embeddings", action="store_true", help="tie the target's lm_head to embed_tokens")
    p.add_argument("--shards", type=int, default=1, help="write the target as this many safetensors shards")
    a = p.parse_args(argv)
    try:
        layer_ids = tuple(int(x) for x in a.target_layer_ids.split(","))
    except ValueError:
        fail(f"--target-layer-ids must be comma-separated integers, got {a.target_layer_ids!r}")
    if any(not 0 <= i < a.layers for i in layer_ids):
        fail(f"--target-layer-ids {layer_ids} must lie in [0, {a.layers})")
    for flag in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "draft_layers", "shards"):
        if getattr(a, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.vocab < MIN_VOCAB:
        fail(f"--vocab must be >= {MIN_VOCAB} (the byte-level tokenizer's 256 bytes and 2 special tokens), "
             f"got {a.vocab}")
    if a.head_dim % 2:
        fail(f"--head-dim must be even (RoPE rotates pairs), got {a.head_dim}")
    if a.block_size < 2 or a.heads % a.kv_heads:
        fail("--block-size must be >= 2 and --heads a multiple of --kv-heads")
    sizes = TinySizes(arch=a.arch, vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                      kv_heads=a.kv_heads, head_dim=a.head_dim, intermediate=a.intermediate,
                      draft_layers=a.draft_layers, block_size=a.block_size, target_layer_ids=layer_ids,
                      tie_embeddings=a.tie_embeddings)
    target_dir, draft_dir = make_tiny(a.out, a.seed, sizes, shards=a.shards)
    print(f"wrote {target_dir} and {draft_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
