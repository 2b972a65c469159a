"""The batched verify step: padding to buckets, the static-shape path, CUDA graphs.

One step verifies the trees of B sessions (`TargetRunner.forward_batch` / `verify_batch`,
`verifier_svc.cuda_graphs.verify_step`). The static-shape code that is captured on CUDA also
runs eagerly on any device (`VerifyGraphs(capture=False)`), so padding (nodes, batch rows,
KV length), masks, the batched accept and the batched KV compaction are checked on the CPU
against plain references written here: a one-session forward of prefix + tree through
`TargetModel` with its own KV cache, `ddtree_kernels.fused_accept.tree_accept_reference` on one
row's logits, and plain autoregressive decoding. The tests marked `gpu` need CUDA and are
skipped without it.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from common.buckets import auto_kv_buckets
from common.config import load_draft_config
from common.protocol import SamplingParams
from common.tree import DraftTree, ancestor_masks, walk_trees
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from ddtree_kernels.fused_accept import tree_accept_reference
from tests.reference import OracleProposer
from verifier_svc.accept import draw_coins
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs, VerifyRow, cache_length
from verifier_svc.target_model import ForwardOutput, KVCache, TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits

CUDA = torch.cuda.is_available()
# Triton runs on CPU tensors only in the interpreter (tests/conftest.py sets it without CUDA).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16]
GREEDY = SamplingParams()
SAMPLED = [SamplingParams(1.0, 20, 0.9), SamplingParams(0.7, 0, 0.95), SamplingParams(1.5, 7, 1.0)]
# Small buckets so that a few tiny trees cover exact fits, padding and the eager fallback.
STATIC = GraphConfig(tree_buckets=(0, 4, 8, 16), batch_buckets=(1, 2, 4), kv_buckets=(128, 256, 512),
                     modes=("forward", "greedy", "sample"))


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """The models here are tiny: on the CPU, intra-op threads only add overhead (several times
    the runtime on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Plain references (no runner, no batching, no padding).
# ---------------------------------------------------------------------------------------


def depths_of(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestors_of(parents: Sequence[int]) -> Tensor:
    """Bool [n, n]: node j is node i or one of its ancestors, by walking up the parents."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def reference_forward(model: TargetModel, seq: Sequence[int], tokens: Sequence[int],
                      parents: Sequence[int]) -> tuple[Tensor, Tensor, KVCache]:
    """One session, one forward of prefix + tree with its own KV cache: causal over the prefix,
    prefix + ancestors for the tree nodes (positions past + depth). Returns the tree rows'
    logits [n, V] and features [n, F], and the cache (node i's K/V at position past + i)."""
    past, n = len(seq), len(tokens)
    total = past + n
    dev = model.embed_tokens.weight.device
    ids = torch.tensor(list(seq) + list(tokens))
    positions = torch.cat([torch.arange(past), past + torch.tensor(depths_of(parents))])
    mask = torch.ones(total, total, dtype=torch.bool).tril()
    mask[past:, past:] = ancestors_of(parents)
    cache = KVCache(model.cfg, 1, total, dev, model.embed_tokens.weight.dtype)
    with torch.inference_mode():
        out = model(ids[None].to(dev), positions[None].to(dev), cache, torch.tensor([0], device=dev),
                    torch.arange(total, device=dev)[None], mask[None].to(dev))
    return out.logits[0, past:], out.features[0, past:], cache


def reference_greedy(model: TargetModel, prompt: Sequence[int], n: int) -> list[int]:
    """Plain autoregressive greedy decoding: prefill, then one token per forward, own KV cache."""
    dev = model.embed_tokens.weight.device
    cache = KVCache(model.cfg, 1, len(prompt) + n, dev, model.embed_tokens.weight.dtype)
    seq, start, out = list(prompt), 0, []
    with torch.inference_mode():
        for _ in range(n):
            t = len(seq)
            pos = torch.arange(start, t, device=dev)[None]
            mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[start:][None]
            logits = model(torch.tensor([seq[start:]], device=dev), pos, cache, torch.tensor([0], device=dev),
                           pos, mask).logits
            seq.append(int(logits[0, -1].argmax()))
            out.append(seq[-1])
            start = t
    return out


def reference_accept(logits: Tensor, tree: DraftTree, sampling: SamplingParams,
                     coins: Tensor | None) -> tuple[list[int], int]:
    """(path, bonus) of `tree_accept_reference` on one tree's logits [n, V] alone."""
    n = tree.num_nodes
    predicts = torch.full((n,), -1, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    num = torch.zeros(1, dtype=torch.int32)
    extra = {}
    if not sampling.greedy:
        extra = dict(coins=coins[None, :n].contiguous(), final_coins=coins[n:n + 1].contiguous(),
                     temperature=torch.tensor([sampling.temperature], dtype=torch.float32),
                     top_k=torch.tensor([sampling.top_k]), top_p=torch.tensor([sampling.top_p], dtype=torch.float32))
    tree_accept_reference(logits.float().cpu()[None].contiguous(), tree.tokens[None], tree.next_token[None],
                          tree.next_sibling[None], predicts, accept_index, num, greedy=sampling.greedy, **extra)
    path = accept_index[0, : int(num[0]) + 1].tolist()
    return path, int(predicts[path[-1]])


# ---------------------------------------------------------------------------------------
# Sessions and their trees.
# ---------------------------------------------------------------------------------------


def collect_garbage() -> None:
    """Free earlier tests' unreachable CUDA graphs now: destroyed by a GC pass during a capture,
    a graph invalidates that capture ("operation not permitted when stream is capturing")."""
    gc.collect()


def load_model(pair, device="cpu", dtype=torch.float32) -> TargetModel:
    target, draft = pair
    return TargetModel.from_pretrained(target, load_draft_config(draft).target_layer_ids, device=device, dtype=dtype)


def static_runner(model, num_slots: int, max_seq: int, config: GraphConfig = STATIC, *, capture: bool = False,
                  headroom: int = 65) -> TargetRunner:
    """A runner whose verify steps go through `VerifyGraphs` (capture=False: the static-shape
    code run eagerly at the bucket shapes; capture=True: CUDA graphs)."""
    if capture:
        collect_garbage()
        return TargetRunner(model, num_slots, max_seq, headroom, graph_config=config)
    runner = TargetRunner(model, num_slots, max_seq, headroom, cuda_graphs=False, graph_config=config)
    runner.graphs = VerifyGraphs(model, runner.cache, max_seq, runner.scratch_slot, config, capture=False)
    return runner


@dataclass
class Session:
    slot: int
    seq: list[int]  # the tokens whose K/V the runner's cache holds, in order
    root: int  # the next tree's root (the last bonus token)
    generator: torch.Generator  # the session's coins, as the verifier draws them


@dataclass
class Draft:
    """One row of a step: a session's tree, its parents and sampling."""
    session: Session
    tree: DraftTree
    parents: list[int]
    sampling: SamplingParams
    coins: Tensor | None


def open_sessions(runners: Sequence[TargetRunner], rng: np.random.Generator, pasts: Sequence[int],
                  slots: Sequence[int] | None = None) -> list[Session]:
    """Prefill a random prompt of each length into each runner (same slot in each)."""
    vocab = runners[0].model.cfg.vocab_size
    sessions = []
    for i, past in enumerate(pasts):
        slot = i if slots is None else slots[i]
        prompt = torch.tensor(rng.integers(0, vocab, past), dtype=torch.int64)
        outs = [r.prefill([slot], [prompt]) for r in runners]
        root = int(outs[0][0][0].argmax())
        sessions.append(Session(slot, prompt.tolist(), root, torch.Generator().manual_seed(1000 + i)))
    return sessions


def make_draft(model: TargetModel, s: Session, rng: np.random.Generator, n: int, kind: str,
               sampling: SamplingParams = GREEDY) -> Draft:
    """A tree of n nodes rooted at the session's root, siblings with distinct tokens. kind "chain":
    a random chain; "random": random parents; "oracle": a spine of the target's own greedy
    continuation (long accepted paths), at random depths after a decoy sibling (so the accepted
    nodes are not the first indices and the KV compaction has to move them), then random
    branches. Sampled rows draw their coins from the session's generator."""
    vocab = model.cfg.vocab_size
    parents, tokens = [-1], [s.root]
    used: dict[int, set[int]] = {}

    def add(parent: int, tok: int | None) -> int:
        siblings = used.setdefault(parent, set())
        while tok is None or tok in siblings:
            tok = int(rng.integers(vocab))
        siblings.add(tok)
        parents.append(parent)
        tokens.append(tok)
        return len(parents) - 1

    if kind == "oracle":
        truth = reference_greedy(model, s.seq + [s.root], min(n - 1, 8))
        last = 0
        for tok in truth:
            if len(parents) < n - 1 and rng.random() < 0.5:
                add(last, (tok + 1 + int(rng.integers(vocab - 1))) % vocab)  # a decoy first
            if len(parents) == n:
                break
            last = add(last, tok)
    while len(parents) < n:
        i = len(parents)
        add(i - 1 if kind == "chain" else int(rng.integers(max(0, i - 5), i)), None)
    coins = None if sampling.greedy else draw_coins(s.generator, n)
    return Draft(s, DraftTree.from_parents(tokens, parents), parents, sampling, coins)


def batch_of(drafts: Sequence[Draft], vocab: int) -> tuple[list[VerifyRow], Tensor]:
    """The step's rows and masks, derived as `TreeVerifier` derives them (walk_trees + ancestor_masks)."""
    layouts = walk_trees([d.tree for d in drafts], vocab_size=vocab, max_nodes=10_000, max_depth=10_000)
    masks = ancestor_masks(layouts, max(d.tree.num_nodes for d in drafts))
    rows = [VerifyRow(d.session.slot, len(d.session.seq), d.tree, lay.depths, d.sampling, d.coins)
            for d, lay in zip(drafts, layouts)]
    return rows, masks


def step_forward(runner: TargetRunner, rows, masks) -> ForwardOutput:
    """The logits / features at the very shapes `verify_batch` uses for these rows (bucketed
    when a graph fits, else the batch's own shapes); nothing committed."""
    out = runner.graphs.run("forward", rows, masks) if runner.graphs is not None else None
    if out is None:
        out = runner.forward_batch(rows, masks)
    return ForwardOutput(out.logits.clone(), out.features.clone())  # graph outputs are overwritten by a replay


def commit(drafts: Sequence[Draft], paths: Sequence[list[int]], bonus: Sequence[int]) -> None:
    for d, path, b in zip(drafts, paths, bonus):
        d.session.seq += d.tree.tokens[path].tolist()
        d.session.root = b


def rel_err(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)


def snapshot(runner: TargetRunner) -> tuple[Tensor, Tensor]:
    return runner.cache.k.clone(), runner.cache.v.clone()


def restore(runner: TargetRunner, saved: tuple[Tensor, Tensor]) -> None:
    runner.cache.k.copy_(saved[0])
    runner.cache.v.copy_(saved[1])


# ---------------------------------------------------------------------------------------
# CPU (and any device): buckets, and the static-shape path run eagerly.
# ---------------------------------------------------------------------------------------


def test_config_buckets_and_cache_length():
    config = GraphConfig()
    config.check()
    assert config.token_buckets() == (8, 16, 32, 64, 128)
    assert GraphConfig(tree_buckets=(16, 0, 16)).token_buckets() == (1, 17)
    assert cache_length(2048, 129) == 2304 and cache_length(2048, 1025) == 3200
    assert cache_length(100, 0) == 128 and cache_length(128, 0) == 128
    ladder = auto_kv_buckets(2304)
    assert ladder[-1] == 2304 and ladder[0] >= 256 and all(k % 128 == 0 for k in ladder)
    assert list(ladder) == sorted(set(ladder)) and len(ladder) <= 8
    for bad in (dict(modes=("bogus",)), dict(modes=()), dict(tree_buckets=()), dict(tree_buckets=(-1,)),
                dict(batch_buckets=()), dict(batch_buckets=(0, 4)), dict(kv_buckets=()), dict(kv_buckets=(0,)),
                dict(max_tokens=0), dict(warmup_iters=0), dict(max_kv_buckets=0)):
        with pytest.raises(ValueError):
            GraphConfig(**bad).check()


def test_select_picks_the_smallest_fitting_buckets(qwen3_pair):
    model = load_model(qwen3_pair)
    config = GraphConfig(tree_buckets=(4, 8, 200), batch_buckets=(1, 2, 8, 16), kv_buckets=(128, 256, 512))
    runner = static_runner(model, 3, 160, config, headroom=9)  # cache length round_up(169) = 256
    g = runner.graphs
    assert runner.cache.num_slots == 4 and runner.scratch_slot == 3 and runner.cache.max_seq_len == 256
    # capped at the sessions (the scratch slot is no session's) and 8 prompt segments beside them
    assert g.batch_buckets == (1, 2, 8, 11)
    assert g.token_buckets == (5, 9)  # 201 nodes do not fit the headroom: no such bucket
    assert g.kv_buckets == (128, 256)  # capped at the cache length
    assert g.num_graphs == 0  # nothing captured
    # (batch, nodes, end = max past + nodes) -> (B, T, L)
    assert g.select("greedy", 1, 1, 1) == (1, 5, 128)
    assert g.select("greedy", 1, 5, 5) == (1, 5, 128)
    assert g.select("sample", 2, 6, 6) == (2, 9, 128)
    assert g.select("greedy", 3, 9, 9) == (8, 9, 128)
    assert g.select("forward", 1, 9, 9) is None  # "forward" is no mode here, and there are no prefill graphs
    assert g.select("greedy", 1, 9, 119 + 9) == (1, 9, 128)
    assert g.select("greedy", 1, 9, 120 + 9) == (1, 9, 256)
    # The padding nodes need room too: L covers the largest past + T, not past + nodes.
    assert g.select("greedy", 1, 4, 123 + 4) == (1, 5, 128)
    assert g.select("greedy", 1, 4, 124 + 4) == (1, 5, 256)
    assert g.select("greedy", 2, 9, 247 + 9) == (2, 9, 256)
    assert g.select("greedy", 2, 9, 248 + 9) is None  # past + T beyond the largest KV bucket
    assert g.select("greedy", 1, 10, 10) is None  # above the largest tree bucket: eager
    assert g.select("greedy", 11, 1, 1) == (11, 5, 128)
    assert g.select("greedy", 12, 1, 1) is None  # above the largest batch bucket: eager
    # Prefill graphs: "forward" at their own batch buckets (capped at the sessions too).
    prefills = static_runner(model, 3, 160, dataclasses.replace(config, prefill_batches=(2, 8)), headroom=9).graphs
    assert prefills.forward_batches == (2, 3)
    assert prefills.select("forward", 1, 9, 9) == (2, 9, 128) and prefills.select("forward", 3, 5, 5) == (3, 5, 128)
    assert prefills.select("greedy", 1, 9, 9) == (1, 9, 128)  # the verify modes keep theirs


def test_select_honours_max_tokens_without_capture(qwen3_pair):
    model = load_model(qwen3_pair)
    config = GraphConfig(tree_buckets=(4, 8), batch_buckets=(1, 2, 4), kv_buckets=(128,), max_tokens=16)
    g = static_runner(model, 4, 64, config, headroom=9).graphs
    assert g.select("greedy", 2, 4, 4) == (2, 5, 128)  # 2 x 5 = 10 tokens: fits
    assert g.select("greedy", 2, 8, 8) is None  # 2 x 9 = 18 > max_tokens: eager
    assert g.select("greedy", 4, 5, 5) is None  # 4 x 5 = 20 > max_tokens: eager


# Rows of different sizes and pasts in one batch: bucket-exact, padded, and above the
# largest bucket (the static runner falls back to eager there).
FORWARD_CASES = {
    "padded": ([3, 40, 17], [1, 9, 6]),  # static: B 3 -> 4 (one scratch row), T 9
    "fallback": ([5, 70], [30, 2]),  # static: 30 nodes > largest bucket: eager at the batch's shape
}


@pytest.mark.parametrize("case", FORWARD_CASES)
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_forward_batch_rows_match_one_session_reference(tiny_pair, attention, case):
    """Every row of a batched forward (eager, and static at bucket shapes) == the plain
    one-session forward of its prefix + tree; the padding rows stay finite."""
    if attention == "triton" and (not INTERPRETED or case != "padded" or "llama" in str(tiny_pair[0])):
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (and the interpreter is slow: one case)")
    model = load_model(tiny_pair)
    model.attention = attention
    pasts, sizes = FORWARD_CASES[case]
    eager = TargetRunner(model, 4, 128, 65, cuda_graphs=False)
    static = static_runner(model, 4, 128)
    rng = np.random.default_rng(len(pasts))
    sessions = open_sessions([eager, static], rng, pasts, slots=[3, 0, 2][: len(pasts)])
    kinds = ["random", "chain", "oracle"]
    drafts = [make_draft(model, s, rng, n, kinds[i % 3]) for i, (s, n) in enumerate(zip(sessions, sizes))]
    rows, masks = batch_of(drafts, model.cfg.vocab_size)
    out_eager = eager.forward_batch(rows, masks)
    out_static = step_forward(static, rows, masks)
    nodes = max(sizes)
    assert out_eager.logits.shape[:2] == (len(rows), nodes) and out_eager.features.shape[:2] == (len(rows), nodes)
    shape = static.graphs.select("forward", len(rows), nodes, max(p + n for p, n in zip(pasts, sizes)))
    b, t = shape[:2] if shape else (len(rows), nodes)
    assert out_static.logits.shape[:2] == (b, t) and out_static.features.shape[:2] == (b, t)
    assert torch.isfinite(out_static.logits).all() and torch.isfinite(out_static.features).all()
    for i, d in enumerate(drafts):
        n = d.tree.num_nodes
        want_logits, want_features, _ = reference_forward(model, d.session.seq, d.tree.tokens.tolist(), d.parents)
        for out in (out_eager, out_static):
            assert rel_err(out.logits[i, :n], want_logits) < 1e-5, (i, n)
            assert rel_err(out.features[i, :n], want_features) < 1e-5, (i, n)


def test_batched_prefill_matches_each_prompt_alone(tiny_pair):
    """TargetRunner.prefill of prompts of different lengths in one forward (right-aligned, padding
    columns past each prompt) gives each prompt's last logits, features and committed K/V as a
    plain causal forward of that prompt alone, and writes no other slot."""
    model = load_model(tiny_pair)
    runner = TargetRunner(model, 4, 64, 9, cuda_graphs=False)
    rng = np.random.default_rng(7)
    prompts = [torch.tensor(rng.integers(0, model.cfg.vocab_size, n), dtype=torch.int64) for n in (1, 13, 6)]
    slots = [2, 0, 3]
    before = snapshot(runner)
    TOL = dict(rtol=1e-4, atol=1e-4)  # float32; the batch's GEMM shapes differ from one prompt's
    logits, features = runner.prefill(slots, prompts)
    for slot, prompt, row_logits, row_features in zip(slots, prompts, logits, features):
        n = prompt.shape[0]
        ref_logits, ref_features, ref_cache = reference_forward(model, [], prompt.tolist(), list(range(-1, n - 1)))
        torch.testing.assert_close(row_logits, ref_logits[-1], **TOL)
        torch.testing.assert_close(row_features, ref_features, **TOL)
        torch.testing.assert_close(runner.cache.k[:, slot, :, :n], ref_cache.k[:, 0, :, :n], **TOL)
        torch.testing.assert_close(runner.cache.v[:, slot, :, :n], ref_cache.v[:, 0, :, :n], **TOL)
    untouched = [s for s in range(runner.cache.num_slots) if s not in slots]
    assert torch.equal(runner.cache.k[:, untouched], before[0][:, untouched])
    assert torch.equal(runner.cache.v[:, untouched], before[1][:, untouched])


def _verify_rounds(model, runner: TargetRunner, rounds, rng, *, static: bool) -> None:
    """Drive sessions through batched steps; per step check each row against the references
    and the KV cache against the compaction it must do."""
    vocab = model.cfg.vocab_size
    # Slots 0..3 hold sessions, slot 4 an open session that never takes part, 5 is scratch.
    sessions = open_sessions([runner], rng, [6, 31, 12, 50, 9], slots=[0, 1, 2, 3, 4])
    idle, scratch = 4, runner.scratch_slot
    for members, sizes, kinds, samplings in rounds:
        drafts = [make_draft(model, sessions[m], rng, n, kind, sampling)
                  for m, n, kind, sampling in zip(members, sizes, kinds, samplings)]
        rows, masks = batch_of(drafts, vocab)
        before = snapshot(runner)
        out = step_forward(runner, rows, masks)
        written = snapshot(runner)  # the nodes' K/V at past + i, as the forward wrote them
        got = runner.verify_batch(rows, masks)
        assert len(got.paths) == len(rows) and len(got.bonus) == len(rows)
        assert got.features.shape == (sum(len(p) for p in got.paths), model.feature_dim)
        offset = 0
        for i, d in enumerate(drafts):
            n, past, slot = d.tree.num_nodes, len(d.session.seq), d.session.slot
            want_path, want_bonus = reference_accept(out.logits[i, :n], d.tree, d.sampling, d.coins)
            assert got.paths[i] == want_path and got.bonus[i] == want_bonus, (i, d.sampling)
            path = torch.tensor(want_path)
            assert torch.equal(got.features[offset: offset + len(path)], out.features[i, path])
            offset += len(path)
            # The independent reference agrees with the step's logits and its K/V.
            ref_logits, ref_features, ref_cache = reference_forward(model, d.session.seq, d.tree.tokens.tolist(),
                                                                    d.parents)
            assert rel_err(out.logits[i, :n], ref_logits) < 1e-5
            assert rel_err(got.features[offset - len(path): offset], ref_features[path]) < 1e-5
            # Compaction: node path[j]'s K/V now at past + j; the prefix is untouched.
            k, v = runner.cache.k[:, slot], runner.cache.v[:, slot]
            committed = slice(past, past + len(path))
            assert torch.equal(k[:, :, committed], written[0][:, slot][:, :, past + path])
            assert torch.equal(v[:, :, committed], written[1][:, slot][:, :, past + path])
            assert rel_err(k[:, :, committed], ref_cache.k[:, 0][:, :, past + path]) < 1e-5
            assert rel_err(v[:, :, committed], ref_cache.v[:, 0][:, :, past + path]) < 1e-5
            assert torch.equal(k[:, :, :past], before[0][:, slot, :, :past])
            assert torch.equal(v[:, :, :past], before[1][:, slot, :, :past])
        # Slots outside the batch are untouched; the scratch slot is the only other one written,
        # and only when padding batch rows run in it.
        nodes = max(r.tree.num_nodes for r in rows)
        shape = runner.graphs.select("greedy", len(rows), nodes, max(r.past for r in rows) + nodes) if static else None
        padded = shape is not None and shape[0] > len(rows)  # batch rows in the scratch slot
        members_slots = {d.session.slot for d in drafts}
        for slot in range(runner.cache.num_slots):
            if slot in members_slots or (slot == scratch and padded):
                continue
            assert torch.equal(runner.cache.k[:, slot], before[0][:, slot]), slot
            assert torch.equal(runner.cache.v[:, slot], before[1][:, slot]), slot
        commit(drafts, got.paths, got.bonus)
    assert len(sessions[idle].seq) == 9 and idle not in members_slots


S1, S2, S3 = SAMPLED
VERIFY_ROUNDS = [
    # (session indices, tree sizes, kinds, samplings)
    ([0, 1, 2], [9, 5, 1], ["oracle", "random", "chain"], [GREEDY, GREEDY, GREEDY]),  # all greedy, B 3 -> 4
    ([3, 0, 2, 1], [17, 8, 6, 3], ["oracle", "random", "oracle", "random"], [S1, GREEDY, S2, GREEDY]),  # mixed
    ([1, 3], [7, 12], ["oracle", "chain"], [S3, S1]),  # all sampled
    ([2, 0, 3], [30, 9, 4], ["oracle", "oracle", "random"], [GREEDY, S2, GREEDY]),  # 30 > bucket: eager
    ([0], [1], ["chain"], [S1]),  # root only, sampled
]


@pytest.mark.parametrize("path", ["eager", "static"])
def test_verify_batch_matches_references_and_compacts_kv(qwen3_pair, path):
    """Per row: the path / bonus of `tree_accept_reference` on that row's logits (greedy and
    sampled rows mixed in one batch), the path rows' features, and the KV compaction; the
    slots outside the batch are untouched."""
    model = load_model(qwen3_pair)
    runner = (TargetRunner(model, 5, 160, 65, cuda_graphs=False, sampling="sample") if path == "eager"
              else static_runner(model, 5, 160))
    _verify_rounds(model, runner, VERIFY_ROUNDS, np.random.default_rng(11), static=path == "static")


@pytest.mark.parametrize("path", ["eager", "static"])
def test_batch_gives_each_row_what_it_gives_alone(qwen3_pair, path):
    """A batch of B rows gives each row exactly the path / bonus that row gives in a batch of one,
    its logits and features to rounding (GEMMs of other sizes), and the same committed K/V."""
    model = load_model(qwen3_pair)
    runner = (TargetRunner(model, 4, 160, 65, cuda_graphs=False) if path == "eager"
              else static_runner(model, 4, 160))
    rng = np.random.default_rng(5)
    sessions = open_sessions([runner], rng, [20, 3, 44, 9])
    vocab = model.cfg.vocab_size
    for sizes, kinds, samplings in [([9, 3, 14, 1], ["oracle", "random", "oracle", "chain"], [GREEDY, S1, S2, GREEDY]),
                                    ([5, 17, 2], ["oracle", "oracle", "random"], [S3, GREEDY, S1])]:
        drafts = [make_draft(model, s, rng, n, kind, sampling)
                  for s, n, kind, sampling in zip(sessions, sizes, kinds, samplings)]
        rows, masks = batch_of(drafts, vocab)
        start = snapshot(runner)
        batched_out = step_forward(runner, rows, masks)
        batched = runner.verify_batch(rows, masks)
        after = snapshot(runner)
        offset = 0
        for i, d in enumerate(drafts):
            restore(runner, start)
            alone_rows, alone_masks = batch_of([d], vocab)
            alone_out = step_forward(runner, alone_rows, alone_masks)
            alone = runner.verify_batch(alone_rows, alone_masks)
            n, past, slot = d.tree.num_nodes, len(d.session.seq), d.session.slot
            assert batched.paths[i] == alone.paths[0] and batched.bonus[i] == alone.bonus[0], i
            length = len(alone.paths[0])
            assert rel_err(batched_out.logits[i, :n], alone_out.logits[0, :n]) < 1e-5
            assert rel_err(batched_out.features[i, :n], alone_out.features[0, :n]) < 1e-5
            assert rel_err(batched.features[offset: offset + length], alone.features) < 1e-5
            offset += length
            for kv, done in ((runner.cache.k, after[0]), (runner.cache.v, after[1])):
                assert rel_err(done[:, slot, :, :past + length], kv[:, slot, :, :past + length]) < 1e-5
        restore(runner, after)
        commit(drafts, batched.paths, batched.bonus)


@pytest.mark.parametrize("path", ["eager", "static", "graphs"])
def test_features_kept_on_the_device_equal_those_sent_to_the_host(qwen3_pair, path):
    """`features_on_device` (an in-process drafter's) changes where the path rows are, not what
    they are, even when a step replaying the same graph is launched before the first one is
    finished; the rows not asked for are left out either way."""
    if path == "graphs" and not CUDA:
        pytest.skip("needs CUDA")
    model = load_model(qwen3_pair, "cuda" if path == "graphs" else "cpu")
    runner = (TargetRunner(model, 4, 160, 65, cuda_graphs=False) if path == "eager"
              else static_runner(model, 4, 160, capture=path == "graphs"))
    rng = np.random.default_rng(3)
    sessions = open_sessions([runner], rng, [20, 3, 9, 12])
    vocab = model.cfg.vocab_size
    drafts = [make_draft(model, s, rng, n, "oracle") for s, n in zip(sessions[:3], [9, 5, 14])]
    other = [make_draft(model, s, rng, n, "random") for s, n in zip(sessions[1:], [10, 6, 12])]  # the same buckets
    rows, masks = batch_of(drafts, vocab)
    rows = [dataclasses.replace(r, wants_features=w) for r, w in zip(rows, [True, False, True])]
    start = snapshot(runner)
    on_host = runner.verify_batch(rows, masks)
    restore(runner, start)
    runner.features_on_device = True
    first = runner.launch_verify(rows, masks)
    runner.launch_verify(*batch_of(other, vocab))  # reuses the step buffers before `first` is read
    kept = runner.finish_verify(first)
    assert kept.features.device == model.embed_tokens.weight.device
    assert kept.paths == on_host.paths and kept.bonus == on_host.bonus
    assert kept.features.shape[0] == len(on_host.paths[0]) + len(on_host.paths[2])
    assert torch.equal(kept.features.cpu(), on_host.features)


def test_stale_cache_entries_never_change_a_step(qwen3_pair):
    """K/V past each session's length (old trees, padding) and in the scratch slot are masked:
    garbage there changes neither the logits nor the accepted paths."""
    model = load_model(qwen3_pair)
    runner = static_runner(model, 3, 160)
    rng = np.random.default_rng(2)
    sessions = open_sessions([runner], rng, [7, 25, 13])
    drafts = [make_draft(model, s, rng, n, kind) for s, n, kind in zip(sessions, [9, 4, 12], ["oracle", "random", "oracle"])]
    rows, masks = batch_of(drafts, model.cfg.vocab_size)
    saved = snapshot(runner)
    clean = step_forward(runner, rows, masks)
    clean_verdict = runner.verify_batch(rows, masks)
    restore(runner, saved)
    gen = torch.Generator().manual_seed(0)
    for s in sessions:
        for kv in (runner.cache.k, runner.cache.v):
            tail = kv[:, s.slot, :, len(s.seq):]
            tail.copy_(torch.randn(tail.shape, generator=gen) * 100)
    for kv in (runner.cache.k, runner.cache.v):
        kv[:, runner.scratch_slot] = torch.randn(kv[:, runner.scratch_slot].shape, generator=gen) * 100
    dirty = step_forward(runner, rows, masks)
    dirty_verdict = runner.verify_batch(rows, masks)
    for i, d in enumerate(drafts):
        n = d.tree.num_nodes
        assert torch.equal(dirty.logits[i, :n], clean.logits[i, :n])
        assert torch.equal(dirty.features[i, :n], clean.features[i, :n])
    assert dirty_verdict.paths == clean_verdict.paths and dirty_verdict.bonus == clean_verdict.bonus
    assert torch.equal(dirty_verdict.features, clean_verdict.features)


def _count_graph_runs(graphs: VerifyGraphs) -> list[tuple[str, int, bool]]:
    """Record (mode, rows, a bucket fitted) for each `VerifyGraphs.run` call. (Through a weak
    reference: a cycle would keep the graphs alive until a GC pass, which may come during
    another capture and invalidate it.)"""
    calls: list[tuple[str, int, bool]] = []
    ref = weakref.ref(graphs)

    def counted(mode, rows, masks):
        out = VerifyGraphs.run(ref(), mode, rows, masks)
        calls.append((mode, len(rows), out is not None))
        return out

    graphs.run = counted
    return calls


PROMPTS = [[5, 17, 42, 99, 3], [300, 12], list(range(60, 100)), [7] * 11]


def test_generate_many_static_path_equals_autoregressive(qwen3_pair):
    """Greedy sessions of several modes batched together through the static path (bucketed
    batches with scratch rows, padded trees, eager fallback for large trees) == plain
    autoregressive decoding per session; a seeded sampled session gives its tokens alone."""
    target, draft = qwen3_pair
    engine = LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=4, max_seq_len=256))
    runner = engine.verifier.runner
    runner.graphs = VerifyGraphs(runner.model, runner.cache, runner.max_seq_len, runner.scratch_slot, STATIC,
                                 capture=False)
    calls = _count_graph_runs(runner.graphs)
    model = runner.model
    n = 20
    modes = [DraftMode("tree", 16), DraftMode("tree", 4), DraftMode("chain", 0), DraftMode("ar", 0),
             DraftMode("tree", 64)]
    requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(n, mode=mode)) for i, mode in enumerate(modes)]
    sampled = (PROMPTS[1], GenerationConfig(n, sampling=SamplingParams(0.9, 40, 0.95, seed=3), mode=DraftMode("tree", 8)))
    outs = engine.generate_many(requests + [sampled])
    for (prompt, config), out in zip(requests, outs):
        assert out.tokens == reference_greedy(model, prompt, n), config.mode
    assert outs[-1].tokens == engine.generate(*sampled).tokens
    # A draft that matches the target often: long accepted paths through the static path, still exact.
    oracle = dataclasses.replace(engine, proposer=OracleProposer(model, block_size=8, rank1_every=5))
    tree = oracle.generate_many([(p, GenerationConfig(32, mode=DraftMode("tree", 16))) for p in PROMPTS[:3]])
    for prompt, out in zip(PROMPTS, tree):
        assert out.tokens == reference_greedy(model, prompt, 32)
        assert out.mean_acceptance > 2.0, out.acceptance_lengths
    assert any(hit and rows > 1 for _, rows, hit in calls) and any(hit and rows == 3 for _, rows, hit in calls)
    assert any(mode == runner.sampling and hit for mode, _, hit in calls)  # the sampled session's steps
    assert any(not hit for _, _, hit in calls)  # the 65-node trees ran eagerly
    assert engine.verifier.free_capacity == 4


