"""Model configurations read from Hugging Face `config.json` files.

Only the fields the engine needs are kept, in typed dataclasses; anything the engine
cannot run (an unknown architecture, a draft that does not fit its target) is rejected
here with a clear message rather than deep inside a forward pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or does not fit its partner model."""


TARGET_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
DRAFT_ARCHITECTURES = ("DFlashDraftModel",)


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

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's query and key; Llama does not."""
        return self.architecture == "Qwen3ForCausalLM"

    def fingerprint(self) -> str:
        """A short, stable identity of the architecture, for mismatch checks."""
        import hashlib

        text = json.dumps(self.__dict__, sort_keys=True, default=list)
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
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None


def read_config_json(folder: str | Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"missing config.json in {folder}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def _require(raw: dict, key: str, where: str):
    if key not in raw:
        raise CheckpointError(f"{where}: config.json lacks '{key}'")
    return raw[key]


def _rope_theta(raw: dict) -> float:
    # transformers 5 moved rope_theta under rope_parameters; older configs keep it at the top.
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if scaling.get("rope_type", "default") not in ("default", None):
        raise CheckpointError(f"unsupported rope_type {scaling.get('rope_type')!r} (only 'default')")
    return float(params.get("rope_theta", 10000.0))


def _head_dim(raw: dict, where: str) -> int:
    heads = int(_require(raw, "num_attention_heads", where))
    return int(raw.get("head_dim") or int(_require(raw, "hidden_size", where)) // heads)


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


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
        rope_theta=_rope_theta(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(raw),
    )


def load_draft_config(folder: str | Path) -> DraftConfig:
    raw = read_config_json(folder)
    where = f"draft {folder}"
    archs = raw.get("architectures") or []
    if not any(a in DRAFT_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"{where}: unsupported architecture {archs or 'unknown'}; expected DFlashDraftModel"
        )
    dflash = raw.get("dflash_config") or {}
    if "target_layer_ids" not in dflash:
        raise CheckpointError(f"{where}: dflash_config.target_layer_ids is missing")
    if "mask_token_id" not in dflash:
        raise CheckpointError(f"{where}: dflash_config.mask_token_id is missing")
    block_size = raw.get("block_size", dflash.get("block_size"))
    if block_size is None or int(block_size) < 2:
        raise CheckpointError(f"{where}: block_size must be >= 2, got {block_size}")
    num_target_layers = raw.get("num_target_layers")
    return DraftConfig(
        vocab_size=int(_require(raw, "vocab_size", where)),
        hidden_size=int(_require(raw, "hidden_size", where)),
        num_layers=int(_require(raw, "num_hidden_layers", where)),
        num_heads=int(_require(raw, "num_attention_heads", where)),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=_head_dim(raw, where),
        intermediate_size=int(_require(raw, "intermediate_size", where)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        block_size=int(block_size),
        target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
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
