"""The draft's context projection: target features -> the rows its context K/V come from.

DFlash concatenates the hidden states of a few target layers (len(target_layer_ids) x hidden
per token) and projects them with its `fc` and `hidden_norm` before anything else sees
them. Either service may apply it: the drafter to raw features, or the verifier, holding
just these two weights of the draft, before the features go on the wire. The second sends
hidden values per token instead of len(target_layer_ids) x hidden (5x fewer bytes for
Qwen3-8B's draft), and the drafter's trees are the same either way.

Both sides must hold the same weights: `projection_fingerprint` summarises them (shapes
and a strided sample of their values rounded to bfloat16, so a float32 and a bfloat16 copy
of one checkpoint agree); the verifier announces it and the drafter compares.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from common.checkpoint import load_tensors
from common.config import DraftConfig, load_draft_config
from common.layers import RMSNorm

FC, NORM = "fc.weight", "hidden_norm.weight"  # the draft checkpoint's names
_SAMPLE = 1 << 16  # values per weight the fingerprint reads


def project_features(features: Tensor, fc: nn.Linear, hidden_norm: RMSNorm) -> Tensor:
    """hidden_norm(fc(features)): [..., n_layers * hidden] -> [..., hidden], in fc's dtype."""
    return hidden_norm(fc(features.to(fc.weight.dtype)))


def projection_fingerprint(fc_weight: Tensor, norm_weight: Tensor) -> str:
    """A short hex digest of both weights' shapes and sampled values."""
    digest = hashlib.sha256()
    for w in (fc_weight, norm_weight):
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to(torch.bfloat16).view(torch.int16).cpu()
        digest.update(repr(tuple(w.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


class FeatureProjection(nn.Module):
    """The draft's `fc` and `hidden_norm`, on their own (the verifier's copy)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @classmethod
    def from_draft(cls, folder: str | Path, device="cpu", dtype=torch.float32) -> "FeatureProjection":
        """Read only the two weights of a draft checkpoint folder."""
        cfg = load_draft_config(folder)
        with torch.device("meta"):
            proj = cls(cfg)
        tensors = load_tensors(folder, [FC, NORM], dtype=dtype)
        proj.load_state_dict(tensors, strict=True, assign=True)
        return proj.to(device).eval().requires_grad_(False)

    @property
    def in_dim(self) -> int:
        return self.fc.weight.shape[1]

    @property
    def out_dim(self) -> int:
        return self.fc.weight.shape[0]

    def fingerprint(self) -> str:
        return projection_fingerprint(self.fc.weight, self.hidden_norm.weight)

    def forward(self, features: Tensor) -> Tensor:
        return project_features(features, self.fc, self.hidden_norm)
