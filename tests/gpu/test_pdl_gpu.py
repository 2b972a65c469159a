"""Programmatic dependent launch (ddtree_kernels/pdl.py) changes no value: each kernel that takes it
gives the same bits with it on and off, at Qwen3-8B shapes, and so does the whole verify forward
replayed from CUDA graphs captured with it (bench/pdl.py at toy sizes)."""
import pytest
import torch

from bench import pdl as bench_pdl
from common.layers import RotaryEmbedding
from ddtree_kernels import pdl
from ddtree_kernels.layer_ops import add_rms_norm_triton, qk_norm_rope_store_triton, silu_mul_triton
from ddtree_kernels.skinny_gemm import skinny_config, skinny_linear
from ddtree_kernels.slot_attention import slot_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def forward_kernels(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's Triton kernels on fresh inputs of `rows` tokens (batch 1): their outputs by name."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, rows, 4096, generator=gen, **bf16)
    delta, norm = torch.randn(h.shape, generator=gen, **bf16), torch.rand(4096, generator=gen, **bf16) + 0.5
    heads, kv_heads, d = 32, 8, 128
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * d, generator=gen, **bf16)
    positions = torch.arange(300, 300 + rows, device="cuda")[None]
    cos, sin = RotaryEmbedding(d, 1e6).to("cuda")(positions, torch.bfloat16)
    qk_norms = [torch.rand(d, generator=gen, **bf16) + 0.5 for _ in range(2)]
    k_cache = torch.randn(2, kv_heads, 512, d, generator=gen, **bf16)
    v_cache = torch.randn(k_cache.shape, generator=gen, **bf16)
    slots, cache_pos = torch.tensor([1], device="cuda"), torch.arange(300, 300 + rows, device="cuda")[None]
    q = qk_norm_rope_store_triton(qkv, cos, sin, *qk_norms, 1e-6, heads, kv_heads, k_cache, v_cache, slots, cache_pos)
    mask = torch.ones(1, rows, 300 + rows, dtype=torch.bool, device="cuda")
    mask[0, :, 300:] = torch.rand(rows, rows, generator=gen, device="cuda") < 0.5
    mask[0, :, 300:] |= torch.eye(rows, dtype=torch.bool, device="cuda")
    outputs = dict(zip(("h", "x", "h_same", "x_only"), (*add_rms_norm_triton(h, delta, norm, 1e-6),
                                                        *add_rms_norm_triton(h, None, norm, 1e-6))))
    outputs |= {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                "silu_mul": silu_mul_triton(torch.randn(1, rows, 2 * 12288, generator=gen, **bf16))}
    for splits in (1, None):
        outputs[f"attention splits={splits}"] = slot_attention_triton(q, k_cache, v_cache, slots, mask, splits=splits)
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        if skinny_config(rows, n, k) is not None:
            x = torch.randn(1, rows, k, generator=gen, **bf16)
            outputs[f"gemm {n}x{k}"] = skinny_linear(x, torch.randn(n, k, generator=gen, **bf16) * 0.02)
    return outputs


def differing(got: dict, want: dict) -> dict[str, float]:
    """The outputs that differ, with their largest absolute difference."""
    return {name: (got[name].float() - want[name].float()).abs().max().item()
            for name in want if not torch.equal(got[name], want[name])}


@pytest.mark.parametrize("rows", [1, 16, 32, 65])
def test_each_kernel_gives_the_same_bits_with_pdl(kernel_env, rows):
    """Off twice (the comparison means something only if the kernels repeat themselves), then on."""
    results = []
    for flag in ("0", "0", "1" if HOPPER else "0"):
        kernel_env(pdl.ENV, flag)
        results.append(forward_kernels(rows, torch.Generator(device="cuda").manual_seed(rows)))
    torch.cuda.synchronize()
    assert differing(results[1], results[0]) == {}, "the kernels differ between two runs without PDL"
    assert differing(results[2], results[0]) == {}


def test_pdl_is_on_by_default_on_hopper(kernel_env):
    kernel_env(pdl.ENV, None)
    assert pdl.enabled(torch.device("cuda")) == HOPPER


def test_verify_forward_gives_the_same_bits_with_pdl():
    """bench/pdl.py at toy sizes: graphs captured with PDL off and on replay, and give the same
    logits and features."""
    res = bench_pdl.main(["--small", "--trees", "0,15", "--rounds", "1", "--reps", "2"])
    assert len(res["rows"]) == 4
    assert all(r["same_as_off"] and r["replay_ms"] is not None for r in res["rows"])


def test_the_start_up_line_says_whether_pdl_is_on(tiny_pair):
    from verifier_svc.server import VerifierConfig, load_verifier, startup_summary

    verifier = load_verifier(VerifierConfig(target_dir=str(tiny_pair[0]), device="cuda", max_sessions=2,
                                            max_seq_len=64, cuda_graphs=False))
    assert ("default kernels (Triton, programmatic dependent launch)" in startup_summary(verifier)) == HOPPER
