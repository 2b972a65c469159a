"""Train a DFlash block-diffusion draft for a target checkpoint (Qwen3 or Llama).

    python -m drafter_svc.train --target DIR --data FILES... --out DIR [--layers 2] [--block-size 8]
        [--target-layer-ids auto|1,3,5] [--steps N] [--batch N] [--seq-len T] [--anchors A]
        [--lr 6e-4] [--warmup 0.04] [--device D] [--seed S] [--eval-prompts N]
        [--generate] [--gen-prompts N] [--gen-tokens N] [--resume]

Writes DIR/config.json + DIR/model.safetensors in the z-lab DFlash format the engine loads
(`layers.N.*`, `norm`, `fc`, `hidden_norm`; no embedding or LM head: the draft borrows the
target's), DIR/train_log.json, and a copy of the target's tokenizer.json.

Recipe (DFlash; the official training code is unreleased, this follows the paper as quoted
by SpecForge / NeMo):
- The target is frozen; its `embed_tokens` and `lm_head` are shared with the draft, frozen,
  and never saved in the draft. Only the draft layers, `fc` and the norms are trained.
- Data: with `--generate`, prompts cut from the text files are continued greedily by the
  target itself (batched decoding over KV-cache slots) and the loss covers only the
  continuation; the token file is saved (`--gen-file`) and reused on later runs. `--data`
  also takes plain text files (trained on directly) and such token files (`*.pt`).
- Context features: the target's hidden states at `target_layer_ids`, id l being transformers'
  hidden_states[l + 1] as in DFlash's extract_context_feature (decoder layer l's output; for
  the last layer, the state after the final norm), from the serving forward
  (`TargetModel.forward`). `auto` is DFlash's build_target_layer_ids
  (`common.config.dflash_target_layer_ids`: n ids spread evenly from 1 to L-3, [1, 9, 17,
  25, 33] for 36 layers and n = 5), n = `--num-features`, default the draft's layer count;
  where that rule repeats ids (shallow targets: [1, 1] for L = 4) n ids spread over all layers.
- Blocks: per sequence up to `--anchors` random anchors where a whole block fits; each block
  is `[anchor token, MASK x (B-1)]` at absolute positions anchor..anchor+B-1.
- Attention (`dflash_training_mask`): a block's queries see the context features of
  positions < anchor (projected to K/V by each layer's k_proj/v_proj after fc+hidden_norm,
  RoPE at their positions, exactly like `DFlashDraftModel.extend`) and their own
  block bidirectionally; never another block. One batched pass over [context rows; all
  blocks] with the modules of `DFlashDraftModel` (`draft_training_hidden`).
- Labels are same-position: block position k predicts the token at anchor+k, k = 1..B-1.
- Loss: cross-entropy over positions 1..B-1 weighted w_k = exp(-(k-1)/gamma), normalised by
  the weight sum; gamma = 7 for B=16, 4 for B=8, else B/2 (5 for B=10, as published).
- AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up then cosine to 0, gradient
  clipping 1.0, bf16 autocast for the draft on CUDA (the target runs in `--target-dtype`).

Progress lines print the loss, per-position accuracy (k=1..B-1) and the chain acceptance
the batch implies (1 + mean leading run of correct positions). `--ckpt` is written every
`--save-every` steps with the optimizer state; `--resume` continues from it. At the end a
held-out evaluation runs the real engine (`LocalEngine`; AR, chain and a DDTree budget,
greedy) on held-out prompts and prints the mean acceptance length.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from common.checkpoint import load_tokenizer
from common.cli import fail
from common.config import (DraftConfig, TargetConfig, dflash_target_layer_ids, is_valid_layer_ids,
                           load_draft_config, load_target_config)
from common.make_tiny import TinySizes, _save, draft_config_json
from drafter_svc.draft_model import DFlashDraftModel
from verifier_svc.target_model import KVCache, TargetModel

GEN_FORMAT = "dflash-train-tokens/1"


# -- recipe pieces (exposed for tests) ----------------------------------------------------------

def build_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """`--target-layer-ids auto`: DFlash's rule (`dflash_target_layer_ids`) where it gives n
    distinct layers; for shallower targets n ids spread evenly over all layers (0 to L-1).
    ValueError when the target has fewer than n layers."""
    ids = dflash_target_layer_ids(num_target_layers, n)
    if is_valid_layer_ids(ids, num_target_layers):
        return ids
    if n > num_target_layers:
        raise ValueError(f"{n} feature layers from a {num_target_layers}-layer target")
    return tuple(int(round(i * (num_target_layers - 1) / (n - 1))) for i in range(n))


def loss_gamma(block_size: int) -> float:
    """The decay of the position weights: 7 for B=16, 4 for B=8 (published), else B/2."""
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    gamma = loss_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dflash_training_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Visibility for one batched pass, bool [N, A*B, seq_len + A*B] (True = visible).

    Row j*B + k is position k of block j (anchor `anchors[n, j]`); columns are the `seq_len`
    context rows followed by all blocks' rows. A block sees context strictly before its
    anchor and its own block (all of it), never another block.
    """
    n, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev)[None, :] < anchors.reshape(n, a, 1)        # [N, A, L]
    ctx = ctx.repeat_interleave(block_size, dim=1)                                     # [N, A*B, L]
    block_id = torch.arange(a * block_size, device=dev) // block_size
    own = (block_id[:, None] == block_id[None, :]).expand(n, -1, -1)                    # [N, A*B, A*B]
    return torch.cat([ctx, own], dim=2)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute positions [N, A*B] of every block row: anchor + k."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).reshape(anchors.shape[0], -1)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Block token ids [N, A, B]: the anchor's own token, then MASK."""
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    blocks[..., 0] = torch.gather(input_ids, 1, anchors)
    return blocks


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Same-position labels [N, A, B-1]: block position k (1..B-1) predicts the token at anchor + k."""
    k = torch.arange(1, block_size, device=anchors.device)
    idx = (anchors[..., None] + k).clamp(max=input_ids.shape[1] - 1)
    return torch.gather(input_ids, 1, idx.reshape(anchors.shape[0], -1)).view(*anchors.shape, block_size - 1)


def draft_training_hidden(draft: DFlashDraftModel, features: torch.Tensor, block_embeds: torch.Tensor,
                          anchors: torch.Tensor) -> torch.Tensor:
    """Draft hidden states [N, A, B, hidden] for all blocks in one pass.

    features: target features [N, L, n_layers*hidden] of the whole sequence; block_embeds
    [N, A, B, hidden]; anchors [N, A]. The same modules and numerics as
    `DFlashDraftModel.extend` + `block_hidden`, with `dflash_training_mask` in place of
    the inference path's "context cache holds only positions < anchor".
    """
    n, a, b, hid = block_embeds.shape
    seq_len = features.shape[1]
    dtype = draft.fc.weight.dtype
    ctx = draft.hidden_norm(draft.fc(features.to(dtype)))                               # [N, L, H]
    ctx_pos = torch.arange(seq_len, device=ctx.device)[None].expand(n, seq_len)
    cos_c, sin_c = draft.rotary(ctx_pos, ctx.dtype)
    h = block_embeds.reshape(n, a * b, hid).to(dtype)
    cos_b, sin_b = draft.rotary(block_positions(anchors, b), h.dtype)
    mask = dflash_training_mask(anchors, seq_len, b)[:, None]                           # [N, 1, A*B, L+A*B]
    for layer in draft.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.key_value(ctx, cos_c, sin_c)
        x = layer.input_layernorm(h)
        q = attn.query(x, cos_b, sin_b)
        k_blk, v_blk = attn.key_value(x, cos_b, sin_b)
        k = torch.cat([k_ctx.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([v_ctx.to(v_blk.dtype), v_blk], dim=2)
        h = h + attn.attend(q, k.to(q.dtype), v.to(q.dtype), mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h).view(n, a, b, hid)


def target_features(target: TargetModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's features [N, L, F] of whole sequences, through its serving forward (KV cache)."""
    n, t = input_ids.shape
    dev = input_ids.device
    cache = KVCache(target.cfg, n, t, dev, target.embed_tokens.weight.dtype)
    pos = torch.arange(t, device=dev)[None].expand(n, t)
    mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None].expand(n, t, t)
    with torch.no_grad():
        out = target(input_ids, pos, cache, torch.arange(n, device=dev), pos, mask,
                     logit_rows=torch.zeros(0, dtype=torch.long, device=dev))
    return out.features


