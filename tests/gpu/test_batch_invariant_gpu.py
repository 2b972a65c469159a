"""The deterministic mode on the GPU: the Triton GEMM and attention give every row the bits it
gets alone, in bf16 and float32; under CUDA graphs a tree's logits equal plain decoding's along
each path; the engine's batched tree output equals its AR output in bf16 (tests/test_batch_invariant.py
checks the same on the CPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from ddtree_kernels import batch_invariant as bi
from tests.reference import OracleProposer
from tests.test_batch_invariant import (_default_mode_after, _model, check_logical_attention,  # noqa: F401
                                        check_tree_logits_equal_plain_decoding, check_tree_output_equals_ar)
from verifier_svc.cuda_graphs import GraphConfig
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import VerifierLimits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("n", [3072, 6144], ids=["narrow", "wide"])  # both tile shapes of `_tiles`
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_triton_is_row_invariant_on_gpu(dtype, n):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(700, 4096, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, 4096, device="cuda", generator=gen) * 0.02).to(dtype)
    full = bi.linear_triton(x, w)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), **tol)
    for start, stop in ((0, 1), (3, 4), (5, 22), (17, 82), (64, 129), (100, 644), (0, 700)):
        assert torch.equal(bi.linear_triton(x[start:stop], w), full[start:stop]), (start, stop)
    out = torch.empty(2, 350, n, device="cuda", dtype=dtype)
    bi.linear_triton(x.view(2, 350, 4096), w, out=out)
    assert torch.equal(out.view(700, n), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logical_attention_on_gpu(dtype):
    check_logical_attention(bi.logical_attention_triton, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_logits_equal_plain_decoding_under_graphs(tiny_pair, dtype):
    """Graph replays (tree bucket 16 with batch bucket 4; plain steps in bucket 0 at batch 1)
    and the eager forward alike."""
    bi.set_enabled(True)
    model = _model(tiny_pair, dtype, "cuda")
    config = GraphConfig(tree_buckets=(0, 16), batch_buckets=(1, 4), modes=("forward", "greedy"), max_kv_buckets=1)
    runner = TargetRunner(model, 4, 256, 33, graph_config=config)
    assert runner.graphs.num_graphs > 0

    def replay(rows, masks):
        out = runner.graphs.run("forward", rows, masks)
        assert out is not None
        return out.logits[: len(rows)].clone()

    check_tree_logits_equal_plain_decoding(model, runner, replay)
    check_tree_logits_equal_plain_decoding(model, runner, lambda rows, masks: runner.forward_batch(rows, masks).logits)


def test_tree_output_equals_ar_on_gpu_bfloat16(qwen3_pair):
    """bf16 with CUDA graphs: every mode equals AR, greedy and seeded; with an oracle draft whose
    trees hold long accepted paths too."""
    bi.set_enabled(True)
    engine = LocalEngine.load(str(qwen3_pair[0]), str(qwen3_pair[1]), device="cuda", dtype=torch.bfloat16,
                              limits=VerifierLimits(max_sessions=6, max_seq_len=256))
    assert engine.verifier.runner.graphs.num_graphs > 0
    check_tree_output_equals_ar(engine)
    target = TargetModel.from_pretrained(qwen3_pair[0], ())  # the oracle's own float32 copy on the CPU
    oracle = dataclasses.replace(engine, proposer=OracleProposer(target, block_size=8, rank1_every=5))
    prompts = [[5, 17, 42, 99, 3], list(range(40, 77)), [7] * 9]
    ar = engine.generate_many([(p, GenerationConfig(40, mode=DraftMode("ar", 0))) for p in prompts])
    got = oracle.generate_many([(p, GenerationConfig(40, mode=DraftMode("tree", 16))) for p in prompts])
    assert [o.tokens for o in got] == [o.tokens for o in ar]
