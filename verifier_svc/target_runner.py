"""Runs the target model over the KV cache: prefill, and the batched verify step.

The runner knows slots, positions, cache indices and masks, not sessions: the verifier
above it decides which slot a request uses. A verify step (`verify_batch`: `launch_verify`,
which queues it without waiting, then `finish_verify`) runs the trees of many sessions in
one forward, accepts them in one batched call and compacts every row's accepted K/V in one
batched copy (`verifier_svc.cuda_graphs.verify_step`).

On CUDA the step replays CUDA graphs captured when the runner is built, per (mode, batch
bucket, tree bucket, KV bucket); batches no graph fits, `cuda_graphs=False` and CPU devices
run the same code eagerly at the batch's own shape. Prefill is always eager.

The cache has one slot per session plus a scratch slot that padding batch rows write
into, and `headroom` positions past max_seq_len for the padding nodes of a tree.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.feature_wire import FP8, MODEL_DTYPE, pack_rows
from common.layers import gemm_weights
from common.penalties import PenaltyState, penalize_dense, penalty_rows
from common.protocol import SamplingParams, TokenLogprob
from common.staging import HostCopy, to_device
from common.tree import DraftTree
from ddtree_kernels.kv_move import warm_up as warm_up_kv_move
from ddtree_kernels.penalties import warm_up as warm_up_penalties
from ddtree_kernels.place_trees import warm_up as warm_up_place_trees
from ddtree_kernels.skinny_gemm import warm_up as warm_up_gemms
from ddtree_kernels.slot_attention import warm_up as warm_up_attention
from ddtree_kernels.tree_sampling import kernel_backend
from verifier_svc.accept import emitted_logprobs
from verifier_svc.cuda_graphs import (SAMPLING, BatchInputs, GraphConfig, VerifyGraphs, VerifyRow, cache_length,
                                      verify_step)
from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel


def prefill_forward(model: TargetModel, cache: KVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
                    cache_pos: Tensor, mask: Tensor, logit_rows: Tensor) -> ForwardOutput:
    """The prefill's forward (`TargetRunner.prefill` builds its inputs; every tensor parallel rank runs it)."""
    with torch.inference_mode():
        return model(tokens, positions, cache, slots, cache_pos, mask, logit_rows)


def prefill_mask(cache_pos: Tensor, in_prompt: Tensor, length: int) -> Tensor:
    """The prefill's mask [B, T, length] (True = visible), on cache_pos's device: a chunk token
    sees every cache position up to its own (the chunks before it, and its chunk up to itself),
    a padding column (`in_prompt` False) only its own position. cache_pos [B, T] is where each
    column's K/V goes."""
    keys = torch.arange(length, device=cache_pos.device)
    lowest = torch.where(in_prompt, 0, cache_pos)[:, :, None]  # the first key a column sees
    return (cache_pos[:, :, None] >= keys).logical_and_(keys >= lowest)  # one temporary of the mask's size


@dataclass
class VerifiedBatch:
    """The accepted paths of one verify step, row by row."""

    paths: list[list[int]]  # node indices, root first
    bonus: list[int]
    accepted: list[list[int]]  # the tokens of each path's nodes after the root
    features: Tensor  # [sum of path lengths, F] on the CPU: the path rows of the rows asked for, in row order
    logprobs: list[list[TokenLogprob] | None]  # per row: of its emitted tokens, for the rows that ask


@dataclass
class PendingVerify:
    """A verify step queued on the device (`TargetRunner.launch_verify`), its results on their way."""

    rows: list[VerifyRow]
    copy: HostCopy  # the per-row results, and the path rows' features unless `first` holds them
    logits: Tensor  # [B, T, V] of every node; under CUDA graphs a buffer that every step shares
    first: Tensor | None = None  # [B * W, F] on the device, the rows to read first (`features_on_device`)
    features: Tensor | None = None  # [B, W, F] there, each row's path rows first: a copy
    result: Tensor | None = None  # [B, T + 2] on the device, beside `features`: valid until the next step is launched

    @property
    def exclusive(self) -> bool:
        """Whether no other step may be launched before this one is finished: its logits are read
        then (rows that ask for logprobs), and a later step would overwrite them."""
        return any(r.logprobs is not None for r in self.rows)

    def ready(self) -> bool:
        return self.copy.ready()

    def wait(self) -> None:
        self.copy.wait()


