"""The target LLM (Qwen3 or Llama) with a static, slot-based KV cache.

One forward serves prefill and tree verification alike: tokens carry explicit positions
and cache indices, and a boolean mask says which cache entries each token sees. The
caller builds the mask (causal for prefill, ancestor-only for a tree), so the model has no
notion of trees and keeps static shapes for CUDA-graph capture.

Feature layer id l is transformers' `hidden_states[l + 1]`, as DFlash's
`extract_context_feature` takes it: the output of decoder layer l (the residual stream), and
for the last layer (l = num_layers - 1) the state after the final norm, since transformers'
last hidden state is taken after it. Every path (prefill, eager and CUDA-graph verify,
training) gets its features from `TargetModel.forward`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.checkpoint import load_tensors
from common.config import TargetConfig, load_target_config
from common.layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding, embedding, linear, residual_linear
from ddtree_kernels import batch_invariant
from ddtree_kernels.kv_move import move_kv_rows
from ddtree_kernels.layer_ops import add_rms_norm, project_store, silu_mul
from ddtree_kernels.slot_attention import (slot_attention, slot_attention_ranges, slot_attention_reference,
                                    slot_attention_triton)

# TargetModel.attention -> the attention over the cache slots (see ddtree_kernels/slot_attention.py).
_ATTENTION = {"auto": slot_attention, "triton": slot_attention_triton, "sdpa": slot_attention_reference}


class KVCache:
    """Preallocated keys/values: [layers, slots, kv_heads, max_seq_len, head_dim] each."""

    def __init__(self, cfg: TargetConfig, num_slots: int, max_seq_len: int, device, dtype):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries src -> dst [B, P] of slot slots[b], all layers at once; every source of a
        row is read before any of its destinations is written (`ddtree_kernels.kv_move`)."""
        move_kv_rows(self.k, self.v, slots, src, dst)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = AttentionProjections(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.qk_norm
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor    # [B, R, vocab] for the requested rows
    features: torch.Tensor  # [B, T, feature_dim]: raw layer features, or context rows when projected


class TargetModel(nn.Module):
    # "auto": `ddtree_kernels.slot_attention` (its Triton kernel on CUDA, which reads the cache slot in
    # place and splits the keys over the GPU; its SDPA reference elsewhere). "triton": the Triton
    # kernel anywhere (CPU through the interpreter). "sdpa": the reference anywhere (a gather of
    # the slot + SDPA). Same result up to rounding. The deterministic mode (`ddtree_kernels.batch_invariant`,
    # process-wide) replaces it, and every GEMM, with batch-invariant kernels.
    attention = "auto"

    def __init__(self, cfg: TargetConfig, feature_layer_ids: tuple[int, ...] = ()):
        super().__init__()
        self.cfg = cfg
        self.feature_layer_ids = tuple(feature_layer_ids)
        # The draft's fc + hidden_norm (`common.feature_projection.FeatureProjection`), set when the
        # verifier sends context rows instead of raw layer features; None: raw features.
        self.feature_projection: nn.Module | None = None
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # Tensor parallelism (`verifier_svc.tensor_parallel`): the sum over the ranks of a row-parallel
        # projection's partial output (o_proj, down_proj), and the unsharded config; None / cfg alone.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.full_cfg = cfg

    @classmethod
    def from_pretrained(cls, folder: str | Path, feature_layer_ids=(), device="cpu", dtype=torch.float32):
        cfg = load_target_config(folder)
        with torch.device("meta"):
            model = cls(cfg, feature_layer_ids)
        tensors = load_tensors(folder, strip_prefix="model.", dtype=dtype)
        # Tied (as transformers ties them, ignoring a stored head) or no head stored: the head is the embedding.
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in tensors
        if tied:
            tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
        model.load_state_dict(tensors, strict=True, assign=True)
        if tied:  # one Parameter in both places, so `.to()` keeps a single tensor
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return model.to(device).eval().requires_grad_(False)

    @property
    def feature_dim(self) -> int:
        """Width of `ForwardOutput.features` (0 without feature layers)."""
        if not self.feature_layer_ids:
            return 0
        if self.feature_projection is not None:
            return self.feature_projection.out_dim
        return len(self.feature_layer_ids) * self.cfg.hidden_size

    def fuse_weights(self) -> None:
        """Concatenate q/k/v and gate/up weights (fewer, wider GEMMs); call after `.to(device)`."""
        for layer in self.layers:
            layer.self_attn.fuse_weights()
            layer.mlp.fuse_weights(silu_mul)

    def forward(
        self,
        input_ids: torch.Tensor,   # [B, T]
        positions: torch.Tensor,   # [B, T] RoPE positions
        cache: KVCache,
        slots: torch.Tensor,       # [B] cache slot of each row
        cache_pos: torch.Tensor,   # [B, T] where each token's K/V is stored
        mask: torch.Tensor,        # [B, T, kv_len] bool, True = visible
        logit_rows: torch.Tensor | None = None,  # [R] rows to return logits for (all when None)
        logits_out: torch.Tensor | None = None,  # [B, R, vocab] buffer to write the logits into
    ) -> ForwardOutput:
        cfg = self.cfg
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        attend = _ATTENTION[self.attention]
        # The deterministic mode reads each row's keys in logical order (ddtree_kernels/batch_invariant.py).
        keys = batch_invariant.LogicalKeys.from_mask(mask, cache_pos) if batch_invariant.enabled() else None
        ranges = slot_attention_ranges(mask) if keys is None else None  # one per forward, for every layer
        outputs = {}  # feature layer id l -> hidden_states[l + 1] (see the module docstring)
        pending = None  # the last MLP's output, added to h by the next fused add + norm
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, x = add_rms_norm(h, pending, layer.input_layernorm.weight, cfg.rms_norm_eps)
            if i - 1 in self.feature_layer_ids:
                outputs[i - 1] = h
            q = project_store(attn, x, cos, sin, cache.k[i], cache.v[i], slots, cache_pos)
            if keys is None:
                out = attend(q, cache.k[i], cache.v[i], slots, mask, ranges)
            else:
                out = batch_invariant.logical_attention(q, cache.k[i], cache.v[i], slots, keys)
            out = out.reshape(*out.shape[:2], -1)
            if self.reduce is None:  # o_proj's and the MLP's outputs as add_rms_norm adds them
                o = residual_linear(out, attn.o_proj.weight)
            else:
                o = self.reduce(linear(out, attn.o_proj.weight))
            h, x = add_rms_norm(h, o, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            pending = layer.mlp(x, into_residual=True) if self.reduce is None else self.reduce(layer.mlp(x))
        h, x = add_rms_norm(h, pending, self.norm.weight, cfg.rms_norm_eps)
        outputs[len(self.layers) - 1] = x  # hidden_states[-1] is after the final norm
        feats = (torch.cat([outputs[i] for i in self.feature_layer_ids], dim=-1) if self.feature_layer_ids
                 else h[..., :0])
        if self.feature_projection is not None and self.feature_layer_ids:
            feats = self.feature_projection(feats)
        if logit_rows is not None:
            x = x[:, logit_rows]
        # With `logits_out`: into a buffer that outlives a CUDA graph's private memory.
        return ForwardOutput(logits=linear(x, self.lm_head.weight, out=logits_out), features=feats)
