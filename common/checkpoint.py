"""Reading tensors and tokenizers from Hugging Face checkpoint folders.

A folder holds either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. Loading can be restricted to a set of tensor names, so the
drafter can take just `embed_tokens` and `lm_head` from a large target checkpoint.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

from common.config import CheckpointError


def _shard_map(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is malformed: {exc}") from None
        return dict(weight_map)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    with _opened(single) as f:
        return {name: single.name for name in f.keys()}


@contextlib.contextmanager
def _opened(path: Path):
    """safe_open, with a file that is not safetensors (or cannot be read) as a CheckpointError."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def tensor_names(folder: str | Path) -> list[str]:
    return sorted(_shard_map(Path(folder)))


def load_tensors(
    folder: str | Path,
    names: Iterable[str] | None = None,
    *,
    strip_prefix: str = "",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Load the named tensors (all when `names` is None) on CPU.

    `strip_prefix` is removed from the front of names that carry it (e.g. "model."), and
    `names` refers to the stripped names.
    """
    folder = Path(folder)
    shard_of = _shard_map(folder)
    stripped = {
        (n[len(strip_prefix):] if strip_prefix and n.startswith(strip_prefix) else n): n for n in shard_of
    }
    wanted = list(stripped) if names is None else list(names)
    missing = [n for n in wanted if n not in stripped]
    if missing:
        raise CheckpointError(f"{folder}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    by_shard: dict[str, list[str]] = {}
    for name in wanted:
        by_shard.setdefault(shard_of[stripped[name]], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for shard, shard_names in by_shard.items():
        path = folder / shard
        if not path.is_file():
            raise CheckpointError(f"{folder}: shard {shard} listed in the index is missing")
        with _opened(path) as f:
            for name in shard_names:
                tensor = f.get_tensor(stripped[name])
                out[name] = tensor.to(dtype) if dtype is not None else tensor
    return out


def load_tokenizer(folder: str | Path):
    """The `tokenizers.Tokenizer` stored as tokenizer.json in a checkpoint folder."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"missing tokenizer.json in {folder}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception on malformed files
        raise CheckpointError(f"{path} could not be read: {exc}") from None