@dataclass
class LossOut:
    loss: torch.Tensor
    accuracy: torch.Tensor          # [B-1] per-position top-1 accuracy over valid blocks
    chain_acceptance: torch.Tensor  # 1 + mean leading run of correct positions (what a chain would accept)
    blocks: torch.Tensor            # valid blocks in the batch (tensors: no device sync per step)


def draft_loss(draft: DFlashDraftModel, target: TargetModel, input_ids: torch.Tensor, anchors: torch.Tensor,
               valid: torch.Tensor, weights: torch.Tensor, autocast: bool = False) -> LossOut:
    """The DFlash loss of one batch: input_ids [N, L], anchors/valid [N, A]."""
    b = draft.cfg.block_size
    feats = target_features(target, input_ids)
    blocks = block_inputs(input_ids, anchors, b, draft.cfg.mask_token_id)
    embeds = target.embed_tokens(blocks)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        hidden = draft_training_hidden(draft, feats, embeds, anchors)[:, :, 1:]         # [N, A, B-1, H]
        logits = F.linear(hidden, target.lm_head.weight.to(hidden.dtype))
    labels = block_labels(input_ids, anchors, b)
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.device)[None, None] * valid[..., None].to(ce.dtype)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid[..., None]
        nvalid = valid.sum().clamp_min(1)
        accuracy = correct.sum((0, 1)).float() / nvalid
        run = correct.long().cumprod(-1).sum(-1)                                           # [N, A]
        chain = 1.0 + (run.float() * valid).sum() / nvalid
    return LossOut(loss, accuracy, chain, valid.sum())


