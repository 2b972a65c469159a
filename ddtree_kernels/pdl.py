"""Programmatic dependent launch (PDL) between the forward pass's Triton kernels.

A batch-1 verify pass is some 450 short kernels in a row; between two of them the GPU drains
the first, then launches and ramps up the second. With PDL (Hopper and later) a kernel's
programs are launched while the kernel before it still runs: each program first waits for its
predecessor to finish (`griddepcontrol.wait`, whose writes it then sees), then lets its own
successor launch (`griddepcontrol.launch_dependents`). The successor's programs are then
resident and waiting when this kernel ends, instead of being launched after it.

Nothing before the wait reads or writes anything another kernel writes, so results are
bit-identical with PDL on or off (tests/gpu/test_pdl_gpu.py). A kernel that follows a PDL
kernel without being one itself (PyTorch's, cuBLAS's) launches as usual, after it completes.

    DDTREE_PDL=0|1   off / on (default: on for CUDA devices of compute capability 9.0+, with Triton 3.3+)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ddtree_kernels.tree_sampling import environment, kernel_backend

try:  # Triton 3.3 and later; before, no launch takes PDL (`enabled`)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    SUPPORTED = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:
    SUPPORTED = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

ENV = "DDTREE_PDL"


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel launched with `launch_pdl`: wait for the kernel before (its writes
    are then visible), then let the next kernel's programs launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _flag() -> bool | None:
    raw = environment(ENV)
    if raw in ("", "auto"):
        return None
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether a launch on `device` takes PDL: on CUDA devices of compute capability 9.0+ unless
    DDTREE_PDL=0 (DDTREE_PDL=1 on an older GPU or Triton is an error: it has no such launch);
    never off CUDA or in the Triton interpreter."""
    flag = _flag()
    if device.type != "cuda" or environment("TRITON_INTERPRET") == "1":
        return False
    able = SUPPORTED and _hopper(device.index if device.index is not None else torch.cuda.current_device())
    if flag and not able:
        raise ValueError(f"{ENV}=1 needs a GPU of compute capability 9.0+ and Triton 3.3+")
    return able if flag is None else flag


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a PDL-capable kernel's launch: PDL (its constexpr), and
    launch_pdl where it is on (a Triton without PDL knows no such option)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


def describe(device: torch.device) -> str:
    """Which kernels run on `device`, for the services' start-up lines (so a bad DDTREE_KERNELS
    or DDTREE_PDL stops the start-up, before any request)."""
    on = enabled(device)
    if kernel_backend(device) == "reference":
        return "PyTorch references"
    return "Triton, programmatic dependent launch" if on else "Triton"
