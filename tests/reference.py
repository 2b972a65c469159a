"""Plain references the tests compare the engine against."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from common.tree import DraftTree


def distinct_sibling_tokens(rng, parents: list[int], vocab: int) -> list[int]:
    """Random node tokens for a tree given by `parents`, siblings pairwise distinct
    (a valid draft tree: duplicate sibling tokens are refused by the verifier)."""
    tokens = [int(rng.integers(vocab))]
    used: dict[int, set[int]] = {}
    for node in range(1, len(parents)):
        siblings = used.setdefault(parents[node], set())
        tok = int(rng.integers(vocab))
        while tok in siblings:
            tok = int(rng.integers(vocab))
        siblings.add(tok)
        tokens.append(tok)
    return tokens


@dataclass(frozen=True, eq=False)
class ScoredTree:
    """A built tree plus the per-node facts the builder knows (index 0 = root)."""

    tree: DraftTree
    parents: list[int]  # parents[0] = -1
    scores: list[float]  # cumulative log-prob of the path to the node; scores[0] = 0.0
    ranks: list[tuple[int, ...]]  # per-depth ranks of that path; ranks[0] = ()

    @property
    def depths(self) -> list[int]:
        return [len(path) for path in self.ranks]


def build_ddtree_heap_reference(block_logits: Tensor, root_token: int, budget: int) -> ScoredTree:
    """Best-first heap search for one session's DDTree (the order `drafter_svc.ddtree` documents),
    keeping each node's parent, score and ranks. Scores are Python (float64) sums."""
    if block_logits.dim() != 2:
        raise ValueError(f"block_logits must be [depth, vocab], got shape {tuple(block_logits.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    num_depths, vocab_size = block_logits.shape
    k = min(budget, vocab_size)

    tokens, parents, scores, ranks = [int(root_token)], [-1], [0.0], [()]
    if k > 0 and num_depths > 0:
        top = torch.topk(torch.log_softmax(block_logits.float(), dim=-1), k, dim=-1)
        top_logq, top_tokens = torch.stack((top.values.double(), top.indices.double())).tolist()
        if any(math.isnan(row[0]) for row in top_logq):  # topk ranks NaN first
            raise ValueError("block_logits contain NaN (or a row that is all -inf)")

        # Heap entries: (-score, depth, rank tuple, parent node); the first three are the
        # ordering key, and they are unique, so `parent` is never compared.
        heap = [(-top_logq[0][0], 1, (0,), 0)]
        while heap and len(tokens) <= budget:
            neg_score, depth, path_ranks, parent = heapq.heappop(heap)
            node, rank, score = len(tokens), path_ranks[-1], -neg_score
            tokens.append(int(top_tokens[depth - 1][rank]))
            parents.append(parent)
            scores.append(score)
            ranks.append(path_ranks)
            if rank + 1 < k:
                sibling_score = scores[parent] + top_logq[depth - 1][rank + 1]
                heapq.heappush(heap, (-sibling_score, depth, path_ranks[:-1] + (rank + 1,), parent))
            if depth < num_depths:
                child_score = score + top_logq[depth][0]
                heapq.heappush(heap, (-child_score, depth + 1, path_ranks + (0,), node))

    # Node index = pop order, so each parent's children are already in descending score.
    return ScoredTree(DraftTree.from_parents(tokens, parents), parents, scores, ranks)


def hf_greedy(target_dir, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own model, recomputing the full sequence each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


class OracleProposer:
    """A test draft source whose block logits favour the target's own greedy continuation.

    At each depth the true next token gets rank 0, except at depths picked by `rank1_every`
    where a decoy takes rank 0 and the true token rank 1: a chain stops there, a tree with
    siblings recovers.
    """

    free_slots = 1 << 30  # a session's state is its token list: no slots to run out of

    def __init__(self, model, block_size: int, rank1_every: int = 0):
        self.model, self.block_size, self.rank1_every = model, block_size, rank1_every
        self.vocab = model.cfg.vocab_size

    def take_prompts(self, states, prompt_ids, features):
        out = []
        for state, ids in zip(states, prompt_ids):
            if state is None:
                out.append(list(ids))
            else:
                state.extend(ids)
                out.append(state)
        return out

    def finish(self, state):
        pass

    def _continuation(self, ids: list[int], n: int) -> list[int]:
        from verifier_svc.target_model import KVCache

        cache = KVCache(self.model.cfg, 1, len(ids) + n + 1, "cpu", torch.float32)
        out = []
        seq = list(ids)
        with torch.inference_mode():
            for _ in range(n):
                t = len(seq)
                pos = torch.arange(t)[None]
                mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
                logits = self.model(torch.tensor([seq]), pos, cache, torch.tensor([0]), pos, mask).logits
                seq.append(int(logits[0, -1].argmax()))
                out.append(seq[-1])
        return out

    def propose(self, states, roots, new_tokens, new_features):
        return torch.stack([self._block_logits(s, t) for s, t in zip(states, new_tokens)])

    def _block_logits(self, state, new_tokens):
        state.extend(new_tokens)
        depth = self.block_size - 1
        truth = self._continuation(state, depth)
        gen = torch.Generator().manual_seed(len(state))
        logits = torch.randn(depth, self.vocab, generator=gen)
        for d, tok in enumerate(truth):
            logits[d, tok] = 10.0
            if self.rank1_every and (len(state) + d) % self.rank1_every == 0:
                decoy = (tok + 1) % self.vocab
                logits[d, decoy] = 12.0
        return logits


def dflash_hidden_reference(draft, embed: Tensor, features: Tensor, block_ids: list[int]) -> Tensor:
    """The DFlash draft's hidden states [T, hidden] for one session, the z-lab formulation: one
    pass over keys [projected context features; block] (concatenated, no cache, no mask), the
    block at positions len(features) .. len(features) + T - 1 after context positions 0 ..
    len(features) - 1. Plain PyTorch ops only (SDPA, separate projections)."""
    from common.layers import apply_rope

    ctx_len, t = features.shape[0], len(block_ids)
    dtype = draft.fc.weight.dtype
    hidden = draft.hidden_norm(draft.fc(features.to(embed.device, dtype)))[None]
    h = embed[torch.tensor(block_ids, device=embed.device)][None].to(dtype)
    cos, sin = draft.rotary(torch.arange(ctx_len + t, device=embed.device)[None], h.dtype)
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.query(x, cos[:, ctx_len:], sin[:, ctx_len:])
        both = torch.cat([hidden, x], dim=1)
        k = attn.k_proj(both).view(1, ctx_len + t, attn.num_kv_heads, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        v = attn.v_proj(both).view(1, ctx_len + t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        h = h + attn.attend(q, k, v, None)
        mlp, y = layer.mlp, layer.post_attention_layernorm(h)
        h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(y)) * mlp.up_proj(y))
    return draft.norm(h)[0]


def decode_with_flaky_link(engine, requests, fail_at: tuple[int, ...], **scheduler_options):
    """Decode `requests` ((prompt, GenerationConfig) pairs) through a scheduler over an in-process
    link to engine.verifier whose sends number `fail_at` (1-based) fail as a lost verifier does
    (its sessions dropped, UNAVAILABLE), so that the sessions re-open; returns each request's
    tokens and how many sends there were."""
    from common.protocol import StatusError
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler

    class FlakyLink(LocalLink):
        sends = 0

        def send(self, entries):
            self.sends += 1
            if self.sends in fail_at:
                self.close()
                raise StatusError("UNAVAILABLE", "verifier went away")
            super().send(entries)

    scheduler = DraftScheduler(FlakyLink(engine.verifier), engine.proposer, max_sessions=len(requests),
                               feature_layer_ids=engine.verifier.feature_layer_ids, recovery_timeout_s=30.0,
                               **scheduler_options)
    ends = [{} for _ in requests]
    for end, (prompt, config) in zip(ends, requests):
        scheduler.submit(prompt, config, lambda item, end=end: end.__setitem__("last", item))
    scheduler.run_until_idle()
    return [end["last"].tokens for end in ends], scheduler.link.sends
