"""Runs the target model over the KV cache: prefill, tree-verify forward, KV compaction.

The runner knows positions, cache indices and masks, not sessions or sampling: the
verifier above it decides which slot a request uses and what was accepted.
"""
from __future__ import annotations

import torch

from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel


class TargetRunner:
    def __init__(self, model: TargetModel, num_slots: int, max_seq_len: int):
        self.model = model
        p = model.embed_tokens.weight
        self.device = p.device
        self.cache = KVCache(model.cfg, num_slots, max_seq_len, p.device, p.dtype)
        self.max_seq_len = max_seq_len

    def _run(self, slot: int, tokens: torch.Tensor, positions: torch.Tensor, past: int,
             local_mask: torch.Tensor, logit_rows: torch.Tensor | None) -> ForwardOutput:
        """Forward T tokens stored at cache [past, past+T); prefix fully visible, local_mask [T, T] within."""
        t = tokens.shape[0]
        mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device)
        mask[:, past:] = local_mask
        cache_pos = torch.arange(past, past + t, device=self.device)
        with torch.inference_mode():
            return self.model(
                tokens[None].to(self.device), positions[None].to(self.device), self.cache,
                torch.tensor([slot], device=self.device), cache_pos[None], mask[None], logit_rows,
            )

    def prefill(self, slot: int, prompt: torch.Tensor) -> ForwardOutput:
        """Causal forward of the prompt into an empty slot; logits for the last position only."""
        t = prompt.shape[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        last = torch.tensor([t - 1], device=self.device)
        return self._run(slot, prompt, torch.arange(t), 0, causal, last)

    def verify(self, slot: int, past: int, tokens: torch.Tensor, depths: torch.Tensor,
               tree_mask: torch.Tensor) -> ForwardOutput:
        """Tree forward: node i at position past + depth[i], cache index past + i."""
        return self._run(slot, tokens, past + depths, past, tree_mask.to(self.device), None)

    def commit(self, slot: int, past: int, path: torch.Tensor) -> None:
        """Compact the accepted path's K/V (tree node indices, root first) to [past, past+len)."""
        src = past + path.to(self.device)
        dst = torch.arange(past, past + path.shape[0], device=self.device)
        self.cache.move(slot, src, dst)
