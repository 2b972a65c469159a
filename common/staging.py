"""Static input buffers for captured CUDA graphs, filled each round through host copies.

A graph reads its inputs from fixed device addresses, so every round the host writes the
new values into a (pinned) host twin of each buffer and copies all twins over in one go,
asynchronously. Before overwriting the twins, `begin()` waits until the previous round's
copies have read them. On the CPU the twin is the buffer itself and nothing is copied.
"""
from __future__ import annotations

import torch
from torch import Tensor


class StagedInputs:
    def __init__(self, device: torch.device, pinned: bool):
        self.device = device
        self._pinned = pinned
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (device buffer, host twin)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def buffer(self, *shape: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A new zeroed (device buffer, host twin) pair; fill the twin, graphs read the buffer."""
        device_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            return device_buffer, device_buffer
        host = torch.zeros(shape, dtype=dtype)
        host = host.pin_memory() if self._pinned else host
        self._pairs.append((device_buffer, host))
        return device_buffer, host

    def begin(self) -> None:
        """Wait until the previous round's copies have read the host twins."""
        if self._copied is not None:
            self._copied.synchronize()

    def commit(self, skip: tuple[Tensor, ...] = ()) -> None:
        """Copy every twin to its device buffer (asynchronously), except the buffers in `skip`."""
        if self._copied is None:
            return
        for device_buffer, host in self._pairs:
            if not any(device_buffer is s for s in skip):
                device_buffer.copy_(host, non_blocking=True)
        self._copied.record()
