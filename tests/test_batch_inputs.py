"""`BatchInputs.fill` (the verify graphs' static inputs, written through numpy views of the
host buffers) against a plain reference with torch operations, on fresh random batches:
greedy and sampled rows, trees of every size up to the bucket, batches below the bucket."""
from __future__ import annotations

import random

import pytest
import torch

from common.protocol import SamplingParams
from common.tree import DraftTree, ancestor_masks, walk_trees
from verifier_svc.cuda_graphs import BatchInputs, VerifyRow

VOCAB = 1000


def reference_fill(b_bucket: int, t_bucket: int, rows: list[VerifyRow], masks: torch.Tensor, scratch_slot: int
                   ) -> dict[str, torch.Tensor]:
    """Every field as `fill` must leave it: padding rows and nodes neutral (token 0, no links,
    the scratch slot, coins and temperatures that touch nothing), each real row's tree in its
    first columns."""
    def full(shape, value, dtype):
        return torch.full(shape, value, dtype=dtype)
    out = {"tokens": full((b_bucket, t_bucket), 0, torch.int64), "positions": full((b_bucket, t_bucket), 0, torch.int64),
           "next_token": full((b_bucket, t_bucket), -1, torch.int64),
           "next_sibling": full((b_bucket, t_bucket), -1, torch.int64), "past": full((b_bucket,), 0, torch.int64),
           "slot": full((b_bucket,), scratch_slot, torch.int64), "top_k": full((b_bucket,), 0, torch.int64),
           "seed": full((b_bucket,), 0, torch.int64), "coins": full((b_bucket, t_bucket), 0.5, torch.float32),
           "final_coin": full((b_bucket,), 0.5, torch.float32), "temperature": full((b_bucket,), 1.0, torch.float32),
           "top_p": full((b_bucket,), 1.0, torch.float32), "greedy": full((b_bucket,), 1.0, torch.float32),
           "tree_mask": torch.eye(t_bucket, dtype=torch.bool).repeat(b_bucket, 1, 1)}
    for j, r in enumerate(rows):
        n = r.tree.num_nodes
        out["tokens"][j, :n] = r.tree.tokens
        out["next_token"][j, :n] = r.tree.next_token
        out["next_sibling"][j, :n] = r.tree.next_sibling
        out["positions"][j] = r.past
        out["positions"][j, :n] += torch.from_numpy(r.depths)
        out["past"][j], out["slot"][j] = r.past, r.slot
        out["tree_mask"][j, : masks.shape[-1], : masks.shape[-1]] = masks[j]
        if not r.sampling.greedy:
            out["top_k"][j], out["seed"][j] = r.sampling.top_k, r.seed
            out["temperature"][j], out["top_p"][j], out["greedy"][j] = r.sampling.temperature, r.sampling.top_p, 0.0
            if r.coins is not None:
                out["coins"][j, :n], out["final_coin"][j] = r.coins[:n], r.coins[n]
    return out


def random_rows(rng: random.Random, batch: int, max_nodes: int) -> tuple[list[VerifyRow], torch.Tensor]:
    trees = []
    for _ in range(batch):
        n = rng.randint(1, max_nodes)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        trees.append(DraftTree.from_parents(rng.sample(range(VOCAB), n), parents))  # siblings differ
    layouts = walk_trees(trees, vocab_size=VOCAB, max_nodes=max_nodes + 1, max_depth=max_nodes + 1)
    assert all(hasattr(layout, "depths") for layout in layouts), layouts
    masks = ancestor_masks(layouts, max(t.num_nodes for t in trees))
    rows = []
    for j, (tree, layout) in enumerate(zip(trees, layouts)):
        kind = rng.choice(["greedy", "keyed", "coins"])
        sampling = SamplingParams() if kind == "greedy" else SamplingParams(
            rng.uniform(0.1, 2.0), rng.choice([0, 5, 50]), rng.choice([1.0, 0.9]), rng.randrange(2 ** 63))
        coins = torch.rand(tree.num_nodes + 1, generator=torch.Generator().manual_seed(j)) if kind == "coins" else None
        rows.append(VerifyRow(rng.randrange(64), rng.randrange(500), tree, layout.depths, sampling, coins,
                              seed=sampling.seed or 0))
    return rows, masks


@pytest.mark.parametrize("seed", range(6))
def test_fill_equals_the_reference(seed):
    rng = random.Random(seed)
    b_bucket, t_bucket = rng.choice([(1, 8), (4, 16), (16, 16), (32, 32)])
    inp = BatchInputs(b_bucket, t_bucket, torch.device("cpu"), pinned=False)
    for _ in range(3):  # refilled: nothing of the previous batch stays
        rows, masks = random_rows(rng, rng.randint(1, b_bucket), t_bucket)
        inp.fill(rows, masks, scratch_slot=99)
        want = reference_fill(b_bucket, t_bucket, rows, masks, 99)
        got = {**{k: getattr(inp.ints, k) for k in ("tokens", "positions", "next_token", "next_sibling", "past",
                                                       "slot", "top_k", "seed")},
               **{k: getattr(inp.floats, k) for k in ("coins", "final_coin", "temperature", "top_p", "greedy")},
               "tree_mask": inp.tree_mask}
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


def test_a_temperature_past_float32_reads_as_inf_without_a_warning(recwarn):
    """A client's finite but huge temperature (checked valid upstream) is stored as inf, as a
    float32 copy stores it, and leaves no warning in the verifier's log."""
    rows, masks = random_rows(random.Random(7), 2, 8)
    rows[0].sampling = SamplingParams(1e300, 0, 1.0, 1)
    inp = BatchInputs(2, 8, torch.device("cpu"), pinned=False)
    inp.fill(rows, masks, scratch_slot=99)
    assert inp.floats.temperature[0] == float("inf") and inp.floats.greedy[0] == 0.0
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("b,t", [(1, 1), (1, 16), (2, 1), (3, 5), (32, 128)])
def test_every_field_starts_on_a_16_byte_boundary_and_none_overlap(b, t):
    """Each field of the packed buffers starts on a 16-byte boundary (kernels launched on a
    field off one compile a variant of their own while serving), on the device and host twins
    alike, and the fields tile their buffer without overlapping."""
    inp = BatchInputs(b, t, torch.device("cpu"), pinned=False)
    for fields, buffer in ((inp.ints, inp.buffers[0]), (inp.floats, inp.buffers[1])):
        spans = []
        for name, view in vars(fields).items():
            offset = view.data_ptr() - buffer.data_ptr()
            assert offset % 16 == 0, (name, offset)
            spans.append((offset, offset + view.numel() * view.element_size()))
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= buffer.numel() * buffer.element_size()
    host = [view.ctypes.data - inp._host_ints.tokens.ctypes.data for view in vars(inp._host_ints).values()]
    assert host == [view.data_ptr() - inp.buffers[0].data_ptr() for view in vars(inp.ints).values()]
