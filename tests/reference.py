"""Plain references the tests compare the engine against."""
from __future__ import annotations

import torch


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

    def __init__(self, model, block_size: int, rank1_every: int = 0):
        self.model, self.block_size, self.rank1_every = model, block_size, rank1_every
        self.vocab = model.cfg.vocab_size

    def start(self, prompt_ids, features):
        return list(prompt_ids)

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

    def block_logits(self, state, root_token, new_tokens, new_features):
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
