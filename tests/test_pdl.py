"""ddtree_kernels/pdl.py's settings: PDL only on a CUDA GPU of compute capability 9.0+, never in the
interpreter; the kernels that take it run the same off it (tests/gpu/test_pdl_gpu.py checks the bits
with it on a GPU)."""
import pytest
import torch

from ddtree_kernels import pdl
from ddtree_kernels.skinny_gemm import skinny_linear


def test_no_launch_takes_pdl_off_a_gpu(kernel_env):
    for flag in ("", "0", "1", "auto"):
        kernel_env(pdl.ENV, flag)
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


def test_the_setting_is_checked(kernel_env):
    kernel_env(pdl.ENV, "yes")
    with pytest.raises(ValueError, match=pdl.ENV):
        pdl.enabled(torch.device("cpu"))


def test_the_pdl_kernels_run_interpreted_with_pdl_asked_for(kernel_env):
    """DDTREE_PDL=1 changes nothing in the interpreter (the kernels take PDL=False there)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(96, 64, generator=gen)
    want = skinny_linear(x, w, tiles=dict(BLOCK_N=32, BLOCK_K=32, num_stages=1))
    kernel_env(pdl.ENV, "1")
    got = skinny_linear(x, w, tiles=dict(BLOCK_N=32, BLOCK_K=32, num_stages=1))
    assert torch.equal(got, want)
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-4)


def test_the_verifier_start_up_line_says_which_kernels_run(kernel_env, tiny_pair):
    """On the CPU the references, or Triton's (interpreted) where DDTREE_KERNELS says so, never
    with PDL; a bad setting stops the start-up (tests/gpu/test_pdl_gpu.py checks a GPU's line)."""
    from verifier_svc.server import VerifierConfig, load_verifier, startup_summary

    verifier = load_verifier(VerifierConfig(target_dir=str(tiny_pair[0]), max_sessions=2, max_seq_len=64))
    assert "default kernels (PyTorch references)," in startup_summary(verifier)
    kernel_env("DDTREE_KERNELS", "triton")
    assert "default kernels (Triton)," in startup_summary(verifier)
    for name, bad in (("DDTREE_KERNELS", "fast"), (pdl.ENV, "yes")):
        kernel_env(name, bad)
        with pytest.raises(ValueError, match=name):
            startup_summary(verifier)
        kernel_env(name, None)


def test_the_pdl_bench_runs_small_on_the_cpu():
    """bench/pdl.py end to end at toy sizes (the GPU suite's PDL test runs it at full size): both
    settings give the same outputs."""
    from bench import pdl as pdl_bench

    res = pdl_bench.main(["--small", "--device", "cpu", "--batches", "1", "--trees", "0,16"])
    assert {(r["tokens"], r["setting"]) for r in res["rows"]} == {(1, "off"), (1, "pdl"), (17, "off"), (17, "pdl")}
    assert all(r["same_as_off"] for r in res["rows"])
