"""Trees handed over on the GPU (`common.tree.DeviceTrees`): the Triton selection left on the
device gives the trees of the host's selection, a NaN row shows as a failed tree, the place
kernel and its torch reference fill the verify buffers as host trees do, and a verify through
CUDA graphs takes DeviceTrees as their host twins."""
from __future__ import annotations

import pytest
import torch

import drafter_svc.ddtree as ddtree
from ddtree_kernels.draft_topk import top_logprobs
from tests.test_device_trees import test_a_verifier_step_takes_device_trees_as_their_host_twins as verifier_step
from tests.test_device_trees import test_fill_with_device_trees_equals_the_reference as fill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("sessions, budget", [(1, 15), (32, 15), (8, 64)])
def test_device_trees_are_the_host_selection(monkeypatch, kernel_env, sessions, budget):
    gen = torch.Generator(device="cuda").manual_seed(sessions + budget)
    logits = torch.randn(sessions, 15, 151936, device="cuda", generator=gen)
    logits[..., :4] += 12.0  # deep chains, as a trained draft gives
    logits = logits.bfloat16()
    logits[sessions // 2, 3, 7] = float("nan")
    budgets = [budget - (s % 3) * (budget // 3) for s in range(sessions)]
    roots = list(range(sessions))
    good = [s for s in range(sessions) if s != sessions // 2]
    candidates = top_logprobs(logits, budget)  # both paths select from these (bf16 ties)
    monkeypatch.setattr(ddtree, "top_logprobs", lambda x, k: candidates if x.shape[0] == sessions
                        else tuple(c[good] for c in candidates))
    kernel_env("DDTREE_KERNELS", "triton")
    handed = ddtree.select_device_trees(logits, roots, budgets)
    assert handed[0].trees.tokens.is_cuda
    kernel_env("DDTREE_KERNELS", "reference")
    host = ddtree.select_ddtrees(logits[good], [roots[s] for s in good], [budgets[s] for s in good]).trees()
    for s, want in zip(good, host):
        got = handed[s].on_host()
        assert not handed[s].failed and handed[s].num_nodes == want.num_nodes == 1 + budgets[s]
        fields = zip((got.tokens, got.next_token, got.next_sibling), (want.tokens, want.next_token, want.next_sibling))
        assert all(torch.equal(a, b) for a, b in fields), s
    assert handed[sessions // 2].failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_graphed_verify_takes_device_trees_as_their_host_twins(tiny_pair, dtype):
    verifier_step(tiny_pair, device="cuda", dtype=dtype)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(4))
def test_device_trees_fill_the_buffers_on_cuda(kernel_env, backend, seed):
    fill(kernel_env, backend, seed, device="cuda")