class TargetRunner:
    def __init__(self, model: TargetModel, num_slots: int, max_seq_len: int, max_tree_nodes: int = 1025,
                 cuda_graphs: bool = True, graph_config: GraphConfig | None = None, sampling: str | None = None):
        if sampling is None:  # the graph config's sampled mode, else position-keyed sampling
            sampling = next((m for m in (graph_config.modes if graph_config else ()) if m in SAMPLING), "keyed")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
        self.model = model
        self.sampling = sampling  # the accept mode of steps with sampled rows: "keyed" or "sample" (coins)
        model.fuse_weights()
        p = model.embed_tokens.weight
        self.device = p.device
        self.max_seq_len = max_seq_len
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.cache = KVCache(model.cfg, num_slots + 1, cache_length(max_seq_len, max_tree_nodes), p.device, p.dtype)
        # Per slot, how often each token occurs in its context (the repetition penalties, `common.penalties`).
        self.penalties = PenaltyState(num_slots + 1, model.cfg.vocab_size, p.device)
        # every attention and few-row GEMM variant now, not when an eager pass (a prompt chunk) first takes it
        warm_up_attention(self.cache.k[0], self.cache.v[0], model.cfg.num_heads)
        warm_up_gemms(gemm_weights(model))
        warm_up_kv_move(self.cache.k, self.cache.v)
        if p.device.type == "cuda":
            warm_up_penalties(p.device, model.lm_head.weight.dtype)
        graph_config = graph_config or GraphConfig(modes=("greedy", sampling))
        self.graph_config = graph_config
        self.graphs = (VerifyGraphs(model, self.cache, max_seq_len, self.scratch_slot, graph_config,
                                    penalties=self.penalties) if use_graphs else None)
        self.mirror = None  # tensor parallelism: see `set_mirror`
        # The features a verify or a prefill returns stay on the model's device (an in-process
        # drafter reads them there: no copy to the host and back); by default they come to the host.
        self.features_on_device = False
        # How the features that come to the host are sent (`common.feature_wire`; `features_for_host`).
        self.feature_wire = MODEL_DTYPE

    def features_for_host(self, features: Tensor) -> Tensor:
        """Features [..., F] on the device, as they go to the host for the link: packed on the device
        (`common.feature_wire.pack_rows`, half the bytes to copy) under `feature_wire` FP8."""
        return pack_rows(features) if self.feature_wire == FP8 else features

    def take_device_trees(self, max_nodes: int) -> None:
        """An in-process drafter hands its trees over on the device (`common.tree.DeviceTrees`) and
        reads the features there: keep them there, and compile the kernel that places such trees
        (`ddtree_kernels.place_trees`) for every tree size now, not at a serving step."""
        self.features_on_device = True
        self.feature_wire = MODEL_DTYPE  # nothing travels: --feature-wire has nothing to pack
        if kernel_backend(self.device) == "triton":
            warm_up_place_trees(self.device, max_nodes)

    def set_mirror(self, mirror) -> None:
        """Tensor parallelism, rank 0: hand every forward's inputs to the other ranks before running
        it (`verifier_svc.tensor_parallel.StepMirror`), so that each runs it on its shard."""
        self.mirror = mirror
        if self.graphs is not None:
            self.graphs.mirror = mirror

    def measure_verify_costs(self, iters: int = 3) -> dict[tuple[int, int], float]:
        """Seconds of one greedy verify step per (batch bucket, tokens per row) of the graph
        config, on dummy trees in the scratch slot: the captured graph's replay at its shortest
        KV length where there is one, else the eager step. The drafter's adaptive budget weighs
        its expected tokens against this table (`InfoResponse.verify_costs`)."""
        config = self.graph_config
        costs = {}
        for b in sorted({min(b, self.num_slots) for b in config.batch_buckets}):
            for t in config.token_buckets():
                if b * t <= config.max_tokens and self.max_seq_len + t <= self.cache.max_seq_len:
                    costs[(b, t)] = self._time_dummy_step(b, t, iters)
        return costs

    def _time_dummy_step(self, b: int, t: int, iters: int) -> float:
        def step() -> None:
            if self.graphs is None or not self.graphs.replay_dummy(b, t):
                inp = BatchInputs(b, t, self.device, pinned=False)
                inp.fill_dummy(self.scratch_slot)
                self._run_eager(inp, t, "greedy")

        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda device: None)
        step()  # warm-up
        sync(self.device)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def prefill(self, slots: Sequence[int], prompts: Sequence[Tensor],
                pasts: Sequence[int] | None = None) -> tuple[Tensor, list[Tensor]]:
        """Causal forward of B prompt chunks, in one pass: row b's tokens go to cache positions
        pasts[b] .. pasts[b] + n_b - 1 of its slot (default 0: whole prompts into empty slots) and
        see the slot's first pasts[b] positions, the chunks before it. Returns the logits [B, V] of
        each chunk's last token and each chunk's features [n_b, F].

        The chunks are right-aligned in T = the longest one's columns, so every row's last token
        is the same column and the head runs on that column only. Row b's padding columns (the
        first T - n_b) go to cache positions past its chunk, up to pasts[b] + T - 1 (overwritten
        later, never visible; the caller keeps that inside the cache), and see only themselves.

        With prefill graphs (`GraphConfig.prefill_batches`) a batch that fits one runs through it
        instead (`_prefill_graphed`); the features are then views of the graph's output, valid until
        the next replay of the same graph.
        """
        pasts = list(pasts) if pasts is not None else [0] * len(prompts)
        graphed = self._prefill_graphed(slots, prompts, pasts)
        if graphed is not None:
            return graphed
        dev = self.device
        b, t = len(prompts), max(p.shape[0] for p in prompts)
        sizes = torch.tensor([p.shape[0] for p in prompts])
        past = torch.tensor(pasts)[:, None]
        col = torch.arange(t)[None]
        start = (t - sizes)[:, None]  # the first chunk column of each row
        in_prompt = col >= start
        cache_pos = past + torch.where(in_prompt, col - start, sizes[:, None] + col)  # [B, T], unique per row
        positions = torch.where(in_prompt, cache_pos, 0)
        tokens = torch.zeros(b, t, dtype=torch.int64)
        tokens[in_prompt] = torch.cat(list(prompts))
        cache_pos = to_device(cache_pos, dev)
        # The mask is B x T x (longest past + T): megabytes for a long prompt's chunk, built where it is used.
        mask = prefill_mask(cache_pos, to_device(in_prompt, dev), int((past + t).max()))
        args = (to_device(tokens, dev), to_device(positions, dev), to_device(list(slots), dev, torch.int64),
                cache_pos, mask, to_device([t - 1], dev, torch.int64))
        if self.mirror is not None:
            self.mirror.prefill(*args)
        out = prefill_forward(self.model, self.cache, *args)
        return out.logits[:, 0], [out.features[i, t - n:] for i, n in enumerate(sizes.tolist())]

    # A verify step takes a step's prompt chunks in as segment rows (`mixing_pays`) while its forward,
    # padding included, holds at most as many tokens as the trees' own verify and the chunks' prefill
    # together, plus this many: the weight pass the prefill's forward of its own would cost on top.
    MIXED_FORWARD_TOKENS = 256

    def row_width(self, nodes: int) -> int:
        """The nodes each row of a verify step holds when its largest tree has `nodes`: its graphs' token
        bucket, else `nodes` (eager). Prompt segments mixed into it are cut to this width."""
        buckets = self.graphs.token_buckets if self.graphs is not None else ()
        return next((t for t in buckets if t >= nodes), nodes)

    def verify_mode(self, rows: Sequence[VerifyRow]) -> str:
        """The mode a verify step of these rows runs in: greedy when every row is, else the sampled mode."""
        return "greedy" if all(r.sampling.greedy for r in rows) else self.sampling

    def mixing_pays(self, mode: str, trees: int, segments: int, width: int, end: int,
                    chunks: Sequence[int]) -> bool:
        """Whether a verify of `trees` trees plus `segments` prompt segments, rows of `width` nodes with
        their last position below `end`, costs less than the trees' verify and the prefill of the
        chunks (their lengths) apart. Eagerly, one forward of the same rows instead of two, while it
        holds at most the graphs' `max_tokens` (every node gets its logits, a prefill's only the
        last). Under graphs, when one takes the mixed batch and holds at most as many tokens,
        padding included, as the two forwards apart plus MIXED_FORWARD_TOKENS."""
        graphs = self.graphs
        if graphs is None:
            return (trees + segments) * width <= self.graph_config.max_tokens
        mixed = graphs.select(mode, trees + segments, width, end)
        if mixed is None:
            return False
        alone = graphs.select(mode, trees, width, end)
        prefill = graphs.select("forward", len(chunks), max(chunks), end) if graphs.forward_batches else None
        apart = ((alone[0] * alone[1]) if alone else trees * width) + (
            (prefill[0] * prefill[1]) if prefill else len(chunks) * max(chunks))
        return mixed[0] * mixed[1] <= apart + self.MIXED_FORWARD_TOKENS

    def count_prompts(self, slots: Sequence[int], prompts: Sequence[Tensor], pasts: Sequence[int],
                      output_starts: Sequence[int]) -> None:
        """Count prompt chunks in their slots' token counts (the repetition penalties): chunk b's
        tokens go to positions pasts[b].., generated from output_starts[b] on; a chunk at past 0
        starts its slot afresh. Every tensor parallel rank counts them."""
        sizes = torch.tensor([p.shape[0] for p in prompts])
        positions = torch.cat([torch.arange(past, past + p.shape[0]) for past, p in zip(pasts, prompts)])
        generated = positions >= torch.tensor(output_starts).repeat_interleave(sizes)
        fresh = [slot for slot, past in zip(slots, pasts) if past == 0]
        args = (to_device(fresh, self.device, torch.int64),
                to_device(torch.tensor(slots).repeat_interleave(sizes), self.device),
                to_device(torch.cat(list(prompts)), self.device), to_device(generated, self.device))
        if self.mirror is not None:
            self.mirror.count_prompts(*args)
        self.penalties.take_prompt(*args)

    @torch.inference_mode()
    def penalize_last(self, logits: Tensor, slots: Sequence[int], sampling: Sequence[SamplingParams]) -> None:
        """The repetition penalties on each prompt's last logits [B, V] (its first token's), in place,
        from its slot's counts (the whole prompt, counted by `count_prompts`)."""
        penalties = penalty_rows(sampling, self.device)
        if penalties is not None:
            penalize_dense(logits[:, None], self.penalties, to_device(list(slots), self.device, torch.int64),
                           penalties)

    def _prefill_graphed(self, slots: Sequence[int], prompts: Sequence[Tensor], pasts: Sequence[int]
                         ) -> tuple[Tensor, list[Tensor]] | None:
        """`prefill` through a captured "forward" graph, or None when none fits (or there are none).

        A chunk of n tokens after `past` is a chain tree: node i is token i at position past + i,
        it sees the slot's first `past` positions and nodes 0..i (a causal mask), and the step
        stores node i's K/V at past + i, where the prefill puts them. So the verify graphs'
        "forward" mode, padded like any tree, is a prefill; its last node's logits and every
        node's features are the prefill's."""
        if self.graphs is None or not self.graphs.forward_batches:
            return None
        sizes = [p.shape[0] for p in prompts]
        if self.graphs.select("forward", len(prompts), max(sizes), max(pasts) + max(sizes)) is None:
            return None  # before building chains of a chunk no graph takes (a long prompt's, say)
        rows = [VerifyRow(slot, past, DraftTree.from_parents(p.tolist(), list(range(-1, n - 1))), np.arange(n),
                          SamplingParams()) for slot, past, p, n in zip(slots, pasts, prompts, sizes)]
        width = max(sizes)
        masks = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1)
        for i, n in enumerate(sizes):
            masks[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        out = self.graphs.run("forward", rows, masks)
        if out is None:
            return None
        last = to_device([n - 1 for n in sizes], self.device, torch.int64)
        logits = out.logits[torch.arange(len(rows), device=self.device), last]
        return logits, [out.features[i, :n] for i, n in enumerate(sizes)]

    def _eager_inputs(self, rows: Sequence[VerifyRow], masks: Tensor) -> tuple[BatchInputs, int]:
        nodes = max(r.tree.num_nodes for r in rows)
        inp = BatchInputs(len(rows), nodes, self.device, pinned=False)
        inp.fill(rows, masks, self.scratch_slot)
        return inp, max(r.past for r in rows) + nodes

    def forward_batch(self, rows: Sequence[VerifyRow], masks: Tensor) -> ForwardOutput:
        """Logits [B, T, V] and features [B, T, F] of the padded trees, eagerly (tests, benchmarks).
        The K/V of every node are written after each row's past; nothing is committed."""
        inp, length = self._eager_inputs(rows, masks)
        return self._run_eager(inp, length, "forward")

    def _run_eager(self, inp: BatchInputs, length: int, mode: str):
        """`verify_step` at the batch's own shape (every rank's, under tensor parallelism)."""
        if self.mirror is not None:
            self.mirror.verify(mode, inp, length, graphed=False)
        with torch.inference_mode():
            return verify_step(self.model, self.cache, inp, length, mode, self.penalties)

    def verify_batch(self, rows: Sequence[VerifyRow], masks: Tensor) -> VerifiedBatch:
        """Verify every row's tree (masks: bool [B, >= n, >= n], see `common.tree.ancestor_masks`),
        accept, and compact each row's accepted K/V to [past, past + len(path)): `launch_verify`
        then `finish_verify`."""
        return self.finish_verify(self.launch_verify(rows, masks))

    def launch_verify(self, rows: Sequence[VerifyRow], masks: Tensor) -> PendingVerify:
        """Queue the verify step and the copies of its results to the host, without waiting for
        the device: the host can prepare the next step meanwhile (`verifier_svc.scheduler`).

        The per-row results and the path rows' features come back together (the features of
        the rows that want them: `VerifyRow.wants_features`). The copies are queued right
        behind the step, so a later step may reuse its graph's buffers; the logits are read after
        the wait, though, so a step with rows that ask for logprobs is `exclusive`.
        """
        mode = self.verify_mode(rows)
        outputs = self.graphs.run(mode, rows, masks) if self.graphs is not None else None
        if outputs is None:
            inp, length = self._eager_inputs(rows, masks)
            outputs = self._run_eager(inp, length, mode)
        result, features, logits, order = outputs
        # No path is longer than the deepest tree (for trees on the device: than their bound).
        walked = [r.depths for r in rows if r.depths is not None]
        bounds = [r.tree.max_depth for r in rows if r.depths is None]
        deepest = max(bounds + ([int(np.concatenate(walked).max())] if walked else []))
        width = min(features.shape[1], 1 + deepest)
        result = result[: len(rows)]
        # The rows to read first (each wanted row's root and accepted nodes, in the order the step
        # computed): no row's path passes `width`, so they lie in the first len(rows) * width rows
        # of that order. A copy, so a later step may replay the same graph before the finish.
        first = features.flatten(0, 1).index_select(0, order[: len(rows) * width])
        if self.features_on_device:  # also each row's rows, where a draft queued behind this step reads them
            return PendingVerify(list(rows), HostCopy(result), logits, first,
                                 features[: len(rows), :width].clone(), result)
        return PendingVerify(list(rows), HostCopy(result, self.features_for_host(first)), logits)

    def finish_verify(self, pending: PendingVerify) -> VerifiedBatch:
        """Wait for a launched step's results (one wait; a second, only when a row asks for
        logprobs, for theirs) and read them out per row."""
        rows = pending.rows
        copied = pending.copy.wait()
        values = copied[0].tolist()
        paths = [v[2: 3 + v[0]] for v in values]
        bonus = [v[1] for v in values]
        accepted = []
        for row, path in zip(rows, paths):
            # (a list once: cheaper than a tensor index per node; a prompt segment has no path)
            tokens = row.tree.token_list() if len(path) > 1 else ()
            accepted.append([tokens[node] for node in path[1:]])
        # (a prompt segment's features: its nodes', after the trees' path rows in row order)
        lengths = [(row.segment or len(path)) if row.wants_features else 0 for path, row in zip(paths, rows)]
        features = copied[1] if pending.first is None else pending.first  # the rows to read come first
        picked = features[: sum(lengths)]
        return VerifiedBatch(paths=paths, bonus=bonus, accepted=accepted, features=picked,
                             logprobs=self._path_logprobs(rows, accepted, bonus, pending.logits, paths))

    @staticmethod
    def _path_logprobs(rows: Sequence[VerifyRow], accepted: list[list[int]], bonus: list[int], logits: Tensor,
                       paths: list[list[int]]) -> list[list[TokenLogprob] | None]:
        """Each asking row's emitted tokens (the path's nodes after the root, then the bonus
        token), each under the logits of the node before it, in one batched call."""
        asking = [i for i, r in enumerate(rows) if r.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(rows)
        if not asking:
            return out
        t = logits.shape[1]
        index, tokens, sampling, top_n = [], [], [], []
        for i in asking:
            path, row = paths[i], rows[i]
            index += [i * t + node for node in path]
            tokens += accepted[i] + [bonus[i]]
            sampling += [row.sampling] * len(path)
            top_n += [row.logprobs] * len(path)
        rows_logits = logits.reshape(-1, logits.shape[-1]).index_select(
            0, torch.tensor(index, dtype=torch.int64, device=logits.device))
        flat = emitted_logprobs(rows_logits, tokens, sampling, top_n)
        at = 0
        for i in asking:
            out[i], at = flat[at: at + len(paths[i])], at + len(paths[i])
        return out
