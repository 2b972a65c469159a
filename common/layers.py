"""Transformer building blocks shared by the target (Qwen3 / Llama) and the DFlash draft.

Module and parameter names follow the Hugging Face checkpoints so that a state dict loads
without renaming. Numerics follow transformers' implementations (RMSNorm in float32,
rotate-half RoPE) so logits agree to float32 precision.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.config import RopeScaling

if TYPE_CHECKING:
    from ddtree_kernels.skinny_gemm import SplitSum


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (a bias-free Linear; into `out` if given): F.linear, on a GPU at few rows the
    weight-streaming GEMM (`ddtree_kernels.skinny_gemm`), or in the deterministic mode the
    batch-invariant GEMM (`ddtree_kernels.batch_invariant`), whose rows do not depend on each other."""
    from ddtree_kernels import batch_invariant, skinny_gemm  # here: the kernels package imports this module

    if batch_invariant.enabled():
        return batch_invariant.linear(x, weight, out=out)
    tiles = skinny_gemm.tiles_for(x, weight)
    if tiles is not None:
        return skinny_gemm.skinny_linear(x, weight, out=out, tiles=tiles)
    if out is None:
        return F.linear(x, weight)
    torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, out.shape[-1]))
    return out


def residual_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | SplitSum:
    """x @ weight^T for `add_rms_norm` to add to the residual stream: where the K-split GEMM
    pays (a GPU, few rows, few output columns: o_proj and down), its float32 partial sums
    (`ddtree_kernels.skinny_gemm.SplitSum`), which add_rms_norm sums; else `linear`."""
    from ddtree_kernels import batch_invariant, skinny_gemm  # here: the kernels package imports this module

    tiles = None if batch_invariant.enabled() else skinny_gemm.tiles_for(x, weight, split=True)
    return linear(x, weight) if tiles is None else skinny_gemm.split_linear(x, weight, tiles=tiles)


def gemm_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every weight `linear` may run with in `model`: its 2-D parameters and the fused ones
    (`fuse_weights`: q/k/v, its k/v rows, gate/up), for a warm-up of the GEMMs that compile per
    shape (`ddtree_kernels.skinny_gemm.warm_up`)."""
    weights = [p for p in model.parameters() if p.dim() == 2]
    for module in model.modules():
        if isinstance(module, AttentionProjections) and module.qkv_weight is not None:
            weights += [module.qkv_weight, module.kv_weight]
        elif isinstance(module, MLP) and module.gate_up_weight is not None:
            weights.append(module.gate_up_weight)
    return weights


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
    """cos/sin tables computed on the fly for arbitrary (per-token) positions; `scaling`
    selects a RoPE variant (None = plain RoPE), whose attention factor scales cos and sin."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.attention_factor = 1.0 if scaling is None else scaling.attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding; built under torch.device("meta") (`from_pretrained`: the weights are loaded
    next) it skips its random init, whose meta op would import torch._dynamo (about a second)."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """float32 [dim / 2] inverse frequencies, op for op as transformers' `modeling_rope_utils`
    computes them for the variant, so the cos/sin tables agree bit for bit. Computed on the CPU
    whatever the default device (under torch.device("meta") its ops would import torch._dynamo,
    about a second of start-up)."""
    with torch.device("cpu"):
        return _rope_inv_freq(dim, theta, scaling)


def _rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return plain
    kind, factor = scaling.rope_type, scaling.factor
    if kind == "linear":
        return plain / factor
    if kind == "llama3":
        # Wavelengths longer than the pretraining context / low_freq_factor are stretched by
        # `factor`, those shorter than it / high_freq_factor kept, the band between blended.
        old_context = scaling.original_max_position_embeddings
        low_factor, high_factor = scaling.low_freq_factor, scaling.high_freq_factor
        low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
        wavelen = 2 * math.pi / plain
        inv_freq = torch.where(wavelen > low_wavelen, plain / factor, plain)
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_freq)
    if kind == "yarn":
        # Dimensions that rotate more than beta_fast times over the pretraining context keep
        # their frequency, those under beta_slow are interpolated by `factor`, a linear ramp between.
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        low, high = _yarn_correction_range(scaling, dim, theta)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn_correction_range(scaling: RopeScaling, dim: int, theta: float) -> tuple[float, float]:
    """The dimension range [low, high] of YaRN's ramp (transformers' `find_correction_range`)."""
    def correction_dim(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


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

    def forward(self, x: torch.Tensor, into_residual: bool = False) -> torch.Tensor | SplitSum:
        """The MLP's output; into_residual: in the form `residual_linear` gives, for add_rms_norm."""
        down = residual_linear if into_residual else linear
        if self.gate_up_weight is None:
            gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
            return down(F.silu(gate) * up, self.down_proj.weight)
        return down(self.silu_mul(linear(x, self.gate_up_weight)), self.down_proj.weight)


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
            return torch.cat([linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        return linear(x, self.qkv_weight)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """The raw k, v projections side by side: [B, T, 2 kv_heads * D]."""
        if self.qkv_weight is None:
            return torch.cat([linear(x, self.k_proj.weight), linear(x, self.v_proj.weight)], dim=-1)
        return linear(x, self.kv_weight)

    @property
    def kv_weight(self) -> torch.Tensor | None:
        """The k and v rows of the fused weight (a view), or None before `fuse_weights`."""
        return None if self.qkv_weight is None else self.qkv_weight[self.num_heads * self.head_dim:]

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] -> rotated queries [B, heads, T, D]."""
        q = linear(x, self.q_proj.weight).view(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> rotated keys and values, each [B, kv_heads, T, D]."""
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        k = linear(x, self.k_proj.weight).view(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = linear(x, self.v_proj.weight).view(shape)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA with grouped KV heads; mask is bool [B, 1, Tq, Tk] (True = visible) or None."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return linear(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1), self.o_proj.weight)
