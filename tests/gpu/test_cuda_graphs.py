"""CUDA-graph verify: padding to buckets, graph replay == eager, greedy == autoregressive on GPU.

The static-shape code that is captured on CUDA also runs eagerly on any device
(`VerifyGraphs(capture=False)`), so the padding, masks and accept step are checked on the
CPU too; the tests marked `gpu` need CUDA and are skipped without it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from common.config import load_draft_config
from common.protocol import SamplingParams
from common.tree import DraftTree, ancestor_mask, walk_tree
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session_loop import GenerationConfig
from kernels.probs import process_probs_reference
from kernels.tree_sampling import tree_speculative_sampling_target_only_reference, verify_tree_greedy_reference
from tests.reference import OracleProposer, distinct_sibling_tokens
from verifier_svc.accept import draw_coins
from common.buckets import auto_kv_buckets
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs, cache_length
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16]
MAX_SEQ = 320
# Triton runs on CPU tensors only in the interpreter (tests/conftest.py sets it without CUDA).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def random_tree(rng: np.random.Generator, n: int, vocab: int, shape: str = "random") -> DraftTree:
    """A tree of n nodes (root included), siblings with distinct tokens."""
    if shape == "chain":
        parents = [-1] + list(range(n - 1))
    else:
        parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]
    return DraftTree.from_parents(distinct_sibling_tokens(rng, parents, vocab), parents)


def layout(tree: DraftTree, vocab: int):
    lay = walk_tree(tree, vocab_size=vocab, max_nodes=10_000, max_depth=10_000)
    return lay.depths, ancestor_mask(lay.parents, lay.depths), lay.max_depth


def greedy_chain(runner: TargetRunner, past: int, root: int, n: int, rng) -> DraftTree:
    """A chain whose first min(n, 10) nodes follow the target's greedy continuation."""
    tokens = [root]
    while len(tokens) < min(n, 10):
        chain = DraftTree.from_parents(tokens, list(range(-1, len(tokens) - 1)))
        depths, mask, _ = layout(chain, runner.model.cfg.vocab_size)
        out = runner.verify(0, past, chain.tokens, depths, mask)
        tokens.append(int(out.logits[0, -1].argmax()))
    tokens += [int(t) for t in rng.integers(0, runner.model.cfg.vocab_size, n - len(tokens))]
    return DraftTree.from_parents(tokens, list(range(-1, n - 1)))


def _model(pair, device, dtype) -> TargetModel:
    target, draft = pair
    layer_ids = load_draft_config(draft).target_layer_ids
    return TargetModel.from_pretrained(target, layer_ids, device=device, dtype=dtype)


def _runners(model, config: GraphConfig, capture: bool, max_seq: int = MAX_SEQ):
    """(eager runner, runner with static-shape graphs) over two caches of the same model."""
    eager = TargetRunner(model, 2, max_seq, cuda_graphs=False)
    graphed = TargetRunner(model, 2, cache_length(max_seq, config), cuda_graphs=False)
    graphed.max_seq_len = max_seq
    graphed.graphs = VerifyGraphs(model, graphed.cache, max_seq, config, capture=capture)
    return eager, graphed


def _accept_like_verifier(runner: TargetRunner, out, tree, max_depth, sampling, seed):
    """(path, bonus) of the kernels' plain references on given logits; coins as TreeVerifier
    draws them from a generator seeded with `seed` (an implementation independent of accept.py)."""
    n, vocab = tree.num_nodes, out.logits.shape[-1]
    logits = out.logits[0].float().cpu()
    ridx = torch.arange(n)[None]
    links = (tree.tokens[None], ridx, tree.next_token[None], tree.next_sibling[None])
    predicts = torch.full((n,), -1, dtype=torch.int32)
    accept_index = torch.full((1, max_depth + 1), -1, dtype=torch.int32)
    num = torch.zeros(1, dtype=torch.int32)
    if sampling.greedy:
        verify_tree_greedy_reference(predicts, accept_index, num, *links, logits.argmax(-1)[None])
    else:
        rows = torch.full((n,), sampling.temperature), torch.full((n,), sampling.top_k), torch.full((n,), sampling.top_p)
        probs = process_probs_reference(logits, *rows)
        coins = _coins(seed, n)
        tree_speculative_sampling_target_only_reference(predicts, accept_index, num, *links, coins[None, :n],
                                                        coins[n:], probs[None], torch.zeros(1, n, vocab))
    path = accept_index[0, : int(num[0]) + 1].long()
    return path, int(predicts[path[-1]])


