"""Model configurations read from Hugging Face `config.json` files.

Only the fields the engine needs are kept, in typed dataclasses; anything the engine
cannot run (an unknown architecture, a draft that does not fit its target) is rejected
here with a clear message rather than deep inside a forward pass.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or does not fit its partner model."""


TARGET_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
DRAFT_ARCHITECTURES = ("DFlashDraftModel",)
DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none
DEFAULT_MAX_POSITIONS = 4096


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's `build_target_layer_ids`, exactly (same expression, Python rounding): n ids spread
    evenly from 1 to L-3, or L // 2 alone for n = 1; [1, 9, 17, 25, 33] for L = 36, n = 5. What a
    draft whose config names no `target_layer_ids` uses. Shallow targets can get repeated or
    out-of-range ids here (L = 4, n = 2 gives [1, 1]); `is_valid_layer_ids` tells."""
    if num_draft_layers < 1:
        raise ValueError(f"need at least one target layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start = 1
    end = num_target_layers - 3
    span = end - start
    return tuple(int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def is_valid_layer_ids(layer_ids: tuple[int, ...], num_target_layers: int) -> bool:
    """Non-empty, strictly increasing and within [0, num_target_layers)."""
    return (bool(layer_ids) and all(0 <= i < num_target_layers for i in layer_ids)
            and all(a < b for a, b in zip(layer_ids, layer_ids[1:])))


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant other than plain RoPE, its parameters resolved as transformers resolves
    them (`modeling_rope_utils`). `common.layers.rope_inv_freq` builds the inverse frequencies
    from it, and cos/sin are multiplied by `attention_factor` (YaRN's mscale)."""
    rope_type: str                             # "linear", "llama3" or "yarn"
    factor: float
    original_max_position_embeddings: int = 0  # llama3, yarn: the pretraining context
    low_freq_factor: float = 1.0               # llama3
    high_freq_factor: float = 4.0              # llama3
    beta_fast: float = 32.0                    # yarn
    beta_slow: float = 1.0                     # yarn
    truncate: bool = True                      # yarn: round the correction range outwards
    attention_factor: float = 1.0              # yarn: cos/sin multiplier; 1 for the others


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None  # None = plain RoPE with rope_theta

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's query and key; Llama does not."""
        return self.architecture == "Qwen3ForCausalLM"

    def fingerprint(self) -> str:
        """A short, stable identity of the architecture, for mismatch checks."""
        import hashlib

        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DraftConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: tuple[int, ...]  # id l = transformers' hidden_states[l + 1] of the target
    mask_token_id: int
    num_target_layers: int | None
    rope_scaling: RopeScaling | None = None  # None = plain RoPE with rope_theta


