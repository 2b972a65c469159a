"""A real Triton compile on CUDA goes through `common.compiles`' hooks: counted in its phase,
and logged with the kernel's name once the process serves."""
from __future__ import annotations

import logging

import pytest
import torch

from common import compiles
from tests.test_compiles import compiled, knobs

CUDA = torch.cuda.is_available()


def _watched_afresh(monkeypatch) -> None:
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_phase", "startup")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compiles.watch()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_kernel_compiled_while_serving_is_counted_and_logged(monkeypatch, caplog):
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    _watched_afresh(monkeypatch)
    x = torch.zeros(8, device="cuda")
    startup = compiled("startup")
    _add_one[(1,)](x, 8, BLOCK=8)
    assert compiled("startup") == startup + 1
    compiles.serving()
    serving = compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        _add_one[(1,)](x, 8, BLOCK=16)  # a new constexpr: a new variant
        _add_one[(1,)](x, 8, BLOCK=16)  # the same one: no compile
    assert compiled("serving") == serving + 1
    assert len(caplog.records) == 1 and "_add_one" in caplog.records[0].getMessage()
    assert x.tolist() == [3.0] * 8


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_trees_placed_into_every_small_bucket_take_one_compiled_variant(monkeypatch, caplog):
    """The place kernel writes into each (batch, nodes) bucket's packed input buffers, some of
    whose fields start off a 16-byte boundary (batch 1, 1 node): once compiled, no bucket of up
    to 16 nodes compiles it again (its pointers are not specialised on their alignment)."""
    from ddtree_kernels.place_trees import place_trees
    from verifier_svc.cuda_graphs import BatchInputs

    _watched_afresh(monkeypatch)
    width = 16
    packed = torch.zeros((1, 2 * width + 1), dtype=torch.int64, device="cuda")
    packed[0, 2 * width] = 1  # the count: the root alone
    tokens, parents, counts = packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width]

    def place(b: int, t: int) -> BatchInputs:
        inp = BatchInputs(b, t, torch.device("cuda"), pinned=True)
        inp.ints.past.fill_(7)
        rows = torch.tensor([[0], [b - 1], [1]], device="cuda")  # tree row, batch row, count limit
        place_trees(tokens, parents, counts, rows, 1, min(width, t), inp.ints.tokens, inp.ints.positions,
                    inp.ints.next_token, inp.ints.next_sibling, inp.ints.past, inp.tree_mask)
        return inp

    place(1, 16)
    compiles.serving()
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        placed = [place(b, t) for b, t in ((1, 1), (2, 16), (2, 1), (4, 1))]
    assert not [r for r in caplog.records if "_place_kernel" in r.getMessage()]
    for inp in placed:
        assert inp.ints.positions[-1, 0].item() == 7 and inp.ints.next_token[-1, 0].item() == -1
        assert inp.tree_mask[-1, 0, 0].item()



