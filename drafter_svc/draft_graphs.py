"""CUDA graphs for the drafter's per-round draft step (context extension + block forward + head).

One draft round at Qwen3-8B size is a few hundred small kernels: run eagerly it is bound by
kernel launches, not by its weights. On CUDA the proposer captures it once per KV length
and replays it every round:

* **Context slots.** Graph addresses are fixed, so every session's `DraftContext` is one slot
  of a pool allocated once, [slots, layers, 2, kv_heads, capacity, D]; the slot index is
  device data. Sessions take a slot in `acquire` and give it back with `DraftContext.close`
  (or when the context is garbage-collected). When every slot is taken a session gets a
  private context and drafts eagerly.
* **Static shapes.** A round extends the context by k new feature rows (0..block_size; the
  first round after the prompt has none), padded to R = block_size rows. All R rows are
  projected and their K/V written at `past .. past + R - 1`; rows k.. are zeros and land past
  the new context length (the next round overwrites them). The block's own K/V are then
  written right after the context, at `past + k .. past + k + T - 1` (T = block_size), and
  attention runs over the slot's first L positions with a mask that hides everything from
  `past + k + T` on: the same keys, values and RoPE positions as the eager
  `DFlashDraftModel.forward`, which concatenates [context, block] instead. Masked columns
  must hold finite values (0 * NaN is NaN): a slot is zeroed when a session takes it, and
  padding rows are zero features.
  The capacity is max_seq_len + block_size, rounded up to `KV_ALIGN`: room for both.
* **Fused kernels.** Per layer one kernel projects-normalises-rotates the new keys (context
  rows and block alike) and stores them with the values into the slot
  (`kernels.layer_ops.project_store`, on fused q/k/v weights), attention reads the slot in
  place (`kernels.slot_attention`), and residual adds are fused into the RMSNorms: the graph
  holds no gathers or scatters and few small kernels.
* **KV-length buckets.** L is the smallest of `kv_buckets` (default: the verifier's
  `auto_kv_buckets` ladder below the capacity) with L >= past + k + T.
* **Static buffers.** One int64 buffer (block tokens, past, new length, slot) and one
  [R, features] buffer in the model's dtype, each filled from a pinned host copy with one
  asynchronous copy (features already on the device are copied device to device). The block
  logits [T - 1, vocab] are a static output; `step` returns a copy.

The prompt's features (the first extension, often hundreds of rows) and rounds that fit no
graph (more than R new rows, or a context past the largest bucket) run the eager code on the
same slot. Graphs are captured at construction, after warm-up runs on a side stream, into one
memory pool; capture writes dummy K/V into slot 0, before any session exists. Replays share
the static buffers, so `step` holds a lock from the fill to the copy of the logits: sessions
in several worker threads take turns.

With `capture=False` (any device, CPU included) the same static-shape code runs eagerly; the
tests use that to check padding, masking and positions without a GPU.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from drafter_svc.draft_model import DFlashDraftModel, DraftContext
from kernels.layer_ops import project_store
from kernels.slot_attention import slot_attention
from common.buckets import KV_ALIGN, auto_kv_buckets
from common.layers import AttentionProjections
from common.staging import StagedInputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftGraphConfig:
    """How many context slots to allocate and which draft graphs to capture."""

    slots: int = 8  # sessions drafting through graphs at once; more get private eager contexts
    kv_buckets: tuple[int, ...] | None = None  # static KV lengths; None = auto_kv_buckets(capacity)
    max_kv_buckets: int = 8  # for the automatic ladder
    warmup_iters: int = 2

    def check(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.kv_buckets is not None and (not self.kv_buckets or any(k < 1 for k in self.kv_buckets)):
            raise ValueError(f"kv_buckets must be positive, got {self.kv_buckets}")
        if self.max_kv_buckets < 1 or self.warmup_iters < 1:
            raise ValueError("max_kv_buckets and warmup_iters must be >= 1")


def context_capacity(max_seq_len: int, block_size: int) -> int:
    """Positions per context slot: max_seq_len plus room for the padded rows and the block."""
    return math.ceil((max_seq_len + block_size) / KV_ALIGN) * KV_ALIGN


class ContextPool:
    """Draft contexts carved out of one preallocated tensor [slots, layers, 2, kv_heads, capacity, D]."""

    def __init__(self, draft: DFlashDraftModel, slots: int, capacity: int):
        cfg, p = draft.cfg, draft.fc.weight
        self.kv = torch.zeros(slots, cfg.num_layers, 2, cfg.num_kv_heads, capacity, cfg.head_dim,
                              device=p.device, dtype=p.dtype)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lock = threading.RLock()  # re-entrant: a collected context's finalizer may run under it

    @property
    def num_slots(self) -> int:
        return self.kv.shape[0]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def acquire(self) -> DraftContext | None:
        """An empty context on a free slot, or None when all are taken."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        kv = self.kv[slot]
        kv.zero_()  # masked columns read stale K/V: never let an earlier session's leak in (a NaN would)
        # A finalizer runs once: on close(), or when a forgotten context (its view) is collected.
        return DraftContext(kv, slot, release=weakref.finalize(kv, self._put, slot))

    def _put(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class _Inputs:
    """The static inputs of a draft round, plus their host staging copies."""

    def __init__(self, block_size: int, rows: int, feature_dim: int, mask_token_id: int, dtype: torch.dtype,
                 device: torch.device, pinned: bool):
        t = self.T = block_size
        self._staging = StagedInputs(device, pinned)
        self.ints, self._host_ints = self._staging.buffer(t + 3, dtype=torch.int64)
        self.features, self._host_features = self._staging.buffer(rows, feature_dim, dtype=dtype)
        self.row_offsets = torch.arange(rows, device=device)
        self.block_offsets = torch.arange(t, device=device)
        self._host_ints[1:t] = mask_token_id

    # Views of the device buffers (what the graphs read).
    @property
    def tokens(self) -> Tensor:
        return self.ints[: self.T]

    @property
    def past(self) -> Tensor:
        return self.ints[self.T: self.T + 1]

    @property
    def new_length(self) -> Tensor:
        return self.ints[self.T + 1: self.T + 2]

    @property
    def slot(self) -> Tensor:
        return self.ints[self.T + 2: self.T + 3]

    def fill(self, slot: int, past: int, root_token: int, features: Tensor) -> None:
        """Stage one round (k <= R new feature rows) and copy it to the device buffers (asynchronously)."""
        t, k = self.T, features.shape[0]
        self._staging.begin()
        ints = self._host_ints
        ints[0] = root_token
        ints[t] = past
        ints[t + 1] = past + k
        ints[t + 2] = slot
        on_device = features.device == self.features.device
        rows = self.features if on_device else self._host_features
        rows[:k] = features
        rows[k:] = 0
        self._staging.commit(skip=(self.features,) if on_device else ())


class DraftGraphs:
    """Captured draft rounds of one proposer's model and head over a `ContextPool`, keyed by KV length."""

    def __init__(self, draft: DFlashDraftModel, embed_tokens: Tensor, lm_head: Tensor, max_seq_len: int,
                 config: DraftGraphConfig = DraftGraphConfig(), *, capture: bool | None = None):
        config.check()
        self.draft, self.embed_tokens, self.lm_head, self.config = draft, embed_tokens, lm_head, config
        self.device = embed_tokens.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        cfg = draft.cfg
        self.block_size = self.rows = cfg.block_size
        self.pool = ContextPool(draft, config.slots, context_capacity(max_seq_len, cfg.block_size))
        capacity = self.pool.capacity
        kv = config.kv_buckets or auto_kv_buckets(capacity, config.max_kv_buckets)
        self.kv_buckets = tuple(sorted({min(k, capacity) for k in kv}))
        feature_dim = draft.fc.weight.shape[1]
        self._inputs = _Inputs(cfg.block_size, self.rows, feature_dim, cfg.mask_token_id, draft.fc.weight.dtype,
                               self.device, pinned=self.capture)
        self._cols = {length: torch.arange(length, device=self.device) for length in self.kv_buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._lock = threading.Lock()
        self._warned_full = False
        self.capture_s = 0.0
        if self.capture:
            self.capture_all()

    # -- sessions ----------------------------------------------------------------------------

    def acquire(self) -> DraftContext | None:
        """An empty context on a free slot, or None (logged once) when all are taken."""
        ctx = self.pool.acquire()
        if ctx is None and not self._warned_full:
            self._warned_full = True
            log.warning("all %d draft context slots are in use: further sessions draft eagerly", self.pool.num_slots)
        return ctx

    # -- shapes ------------------------------------------------------------------------------

    def select(self, past: int, new_rows: int) -> int | None:
        """The KV length L for a round that adds `new_rows` to a context of `past` rows, or None (eager)."""
        if new_rows > self.rows or past + self.rows > self.pool.capacity:
            return None
        length = next((k for k in self.kv_buckets if k >= past + new_rows + self.block_size), None)
        if length is None or (self.capture and length not in self._graphs):
            return None
        return length

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # -- the static-shape computation (captured on CUDA, run eagerly otherwise) ---------------

    def _static(self, length: int) -> Tensor:
        inp, kv = self._inputs, self.pool.kv
        slot = inp.slot
        rows = inp.past + inp.row_offsets  # padded rows too: they land past the new length
        context = self.draft.context_hidden(inp.features)
        cos, sin = self.draft.rotary(rows[None], context.dtype)
        for i, layer in enumerate(self.draft.layers):
            project_store(layer.self_attn, context, cos, sin, kv[:, i, 0], kv[:, i, 1], slot, rows[None],
                          queries=False)
        block = inp.new_length + inp.block_offsets
        visible = (self._cols[length] < inp.new_length + self.block_size).expand(1, self.block_size, length)

        def attention(i: int, attn: AttentionProjections, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            q = project_store(attn, x, cos, sin, kv[:, i, 0], kv[:, i, 1], slot, block[None])
            out = slot_attention(q, kv[:, i, 0], kv[:, i, 1], slot, visible)
            return attn.o_proj(out.reshape(1, self.block_size, -1))

        hidden = self.draft.block_forward(self.embed_tokens[inp.tokens], block[None], attention)
        return hidden[1:] @ self.lm_head.T

    def _run(self, length: int) -> Tensor:
        if not self.capture:
            return self._static(length)
        graph, logits = self._graphs[length]
        graph.replay()
        return logits

    # -- capture -----------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture one graph per KV length that can hold a block; largest first so the pool is sized once."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for length in sorted(self.kv_buckets, reverse=True):
            if length >= self.block_size:
                self._capture(length, pool)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d draft CUDA graphs (kv lengths %s, %d context slots of %d positions) in %.1f s",
                 len(self._graphs), list(self._graphs), self.pool.num_slots, self.pool.capacity, self.capture_s)

    def _capture(self, length: int, pool) -> None:
        inp = self._inputs
        inp.fill(0, 0, 0, inp.features[:0])  # a round without new rows: the block alone, in slot 0
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.config.warmup_iters):
                self._static(length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            logits = self._static(length)
        self._graphs[length] = (graph, logits)

    # -- per round ---------------------------------------------------------------------------

    def step(self, ctx: DraftContext, root_token: int, features: Tensor) -> Tensor | None:
        """Extend the slot's context by `features` [k, n_layers * hidden] and return the block
        logits [block_size - 1, vocab] (a copy), or None if no graph fits (nothing is changed)."""
        if ctx.slot is None or ctx.kv is None:
            raise ValueError("a graph step needs an open context on a pool slot")
        k = features.shape[0]
        length = self.select(ctx.length, k)
        if length is None:
            return None
        with self._lock, torch.inference_mode():
            self._inputs.fill(ctx.slot, ctx.length, root_token, features)
            logits = self._run(length).clone()
        ctx.length += k
        return logits
