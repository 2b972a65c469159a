"""The repetition penalties' device kernels (`ddtree_kernels.penalties`) against the CPU reference
(`common.penalties`), bit for bit, on random trees, counts and penalties, trees wider than a node
program takes among them (the torch path part); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from common.penalties import PenaltyState, penalize
from tests.test_penalties import random_tree

CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalize_on_the_device_equals_the_reference(dtype):
    """Vocabularies over several kernel chunks, rows with and without penalties, the slots' counts
    and the paths' tokens overlapping."""
    gen = torch.Generator().manual_seed(1)
    dev = torch.device("cuda")
    for v, widest in ((7, 17), (1024, 17), (3001, 140), (151_936, 17)):
        for _ in range(4):
            b, t = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, widest, (1,), generator=gen))
            logits = (torch.randn(b, t, v, generator=gen) * 4).to(dtype)
            state = PenaltyState(b + 1, v, torch.device("cpu"))
            state.generated.copy_(torch.randint(0, 3, state.generated.shape, generator=gen).float())
            state.context.copy_(state.generated + torch.randint(0, 2, state.generated.shape, generator=gen).float())
            slots = torch.randperm(b + 1, generator=gen)[:b]
            tokens = torch.randint(0, min(v, 6), (b, t), generator=gen)
            ancestors = torch.stack([random_tree(gen, t) for _ in range(b)])
            penalties = torch.stack([torch.tensor([float(torch.empty(()).uniform_(-2, 2, generator=gen)),
                                                   float(torch.empty(()).uniform_(-2, 2, generator=gen)),
                                                   float(torch.empty(()).uniform_(0.3, 3.0, generator=gen))])
                                     for _ in range(b)])
            penalties[0] = torch.tensor([0.0, 0.0, 1.0])
            on_device = PenaltyState(b + 1, v, dev)
            on_device.generated.copy_(state.generated)
            on_device.context.copy_(state.context)
            got = logits.to(dev)
            penalize(got, on_device, slots.to(dev), tokens.to(dev), ancestors.to(dev), penalties.to(dev))
            penalize(logits, state, slots, tokens, ancestors, penalties)
            assert torch.equal(got.cpu(), logits), (v, b, t)
            result = torch.full((b, t + 2), -1, dtype=torch.int64)
            result[:, 0] = torch.randint(0, t, (b,), generator=gen)
            for row in range(b):
                result[row, 2: 3 + int(result[row, 0])] = torch.randperm(t, generator=gen)[: int(result[row, 0]) + 1]
            on_device.count_paths(slots.to(dev), tokens.to(dev), result.to(dev), penalties.to(dev))
            state.count_paths(slots, tokens, result, penalties)
            counted = slots[penalties[:, 0] != 0]  # the rows with penalties (row 0 has none)
            assert torch.equal(on_device.generated.cpu()[counted], state.generated[counted])
            assert torch.equal(on_device.context.cpu()[counted], state.context[counted])
