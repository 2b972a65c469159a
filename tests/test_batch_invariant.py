"""The deterministic mode (`ddtree_kernels.batch_invariant`): every row's result depends on that row alone.

Checked bit for bit on fresh random inputs, in float32 and bfloat16 on the CPU (the Triton
kernels through the interpreter, float32 only: its bf16 dot is not usable), and against the
plain references up to rounding:
* the GEMM: a row gives the same bits with any number of rows beside it;
* the attention: a tree node's output equals plain decoding of the same token at past + depth;
* the model: a tree's logits equal AR decoding's along each path, alone or batched with other
  sessions' trees, and the engine's greedy tree output equals its AR output in bf16.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.protocol import SamplingParams
from common.tree import DraftTree, ancestor_masks, walk_trees
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from ddtree_kernels import batch_invariant as bi
from ddtree_kernels.slot_attention import slot_attention_reference
from tests.reference import distinct_sibling_tokens
from verifier_svc.cuda_graphs import VerifyRow
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import VerifierLimits

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _default_mode_after():
    yield
    bi.set_enabled(False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_is_row_invariant(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(53, 96, generator=gen).to(dtype)
    w = torch.randn(70, 96, generator=gen).to(dtype)
    full = bi.linear_rows(x, w)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2 * 10)
    for start, stop in ((0, 1), (3, 4), (5, 22), (17, 53), (40, 41)):
        assert torch.equal(bi.linear_rows(x[start:stop], w), full[start:stop])
    out = torch.empty(53, 70, dtype=dtype)
    assert bi.linear_rows(x, w, out=out) is out and torch.equal(out, full)


@pytest.mark.skipif(not INTERPRETED, reason="Triton needs CUDA or the interpreter")
def test_linear_triton_is_row_invariant_float32():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(41, 80, generator=gen)
    w = torch.randn(72, 80, generator=gen)
    full = bi.linear_triton(x, w)
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-4)
    # Slices that start on a row tile: the interpreter's tl.dot is numpy's matmul, and numpy's
    # BLAS (OpenBLAS 0.3.31) may round a row differently at another position inside the tile,
    # which the GPU's MMA does not (tests/gpu/test_batch_invariant_gpu.py slices anywhere).
    # What is checked here: a row's result does not depend on M, the tile count or the masking.
    tile = bi._tiles(torch.float32, 72)["BLOCK_M"]
    for start, stop in ((0, 1), (0, 7), (tile, tile + 1), (0, tile + 3), (tile, 41)):
        assert torch.equal(bi.linear_triton(x[start:stop], w), full[start:stop])
    assert torch.equal(bi.linear_triton(x.view(1, 41, 80), w).view(41, 72), full)


def test_linear_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="features"):
        bi.linear_rows(torch.zeros(3, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        bi.linear_rows(torch.zeros(3, 8), torch.zeros(4, 8), out=torch.zeros(3, 5))


def _random_tree(gen: torch.Generator, n: int) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def _tree_mask(pasts: torch.Tensor, trees: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify step's [B, T, L] mask and cache positions for parent arrays padded to T."""
    t = max(len(p) for p in trees)
    local = torch.eye(t, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, parents in enumerate(trees):
        for i in range(len(parents)):
            j = i
            while j >= 0:
                local[b, i, j] = True
                j = parents[j]
    cols = torch.arange(length)
    rel = cols[None, None] - pasts[:, None, None]
    inside = (rel >= 0) & (rel < t)
    mask = (rel < 0) | (inside & local.gather(2, rel.clamp(0, t - 1).expand(len(trees), t, length)))
    return mask, pasts[:, None] + torch.arange(t)


def test_logical_keys_from_the_verify_and_prefill_layouts():
    pasts = torch.tensor([7, 0])
    mask, cache_pos = _tree_mask(pasts, [[-1, 0, 0, 1, 3], [-1, 0]], 20)
    keys = bi.LogicalKeys.from_mask(mask, cache_pos)
    assert keys.past.tolist() == [7, 0]
    assert keys.count.tolist() == [[1, 2, 2, 3, 4], [1, 2, 1, 1, 1]]  # row 1 pads past its 2 nodes
    assert keys.key_pos[0, 4, :4].tolist() == [7, 8, 10, 11]
    assert keys.key_pos[0, 2, :2].tolist() == [7, 9]
    # Prefill: padding columns first, at cache positions past the chunk (TargetRunner.prefill).
    cache_pos = torch.tensor([[5 + 3, 5 + 0, 5 + 1, 5 + 2]])
    keys_cols = torch.arange(12)
    causal = (cache_pos[0, :, None] >= keys_cols) & (keys_cols >= 0)
    mask = torch.where(torch.tensor([False, True, True, True])[:, None], causal, cache_pos[0, :, None] == keys_cols)
    keys = bi.LogicalKeys.from_mask(mask[None], cache_pos)
    assert keys.past.tolist() == [5]
    assert keys.count[0, 1:].tolist() == [1, 2, 3]
    assert keys.key_pos[0, 3, :3].tolist() == [5, 6, 7]


# The Triton kernel through the interpreter in float32 only (its bf16 dot is not usable there;
# tests/gpu/test_batch_invariant_gpu.py runs it in bf16).
CASES = [(bi.logical_attention_tiled, dtype) for dtype in DTYPES] + (
    [(bi.logical_attention_triton, torch.float32)] if INTERPRETED else [])


@pytest.mark.parametrize("impl, dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_logical_attention_equals_the_mask_and_plain_decoding(impl, dtype):
    check_logical_attention(impl, dtype, "cpu")


def check_logical_attention(impl, dtype: torch.dtype, device: str) -> None:
    """Against SDPA under the mask (rounding), and bit for bit against one-token decoding of
    each node with its ancestors' K/V moved to positions past .. past + depth."""
    gen = torch.Generator().manual_seed(3)
    b, h, kvh, d, length = 3, 4, 2, 16, 256
    k_cache = torch.randn(4, kvh, length, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(4, kvh, length, d, generator=gen).to(device, dtype)
    trees = [_random_tree(gen, n) for n in (9, 4, 6)]
    pasts = torch.tensor([63, 0, 130])  # a tile boundary inside, at, and past the tree
    slots = torch.tensor([2, 0, 3], device=device)
    t = 9
    mask, cache_pos = _tree_mask(pasts, trees, length)
    mask, cache_pos = mask.to(device), cache_pos.to(device)
    keys = bi.LogicalKeys.from_mask(mask, cache_pos)
    q = torch.randn(b, h, t, d, generator=gen).to(device, dtype)
    out = impl(q, k_cache, v_cache, slots, keys)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, slot_attention_reference(q, k_cache, v_cache, slots, mask), **tol)
    torch.testing.assert_close(out, bi.logical_attention_reference(q, k_cache, v_cache, slots, keys), **tol)
    for row, parents in enumerate(trees):
        for node in range(len(parents)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            k2, v2 = k_cache.clone(), v_cache.clone()
            past, slot = int(pasts[row]), int(slots[row])
            for depth, n in enumerate(path):
                k2[slot, :, past + depth] = k_cache[slot, :, past + n]
                v2[slot, :, past + depth] = v_cache[slot, :, past + n]
            here = past + len(path) - 1
            one = bi.LogicalKeys(past=torch.tensor([here], dtype=torch.int32, device=device),
                                 key_pos=torch.tensor([[[here]]], dtype=torch.int32, device=device),
                                 count=torch.ones(1, 1, dtype=torch.int32, device=device))
            alone = impl(q[row: row + 1, :, node: node + 1], k2, v2, slots[row: row + 1], one)
            assert torch.equal(alone[0, 0], out[row, node]), (row, node)


def _model(tiny_pair, dtype, device="cpu"):
    return TargetModel.from_pretrained(tiny_pair[0], (0, 1), device=device, dtype=dtype)


def _layouts(trees: list[DraftTree]):
    return walk_trees(trees, vocab_size=1 << 20, max_nodes=1 << 10, max_depth=1 << 10)


def _row(slot: int, past: int, tokens: list[int], parents: list[int]) -> VerifyRow:
    tree = DraftTree.from_parents(tokens, parents)
    layout = _layouts([tree])[0]
    return VerifyRow(slot, past, tree, layout.depths, SamplingParams())


def check_tree_logits_equal_plain_decoding(model: TargetModel, runner: TargetRunner, forward) -> None:
    """Every node's logits equal AR decoding's along its path, and a tree verified alone gives the
    bits it gives beside two other sessions' trees. `forward(rows, masks)` -> logits [B, T, V]
    (the runner's eager forward_batch, or a graph replay); the runner has 4 slots."""
    vocab = model.cfg.vocab_size
    dev = runner.device
    gen = torch.Generator().manual_seed(4)
    rng = np.random.default_rng(5)
    prompt = torch.randint(0, vocab, (70,), generator=gen)
    parents = _random_tree(gen, 17)
    tokens = distinct_sibling_tokens(rng, parents, vocab)
    runner.prefill([0, 1, 2], [prompt, prompt[:23], torch.randint(0, vocab, (40,), generator=gen)])
    row = _row(0, 70, tokens, parents)
    alone = forward([row], ancestor_masks(_layouts([row.tree]), 17))[0]
    others = [_row(1, 23, tokens[:5], parents[:5]), _row(2, 40, [tokens[0]], [-1])]
    layouts = _layouts([r.tree for r in [row, *others]])
    batched = forward([others[0], row, others[1]], ancestor_masks([layouts[1], layouts[0], layouts[2]], 17))[1]
    assert torch.equal(alone, batched)
    # AR along the path to each leaf, in slot 3 (the same prompt prefilled alone).
    runner.prefill([3], [prompt])
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    for leaf in range(len(parents)):
        if leaf in parents:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        for depth, node in enumerate(path):
            step = forward([_row(3, 70 + depth, [tokens[node]], [-1])], one)
            assert torch.equal(step[0, 0].to(dev), alone[node]), (leaf, depth)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_logits_equal_plain_decoding_and_ignore_the_batch(tiny_pair, dtype):
    """The deterministic mode on the model's eager CPU path."""
    bi.set_enabled(True)
    model = _model(tiny_pair, dtype)
    runner = TargetRunner(model, 4, 256, 33)
    check_tree_logits_equal_plain_decoding(model, runner, lambda rows, masks: runner.forward_batch(rows, masks).logits)


def check_tree_output_equals_ar(engine: LocalEngine) -> None:
    """Batched sessions of every mode give their AR output token for token: greedy, and seeded
    position-keyed sampling (whose tokens are a function of the seed, the position and the
    target's distribution, which the mode keeps bit-equal across passes)."""
    gen = torch.Generator().manual_seed(6)
    vocab = engine.verifier.runner.model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 47, 12, 64, 5, 33)]
    modes = [DraftMode("tree", 16), DraftMode("tree", 64), DraftMode("chain", 0), DraftMode("tree", 8),
             DraftMode("ar", 0), DraftMode("tree", 32)]
    sampled = [SamplingParams(1.0, 0, 1.0, seed=11), SamplingParams(0.8, 40, 0.9, seed=12)]
    configs = [GenerationConfig(40, sampling=SamplingParams() if i % 3 else sampled[i % 2]) for i in range(6)]
    ar = engine.generate_many([(p, dataclasses.replace(c, mode=DraftMode("ar", 0))) for p, c in zip(prompts, configs)])
    got = engine.generate_many([(p, dataclasses.replace(c, mode=m)) for p, c, m in zip(prompts, configs, modes)])
    for a, g, c in zip(ar, got, configs):
        assert g.tokens == a.tokens, c


def test_tree_output_equals_ar_in_bfloat16(qwen3_pair):
    """The engine in the deterministic mode, bf16 on the CPU (the default mode promises greedy
    equality in float32 only)."""
    bi.set_enabled(True)
    engine = LocalEngine.load(str(qwen3_pair[0]), str(qwen3_pair[1]), dtype=torch.bfloat16,
                              limits=VerifierLimits(max_sessions=6, max_seq_len=256))
    check_tree_output_equals_ar(engine)


def test_the_verifier_flag_its_environment_variable_and_start_up(monkeypatch, tiny_pair):
    import verifier_svc.__main__ as cli
    from verifier_svc.server import VerifierConfig, load_verifier, startup_summary

    assert not cli.parse_config(["--target", "t"]).deterministic
    assert cli.parse_config(["--target", "t", "--deterministic"]).deterministic
    monkeypatch.setenv("VERIFIER_DETERMINISTIC", "1")
    assert cli.parse_config(["--target", "t"]).deterministic
    verifier = load_verifier(VerifierConfig(target_dir=str(tiny_pair[0]), max_sessions=2, max_seq_len=64,
                                            deterministic=True))
    assert bi.enabled() and "deterministic kernels" in startup_summary(verifier)
    load_verifier(VerifierConfig(target_dir=str(tiny_pair[0]), max_sessions=2, max_seq_len=64))
    assert not bi.enabled()


def test_the_local_generate_cli_in_the_deterministic_mode(qwen3_pair):
    """`python -m drafter_svc.generate --deterministic`: bf16 is not what the CLI loads on the CPU,
    so this checks the flag end to end: tree decoding's tokens equal --ar's."""
    import json
    import subprocess
    import sys

    def tokens(*mode: str) -> list[int]:
        r = subprocess.run([sys.executable, "-m", "drafter_svc.generate", "--target", str(qwen3_pair[0]), "--draft",
                            str(qwen3_pair[1]), "--prompt-ids", "5,17,42,99,3", "--max-new-tokens", "24",
                            "--deterministic", "--json", *mode], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"]

    assert tokens("--tree-budget", "16") == tokens("--ar")
