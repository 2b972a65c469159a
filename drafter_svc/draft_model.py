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
from kernels.layer_ops import add_rms_norm, silu_mul


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


# One layer's attention of the block over [context, block]: (layer index, its projections,
# the normalised block x [1, T, hidden], cos, sin) -> the attention output after o_proj.
BlockAttention = Callable[[int, AttentionProjections, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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

    def fuse_weights(self) -> None:
        """Concatenate q/k/v and gate/up weights (inference only; see `common.layers`)."""
        for layer in self.layers:
            layer.self_attn.fuse_weights()
            layer.mlp.fuse_weights(silu_mul)

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The context rows [1, k, hidden] the layers' keys and values come from."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))[None]

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rotated keys and values [1, kv_heads, k, D] of every layer for feature rows
        [k, n_layers * hidden] at positions [1, k]."""
        hidden = self.context_hidden(features)
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
                      attention: BlockAttention) -> torch.Tensor:
        """Hidden states [T, hidden] of block embeddings [T, hidden] at positions [1, T], each
        layer's attention (o_proj included) computed by `attention`."""
        h = block_embeds[None].to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        eps = self.cfg.rms_norm_eps
        pending = None  # the last MLP's output, added to h by the next fused add + norm
        for i, layer in enumerate(self.layers):
            h, x = add_rms_norm(h, pending, layer.input_layernorm.weight, eps)
            h, x = add_rms_norm(h, attention(i, layer.self_attn, x, cos, sin), layer.post_attention_layernorm.weight, eps)
            pending = layer.mlp(x)
        return add_rms_norm(h, pending, self.norm.weight, eps)[1][0]

    def forward(self, ctx: DraftContext, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for a block of embeddings [T, hidden] placed right after the context."""
        t = block_embeds.shape[0]
        positions = torch.arange(ctx.length, ctx.length + t, device=self.fc.weight.device)[None]

        def attention(i: int, attn: AttentionProjections, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            k_blk, v_blk = attn.key_value(x, cos, sin)
            k = torch.cat([ctx.kv[i, 0, :, :ctx.length][None], k_blk], dim=2)
            v = torch.cat([ctx.kv[i, 1, :, :ctx.length][None], v_blk], dim=2)
            return attn.attend(attn.query(x, cos, sin), k, v, None)

        return self.block_forward(block_embeds, positions, attention)
