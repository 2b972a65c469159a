"""Host <-> device copies that do not wait (common/staging.py), on the GPU.

`to_device` must queue its copy behind the device's work rather than wait for it (a pageable
copy would: the drafter's and the verifier's small index copies then stalled each step for
the other service's time slice on a shared GPU), and give the right values; `HostCopy` must
bring several tensors (views included) back after one wait.
"""
from __future__ import annotations

import pytest
import torch

from common.staging import HostCopy, to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_to_device_does_not_wait_for_queued_work_and_lands_in_order():
    dev = torch.device("cuda")
    x = torch.zeros(4, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued device work
    index = to_device([3, 0, 2, 1], dev, torch.int64)
    busy = not torch.cuda.current_stream().query()
    x[index] = torch.arange(4, device=dev)  # runs after the copy, in stream order
    assert busy, "to_device waited for the device's queue"
    assert x.tolist() == [1, 3, 2, 0]
    rows = torch.randn(5, 3)
    assert torch.equal(to_device(rows, dev, torch.float32).cpu(), rows)


def test_host_copy_brings_several_tensors_and_views_back_after_one_wait():
    a = torch.randn(6, 17, 8, device="cuda", dtype=torch.bfloat16)
    b = torch.randint(0, 100, (6, 19), device="cuda")
    host_c, host_a, host_b = HostCopy(torch.arange(3), a[:4, :5], b[:4]).wait()  # a host tensor first, too
    assert host_a.device.type == "cpu" and torch.equal(host_a, a[:4, :5].cpu())
    assert torch.equal(host_b, b[:4].cpu()) and host_c.tolist() == [0, 1, 2]


def test_host_copy_waits_for_its_copies_only_not_for_work_queued_after_them():
    a = torch.randn(64, 33, device="cuda")
    copy = HostCopy(a[:, 1:])
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device work queued behind the copy (the next step, say)
    (host,) = copy.wait()
    assert not torch.cuda.current_stream().query(), "HostCopy.wait waited for work queued after its copies"
    assert copy.ready() and torch.equal(host, a[:, 1:].cpu())
