"""Repetition penalties on the target's logits, exactly per tree node: OpenAI's presence_penalty and
frequency_penalty (over the generated tokens) and vLLM's repetition_penalty (over the prompt and the
generated tokens), applied in vLLM's order after the token biases:

    x' = (x / r if x > 0 else x * r) if the token occurs in the context else x
    x'' = x' - (frequency * count + (presence if count > 0 else 0))

`count` is how often the token occurs among the generated tokens before the position the logits
predict. In a tree that context is the session's committed tokens plus the node's own path (the
root, its ancestors and itself), so each node has counts of its own. The verifier keeps, per KV
slot, how often each token occurs in the committed context (`PenaltyState`: the generated tokens,
and all of them); a verify step applies those to every node (the dense part, `penalize_dense`),
then, for each node, recomputes from the raw logits the tokens of its path with their path
occurrences added (`penalize`). Every value goes through the one formula (`penalized`) with the
same counts as a one-token-at-a-time decoding would give, so tree decoding equals plain decoding
with the same penalties, bit for bit.

Rows without penalties (presence 0, frequency 0, repetition 1) come out unchanged: the formula is
then the identity in floating point, and the device kernel skips them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.protocol import SamplingParams
from common.staging import to_device


class PenaltyState:
    """Per KV slot, token occurrences in the committed context: `generated` counts the tokens at
    positions from the session's output start on, `context` all of them (float32 [slots, V], exact
    integers)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device):
        self.generated = torch.zeros(slots, vocab_size, dtype=torch.float32, device=device)
        self.context = torch.zeros(slots, vocab_size, dtype=torch.float32, device=device)

    @torch.inference_mode()
    def take_prompt(self, fresh: Tensor, slots: Tensor, tokens: Tensor, generated: Tensor) -> None:
        """Count a prefill's prompt tokens (eager): the slots in `fresh` (int64) start afresh (a new
        session's first chunk), then token tokens[i] (int64 [N]) counts in slot slots[i], as
        generated where generated[i] (a re-opened session's prompt holds its tokens so far)."""
        self.generated.index_fill_(0, fresh, 0.0)
        self.context.index_fill_(0, fresh, 0.0)
        self.take(slots, tokens, torch.ones_like(generated), generated)

    def count_paths(self, slots: Tensor, tokens: Tensor, result: Tensor, penalties: Tensor) -> None:
        """A verify step's accepted paths (result int64 [B, T + 2] = [accepted, bonus, path padded
        with -1], the nodes' tokens [B, T]) join their slots' counts, for the rows with penalties
        at least (the others' counts are never read). Static shapes: inside the verify graphs."""
        b, t = tokens.shape
        if tokens.is_cuda:
            from ddtree_kernels.penalties import MAX_WIDTH, count_paths_triton
            if t <= MAX_WIDTH:
                count_paths_triton(self.generated, self.context, slots, penalties, tokens, result)
                return
        keep = torch.arange(t, device=tokens.device)[None] <= result[:, :1]
        path = torch.gather(tokens, 1, result[:, 2:].clamp(min=0))
        self.take(slots[:, None].expand(b, t), path, keep, keep)

    def take(self, slots: Tensor, tokens: Tensor, in_context: Tensor, generated: Tensor) -> None:
        """Add tokens to slots (int64, one slot per token, any one shape): to `context` where
        in_context, to `generated` where generated (bool). Static shapes: a verify step's accepted
        paths are counted inside its graphs."""
        self.context.index_put_((slots, tokens), in_context.float(), accumulate=True)
        self.generated.index_put_((slots, tokens), generated.float(), accumulate=True)


NO_PENALTY = (0.0, 0.0, 1.0)  # [presence, frequency, repetition] of a row without penalties


def penalty_values(sampling: Sequence[SamplingParams]) -> list[list[float]]:
    """Each row's [presence, frequency, repetition], as the verify step's inputs hold them."""
    return [[s.presence_penalty, s.frequency_penalty, s.repetition_penalty] for s in sampling]


def penalized(x: Tensor, count: Tensor, seen: Tensor, presence: Tensor, frequency: Tensor,
              repetition: Tensor) -> Tensor:
    """The formula, in float32, one operation at a time (the device kernel rounds each the same
    way): x the raw logits, count the token's generated occurrences, seen whether it occurs in
    the context; the penalties broadcast against x."""
    x = x.float()
    repeated = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    subtract = frequency * count
    subtract = subtract + torch.where(count > 0, presence, 0.0)
    return repeated - subtract


