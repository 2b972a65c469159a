"""The batched draft step (context extension + block forward + head) and its CUDA graphs.

One step drafts a block for B sessions at once. Each session owns a slot of the draft's
`DraftKVPool`; the step appends the session's new target feature rows to its context (at
most block_size rows: the root and accepted tokens of the last round), writes the block's
K/V right after, attends over the slot and returns the block logits [B, block_size - 1, V].
The same static-shape code runs eagerly (CPU, the prompt's extension, shapes no graph
covers) and under CUDA graphs:

* **Padding.** New rows are padded to R = block_size with zero features; their K/V land past
  the new context length and the block's K/V overwrite them (the slot's capacity is
  max_seq_len + 2 * block_size, rounded up to `KV_ALIGN`). Padding batch rows (a graph's
  batch bucket larger than the batch) use the pool's scratch slot, which no session owns.
  Masked columns must hold finite values (0 * NaN is NaN): a slot is zeroed when a session
  takes it.
* **Buckets.** One graph per (B, L): B in `DraftGraphConfig.batch_buckets`, L (the key length
  attention runs over, >= the largest context + R + block_size of the batch) in `kv_buckets`
  (default: the `auto_kv_buckets` ladder of the capacity).
* **Fused kernels.** Per layer one kernel projects-normalises-rotates the new keys (context
  rows and block alike) and stores them with the values into the slot
  (`ddtree_kernels.layer_ops.project_store`, on fused q/k/v weights), attention reads the slot in
  place (`ddtree_kernels.slot_attention`), and residual adds are fused into the RMSNorms.
* **Static buffers.** Per batch bucket one int64 buffer (block tokens, past, new length, slot)
  and one [B, R, features] buffer in the model's dtype, filled from pinned host copies with
  one asynchronous copy each. The logits are a static output; `step` returns a copy.

Graphs are captured at construction into one memory pool, after warm-up runs on a side
stream, with dummy rows in the scratch slot. With `capture=False` (any device, CPU
included) the same code runs eagerly at the batch's own shape.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.buckets import KV_ALIGN, auto_kv_buckets, round_up
from common.protocol import VerifiedRows
from common.staging import StagedInputs, stack_rows
from drafter_svc.draft_model import DFlashDraftModel, DraftKVPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftGraphConfig:
    """Which draft graphs to capture."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # sessions per step (capped by the slots)
    kv_buckets: tuple[int, ...] | None = None  # static KV lengths; None = auto_kv_buckets(capacity)
    max_kv_buckets: int = 4  # for the automatic ladder
    warmup_iters: int = 2

    def check(self) -> None:
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be non-empty and >= 1, got {self.batch_buckets}")
        if self.kv_buckets is not None and (not self.kv_buckets or any(k < 1 for k in self.kv_buckets)):
            raise ValueError(f"kv_buckets must be positive, got {self.kv_buckets}")
        if self.max_kv_buckets < 1 or self.warmup_iters < 1:
            raise ValueError("max_kv_buckets and warmup_iters must be >= 1")


def feature_dim(draft: DFlashDraftModel, projected: bool) -> int:
    """Width of the feature rows a step takes: context rows (hidden) or raw target features."""
    return draft.fc.weight.shape[0] if projected else draft.fc.weight.shape[1]


def context_capacity(max_seq_len: int, block_size: int) -> int:
    """Positions per context slot: max_seq_len plus room for the padded rows and the block."""
    return round_up(max_seq_len + 2 * block_size, KV_ALIGN)


@dataclass
class DraftRow:
    """One session in a draft step: its slot, context rows so far, root token and new rows."""

    slot: int
    past: int
    root: int
    features: Tensor  # [k, feature_dim], k <= block_size


