"""How the target's feature rows travel on the link: in the model's dtype, or packed as fp8.

A verify step's reply carries the features of every accepted token, and a prefill's the
features of every prompt token: megabytes per message at 8B dimensions (a context row is
hidden_size bf16 values, 8 KB for Qwen3-8B). `--feature-wire fp8` halves those bytes: each row
travels as its F values in float8_e4m3fn, scaled so that the row's largest magnitude is fp8's
largest finite value, followed by that scale as a little-endian float32. A packed row is
F + SCALE_BYTES bytes; the rows of a message are one uint8 tensor [rows, F + SCALE_BYTES], so
they slice row by row like the unpacked ones.

Only the draft reads the features, so packing them changes the drafts, never the output: the
verify step, which decides every token, runs on the target's own values. It costs some
acceptance where the draft is sensitive to 3-bit mantissas (relative error up to 2^-4 per value).
The verifier packs on its device before the copy to the host, the drafter unpacks on its device
after the copy from it.

A drafter reads a reply's rows with a `FeatureReader` (`feature_reader`): on a GPU, all of a
reply's rows go to the draft's device in one copy (unpacked there when packed), and the draft
step's inputs are filled on the device.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from common.staging import to_device

MODEL_DTYPE = ""  # InfoResponse.feature_wire: rows in the model's dtype
FP8 = "fp8-e4m3-rowscale"  # InfoResponse.feature_wire: rows packed by `pack_rows`
FORMATS = {"model": MODEL_DTYPE, "fp8": FP8}  # --feature-wire choices -> the name the verifier announces

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_BYTES = 4  # the row's float32 scale


def wire_rows(feature_dim: int, wire: str, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(width, dtype) of a feature row on the wire, for rows of `feature_dim` values in `dtype`:
    as they are, or packed, (F + SCALE_BYTES, uint8)."""
    return (feature_dim, dtype) if wire == MODEL_DTYPE else (feature_dim + SCALE_BYTES, torch.uint8)


def pack_rows(x: Tensor) -> Tensor:
    """x [..., F] (floating point, F a multiple of 4) as packed rows, uint8 [..., F + SCALE_BYTES],
    on x's device. A row of zeros has scale 0; values are rounded to nearest, ties to even."""
    if x.shape[-1] % SCALE_BYTES:
        raise ValueError(f"feature rows of {x.shape[-1]} values cannot be packed (a multiple of 4 is needed)")
    width = x.shape[-1]
    x = x.float()
    # Times the reciprocal, not divided by 448: a GPU divides a tensor by a number that way, and
    # the scale, so every byte, must not depend on the device that packs.
    scale = (x.abs().amax(dim=-1, keepdim=True) if width else x.new_zeros(*x.shape[:-1], 1)) * (1.0 / FP8_MAX)
    # The clamp keeps a rounding of amax / scale past 448 finite (fp8 e4m3fn has no infinity).
    q = (x / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-FP8_MAX, FP8_MAX)
    packed = torch.empty(*x.shape[:-1], width + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    packed[..., :width].view(FP8_DTYPE).copy_(q)
    packed[..., width:].view(torch.float32).copy_(scale)
    return packed


def scales_of(packed: Tensor) -> Tensor:
    """The float32 scales [rows] of packed rows [rows, F + SCALE_BYTES] (a copy)."""
    return packed[:, -SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)


def check_packed(packed: Tensor) -> None:
    """Raise ValueError unless `packed` (wire data, on the host) is uint8 [rows, F + SCALE_BYTES]
    with F a multiple of 4 and every scale a finite number >= 0. (fp8 values are finite or NaN;
    a NaN value stays a NaN, as it would in the model's dtype.)"""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] <= SCALE_BYTES \
            or packed.shape[1] % SCALE_BYTES:
        raise ValueError(f"packed feature rows must be uint8 [rows, F + {SCALE_BYTES}] with F a multiple of "
                         f"{SCALE_BYTES}, got {packed.dtype} {list(packed.shape)}")
    scales = scales_of(packed)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("a packed feature row's scale is not a finite number >= 0")


def dequantize(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """Packed rows [..., F + SCALE_BYTES] as [..., F] of `dtype`, where they are, unchecked: each
    value times its row's scale."""
    values = packed[..., :-SCALE_BYTES].view(FP8_DTYPE).to(torch.float32)
    scales = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # aligned, wherever the rows lie
    return (values * scales).to(dtype)


def unpack_rows(packed: Tensor, device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """Packed rows [rows, F + SCALE_BYTES] (wire data, on the host) as [rows, F] of `dtype` on
    `device`: checked (`check_packed`, ValueError), copied over in one go, dequantized there."""
    check_packed(packed)
    return dequantize(to_device(packed, device), dtype)


@dataclass(frozen=True)
class FeatureReader:
    """How a drafter reads the feature rows of the verifier's replies: `packed` (InfoResponse.feature_wire
    FP8) or in a floating-point dtype, and `to_draft`, applied to all of a reply's rows at once before
    they are shared out to its sessions: unpack them onto the draft's device, or copy them there in
    one go (the draft step's inputs are then filled on the device); None: the rows stay where they are."""
    packed: bool = False
    to_draft: Callable[[Tensor], Tensor] | None = None


def feature_reader(wire: str, device: torch.device, dtype: torch.dtype) -> FeatureReader:
    """The reader for a verifier that sends rows as `wire` says, to a draft on `device` in `dtype`."""
    if wire == FP8:
        return FeatureReader(True, functools.partial(unpack_rows, device=device, dtype=dtype))
    if torch.device(device).type == "cuda":
        return FeatureReader(False, functools.partial(to_device, device=device))
    return FeatureReader()
