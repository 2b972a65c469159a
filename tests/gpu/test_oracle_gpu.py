"""The benchmark oracle's edit (drafter_svc/oracle.py) on the GPU.

It must queue behind the draft step without waiting for the device: a wait stalled the
drafter's step, on a shared GPU for the other service's time slice too, and showed in the
benchmark as draft time that a real draft does not have. And it must make the calibrated draft
in bf16 as well.
"""
from __future__ import annotations

import pytest
import torch

from drafter_svc.oracle import ControlledAcceptance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_edit_does_not_wait_for_the_device_and_calibrates_in_bf16():
    truth = list(range(1000, 1100))
    hook = ControlledAcceptance(0.8445, {(1, 2, 3): truth, (4, 5): truth[::-1]}, seed=1)
    prompts, outputs = [[1, 2, 3], [4, 5], [9]], [truth[:5], truth[::-1][:7], [1]]
    logits = torch.randn(3, 15, 151936, device="cuda", dtype=torch.bfloat16)
    hook(prompts, outputs, 15)(logits.clone())  # warm-up: the allocator's blocks are cached
    raw = logits[2].clone()
    edit = hook(prompts, outputs, 15)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued device work (the draft step)
    edit(logits)
    assert not torch.cuda.current_stream().query(), "the oracle's edit waited for the device"
    top = logits[:2].float().softmax(-1).amax(-1)
    assert torch.allclose(top, torch.full_like(top, 0.8445), atol=5e-3)
    assert torch.equal(logits[2], raw)  # no continuation known: untouched
