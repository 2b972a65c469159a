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
* **Modes.** "greedy" and "sample" (the default, what a verifier's rounds use) replay forward
  + accept in one graph: `kernels.fused_accept.tree_accept` (greedy, or sampling with
  temperature / top-k / top-p), then the bonus-token lookup and the gather of the accepted
  rows' features; one small device-to-host copy returns [accepted count, bonus, accepted
  path]. "forward" replays the target forward only (logits and features of all T rows; the
  caller slices the first n): benchmarks and tests use it.

Graphs are captured once, at start-up (`VerifyGraphs.capture_all`, called by the
constructor on CUDA), after the warm-up runs that PyTorch requires on a side stream. The
capture writes dummy K/V into slot 0, so it must happen before any session is opened. All
graphs share one memory pool; they are replayed one at a time by the model worker thread.
Outputs of a replay live in static buffers and are overwritten by the next replay of the same
graph: use them (or copy them) before the next verify.

With `capture=False` (any device, CPU included) the same static-shape code runs eagerly;
the tests use that to check the padding logic without a GPU.

The attention inside the graphs is `kernels.slot_attention` on CUDA (see `TargetModel.attention`):
it reads the session's cache slot in place, so the slot is data in the captured graph.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from common.buckets import KV_ALIGN, auto_kv_buckets, round_up
from common.protocol import SamplingParams
from common.staging import StagedInputs
from common.tree import DraftTree
from verifier_svc.accept import AcceptResult, Stage, accept_step, no_stage, unpack_accept
from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel

log = logging.getLogger(__name__)

DEFAULT_TREE_BUCKETS = (8, 16, 32, 64, 128)
MODES = ("forward", "greedy", "sample")


@dataclass(frozen=True)
class GraphConfig:
    """Which verify graphs to capture."""

    tree_buckets: tuple[int, ...] = DEFAULT_TREE_BUCKETS  # drafted nodes N; a bucket forwards 1 + N tokens
    kv_buckets: tuple[int, ...] | None = None  # static KV lengths; None = auto_kv_buckets(cache length)
    # "forward", "greedy", "sample" (see the module doc); a verifier's rounds use the last two.
    modes: tuple[str, ...] = ("greedy", "sample")
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
    return round_up(max_seq_len + config.headroom(), KV_ALIGN)


class _Inputs:
    """The static input buffers of one token bucket, plus their host staging copies."""

    def __init__(self, tokens: int, device: torch.device, pinned: bool):
        t = self.T = tokens
        self.device = device
        self._staging = StagedInputs(device, pinned)
        self.ints, self._host_ints = self._staging.buffer(4 * t + 3, dtype=torch.int64)
        self.floats, self._host_floats = self._staging.buffer(t + 3, dtype=torch.float32)
        self.tree_mask, self._host_mask = self._staging.buffer(t, t, dtype=torch.bool)
        self.arange = torch.arange(t, device=device)
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
        self._staging.begin()
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
        self._staging.commit()

    def fill_dummy(self) -> None:
        """A valid tree for warm-up and capture: a chain of T token-0 nodes in slot 0 at past 0."""
        t = self.T
        parents = torch.arange(-1, t - 1)
        chain = torch.ones(t, t, dtype=torch.bool).tril()
        next_token = torch.cat([torch.arange(1, t), torch.tensor([-1])])
        self.fill(0, 0, torch.zeros(t, dtype=torch.int64), parents + 1, chain, next_token,
                  torch.full((t,), -1), SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
                  torch.full((t + 1,), 0.5))


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
