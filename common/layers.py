"""Transformer building blocks shared by the target (Qwen3 / Llama) and the DFlash draft.

Module and parameter names follow the Hugging Face checkpoints so that a state dict loads
without renaming. Numerics follow transformers' implementations (RMSNorm in float32,
rotate-half RoPE) so logits agree to float32 precision.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, round back, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly for arbitrary (per-token) positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        self.silu_mul = silu_mul

    def fuse_weights(self, silu_mul_impl: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """One [2 * intermediate, hidden] weight for gate and up (one GEMM instead of two);
        gate_proj / up_proj keep views of it, so state dicts are unchanged. `silu_mul_impl`
        replaces `silu_mul` on the fused projection (a fused kernel with the same semantics)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = _fuse_linears(self.gate_proj, self.up_proj)
        if silu_mul_impl is not None:
            self.silu_mul = silu_mul_impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.silu_mul(F.linear(x, self.gate_up_weight)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [..., 2 * I] = [gate, up] (the MLP's activation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate bias-free Linear weights along the output dim; each Linear keeps a view."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


class AttentionProjections(nn.Module):
    """q/k/v/o projections plus Qwen3's per-head q_norm/k_norm (absent for Llama)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        """One [(heads + 2 kv_heads) * D, hidden] weight for q, k, v (see `MLP.fuse_weights`)."""
        if self.qkv_weight is None:
            self.qkv_weight = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The raw q, k, v projections side by side: [B, T, (heads + 2 kv_heads) * D]."""
        if self.qkv_weight is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return F.linear(x, self.qkv_weight)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """The raw k, v projections side by side: [B, T, 2 kv_heads * D]."""
        if self.qkv_weight is None:
            return torch.cat([self.k_proj(x), self.v_proj(x)], dim=-1)
        return F.linear(x, self.qkv_weight[self.num_heads * self.head_dim:])

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] -> rotated queries [B, heads, T, D]."""
        q = self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> rotated keys and values, each [B, kv_heads, T, D]."""
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(shape)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA with grouped KV heads; mask is bool [B, 1, Tq, Tk] (True = visible) or None."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))
