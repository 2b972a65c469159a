"""The drafter's model side: DFlash block logits for a batch of sessions, and their trees.

The drafter holds the DFlash draft plus only the target's `embed_tokens` and `lm_head`
(loaded from the target checkpoint), and one slot of a context pool per session. On CUDA
the batched draft step replays CUDA graphs (`drafter_svc.draft_graphs`); the prompt's
features, steps that fit no graph, `cuda_graphs=False` and CPU devices run the same code
eagerly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from common.checkpoint import load_tensors
from common.config import check_draft_fits_target, load_target_config
from common.devices import device_id
from common.feature_projection import projection_fingerprint
from common.layers import gemm_weights
from common.logit_bias import bias_rows
from common.penalties import TokenCounts, penalize_block
from common.protocol import SamplingParams, StatusError, TokenBias, VerifiedRows
from common.staging import rows_of, to_device
from common.tree import DeviceTree, DraftTree
from drafter_svc.budget import BudgetChoice, BudgetPlanner
from drafter_svc.ddtree import build_chains, select_ddtrees, select_device_trees
from drafter_svc.draft_graphs import (DraftGraphConfig, DraftGraphs, DraftInputs, DraftRow, context_capacity, draft_step,
                                      feature_dim)
from drafter_svc.draft_model import DFlashDraftModel, DraftKVPool
from ddtree_kernels.ddtree_select import warm_up as warm_up_selection
from ddtree_kernels.draft_topk import warm_up as warm_up_top_k
from ddtree_kernels.skinny_gemm import warm_up as warm_up_gemms
from ddtree_kernels.tree_sampling import kernel_backend


@dataclass(frozen=True)
class DraftMode:
    """How each round's tree is made: a DDTree of `budget` nodes, the argmax chain, or none (plain AR)."""
    kind: str = "tree"  # "tree" | "chain" | "ar"
    budget: int = 15  # drafted nodes: with the root, 16 tokens a session (the verifier's tree buckets)

    def __post_init__(self):
        if self.kind not in ("tree", "chain", "ar"):
            raise ValueError(f"unknown draft mode {self.kind!r}")
        if self.budget < 0:
            raise ValueError(f"tree budget must be >= 0, got {self.budget}")


@dataclass
class DraftState:
    """One session's draft context: its pool slot and the feature rows it holds."""
    slot: int
    length: int = 0


