"""A stable name for the device a service computes on, comparable across processes."""
from __future__ import annotations

import torch


def device_id(device: torch.device | str) -> str:
    """"cuda:" + the GPU's UUID (the same GPU in two processes gives the same id, whatever
    CUDA_VISIBLE_DEVICES numbers it), else the device type ("cpu")."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
