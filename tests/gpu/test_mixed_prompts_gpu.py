"""Prompt chunks riding a verify's forward under CUDA graphs equal a prefill of their own
(float32): tests/test_mixed_prompts.py's check, its verifies replaying captured graphs (the
segments' rows through the graph's inputs, the features' copy and the penalties' kernels)."""
from __future__ import annotations

import pytest
import torch

from tests.test_mixed_prompts import check_mixed_equals_apart, verifier
from verifier_svc.cuda_graphs import GraphConfig

CUDA = torch.cuda.is_available()
# 2 trees of 16 nodes and 5 segments: 7 rows, in the 8 bucket (buckets go to twice the 6 sessions)
CONFIG = GraphConfig(tree_buckets=(8, 15), batch_buckets=(1, 2, 4, 8, 12), kv_buckets=(64, 160),
                     modes=("greedy", "keyed"), prefill_batches=(1, 2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_prompts_in_a_captured_verify_equal_their_own_prefill(tiny_pair):
    twins = [verifier(tiny_pair[0], mix, "cuda", CONFIG) for mix in (True, False)]
    graphs = twins[0].runner.graphs
    assert graphs is not None and graphs.batch_buckets == (1, 2, 4, 8, 12) and graphs.num_graphs
    assert graphs.select("keyed", 7, 16, 16 + 16) is not None  # the mixed step's shape has a graph
    check_mixed_equals_apart(twins)
