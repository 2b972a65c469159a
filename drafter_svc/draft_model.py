"""The DFlash block-diffusion draft model (z-lab checkpoint format).

Every draft layer attends from the block tokens to [projected context features, block
tokens] without a causal mask. Context K/V are computed once per feature row and kept in
the session's slot of a `DraftKVPool`; the block's own K/V are written after the context
every round and overwritten by the next. The draft has no embedding or LM head: it borrows
the target's, passed in. Both steps take a batch of sessions (slots) at once.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from common.checkpoint import load_tensors
from common.config import DraftConfig, load_draft_config
from common.feature_projection import project_features
from common.layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding, residual_linear
from ddtree_kernels.layer_ops import add_rms_norm, project_store, silu_mul
from ddtree_kernels.slot_attention import slot_attention, slot_attention_ranges
from ddtree_kernels.slot_attention import warm_up as warm_up_attention

if TYPE_CHECKING:
    from ddtree_kernels.skinny_gemm import SplitSum


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = AttentionProjections(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, qk_norm=True
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DraftKVPool:
    """Every session's context K/V in one preallocated tensor [slots, layers, 2, kv_heads, capacity, D].

    A session holds one slot from `acquire` to `release`. One tensor (not one per session)
    lets a batched step address every session's context by slot index, which is also what a
    captured CUDA graph needs: the slots are data, the addresses fixed.
    """

    def __init__(self, draft: "DFlashDraftModel", slots: int, capacity: int):
        cfg, p = draft.cfg, draft.fc.weight
        self.kv = torch.zeros(slots, cfg.num_layers, 2, cfg.num_kv_heads, capacity, cfg.head_dim,
                              device=p.device, dtype=p.dtype)
        # every attention variant now, not when an eager draft step first takes it
        warm_up_attention(self.kv[:, 0, 0], self.kv[:, 0, 1], cfg.num_heads)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.kv.shape[0]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, zeroed, or None when all are taken. Masked columns are read as
        finite values (0 * NaN is NaN), so an earlier session's K/V must never stay behind."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.kv[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)


# One layer's attention of the block over [context, block]: (layer index, its projections,
# the normalised block x [B, T, hidden], cos, sin) -> the attention output after o_proj.
# (A SplitSum where o_proj ran as a K-split GEMM: `common.layers.residual_linear`.)
BlockAttention = Callable[[int, AttentionProjections, torch.Tensor, torch.Tensor, torch.Tensor],
                          "torch.Tensor | SplitSum"]


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device="cpu", dtype=torch.float32):
        cfg = load_draft_config(folder)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(load_tensors(folder, dtype=dtype), strict=True, assign=True)
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return model.to(device).eval().requires_grad_(False)

    def fuse_weights(self) -> None:
        """Concatenate q/k/v and gate/up weights (inference only; see `common.layers`)."""
        for layer in self.layers:
            layer.self_attn.fuse_weights()
            layer.mlp.fuse_weights(silu_mul)

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The context rows [..., hidden] the layers' keys and values come from, of feature rows
        [..., n_layers * hidden]."""
        return project_features(features, self.fc, self.hidden_norm)

    def extend(self, kv: torch.Tensor, slots: torch.Tensor, past: torch.Tensor, features: torch.Tensor,
               projected: bool = False) -> None:
        """Write the rotated context K/V of feature rows [B, R, n_layers * hidden] into pool
        `kv` at slot slots[b], positions past[b] .. past[b] + R - 1 (RoPE at those positions).
        `projected`: the rows are context rows [B, R, hidden] already (the verifier projected them)."""
        context = features.to(self.fc.weight.dtype) if projected else self.context_hidden(features)
        rows = past[:, None] + torch.arange(features.shape[1], device=past.device)[None]
        cos, sin = self.rotary(rows, context.dtype)
        for i, layer in enumerate(self.layers):
            project_store(layer.self_attn, context, cos, sin, kv[:, i, 0], kv[:, i, 1], slots, rows, queries=False)

    def block_hidden(self, kv: torch.Tensor, slots: torch.Tensor, context_length: torch.Tensor,
                     block_embeds: torch.Tensor, length: int) -> torch.Tensor:
        """Hidden states [B, T, hidden] of blocks [B, T, hidden] placed right after each row's
        context of context_length[b] rows: the block's K/V go to the slot after the context, and
        every block token attends, without a causal mask, to the first `length` (>= the
        context + T) positions of its slot, those from context + T on hidden."""
        b, t = block_embeds.shape[:2]
        positions = context_length[:, None] + torch.arange(t, device=slots.device)[None]
        cols = torch.arange(length, device=slots.device)
        visible = (cols[None] < (context_length + t)[:, None])[:, None, :].expand(b, t, length)
        ranges = slot_attention_ranges(visible)

        def attention(i: int, attn: AttentionProjections, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            q = project_store(attn, x, cos, sin, kv[:, i, 0], kv[:, i, 1], slots, positions)
            out = slot_attention(q, kv[:, i, 0], kv[:, i, 1], slots, visible, ranges)
            return residual_linear(out.reshape(b, t, -1), attn.o_proj.weight)

        return self.block_forward(block_embeds, positions, attention)

    def block_forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                      attention: BlockAttention) -> torch.Tensor:
        """Hidden states [B, T, hidden] of block embeddings [B, T, hidden] at positions [B, T], each
        layer's attention (o_proj included) computed by `attention`."""
        h = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        eps = self.cfg.rms_norm_eps
        pending = None  # the last MLP's output, added to h by the next fused add + norm
        for i, layer in enumerate(self.layers):
            h, x = add_rms_norm(h, pending, layer.input_layernorm.weight, eps)
            h, x = add_rms_norm(h, attention(i, layer.self_attn, x, cos, sin), layer.post_attention_layernorm.weight, eps)
            pending = layer.mlp(x, into_residual=True)
        return add_rms_norm(h, pending, self.norm.weight, eps)[1]