@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_after_the_drafter_warm_ups_no_tree_selection_compiles(monkeypatch, caplog):
    """The drafter's warm-ups (`ddtree_select.warm_up` for its block's depths, the top-k's) cover
    what a step launches: the host-built and the device-kept selections, at 1 to 3 sessions (odd
    counts put the budgets 8 bytes off a 16-byte boundary) and budgets up to 64, compile nothing."""
    from ddtree_kernels.ddtree_select import warm_up as warm_up_selection
    from ddtree_kernels.draft_topk import warm_up as warm_up_top_k
    from drafter_svc.ddtree import select_ddtrees, select_device_trees

    _watched_afresh(monkeypatch)
    vocab, depths = 151936, 15
    warm_up_selection(torch.device("cuda"), depths)
    warm_up_top_k(torch.device("cuda"), vocab, torch.bfloat16)
    compiles.serving()
    serving = compiled("serving")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        for sessions in (1, 2, 3):
            logits = torch.randn((sessions, depths, vocab), generator=gen, device="cuda").to(torch.bfloat16)
            for budget in (1, 7, 15, 62, 63, 64):
                budgets = [budget] * sessions
                select_ddtrees(logits, list(range(sessions)), budgets)
                trees = select_device_trees(logits, list(range(sessions)), budgets)
                assert trees[0].trees.host.wait()[0].shape[0] == sessions  # waits for the selection
    assert compiled("serving") == serving, [r.getMessage() for r in caplog.records]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_after_the_place_warm_up_no_tree_size_compiles(monkeypatch, caplog):
    """`place_trees.warm_up` (an in-process verifier's start-up) compiles every tile: trees of 1 to
    128 nodes then place without a compile."""
    from ddtree_kernels.place_trees import place_trees, warm_up
    from verifier_svc.cuda_graphs import BatchInputs

    _watched_afresh(monkeypatch)
    warm_up(torch.device("cuda"), 128)
    compiles.serving()
    serving = compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        for width in (1, 8, 16, 17, 31, 32, 33, 64, 65, 100, 128):
            packed = torch.zeros((1, 2 * width + 1), dtype=torch.int64, device="cuda")
            packed[0, 2 * width] = 1
            inp = BatchInputs(1, width, torch.device("cuda"), pinned=True)
            rows = torch.tensor([[0], [0], [1]], device="cuda")
            place_trees(packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width], rows, 1, width,
                        inp.ints.tokens, inp.ints.positions, inp.ints.next_token, inp.ints.next_sibling,
                        inp.ints.past, inp.tree_mask)
            assert inp.tree_mask[0, 0, 0].item()
    assert compiled("serving") == serving, [r.getMessage() for r in caplog.records]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_after_the_kv_move_warm_up_no_step_width_compiles(monkeypatch, caplog):
    """`kv_move.warm_up` (every verifier's start-up) compiles the kernel: eager steps of 1 to 300
    columns then compact the cache without a compile, from slices of a packed buffer too."""
    from ddtree_kernels.kv_move import move_kv_rows, warm_up

    _watched_afresh(monkeypatch)
    k = torch.zeros(2, 3, 8, 256, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    warm_up(k, v)
    compiles.serving()
    serving = compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        for width in (1, 2, 8, 16, 17, 31, 32, 33, 64, 65, 100, 128, 300):
            ints = torch.zeros(1 + 2 * width, dtype=torch.int64, device="cuda")
            ints[1 + width:] = torch.arange(width, device="cuda")
            move_kv_rows(k, v, ints[:1], ints[1: 1 + width][None], ints[1 + width:][None])
    torch.cuda.synchronize()
    assert compiled("serving") == serving, [r.getMessage() for r in caplog.records]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_few_row_gemm_compiles_once_for_every_row_count(monkeypatch, caplog):
    """The verify graphs run the head at 8 or more rows (B x T, T >= 8); an eager one-session
    prompt chunk runs it at 1 row, and its layers at the chunk's length. Once warmed up
    (`skinny_gemm.warm_up`, as the runners do at start-up), the few-row GEMM and its K-split form
    compile nothing at any row count (BLOCK_M is the only constexpr a row count changes, and M is
    not specialised)."""
    from ddtree_kernels.skinny_gemm import skinny_linear, split_linear, warm_up

    _watched_afresh(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn((1024, 512), generator=gen, device="cuda").to(torch.bfloat16)
    o_proj = torch.randn((256, 2048), generator=gen, device="cuda").to(torch.bfloat16)
    assert warm_up([head, o_proj]) == 7  # each 2 one-pass tile configs; o_proj K-split at BLOCK_M 16, 32, 64
    compiles.serving()
    serving = compiled("serving")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 31, 32):  # the head
            x = torch.randn((m, 512), generator=gen, device="cuda").to(torch.bfloat16)
            torch.testing.assert_close(skinny_linear(x, head), x @ head.T, rtol=2e-2, atol=5e-2)
        for m in (16, 17, 32, 48, 64):  # o_proj
            x = torch.randn((m, 2048), generator=gen, device="cuda").to(torch.bfloat16)
            torch.testing.assert_close(split_linear(x, o_proj).total(), x @ o_proj.T, rtol=2e-2, atol=1e-1)
    assert compiled("serving") == serving, [r.getMessage() for r in caplog.records]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_after_the_runners_warm_ups_eager_passes_compile_no_kernel(monkeypatch, caplog):
    """A verifier's runner and a drafter's draft, warmed up as the services warm them up (the
    attention variants, `slot_attention.warm_up`, which are not specialised on a pass's length;
    the few-row GEMMs for every weight shape), then eager prompt chunks of 1 to 300 tokens at
    several pasts (with and without key splits and their merge), batches of chunks, and eager
    draft blocks over contexts of any length: not one kernel compiles while serving (bf16, Qwen3-8B's
    shapes: the K-split GEMMs run; the target at 2 layers). One 8-token prefill goes first, and
    may compile only what no warm-up covers by design (the norms' and the rotary kernel's, which
    take no size-dependent constants), not an attention or GEMM variant."""
    from dataclasses import replace

    from bench.verify import feature_layers, qwen3_8b_config, random_draft, random_target
    from common.layers import gemm_weights
    from ddtree_kernels.skinny_gemm import warm_up as warm_up_gemms
    from drafter_svc.draft_model import DraftKVPool
    from verifier_svc.target_runner import TargetRunner

    _watched_afresh(monkeypatch)
    cfg = replace(qwen3_8b_config(), num_layers=2)
    model = random_target(cfg, feature_layers(cfg), torch.device("cuda"), torch.bfloat16)
    runner = TargetRunner(model, 3, 1400, 17, cuda_graphs=False)
    draft, _, _ = random_draft(False, torch.device("cuda"), torch.bfloat16)
    draft.fuse_weights()
    warm_up_gemms(gemm_weights(draft))  # as `Drafter` does
    pool = DraftKVPool(draft, 2, 700)
    compiles.serving()
    warmed = ("_slot_attention_kernel", "_combine_splits_kernel", "_skinny_kernel")
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        runner.prefill([1], [torch.zeros(8, dtype=torch.int64)])  # also fills the caches' first rows
    assert [r.getMessage() for r in caplog.records if any(name in r.getMessage() for name in warmed)] == []
    caplog.clear()
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="common.compiles"):
        for past, n in ((0, 1), (0, 2), (0, 16), (0, 17), (0, 31), (0, 33), (0, 48), (0, 64), (0, 65), (0, 129),
                        (0, 150), (0, 200), (0, 257), (0, 300), (1024, 150), (700, 33), (5, 1)):
            logits, features = runner.prefill([1], [torch.randint(0, cfg.vocab_size, (n,), generator=gen)],
                                              pasts=[past])
            assert logits.isfinite().all() and features[0].shape[0] == n
        for sizes in ((3, 9), (17, 1, 5), (40, 2)):  # batches of chunks: the head at several rows
            prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in sizes]
            logits, _ = runner.prefill([0, 1, 2][:len(sizes)], prompts)
            assert logits.isfinite().all()
        for context, length in ((37, 60), (300, 333), (600, 650)):
            block = torch.randn(1, 16, draft.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            hidden = draft.block_hidden(pool.kv, torch.tensor([1], device="cuda"),
                                        torch.tensor([context], device="cuda"), block, length)
            assert hidden.isfinite().all()
        for rows in (1, 7, 17, 40):  # the context's extension by a prompt chunk's features
            feats = torch.randn(1, rows, draft.fc.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            draft.extend(pool.kv, torch.tensor([1], device="cuda"), torch.tensor([rows], device="cuda"), feats)
    torch.cuda.synchronize()
    assert [r.getMessage() for r in caplog.records] == []
