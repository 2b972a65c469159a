"""The DDTree selection on the GPU (`ddtree_kernels.ddtree_select`) against the host's numpy selection, on
the same candidates of bf16 draft logits at Qwen3-8B's vocabulary (bf16 logits tie often)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import drafter_svc.ddtree as ddtree
from ddtree_kernels.draft_topk import top_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("sessions, budget", [(1, 15), (32, 15), (16, 64), (4, 200)])
@pytest.mark.parametrize("peaked", [False, True])
def test_device_selection_equals_the_host_selection_on_bf16_logits(monkeypatch, kernel_env, sessions, budget, peaked):
    gen = torch.Generator(device="cuda").manual_seed(sessions * 1000 + budget + peaked)
    logits = torch.randn(sessions, 15, 151936, device="cuda", generator=gen)
    if peaked:  # a likely token per depth, as a trained draft has: deep chains
        logits[..., :4] += 12.0
    logits = logits.bfloat16()
    budgets = [budget - (s % 3) * (budget // 3) for s in range(sessions)]
    roots = list(range(sessions))
    candidates = top_logprobs(logits, budget)
    monkeypatch.setattr(ddtree, "top_logprobs", lambda *_: candidates)  # both paths select from these
    kernel_env("DDTREE_KERNELS", "triton")
    device = ddtree.select_ddtrees(logits, roots, budgets)
    kernel_env("DDTREE_KERNELS", "reference")
    host = ddtree.select_ddtrees(logits, roots, budgets)
    assert device.num_nodes.tolist() == host.num_nodes.tolist() == [1 + b for b in budgets]
    for s, n in enumerate(host.num_nodes.tolist()):
        assert np.array_equal(device.tokens[s, :n], host.tokens[s, :n]), s
        assert np.array_equal(device.parents[s, :n], host.parents[s, :n]), s
        assert np.array_equal(device.scores[s, : n - 1], host.scores[s, : n - 1]), s
