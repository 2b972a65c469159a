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
same paths, and rank 0 alone answers the drafter. Rank 0 runs the verifier as usual, its
`TargetRunner` handing each forward's inputs to the other ranks first (`StepMirror`: a
header, then the step's input buffers, broadcast); the others run `follow`, the same forward
on their shard, until rank 0 stops them. Collectives run on torch.distributed: NCCL on GPUs,
gloo on CPUs (tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from common.config import TargetConfig
from common.penalties import NO_PENALTY
from verifier_svc.cuda_graphs import MODES, BatchInputs, verify_step
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner, prefill_forward

log = logging.getLogger(__name__)

STOP, PREFILL, VERIFY, COUNT = 0, 1, 2, 3  # the operation a header announces
HEADER = 6  # int64s: operation, then its sizes
# Headers go over a gloo group on the CPU with no practical timeout: a rank waits for the next step
# as long as the verifier idles (a NCCL collective would be killed by its watchdog). Steps' tensors
# go over the default group (NCCL on GPUs).
IDLE_TIMEOUT = timedelta(days=365)


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


class StepMirror:
    """Rank 0's side: before each forward, broadcast what it is (a header, over `control`) and its
    inputs (over the default group, on `device`), so that every other rank (`follow`) runs the
    same forward on its shard (set with `TargetRunner.set_mirror`)."""

    def __init__(self, device: torch.device, control: dist.ProcessGroup | None = None):
        self.device, self.control = device, control

    def _send(self, *header: int, tensors: tuple[Tensor, ...] = ()) -> None:
        fields = torch.zeros(HEADER, dtype=torch.int64)
        fields[: len(header)] = torch.tensor(header, dtype=torch.int64)
        dist.broadcast(fields, 0, group=self.control)
        for tensor in tensors:
            dist.broadcast(_wire(tensor), 0)

    def prefill(self, tokens: Tensor, positions: Tensor, slots: Tensor, cache_pos: Tensor, mask: Tensor,
                logit_rows: Tensor) -> None:
        (b, t), length = tokens.shape, mask.shape[-1]
        self._send(PREFILL, b, t, length, logit_rows.shape[0],
                   tensors=(tokens, positions, slots, cache_pos, mask.contiguous(), logit_rows))

    def count_prompts(self, fresh: Tensor, slots: Tensor, tokens: Tensor, generated: Tensor) -> None:
        self._send(COUNT, fresh.shape[0], tokens.shape[0], tensors=(fresh, slots, tokens, generated))

    def verify(self, mode: str, inp: BatchInputs, length: int, graphed: bool) -> None:
        self._send(VERIFY, MODES.index(mode), inp.B, inp.T, length, int(graphed), tensors=inp.buffers)

    def stop(self) -> None:
        self._send(STOP)


def _wire(tensor: Tensor) -> Tensor:
    """What a collective carries for `tensor`: bool as bytes (in place: receiving fills the tensor)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def follow(runner: TargetRunner, control: dist.ProcessGroup | None = None) -> int:
    """Ranks > 0: run every forward rank 0 announces on this rank's shard (its own KV cache and
    graphs), until it stops; returns how many ran."""
    dev = runner.device
    ran = 0
    while True:
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=control)
        op, *sizes = header.tolist()
        if op == STOP:
            return ran
        if op == PREFILL:
            b, t, length, rows = sizes[:4]
            tensors = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in (
                ((b, t), torch.int64), ((b, t), torch.int64), ((b,), torch.int64), ((b, t), torch.int64),
                ((b, t, length), torch.uint8), ((rows,), torch.int64))]
            for tensor in tensors:
                dist.broadcast(tensor, 0)
            tokens, positions, slots, cache_pos, mask, logit_rows = tensors
            prefill_forward(runner.model, runner.cache, tokens, positions, slots, cache_pos, mask.bool(), logit_rows)
        elif op == COUNT:
            tensors = [torch.empty(n, dtype=dtype, device=dev) for n, dtype in (
                (sizes[0], torch.int64), (sizes[1], torch.int64), (sizes[1], torch.int64), (sizes[1], torch.bool))]
            for tensor in tensors:
                dist.broadcast(_wire(tensor), 0)
            runner.penalties.take_prompt(*tensors)
            continue  # no forward
        elif op == VERIFY:
            mode, b, t, length, graphed = MODES[sizes[0]], *sizes[1:5]
            inp = runner.graphs.inputs(b, t) if graphed else BatchInputs(b, t, dev, pinned=False)
            for tensor in inp.buffers:
                dist.broadcast(_wire(tensor), 0)
            # (rank 0's `fill` knew; an eager step here reads it from the received inputs)
            inp.penalized = bool((inp.floats.penalties != inp.floats.penalties.new_tensor(NO_PENALTY)).any())
            if graphed and runner.graphs.capture:
                runner.graphs.replay(mode, b, t, length)
            else:
                with torch.inference_mode():
                    verify_step(runner.model, runner.cache, inp, length, mode, runner.penalties)
        else:
            raise RuntimeError(f"tensor parallel rank: unknown operation {op} from rank 0")
        ran += 1


# ---------------------------------------------------------------------------------------
# The processes of a tensor parallel verifier.
# ---------------------------------------------------------------------------------------

LoadRunner = Callable[..., TargetRunner]  # (config, rank, world) -> that rank's TargetRunner


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for (cuda:N -> cuda:N + r), or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _join(device: torch.device, rank: int, world: int, init: str) -> dist.ProcessGroup:
    """Join the ranks' default group (NCCL on GPUs, gloo on CPUs); returns the gloo control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD


def _follower(index: int, config, world: int, init: str, load_runner: LoadRunner) -> None:
    """Rank index + 1: load its shard, then follow rank 0 until it stops (or goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0, which stops the others
    rank = index + 1
    control = _join(rank_device(config.torch_device(), rank), rank, world, init)
    try:
        follow(load_runner(config, rank, world), control)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def leader(config, load_runner: LoadRunner) -> Iterator[TargetRunner]:
    """Rank 0 of a `config.tensor_parallel`-way verifier: start the other ranks (processes of
    their own, each loading its shard with `load_runner`), join them, and yield rank 0's runner,
    which hands every forward to them; on exit stop them and wait for them."""
    world = config.tensor_parallel
    folder = tempfile.mkdtemp(prefix="ddtree-tp-")
    init = f"file://{folder}/init"
    ranks = mp.start_processes(_follower, args=(config, world, init, load_runner), nprocs=world - 1, join=False,
                               start_method="spawn")
    mirror = None
    try:
        control = _join(rank_device(config.torch_device(), 0), 0, world, init)
        runner = load_runner(config, 0, world)
        mirror = StepMirror(runner.device, control)
        runner.set_mirror(mirror)
        log.info("tensor parallel: %d ranks joined", world)
        yield runner
    finally:
        try:
            if mirror is not None:
                mirror.stop()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for process in ranks.processes:
                process.join(30)
                if process.is_alive():
                    process.kill()
            shutil.rmtree(folder, ignore_errors=True)
