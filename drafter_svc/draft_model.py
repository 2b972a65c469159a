"""The DFlash block-diffusion draft model (z-lab checkpoint format).

Every draft layer attends from the block tokens to [projected context features, block
tokens] without a causal mask. Context K/V are computed once per feature row and kept in
a per-session cache (`DraftContext`); the block's own K/V are recomputed every round and
dropped. The draft has no embedding or LM head: it borrows the target's, passed in.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from common.checkpoint import load_tensors
from common.config import DraftConfig, load_draft_config
from common.layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = AttentionProjections(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, qk_norm=True
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DraftContext:
    """One session's context K/V for every draft layer: [layers, 2, kv_heads, capacity, D].

    The tensor is the session's own, or slot `slot` of a pool (`drafter_svc.draft_graphs`);
    `close()` gives a slot back. A closed context has no K/V left to use.
    """

    def __init__(self, kv: torch.Tensor, slot: int | None = None, release: Callable[[], object] | None = None):
        self.kv: torch.Tensor | None = kv
        self.slot = slot
        self.length = 0
        self._release = release

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def close(self) -> None:
        """Give the K/V back (to the pool, for a slot); safe to call more than once."""
        if self._release is not None:
            self._release()
        self.kv = None


# A block's attention context per layer: (layer index, block keys, block values) -> keys,
# values and mask (None = all visible) for `AttentionProjections.attend`.
ContextAttention = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device="cpu", dtype=torch.float32):
        cfg = load_draft_config(folder)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(load_tensors(folder, dtype=dtype), strict=True, assign=True)
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        return model.to(device).eval().requires_grad_(False)

    def new_context(self, capacity: int) -> DraftContext:
        p = self.fc.weight
        cfg = self.cfg
        return DraftContext(torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, capacity, cfg.head_dim,
                                        device=p.device, dtype=p.dtype))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rotated keys and values [1, kv_heads, k, D] of every layer for feature rows
        [k, n_layers * hidden] at positions [1, k]."""
        hidden = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))[None]
        cos, sin = self.rotary(positions, hidden.dtype)
        return [layer.self_attn.key_value(hidden, cos, sin) for layer in self.layers]

    def extend_context(self, ctx: DraftContext, features: torch.Tensor) -> None:
        """Append K/V for new target feature rows [k, n_layers * hidden] at the next positions."""
        k = features.shape[0]
        if k == 0:
            return
        if ctx.length + k > ctx.capacity:
            raise ValueError(f"draft context full: {ctx.length} + {k} rows > capacity {ctx.capacity}")
        positions = torch.arange(ctx.length, ctx.length + k, device=self.fc.weight.device)[None]
        for i, (key, value) in enumerate(self.context_kv(features, positions)):
            ctx.kv[i, 0, :, ctx.length:ctx.length + k] = key[0]
            ctx.kv[i, 1, :, ctx.length:ctx.length + k] = value[0]
        ctx.length += k

    def block_forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                      context: ContextAttention) -> torch.Tensor:
        """Hidden states [T, hidden] of block embeddings [T, hidden] at positions [1, T], each
        layer attending to what `context` gives it."""
        h = block_embeds[None].to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.query(x, cos, sin)
            k, v, mask = context(i, *attn.key_value(x, cos, sin))
            h = h + attn.attend(q, k, v, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)[0]

    def forward(self, ctx: DraftContext, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for a block of embeddings [T, hidden] placed right after the context."""
        t = block_embeds.shape[0]
        positions = torch.arange(ctx.length, ctx.length + t, device=self.fc.weight.device)[None]

        def context(i: int, k_blk: torch.Tensor, v_blk: torch.Tensor):
            k = torch.cat([ctx.kv[i, 0, :, :ctx.length][None], k_blk], dim=2)
            v = torch.cat([ctx.kv[i, 1, :, :ctx.length][None], v_blk], dim=2)
            return k, v, None

        return self.block_forward(block_embeds, positions, context)