@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_triton_attention_matches_sdpa_on_cpu(qwen3_pair):
    assert max(_attention_agreement(qwen3_pair, "cpu", torch.float32)) < 1e-5


def _attention_agreement(pair, device, dtype) -> list[float]:
    """Prefill and batched-forward logits / features with attention="triton" vs "sdpa"."""
    model = load_model(pair, device, dtype)
    runner = TargetRunner(model, 2, 64, 33, cuda_graphs=False)
    rng = np.random.default_rng(1)
    sessions = open_sessions([runner], rng, [20, 7])
    drafts = [make_draft(model, s, rng, n, "random") for s, n in zip(sessions, [12, 5])]
    rows, masks = batch_of(drafts, model.cfg.vocab_size)
    outs = {}
    for attention in ("sdpa", "triton"):
        model.attention = attention
        pre = [runner.prefill([s.slot], [torch.tensor(s.seq)])[0] for s in sessions]
        out = runner.forward_batch(rows, masks)
        outs[attention] = (*pre, out.logits, out.features)
    model.attention = "auto"
    return [rel_err(a, b) for a, b in zip(outs["triton"], outs["sdpa"])]


# ---------------------------------------------------------------------------------------
# GPU: captured graphs.
# ---------------------------------------------------------------------------------------

GPU_CONFIG = GraphConfig(tree_buckets=(0, 4, 16, 64), batch_buckets=(1, 2, 4), kv_buckets=(256, 512),
                         modes=("forward", "greedy", "sample"))
