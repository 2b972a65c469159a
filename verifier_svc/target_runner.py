"""Runs the target model over the KV cache: prefill, tree-verify forward, KV compaction.

The runner knows positions, cache indices and masks, not sessions or sampling: the
verifier above it decides which slot a request uses and what was accepted.

On CUDA the tree-verify forward replays CUDA graphs (`verifier_svc.cuda_graphs`), captured
when the runner is built; trees larger than the largest bucket, `cuda_graphs=False` and
CPU devices run eagerly. Prefill is always eager.
"""
from __future__ import annotations

import torch

from common.protocol import SamplingParams
from common.tree import DraftTree
from verifier_svc.accept import AcceptResult, Stage, accept_tree, no_stage
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs, cache_length
from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel


class TargetRunner:
    def __init__(self, model: TargetModel, num_slots: int, max_seq_len: int, cuda_graphs: bool = True,
                 graph_config: GraphConfig | None = None):
        self.model = model
        model.fuse_weights()
        p = model.embed_tokens.weight
        self.device = p.device
        self.max_seq_len = max_seq_len
        use_graphs = cuda_graphs and self.device.type == "cuda"
        config = graph_config or GraphConfig()
        # Graphs pad trees to their bucket: the padding's K/V land after the tree, so the cache
        # keeps room for the largest bucket past max_seq_len (never committed, never visible).
        length = cache_length(max_seq_len, config) if use_graphs else max_seq_len
        self.cache = KVCache(model.cfg, num_slots, length, p.device, p.dtype)
        self.graphs = VerifyGraphs(model, self.cache, max_seq_len, config) if use_graphs else None

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
        """Tree forward: node i at position past + depth[i], cache index past + i.

        Under CUDA graphs the outputs are views of static buffers, valid until the next verify.
        """
        if self.graphs is not None:
            out = self.graphs.forward(slot, past, tokens, depths, tree_mask)
            if out is not None:
                return out
        return self._run(slot, tokens, past + depths, past, tree_mask.to(self.device), None)

    def verify_accept(self, slot: int, past: int, tree: DraftTree, depths: torch.Tensor, tree_mask: torch.Tensor,
                      sampling: SamplingParams, coins: torch.Tensor | None = None,
                      stage: Stage = no_stage) -> AcceptResult:
        """Forward + accept (greedy, or target-only sampling with `coins` float32 [n + 1]) + the
        features of the accepted path: one graph replay on CUDA, the same steps eagerly otherwise.

        `stage` wraps the steps: "forward" and "sample" eagerly; under a graph, "forward" is the
        replay (forward and accept kernels together) and "sample" reading the result back.
        """
        if not sampling.greedy and coins is None:
            raise ValueError("sampling needs coins: float32 [num_nodes + 1]")
        if self.graphs is not None:
            result = self.graphs.verify_accept(slot, past, tree, depths, tree_mask, sampling, coins, stage)
            if result is not None:
                return result
        with stage("forward"):
            out = self.verify(slot, past, tree.tokens, depths, tree_mask)
        with stage("sample"):
            return accept_tree(tree, out.logits[0], out.features[0], sampling, coins)

    def commit(self, slot: int, past: int, path: torch.Tensor) -> None:
        """Compact the accepted path's K/V (tree node indices, root first) to [past, past+len)."""
        src = past + path.to(self.device)
        dst = torch.arange(past, past + path.shape[0], device=self.device)
        self.cache.move(slot, src, dst)
