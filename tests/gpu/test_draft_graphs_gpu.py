"""CUDA-graph draft step: captured replay == the same static-shape code run eagerly == the dynamic path.

tests/test_draft_graphs.py checks the static-shape code against the dynamic path on the CPU;
these tests need CUDA and are skipped without it.
"""
from __future__ import annotations

import pytest
import torch

from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session_loop import GenerationConfig
from verifier_svc.tree_verifier import VerifierLimits

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16]
MAX_SEQ = 200
CONFIG = DraftGraphConfig(slots=2, kv_buckets=(48, 96, 128))  # past 128 - 8 - 8 rows: eager fallback
ROUND_ROWS = [0, 1, 8, 3, 8, 5, 2, 8, 8, 7, 1, 4, 8, 6]


def _proposer(pair, dtype, cuda_graphs: bool = True, capture: bool | None = None) -> DFlashProposer:
    target, draft = pair
    proposer = DFlashProposer.from_pretrained(draft, target, "cuda", dtype, MAX_SEQ,
                                              cuda_graphs and capture is not False, CONFIG)
    if capture is False:  # the static-shape path, run eagerly
        proposer.graphs = DraftGraphs(proposer.draft, proposer.embed_tokens, proposer.lm_head, MAX_SEQ, CONFIG,
                                      capture=False)
    return proposer


def _rounds(proposers: list[DFlashProposer], tol: float) -> set:
    """Two interleaved sessions per proposer, the same features and roots: logits agree with the first's."""
    dim = proposers[0].draft.fc.weight.shape[1]
    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(300, dim, generator=gen) for _ in range(2)]
    prompt_rows = (20, 3)
    ctxs = [[p.start([], f[:n]) for f, n in zip(feats, prompt_rows)] for p in proposers]
    pos, used = list(prompt_rows), set()
    for r, k in enumerate(ROUND_ROWS * 2):
        for s in (0, 1):
            new = feats[s][pos[s]: pos[s] + k]
            pos[s] += k
            if proposers[-1].graphs is not None:
                used.add(proposers[-1].graphs.select(ctxs[-1][s].length, k))
            out = [p.block_logits(c[s], 11 + r + s, [], new).float() for p, c in zip(proposers, ctxs)]
            for got in out[1:]:
                assert (got - out[0]).abs().max().item() <= tol * out[0].abs().max().item(), (r, s, k)
    for p, c in zip(proposers, ctxs):
        for ctx in c:
            p.finish(ctx)
        if p.graphs is not None:
            assert p.graphs.pool.free_slots == CONFIG.slots
    return used


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_matches_static_eager(qwen3_pair, dtype):
    static = _proposer(qwen3_pair, dtype, capture=False)
    replayed = _proposer(qwen3_pair, dtype)
    assert replayed.graphs.capture and replayed.graphs.num_graphs == 3
    used = _rounds([static, replayed], tol=1e-6 if dtype == torch.float32 else 1e-3)
    assert {48, 96, 128, None} <= used  # every graph, then the eager fallback


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_matches_dynamic_path(tiny_pair, dtype):
    eager = _proposer(tiny_pair, dtype, cuda_graphs=False)
    assert eager.graphs is None
    # bf16: the graph path's fused norm / RoPE / attention kernels round differently from the
    # eager path's separate ops and SDPA; the differences grow over the rounds' context.
    _rounds([eager, _proposer(tiny_pair, dtype)], tol=1e-4 if dtype == torch.float32 else 6e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_greedy_generation_with_draft_graphs(tiny_pair):
    """float32 on CUDA: graphs on (drafter and verifier) == graphs off == autoregressive."""
    target, draft = tiny_pair
    limits = VerifierLimits(max_sessions=2, max_seq_len=256)
    on = LocalEngine.load(str(target), str(draft), "cuda", torch.float32, limits)
    off = LocalEngine.load(str(target), str(draft), "cuda", torch.float32, limits, cuda_graphs=False)
    assert on.proposer.graphs is not None and off.proposer.graphs is None
    for prompt in ([5, 17, 42, 99, 3], list(range(60, 100))):
        ar = off.generate(prompt, GenerationConfig(max_new_tokens=40, mode=DraftMode("ar", 0))).tokens
        for mode in (DraftMode("chain", 0), DraftMode("tree", 16)):
            config = GenerationConfig(max_new_tokens=40, mode=mode)
            assert on.generate(prompt, config).tokens == off.generate(prompt, config).tokens == ar, mode
    assert on.proposer.graphs.pool.free_slots == limits.max_sessions
