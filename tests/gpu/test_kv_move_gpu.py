"""The compiled KV compaction kernel == the cache's advanced indexing at Qwen3-8B sizes (tests/test_kv_move.py)."""
import pytest
import torch

from tests.test_kv_move import check_move_kv_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b, t", [(1, 16), (32, 16), (32, 65), (2, 200)])
def test_move_kv_rows_compiled(dtype, b, t):
    check_move_kv_rows("cuda", dtype, layers=4, heads=8, d=128, b=b, t=t, length=512, seed=b + t)
