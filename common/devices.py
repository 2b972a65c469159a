"""The device a service computes on: parsed and checked from its flag, and a stable name for it,
comparable across processes."""
from __future__ import annotations

import torch


def device_id(device: torch.device | str) -> str:
    """"cuda:" + the GPU's UUID (the same GPU in two processes gives the same id, whatever
    CUDA_VISIBLE_DEVICES numbers it), else the device type ("cpu")."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def parse_device(text: str) -> torch.device:
    """The torch device a --device flag names ("auto": cuda when there is a GPU, else cpu);
    ValueError with one line for a malformed name or a GPU this machine does not have."""
    try:
        device = torch.device("cuda" if text == "auto" and torch.cuda.is_available() else
                              "cpu" if text == "auto" else text)
    except RuntimeError as exc:
        raise ValueError(f"bad device {text!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {text!r} asked for, but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {text!r} asked for, but {torch.cuda.device_count()} GPUs are visible")
    return device
