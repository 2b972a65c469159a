"""The drafter's static-shape draft step (`drafter_svc.draft_graphs`), run eagerly on the CPU.

On CUDA the same code is captured in CUDA graphs (tests/gpu/test_draft_graphs_gpu.py); here
`capture=False` checks padding, masks, positions, KV buckets, slots and the eager fallbacks
against the dynamic `DFlashProposer` path.
"""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from common.protocol import StatusError
from drafter_svc.__main__ import parse_args
from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs, context_capacity
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session_loop import DecodeSession, GenerationConfig, LocalVerifierLink, generate
from common.buckets import auto_kv_buckets
from verifier_svc.tree_verifier import VerifierLimits

MAX_SEQ = 200
# Tiny drafts have block 8: rounds of 0..8 new rows; buckets small enough to cross two boundaries
# and to fall back to eager once past + k + 8 > 128.
CONFIG = DraftGraphConfig(slots=2, kv_buckets=(48, 96, 128))
ROUND_ROWS = [0, 1, 8, 3, 8, 5, 2, 8, 8, 7, 1, 4, 8, 6]


def _proposers(pair, config: DraftGraphConfig = CONFIG, max_seq: int = MAX_SEQ):
    """(dynamic proposer, proposer with the static-shape path run eagerly), sharing weights."""
    target, draft = pair
    eager = DFlashProposer.from_pretrained(draft, target, max_seq_len=max_seq)
    static = DFlashProposer(eager.draft, eager.embed_tokens, eager.lm_head, max_seq)
    assert eager.graphs is None and static.graphs is None  # CPU: graphs are off by default
    static.graphs = DraftGraphs(static.draft, static.embed_tokens, static.lm_head, max_seq, config, capture=False)
    return eager, static


def _features(proposer: DFlashProposer, rows: int, seed: int) -> torch.Tensor:
    dim = proposer.draft.fc.weight.shape[1]
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= tol * b.abs().max().item()


def test_capacity_and_buckets():
    assert context_capacity(2048, 16) == 2176 and context_capacity(2048, 16) >= 2048 + 16
    assert context_capacity(100, 8) == 128
    with pytest.raises(ValueError):
        DraftGraphConfig(slots=0).check()
    with pytest.raises(ValueError):
        DraftGraphConfig(kv_buckets=()).check()


def test_select_picks_smallest_fitting_bucket(qwen3_pair):
    _, static = _proposers(qwen3_pair)
    g = static.graphs
    assert g.pool.capacity == 256 and g.kv_buckets == (48, 96, 128) and g.rows == 8
    assert g.select(0, 0) == 48
    assert g.select(32, 8) == 48  # 32 + 8 new rows + a block of 8 = 48
    assert g.select(33, 8) == 96
    assert g.select(112, 8) == 128
    assert g.select(113, 8) is None  # past the largest bucket: eager
    assert g.select(0, 9) is None  # more new rows than the padding allows: eager
    ladder = DraftGraphs(static.draft, static.embed_tokens, static.lm_head, 2048, DraftGraphConfig(slots=1),
                         capture=False)
    assert ladder.kv_buckets == auto_kv_buckets(context_capacity(2048, 8))
    assert ladder.kv_buckets[-1] == ladder.pool.capacity


def test_static_path_matches_dynamic_path(tiny_pair):
    """Two interleaved sessions on different slots, varying new rows, across KV buckets into the
    eager fallback: the block logits equal the dynamic path's."""
    eager, static = _proposers(tiny_pair)
    g = static.graphs
    feats = [_features(eager, 300, seed) for seed in (1, 2)]
    prompt_rows = (20, 3)
    dyn = [eager.start([], f[:n]) for f, n in zip(feats, prompt_rows)]
    ctx = [static.start([], f[:n]) for f, n in zip(feats, prompt_rows)]
    assert [c.slot for c in ctx] == [0, 1] and g.pool.free_slots == 0
    used, pos = [], list(prompt_rows)
    for r, k in enumerate(ROUND_ROWS * 2):
        for s in (0, 1):
            new = feats[s][pos[s]: pos[s] + k]
            pos[s] += k
            used.append(g.select(ctx[s].length, k))
            want = eager.block_logits(dyn[s], 11 + r + s, [], new)
            got = static.block_logits(ctx[s], 11 + r + s, [], new)
            assert got.shape == want.shape == (eager.block_size - 1, eager.lm_head.shape[0])
            assert _close(got, want), (r, s, k)
            assert ctx[s].length == dyn[s].length == pos[s]
    assert {48, 96, 128, None} <= set(used)  # every bucket, then past the largest one
    for c in ctx:
        static.finish(c)
    assert g.pool.free_slots == 2