def _coins(seed: int, n: int) -> torch.Tensor:
    """The coins TreeVerifier draws for an n-node tree from a generator seeded with `seed`."""
    return draw_coins(torch.Generator().manual_seed(seed), n)


def _rounds(model, eager, graphed, rng, sizes, check_exact: bool, tol: float, modes=("greedy", "sample")):
    """Drive both runners through the same rounds; compare forwards, accepts and the KV caches."""
    vocab = model.cfg.vocab_size
    prompt = torch.tensor(rng.integers(0, vocab, 9), dtype=torch.int64)
    a, b = eager.prefill(0, prompt), graphed.prefill(0, prompt)
    assert torch.equal(a.logits, b.logits)
    past = len(prompt)
    root = int(a.logits[0, -1].argmax())
    for i, n in enumerate(sizes):
        assert past + n <= MAX_SEQ, "the test's trees must fit the eager runner's cache"
        if i % 3 == 1:  # the target's own greedy continuation (then random): long accepted paths
            tree = greedy_chain(eager, past, root, n, rng)
        else:
            tree = random_tree(rng, n, vocab, "chain" if i % 3 == 0 else "random")
            tree = DraftTree(torch.cat([torch.tensor([root]), tree.tokens[1:]]), tree.next_token, tree.next_sibling)
        depths, mask, max_depth = layout(tree, vocab)
        out_e = eager.verify(0, past, tree.tokens, depths, mask)
        out_g = graphed.verify(0, past, tree.tokens, depths, mask)
        assert out_g.logits.shape == out_e.logits.shape and out_g.features.shape == out_e.features.shape
        scale = out_e.logits.float().abs().max().item()
        assert (out_g.logits.float() - out_e.logits.float()).abs().max().item() <= tol * scale
        fscale = out_e.features.float().abs().max().item()
        assert (out_g.features.float() - out_e.features.float()).abs().max().item() <= tol * max(fscale, 1.0)
        if check_exact:
            assert torch.equal(out_g.logits.argmax(-1), out_e.logits.argmax(-1))
        for mode in modes:
            sampling = SamplingParams() if mode == "greedy" else SamplingParams(1.0, 20, 0.9)
            seed = 1000 * i + n
            want_path, want_bonus = _accept_like_verifier(eager, out_e, tree, max_depth, sampling, seed)
            coins = _coins(seed, n)
            got = graphed.verify_accept(0, past, tree, depths, mask, sampling, coins)
            if check_exact:
                assert got.path.tolist() == want_path.tolist() and got.bonus == want_bonus, (mode, n)
            feats = out_e.features[0, want_path.to(out_e.features.device)]
            if got.path.tolist() == want_path.tolist():
                assert (got.features.float() - feats.float()).abs().max().item() <= tol * max(fscale, 1.0)
        # Commit the eager greedy path in both and continue from its bonus token.
        path, bonus = _accept_like_verifier(eager, out_e, tree, max_depth, SamplingParams(), 0)
        if i % 3 == 1:
            assert path.shape[0] >= min(n, 10) - 1  # the greedy chain is (almost all) accepted
        eager.commit(0, past, path)
        graphed.commit(0, past, path)
        past += path.shape[0]
        root = bonus
        ke, kg = eager.cache.k[:, 0, :, :past].float(), graphed.cache.k[:, 0, :, :past].float()
        assert (ke - kg).abs().max().item() <= tol * max(ke.abs().max().item(), 1.0)
    return past


# ---------------------------------------------------------------------------------------
# CPU (and any device): the static-shape path run eagerly.
# ---------------------------------------------------------------------------------------