class DraftInputs:
    """The static inputs of a B-row draft step with R new rows each, plus host staging copies."""

    def __init__(self, batch: int, rows: int, block_size: int, feature_dim: int, mask_token_id: int,
                 dtype: torch.dtype, device: torch.device, pinned: bool, projected: bool = False):
        self.B, self.R, self.T = batch, rows, block_size
        self.mask_token_id = mask_token_id
        self.projected = projected  # the rows are context rows (the verifier applied fc + hidden_norm)
        self._staging = StagedInputs(device, pinned)
        scalars = batch * (block_size + 3)  # tokens, then past, new_length and slot
        ints, host_ints = self._staging.buffer(scalars + batch * rows, dtype=torch.int64)
        self.tokens = ints[: batch * block_size].view(batch, block_size)
        self.past, self.new_length, self.slot = ints[batch * block_size: scalars].view(3, batch)
        # Where each new feature row goes among the B * R rows of `features` (`fill`): the step
        # does not read it, the copy of rows already on the device does (staged with the rest).
        self.row_index = ints[scalars:]
        # `fill` writes the host twin through numpy views: a few microseconds an operation, where
        # torch's small CPU operations cost several times that (on the drafter's critical path).
        self._host_ints = host_ints.numpy()
        self._host_row_index = self._host_ints[scalars:]
        self.features, self._host_features = self._staging.buffer(batch, rows, feature_dim, dtype=dtype)
        # Where a graph leaves its logits: one buffer per batch bucket that the graphs of every KV
        # length share, rather than one output per graph (set by DraftGraphs).
        self.logits_out: Tensor | None = None

    def fill(self, rows: Sequence[DraftRow], scratch_slot: int, verified: VerifiedRows | None = None) -> None:
        """Stage the rows (batch rows past len(rows) are padding) and copy them over asynchronously.

        `verified`: the rows' roots and new feature rows are a verify step's, still on the device
        (row i of it for rows[i], whose own root and features are then unused): they are copied
        from there behind the staged values, without the host reading them."""
        b, t = self.B, self.T
        self._staging.begin()
        ints = self._host_ints
        tokens = ints[: b * t].reshape(b, t)
        past, new_length, slot = ints[b * t: b * (t + 3)].reshape(3, b)
        tokens.fill(self.mask_token_id)
        tokens[:, 0] = 0
        past.fill(0)
        new_length.fill(0)
        slot.fill(scratch_slot)
        # Rows past a session's k new ones keep whatever finite values an earlier step left: their
        # K/V land where the block's K/V overwrite them, so they need no zeroing.
        n, on_device = len(rows), ()  # on_device: the device buffers written in place (not from a twin)
        placed = None  # rows on the device, copied into `features` behind the staged values (their index)
        if n:
            past[:n] = [row.past for row in rows]
            slot[:n] = [row.slot for row in rows]
        if n and verified is not None:  # roots, lengths and rows: from the verify, after the commit
            on_device = (self.features,)
        elif n:
            counts = [row.features.shape[0] for row in rows]
            tokens[:n, 0] = [row.root for row in rows]
            new_length[:n] = past[:n] + counts
            if max(counts) > self.R:
                raise ValueError(f"{max(counts)} new feature rows for a session, the step takes {self.R}")
            if any(counts):
                total, width = sum(counts), self.features.shape[-1]
                index = self._host_row_index[:total]  # row i's k rows go to i * R .. i * R + k - 1
                starts = np.arange(n) * self.R - (np.cumsum(counts) - counts)
                index[:] = np.arange(total) + np.repeat(starts, counts)
                new = stack_rows([row.features for row in rows], width, self.features.dtype)
                if new.device == self.features.device:  # on the draft's device already (on a GPU: no host trip)
                    placed = new.to(self.features.dtype)
                    on_device = (self.features,)
                else:  # on the host, for a draft on a GPU: into the staged twin
                    feats = self._host_features
                    feats.view(-1, width).index_copy_(0, torch.from_numpy(index), new.cpu().to(feats.dtype))
        self._staging.commit(skip=on_device)
        if placed is not None:  # behind the copy of the index
            self.features.view(-1, self.features.shape[-1]).index_copy_(0, self.row_index[: placed.shape[0]], placed)
        if n and verified is not None:
            self._take_verified(n, verified)

    def _take_verified(self, n: int, verified: VerifiedRows) -> None:
        """The first n rows' roots (the bonus tokens), new lengths (past + the accepted path) and
        feature rows (the path's), from a verify step's results on the device."""
        result, features = verified.result, verified.features
        if result.shape[0] != n or features.shape[1] > self.R:
            raise ValueError(f"{result.shape[0]} verified rows of paths up to {features.shape[1]} for {n} sessions, "
                             f"the step takes {self.R} new rows each")
        self.tokens[:n, 0].copy_(result[:, 1])
        self.new_length[:n].copy_(self.past[:n] + result[:, 0] + 1)
        self.features[:n, : features.shape[1]].copy_(features)


def draft_step(draft: DFlashDraftModel, embed_tokens: Tensor, lm_head: Tensor, kv: Tensor, inp: DraftInputs,
               length: int) -> Tensor:
    """The static-shape step over key length `length`: block logits [B, block_size - 1, V]."""
    if inp.R:
        draft.extend(kv, inp.slot, inp.past, inp.features, inp.projected)
    hidden = draft.block_hidden(kv, inp.slot, inp.new_length, embed_tokens[inp.tokens], length)
    # One [B * (T - 1), hidden] x [hidden, V] GEMM. (A 3-D matmul into a 3-D `out` runs as a batched
    # GEMM that reads the head once per session: 9 ms instead of 1 at 32 sessions on an H200.)
    rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
    if inp.logits_out is None:
        return (rows @ lm_head.T).view(hidden.shape[0], -1, lm_head.shape[0])
    torch.matmul(rows, lm_head.T, out=inp.logits_out.view(rows.shape[0], -1))
    return inp.logits_out


