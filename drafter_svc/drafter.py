"""The drafter's model side: DFlash block logits and the draft tree built from them.

The drafter holds the DFlash draft plus only the target's `embed_tokens` and `lm_head`
(loaded from the target checkpoint), and one `DraftContext` per session. On CUDA the draft
rounds replay CUDA graphs (`drafter_svc.draft_graphs`) over a pool of context slots; the
prompt's features, rounds that fit no graph, `cuda_graphs=False` and CPU devices run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from common.checkpoint import load_tensors
from common.config import check_draft_fits_target, load_target_config
from common.tree import DraftTree
from drafter_svc.ddtree import build_chain, build_ddtree
from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs
from drafter_svc.draft_model import DFlashDraftModel, DraftContext


@dataclass(frozen=True)
class DraftMode:
    """How each round's tree is made: a DDTree of `budget` nodes, the argmax chain, or none (plain AR)."""
    kind: str = "tree"  # "tree" | "chain" | "ar"
    budget: int = 16

    def __post_init__(self):
        if self.kind not in ("tree", "chain", "ar"):
            raise ValueError(f"unknown draft mode {self.kind!r}")
        if self.budget < 0:
            raise ValueError(f"tree budget must be >= 0, got {self.budget}")


class BlockProposer(Protocol):
    """Anything that proposes per-depth logits for the tokens after a root."""

    block_size: int

    def start(self, prompt_ids: list[int], features: torch.Tensor) -> object: ...

    def block_logits(self, state: object, root_token: int, new_tokens: list[int],
                     new_features: torch.Tensor) -> torch.Tensor: ...

    def finish(self, state: object) -> None: ...


def build_tree(mode: DraftMode, block_logits: torch.Tensor | None, root_token: int, room: int) -> DraftTree:
    """The round's tree under `mode`, with at most `room` nodes besides the root."""
    if mode.kind == "ar" or room <= 0 or block_logits is None:
        return build_ddtree(torch.zeros(1, 1), root_token, 0)
    if mode.kind == "chain":
        return build_chain(block_logits[:room], root_token)
    return build_ddtree(block_logits, root_token, min(mode.budget, room))


class DFlashProposer:
    """Block logits from the DFlash draft, conditioned on target features. Serving only: the
    constructor fuses the draft's q/k/v and gate/up weights (`DFlashDraftModel.fuse_weights`)."""

    def __init__(self, draft: DFlashDraftModel, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 max_seq_len: int, cuda_graphs: bool = True, graph_config: DraftGraphConfig | None = None):
        self.draft = draft
        draft.fuse_weights()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = draft.cfg.block_size
        self.mask_token_id = draft.cfg.mask_token_id
        self.max_seq_len = max_seq_len
        use_graphs = cuda_graphs and embed_tokens.device.type == "cuda"
        self.graphs = (DraftGraphs(draft, embed_tokens, lm_head, max_seq_len, graph_config or DraftGraphConfig())
                       if use_graphs else None)

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, target_dir: str | Path, device="cpu",
                        dtype=torch.float32, max_seq_len: int = 2048, cuda_graphs: bool = True,
                        graph_config: DraftGraphConfig | None = None) -> "DFlashProposer":
        target_cfg = load_target_config(target_dir)
        draft = DFlashDraftModel.from_pretrained(draft_dir, device=device, dtype=dtype)
        check_draft_fits_target(draft.cfg, target_cfg)
        names = ["embed_tokens.weight"] + ([] if target_cfg.tie_word_embeddings else ["lm_head.weight"])
        tensors = load_tensors(target_dir, names, strip_prefix="model.", dtype=dtype)
        embed = tensors["embed_tokens.weight"].to(device)
        head = tensors.get("lm_head.weight", tensors["embed_tokens.weight"]).to(device)
        return cls(draft, embed, head, max_seq_len, cuda_graphs, graph_config)

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], features: torch.Tensor) -> DraftContext:
        """A session's context (a pool slot when graphs are on and one is free) holding the prompt's features."""
        ctx = self.graphs.acquire() if self.graphs is not None else None
        if ctx is None:
            ctx = self.draft.new_context(self.max_seq_len + self.block_size)
        try:
            self.draft.extend_context(ctx, features.to(self.embed_tokens.device))
        except BaseException:
            ctx.close()
            raise
        return ctx

    @torch.inference_mode()
    def block_logits(self, ctx: DraftContext, root_token: int, new_tokens: list[int],
                     new_features: torch.Tensor) -> torch.Tensor:
        """Logits [block_size - 1, vocab] for the tokens after `root_token`."""
        if self.graphs is not None and ctx.slot is not None:
            logits = self.graphs.step(ctx, root_token, new_features)
            if logits is not None:
                return logits
        self.draft.extend_context(ctx, new_features.to(self.embed_tokens.device))
        block = torch.full((self.block_size,), self.mask_token_id, device=self.embed_tokens.device)
        block[0] = root_token
        hidden = self.draft(ctx, self.embed_tokens[block])
        return hidden[1:] @ self.lm_head.T

    def finish(self, ctx: DraftContext) -> None:
        """The session is over: give its context (slot) back."""
        ctx.close()