GPU_ROUNDS = [
    ([0, 1, 2], [17, 5, 1], ["oracle", "random", "chain"], [GREEDY, GREEDY, GREEDY]),
    ([3, 0, 2, 1], [65, 9, 40, 3], ["oracle", "random", "oracle", "random"], [S1, GREEDY, S2, GREEDY]),
    ([1, 3], [7, 17], ["oracle", "chain"], [S3, S1]),
    ([2, 0, 3, 1], [100, 9, 4, 2], ["oracle", "oracle", "random", "chain"], [GREEDY, S2, GREEDY, S1]),  # eager
    ([0], [1], ["chain"], [GREEDY]),
]


def _lockstep(model, runners: Sequence[TargetRunner], rounds, rng, *, exact: bool, tol: float) -> None:
    """Drive runners (the first is the reference) through the same batched steps: compare the
    step's logits / features, the accepted paths (exactly when `exact`) and the committed K/V."""
    sessions = open_sessions(runners, rng, [9, 40, 17, 120])
    vocab = model.cfg.vocab_size
    for members, sizes, kinds, samplings in rounds:
        drafts = [make_draft(model, sessions[m], rng, n, kind, sampling)
                  for m, n, kind, sampling in zip(members, sizes, kinds, samplings)]
        rows, masks = batch_of(drafts, vocab)
        outs = [step_forward(r, rows, masks) for r in runners]
        verdicts = [r.verify_batch(rows, masks) for r in runners]
        want_out, want = outs[0], verdicts[0]
        for out, got in zip(outs[1:], verdicts[1:]):
            for i, d in enumerate(drafts):
                n = d.tree.num_nodes
                assert rel_err(out.logits[i, :n], want_out.logits[i, :n]) <= tol, (i, n)
                assert rel_err(out.features[i, :n], want_out.features[i, :n]) <= tol, (i, n)
                if exact:
                    assert got.paths[i] == want.paths[i] and got.bonus[i] == want.bonus[i], (i, n, d.sampling)
                if exact and want_out.logits.dtype == torch.float32:  # the Triton accept == its reference
                    path, bonus = reference_accept(want_out.logits[i, :n], d.tree, d.sampling, d.coins)
                    assert want.paths[i] == path and want.bonus[i] == bonus
            if got.paths == want.paths:
                assert rel_err(got.features, want.features) <= tol
        commit(drafts, want.paths, want.bonus)
        if not all(v.paths == want.paths for v in verdicts):
            return  # the sessions diverged (bf16 near-ties); nothing more to compare
        for s in sessions:
            ref = runners[0].cache.k[:, s.slot, :, :len(s.seq)]
            for r in runners[1:]:
                assert rel_err(r.cache.k[:, s.slot, :, :len(s.seq)], ref) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_graph_replay_matches_static_eager(qwen3_pair, dtype, attention):
    """Replaying the captured graphs gives what the same static-shape code gives eagerly, batch by batch."""
    model = load_model(qwen3_pair, "cuda", dtype)
    model.attention = attention
    replayed = static_runner(model, 4, 256, GPU_CONFIG, capture=True)
    static = static_runner(model, 4, 256, GPU_CONFIG, capture=False)
    assert replayed.graphs.num_graphs > 0 and static.graphs.num_graphs == 0
    _lockstep(model, [static, replayed], GPU_ROUNDS, np.random.default_rng(5), exact=True,
              tol=1e-6 if dtype == torch.float32 else 1e-3)
    model.attention = "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_graph_runner_matches_eager_runner(tiny_pair, dtype):
    """The default runner (graphs on) against cuda_graphs=False (the batch's own shapes)."""
    if dtype == torch.bfloat16 and "llama" in str(tiny_pair[0]):
        pytest.skip("bf16 is covered on the qwen3 pair (keeps the GPU run short)")
    model = load_model(tiny_pair, "cuda", dtype)
    eager = TargetRunner(model, 4, 256, 129, cuda_graphs=False, sampling="sample")  # GPU_CONFIG's sampled mode
    collect_garbage()
    graphed = TargetRunner(model, 4, 256, 129, graph_config=GPU_CONFIG)
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.cache.max_seq_len >= 256 + 129
    exact = dtype == torch.float32
    _lockstep(model, [eager, graphed], GPU_ROUNDS, np.random.default_rng(7), exact=exact,
              tol=1e-4 if exact else 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_measuring_verify_costs_covers_the_graphs_and_changes_no_step(qwen3_pair):
    """The cost table (graph replays on dummy trees in the scratch slot) has every (batch
    bucket, token bucket) of the graphs, and a runner that measured it still steps exactly
    as an eager one."""
    model = load_model(qwen3_pair, "cuda", torch.float32)
    eager = TargetRunner(model, 4, 256, 129, cuda_graphs=False, sampling="sample")  # GPU_CONFIG's sampled mode
    collect_garbage()
    graphed = TargetRunner(model, 4, 256, 129, graph_config=GPU_CONFIG)
    costs = graphed.measure_verify_costs()
    grid = {(b, t) for b in graphed.graphs.batch_buckets for t in graphed.graphs.token_buckets
            if b * t <= GPU_CONFIG.max_tokens}
    assert set(costs) == grid and all(s > 0 for s in costs.values())
    _lockstep(model, [eager, graphed], GPU_ROUNDS, np.random.default_rng(9), exact=True, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_eager_fallback_outside_the_buckets(qwen3_pair):
    """Batches no captured graph fits (too many rows, nodes, tokens or KV) run eagerly, correctly."""
    model = load_model(qwen3_pair, "cuda", torch.float32)
    off = TargetRunner(model, 3, 64, cuda_graphs=False)
    assert off.graphs is None and off.cache.max_seq_len == cache_length(64, 1025)
    config = GraphConfig(tree_buckets=(4, 8), batch_buckets=(1, 2), kv_buckets=(128,), max_tokens=10,
                         modes=("forward", "greedy", "sample"))
    collect_garbage()
    on = TargetRunner(model, 3, 64, 9, graph_config=config)
    g = on.graphs
    assert g.num_graphs == 3 * 3 and g.batch_buckets == (1, 2)  # (1, 5), (1, 9), (2, 5); (2, 9) > max_tokens
    assert g.select("greedy", 2, 5, 5) == (2, 5, 128) and g.select("sample", 1, 9, 9) == (1, 9, 128)
    assert g.select("greedy", 2, 6, 6) is None  # 2 x 9 tokens > max_tokens
    assert g.select("greedy", 3, 1, 1) is None  # more rows than the largest batch bucket
    assert g.select("greedy", 1, 10, 10) is None  # more nodes than the largest tree bucket
    assert g.select("forward", 1, 5, 124 + 5) is None  # past the largest KV bucket
    eager = TargetRunner(model, 3, 64, 9, cuda_graphs=False, sampling="sample")  # the config's sampled mode
    calls = _count_graph_runs(g)
    rounds = [([0, 1], [5, 5], ["oracle", "random"], [GREEDY, S1]),  # a graph
              ([0, 1], [6, 3], ["oracle", "random"], [GREEDY, S1]),  # max_tokens: eager
              ([0, 1, 2], [2, 3, 4], ["oracle", "random", "chain"], [GREEDY, GREEDY, S2]),  # 3 rows: eager
              ([2], [9], ["oracle"], [GREEDY]),  # a graph
              ([1], [12], ["oracle"], [S3])]  # 12 nodes: eager
    rng = np.random.default_rng(3)
    sessions = open_sessions([eager, on], rng, [9, 3, 20])
    for members, sizes, kinds, samplings in rounds:
        drafts = [make_draft(model, sessions[m], rng, n, kind, sampling)
                  for m, n, kind, sampling in zip(members, sizes, kinds, samplings)]
        rows, masks = batch_of(drafts, model.cfg.vocab_size)
        want, got = eager.verify_batch(rows, masks), on.verify_batch(rows, masks)
        assert got.paths == want.paths and got.bonus == want.bonus
        assert rel_err(got.features, want.features) < 1e-4
        commit(drafts, got.paths, got.bonus)
    assert [hit for mode, _, hit in calls if mode != "forward"] == [True, False, False, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_triton_attention_matches_sdpa_on_gpu(tiny_pair, dtype):
    assert max(_attention_agreement(tiny_pair, "cuda", dtype)) < (1e-5 if dtype == torch.float32 else 3e-2)


def _engine(pair, dtype, cuda_graphs=True, max_sessions=4):
    target, draft = pair
    limits = VerifierLimits(max_sessions=max_sessions, max_seq_len=256)
    collect_garbage()
    engine = LocalEngine.load(str(target), str(draft), device="cuda", dtype=dtype, limits=limits)
    if not cuda_graphs:
        model = engine.verifier.runner.model
        engine.verifier = TreeVerifier(TargetRunner(model, max_sessions, 256, cuda_graphs=False), limits)
    return engine


GPU_MODES = [DraftMode("tree", 16), DraftMode("tree", 64), DraftMode("chain", 0), DraftMode("tree", 0),
             DraftMode("ar", 0)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_float32(tiny_pair):
    """Sessions of several modes batched through the captured graphs == plain AR decoding each."""
    engine = _engine(tiny_pair, torch.float32)
    assert engine.verifier.runner.graphs.num_graphs > 0
    calls = _count_graph_runs(engine.verifier.runner.graphs)
    model = engine.verifier.runner.model
    requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(40, mode=m)) for i, m in enumerate(GPU_MODES)]
    for (prompt, config), out in zip(requests, engine.generate_many(requests)):
        assert out.tokens == reference_greedy(model, prompt, 40), config.mode
    assert any(hit and rows > 1 for _, rows, hit in calls)
    # A draft that matches the target often: long accepted paths through the graphs, still exact.
    oracle = dataclasses.replace(engine, proposer=OracleProposer(load_model(tiny_pair), block_size=8, rank1_every=5))
    outs = oracle.generate_many([(p, GenerationConfig(40, mode=DraftMode("tree", 16))) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == reference_greedy(model, prompt, 40) and out.mean_acceptance > 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_mixed_batches_on_gpu_are_seeded_and_batch_independent(tiny_pair):
    """Sampled sessions batched with greedy ones ("sample" graphs with greedy rows): each gives
    its tokens alone; same seed same tokens, another seed other tokens."""
    engine = _engine(tiny_pair, torch.float32)
    sampled = [GenerationConfig(40, sampling=SamplingParams(0.9, 30, 0.95, seed=7 + i), mode=DraftMode("tree", 16))
               for i in range(2)]
    requests = [(PROMPTS[0], sampled[0]), (PROMPTS[1], GenerationConfig(40, mode=DraftMode("tree", 16))),
                (PROMPTS[2], sampled[1]), (PROMPTS[0], sampled[1])]
    batched = engine.generate_many(requests)
    for (prompt, config), out in zip(requests, batched):
        assert out.tokens == engine.generate(prompt, config).tokens and len(out.tokens) == 40
    assert batched[0].tokens != batched[3].tokens  # same prompt, other seed
    assert batched[1].tokens == reference_greedy(engine.verifier.runner.model, PROMPTS[1], 40)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_logprobs_through_graphs_equal_eager_on_gpu(tiny_pair):
    """Logprobs read from the graphs' shared logits buffer (float32): those of the eager step, for
    greedy and sampled sessions batched with sessions that do not ask; asking changes no token."""
    graphs, eager = _engine(tiny_pair, torch.float32), _engine(tiny_pair, torch.float32, cuda_graphs=False)
    assert graphs.verifier.runner.graphs.num_graphs > 0
    oracle = OracleProposer(load_model(tiny_pair), block_size=8, rank1_every=5)  # long accepted paths
    graphs, eager = (dataclasses.replace(e, proposer=oracle) for e in (graphs, eager))
    asking = [GenerationConfig(40, mode=DraftMode("tree", 16), logprobs=5),
              GenerationConfig(40, sampling=SamplingParams(0.9, 30, 0.95, seed=3), mode=DraftMode("tree", 16),
                               logprobs=2)]
    requests = [(PROMPTS[0], asking[0]), (PROMPTS[1], GenerationConfig(40, mode=DraftMode("tree", 16))),
                (PROMPTS[2], asking[1])]
    calls = _count_graph_runs(graphs.verifier.runner.graphs)
    got, want = graphs.generate_many(requests), eager.generate_many(requests)
    assert any(hit and rows > 1 for _, rows, hit in calls)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
    assert got[1].logprobs is None and max(got[0].acceptance_lengths) > 2
    for i in (0, 2):  # (the sampled session may end early, at its EOS)
        assert len(got[i].logprobs) == len(got[i].tokens) > 1 and len(got[0].tokens) == 40
        assert [t.logprob for t in got[i].logprobs] == pytest.approx([t.logprob for t in want[i].logprobs], abs=1e-4)
        assert [[a for a, _ in t.top] for t in got[i].logprobs] == [[a for a, _ in t.top] for t in want[i].logprobs]
    plain = graphs.generate_many([(p, dataclasses.replace(c, logprobs=None)) for p, c in requests])
    assert [o.tokens for o in plain] == [o.tokens for o in got]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_token_biases_through_graphs_equal_eager_on_gpu(tiny_pair):
    """min_tokens's held-back ids and logit_bias, written into the graphs' inputs, batched beside
    sessions without them (float32): the eager step's tokens, greedy and sampled, and no held-back
    id in the first min_tokens; without min_tokens the same requests stop earlier."""
    graphs, eager = _engine(tiny_pair, torch.float32), _engine(tiny_pair, torch.float32, cuda_graphs=False)
    assert graphs.verifier.runner.graphs.num_graphs > 0
    ar = graphs.generate(PROMPTS[0], GenerationConfig(40, mode=DraftMode("ar", 0))).tokens
    stops = tuple(dict.fromkeys(ar))[:8]
    sampled = SamplingParams(0.8, 0, 1.0, seed=5)
    requests = [(PROMPTS[0], GenerationConfig(40, mode=DraftMode("tree", 16), stop_token_ids=stops, min_tokens=20)),
                (PROMPTS[1], GenerationConfig(40, mode=DraftMode("tree", 16))),
                (PROMPTS[0], GenerationConfig(40, sampling=sampled, mode=DraftMode("tree", 16), stop_token_ids=stops,
                                              min_tokens=20)),
                (PROMPTS[0], GenerationConfig(40, mode=DraftMode("ar", 0), stop_token_ids=stops, min_tokens=20)),
                (PROMPTS[2], GenerationConfig(40, mode=DraftMode("tree", 16),
                                              logit_bias=((ar[1], -100.0), (ar[3], 3.0))))]
    calls = _count_graph_runs(graphs.verifier.runner.graphs)
    got, want = graphs.generate_many(requests), eager.generate_many(requests)
    assert any(hit and rows > 1 for _, rows, hit in calls)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert got[0].tokens == got[3].tokens
    for out in (got[0], got[2]):
        assert len(out.tokens) >= 20 and not set(out.tokens[:20]) & set(stops)
    free = graphs.generate(PROMPTS[0], GenerationConfig(40, mode=DraftMode("tree", 16), stop_token_ids=stops))
    assert len(free.tokens) == 1  # its first token is a stop id


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_through_graphs_equal_plain_decoding_on_gpu(tiny_pair, dtype):
    """Repetition penalties in the graphs' inputs (the dense part in its kernel, the paths beside
    it), batched beside sessions without them: tree decoding gives plain decoding's tokens, greedy
    and seeded, and the eager step's in float32; the penalties change the output."""
    graphs = _engine(tiny_pair, dtype)
    assert graphs.verifier.runner.graphs.num_graphs > 0
    penalties = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
                 SamplingParams(repetition_penalty=1.6), SamplingParams(0.8, 0, 1.0, seed=3, frequency_penalty=1.0)]
    requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(40, sampling=s, mode=m, ignore_eos=True))
                for i, s in enumerate(penalties) for m in (DraftMode("ar", 0), DraftMode("tree", 16))]
    requests.append((PROMPTS[0], GenerationConfig(40, mode=DraftMode("tree", 16), ignore_eos=True)))
    calls = _count_graph_runs(graphs.verifier.runner.graphs)
    got = graphs.generate_many(requests)
    assert any(hit and rows > 1 for _, rows, hit in calls)
    for i in range(len(penalties)):
        assert got[2 * i].tokens == got[2 * i + 1].tokens, penalties[i]
    assert got[0].tokens != got[-1].tokens
    if dtype == torch.float32:
        eager = _engine(tiny_pair, dtype, cuda_graphs=False)
        assert [g.tokens for g in got] == [w.tokens for w in eager.generate_many(requests)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_triton_attention(tiny_pair):
    """attention="triton" in the captured graphs (float32): batched tree decoding == AR with "sdpa"."""
    engine = _engine(tiny_pair, torch.float32)
    model = engine.verifier.runner.model
    ar = {tuple(p): reference_greedy(model, p, 32) for p in PROMPTS}
    model.attention = "triton"
    try:
        limits = engine.verifier.limits
        collect_garbage()
        engine.verifier = TreeVerifier(TargetRunner(model, limits.max_sessions, 256), limits)  # captured with triton
        modes = [DraftMode("ar", 0), DraftMode("tree", 16), DraftMode("tree", 64), DraftMode("chain", 0)]
        requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(32, mode=m)) for i, m in enumerate(modes)]
        for (prompt, config), out in zip(requests, engine.generate_many(requests)):
            assert out.tokens == ar[tuple(prompt)], config.mode
    finally:
        model.attention = "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_equals_ar_on_gpu_bfloat16(qwen3_pair):
    """bf16: graphs on vs off, batched; tree vs AR agree on the first tokens.

    (Different token counts per pass pick different GEMM tilings, so bf16 rounding may
    flip a near-tie between AR and tree decoding.)
    """
    on, off = _engine(qwen3_pair, torch.bfloat16), _engine(qwen3_pair, torch.bfloat16, cuda_graphs=False)
    ar = {tuple(p): out.tokens for p, out in
          zip(PROMPTS, off.generate_many([(p, GenerationConfig(32, mode=DraftMode("ar", 0))) for p in PROMPTS]))}
    requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(32, mode=m)) for i, m in enumerate(GPU_MODES)]
    for (prompt, config), out in zip(requests, on.generate_many(requests)):
        assert out.tokens[:8] == ar[tuple(prompt)][:8], config.mode
    assert on.verifier.free_capacity == 4


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("t", [17, 65])
@pytest.mark.parametrize("length", [256, 1152])  # few keys: attention_tiles' small query blocks
def test_slot_attention_compiled_matches_sdpa(splits, t, length):
    from tests.test_slot_attention import check_slot_attention

    check_slot_attention("cuda", torch.bfloat16, splits, b=1, heads=32, kv_heads=8, d=128, t=t, length=length,
                         tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", [None, (16, 64, 4, 2), (16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2),
                                   (128, 64, 8, 2), (128, 32, 8, 3)])
@pytest.mark.parametrize("kind", ["tree", "causal"])
@pytest.mark.parametrize("t", [1, 17, 65])
def test_slot_attention_compiled_tiles_match_sdpa(tiles, kind, t):
    """Compiled launch shapes, at Qwen3-8B head counts, with three sessions' pasts ending in
    different key tiles (the shared-prefix loop, the masked loop, keys skipped after the last)."""
    from ddtree_kernels.slot_attention import AttentionTiles
    from tests.test_slot_attention import check_slot_attention

    check_slot_attention("cuda", torch.bfloat16, None, b=3, heads=32, kv_heads=8, d=128, t=t, length=1152,
                         pasts=[100, 700, 1152 - t - 30], kind=kind, tol=2e-2,
                         tiles=AttentionTiles(*tiles) if tiles else None)
