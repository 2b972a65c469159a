"""The fused sampling + accept stage (ddtree_kernels/fused_accept.py) on the GPU, at the full Qwen3 vocabulary.

Skipped without CUDA (the CPU suite checks the same kernels in the Triton interpreter at
small vocabularies, tests/test_fused_accept.py). The stage starts from random bf16 logits:
its float32 sums differ from torch's in rounding only, so its outputs must equal those of
the composed references.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree_kernels.fused_accept import tree_accept, tree_accept_reference, tree_accept_triton
from tests.test_fused_accept import filter_kinds, random_stage, row_params, run_on

VOCAB = 151_936
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kernels_are_cuda_graph_capturable():
    """The batched accept step as the verify graphs run it: captured once, replayed on new inputs."""
    from verifier_svc.accept import accept_batch

    t, feat = 65, 32
    rng = np.random.default_rng(0)
    tree = random_stage(7, 1, t, 1000, torch.bfloat16)
    tokens, nt, ns = (tree[k][0].cuda()[None] for k in ("tokens", "next_token", "next_sibling"))
    logits = torch.from_numpy(rng.normal(size=(1, t, VOCAB))).float().cuda().to(torch.bfloat16)
    features = torch.randn(1, t, feat, device="cuda")
    static = dict(greedy=torch.tensor([False], device="cuda"), coins=torch.rand(1, t, device="cuda"),
                  final_coin=torch.rand(1, device="cuda"), temperature=torch.tensor([0.8], device="cuda"),
                  top_k=torch.tensor([50], device="cuda"), top_p=torch.tensor([0.9], device="cuda"))
    static.update(seeds=torch.tensor([12345], device="cuda"), positions=torch.arange(t, device="cuda")[None] + 100)
    for mode in ("greedy", "sample", "keyed"):
        eager = accept_batch(mode, tokens, nt, ns, logits, features, **static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            accept_batch(mode, tokens, nt, ns, logits, features, **static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = accept_batch(mode, tokens, nt, ns, logits, features, **static)
        graph.replay()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
        logits.copy_(torch.from_numpy(rng.normal(size=(1, t, VOCAB))).to(torch.bfloat16).cuda())
        static["coins"].copy_(torch.rand(1, t, device="cuda"))
        graph.replay()
        again = accept_batch(mode, tokens, nt, ns, logits, features, **static)
        assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])


# ---------------------------------------------------------------------------------------
# The fused sampling + accept stage (ddtree_kernels/fused_accept.py).
# ---------------------------------------------------------------------------------------

STAGES = ("greedy", "sample-temp", "sample")


def _stage_options(stage: str, bs: int, seed: int) -> dict:
    """tree_accept's keyword arguments for a stage; `sample` mixes top-k 50 / top-p 0.9 with the edges."""
    if stage == "greedy":
        return {"greedy": True}
    params = row_params(VOCAB, bs, seed, [(50, 0.9)] + filter_kinds(VOCAB))
    if stage == "sample-temp":
        return {"greedy": False, "temperature": params["temperature"], "filters": False}
    return {"greedy": False, **params}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("nodes", [17, 65])
@pytest.mark.parametrize("bs", [1, 4])
def test_fused_accept_matches_reference_at_full_vocab(bs, nodes, stage):
    seed = 10 * bs + nodes
    inputs = random_stage(seed, bs, nodes, VOCAB, torch.bfloat16, shape="deep")
    options = _stage_options(stage, bs, seed)
    expected = run_on("cpu", tree_accept_reference, inputs, **options)
    for impl in (tree_accept_triton, tree_accept):  # the dispatcher picks Triton on CUDA
        actual = run_on("cuda", impl, inputs, **options)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e), f"{impl.__name__}:\n{a}\n{e}"