def read_config_json(folder: str | Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"missing config.json in {folder}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _read_values(where: str, read: Callable[[], T]) -> T:
    """`read()`, which builds a config from config.json's values; a value of the wrong type
    (a string for a size, a list for a number) becomes a CheckpointError naming the folder."""
    try:
        return read()
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise CheckpointError(f"{where}: config.json has a value of the wrong type: {exc}") from None


def _check_sizes(cfg: TargetConfig | DraftConfig, where: str) -> None:
    """Values a forward cannot run with, refused at load instead of at the first request."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size"):
        if getattr(cfg, name) < 1:
            raise CheckpointError(f"{where}: {name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.head_dim % 2:
        raise CheckpointError(f"{where}: head_dim must be even (RoPE rotates pairs), got {cfg.head_dim}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads {cfg.num_heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_kv_heads}")
    if not (cfg.rms_norm_eps > 0 and cfg.rope_theta > 0):
        raise CheckpointError(f"{where}: rms_norm_eps and rope_theta must be > 0, got {cfg.rms_norm_eps} and "
                              f"{cfg.rope_theta}")


def _require(raw: dict, key: str, where: str):
    if key not in raw:
        raise CheckpointError(f"{where}: config.json lacks '{key}'")
    return raw[key]


def _rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either layout: the hub's (`rope_theta` at the top, a
    `rope_scaling` dict beside it, its type under `rope_type` or the legacy `type`) or
    transformers 5's (`rope_parameters` holding both). Variants the engine cannot compute
    exactly as transformers does are refused."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{where}: per-layer-type RoPE parameters are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "dynamic":
        raise CheckpointError(f"{where}: rope_type 'dynamic' is not supported (its frequencies change with "
                              "the length of each forward pass, which a cached, batched engine cannot follow)")
    if rope_type not in ("linear", "llama3", "yarn"):
        raise CheckpointError(f"{where}: unsupported rope_type {rope_type!r} "
                              "(supported: default, linear, llama3, yarn)")

    def need(key: str):
        if params.get(key) is None:
            raise CheckpointError(f"{where}: rope_type {rope_type!r} needs '{key}' in its RoPE parameters")
        return params[key]

    if rope_type == "linear":
        return theta, RopeScaling("linear", float(need("factor")))
    # transformers lets a top-level original_max_position_embeddings win, then the dict's,
    # then max_position_embeddings.
    max_positions = int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    original = int(raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or max_positions)
    if rope_type == "llama3":
        return theta, RopeScaling("llama3", float(need("factor")), original, float(need("low_freq_factor")),
                                  float(need("high_freq_factor")))
    factor = float(params["factor"]) if params.get("factor") is not None else max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return theta, RopeScaling("yarn", factor, original, beta_fast=float(params.get("beta_fast") or 32),
                              beta_slow=float(params.get("beta_slow") or 1),
                              truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context scale (transformers' `get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_full_attention(raw: dict, where: str) -> None:
    """Refuse sliding-window layers (the engine attends over the whole context). The fields
    are read as transformers' Qwen3Config reads them: the window counts only with
    use_sliding_window, and layer_types, when absent, follow from it and max_window_layers."""
    layers = int(_require(raw, "num_hidden_layers", where))
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = raw.get("layer_types")
    if types is None:
        start = 28 if raw.get("max_window_layers") is None else int(raw["max_window_layers"])  # Qwen3Config's default
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"{where}: layer_types must list one type per layer ({layers})")
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise CheckpointError(f"{where}: unsupported layer_types {unknown} (only full_attention is supported)")
    if window is not None and "sliding_attention" in types:
        raise CheckpointError(f"{where}: sliding-window attention (sliding_window={window} on "
                              f"{types.count('sliding_attention')} layers) is not supported")


def _head_dim(raw: dict, where: str) -> int:
    heads = int(_require(raw, "num_attention_heads", where))
    return int(raw.get("head_dim") or int(_require(raw, "hidden_size", where)) // heads)


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json beside config.json, where instruct models list
    their end-of-turn ids; () when there is no such file."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _eos_ids(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid: {exc}") from None


def load_target_config(folder: str | Path) -> TargetConfig:
    raw = read_config_json(folder)
    where = f"target {folder}"
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{where}: unsupported architecture {archs or 'unknown'}; "
            f"supported targets are {', '.join(TARGET_ARCHITECTURES)}"
        )
    if raw.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true is not supported")
    cfg = _read_values(where, lambda: _target_config(raw, arch, folder, where))
    _check_sizes(cfg, where)
    return cfg


def _target_config(raw: dict, arch: str, folder: str | Path, where: str) -> TargetConfig:
    _check_full_attention(raw, where)
    rope_theta, rope_scaling = _rope(raw, where)
    return TargetConfig(
        architecture=arch,
        vocab_size=int(_require(raw, "vocab_size", where)),
        hidden_size=int(_require(raw, "hidden_size", where)),
        num_layers=int(_require(raw, "num_hidden_layers", where)),
        num_heads=int(_require(raw, "num_attention_heads", where)),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=_head_dim(raw, where),
        intermediate_size=int(_require(raw, "intermediate_size", where)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)),
        eos_token_ids=tuple(dict.fromkeys(_eos_ids(raw) + _generation_eos_ids(folder))),
        rope_scaling=rope_scaling,
    )


def load_draft_config(folder: str | Path) -> DraftConfig:
    raw = read_config_json(folder)
    where = f"draft {folder}"
    archs = raw.get("architectures") or []
    if not any(a in DRAFT_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"{where}: unsupported architecture {archs or 'unknown'}; expected DFlashDraftModel"
        )
    cfg = _read_values(where, lambda: _draft_config(raw, where))
    _check_sizes(cfg, where)
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise CheckpointError(f"{where}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the "
                              f"vocabulary ({cfg.vocab_size})")
    return cfg


def _draft_config(raw: dict, where: str) -> DraftConfig:
    dflash = raw.get("dflash_config") or {}
    num_target_layers = raw.get("num_target_layers")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:  # as DFlash's draft model: derived from the target and draft depths
        if num_target_layers is None:
            raise CheckpointError(f"{where}: dflash_config.target_layer_ids and num_target_layers are missing")
        layer_ids = dflash_target_layer_ids(int(num_target_layers), int(_require(raw, "num_hidden_layers", where)))
        if not is_valid_layer_ids(layer_ids, int(num_target_layers)):
            raise CheckpointError(f"{where}: dflash_config.target_layer_ids is missing and DFlash's rule gives "
                                  f"{list(layer_ids)} for a {num_target_layers}-layer target; write them in config.json")
    if "mask_token_id" not in dflash:
        raise CheckpointError(f"{where}: dflash_config.mask_token_id is missing")
    block_size = raw.get("block_size", dflash.get("block_size"))
    if block_size is None or int(block_size) < 2:
        raise CheckpointError(f"{where}: block_size must be >= 2, got {block_size}")
    _check_full_attention(raw, where)
    rope_theta, rope_scaling = _rope(raw, where)
    return DraftConfig(
        vocab_size=int(_require(raw, "vocab_size", where)),
        hidden_size=int(_require(raw, "hidden_size", where)),
        num_layers=int(_require(raw, "num_hidden_layers", where)),
        num_heads=int(_require(raw, "num_attention_heads", where)),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=_head_dim(raw, where),
        intermediate_size=int(_require(raw, "intermediate_size", where)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        block_size=int(block_size),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        mask_token_id=int(dflash["mask_token_id"]),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        rope_scaling=rope_scaling,
    )


def check_draft_fits_target(draft: DraftConfig, target: TargetConfig) -> None:
    """Raise CheckpointError when the draft cannot run on this target's features."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"draft hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}")
    if not draft.target_layer_ids:
        problems.append("draft target_layer_ids is empty")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"draft target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if draft.num_target_layers is not None and draft.num_target_layers != target.num_layers:
        problems.append(
            f"draft was trained for a {draft.num_target_layers}-layer target, this target has {target.num_layers}"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        problems.append(f"draft mask_token_id {draft.mask_token_id} outside the target vocabulary ({target.vocab_size})")
    if problems:
        raise CheckpointError("draft does not fit target: " + "; ".join(problems))