def test_concurrent_sessions_take_turns(qwen3_pair):
    """Sessions in worker threads share the static buffers: each still gets its own logits."""
    eager, static = _proposers(qwen3_pair, DraftGraphConfig(slots=3, kv_buckets=(64, 128, 256)))
    feats = [_features(eager, 200, seed) for seed in range(3)]
    want = []
    for f in feats:
        ctx, pos, out = eager.start([], f[:10]), 10, []
        for r, k in enumerate(ROUND_ROWS):
            out.append(eager.block_logits(ctx, r, [], f[pos: pos + k]))
            pos += k
        want.append(out)
    errors = []

    def session(i: int) -> None:
        ctx, pos = static.start([], feats[i][:10]), 10
        try:
            for r, k in enumerate(ROUND_ROWS):
                got = static.block_logits(ctx, r, [], feats[i][pos: pos + k])
                pos += k
                if not _close(got, want[i][r]):
                    errors.append((i, r))
        finally:
            static.finish(ctx)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and static.graphs.pool.free_slots == 3


def test_full_pool_gives_private_eager_contexts(qwen3_pair):
    eager, static = _proposers(qwen3_pair, DraftGraphConfig(slots=1, kv_buckets=(64, 128)))
    f = _features(eager, 40, 0)
    first, second = static.start([], f[:5]), static.start([], f[:5])
    assert first.slot == 0 and second.slot is None and static.graphs.pool.free_slots == 0
    ref = eager.start([], f[:5])
    want = eager.block_logits(ref, 3, [], f[5:9])
    assert _close(static.block_logits(second, 3, [], f[5:9]), want)
    assert _close(static.block_logits(first, 3, [], f[5:9]), want)
    static.finish(second)
    assert static.graphs.pool.free_slots == 0
    static.finish(first)
    static.finish(first)  # twice is harmless
    assert static.graphs.pool.free_slots == 1 and first.kv is None
    forgotten = static.start([], f[:5])
    assert static.graphs.pool.free_slots == 0
    del forgotten
    gc.collect()
    assert static.graphs.pool.free_slots == 1  # a context that was never finished is collected


def test_prompt_too_long_frees_its_slot(qwen3_pair):
    _, static = _proposers(qwen3_pair)
    with pytest.raises(ValueError, match="draft context full"):
        static.start([], _features(static, 300, 0))
    assert static.graphs.pool.free_slots == 2


# ---------------------------------------------------------------------------------------
# End to end: generation through the static-shape draft path.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_pair):
    """(engine with the static-shape draft path, its dynamic twin) over one verifier."""
    target, draft = tiny_pair
    limits = VerifierLimits(max_sessions=2, max_seq_len=MAX_SEQ)
    dynamic = LocalEngine.load(str(target), str(draft), limits=limits)
    graphed = LocalEngine(dynamic.verifier, _proposers(tiny_pair)[1], dynamic.tokenizer, dynamic.eos_token_ids)
    return graphed, dynamic


PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100))]


@pytest.mark.parametrize("mode", [DraftMode("chain", 0), DraftMode("tree", 4), DraftMode("tree", 16)],
                         ids=lambda m: f"{m.kind}{m.budget}")
def test_greedy_generation_unchanged(engines, mode):
    graphed, dynamic = engines
    for prompt in PROMPTS:
        n = MAX_SEQ - len(prompt) - 1  # runs into the eager fallback past the largest bucket
        ar = dynamic.generate(prompt, GenerationConfig(max_new_tokens=n, mode=DraftMode("ar", 0)))
        before = dynamic.generate(prompt, GenerationConfig(max_new_tokens=n, mode=mode))
        out = graphed.generate(prompt, GenerationConfig(max_new_tokens=n, mode=mode))
        assert out.tokens == before.tokens == ar.tokens
        assert out.acceptance_lengths == before.acceptance_lengths
    assert graphed.proposer.graphs.pool.free_slots == 2


class _FailingLink(LocalVerifierLink):
    def verify(self, tree, round_index, traceparent=""):
        if round_index == 3:
            raise StatusError("UNAVAILABLE", "verifier went away")
        return super().verify(tree, round_index, traceparent)


def test_sessions_give_their_slot_back(engines):
    """However a session ends (done, error, or dropped by its caller), its slot is free again."""
    graphed, _ = engines
    pool = graphed.proposer.graphs.pool
    config = GenerationConfig(max_new_tokens=30, mode=DraftMode("tree", 8))
    generate(LocalVerifierLink(graphed.verifier), graphed.proposer, PROMPTS[0], config)
    assert pool.free_slots == 2
    with pytest.raises(StatusError):
        generate(_FailingLink(graphed.verifier), graphed.proposer, PROMPTS[0], config)
    assert pool.free_slots == 2
    session = DecodeSession(LocalVerifierLink(graphed.verifier), graphed.proposer, PROMPTS[0], config)
    for update in session:  # the server's worker stops like this when the client goes away
        if update.round == 2:
            assert pool.free_slots == 1
            break
    assert pool.free_slots == 2


def test_no_cuda_graphs_flag(monkeypatch):
    args = ["--draft", "d", "--target", "t"]
    monkeypatch.delenv("DRAFTER_NO_CUDA_GRAPHS", raising=False)
    assert parse_args(args).cuda_graphs
    assert not parse_args(args + ["--no-cuda-graphs"]).cuda_graphs
    monkeypatch.setenv("DRAFTER_NO_CUDA_GRAPHS", "1")
    assert not parse_args(args).cuda_graphs