def penalize_dense(logits: Tensor, state: PenaltyState, slots: Tensor, penalties: Tensor) -> None:
    """Every token of logits [B, T, V] penalised in place with its row's committed counts (slot
    slots[b], penalties float32 [B, 3]); rows without penalties unchanged."""
    if logits.is_cuda:
        from ddtree_kernels.penalties import penalize_dense_triton
        penalize_dense_triton(logits, state.generated, state.context, slots, penalties)
        return
    p, f, r = (penalties[:, k, None, None] for k in range(3))
    count = state.generated[slots][:, None]
    logits.copy_(penalized(logits, count, state.context[slots][:, None] > 0, p, f, r))


def penalize(logits: Tensor, state: PenaltyState, slots: Tensor, tokens: Tensor, ancestors: Tensor,
             penalties: Tensor) -> None:
    """A verify step's penalties, in place and with static shapes: logits [B, T, V] of tree nodes
    whose tokens are [B, T] and ancestors [B, T, T] (node n sees node a: a is n or one of its
    ancestors), slots [B], penalties float32 [B, 3] (presence, frequency, repetition).

    Node n's counts are its slot's plus its path's. For each pair (n, a) of a node and one of its
    path's nodes, the first such a with its token writes that token's value at n; every other
    pair writes the value of n's own token at n. Writers of one place thus write one value (in
    any order), computed from the raw logit before the dense part changed it. On CUDA, trees of
    up to `MAX_WIDTH` nodes take one launch (`ddtree_kernels.penalties.penalize_nodes_triton`)."""
    b, t, _ = logits.shape
    if logits.is_cuda:
        from ddtree_kernels.penalties import MAX_WIDTH, penalize_nodes_triton
        if t <= MAX_WIDTH:
            penalize_nodes_triton(logits, state.generated, state.context, slots, tokens, ancestors, penalties)
            return
    seen = ancestors.float()  # [B, N, A]
    same = (tokens[:, :, None] == tokens[:, None, :]).float()  # [B, A, A']
    on_path = torch.bmm(seen, same.transpose(1, 2))  # [B, N, A]: n's path nodes with a's token
    earlier = torch.bmm(seen, (same * torch.ones(t, t, device=logits.device).tril(-1)).transpose(1, 2))
    first = ancestors & (earlier == 0)
    own = torch.diagonal(on_path, dim1=1, dim2=2)  # [B, N]: n's path nodes with n's token
    target = torch.where(first, tokens[:, None, :], tokens[:, :, None])
    extra = torch.where(first, on_path, own[:, :, None])
    raw = torch.gather(logits, 2, target)
    rows = slots[:, None, None].expand_as(target)
    count = state.generated[rows, target] + extra
    seen_anywhere = (state.context[rows, target] + extra) > 0
    p, f, r = (penalties[:, k, None, None] for k in range(3))
    values = penalized(raw, count, seen_anywhere, p, f, r).to(logits.dtype)
    penalize_dense(logits, state, slots, penalties)
    logits.scatter_(2, target, values)


class TokenCounts:
    """One session's token occurrences (the drafter's, where its block logits are): `generated`
    its emitted tokens, `context` those and its prompt's (float32 [V])."""

    def __init__(self, vocab_size: int, device: torch.device, prompt: Sequence[int]):
        self.generated = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.context = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._add(self.context, prompt)
        self.counted = 0  # emitted tokens counted so far

    def catch_up(self, emitted: Sequence[int]) -> TokenCounts:
        """Count the emitted tokens not counted yet; returns self."""
        new = emitted[self.counted:]
        if new:
            self._add(self.generated, new)
            self._add(self.context, new)
            self.counted = len(emitted)
        return self

    @staticmethod
    def _add(counts: Tensor, tokens: Sequence[int]) -> None:
        index = to_device(list(tokens), counts.device, torch.int64)
        counts.index_add_(0, index, torch.ones(index.shape, dtype=counts.dtype, device=counts.device))


@torch.inference_mode()
def penalize_block(logits: Tensor, rows: Sequence[tuple[int, TokenCounts, SamplingParams]]) -> None:
    """The drafter's block logits [S, D, V] penalised in place, row i of each (i, counts, sampling)
    with its session's counts at every depth (its tree's own tokens are not counted: this only
    steers the proposals toward what the penalised target picks)."""
    for i, counts, s in rows:
        logits[i] = penalized(logits[i], counts.generated, counts.context > 0, torch.tensor(s.presence_penalty),
                              torch.tensor(s.frequency_penalty), torch.tensor(s.repetition_penalty)).to(logits.dtype)


def penalty_rows(sampling: Sequence[SamplingParams], device: torch.device) -> Tensor | None:
    """float32 [B, 3] of the rows' penalties, or None when no row has any."""
    if not any(s.penalized for s in sampling):
        return None
    return to_device(penalty_values(sampling), device, torch.float32)
