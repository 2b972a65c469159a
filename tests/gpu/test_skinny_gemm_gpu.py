"""The few-row GEMM on the GPU in bfloat16, at Qwen3-8B's shapes, against the float32 product
of the same bf16 inputs (cuBLAS's bf16 result is held to the same bound), and `linear`'s choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.layers import linear, residual_linear
from ddtree_kernels.layer_ops import add_rms_norm_triton
from ddtree_kernels.skinny_gemm import SplitSum, skinny_linear, split_linear, tiles_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (1000, 200)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32])
def test_skinny_linear_bf16_matches_float32(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    exact = F.linear(x.float(), w.float())
    bound = 2 * (F.linear(x, w).float() - exact).abs().max().item() + 1e-3
    if tiles_for(x, w) is not None:
        got = skinny_linear(x, w)
        assert got.dtype == torch.bfloat16 and (got.float() - exact).abs().max().item() <= bound
        assert torch.equal(linear(x, w), got)  # linear takes it
    else:
        assert m > 16 and k > 8192 and torch.equal(linear(x, w), F.linear(x, w))
    out = torch.empty(1, m, n, device="cuda", dtype=torch.bfloat16)
    assert linear(x[None], w, out=out) is out and torch.equal(out[0], linear(x, w))


def test_skinny_linear_in_a_cuda_graph():
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    out = torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16)
    want = skinny_linear(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(x, w, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 12288)])
@pytest.mark.parametrize("m", [16, 33, 64])
def test_split_linear_bf16_matches_float32(m, n, k):
    """The K-split GEMM at o_proj's and down's shapes: its total within cuBLAS's error of the
    float32 product; `residual_linear` takes it; add_rms_norm adds the partials exactly as it
    adds their total; and a CUDA graph replays it to the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(1, m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    exact = F.linear(x.float(), w.float())
    bound = 2 * (F.linear(x, w).float() - exact).abs().max().item() + 1e-3
    got = residual_linear(x, w)
    assert isinstance(got, SplitSum) and got.partials.shape == (2, 1, m, n)
    assert (got.total().float() - exact).abs().max().item() <= bound
    h = torch.randn(1, m, n, device="cuda", generator=gen).bfloat16()
    weight = torch.rand(n, device="cuda", generator=gen).bfloat16()
    split_h, split_x = add_rms_norm_triton(h, got, weight, 1e-6)
    whole_h, whole_x = add_rms_norm_triton(h, got.total(), weight, 1e-6)
    assert torch.equal(split_h, whole_h) and torch.equal(split_x, whole_x)
    holder = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split_linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        holder["out"] = split_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(holder["out"].partials, got.partials)
