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


def shifts(gen: torch.Generator, b: int, p: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending destinations, each column's source at or after its own destination: sources that
    are later columns' destinations (in the same block of columns and in later ones), so a kernel
    that wrote a block before every read of it had finished, or that took the blocks out of
    order, would differ."""
    src, dst = [], []
    for _ in range(b):
        to = torch.randperm(length, generator=gen)[:p].sort()[0]
        ahead = torch.randint(0, 4, (p,), generator=gen)  # how many destinations ahead the source lies
        at = torch.minimum(torch.arange(p) + ahead, torch.tensor(p - 1))
        src.append(torch.where(at == torch.arange(p), to + (to < length - 1), to[at]).clamp(max=length - 1))
        dst.append(to)
    return torch.stack(src), torch.stack(dst)


def check_move_kv_rows(device: str, dtype: torch.dtype, layers: int, heads: int, d: int, b: int, t: int,
                       length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = b + 2
    k = torch.randn(layers, num_slots, heads, length, d, generator=gen).to(device, dtype)
    v = torch.randn(layers, num_slots, heads, length, d, generator=gen).to(device, dtype)
    slots = torch.randperm(num_slots, generator=gen)[:b]
    past = torch.randint(0, length - t + 1, (b,), generator=gen)
    cases = (("compaction", compaction(gen, past, t)), ("shifts", shifts(gen, b, t, length)))
    for kind, (src, dst) in cases:
        want_k, want_v = k.clone(), v.clone()
        move_kv_rows_reference(want_k, want_v, slots.to(device), src.to(device), dst.to(device))
        got_k, got_v = k.clone(), v.clone()
        move_kv_rows_triton(got_k, got_v, slots.to(device), src.to(device), dst.to(device))
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if kind == "shifts":
            assert not torch.equal(want_k, k)  # something moved


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_rows_matches_reference(seed, dtype):
    check_move_kv_rows("cpu", dtype, layers=2, heads=2, d=16, b=3, t=5, length=24, seed=seed)


@pytest.mark.parametrize("t", [1, 16, 17, 33, 130])
def test_move_kv_rows_odd_head_dim_and_any_width(t):
    check_move_kv_rows("cpu", torch.float32, layers=1, heads=3, d=12, b=2, t=t, length=t + 150, seed=t)


def test_move_kv_rows_refuses_mismatched_shapes():
    k = torch.zeros(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="src, dst"):
        move_kv_rows_triton(k, k.clone(), torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                            torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        move_kv_rows_triton(k, k.transpose(3, 4), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                            torch.zeros(1, 1, dtype=torch.long))


def test_move_kv_rows_skips_entries_outside_the_cache():
    """An index outside [0, length) never reaches memory: the kernel skips it, and moves the rest."""
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(1, 2, 1, 8, 4, generator=gen), torch.randn(1, 2, 1, 8, 4, generator=gen)
    slots = torch.tensor([1])
    src, dst = torch.tensor([[3, 9, 5, -1]]), torch.tensor([[0, 1, 8, 2]])
    got_k, got_v = k.clone(), v.clone()
    move_kv_rows_triton(got_k, got_v, slots, src, dst)
    want_k, want_v = k.clone(), v.clone()
    move_kv_rows_reference(want_k, want_v, slots, src[:, :1], dst[:, :1])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
