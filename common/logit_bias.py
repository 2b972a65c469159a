"""Token biases on logits (logit_bias; min_tokens' held-back ids at -inf), as both services apply
them: the verifier to the target's logits, exactly (the output is that of the biased target),
and the drafter to its block logits, to steer its proposals toward what the verifier will pick."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.protocol import TokenBias
from common.staging import to_device


def bias_tokens(logits: Tensor, next_positions: Tensor, ids: Tensor, values: Tensor, until: Tensor) -> None:
    """Add token biases to logits, in place and with static shapes (inside the verify graphs):
    entry k of batch row b adds values[b, k] (float32 [B, K]) to the logit of token ids[b, k] in
    the rows of logits [B, T, V] whose next token goes to a position next_positions [b, t] <
    until[b, k]. Unused entries add 0 (to token 0). Entries of one token add up (a scatter-add):
    with at most one finite value among them, as a request gives, the sum does not depend on
    their order."""
    b, t, _ = logits.shape
    active = next_positions[:, :, None] < until[:, None, :]
    add = torch.where(active, values[:, None, :], 0.0).to(logits.dtype)
    logits.scatter_add_(2, ids[:, None, :].expand(b, t, ids.shape[1]), add)


@torch.inference_mode()
def bias_rows(logits: Tensor, biases: Sequence[Sequence[TokenBias]], first_positions: Sequence[int]) -> None:
    """`bias_tokens` on logits [B, T, V] from each row's TokenBias entries (row b's T next tokens go to
    positions first_positions[b] + 0..T-1), eagerly and in place, touching only the rows that
    have some (nothing at all when none has)."""
    rows = [i for i, row in enumerate(biases) if row]
    if not rows:
        return
    k = max(len(biases[i]) for i in rows)
    entries = [list(biases[i]) + [TokenBias(0, 0.0)] * (k - len(biases[i])) for i in rows]
    dev = logits.device
    positions = (to_device([first_positions[i] for i in rows], dev, torch.int64)[:, None]
                 + torch.arange(logits.shape[1], device=dev))
    index = to_device(rows, dev, torch.int64)
    part = logits.index_select(0, index)
    bias_tokens(part, positions, to_device([[e.token for e in row] for row in entries], dev, torch.int64),
                to_device([[e.value for e in row] for row in entries], dev, torch.float32),
                to_device([[e.until for e in row] for row in entries], dev, torch.int64))
    logits.index_copy_(0, index, part)
