"""The batched verify step (forward + accept + KV compaction) and its CUDA graphs.

One step verifies the trees of B sessions in one forward of B x T tokens; each session
keeps its own KV slot, past length, positions (past + depth) and tree mask. The same
static-shape code runs eagerly (CPU, or shapes no graph covers) and under CUDA graphs:

* **Padding.** Trees are padded to a common T nodes. A padding node gets token 0, position
  `past`, no tree links (the accept kernels never reach it) and a mask row that sees the
  prefix and itself only (never another node, and no real node sees it), so every row stays
  finite and real rows are unaffected. Its K/V land at cache positions past + n .. past + T - 1,
  after the real tree, and are never committed: the KV cache keeps `headroom` positions past
  max_seq_len for them. Padding batch rows (a graph's batch bucket larger than the batch) use
  the cache's scratch slot, which no session owns.
* **Buckets.** Under graphs T = 1 + N for N in `GraphConfig.tree_buckets`, B in
  `batch_buckets`, and the attention's static key length L in `kv_buckets` (L >= the
  largest past + T of the batch; the mask hides everything at or past each row's tree). One
  graph per (mode, B, T, L) with B * T <= `max_tokens`; a batch that fits none runs eagerly.
  Eagerly, B, T and L are the batch's own.
* **Static buffers.** Per (B, T): one int64 buffer [B, 4T + 4] (tokens, positions, tree links,
  past, slot, top-k, seed), one float32 buffer [B, T + 4] (coins, final coin, temperature, top-p,
  greedy flag) and the [B, T, T] tree masks, each filled from a pinned host copy with one
  asynchronous copy. The [B, T, L] attention mask and cache positions are computed from them
  inside the graph.
* **Modes.** "greedy" (every row greedy) and a sampled mode, "keyed" (position-keyed) or
  "sample" (the coin walk) (any row sampled; greedy rows take the greedy walk's result, so
  one batch mixes both), run forward, `verifier_svc.accept.accept_batch`
  (one batched sampling + tree-walk call) and the KV compaction of every row's accepted path
  (one batched gather + scatter); one small device-to-host copy returns [accepted count, bonus,
  path] per row. "forward" returns the logits and features of all rows (tests, benchmarks,
  and prefills: a prompt chunk is a chain tree, `TargetRunner.prefill`; its graphs are captured
  at `GraphConfig.prefill_batches` unless "forward" is one of the modes).

Graphs are captured at start-up into one memory pool (largest first), after the warm-up runs
PyTorch needs on a side stream; capture runs dummy trees in the scratch slot, so sessions'
K/V are never touched. Outputs of a replay live in static buffers, overwritten by the next
replay of the same graph; the logits, which rows asking for logprobs read after the replay,
go to one buffer all graphs share (overwritten by the next replay of any graph). The
attention inside is `ddtree_kernels.slot_attention` (see `TargetModel.attention`; in the
deterministic mode `ddtree_kernels.batch_invariant.logical_attention`): it reads each row's cache
slot in place, so slots are data.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.buckets import KV_ALIGN, auto_kv_buckets, round_up
from common.logit_bias import bias_tokens
from common.penalties import NO_PENALTY, PenaltyState, penalize, penalty_values
from common.protocol import MAX_TOKEN_BIAS, SamplingParams, TokenBias
from common.staging import StagedInputs, to_device
from common.tree import DeviceTree, DraftTree, tree_fields
from ddtree_kernels.place_trees import MAX_BLOCK as PLACE_MAX_BLOCK, place_trees
from ddtree_kernels.tree_sampling import kernel_backend
from verifier_svc.accept import accept_batch
from verifier_svc.target_model import KVCache, TargetModel

log = logging.getLogger(__name__)

MODES = ("forward", "greedy", "keyed", "sample")
SAMPLING = ("keyed", "sample")  # position-keyed sampling, or the coin walk


@dataclass(frozen=True)
class GraphConfig:
    """Which verify graphs to capture."""

    # Drafted nodes N; a bucket forwards 1 + N tokens per session: 8, 16, ..., 128, so that a batch's
    # rows fill whole tiles of the GEMMs (17 rows a session cost 8-18% more than 16 at 16 and 32 sessions).
    tree_buckets: tuple[int, ...] = (7, 15, 31, 63, 127)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # rows per step (`VerifyGraphs` caps them)
    kv_buckets: tuple[int, ...] | None = None  # static KV lengths; None = auto_kv_buckets(cache length)
    modes: tuple[str, ...] = ("greedy", "keyed")  # a verifier's steps use greedy and its sampling mode
    max_kv_buckets: int = 4  # for the automatic ladder
    max_tokens: int = 4096  # no graph for B * T above this (eager)
    warmup_iters: int = 2
    # Prompt chunks of this many rows per step at most run through captured "forward" graphs (a
    # chunk is a chain: `TargetRunner.prefill`), at every tree bucket; () = prefills run eagerly.
    prefill_batches: tuple[int, ...] = ()

    def check(self) -> None:
        if not self.tree_buckets or any(b < 0 for b in self.tree_buckets):
            raise ValueError(f"tree_buckets must be non-empty and >= 0, got {self.tree_buckets}")
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be non-empty and >= 1, got {self.batch_buckets}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes}")
        if self.kv_buckets is not None and (not self.kv_buckets or any(k < 1 for k in self.kv_buckets)):
            raise ValueError(f"kv_buckets must be positive, got {self.kv_buckets}")
        if self.max_kv_buckets < 1 or self.warmup_iters < 1 or self.max_tokens < 1:
            raise ValueError("max_kv_buckets, max_tokens and warmup_iters must be >= 1")
        if any(b < 1 for b in self.prefill_batches):
            raise ValueError(f"prefill_batches must be >= 1, got {self.prefill_batches}")

    def token_buckets(self) -> tuple[int, ...]:
        """Static node counts T = 1 + N, ascending."""
        return tuple(sorted({1 + b for b in self.tree_buckets}))


def cache_length(max_seq_len: int, headroom: int) -> int:
    """KV positions per slot: max_seq_len plus room for the padding nodes of the largest tree."""
    return round_up(max_seq_len + headroom, KV_ALIGN)


@dataclass
class VerifyRow:
    """One session's tree in a verify step."""

    slot: int
    past: int  # committed tokens; the root goes to position past
    tree: DraftTree | DeviceTree
    depths: np.ndarray | None  # int64 [n]; None for a DeviceTree (its depths are derived on the device)
    sampling: SamplingParams
    coins: Tensor | None = None  # float32 [n + 1] when sampling with coins
    seed: int = 0  # the session's sampling seed (position-keyed sampling)
    logprobs: int | None = None  # the emitted tokens' logprobs and the top N are wanted (None: not)
    token_bias: tuple[TokenBias, ...] = ()  # logit_bias, and min_tokens' stop ids at -inf
    wants_features: bool = True  # the path rows' features are read (plain decoding reads none)
    # A prompt segment (`TreeVerifier`'s mixed prompts): `tree` holds `segment` prompt tokens with
    # no links, `depths` 0, 1, ..., a causal mask; their K/V stay where the forward writes them,
    # every node's features are read, and no path is accepted. 0: a tree.
    segment: int = 0