# -- data ---------------------------------------------------------------------------------------

@dataclass
class TokenData:
    """Token sequences; labels are taken only at positions >= loss_start[i]."""
    seqs: list[torch.Tensor] = field(default_factory=list)
    loss_start: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def extend(self, other: "TokenData") -> None:
        self.seqs += other.seqs
        self.loss_start += other.loss_start

    def __len__(self) -> int:
        return len(self.seqs)

    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.seqs)

    def save(self, path: Path) -> None:
        offsets = [0]
        for s in self.seqs:
            offsets.append(offsets[-1] + s.numel())
        flat = torch.cat(self.seqs).to(torch.int32) if self.seqs else torch.zeros(0, dtype=torch.int32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({"format": GEN_FORMAT, "tokens": flat, "offsets": torch.tensor(offsets, dtype=torch.int64),
                    "loss_start": torch.tensor(self.loss_start, dtype=torch.int64),
                    "meta": json.dumps(self.meta, sort_keys=True)}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "TokenData":
        raw = torch.load(path, weights_only=True)
        if not isinstance(raw, dict) or raw.get("format") != GEN_FORMAT:
            raise ValueError(f"{path} is not a {GEN_FORMAT} token file")
        off = raw["offsets"].tolist()
        seqs = [raw["tokens"][off[i]:off[i + 1]].long() for i in range(len(off) - 1)]
        return cls(seqs, raw["loss_start"].tolist(), json.loads(raw["meta"]))


def target_digest(folder: str | Path) -> str:
    """sha256 of the target's weight files: generated data is reused only for the same weights."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def read_text_tokens(files: list[str], tokenizer, eos_id: int) -> list[torch.Tensor]:
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    return [torch.tensor(e.ids + [eos_id], dtype=torch.long) for e in tokenizer.encode_batch(texts)]


def chunk_documents(docs: list[torch.Tensor], seq_len: int) -> TokenData:
    """Plain-text training data: each document cut into windows of seq_len tokens (labels from position 1)."""
    data = TokenData()
    for doc in docs:
        for s in range(0, max(1, doc.numel() - 1), seq_len):
            piece = doc[s:s + seq_len]
            if piece.numel() >= 2:
                data.seqs.append(piece)
                data.loss_start.append(1)
    return data


@torch.no_grad()
def greedy_continue(target: TargetModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations [B, new_tokens] of B equal-length prompts [B, P], one KV-cache slot each."""
    bsz, p = prompts.shape
    dev = prompts.device
    cache = KVCache(target.cfg, bsz, p + new_tokens, dev, target.embed_tokens.weight.dtype)
    slots = torch.arange(bsz, device=dev)
    pos = torch.arange(p, device=dev)[None].expand(bsz, p)
    mask = torch.ones(p, p, dtype=torch.bool, device=dev).tril()[None].expand(bsz, p, p)
    logits = target(prompts, pos, cache, slots, pos, mask, logit_rows=torch.tensor([p - 1], device=dev)).logits
    out = torch.empty(bsz, new_tokens, dtype=torch.long, device=dev)
    out[:, 0] = logits[:, -1].argmax(-1)
    for i in range(1, new_tokens):
        t = p + i - 1  # position of the token being fed
        here = torch.full((bsz, 1), t, device=dev)
        step_mask = torch.ones(bsz, 1, t + 1, dtype=torch.bool, device=dev)
        logits = target(out[:, i - 1:i], here, cache, slots, here, step_mask).logits
        out[:, i] = logits[:, -1].argmax(-1)
    return out


def generate_data(target: TargetModel, docs: list[torch.Tensor], n_prompts: int, prompt_len: int,
                  gen_tokens: int, batch: int, seed: int, eos_ids: tuple[int, ...],
                  start_fraction: float = 0.25, log=print) -> TokenData:
    """Target-generated training data: prompts cut from docs, continued greedily by the target.

    Up to a `start_fraction` of the prompts are the beginnings of documents (like the
    evaluation prompts; each document at most once, since greedy continuations of equal
    prompts are equal), the rest start at random token offsets of documents picked in
    proportion to their length. Each sequence is cut after its first end-of-sequence token.
    """
    docs = [d for d in docs if d.numel() > prompt_len]
    if not docs:
        raise ValueError(f"no document is longer than the prompt length {prompt_len}")
    rng = random.Random(seed)
    weights = [d.numel() for d in docs]
    n_begin = min(len(docs), int(n_prompts * start_fraction))
    prompts = [d[:prompt_len] for d in rng.sample(docs, n_begin)]
    for _ in range(n_prompts - n_begin):
        doc = rng.choices(docs, weights)[0]
        start = rng.randrange(1, doc.numel() - prompt_len + 1)
        prompts.append(doc[start:start + prompt_len])
    rng.shuffle(prompts)
    dev = target.embed_tokens.weight.device
    data = TokenData()
    t0 = time.time()
    for i in range(0, n_prompts, batch):
        chunk = torch.stack(prompts[i:i + batch]).to(dev)
        cont = greedy_continue(target, chunk, gen_tokens).cpu()
        for prompt, c in zip(chunk.cpu(), cont):
            stops = [j for j, tok in enumerate(c.tolist()) if tok in eos_ids]
            if stops:
                c = c[:stops[0] + 1]
            data.seqs.append(torch.cat([prompt, c]))
            data.loss_start.append(prompt_len)
        done = min(i + batch, n_prompts)
        el = time.time() - t0
        log(f"generate {done}/{n_prompts} prompts | {data.num_tokens() / max(el, 1e-9) / 1e3:.1f}k tok/s | {el:.1f}s")
    return data


class Batcher:
    """Random batches of sequences with random anchors where a whole block fits after loss_start."""

    def __init__(self, data: TokenData, seq_len: int, block_size: int, anchors: int, pad_id: int, seed: int):
        self.seq_len, self.b, self.anchors, self.pad_id = seq_len, block_size, anchors, pad_id
        self.rng = random.Random(seed)
        self.items = []
        for seq, ls in zip(data.seqs, data.loss_start):
            lo = max(1, ls)
            if seq.numel() - block_size >= lo:  # at least one anchor
                self.items.append((seq, lo))
        if not self.items:
            raise ValueError(f"no sequence fits one block of {block_size} tokens after its prompt")

    def state(self):
        return self.rng.getstate()

    def set_state(self, state) -> None:
        self.rng.setstate(state)

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, anchor_rows = [], []
        for _ in range(n):
            seq, lo = self.items[self.rng.randrange(len(self.items))]
            if seq.numel() > self.seq_len:
                # Crop a window that keeps at least one anchor (needs lo <= start + seq_len - B).
                first = max(0, min(lo, seq.numel() - self.b) + self.b - self.seq_len)
                start = self.rng.randint(first, seq.numel() - self.seq_len)
                seq, lo = seq[start:start + self.seq_len], max(1, lo - start)
            hi = seq.numel() - self.b  # last anchor whose block fits
            choices = list(range(lo, hi + 1))
            picked = sorted(self.rng.sample(choices, min(self.anchors, len(choices))))
            rows.append(seq)
            anchor_rows.append(picked)
        length = max(r.numel() for r in rows)
        ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        anchors = torch.zeros(n, self.anchors, dtype=torch.long)
        valid = torch.zeros(n, self.anchors, dtype=torch.bool)
        for i, (r, picked) in enumerate(zip(rows, anchor_rows)):
            ids[i, :r.numel()] = r
            anchors[i, :len(picked)] = torch.tensor(picked, dtype=torch.long)
            valid[i, :len(picked)] = True
        return ids, anchors, valid


# -- model construction and saving ------------------------------------------------------------------

def draft_sizes(target_cfg: TargetConfig, layers: int, block_size: int, layer_ids: tuple[int, ...]) -> TinySizes:
    return TinySizes(hidden=target_cfg.hidden_size, layers=target_cfg.num_layers, heads=target_cfg.num_heads,
                     kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                     intermediate=target_cfg.intermediate_size, draft_layers=layers, block_size=block_size,
                     target_layer_ids=layer_ids, max_positions=target_cfg.max_position_embeddings)


def draft_config_dict(target_cfg: TargetConfig, layers: int, block_size: int, layer_ids: tuple[int, ...],
                      mask_id: int) -> dict:
    cfg = draft_config_json(draft_sizes(target_cfg, layers, block_size, layer_ids), target_cfg.vocab_size, mask_id)
    cfg["rms_norm_eps"] = target_cfg.rms_norm_eps
    cfg["rope_theta"] = target_cfg.rope_theta
    return cfg


def draft_config_from_dict(raw: dict) -> DraftConfig:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        return load_draft_config(tmp)


def new_draft(cfg: DraftConfig, seed: int) -> DFlashDraftModel:
    """A freshly initialised draft: N(0, 0.02) matrices (residual outputs scaled by 1/sqrt(2 L)), unit norms."""
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * cfg.num_layers)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                std = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return draft


def save_draft(draft: DFlashDraftModel, config: dict, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in draft.state_dict().items()}
    _save(tensors, out, 1)
    cfg = dict(config)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` fraction of training, then cosine to 0."""
    if progress < warmup:
        return (progress + 1e-9) / warmup
    frac = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return 0.5 * (1 + math.cos(math.pi * frac))


# -- evaluation with the real engine ------------------------------------------------------------------

def evaluate_engine(target_dir: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int,
                    budget: int, device: str, dtype: torch.dtype = torch.float32, log=print) -> dict:
    """Greedy AR, chain and DDTree(budget) on the prompts; mean acceptance, tokens/s, equality with AR."""
    from common.protocol import SamplingParams
    from drafter_svc.drafter import DraftMode
    from drafter_svc.generate import LocalEngine
    from drafter_svc.session import GenerationConfig
    from verifier_svc.tree_verifier import VerifierLimits

    longest = max(len(p) for p in prompts)
    limits = VerifierLimits(max_sessions=1, max_seq_len=longest + max_new_tokens + budget + 64)
    engine = LocalEngine.load(target_dir, draft_dir, device, dtype, limits)
    modes = [("ar", DraftMode("ar", 0)), ("chain", DraftMode("chain", 0)), (f"tree{budget}", DraftMode("tree", budget))]
    results: dict = {}
    ar_tokens = []
    for name, mode in modes:
        cfg = GenerationConfig(max_new_tokens, SamplingParams(0.0), mode=mode)
        runs = [engine.generate(p, cfg) for p in prompts]
        if name == "ar":
            ar_tokens = [r.tokens for r in runs]
        tokens = sum(len(r.tokens) for r in runs)
        elapsed = sum(r.elapsed_s for r in runs)
        results[name] = {
            "mean_acceptance": sum(r.mean_acceptance for r in runs) / len(runs),
            "tokens_per_s": tokens / elapsed if elapsed else 0.0,
            "equals_ar": sum(r.tokens == a for r, a in zip(runs, ar_tokens)) / len(runs),
        }
        log(f"eval {name:>8}: mean acceptance {results[name]['mean_acceptance']:.3f} | "
            f"{results[name]['tokens_per_s']:.1f} tok/s | greedy == AR on {results[name]['equals_ar']:.0%} of prompts")
    return results


# -- command line -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafter_svc.train", description=__doc__.split("\n\n")[0],
                                fromfile_prefix_chars="@",
                                epilog="Arguments may be read from a file, one per line: --data @files.txt")
    p.add_argument("--target", required=True, help="target checkpoint folder")
    p.add_argument("--data", nargs="+", required=True,
                   help="text files (tokenised with the target's tokenizer) and/or token files (*.pt); "
                        "with --generate the text files are the prompt sources")
    p.add_argument("--out", required=True, help="draft checkpoint folder to write")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--block-size", type=int, default=8, help="DFlash block size B (>= 2)")
    p.add_argument("--target-layer-ids", default="auto",
                   help="'auto' (DFlash's rule: n ids spread evenly from 1 to L-3) or comma-separated target "
                        "layer ids, id l being transformers' hidden_states[l + 1]")
    p.add_argument("--num-features", type=int, default=0,
                   help="number of target layers for 'auto' (0 = the draft's layer count, as DFlash)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="MASK token id when the tokenizer has no <|mask|> token")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (upper bound with --time-budget)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="stop training after this many seconds; the schedule follows the larger of step "
                        "and time progress (0 = off)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="longest training sequence (longer ones are cropped)")
    p.add_argument("--anchors", type=int, default=64, help="random anchors (blocks) per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of the schedule")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the frozen target (features, generation); float32 matches CPU serving")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written draft weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=500, help="write --ckpt every N steps")
    p.add_argument("--ckpt", default=None, help="training-state file (default OUT/train_state.pt)")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--val-seqs", type=int, default=32, help="sequences held out of training for the validation loss")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the final engine evaluation (0 = skip)")
    p.add_argument("--eval-data", nargs="*", default=[],
                   help="text files whose beginnings are the evaluation prompts (default: held-out sequences' prompts)")
    p.add_argument("--eval-prompt-len", type=int, default=64, help="prompt tokens taken from --eval-data files")
    p.add_argument("--eval-tokens", type=int, default=64, help="new tokens per evaluation prompt")
    p.add_argument("--eval-budget", type=int, default=32, help="DDTree budget of the evaluation")
    p.add_argument("--eval-device", default=None, help="device of the evaluation engine (default --device)")
    p.add_argument("--generate", action="store_true",
                   help="first make the training data: the target's greedy continuations of prompts from the text files")
    p.add_argument("--gen-file", default=None, help="token file of the generated data (default OUT/generated.pt); reused if it matches")
    p.add_argument("--gen-prompts", type=int, default=1024, help="prompts to continue")
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--gen-prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--gen-batch", type=int, default=256, help="prompts decoded at once (KV-cache slots)")
    return p


def parse_layer_ids(text: str, target_cfg: TargetConfig, n: int) -> tuple[int, ...]:
    if text == "auto":
        try:
            return build_target_layer_ids(target_cfg.num_layers, n)
        except ValueError as exc:
            fail(f"--target-layer-ids auto: {exc}")
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(f"--target-layer-ids must be 'auto' or comma-separated integers, got {text!r}")
    if not ids or any(not 0 <= i < target_cfg.num_layers for i in ids):
        fail(f"--target-layer-ids {ids} must lie in [0, {target_cfg.num_layers})")
    return ids


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t_start = time.time()
    out = Path(a.out)
    ckpt_path = Path(a.ckpt) if a.ckpt else out / "train_state.pt"
    gen_path = Path(a.gen_file) if a.gen_file else out / "generated.pt"
    if a.block_size < 2:
        fail("--block-size must be >= 2")
    try:
        target_cfg = load_target_config(a.target)
        tokenizer = load_tokenizer(a.target)
    except ValueError as exc:
        fail(str(exc))
    mask_id = tokenizer.token_to_id("<|mask|>")
    if mask_id is None:
        mask_id = a.mask_token_id
    if mask_id is None:
        fail("the tokenizer has no <|mask|> token: give --mask-token-id (an unused vocabulary row)")
    if not 0 <= mask_id < target_cfg.vocab_size:
        fail(f"mask token id {mask_id} outside the target vocabulary ({target_cfg.vocab_size})")
    eos_ids = tuple(target_cfg.eos_token_ids) or tuple(
        i for i in [tokenizer.token_to_id("<|endoftext|>")] if i is not None)
    pad_id = eos_ids[0] if eos_ids else 0
    layer_ids = parse_layer_ids(a.target_layer_ids, target_cfg, a.num_features or a.layers)
    config = draft_config_dict(target_cfg, a.layers, a.block_size, layer_ids, mask_id)
    draft_cfg = draft_config_from_dict(config)
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    log(f"target {a.target}: {target_cfg.num_layers} layers, hidden {target_cfg.hidden_size}, vocab "
        f"{target_cfg.vocab_size}; draft {a.layers} layers, block {a.block_size}, target_layer_ids "
        f"{list(layer_ids)}, mask {mask_id}, gamma {loss_gamma(a.block_size)}")
    target = TargetModel.from_pretrained(a.target, layer_ids, device=device, dtype=getattr(torch, a.target_dtype))

    # Data.
    text_files = [f for f in a.data if not f.endswith(".pt")]
    token_files = [f for f in a.data if f.endswith(".pt")]
    missing = [f for f in a.data if not Path(f).is_file()]
    if missing:
        fail(f"data files not found: {missing[:3]}")
    data = TokenData()
    for f in token_files:
        data.extend(TokenData.load(Path(f)))
    docs = read_text_tokens(text_files, tokenizer, pad_id) if text_files else []
    if a.generate:
        if not docs:
            fail("--generate needs text files in --data as prompt sources")
        meta = {"target": target_cfg.fingerprint(), "weights": target_digest(a.target), "prompts": a.gen_prompts,
                "gen_tokens": a.gen_tokens, "prompt_len": a.gen_prompt_len, "seed": a.seed, "sampler": 2,
                "files": len(text_files), "corpus_tokens": sum(int(d.numel()) for d in docs)}
        reused = False
        if gen_path.is_file():
            try:
                old = TokenData.load(gen_path)
                reused = old.meta == meta
            except (ValueError, RuntimeError, KeyError):
                reused = False
        if reused:
            log(f"reusing generated data {gen_path} ({len(old)} sequences, {old.num_tokens():,} tokens)")
            gen = old
        else:
            gen = generate_data(target, docs, a.gen_prompts, a.gen_prompt_len, a.gen_tokens, a.gen_batch,
                                a.seed, eos_ids, log=log)
            gen.meta = meta
            gen.save(gen_path)
            log(f"wrote {gen_path}: {len(gen)} sequences, {gen.num_tokens():,} tokens")
        data.extend(gen)
    elif docs:
        data.extend(chunk_documents(docs, a.seq_len))
    if len(data) < 2:
        fail("not enough training data")
    # Hold out the last sequences (a seeded shuffle first) for validation and evaluation prompts.
    order = list(range(len(data)))
    random.Random(a.seed + 1).shuffle(order)
    n_val = min(a.val_seqs, max(1, len(data) // 10))
    val = TokenData([data.seqs[i] for i in order[:n_val]], [data.loss_start[i] for i in order[:n_val]])
    train = TokenData([data.seqs[i] for i in order[n_val:]], [data.loss_start[i] for i in order[n_val:]])
    log(f"data: {len(train)} training sequences ({train.num_tokens():,} tokens), {len(val)} validation")
    batcher = Batcher(train, a.seq_len, a.block_size, a.anchors, pad_id, a.seed)
    val_batcher = Batcher(val, a.seq_len, a.block_size, a.anchors, pad_id, a.seed + 2)
    val_batch = val_batcher.sample(min(len(val), a.batch))

    # Model, optimizer, state.
    draft = new_draft(draft_cfg, a.seed).to(device).train()
    decay = [p for p in draft.parameters() if p.ndim >= 2]
    no_decay = [p for p in draft.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    weights = position_weights(a.block_size).to(device)
    use_amp = device.type == "cuda"
    step, train_elapsed, history = 0, 0.0, []
    if a.resume:
        if not ckpt_path.is_file():
            fail(f"--resume: no training state at {ckpt_path}")
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if state["config"] != config:
            fail(f"--resume: {ckpt_path} was made for another draft configuration")
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        step, train_elapsed, history = state["step"], state["elapsed"], state["history"]
        batcher.set_state(state["batcher"])
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {ckpt_path} at step {step}")

    def save_state() -> None:
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"config": config, "draft": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "elapsed": train_elapsed, "history": history, "batcher": batcher.state(),
                    "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, ckpt_path)

    def validate() -> LossOut:
        draft.eval()
        with torch.no_grad():
            ids, anchors, valid = (x.to(device) for x in val_batch)
            res = draft_loss(draft, target, ids, anchors, valid, weights, use_amp)
        draft.train()
        return res

    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_params / 1e6:.2f}M trainable parameters; training up to {a.steps} steps"
        + (f" or {a.time_budget:.0f}s" if a.time_budget else ""))
    seg_start, window = time.time(), []
    base_elapsed = train_elapsed
    while step < a.steps:
        train_elapsed = base_elapsed + time.time() - seg_start
        progress = max(step / a.steps, train_elapsed / a.time_budget if a.time_budget > 0 else 0.0)
        if progress >= 1.0:
            break
        lr = a.lr * lr_factor(max(progress, (step + 1) / a.steps), a.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids, anchors, valid = (x.to(device, non_blocking=True) for x in batcher.sample(a.batch))
        res = draft_loss(draft, target, ids, anchors, valid, weights, use_amp)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        window.append((res.loss.detach(), res.accuracy.detach(), res.chain_acceptance.detach()))
        if step % a.log_every == 0 or step == 1 or step == a.steps:
            loss = torch.stack([w[0] for w in window]).mean().item()
            acc = torch.stack([w[1] for w in window]).mean(0).tolist()
            tau = torch.stack([w[2] for w in window]).mean().item()
            window.clear()
            el = base_elapsed + time.time() - seg_start
            log(f"step {step:>6}/{a.steps} | loss {loss:.4f} | acc " + " ".join(f"{x:.2f}" for x in acc)
                + f" | chain~{tau:.2f} | lr {lr:.2e} | {el:6.1f}s")
            history.append({"step": step, "loss": loss, "accuracy": acc, "chain_estimate": tau, "time_s": round(el, 1)})
        if a.save_every and step % a.save_every == 0:
            train_elapsed = base_elapsed + time.time() - seg_start
            save_state()
    train_elapsed = base_elapsed + time.time() - seg_start
    save_state()
    val_res = validate()
    log(f"validation: loss {val_res.loss.item():.4f} | acc " + " ".join(f"{x:.2f}" for x in val_res.accuracy.tolist())
        + f" | chain~{val_res.chain_acceptance.item():.2f}")
    save_draft(draft, config, out, getattr(torch, a.save_dtype))
    if (Path(a.target) / "tokenizer.json").is_file():
        shutil.copyfile(Path(a.target) / "tokenizer.json", out / "tokenizer.json")
    log(f"wrote draft {out} ({step} steps, {train_elapsed:.0f}s training)")

    summary = {"target": str(a.target), "config": config, "args": {k: v for k, v in vars(a).items() if k not in ("data", "eval_data")},
               "data_files": len(a.data), "train_sequences": len(train), "train_tokens": train.num_tokens(),
               "steps": step, "train_time_s": round(train_elapsed, 1), "draft_params": n_params,
               "validation": {"loss": val_res.loss.item(), "accuracy": val_res.accuracy.tolist(),
                              "chain_estimate": val_res.chain_acceptance.item()},
               "history": history}
    if a.eval_prompts > 0:
        if a.eval_data:
            prompts = [d[:a.eval_prompt_len].tolist()
                       for d in read_text_tokens(a.eval_data, tokenizer, pad_id)][: a.eval_prompts]
        else:
            prompts = [s[:max(ls, min(a.eval_prompt_len, s.numel() - 1))].tolist()
                       for s, ls in zip(val.seqs, val.loss_start)][: a.eval_prompts]
        eval_device = a.eval_device or a.device
        log(f"held-out evaluation: {len(prompts)} prompts, {a.eval_tokens} new tokens, greedy, on {eval_device}")
        try:
            summary["eval"] = evaluate_engine(str(a.target), str(out), prompts, a.eval_tokens, a.eval_budget,
                                              eval_device, log=log)
        except Exception as exc:  # the draft is written already; fall back to the CPU engine
            if eval_device == "cpu":
                raise
            log(f"evaluation on {eval_device} failed ({type(exc).__name__}: {exc}); retrying on cpu")
            summary["eval_error"] = f"{eval_device}: {type(exc).__name__}: {exc}"
            summary["eval"] = evaluate_engine(str(a.target), str(out), prompts, a.eval_tokens, a.eval_budget,
                                              "cpu", log=log)
        summary["eval"]["prompts"] = len(prompts)
        chain = summary["eval"]["chain"]["mean_acceptance"]
        tree = summary["eval"][f"tree{a.eval_budget}"]["mean_acceptance"]
        log(f"held-out mean acceptance: chain {chain:.3f}, tree budget {a.eval_budget} {tree:.3f} "
            f"({tree / chain:.2f}x chain)")
    summary["total_time_s"] = round(time.time() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
