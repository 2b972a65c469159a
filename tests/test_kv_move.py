"""The verify step's KV compaction: Triton kernel == the cache's advanced indexing, exactly.

On the CPU the kernel runs in Triton's interpreter; tests/gpu runs the same checks compiled, at
Qwen3-8B sizes.
"""
import pytest
import torch

from ddtree_kernels.kv_move import move_kv_rows_reference, move_kv_rows_triton


def compaction(gen: torch.Generator, past: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """src, dst [B, T] as verify_step builds them: a random root-first increasing path per row,
    its first 1 + accepted nodes moved to past + i, every other column copying past onto itself."""
    src, dst = [], []
    for p in past.tolist():
        accepted = int(torch.randint(0, t, (), generator=gen))
        chosen = torch.randperm(t - 1, generator=gen)[:accepted].sort()[0] + 1
        path = torch.cat([torch.zeros(1, dtype=torch.long), chosen, torch.full((t - 1 - accepted,), -1)])
        keep = torch.arange(t) <= accepted
        src.append(p + torch.where(keep, path, 0))
        dst.append(p + torch.where(keep, torch.arange(t), 0))
    return torch.stack(src), torch.stack(dst)


def permutations(gen: torch.Generator, b: int, p: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct destinations whose sources are other columns' destinations: a row's reads and
    writes overlap, so a kernel that wrote before every read had finished would differ."""
    dst = torch.stack([torch.randperm(length, generator=gen)[:p] for _ in range(b)])
    src = torch.stack([row[torch.randperm(p, generator=gen)] for row in dst])
    return src, dst


def check_move_kv_rows(device: str, dtype: torch.dtype, layers: int, heads: int, d: int, b: int, t: int,
                       length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = b + 2
    k = torch.randn(layers, num_slots, heads, length, d, generator=gen).to(device, dtype)
    v = torch.randn(layers, num_slots, heads, length, d, generator=gen).to(device, dtype)
    slots = torch.randperm(num_slots, generator=gen)[:b]
    past = torch.randint(0, length - t + 1, (b,), generator=gen)
    cases = (("compaction", compaction(gen, past, t)), ("permutation", permutations(gen, b, t, length)))
    for kind, (src, dst) in cases:
        want_k, want_v = k.clone(), v.clone()
        move_kv_rows_reference(want_k, want_v, slots.to(device), src.to(device), dst.to(device))
        got_k, got_v = k.clone(), v.clone()
        move_kv_rows_triton(got_k, got_v, slots.to(device), src.to(device), dst.to(device))
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if kind == "permutation":
            assert not torch.equal(want_k, k)  # something moved


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_rows_matches_reference(seed, dtype):
    check_move_kv_rows("cpu", dtype, layers=2, heads=2, d=16, b=3, t=5, length=24, seed=seed)


def test_move_kv_rows_odd_head_dim_and_wide_tree():
    check_move_kv_rows("cpu", torch.float32, layers=1, heads=3, d=12, b=2, t=33, length=80, seed=5)


def test_move_kv_rows_refuses_mismatched_shapes():
    k = torch.zeros(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="src, dst"):
        move_kv_rows_triton(k, k.clone(), torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                            torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        move_kv_rows_triton(k, k.transpose(3, 4), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                            torch.zeros(1, 1, dtype=torch.long))


def test_move_kv_rows_past_the_tile_takes_the_reference(monkeypatch):
    """A step wider than one tile is refused by the kernel and moved by the reference through the
    dispatching wrapper, with the same result."""
    from ddtree_kernels import kv_move

    monkeypatch.setenv("DDTREE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(1, 2, 1, 300, 4, generator=gen)
    v = torch.randn(1, 2, 1, 300, 4, generator=gen)
    slots = torch.tensor([1])
    src, dst = permutations(gen, 1, kv_move.MAX_COLUMNS + 1, 300)
    with pytest.raises(ValueError, match="at most"):
        move_kv_rows_triton(k.clone(), v.clone(), slots, src, dst)
    want_k, want_v = k.clone(), v.clone()
    move_kv_rows_reference(want_k, want_v, slots, src, dst)
    kv_move.move_kv_rows(k, v, slots, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
