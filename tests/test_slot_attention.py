"""`slot_attention_triton` (reads K/V from the cache slot in place, split over keys) == SDPA over the gathered slot."""
import pytest
import torch

from kernels.slot_attention import slot_attention_reference, slot_attention_triton


def check_slot_attention(device: str, dtype: torch.dtype, splits: int | None, *, b=2, heads=4, kv_heads=2, d=16,
                         t=9, length=200, slots_n=3, tol=1e-5):
    gen = torch.Generator().manual_seed(t + length + (splits or 0))
    q = torch.randn(b, heads, t, d, generator=gen).to(device, dtype)
    k_cache = torch.randn(slots_n, kv_heads, length + 16, d, generator=gen).to(device, dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([slots_n - 1, 0][:b], device=device)
    # Each row sees a random prefix length's worth of keys plus a random subset after it, and
    # always itself (key past + row), like a tree row; everything past past + t is hidden.
    past = length - t - 7
    mask = torch.rand(b, t, length, generator=gen) < 0.3
    mask[..., :past] = True
    mask[..., past + t:] = False
    mask[:, torch.arange(t), past + torch.arange(t)] = True
    mask = mask.to(device)
    got = slot_attention_triton(q, k_cache, v_cache, slots, mask, splits=splits)
    want = slot_attention_reference(q.float(), k_cache.float(), v_cache.float(), slots, mask)
    assert got.shape == (b, t, heads, d)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_slot_attention_matches_sdpa(splits):
    check_slot_attention("cpu", torch.float32, splits)


def test_slot_attention_split_with_no_visible_keys():
    """A split whose keys nobody sees (past the tree) must not disturb the merge."""
    check_slot_attention("cpu", torch.float32, 4, length=256, t=3)
