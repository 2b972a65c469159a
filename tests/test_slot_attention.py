"""`slot_attention_triton` (reads K/V from the cache slot in place, split over keys) == SDPA over the gathered slot."""
import pytest
import torch

from ddtree_kernels.slot_attention import (SHORT_KEYS, AttentionTiles, attention_tiles, key_ranges,
                                          slot_attention_reference, slot_attention_triton)


def tree_mask(gen: torch.Generator, b: int, t: int, length: int, pasts: list[int]) -> torch.Tensor:
    """Row b sees its past (pasts[b] keys) whole, then a random subset of the t tree keys after
    it, and always itself (key past + row), like a tree row; everything after that is hidden."""
    mask = torch.rand(b, t, length, generator=gen) < 0.3
    for i, past in enumerate(pasts):
        mask[i, :, :past] = True
        mask[i, :, past + t:] = False
        mask[i, torch.arange(t), past + torch.arange(t)] = True
    return mask


def causal_mask(b: int, t: int, length: int, pasts: list[int]) -> torch.Tensor:
    """A prefill chunk: token j of row b sees keys up to pasts[b] + j."""
    cols = torch.arange(length)
    return torch.stack([cols[None] <= past + torch.arange(t)[:, None] for past in pasts])


def check_slot_attention(device: str, dtype: torch.dtype, splits: int | None, *, b=2, heads=4, kv_heads=2, d=16,
                         t=9, length=200, slots_n=3, tol=1e-5, pasts=None, kind="tree", tiles=None):
    gen = torch.Generator().manual_seed(t + length + (splits or 0))
    q = torch.randn(b, heads, t, d, generator=gen).to(device, dtype)
    k_cache = torch.randn(slots_n, kv_heads, length + 16, d, generator=gen).to(device, dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([slots_n - 1, 0, 1][:b], device=device)
    pasts = pasts or [length - t - 7] * b
    mask = tree_mask(gen, b, t, length, pasts) if kind == "tree" else causal_mask(b, t, length, pasts)
    mask = mask.to(device)
    got = slot_attention_triton(q, k_cache, v_cache, slots, mask, splits=splits, tiles=tiles)
    want = slot_attention_reference(q.float(), k_cache.float(), v_cache.float(), slots, mask)
    assert got.shape == (b, t, heads, d)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_slot_attention_matches_sdpa(splits):
    check_slot_attention("cpu", torch.float32, splits)


@pytest.mark.parametrize("splits", [1, 3])
def test_slot_attention_of_one_token(splits):
    """Decode steps (one token a row: the kernel's ONE_TOKEN variant), with and without splits."""
    check_slot_attention("cpu", torch.float32, splits, b=3, t=1, length=150, pasts=[17, 64, 149])


def test_slot_attention_split_with_no_visible_keys():
    """A split whose keys nobody sees (past the tree) must not disturb the merge."""
    check_slot_attention("cpu", torch.float32, 4, length=256, t=3)


TILES = [AttentionTiles(16, 64, 4, 2), AttentionTiles(64, 32, 4, 1), AttentionTiles(128, 64, 8, 3),
         AttentionTiles(32, 16, 4, 2, programs_per_sm=4)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda x: f"{x.block_m}x{x.block_n}")
@pytest.mark.parametrize("kind", ["tree", "causal"])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_slot_attention_tiles_and_uneven_pasts(tiles, kind, splits):
    """Rows whose pasts end mid-tile, in different tiles, and whose masks differ in kind: the
    shared-prefix loop, the masked loop and the keys skipped past the last visible one."""
    check_slot_attention("cpu", torch.float32, splits, b=3, t=5, length=150, pasts=[17, 64, 131], kind=kind,
                         tiles=tiles)


def test_key_ranges_match_a_plain_scan():
    gen = torch.Generator().manual_seed(7)
    masks = [torch.rand(4, 6, 50, generator=gen) < p for p in (0.2, 0.9)]
    masks.append(torch.ones(2, 3, 40, dtype=torch.bool))
    masks.append(torch.zeros(2, 3, 40, dtype=torch.bool))
    masks.append(tree_mask(gen, 3, 5, 90, [0, 33, 70]))
    masks.append(causal_mask(2, 4, 30, [5, 26]))
    for mask in masks:
        got = key_ranges(mask).tolist()
        for row, (prefix, end) in zip(mask, got):
            shared = row.all(0).tolist()
            seen = row.any(0).tolist()
            want_prefix = next((j for j, s in enumerate(shared) if not s), len(shared))
            want_end = max((j + 1 for j, s in enumerate(seen) if s), default=0)
            assert (prefix, end) == (want_prefix, want_end)


def test_attention_tiles_fill_the_gpu_over_few_keys():
    """Decode steps take 16-row blocks; over few keys the largest block whose programs fill 132
    SMs without key splits, else 16 rows; over many keys, or when 64-row blocks fill the GPU, 64."""
    sms = 132
    assert attention_tiles(4, 8, 1024, sms).block_m == 16  # one token, 4 query heads per KV head
    assert attention_tiles(64, 8, 144, sms).block_m == 16  # batch 1, 16 tokens: 32 programs at most
    assert attention_tiles(256, 8, 192, sms).block_m == 16  # batch 1, 64 tokens: 128 programs of 16 rows
    assert attention_tiles(256, 32, 576, sms).block_m == 32  # batch 4, 64 tokens: 128 programs of 64 rows, 256 of 32
    assert attention_tiles(68, 128, 400, sms).block_m == 64  # batch 16, 17 tokens
    assert attention_tiles(256, 8, SHORT_KEYS + 1, sms).block_m == 64  # long keys