class DraftGraphs:
    """Captured draft steps of one model and head over a `DraftKVPool`, keyed by (B, L)."""

    def __init__(self, draft: DFlashDraftModel, embed_tokens: Tensor, lm_head: Tensor, pool: DraftKVPool,
                 scratch_slot: int, config: DraftGraphConfig = DraftGraphConfig(), *, capture: bool | None = None,
                 projected: bool = False):
        config.check()
        self.draft, self.embed_tokens, self.lm_head, self.config = draft, embed_tokens, lm_head, config
        self.projected = projected
        self.pool, self.scratch_slot = pool, scratch_slot
        self.device = embed_tokens.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        cfg = draft.cfg
        self.block_size = cfg.block_size
        self.batch_buckets = tuple(sorted({min(b, pool.num_slots - 1) for b in config.batch_buckets}))
        kv = config.kv_buckets or auto_kv_buckets(pool.capacity, config.max_kv_buckets)
        self.kv_buckets = tuple(sorted({min(k, pool.capacity) for k in kv}))
        self._inputs: dict[int, DraftInputs] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.capture_s = 0.0
        if self.capture:
            self.capture_all()

    def inputs(self, batch: int) -> DraftInputs:
        if batch not in self._inputs:
            cfg = self.draft.cfg
            inp = DraftInputs(batch, self.block_size, self.block_size, feature_dim(self.draft, self.projected),
                              cfg.mask_token_id, self.draft.fc.weight.dtype, self.device, pinned=self.capture,
                              projected=self.projected)
            if self.capture:
                inp.logits_out = torch.empty(batch, self.block_size - 1, self.lm_head.shape[0], device=self.device,
                                             dtype=self.lm_head.dtype)
            self._inputs[batch] = inp
        return self._inputs[batch]

    def select(self, batch: int, end: int) -> tuple[int, int] | None:
        """(B, L) for `batch` rows whose contexts end below `end` (max past), or None (eager)."""
        b = next((x for x in self.batch_buckets if x >= batch), None)
        length = next((k for k in self.kv_buckets if k >= end + 2 * self.block_size), None)
        if b is None or length is None or (self.capture and (b, length) not in self._graphs):
            return None
        return b, length

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture_all(self) -> None:
        """Capture one graph per (B, L) that can hold a block; largest first so the pool is sized once."""
        start = time.perf_counter()
        gc.collect()  # dead graphs freed by the collector in the middle of a capture would break it
        pool = torch.cuda.graph_pool_handle()
        keys = [(b, k) for b in self.batch_buckets for k in self.kv_buckets if k >= 2 * self.block_size]
        for b, length in sorted(keys, key=lambda key: (-key[0] * key[1], key)):
            self._capture(b, length, pool)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d draft CUDA graphs (batches %s, kv lengths %s, %d context slots of %d positions) "
                 "in %.1f s", len(self._graphs), list(self.batch_buckets), list(self.kv_buckets),
                 self.pool.num_slots - 1, self.pool.capacity, self.capture_s)

    def _capture(self, b: int, length: int, pool) -> None:
        inp = self.inputs(b)
        inp.fill([], self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.config.warmup_iters):
                draft_step(self.draft, self.embed_tokens, self.lm_head, self.pool.kv, inp, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            logits = draft_step(self.draft, self.embed_tokens, self.lm_head, self.pool.kv, inp, length)
        self._graphs[(b, length)] = (graph, logits)

    def run(self, rows: Sequence[DraftRow], verified: VerifiedRows | None = None) -> Tensor | None:
        """Block logits [len(rows), block_size - 1, V] (a copy), or None if no graph fits;
        `verified` as in `DraftInputs.fill`."""
        widest = verified.features.shape[1] if verified is not None else max(r.features.shape[0] for r in rows)
        if widest > self.block_size:
            return None
        shape = self.select(len(rows), max(r.past for r in rows))
        if shape is None:
            return None
        b, length = shape
        inp = self.inputs(b)
        inp.fill(rows, self.scratch_slot, verified)
        with torch.inference_mode():
            if not self.capture:
                return draft_step(self.draft, self.embed_tokens, self.lm_head, self.pool.kv, inp, length)[: len(rows)]
            graph, logits = self._graphs[(b, length)]
            graph.replay()
            return logits[: len(rows)].clone()
