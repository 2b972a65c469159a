"""Tensor parallelism for the target, Megatron-style: one shard of every layer per process.

Each of `world` ranks holds
* column-parallel q/k/v (its num_heads / world query heads and num_kv_heads / world KV heads, a
  contiguous range, so a query head's KV head is on the same rank) and gate/up (its
  intermediate_size / world columns);
* row-parallel o_proj and down_proj (the matching input columns), whose partial outputs are
  summed over the ranks by one all-reduce each (`TargetModel.reduce`);
* the embedding, the norms (Qwen3's per-head q/k norms too) and the head, replicated;
* a KV cache of its own KV heads only (a `KVCache` of the shard's config).

After each all-reduce every rank holds the same residual stream, so the logits, the features
and the accept step come out the same on every rank: each compacts its own K/V slice by the
same paths, and rank 0 alone needs to answer the drafter. Collectives run on
torch.distributed: NCCL on GPUs, gloo on CPUs (tests).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from common.config import TargetConfig
from verifier_svc.target_model import TargetModel


def shard_config(cfg: TargetConfig, world: int) -> TargetConfig:
    """The config of one rank's shard; ValueError when the heads or the MLP do not split evenly."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"{name} {getattr(cfg, name)} does not split over {world} ranks")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def _rows(weight: Tensor, rank: int, world: int) -> Tensor:
    size = weight.shape[0] // world
    return weight[rank * size: (rank + 1) * size].clone()


def _columns(weight: Tensor, rank: int, world: int) -> Tensor:
    size = weight.shape[1] // world
    return weight[:, rank * size: (rank + 1) * size].clone()


def shard_target(model: TargetModel, rank: int, world: int, group: dist.ProcessGroup | None = None) -> TargetModel:
    """Rank `rank`'s shard of `model` (unfused weights, as loaded), reducing over `group` (None:
    the default group). The full config stays reachable as `full_cfg`, for what the verifier
    reports (its fingerprint, sizes)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    if any(layer.self_attn.qkv_weight is not None for layer in model.layers):
        raise ValueError("shard the model before fuse_weights()")
    full = model.cfg
    with torch.device("meta"):
        shard = TargetModel(shard_config(full, world), model.feature_layer_ids)
    state = {}
    for name, weight in model.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            state[name] = _rows(weight, rank, world)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = _columns(weight, rank, world)
        else:  # embedding, norms, head: replicated
            state[name] = weight
    shard.load_state_dict(state, strict=True, assign=True)
    if model.lm_head.weight is model.embed_tokens.weight:
        shard.lm_head.weight = shard.embed_tokens.weight
    shard.rotary = model.rotary
    shard.feature_projection = model.feature_projection
    shard.attention = model.attention
    shard.full_cfg = full
    shard.reduce = lambda partial: all_reduce(partial, group)
    return shard.eval().requires_grad_(False)


def all_reduce(partial: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The sum of every rank's `partial` (in place), the same bits on every rank."""
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial
