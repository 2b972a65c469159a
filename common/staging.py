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


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """`data` (a host tensor, or what `torch.tensor` takes) on `device`, without waiting for it.

    A copy from pageable host memory waits for everything queued on the device before it, so
    each such small copy stalls the host for the step's kernels (and, on a GPU another process
    shares, for that process's time slice). Staged through pinned memory, the copy is queued
    like a kernel and the host goes on; PyTorch keeps the pinned block until the copy is done.
    """
    host = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type != "cuda":  # a copy to the host waits for the device: its values are read next
        return host.to(device)
    if host.is_cuda:  # a device tensor (an in-process verifier's features): no host in between
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def rows_of(tensor: Tensor, rows: list[int]) -> Tensor:
    """tensor[rows] along dim 0 (all of them, in order: the tensor itself), the index copied
    to the device without a wait."""
    if rows == list(range(tensor.shape[0])):
        return tensor
    return tensor.index_select(0, to_device(rows, tensor.device, torch.int64))


class HostCopy:
    """Device tensors on their way to the host: each is copied into pinned memory asynchronously
    and an event is recorded behind the copies; `wait()` returns them after waiting for that
    event alone, not for work queued on the stream after it (the next step's forward, say).
    Host tensors are passed through as they are."""

    def __init__(self, *tensors: Tensor):
        cuda = [t for t in tensors if t.is_cuda]
        self._out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     if t.is_cuda else t for t in tensors]
        self._done = None
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(cuda[0].device))

    def ready(self) -> bool:
        """Whether the copies have finished (`wait` would return at once)."""
        return self._done is None or self._done.query()

    def wait(self) -> list[Tensor]:
        if self._done is not None:
            self._done.synchronize()
        return self._out


def stack_rows(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.cat(rows) ([0, width] of `dtype` when all are empty), but without the copy when the
    rows are back-to-back slices of one tensor (a verify step hands its rows out that way, and a
    drafter's reply decoding too)."""
    rows = [r for r in rows if r.shape[0]]
    if not rows:
        return torch.empty(0, width, dtype=dtype)
    first = rows[0]
    nbytes = first.element_size()
    adjacent = all(r.is_contiguous() and r.dtype == first.dtype and r.untyped_storage().data_ptr()
                   == first.untyped_storage().data_ptr() for r in rows) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * nbytes for a, b in zip(rows, rows[1:]))
    if adjacent:
        return first.as_strided((sum(r.shape[0] for r in rows), first.shape[1]), first.stride())
    return torch.cat(rows)
