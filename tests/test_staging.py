"""Host <-> device copies that do not wait (common/staging.py), on the CPU: values, dtypes, views."""
from __future__ import annotations

import torch

from common.staging import HostCopy, to_device


def test_to_device_takes_lists_and_tensors_with_their_dtype():
    out = to_device([3, 1, 2], "cpu", torch.int64)
    assert out.dtype == torch.int64 and out.tolist() == [3, 1, 2]
    flags = to_device([True, False], torch.device("cpu"), torch.bool)
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    x = torch.arange(6, dtype=torch.int32).view(2, 3)
    y = to_device(x, "cpu", torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, x.float())
    assert torch.equal(to_device(x, "cpu"), x)


def test_host_copy_returns_host_tensors_unchanged():
    a, b = torch.randn(4, 5), torch.arange(7)
    out = HostCopy(a[:, 1:3], b).wait()
    assert torch.equal(out[0], a[:, 1:3]) and torch.equal(out[1], b)
    assert HostCopy().wait() == []


def test_rows_of_selects_rows_and_keeps_the_tensor_when_all_are_asked():
    from common.staging import rows_of

    x = torch.arange(12).view(4, 3)
    assert rows_of(x, [0, 1, 2, 3]) is x
    assert torch.equal(rows_of(x, [2, 0]), x[[2, 0]])
    assert rows_of(x, []).shape == (0, 3)


def test_host_copy_of_host_tensors_is_ready_at_once():
    a = torch.arange(5)
    copy = HostCopy(a)
    assert copy.ready() and copy.wait()[0] is a


def test_stack_rows_views_back_to_back_slices_and_copies_the_rest():
    from common.staging import stack_rows

    x = torch.randn(9, 4)
    parts = [x[0:2], x[2:2], x[2:7], x[7:9]]  # back to back, one of them empty
    stacked = stack_rows(parts, 4, x.dtype)
    assert torch.equal(stacked, x) and stacked.data_ptr() == x.data_ptr()  # a view, no copy
    apart = [x[0:2], x[5:7]]  # a gap between them
    out = stack_rows(apart, 4, x.dtype)
    assert torch.equal(out, torch.cat(apart)) and out.data_ptr() != x.data_ptr()
    swapped = [x[4:6], x[0:4]]  # out of order
    assert torch.equal(stack_rows(swapped, 4, x.dtype), torch.cat(swapped))
    empty = stack_rows([x[:0]], 4, torch.bfloat16)
    assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