class BlockProposer(Protocol):
    """Anything that proposes per-depth logits for the tokens after each session's root, in batch."""

    block_size: int

    def take_prompts(self, states: Sequence[object | None], prompt_ids: Sequence[list[int]],
                     features: Sequence[torch.Tensor]) -> list[object | StatusError | ValueError]:
        """Prompt chunks (tokens and their features) into many sessions' contexts at once; a state of
        None starts a session (its first chunk). Each gets its state, or the error that stops it."""
        ...

    def propose(self, states: Sequence[object], roots: Sequence[int], new_tokens: Sequence[list[int]],
                new_features: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def finish(self, state: object) -> None: ...


@dataclass
class BuiltTrees:
    """One step's trees (`build_trees`), row i for session i."""
    trees: list[DraftTree | DeviceTree]
    choice: BudgetChoice | None = None  # the adaptive budget's, for `BudgetPlanner.observe`
    # Each DDTree's expected gains as selected (`common.tree.expected_gains`), where the host has
    # them now (None elsewhere; a DeviceTree's come with its copy: `DeviceTree.gains`).
    gains: list[np.ndarray | None] = field(default_factory=list)


def build_trees(modes: Sequence[DraftMode], block_logits: torch.Tensor, roots: Sequence[int],
                rooms: Sequence[int], planner: BudgetPlanner | None = None, batch: int = 0,
                adaptive: Sequence[bool] | None = None, on_device: bool = False,
                prior_gains: Sequence[np.ndarray | None] | None = None,
                token_bias: Sequence[tuple[Sequence[TokenBias], int]] = (),
                penalties: Sequence[tuple[int, TokenCounts, SamplingParams]] = ()) -> BuiltTrees:
    """Each drafted session's tree under its mode, with at most `rooms[i]` nodes besides the root.

    block_logits [S, D, V], row i for session i. All DDTrees are built in one batched call,
    all chains in another. With a `planner` (the adaptive budget), the DDTrees of the sessions
    marked `adaptive` are selected at most `BudgetPlanner.build_width` wide, then cut to the one
    budget it chooses for this step of `batch` sessions from their expected gains.

    With `on_device` (a verifier in this process takes them), the DDTrees stay on the device
    (`select_device_trees`) and nothing waits for the draft. The planner then weighs the gains
    of the sessions' previous trees (`prior_gains`; a session without one gets their mean): this
    step's are on the device. Until some session has one, the trees are built on the host.

    `token_bias`: each session's token biases and the position of its depth-1 token, added to
    its rows of block_logits (in place) so that its tree proposes what the biased target picks;
    `penalties`: (row, counts, sampling) of the sessions with repetition penalties, likewise
    (`common.penalties.penalize_block`)."""
    bias_rows(block_logits, [b for b, _ in token_bias], [p for _, p in token_bias])
    penalize_block(block_logits, penalties)
    trees: list[DraftTree | DeviceTree | None] = [None] * len(modes)
    gains: list[np.ndarray | None] = [None] * len(modes)
    tree_rows, chain_rows = [], []
    for i, (mode, root, room) in enumerate(zip(modes, roots, rooms)):
        if mode.kind == "ar" or room <= 0 or (mode.kind == "tree" and mode.budget == 0):
            trees[i] = DraftTree.root_only(root)
        else:
            (chain_rows if mode.kind == "chain" else tree_rows).append(i)
    if chain_rows:
        built = build_chains(rows_of(block_logits, chain_rows), [roots[i] for i in chain_rows],
                             [rooms[i] for i in chain_rows])
        for i, tree in zip(chain_rows, built):
            trees[i] = tree
    choice = None
    if tree_rows:
        caps = [min(modes[i].budget, rooms[i]) for i in tree_rows]
        adapting = [planner is not None and (adaptive is None or adaptive[i]) for i in tree_rows]
        if any(adapting):  # select no wider than the planner may choose this step
            width = planner.build_width(max(c for c, a in zip(caps, adapting) if a))
            caps = [min(c, width) if a else c for c, a in zip(caps, adapting)]
        priors = _with_means([prior_gains[i] for i in tree_rows]) if any(adapting) and prior_gains else None
        if on_device and (priors is not None or not any(adapting)):
            cut = caps
            if any(adapting):
                choice = _choose(planner, priors, caps, adapting, trees, max(batch, len(modes)))
                cut = [min(c, choice.budget) if a else c for c, a in zip(caps, adapting)]
            built = select_device_trees(rows_of(block_logits, tree_rows), [roots[i] for i in tree_rows], caps, cut)
            for i, tree in zip(tree_rows, built):
                trees[i] = tree
            return BuiltTrees(trees, choice, gains)
        selection = select_ddtrees(rows_of(block_logits, tree_rows), [roots[i] for i in tree_rows], caps)
        selected = list(selection.expected_gains())
        budgets = caps
        if any(adapting):
            choice = _choose(planner, selected, caps, adapting, trees, max(batch, len(modes)))
            budgets = [min(c, choice.budget) if a else c for c, a in zip(caps, adapting)]
        for i, tree, g in zip(tree_rows, selection.trees(budgets), selected):
            trees[i], gains[i] = tree, g
    return BuiltTrees(trees, choice, gains)


def _choose(planner: BudgetPlanner, gains: Sequence[np.ndarray], caps: Sequence[int], adapting: Sequence[bool],
            trees: Sequence[DraftTree | None], batch: int) -> BudgetChoice:
    """The planner's budget for the adapting DDTrees (gains[j], caps[j] of the j-th DDTree), above
    the nodes of the trees it may not cut (the other DDTrees, at their caps, and `trees` built)."""
    fixed = [j for j, a in enumerate(adapting) if not a]
    floor = max([1] + [t.num_nodes for t in trees if t is not None] + [1 + caps[j] for j in fixed])
    fixed_gain = float(sum(gains[j][min(caps[j], gains[j].shape[0] - 1)] for j in fixed))
    return planner.choose([g for g, a in zip(gains, adapting) if a], [c for c, a in zip(caps, adapting) if a],
                          batch, floor_nodes=floor, fixed_gain=fixed_gain)


def _with_means(gains: Sequence[np.ndarray | None]) -> list[np.ndarray] | None:
    """Each session's expected gains, the mean of the others' where it has none (None: no session
    has one). Shorter rows are extended with their last value, as `BudgetPlanner.choose` reads them."""
    known = [g for g in gains if g is not None]
    if len(known) == len(gains):
        return list(gains)
    if not known:
        return None
    width = max(g.shape[0] for g in known)
    mean = np.mean([np.pad(g, (0, width - g.shape[0]), mode="edge") for g in known], axis=0)
    return [g if g is not None else mean for g in gains]


def _raised(result):
    """`result`, raised when it is an exception."""
    if isinstance(result, Exception):
        raise result
    return result


def join_blocks(parts: Sequence[tuple[torch.Tensor, Sequence[int]]], fresh: torch.Tensor | None) -> torch.Tensor:
    """One step's block logits: rows `rows` of each block drafted ahead (`parts`: (block, rows)
    pairs; `DraftScheduler`), then a block drafted now (may be None). No copy when one block
    alone holds all, in order."""
    blocks = [rows_of(block, list(rows)) for block, rows in parts if rows] + ([fresh] if fresh is not None else [])
    if not blocks:
        raise ValueError("no block logits to join")
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


class DFlashProposer:
    """Block logits from the DFlash draft, conditioned on target features, for many sessions at
    once: the drafter's model runner. Serving only: the constructor fuses the draft's q/k/v and
    gate/up weights (`DFlashDraftModel.fuse_weights`) and allocates the context pool (`slots`
    sessions plus a scratch slot)."""

    max_prompt_rows = 8192  # padded prompt rows per batched context extension (`take_prompts`)

    def __init__(self, draft: DFlashDraftModel, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 max_seq_len: int, slots: int = 8, cuda_graphs: bool = True,
                 graph_config: DraftGraphConfig | None = None, projected_features: bool = False):
        self.draft = draft
        # Whether the feature rows it is given are context rows already (the verifier applied the
        # draft's fc + hidden_norm; `common.feature_projection`) or raw target features.
        self.projected = projected_features
        self.feature_dim = feature_dim(draft, projected_features)
        draft.fuse_weights()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = draft.cfg.block_size
        self.max_seq_len = max_seq_len
        self.device = embed_tokens.device
        self.pool = DraftKVPool(draft, slots + 1, context_capacity(max_seq_len, self.block_size))
        self.scratch_slot = self.pool.acquire()  # held for good: padding rows of the graphs write there
        if kernel_backend(self.device) == "triton":  # no step waits for a compile
            warm_up_selection(self.device, self.block_size - 1)
            warm_up_top_k(self.device, lm_head.shape[0], lm_head.dtype)
            warm_up_gemms(gemm_weights(draft))  # an eager step (a prompt chunk's context) at any row count
        use_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs = (DraftGraphs(draft, embed_tokens, lm_head, self.pool, self.scratch_slot,
                                   graph_config or DraftGraphConfig(), projected=projected_features)
                       if use_graphs else None)

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, target_dir: str | Path, device="cpu",
                        dtype=torch.float32, max_seq_len: int = 2048, slots: int = 8, cuda_graphs: bool = True,
                        graph_config: DraftGraphConfig | None = None, projected_features: bool = False,
                        target_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DFlashProposer":
        """`target_weights`: the target's (embed_tokens, lm_head) when this process holds them
        already (an in-process verifier), shared instead of loaded again when on `device` in `dtype`."""
        target_cfg = load_target_config(target_dir)
        draft = DFlashDraftModel.from_pretrained(draft_dir, device=device, dtype=dtype)
        check_draft_fits_target(draft.cfg, target_cfg)
        if target_weights is not None and all(device_id(t.device) == device_id(device) and t.dtype == dtype
                                              for t in target_weights):
            return cls(draft, *target_weights, max_seq_len, slots, cuda_graphs, graph_config, projected_features)
        names = ["embed_tokens.weight"] + ([] if target_cfg.tie_word_embeddings else ["lm_head.weight"])
        tensors = load_tensors(target_dir, names, strip_prefix="model.", dtype=dtype)
        embed = tensors["embed_tokens.weight"].to(device)
        head = tensors["lm_head.weight"].to(device) if "lm_head.weight" in tensors else embed  # tied: one tensor
        return cls(draft, embed, head, max_seq_len, slots, cuda_graphs, graph_config, projected_features)

    def projection_fingerprint(self) -> str:
        """Of the draft's fc + hidden_norm: must equal the verifier's when it projects the features."""
        return projection_fingerprint(self.draft.fc.weight, self.draft.hidden_norm.weight)

    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    def start(self, prompt_ids: list[int], features: torch.Tensor) -> DraftState:
        """A session's context (a pool slot) holding the prompt's features (or its first chunk's).
        Raises StatusError(RESOURCE_EXHAUSTED) when every slot is taken (`take_prompts` of one)."""
        return _raised(self.take_prompts([None], [prompt_ids], [features])[0])

    def extend(self, state: DraftState, prompt_ids: list[int], features: torch.Tensor) -> None:
        """Append prompt features to a session's context (the next chunk, in chunked prefill)."""
        _raised(self.take_prompts([state], [prompt_ids], [features])[0])

    @torch.inference_mode()
    def take_prompts(self, states: Sequence[DraftState | None], prompt_ids: Sequence[list[int]],
                     features: Sequence[torch.Tensor]) -> list[DraftState | StatusError | ValueError]:
        """Append prompt chunks' features to many sessions' contexts in a few batched extensions
        (one while they fit `max_prompt_rows` padded rows): the host's launches are paid per call,
        not per session. A state of None is a session's first chunk, which takes a context slot.
        Each gets its state, or what stops it: StatusError(RESOURCE_EXHAUSTED) when every slot is
        taken, ValueError past max_seq_len (a slot it took is given back). Chunks are padded with
        zero rows to the longest of their call; those rows' K/V land past each context, where the
        rows that come later overwrite them."""
        out: list[DraftState | StatusError | ValueError] = []
        taken: list[tuple[DraftState, torch.Tensor]] = []
        for state, f in zip(states, features, strict=True):
            fresh = state is None
            if fresh:
                slot = self.pool.acquire()
                if slot is None:
                    out.append(StatusError("RESOURCE_EXHAUSTED",
                                           f"all {self.pool.num_slots - 1} draft context slots are in use"))
                    continue
                state = DraftState(slot)
            if state.length + f.shape[0] > self.max_seq_len:
                if fresh:
                    self.pool.release(state.slot)
                out.append(ValueError(f"{state.length + f.shape[0]} prompt rows exceed max_seq_len {self.max_seq_len}"))
                continue
            out.append(state)
            taken.append((state, f))
        group: list[tuple[DraftState, torch.Tensor]] = []
        for item in sorted(taken, key=lambda item: item[1].shape[0]):  # ascending: the last one is the widest
            width = item[1].shape[0]
            if group and ((len(group) + 1) * width > self.max_prompt_rows
                          or max(s.length for s, _ in group + [item]) + width > self.pool.capacity):
                self._extend(group)
                group = []
            group.append(item)
        if group:
            self._extend(group)
        return out

    def _extend(self, group: Sequence[tuple[DraftState, torch.Tensor]]) -> None:
        """One batched context extension: each state's feature rows at its next positions."""
        dev = self.device
        rows = torch.nn.utils.rnn.pad_sequence([f for _, f in group], batch_first=True)
        self.draft.extend(self.pool.kv, to_device([s.slot for s, _ in group], dev, torch.int64),
                          to_device([s.length for s, _ in group], dev, torch.int64), to_device(rows, dev),
                          self.projected)
        for state, f in group:
            state.length += f.shape[0]

    @torch.inference_mode()
    def propose(self, states: Sequence[DraftState], roots: Sequence[int], new_tokens: Sequence[list[int]],
                new_features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Block logits [S, block_size - 1, V]: each session's context grows by its new feature
        rows (at most block_size), then one batched draft step over every session."""
        rows = [DraftRow(s.slot, s.length, root, f) for s, root, f in zip(states, roots, new_features)]
        logits = self._draft(rows, max(r.features.shape[0] for r in rows))
        for s, f in zip(states, new_features):
            s.length += f.shape[0]
        return logits

    @torch.inference_mode()
    def propose_verified(self, states: Sequence[DraftState], verified: VerifiedRows) -> torch.Tensor:
        """`propose` for sessions whose roots and new feature rows are the results of a verify
        still on this device (row i of `verified` for states[i]: an in-process verifier's), queued
        behind it without waiting for it. The contexts take the rows now, but their lengths grow
        only once the host knows how many (`grow`)."""
        unused = verified.features[0, :0]  # the rows' own roots and features are not read
        rows = [DraftRow(s.slot, s.length, -1, unused) for s in states]
        return self._draft(rows, verified.features.shape[1], verified)

    def _draft(self, rows: Sequence[DraftRow], width: int, verified: VerifiedRows | None = None) -> torch.Tensor:
        """One batched draft step (a graph's, else eager) of rows with up to `width` new feature rows."""
        logits = self.graphs.run(rows, verified) if self.graphs is not None else None
        if logits is None:
            inp = DraftInputs(len(rows), width, self.block_size, self.feature_dim, self.draft.cfg.mask_token_id,
                              self.draft.fc.weight.dtype, self.device, pinned=False, projected=self.projected)
            inp.fill(rows, self.scratch_slot, verified)
            length = max(r.past for r in rows) + width + self.block_size
            logits = draft_step(self.draft, self.embed_tokens, self.lm_head, self.pool.kv, inp, length)
        return logits

    def grow(self, state: DraftState, rows: int) -> None:
        """A session's context holds `rows` more feature rows (those `propose_verified` took)."""
        state.length += rows

    def finish(self, state: DraftState) -> None:
        """The session is over: give its slot back."""
        self.pool.release(state.slot)
