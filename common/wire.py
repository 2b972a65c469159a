"""Conversions between engine messages and protobuf, with validation of what arrives.

Tensors travel as raw little-endian bytes + dtype + shape (never pickled); tree buffers as
packed integers of the narrowest width that holds them. Every decoder checks sizes against
limits before allocating, and raises `WireError` (a ValueError) with a clear message.
"""
from __future__ import annotations

import torch

from common.protocol import SamplingParams
from common.rpc import pb
from common.tree import DraftTree


class WireError(ValueError):
    """A message that cannot be decoded: wrong sizes, dtypes or values."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_INT_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def encode_tensor(t: torch.Tensor) -> pb.Tensor:
    if t.dtype not in _DTYPE_NAMES:
        raise WireError(f"dtype {t.dtype} cannot be sent")
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape))


def decode_tensor(msg: pb.Tensor, *, max_elements: int) -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unknown tensor dtype {msg.dtype!r}; expected one of {sorted(_DTYPES)}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative tensor dimension in shape {shape}")
    count = 1
    for d in shape:
        count *= d
    if count > max_elements:
        raise WireError(f"tensor of {count} elements exceeds the limit of {max_elements}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(msg.data) != count * itemsize:
        raise WireError(f"tensor data is {len(msg.data)} bytes, shape {shape} of {msg.dtype} needs {count * itemsize}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def pack_ints(values: torch.Tensor | list[int]) -> pb.PackedInts:
    """Signed little-endian integers in the narrowest of 1, 2, 4 or 8 bytes."""
    t = torch.as_tensor(values, dtype=torch.int64).cpu()
    lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 0)
    width = next(w for w in (1, 2, 4, 8) if -(2 ** (8 * w - 1)) <= lo and hi < 2 ** (8 * w - 1))
    return pb.PackedInts(data=t.to(_INT_DTYPES[width]).numpy().tobytes(), width=width)


def unpack_ints(msg: pb.PackedInts, *, max_count: int, what: str) -> torch.Tensor:
    if msg.width not in _INT_DTYPES:
        raise WireError(f"{what}: integer width {msg.width} is not 1, 2, 4 or 8")
    if len(msg.data) % msg.width:
        raise WireError(f"{what}: {len(msg.data)} bytes is not a multiple of width {msg.width}")
    count = len(msg.data) // msg.width
    if count > max_count:
        raise WireError(f"{what}: {count} values exceed the limit of {max_count}")
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(msg.data), dtype=_INT_DTYPES[msg.width]).to(torch.int64)


def encode_tree(tree: DraftTree, round_index: int, traceparent: str = "") -> pb.Tree:
    return pb.Tree(round=round_index, tokens=pack_ints(tree.tokens), next_token=pack_ints(tree.next_token),
                   next_sibling=pack_ints(tree.next_sibling), traceparent=traceparent)


def decode_tree(msg: pb.Tree, *, max_nodes: int) -> DraftTree:
    """Sizes are checked here; structure, depth and token range by `walk_tree`."""
    parts = [unpack_ints(getattr(msg, f), max_count=max_nodes, what=f)
             for f in ("tokens", "next_token", "next_sibling")]
    if not parts[0].numel():
        raise WireError("tree has no nodes (the root is required)")
    if len({p.numel() for p in parts}) != 1:
        raise WireError(f"tree buffers differ in length: {[p.numel() for p in parts]}")
    return DraftTree(*parts)


def encode_sampling(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def decode_sampling(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take their defaults; the values are checked (ValueError)."""
    s = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )
    s.check()
    return s