_FIELD_ALIGN = 16  # bytes: each field starts on such a boundary, as Triton's kernels are compiled for


class _Fields:
    """Named contiguous views of one flat buffer (a tensor, or a numpy array) of `itemsize`-byte
    elements, field after field, each starting on a 16-byte boundary: (name, shape) pairs. (A
    kernel launched on a field that starts off one compiles a variant of its own.)"""

    def __init__(self, flat: Tensor | np.ndarray, layout: Sequence[tuple[str, tuple[int, ...]]], itemsize: int):
        for (name, shape), offset in zip(layout, _offsets(layout, itemsize)):
            setattr(self, name, flat[offset: offset + math.prod(shape)].reshape(shape))


def _offsets(layout: Sequence[tuple[str, tuple[int, ...]]], itemsize: int) -> list[int]:
    """Each field's first element, and then the buffer's size, in elements."""
    step, offsets = max(_FIELD_ALIGN // itemsize, 1), [0]
    for _, shape in layout:
        offsets.append(-(-(offsets[-1] + math.prod(shape)) // step) * step)
    return offsets


def _layout_size(layout: Sequence[tuple[str, tuple[int, ...]]], itemsize: int) -> int:
    return _offsets(layout, itemsize)[-1]


class BatchInputs:
    """The static inputs of a (B, T) verify step, plus their host staging copies.

    Two flat buffers (int64 and float32) hold the fields one after another, so each field is
    a contiguous view (the kernels want that) and one copy per buffer moves them all."""

    def __init__(self, batch: int, tokens: int, device: torch.device, pinned: bool):
        b, t = self.B, self.T = batch, tokens
        ints = [("tokens", (b, t)), ("positions", (b, t)), ("next_token", (b, t)), ("next_sibling", (b, t)),
                ("past", (b,)), ("slot", (b,)), ("top_k", (b,)), ("seed", (b,)), ("wants_features", (b,)),
                ("segment", (b,)), ("bias_ids", (b, MAX_TOKEN_BIAS)), ("bias_until", (b, MAX_TOKEN_BIAS))]
        floats = [("coins", (b, t)), ("final_coin", (b,)), ("temperature", (b,)), ("top_p", (b,)),
                  ("greedy", (b,)), ("bias", (b, MAX_TOKEN_BIAS)), ("penalties", (b, 3))]
        self._staging = StagedInputs(device, pinned)
        int_buffer, host_ints = self._staging.buffer(_layout_size(ints, 8), dtype=torch.int64)
        float_buffer, host_floats = self._staging.buffer(_layout_size(floats, 4), dtype=torch.float32)
        self.tree_mask, host_mask = self._staging.buffer(b, t, t, dtype=torch.bool)
        # What the graphs read.
        self.ints, self.floats = _Fields(int_buffer, ints, 8), _Fields(float_buffer, floats, 4)
        self.buffers = (int_buffer, float_buffer, self.tree_mask)  # the whole step input (tensor parallel ranks copy it)
        # `fill` writes the host twins through numpy views: a few microseconds an operation, where
        # torch's small CPU operations cost several times that (a step's host work is on its critical path).
        self._host_ints = _Fields(host_ints.numpy(), ints, 8)
        self._host_floats = _Fields(host_floats.numpy(), floats, 4)
        self._host_mask = host_mask.numpy()
        self.arange = torch.arange(t, device=device)
        self._eye = np.eye(t, dtype=bool)
        # Where a graph leaves the path rows' features: one buffer per (B, T) that every graph of
        # that shape shares, rather than one output per graph (set by VerifyGraphs).
        self.features_out: Tensor | None = None
        # Where the forward writes the logits [B, T, V] (set by VerifyGraphs: a view of one buffer
        # all graphs share), so that they outlive the replay for the rows that ask for logprobs.
        self.logits_out: Tensor | None = None
        # Whether some row has repetition penalties (`fill`); an eager step without runs none of
        # their work. Captured steps always run it (`always_penalize`, set by VerifyGraphs).
        self.penalized = False
        self.always_penalize = False

    def fill(self, rows: Sequence[VerifyRow], masks: Tensor, scratch_slot: int) -> None:
        """Stage the rows (masks bool [len(rows), W, W] with W <= T: each tree's ancestor mask in
        the top-left block, padding rows seeing themselves only, as `common.tree.ancestor_masks`
        builds them) and copy them to the device buffers asynchronously; batch rows past
        len(rows) are padding. A few whole-batch operations, whatever the batch size. The trees
        of rows that hold a `DeviceTree` (whose masks are ignored) are staged as root-only padding,
        then written over on the device (`_place_device_trees`)."""
        self._staging.begin()
        i, f, mask = self._host_ints, self._host_floats, self._host_mask
        b, width = len(rows), masks.shape[-1]
        on_host = [j for j, r in enumerate(rows) if not isinstance(r.tree, DeviceTree)]
        sizes = np.array([rows[j].tree.num_nodes for j in on_host], dtype=np.int64)
        row_of = np.repeat(np.array(on_host, dtype=np.int64), sizes)  # batch row of every node
        col_of = np.arange(row_of.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        past = np.array([r.past for r in rows])
        for field, value in ((i.tokens, 0), (i.next_token, -1), (i.next_sibling, -1), (i.past, 0), (i.top_k, 0),
                             (i.seed, 0), (i.slot, scratch_slot), (i.positions, 0), (i.bias_ids, 0),
                             (i.bias_until, 0), (i.wants_features, 0), (i.segment, 0)):
            field.fill(value)
        i.positions[:b] = past[:, None]
        i.wants_features[:b] = [r.wants_features for r in rows]
        i.segment[:b] = [r.segment for r in rows]
        if on_host:
            trees = [rows[j].tree for j in on_host]
            i.tokens[row_of, col_of] = torch.cat([t.tokens for t in trees]).numpy()
            i.next_token[row_of, col_of] = torch.cat([t.next_token for t in trees]).numpy()
            i.next_sibling[row_of, col_of] = torch.cat([t.next_sibling for t in trees]).numpy()
            i.positions[row_of, col_of] += np.concatenate([rows[j].depths for j in on_host])
        i.past[:b] = past
        i.slot[:b] = [r.slot for r in rows]
        f.bias.fill(0.0)
        for j, r in enumerate(rows):
            if r.token_bias:  # (the rest of the row's entries add 0)
                n = len(r.token_bias)
                i.bias_ids[j, :n] = [e.token for e in r.token_bias]
                i.bias_until[j, :n] = [e.until for e in r.token_bias]
                f.bias[j, :n] = [e.value for e in r.token_bias]
        f.penalties[:] = NO_PENALTY
        penalized = [j for j, r in enumerate(rows) if r.sampling.penalized]
        self.penalized = bool(penalized)
        if penalized:
            f.penalties[penalized] = penalty_values([rows[j].sampling for j in penalized])
        mask[:] = self._eye
        mask[:b, :width, :width] = masks.numpy()
        for field, value in ((f.coins, 0.5), (f.final_coin, 0.5), (f.temperature, 1.0), (f.top_p, 1.0),
                             (f.greedy, 1.0)):
            field.fill(value)
        sampled = [j for j, r in enumerate(rows) if not r.sampling.greedy]
        if sampled:
            i.top_k[sampled] = [rows[j].sampling.top_k for j in sampled]
            i.seed[sampled] = [rows[j].seed for j in sampled]
            with np.errstate(over="ignore"):  # a finite temperature past float32's range reads as inf, as before
                f.temperature[sampled] = [rows[j].sampling.temperature for j in sampled]
            f.top_p[sampled] = [rows[j].sampling.top_p for j in sampled]
            f.greedy[sampled] = 0.0
            for j in sampled:
                if rows[j].coins is not None:
                    n = rows[j].tree.num_nodes
                    f.coins[j, :n] = rows[j].coins[:n].numpy()
                    f.final_coin[j] = float(rows[j].coins[n])
        self._staging.commit()
        if len(on_host) < b:
            self._place_device_trees(rows)

    def _place_device_trees(self, rows: Sequence[VerifyRow]) -> None:
        """Write the trees of the rows that hold a `DeviceTree` into the device buffers, behind
        the staged copy: tokens, links, positions (past + depth) and masks, built there from the
        trees' parents, each cut to its host count (`DeviceTree.num_nodes`). One kernel launch
        (`ddtree_kernels.place_trees`) where Triton runs, else `common.tree.tree_fields`; nothing
        waits for the device."""
        groups: dict[int, list[int]] = {}  # id of the DeviceTrees -> batch rows
        for j, r in enumerate(rows):
            if isinstance(r.tree, DeviceTree):
                groups.setdefault(id(r.tree.trees), []).append(j)
        ints, device = self.ints, self.tree_mask.device
        for batch_rows in groups.values():
            trees = rows[batch_rows[0]].tree.trees.on(device)
            width = min(1 + trees.width, self.T)
            index = to_device([[rows[j].tree.row for j in batch_rows], batch_rows,
                               [rows[j].tree.num_nodes for j in batch_rows]], device, torch.int64)
            if kernel_backend(device) == "triton" and width <= PLACE_MAX_BLOCK:
                place_trees(trees.tokens, trees.parents, trees.counts, index, trees.max_depth, width, ints.tokens,
                            ints.positions, ints.next_token, ints.next_sibling, ints.past, self.tree_mask)
                continue
            src, dst, limit = index
            counts = trees.counts.index_select(0, src)
            counts = torch.where(counts < 0, 1, torch.minimum(counts, limit)).clamp(1, width)  # a NaN row: the root
            next_token, next_sibling, depths, masks = tree_fields(trees.parents.index_select(0, src)[:, :width],
                                                                  counts, trees.max_depth)
            valid = self.arange[None, :width] < counts[:, None]
            ints.tokens[dst, :width] = torch.where(valid, trees.tokens.index_select(0, src)[:, :width], 0)
            ints.next_token[dst, :width] = next_token
            ints.next_sibling[dst, :width] = next_sibling
            ints.positions[dst, :width] = ints.past.index_select(0, dst)[:, None] + depths
            self.tree_mask[dst, :width, :width] = masks

    def fill_dummy(self, scratch_slot: int) -> None:
        """Valid trees for warm-up and capture: B chains of T token-0 nodes in the scratch slot."""
        t = self.T
        chain = DraftTree.from_parents([0] * t, list(range(-1, t - 1)))
        row = VerifyRow(scratch_slot, 0, chain, np.arange(t), SamplingParams(temperature=1.0),
                        torch.full((t + 1,), 0.5))
        masks = torch.ones(t, t, dtype=torch.bool).tril().expand(self.B, t, t)
        self.fill([row] * self.B, masks, scratch_slot)


def verify_step(model: TargetModel, cache: KVCache, inp: BatchInputs, length: int, mode: str,
                penalties: PenaltyState | None = None):
    """The static-shape step over key length `length` (captured on CUDA, eager otherwise).
    With `penalties` (the slots' token counts) the rows' repetition penalties apply, and the
    accepted paths are counted.

    "forward": ForwardOutput of all B x T rows. "greedy" / "keyed" / "sample": (result int64 [B, T + 2] =
    [accepted, bonus, path padded with -1] per row, features of the path rows [B, T, F], logits
    [B, T, V] of every node, rows_first int64 [B * T]: the order of the features' B * T rows that
    puts the path rows of the rows that want them first, in row order: `rows_first_order`), with each
    row's accepted K/V already compacted to [past, past + 1 + accepted). A prompt segment's row
    (`VerifyRow.segment`) has accepted -1 (nothing moved or counted: its K/V stay where they were
    written), and its features and rows-first rows are its first `segment` nodes'.
    """
    b, t = inp.B, inp.T
    i, f = inp.ints, inp.floats
    cols = torch.arange(length, device=inp.arange.device)
    past = i.past[:, None]
    rel = cols[None] - past  # [B, L]: column index inside the tree, valid for 0 <= rel < T
    inside = (rel >= 0) & (rel < t)
    local = torch.gather(inp.tree_mask, 2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, length))
    mask = (local & inside[:, None, :]) | (cols[None] < past)[:, None, :]  # [B, T, L]
    cache_pos = past + inp.arange[None]
    out = model(i.tokens, i.positions, cache, i.slot, cache_pos, mask, logits_out=inp.logits_out)
    if mode == "forward":
        return out
    bias_tokens(out.logits, i.positions + 1, i.bias_ids, f.bias, i.bias_until)
    penalties = penalties if inp.penalized or inp.always_penalize else None
    if penalties is not None:
        penalize(out.logits, penalties, i.slot, i.tokens, inp.tree_mask, f.penalties)
    result, features = accept_batch(mode, i.tokens, i.next_token, i.next_sibling, out.logits, out.features,
                                    greedy=f.greedy > 0.5, coins=f.coins, final_coin=f.final_coin,
                                    temperature=f.temperature, top_k=i.top_k, top_p=f.top_p, seeds=i.seed,
                                    positions=i.positions)
    segment = i.segment > 0  # prompt segments: no path (the KV compaction and the counts skip them), every row
    result[:, 0].masked_fill_(segment, -1)
    features = torch.where(segment[:, None, None], out.features, features)
    # KV compaction: node path[i] -> position past + i for i <= accepted; the rest copy past onto itself.
    path = result[:, 2:]
    keep = inp.arange[None] <= result[:, :1]
    src = past + torch.where(keep, path, 0)
    dst = past + torch.where(keep, inp.arange[None], 0)
    cache.move(i.slot, src, dst)
    if penalties is not None:  # the path's tokens (root and accepted) join the committed context
        penalties.count_paths(i.slot, i.tokens, result, f.penalties)
    if inp.features_out is not None:
        inp.features_out.copy_(features)
        features = inp.features_out
    lengths = torch.where(segment, i.segment, result[:, 0] + 1) * i.wants_features
    return result, features, out.logits, rows_first_order(lengths, t)


def rows_first_order(lengths: Tensor, width: int) -> Tensor:
    """The order of B * width rows (row b's `width` rows after row b - 1's) that puts the first
    lengths[b] rows of every row b first, in row order, and the others after: int64 [B * width]
    on the lengths' device (lengths: int64 [B] there). No wait for the lengths: a step computes
    it on the device, so the host reads each session's path rows as one block without a copy."""
    behind = torch.arange(width, device=lengths.device) >= lengths[:, None]  # [B, W]: a row past its path
    return torch.argsort(behind.flatten().to(torch.int32), stable=True)


class VerifyGraphs:
    """Captured verify steps of one model over one KV cache, keyed by (mode, B, T, L)."""

    def __init__(self, model: TargetModel, cache: KVCache, max_seq_len: int, scratch_slot: int,
                 config: GraphConfig = GraphConfig(), *, capture: bool | None = None,
                 penalties: PenaltyState | None = None):
        config.check()
        self.model, self.cache, self.config, self.scratch_slot = model, cache, config, scratch_slot
        self.penalties = penalties  # the slots' token counts (`verify_step`)
        self.device = cache.k.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.token_buckets = tuple(t for t in config.token_buckets() if max_seq_len + t <= cache.max_seq_len)
        sessions = cache.num_slots - 1
        # Rows: a step's trees, one a session, and the prompt segments it may take in beside them
        # (`TreeVerifier`'s mixed prompts): half as many again, at least 8 (a 128-token prompt in
        # 16-node rows). A larger bucket would hold more padding than the prefill it spares.
        rows = sessions + max(8, sessions // 2)
        self.batch_buckets = tuple(sorted({min(b, rows) for b in config.batch_buckets}))
        # Batch buckets of the "forward" graphs: every batch bucket when it is one of the modes (tests,
        # benchmarks), else the prefill buckets alone (`TargetRunner.prefill`).
        self.forward_batches = (self.batch_buckets if "forward" in config.modes
                                else tuple(sorted({min(b, sessions) for b in config.prefill_batches})))
        kv = config.kv_buckets or auto_kv_buckets(cache.max_seq_len, config.max_kv_buckets)
        self.kv_buckets = tuple(sorted({min(k, cache.max_seq_len) for k in kv}))
        self._inputs: dict[tuple[int, int], BatchInputs] = {}
        # One logits buffer for the largest (B, T); every shape's logits are a view of its front.
        most = max((b * t for b in self.batch_buckets + self.forward_batches for t in self.token_buckets
                    if b * t <= config.max_tokens), default=0)
        self._logits = torch.empty(most * model.cfg.vocab_size, device=self.device, dtype=model.lm_head.weight.dtype)
        self._graphs: dict[tuple[str, int, int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None
        # Tensor parallelism: hands each step's inputs to the other ranks first (`StepMirror`); None alone.
        self.mirror = None
        self.capture_s = 0.0
        if self.capture:
            self.capture_all()

    # -- shapes ----------------------------------------------------------------------------

    def select(self, mode: str, batch: int, nodes: int, end: int) -> tuple[int, int, int] | None:
        """(B, T, L) for `batch` trees of at most `nodes` nodes whose last position is below
        `end` (max past + nodes), or None when no captured graph fits (eager)."""
        b = next((x for x in (self.forward_batches if mode == "forward" else self.batch_buckets) if x >= batch), None)
        t = next((x for x in self.token_buckets if x >= nodes), None)
        if b is None or t is None or b * t > self.config.max_tokens:
            return None
        length = next((k for k in self.kv_buckets if k >= end - nodes + t), None)
        if length is None or (self.capture and (mode, b, t, length) not in self._graphs):
            return None
        return b, t, length

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def inputs(self, batch: int, tokens: int) -> BatchInputs:
        key = (batch, tokens)
        if key not in self._inputs:
            inp = BatchInputs(batch, tokens, self.device, pinned=self.capture)
            inp.always_penalize = self.capture
            if self.capture:
                inp.features_out = torch.empty(batch, tokens, self.model.feature_dim, device=self.device,
                                               dtype=self.cache.k.dtype)
                inp.logits_out = self._logits[: batch * tokens * self.model.cfg.vocab_size].view(batch, tokens, -1)
            self._inputs[key] = inp
        return self._inputs[key]

    # -- capture -----------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every (mode, B, T, L) of the config; largest first so the pool is sized once."""
        start = time.perf_counter()
        gc.collect()  # dead graphs freed by the collector in the middle of a capture would break it
        self._pool = torch.cuda.graph_pool_handle()
        modes = [(m, self.batch_buckets) for m in self.config.modes if m != "forward"]
        modes.append(("forward", self.forward_batches))
        keys = [(m, b, t, k) for m, batches in modes for b in batches for t in self.token_buckets
                for k in self.kv_buckets if t <= k and b * t <= self.config.max_tokens]
        for key in sorted(keys, key=lambda key: (-key[1] * key[2] * key[3], key)):
            self._capture(*key)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d verify CUDA graphs (modes %s, batches %s, nodes %s, kv lengths %s%s) in %.1f s",
                 len(self._graphs), ",".join(self.config.modes), list(self.batch_buckets), list(self.token_buckets),
                 list(self.kv_buckets), f"; prefills of batches {list(self.forward_batches)}"
                 if self.forward_batches and "forward" not in self.config.modes else "", self.capture_s)

    def _capture(self, mode: str, b: int, t: int, length: int) -> None:
        inp = self.inputs(b, t)
        inp.fill_dummy(self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.config.warmup_iters):
                verify_step(self.model, self.cache, inp, length, mode, self.penalties)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            outputs = verify_step(self.model, self.cache, inp, length, mode, self.penalties)
        self._graphs[(mode, b, t, length)] = (graph, outputs)

    def replay_dummy(self, b: int, t: int) -> bool:
        """Replay the greedy graph of batch bucket b and t tokens at its shortest KV length on
        dummy trees in the scratch slot (for timing); False if there is none."""
        length = next((k for k in self.kv_buckets if k >= t and ("greedy", b, t, k) in self._graphs), None)
        if length is None:
            return False
        inp = self.inputs(b, t)
        inp.fill_dummy(self.scratch_slot)
        if self.mirror is not None:
            self.mirror.verify("greedy", inp, length, graphed=True)
        self.replay("greedy", b, t, length)
        return True

    def replay(self, mode: str, b: int, t: int, length: int):
        """Replay the captured step (mode, B, T, L) on what its inputs hold; its outputs."""
        graph, outputs = self._graphs[(mode, b, t, length)]
        graph.replay()
        return outputs

    # -- per step ----------------------------------------------------------------------------

    def run(self, mode: str, rows: Sequence[VerifyRow], masks: Tensor):
        """The step's outputs (see `verify_step`; static buffers under graphs), or None if no graph fits."""
        nodes = max(r.tree.num_nodes for r in rows)
        shape = self.select(mode, len(rows), nodes, max(r.past for r in rows) + nodes)
        if shape is None:
            return None
        b, t, length = shape
        inp = self.inputs(b, t)
        inp.fill(rows, masks, self.scratch_slot)
        if self.mirror is not None:
            self.mirror.verify(mode, inp, length, graphed=True)
        if not self.capture:
            with torch.inference_mode():
                return verify_step(self.model, self.cache, inp, length, mode, self.penalties)
        return self.replay(mode, b, t, length)