def test_buckets_and_cache_length():
    config = GraphConfig()
    assert config.token_buckets() == (9, 17, 33, 65, 129)
    assert cache_length(2048, config) == 2304 and cache_length(2048, config) >= 2048 + 129
    ladder = auto_kv_buckets(2304)
    assert ladder[-1] == 2304 and ladder[0] >= 256 and all(k % 128 == 0 for k in ladder)
    assert list(ladder) == sorted(set(ladder)) and len(ladder) <= 8
    with pytest.raises(ValueError):
        GraphConfig(modes=("bogus",)).check()


def test_select_picks_smallest_fitting_bucket(qwen3_pair):
    model = _model(qwen3_pair, "cpu", torch.float32)
    config = GraphConfig(tree_buckets=(4, 8), kv_buckets=(128, 256, 512))
    _, graphed = _runners(model, config, capture=False, max_seq=160)
    g = graphed.graphs
    assert g.kv_buckets == (128, 256)  # capped at the cache length
    assert g.select("forward", 1, 0) == (5, 128)
    assert g.select("forward", 6, 0) == (9, 128)
    assert g.select("forward", 9, 119) == (9, 128)
    assert g.select("forward", 9, 120) == (9, 256)
    assert g.select("forward", 9, 248) is None  # past + T beyond the cache
    assert g.select("forward", 10, 0) is None  # above the largest bucket: eager


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_static_path_matches_eager_on_cpu(tiny_pair, attention):
    if attention == "triton" and not INTERPRETED:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    model = _model(tiny_pair, "cpu", torch.float32)
    model.attention = attention
    config = GraphConfig(tree_buckets=(0, 4, 8, 16), kv_buckets=(256, 512), modes=("forward", "greedy", "sample"))
    eager, graphed = _runners(model, config, capture=False)
    rng = np.random.default_rng(0)
    # 1 = root only, 5 = exact bucket, 3/7/12 = padded, 30 = above the largest bucket (eager fallback).
    sizes = [1, 5, 3, 7, 12, 30, 17, 2] if attention == "sdpa" else [1, 5, 12, 30]  # the interpreter is slow
    _rounds(model, eager, graphed, rng, sizes, check_exact=True, tol=1e-5)


def _attention_agreement(pair, device, dtype):
    """Logits/features with attention="triton" vs "sdpa", prefill and a tree verify."""
    model = _model(pair, device, dtype)
    runner = TargetRunner(model, 2, 64, cuda_graphs=False)
    tree = random_tree(np.random.default_rng(1), 12, model.cfg.vocab_size)
    depths, mask, _ = layout(tree, model.cfg.vocab_size)
    outs = {}
    for attention in ("sdpa", "triton"):
        model.attention = attention
        pre = runner.prefill(1, torch.arange(20))
        out = runner.verify(1, 20, tree.tokens, depths, mask)
        outs[attention] = (pre.logits.float(), out.logits.float(), out.features.float())
    model.attention = "auto"
    return [(a - b).abs().max().item() / max(b.abs().max().item(), 1.0) for a, b in zip(outs["triton"], outs["sdpa"])]


@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_triton_attention_matches_sdpa_on_cpu(qwen3_pair):
    assert max(_attention_agreement(qwen3_pair, "cpu", torch.float32)) < 1e-5


def test_verify_accept_eager_matches_tree_verifier(qwen3_pair):
    """TargetRunner.verify_accept without graphs == the kernels' references + feature gather."""
    model = _model(qwen3_pair, "cpu", torch.float32)
    runner = TargetRunner(model, 1, MAX_SEQ)
    rng = np.random.default_rng(3)
    runner.prefill(0, torch.arange(10))
    for i, n in enumerate([1, 4, 9, 20]):
        tree = random_tree(rng, n, model.cfg.vocab_size)
        depths, mask, max_depth = layout(tree, model.cfg.vocab_size)
        out = runner.verify(0, 10, tree.tokens, depths, mask)
        for sampling in (SamplingParams(), SamplingParams(0.8, 0, 0.95), SamplingParams(1.5, 7, 1.0)):
            path, bonus = _accept_like_verifier(runner, out, tree, max_depth, sampling, i)
            coins = _coins(i, n)
            got = runner.verify_accept(0, 10, tree, depths, mask, sampling, coins)
            assert got.path.tolist() == path.tolist() and got.bonus == bonus
            assert torch.equal(got.features, out.features[0, path])


