"""Compiled fused norm / RoPE / SiLU-and-mul kernels == reference at Qwen3-8B sizes (tests/test_layer_ops.py's checks)."""
import pytest
import torch

from tests.test_layer_ops import DTYPES, check_add_rms_norm, check_qk_norm_rope_store, check_silu_mul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 65, 129])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_compiled(dtype, rows, with_delta):
    check_add_rms_norm("cuda", dtype, (1, rows, 4096), with_delta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_compiled(dtype, qk_norm):
    check_qk_norm_rope_store("cuda", dtype, qk_norm, heads=32, kv_heads=8, d=128, b=2, t=65)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 65])
def test_silu_mul_compiled(dtype, rows):
    check_silu_mul("cuda", dtype, (1, rows, 2 * 12288))
