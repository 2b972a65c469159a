"""Compiled Triton kernels on the GPU == their PyTorch references, at the full Qwen3 vocabulary.

Skipped without CUDA (the CPU suite checks the same kernels in the Triton interpreter at
small vocabularies, tests/test_kernels.py). Random target probabilities are multiples of
2**-20 there and here, so both implementations must agree bit for bit. The fused accept
stage (kernels/fused_accept.py) starts from random bf16 logits: its float32 sums differ from
torch's in rounding only, so its outputs must be equal too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.fused_accept import tree_accept, tree_accept_reference, tree_accept_triton
from kernels.probs import process_probs, process_probs_reference, process_probs_triton
from kernels.tree_sampling import (
    tree_speculative_sampling_target_only,
    tree_speculative_sampling_target_only_reference,
    tree_speculative_sampling_target_only_triton,
    verify_tree_greedy,
    verify_tree_greedy_reference,
    verify_tree_greedy_triton,
)
from tests.test_fused_accept import filter_kinds, random_stage, row_params, run_on
from tests.test_kernels import assert_same, random_batch, random_filters

VOCAB = 151_936
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def on_gpu(impl, args: dict) -> dict:
    """Call impl on CUDA copies of args; return its outputs on the CPU."""
    moved = {k: v.clone().cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    impl(**moved)
    return {k: moved[k].cpu() for k in ("predicts", "accept_index", "accept_token_num", "draft_probs") if k in moved}


def on_cpu(impl, args: dict) -> dict:
    moved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    impl(**moved)
    return {k: moved[k] for k in ("predicts", "accept_index", "accept_token_num", "draft_probs") if k in moved}


CASES = [
    # (shape, nodes, batch, random_batch options, other thresholds)
    ("random", 17, 2, {}, (0.5, 0.5)),
    ("chain", 17, 2, {"path": "full"}, (0.0, 0.0)),
    ("deep", 65, 1, {}, (0.3, 1.0)),
    ("wide", 33, 2, {"zero_children": True}, (0.5, 0.5)),
    ("random", 129, 1, {"path": "short"}, (0.6, 0.9)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-N{c[1]}-bs{c[2]}" for c in CASES])
def test_tree_kernels_match_reference_at_full_vocab(case):
    shape, num_nodes, bs, options, other = case
    sampling, greedy = random_batch(CASES.index(case), shape, num_nodes, VOCAB, bs, **options)
    for threshold_single, threshold_acc in [(1.0, 1.0), other]:
        args = {**sampling, "threshold_single": threshold_single, "threshold_acc": threshold_acc}
        expected = on_cpu(tree_speculative_sampling_target_only_reference, args)
        assert_same(on_gpu(tree_speculative_sampling_target_only_triton, args), expected)
        assert_same(on_gpu(tree_speculative_sampling_target_only, args), expected)  # dispatch picks Triton
        # The reference on CUDA tensors gives the same too.
        assert_same(on_gpu(tree_speculative_sampling_target_only_reference, args), expected)
    want = on_cpu(verify_tree_greedy_reference, greedy)
    assert_same(on_gpu(verify_tree_greedy_triton, greedy), want)
    assert_same(on_gpu(verify_tree_greedy, greedy), want)


def _close_rows(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same support and values within 1e-6; except that a row may differ in at most 2 entries at
    its top-p boundary (the cut compares a cumulative mass that can differ in the last bit between
    a chunked and a torch sum), with the renormalised values then within 1e-4."""
    differ = ((actual > 0) != (expected > 0)).sum(dim=-1)
    assert differ.max().item() <= 2, "different support"
    error = (actual - expected).abs().max(dim=-1).values
    assert (error[differ == 0] <= 1e-6).all(), error.max().item()
    assert (error <= 1e-4).all(), error.max().item()
    assert torch.allclose(actual.sum(-1), torch.ones(actual.shape[0], device=actual.device), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 17, 65])
def test_process_probs_matches_reference_at_full_vocab(dtype, rows):
    rng = np.random.default_rng(rows)
    logits = (torch.from_numpy(rng.normal(size=(rows, VOCAB))) * 3).to(dtype).cuda()
    filters = [t.cuda() for t in random_filters(rng, rows, VOCAB)]
    expected = process_probs_reference(logits, *filters)
    _close_rows(process_probs_triton(logits, *filters), expected)
    _close_rows(process_probs(logits, *filters), expected)
    # The reference itself on CPU vs CUDA: torch's softmax rounds differently there (seen on an
    # H200: up to 6e-6 on the largest probabilities), so this one is compared relatively.
    cpu = process_probs_reference(logits.cpu(), *(f.cpu() for f in filters))
    differ = ((expected.cpu() > 0) != (cpu > 0)).sum(dim=-1)
    assert differ.max().item() <= 2
    error = (expected.cpu() - cpu).abs().max(dim=-1).values
    scale = cpu.abs().max(dim=-1).values
    assert (error[differ == 0] <= (1e-6 + 3e-5 * scale)[differ == 0]).all(), error.max().item()
    assert (error <= 1e-4).all(), error.max().item()


def test_kernels_are_cuda_graph_capturable():
    """The accept step as the verify graphs run it: captured once, replayed on new inputs."""
    from verifier_svc.accept import accept_step

    t, feat = 65, 32
    rng = np.random.default_rng(0)
    sampling, _ = random_batch(7, "random", t, 1000, 1)
    nt, ns = sampling["retrive_next_token"][0].cuda(), sampling["retrive_next_sibling"][0].cuda()
    tokens = sampling["candidates"][0].cuda()
    logits = torch.from_numpy(rng.normal(size=(t, VOCAB))).float().cuda().to(torch.bfloat16)
    features = torch.randn(t, feat, device="cuda")
    static = dict(coins=torch.rand(t, device="cuda"), final_coin=torch.rand(1, device="cuda"),
                  temperature=torch.tensor([0.8], device="cuda"), top_k=torch.tensor([50], device="cuda"),
                  top_p=torch.tensor([0.9], device="cuda"))
    for mode in ("greedy", "sample"):
        eager = accept_step(mode, tokens, nt, ns, logits, features, **static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            accept_step(mode, tokens, nt, ns, logits, features, **static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = accept_step(mode, tokens, nt, ns, logits, features, **static)
        graph.replay()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
        logits.copy_(torch.from_numpy(rng.normal(size=(t, VOCAB))).to(torch.bfloat16).cuda())
        static["coins"].copy_(torch.rand(t, device="cuda"))
        graph.replay()
        again = accept_step(mode, tokens, nt, ns, logits, features, **static)
        assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])


# ---------------------------------------------------------------------------------------
# The fused sampling + accept stage (kernels/fused_accept.py).
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