@pytest.mark.parametrize("stage", STAGES)
def test_fused_accept_cuda_graph_replay_equals_eager(stage):
    """Captured once, replayed on new logits and coins: the same outputs as eager calls."""
    bs, nodes = 4, 65
    inputs = {k: v.cuda() for k, v in random_stage(3, bs, nodes, VOCAB, torch.bfloat16).items()}
    options = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _stage_options(stage, bs, 3).items()}
    if stage != "greedy":
        options.update(coins=inputs["coins"], final_coins=inputs["final_coins"])
    tree = [inputs[k] for k in ("logits", "tokens", "next_token", "next_sibling")]

    def fresh():
        return [torch.full((bs * nodes,), -1, dtype=torch.int32, device="cuda"),
                torch.full((bs, nodes), -1, dtype=torch.int32, device="cuda"),
                torch.zeros(bs, dtype=torch.int32, device="cuda")]

    def eager():
        out = fresh()
        tree_accept_triton(*tree, *out, **options)
        return out

    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tree_accept_triton(*tree, *fresh(), **options)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_accept_triton(*tree, *static, **options)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        for out in static:
            out.fill_(-1)
        static[2].zero_()
        graph.replay()
        want = eager()
        assert all(torch.equal(a, b) for a, b in zip(static, want))
        tree[0].copy_((torch.randn(tree[0].shape, generator=gen, device="cuda") * 3).to(torch.bfloat16))
        if stage != "greedy":
            options["coins"].copy_(torch.rand(options["coins"].shape, generator=gen, device="cuda"))
            options["final_coins"].copy_(torch.rand(options["final_coins"].shape, generator=gen, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keyed_accept_matches_reference_at_full_vocabulary(dtype):
    """The fused keyed stage at V = 151,936: the reference's paths and bonus tokens, greedy rows
    mixed in, filters on and off."""
    from ddtree_kernels.fused_accept import tree_accept_keyed_reference, tree_accept_keyed_triton

    bs, nodes = 8, 17
    stage = random_stage(5, bs, nodes, VOCAB, dtype, oracle=0.0)
    del stage["coins"], stage["final_coins"]
    params = row_params(VOCAB, bs, 2, filter_kinds(VOCAB))
    options = dict(greedy_rows=torch.tensor([b % 4 == 3 for b in range(bs)]),
                   seeds=torch.arange(bs, dtype=torch.int64) * 7919 + 11,
                   positions=torch.arange(nodes)[None].repeat(bs, 1) + 300, **params)
    options["temperature"] = torch.where(options["greedy_rows"], 1.0, options["temperature"])
    expected = run_on("cuda", tree_accept_keyed_reference, stage, **options)
    actual = run_on("cuda", tree_accept_keyed_triton, stage, **options)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_candidates_and_radix_search_agree_at_full_vocabulary(dtype, monkeypatch):
    """The filters' floors from the candidates equal the radix search's: at 2 candidates per
    chunk most rows take the search, at the default most are decided by the candidates, and
    the rows both decide give the same floor and mass."""
    from ddtree_kernels import fused_accept

    bs, nodes = 4, 65
    logits = random_stage(9, bs, nodes, VOCAB, dtype)["logits"].cuda()
    params = {k: v.cuda() for k, v in row_params(VOCAB, bs, 4, [(50, 0.9), (50, 1.0), (0, 0.9), (20, 0.5)]).items()}

    def stats(candidates: int):
        monkeypatch.setattr(fused_accept, "CANDIDATES", candidates)
        out = fused_accept._row_stats(logits, nodes, greedy=False, filters=True, **params)
        return out.floor.cpu(), out.kept.cpu(), out.exact.cpu()

    floor, kept, exact = stats(fused_accept.CANDIDATES)
    few_floor, few_kept, few_exact = stats(2)
    assert exact.float().mean() > 0.5 and few_exact.float().mean() < exact.float().mean()
    assert torch.equal(floor, few_floor)
    torch.testing.assert_close(kept, few_kept, rtol=1e-4, atol=0)
