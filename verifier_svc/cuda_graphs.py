"""CUDA graphs for the verifier's tree-verify forward (and, optionally, the accept step).

A verify pass at batch 1 is launch-bound when run eagerly (thousands of small kernels per
pass), so on CUDA the runner captures it once per shape and replays it every round:

* **Token buckets.** A tree of n = 1 + N nodes is padded to the smallest bucket
  T = 1 + B (B in `GraphConfig.tree_buckets`, default 8, 16, 32, 64, 128) with T >= n.
  Padding rows get token 0, position `past`, no tree links (the accept kernels never reach
  them) and a mask row that sees the prefix and themselves only (never another node, and
  no real node sees them), so every row stays finite and real rows are unaffected. Their
  K/V are written at cache positions past + n .. past + T - 1, after the real tree, and are
  never committed (the next round overwrites them). The KV cache therefore holds
  `cache_length(max_seq_len, config)` positions: max_seq_len plus the largest bucket.
* **KV-length buckets.** Attention runs over a static key length L (a `kv_buckets` value
  >= past + T), with the mask hiding everything at or past the tree; L = the cache length
  works for every round, smaller buckets save the K/V gather and attention over unused
  positions (`auto_kv_buckets`: a geometric ladder from the cache length down to 256).
* **Static buffers.** Per token bucket: one int64 buffer (tokens, positions, tree links,
  past, slot, top-k), one float32 buffer (coins, temperature, top-p) and the [T, T] tree
  mask, each filled from a pinned host copy with one asynchronous copy. Cache positions and
  the [T, L] attention mask are computed from them inside the graph.
* **Modes.** "forward" replays the target forward only (logits and features of all T rows;
  the caller slices the first n). "greedy" and "sample" replay forward + accept in one graph:
  argmax + `verify_tree_greedy`, or `process_probs` + `tree_speculative_sampling_target_only`,
  then the bonus-token lookup and the gather of the accepted rows' features; one small
  device-to-host copy returns [accepted count, bonus, accepted path].

Graphs are captured once, at start-up (`VerifyGraphs.capture_all`, called by the
constructor on CUDA), after the warm-up runs that PyTorch requires on a side stream. The
capture writes dummy K/V into slot 0, so it must happen before any session is opened. All
graphs share one memory pool; they are replayed one at a time by the model worker thread.
Outputs of a replay live in static buffers and are overwritten by the next replay of the same
graph: use them (or copy them) before the next verify.

With `capture=False` (any device, CPU included) the same static-shape code runs eagerly;
the tests use that to check the padding logic without a GPU.

`slot_attention` (used when `TargetModel.attention == "triton"`, opt-in) is an attention
kernel for this path: it reads K/V of the session's slot in place instead of gathering them,
so the slot stays data in the captured graph. On an H200 it is break-even with the default
SDPA path so far (bench/RESULTS.md); a split-KV version is the next step.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from common.protocol import SamplingParams
from common.tree import DraftTree
from verifier_svc.accept import AcceptResult, Stage, accept_step, no_stage, unpack_accept
from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel

log = logging.getLogger(__name__)

DEFAULT_TREE_BUCKETS = (8, 16, 32, 64, 128)
MODES = ("forward", "greedy", "sample")
KV_ALIGN = 128  # static KV lengths are multiples of this (aligned masks for the attention kernels)
MIN_KV_BUCKET = 256


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class GraphConfig:
    """Which verify graphs to capture."""

    tree_buckets: tuple[int, ...] = DEFAULT_TREE_BUCKETS  # drafted nodes N; a bucket forwards 1 + N tokens
    kv_buckets: tuple[int, ...] | None = None  # static KV lengths; None = auto_kv_buckets(cache length)
    modes: tuple[str, ...] = ("forward",)  # "forward", "greedy", "sample" (see the module doc)
    max_kv_buckets: int = 8  # for the automatic ladder
    warmup_iters: int = 2

    def check(self) -> None:
        if not self.tree_buckets or any(b < 0 for b in self.tree_buckets):
            raise ValueError(f"tree_buckets must be non-empty and >= 0, got {self.tree_buckets}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes}")
        if self.kv_buckets is not None and (not self.kv_buckets or any(k < 1 for k in self.kv_buckets)):
            raise ValueError(f"kv_buckets must be positive, got {self.kv_buckets}")
        if self.max_kv_buckets < 1 or self.warmup_iters < 1:
            raise ValueError("max_kv_buckets and warmup_iters must be >= 1")

    def token_buckets(self) -> tuple[int, ...]:
        """Static token counts T = 1 + N, ascending."""
        return tuple(sorted({1 + b for b in self.tree_buckets}))

    def headroom(self) -> int:
        """Cache positions past max_seq_len that padding may write: the largest bucket."""
        return max(self.token_buckets())


def cache_length(max_seq_len: int, config: GraphConfig) -> int:
    """KV positions per slot when graphs are used: room for the largest padded tree."""
    return _round_up(max_seq_len + config.headroom(), KV_ALIGN)


def auto_kv_buckets(cache_len: int, max_buckets: int = 8) -> tuple[int, ...]:
    """A geometric ladder (ratio sqrt 2) of static KV lengths, from cache_len down to 256."""
    buckets = {cache_len}
    k = 1
    while len(buckets) < max_buckets:
        length = _round_up(math.ceil(cache_len / 2 ** (k / 2)), KV_ALIGN)
        if length < MIN_KV_BUCKET:
            break
        buckets.add(length)
        k += 1
    return tuple(sorted(buckets))


class _Inputs:
    """The static input buffers of one token bucket, plus their host staging copies."""

    def __init__(self, tokens: int, device: torch.device, pinned: bool):
        t = self.T = tokens
        self.device = device
        self.ints = torch.zeros(4 * t + 3, dtype=torch.int64, device=device)
        self.floats = torch.zeros(t + 3, dtype=torch.float32, device=device)
        self.tree_mask = torch.zeros(t, t, dtype=torch.bool, device=device)
        self.arange = torch.arange(t, device=device)
        on_host = device.type == "cpu"

        def staging(buffer: Tensor) -> Tensor:
            if on_host:
                return buffer  # no copy needed: fill the static buffer itself
            host = torch.zeros_like(buffer, device="cpu")
            return host.pin_memory() if pinned else host

        self._host_ints, self._host_floats, self._host_mask = map(staging, (self.ints, self.floats, self.tree_mask))
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._eye = torch.eye(t, dtype=torch.bool)

    # Views of the device buffers (what the graphs read).
    @property
    def tokens(self) -> Tensor:
        return self.ints[: self.T]

    @property
    def positions(self) -> Tensor:
        return self.ints[self.T: 2 * self.T]

    @property
    def next_token(self) -> Tensor:
        return self.ints[2 * self.T: 3 * self.T]

    @property
    def next_sibling(self) -> Tensor:
        return self.ints[3 * self.T: 4 * self.T]

    @property
    def past(self) -> Tensor:
        return self.ints[4 * self.T: 4 * self.T + 1]

    @property
    def slot(self) -> Tensor:
        return self.ints[4 * self.T + 1: 4 * self.T + 2]

    @property
    def top_k(self) -> Tensor:
        return self.ints[4 * self.T + 2: 4 * self.T + 3]

    @property
    def coins(self) -> Tensor:
        return self.floats[: self.T]

    @property
    def final_coin(self) -> Tensor:
        return self.floats[self.T: self.T + 1]

    @property
    def temperature(self) -> Tensor:
        return self.floats[self.T + 1: self.T + 2]

    @property
    def top_p(self) -> Tensor:
        return self.floats[self.T + 2: self.T + 3]

    def fill(self, slot: int, past: int, tokens: Tensor, depths: Tensor, tree_mask: Tensor,
             next_token: Tensor | None = None, next_sibling: Tensor | None = None,
             sampling: SamplingParams | None = None, coins: Tensor | None = None) -> None:
        """Stage one tree (n <= T nodes) and copy it to the device buffers (asynchronously)."""
        t, n = self.T, tokens.shape[0]
        if self._copied is not None:
            self._copied.synchronize()  # the previous round's copy has read the staging buffers
        ints, floats, mask = self._host_ints, self._host_floats, self._host_mask
        ints.zero_()
        ints[:n] = tokens
        ints[t: 2 * t] = past
        ints[t: t + n] += depths
        ints[2 * t: 4 * t] = -1
        if next_token is not None:
            ints[2 * t: 2 * t + n] = next_token
            ints[3 * t: 3 * t + n] = next_sibling
        ints[4 * t] = past
        ints[4 * t + 1] = slot
        mask.copy_(self._eye)
        mask[:n, :n] = tree_mask
        floats.fill_(0.5)
        if sampling is not None:
            ints[4 * t + 2] = sampling.top_k
            floats[t + 1] = sampling.temperature
            floats[t + 2] = sampling.top_p
        else:
            floats[t + 1] = 1.0
            floats[t + 2] = 1.0
        if coins is not None:
            floats[:n] = coins[:n]
            floats[t] = coins[n]
        if self._copied is not None:
            self.ints.copy_(ints, non_blocking=True)
            self.floats.copy_(floats, non_blocking=True)
            self.tree_mask.copy_(mask, non_blocking=True)
            self._copied.record()

    def fill_dummy(self) -> None:
        """A valid tree for warm-up and capture: a chain of T token-0 nodes in slot 0 at past 0."""
        t = self.T
        parents = torch.arange(-1, t - 1)
        chain = torch.ones(t, t, dtype=torch.bool).tril()
        next_token = torch.cat([torch.arange(1, t), torch.tensor([-1])])
        self.fill(0, 0, torch.zeros(t, dtype=torch.int64), parents + 1, chain, next_token,
                  torch.full((t,), -1), SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
                  torch.full((t + 1,), 0.5))


# ---------------------------------------------------------------------------------------
# Slot attention: the graph-friendly attention (TargetModel.attention = "triton").
# ---------------------------------------------------------------------------------------


@triton.jit
def _slot_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, slots_ptr, sm_scale, T, L, GROUP,
                           s_qb, s_qh, s_qt, s_cs, s_ch, s_cl, s_mb, s_mt, s_ob, s_ot, s_oh,
                           D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One program per (KV head, block of GROUP * T query rows, batch row): online softmax over the
    slot's first L cache positions, skipping key blocks that no row of the block may see."""
    kvh = tl.program_id(0)
    b = tl.program_id(2)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < GROUP * T
    t = rows % T
    head = kvh * GROUP + rows // T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + t[:, None] * s_qt + d[None, :], mask=valid[:, None],
                other=0.0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    k_base = k_ptr + slot * s_cs + kvh * s_ch
    v_base = v_ptr + slot * s_cs + kvh * s_ch
    mask_rows = mask_ptr + b * s_mb + t * s_mt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < L
        visible = tl.load(mask_rows[:, None] + cols[None, :], mask=valid[:, None] & inside[None, :], other=0) != 0
        if tl.max(visible.to(tl.int32)) > 0:
            k = tl.load(k_base + cols[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:  # float32 products (also the interpreter's only working path)
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(visible, scores * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * s_cl + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    out = acc / tl.where(valid, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def slot_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                   float32_products: bool | None = None) -> Tensor:
    """Masked GQA attention that reads K/V straight from the cache slots (no gather, no mask copy).

    q [B, H, T, D] (rotated queries); k_cache / v_cache [slots, KVH, max_len, D] (one layer of
    KVCache.k / .v, already holding this pass's keys); slots [B]; mask bool [B, T, L] (True =
    visible, L <= max_len). Returns [B, T, H, D], the layout o_proj wants. Same result as
    SDPA over `KVCache.read` with that mask; in one launch that takes no host sync, so it
    captures in CUDA graphs with the slot as data. Triton (CUDA, or the interpreter).
    float32_products: multiply in float32 (default: for float32 inputs only; bf16/fp16 inputs
    use the tensor cores' native products with float32 accumulation, as flash attention does).
    """
    b, h, t, d = q.shape
    kvh, length = k_cache.shape[1], mask.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if mask.stride(-1) != 1 or mask.dtype != torch.bool:
        mask = mask.to(torch.bool).contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides, last dimension contiguous")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    group = h // kvh
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    block_m = 64 if group * t > 32 else 16
    grid = (kvh, triton.cdiv(group * t, block_m), b)
    mask_u8 = mask.view(torch.uint8)
    _slot_attention_kernel[grid](
        q, k_cache, v_cache, out, mask_u8, slots, 1.0 / math.sqrt(d), t, length, group,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        mask_u8.stride(0), mask_u8.stride(1), out.stride(0), out.stride(1), out.stride(2),
        D=d, BLOCK_M=block_m, BLOCK_N=64,
        IEEE=q.dtype == torch.float32 if float32_products is None else float32_products)
    return out


class VerifyGraphs:
    """Captured verify passes of one model over one KV cache, keyed by (mode, T, L)."""

    def __init__(self, model: TargetModel, cache: KVCache, max_seq_len: int,
                 config: GraphConfig = GraphConfig(), *, capture: bool | None = None):
        config.check()
        self.model, self.cache, self.config = model, cache, config
        self.device = cache.k.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.token_buckets = config.token_buckets()
        need = max_seq_len + config.headroom()
        if cache.max_seq_len < need:
            raise ValueError(f"KV cache of {cache.max_seq_len} positions cannot hold max_seq_len {max_seq_len} "
                             f"plus the largest bucket ({config.headroom()}); allocate cache_length()")
        kv = config.kv_buckets or auto_kv_buckets(cache.max_seq_len, config.max_kv_buckets)
        self.kv_buckets = tuple(sorted({min(k, cache.max_seq_len) for k in kv}))
        self._inputs = {t: _Inputs(t, self.device, pinned=self.capture) for t in self.token_buckets}
        self._cols = {length: torch.arange(length, device=self.device) for length in self.kv_buckets}
        self._graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None
        self.capture_s = 0.0
        if self.capture:
            self.capture_all()

    # -- shapes ----------------------------------------------------------------------------

    def select(self, mode: str, n: int, past: int) -> tuple[int, int] | None:
        """(T, L) for a tree of n nodes after `past` tokens, or None (eager fallback)."""
        t = next((b for b in self.token_buckets if b >= n), None)
        if t is None:
            return None
        length = next((k for k in self.kv_buckets if k >= past + t), None)
        if length is None:
            return None
        if self.capture and (mode, t, length) not in self._graphs:
            return None
        return t, length

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # -- the static-shape computation (captured on CUDA, run eagerly otherwise) ---------------

    def _forward(self, inp: _Inputs, length: int) -> ForwardOutput:
        t = inp.T
        cols = self._cols[length]
        past = inp.past
        rel = cols - past  # column index inside the tree, valid for 0 <= rel < T
        local = inp.tree_mask.index_select(1, rel.clamp(0, t - 1)) & ((rel >= 0) & (rel < t))
        mask = local | (cols < past)  # [T, L]: the prefix, then the tree's own ancestor mask
        cache_pos = (past + inp.arange)[None]
        return self.model(inp.tokens[None], inp.positions[None], self.cache, inp.slot, cache_pos, mask[None])

    def _static(self, mode: str, inp: _Inputs, length: int):
        out = self._forward(inp, length)
        if mode == "forward":
            return out
        return accept_step(mode, inp.tokens, inp.next_token, inp.next_sibling, out.logits[0], out.features[0],
                           coins=inp.coins, final_coin=inp.final_coin, temperature=inp.temperature,
                           top_k=inp.top_k, top_p=inp.top_p)

    def _run(self, mode: str, t: int, length: int):
        if not self.capture:
            with torch.inference_mode():
                return self._static(mode, self._inputs[t], length)
        graph, outputs = self._graphs[(mode, t, length)]
        graph.replay()
        return outputs

    # -- capture -----------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every (mode, T, L) of the config; largest first so the pool is sized once."""
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        keys = [(m, t, k) for m in self.config.modes for t in self.token_buckets for k in self.kv_buckets
                if t <= k]
        for key in sorted(keys, key=lambda key: (-key[1] * key[2], key)):
            self._capture(*key)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d verify CUDA graphs (modes %s, tokens %s, kv lengths %s) in %.1f s",
                 len(self._graphs), ",".join(self.config.modes), list(self.token_buckets), list(self.kv_buckets),
                 self.capture_s)

    def _capture(self, mode: str, t: int, length: int) -> None:
        inp = self._inputs[t]
        inp.fill_dummy()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.config.warmup_iters):
                self._static(mode, inp, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            outputs = self._static(mode, inp, length)
        self._graphs[(mode, t, length)] = (graph, outputs)

    # -- per round ---------------------------------------------------------------------------

    def forward(self, slot: int, past: int, tokens: Tensor, depths: Tensor, tree_mask: Tensor) -> ForwardOutput | None:
        """Logits and features of the tree's n rows (views of static buffers), or None if no graph fits."""
        n = tokens.shape[0]
        shape = self.select("forward", n, past)
        if shape is None:
            return None
        t, length = shape
        self._inputs[t].fill(slot, past, tokens, depths, tree_mask)
        out = self._run("forward", t, length)
        return ForwardOutput(logits=out.logits[:, :n], features=out.features[:, :n])

    def verify_accept(self, slot: int, past: int, tree: DraftTree, depths: Tensor, tree_mask: Tensor,
                      sampling: SamplingParams, coins: Tensor | None = None,
                      stage: Stage = no_stage) -> AcceptResult | None:
        """Forward + accept + feature gather in one replay, or None if no graph fits."""
        mode = "greedy" if sampling.greedy else "sample"
        n = tree.num_nodes
        shape = self.select(mode, n, past)
        if shape is None:
            return None
        t, length = shape
        with stage("forward"):
            self._inputs[t].fill(slot, past, tree.tokens, depths, tree_mask, tree.next_token, tree.next_sibling,
                                 sampling, coins)
            result, features = self._run(mode, t, length)
        with stage("sample"):
            return unpack_accept(result, features)