# ---------------------------------------------------------------------------------------
# GPU: captured graphs.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_matches_static_eager(qwen3_pair, dtype, attention):
    """Replaying the captured graphs gives what the same static-shape code gives eagerly."""
    model = _model(qwen3_pair, "cuda", dtype)
    model.attention = attention
    config = GraphConfig(modes=("forward", "greedy", "sample"))
    _, replayed = _runners(model, config, capture=True)
    _, static = _runners(model, config, capture=False)
    assert replayed.graphs.num_graphs > 0
    rng = np.random.default_rng(5)
    sizes = [1, 9, 5, 17, 40, 65, 100, 129, 140]  # 140 > largest bucket: eager fallback in both
    _rounds(model, static, replayed, rng, sizes, check_exact=True, tol=1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_runner_matches_eager_runner(tiny_pair, dtype):
    """The default runner (graphs on) against cuda_graphs=False: logits, features, accepts, KV."""
    if dtype == torch.bfloat16 and "llama" in str(tiny_pair[0]):
        pytest.skip("bf16 is covered on the qwen3 pair (keeps the GPU run short)")
    model = _model(tiny_pair, "cuda", dtype)
    eager = TargetRunner(model, 2, MAX_SEQ, cuda_graphs=False)
    graphed = TargetRunner(model, 2, MAX_SEQ, graph_config=GraphConfig(modes=("forward", "greedy", "sample")))
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.cache.max_seq_len >= MAX_SEQ + 129
    rng = np.random.default_rng(7)
    exact = dtype == torch.float32
    _rounds(model, eager, graphed, rng, [1, 3, 9, 17, 33, 64, 65, 129, 130, 7], check_exact=exact,
            tol=1e-4 if exact else 3e-2, modes=("greedy", "sample") if exact else ())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_triton_attention_matches_sdpa_on_gpu(tiny_pair, dtype):
    assert max(_attention_agreement(tiny_pair, "cuda", dtype)) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graphs_flag_and_fallback(qwen3_pair):
    model = _model(qwen3_pair, "cuda", torch.float32)
    off = TargetRunner(model, 1, 64, cuda_graphs=False)
    assert off.graphs is None and off.cache.max_seq_len == 64
    on = TargetRunner(model, 1, 64, graph_config=GraphConfig(tree_buckets=(4,)))
    assert on.graphs.num_graphs > 0
    assert on.graphs.select("forward", 6, 0) is None  # falls back to eager
    on.prefill(0, torch.arange(5))
    tree = random_tree(np.random.default_rng(0), 6, model.cfg.vocab_size)
    depths, mask, _ = layout(tree, model.cfg.vocab_size)
    assert on.verify(0, 5, tree.tokens, depths, mask).logits.shape[1] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tree_verifier_verify_on_gpu(qwen3_pair):
    engine = _engine(qwen3_pair, torch.float32)
    engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, mode=DraftMode("tree", 4)))


def _engine(pair, dtype, cuda_graphs=True):
    target, draft = pair
    limits = VerifierLimits(max_sessions=2, max_seq_len=256)
    engine = LocalEngine.load(str(target), str(draft), device="cuda", dtype=dtype, limits=limits)
    if not cuda_graphs:
        model = engine.verifier.runner.model
        engine.verifier = TreeVerifier(TargetRunner(model, 2, 256, cuda_graphs=False), limits)
    return engine


PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100))]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_float32(tiny_pair):
    engine = _engine(tiny_pair, torch.float32)
    assert engine.verifier.runner.graphs is not None
    for prompt in PROMPTS:
        ar = engine.generate(prompt, GenerationConfig(max_new_tokens=40, mode=DraftMode("ar", 0))).tokens
        for mode in [DraftMode("tree", 0), DraftMode("tree", 16), DraftMode("tree", 64), DraftMode("chain", 0)]:
            out = engine.generate(prompt, GenerationConfig(max_new_tokens=40, mode=mode))
            assert out.tokens == ar, mode
    # A draft that matches the target often: long accepted paths through the graphs, still exact.
    from drafter_svc.session_loop import LocalVerifierLink, generate

    oracle = OracleProposer(_model(tiny_pair, "cpu", torch.float32), block_size=8, rank1_every=5)
    ar = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, mode=DraftMode("ar", 0))).tokens
    tree = generate(LocalVerifierLink(engine.verifier), oracle, PROMPTS[0],
                    GenerationConfig(max_new_tokens=40, mode=DraftMode("tree", 16)))
    assert tree.tokens == ar and tree.mean_acceptance > 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_sampling_on_gpu_is_seeded(tiny_pair):
    """Sampled rounds go through the captured accept graph: same seed, same output."""
    engine = _engine(tiny_pair, torch.float32)
    config = GenerationConfig(max_new_tokens=40, sampling=SamplingParams(0.9, 30, 0.95, seed=7),
                              mode=DraftMode("tree", 16))
    first = engine.generate(PROMPTS[0], config).tokens
    assert engine.generate(PROMPTS[0], config).tokens == first and len(first) == 40
    other = GenerationConfig(40, sampling=SamplingParams(0.9, 30, 0.95, seed=8), mode=DraftMode("tree", 16))
    assert engine.generate(PROMPTS[0], other).tokens != first


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_triton_attention(tiny_pair):
    """attention="triton" in the captured graphs (float32): tree decoding == ar with "sdpa"."""
    engine = _engine(tiny_pair, torch.float32)
    ar = {tuple(p): engine.generate(p, GenerationConfig(max_new_tokens=32, mode=DraftMode("ar", 0))).tokens
          for p in PROMPTS}
    model = engine.verifier.runner.model
    model.attention = "triton"
    try:
        limits = VerifierLimits(max_sessions=2, max_seq_len=256)
        engine.verifier = TreeVerifier(TargetRunner(model, 2, 256), limits)  # captured with triton attention
        for prompt in PROMPTS:
            for mode in [DraftMode("ar", 0), DraftMode("tree", 16), DraftMode("tree", 64)]:
                out = engine.generate(prompt, GenerationConfig(max_new_tokens=32, mode=mode)).tokens
                assert out == ar[tuple(prompt)], mode
    finally:
        model.attention = "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_bfloat16(qwen3_pair):
    """bf16: graphs on == graphs off for every mode; tree vs ar agree on a long prefix.

    (Different token counts per pass pick different GEMM tilings, so bf16 rounding may
    flip a near-tie between ar and tree decoding; within one mode the graph must not.)
    """
    on, off = _engine(qwen3_pair, torch.bfloat16), _engine(qwen3_pair, torch.bfloat16, cuda_graphs=False)
    for prompt in PROMPTS:
        ar = off.generate(prompt, GenerationConfig(max_new_tokens=32, mode=DraftMode("ar", 0))).tokens
        for mode in [DraftMode("ar", 0), DraftMode("tree", 0), DraftMode("tree", 16), DraftMode("tree", 64)]:
            out = on.generate(prompt, GenerationConfig(max_new_tokens=32, mode=mode)).tokens
            assert out[:8] == ar[:8], mode


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_sessions_free_capacity_with_graphs(qwen3_pair):
    engine = _engine(qwen3_pair, torch.float32)
    before = engine.verifier.free_capacity
    engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=5, mode=DraftMode("tree", 8)))
    assert engine.verifier.free_capacity == before


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("t", [17, 65])
def test_slot_attention_compiled_matches_sdpa(splits, t):
    from tests.test_slot_attention import check_slot_attention

    check_slot_attention("cuda", torch.bfloat16, splits, b=1, heads=32, kv_heads=8, d=128, t=t, length=1152,
                         tol=2e-2)
