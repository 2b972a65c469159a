"""Position-keyed sampling (ddtree_kernels/keyed_sampling.py, accept mode "keyed"): the noise is
Gumbel, samples follow the filtered distribution, the keyed walk is the greedy walk over the
perturbed scores, and a seeded speculative run equals seeded plain decoding token for token
whatever the trees, the budget and the batch (float32)."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from common.protocol import SamplingParams
from common.tree import DraftTree
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from ddtree_kernels.keyed_sampling import gumbel_noise, keyed_sample_reference, keyed_scores, position_keys
from ddtree_kernels.probs import process_probs_reference
from verifier_svc.accept import accept_batch
from verifier_svc.tree_verifier import VerifierLimits


def test_noise_is_standard_gumbel_and_keyed():
    seeds = torch.arange(64, dtype=torch.int64) * 7919 + (1 << 62)
    positions = torch.arange(64, dtype=torch.int64) % 9
    g = gumbel_noise(position_keys(seeds, positions), 4096).double()
    x = g.flatten().numpy()
    assert abs(x.mean() - 0.5772156649) < 0.01 and abs(x.var() - math.pi ** 2 / 6) < 0.02
    assert kstest(np.exp(-np.exp(-x[:50_000])), "uniform").pvalue > 1e-3  # Gumbel CDF of the noise is uniform
    # A function of (seed, position, token) alone; other seeds, positions (and the seed's high bits) differ.
    again = gumbel_noise(position_keys(seeds.clone(), positions.clone()), 4096)
    assert torch.equal(again, g.float())
    for other in (position_keys(seeds + 1, positions), position_keys(seeds, positions + 1),
                  position_keys(seeds ^ (1 << 62), positions)):
        assert (gumbel_noise(other, 4096) != g.float()).float().mean() > 0.99
    # Neighbouring tokens are not correlated.
    assert abs(np.corrcoef(x.reshape(64, 4096)[:, :-1].ravel(), x.reshape(64, 4096)[:, 1:].ravel())[0, 1]) < 0.01


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.9)])
def test_keyed_samples_follow_the_filtered_distribution(temperature, top_k, top_p):
    """One row of logits sampled under 20,000 seeds: the counts fit process_probs' distribution,
    and the test has power (the unfiltered or sharper distribution is rejected)."""
    vocab, n = 12, 20_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    rows = logits.expand(n, vocab).contiguous()
    t, k, p = (torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
    samples = keyed_sample_reference(rows, torch.arange(n, dtype=torch.int64) * 104729, torch.full((n,), 17),
                                     t, k, p)
    want = process_probs_reference(logits, t[:1], k[:1], p[:1])[0].double()
    counts = torch.bincount(samples, minlength=vocab).double()
    assert counts[want == 0].sum() == 0
    kept = want > 0
    expected = want[kept] / want[kept].sum()  # float64, summing to 1 exactly enough for scipy
    assert chisquare(counts[kept].numpy(), (n * expected).numpy()).pvalue > 1e-3
    sharper = expected ** 2 / (expected ** 2).sum()
    assert chisquare(counts[kept].numpy(), (n * sharper).numpy()).pvalue < 1e-6


def _walk_reference(tree: DraftTree, scores: torch.Tensor) -> tuple[list[int], int]:
    """Follow the child holding each node's top-scored token; (path, bonus token)."""
    node, path = 0, [0]
    while True:
        best = int(scores[node].argmax())
        child = int(tree.next_token[node])
        while child >= 0 and int(tree.tokens[child]) != best:
            child = int(tree.next_sibling[child])
        if child < 0:
            return path, best
        path.append(child)
        node = child


def test_keyed_walk_is_the_greedy_walk_over_perturbed_scores():
    """accept_batch "keyed" on random trees (greedy rows mixed in) equals a plain walk over
    keyed_scores at each node's position + 1; greedy rows equal the plain greedy walk."""
    from tests.test_fused_accept import random_stage

    b, t, vocab = 6, 9, 40
    stage = random_stage(11, b, t, vocab, torch.float32)
    logits = stage["logits"].view(b, t, vocab)
    tokens, nt, ns = (stage[k].view(b, t) for k in ("tokens", "next_token", "next_sibling"))
    seeds = torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int64)
    past = torch.tensor([3, 0, 11, 4, 7, 2])
    positions = past[:, None] + torch.arange(t)[None]  # any positions: the walk only reads them
    greedy = torch.tensor([False, True, False, False, True, False])
    temperature = torch.tensor([0.8, 1.0, 1.2, 1.0, 1.0, 0.6])
    top_k = torch.tensor([0, 0, 7, 0, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.7, 1.0, 1.0])
    result, _ = accept_batch("keyed", tokens, nt, ns, logits, torch.zeros(b, t, 1), greedy=greedy,
                             temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    for r in range(b):
        tree = DraftTree(tokens[r], nt[r], ns[r])
        if greedy[r]:
            scores = logits[r]
        else:
            scores = keyed_scores(logits[r], seeds[r].repeat(t), positions[r] + 1, temperature[r].repeat(t),
                                  top_k[r].repeat(t), top_p[r].repeat(t))
        path, bonus = _walk_reference(tree, scores)
        assert result[r, 0] == len(path) - 1 and result[r, 1] == bonus
        assert result[r, 2: 2 + len(path)].tolist() == path


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=6, max_seq_len=256),
                            sampling="keyed")


PROMPTS = [[5, 17, 42, 99, 3], [300, 12], list(range(60, 100))]
SAMPLINGS = [SamplingParams(1.0, 0, 1.0, seed=1), SamplingParams(0.8, 20, 0.9, seed=2),
             SamplingParams(1.2, 0, 0.8, seed=3)]


def test_seeded_speculative_sampling_equals_seeded_ar(engine):
    """Every budget and the chain, alone and all batched together: exactly the AR tokens."""
    modes = [DraftMode("chain", 0)] + [DraftMode("tree", b) for b in (0, 1, 4, 16, 64)]
    requests = []
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            ar = engine.generate(prompt, GenerationConfig(24, sampling=sampling, mode=DraftMode("ar", 0))).tokens
            for mode in modes:
                config = GenerationConfig(24, sampling=sampling, mode=mode)
                assert engine.generate(prompt, config).tokens == ar, (prompt, sampling, mode)
                requests.append((prompt, config, ar))
    together = engine.generate_many([(p, c) for p, c, _ in requests], pipelined=True)
    assert [r.tokens for r in together] == [ar for *_, ar in requests]


def test_both_sampling_modes_are_selectable(tiny_pair):
    """Keyed sampling (the default) and the coin walk: seeded outputs are reproducible, and differ."""
    target, draft = tiny_pair
    coins = LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=2, max_seq_len=128),
                             sampling="sample")
    keyed = LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=2, max_seq_len=128))
    config = GenerationConfig(24, sampling=SAMPLINGS[0], mode=DraftMode("tree", 8))
    a, b = (coins.generate(PROMPTS[0], config).tokens for _ in range(2))
    assert a == b and a != keyed.generate(PROMPTS[0], config).tokens
    assert coins.verifier.runner.sampling == "sample" and keyed.verifier.runner.sampling == "keyed"


def test_keyed_sampling_through_the_services(qwen3_pair):
    """A verifier started with sampling="keyed": a seeded request gives the same tokens at every
    tree budget, plain decoding (budget 0) included, and concurrent requests change nothing."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from common.rpc import CHANNEL_OPTIONS, pb_grpc
    from drafter_svc.server import serve as serve_drafter
    from tests.servers import ServerThread
    from tests.test_e2e import drafter_engine, request, run, verifier_config
    from verifier_svc.server import serve as serve_verifier

    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair, sampling="keyed"))) as verifier:
        engine = drafter_engine(qwen3_pair, verifier.port)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GenerationStub(channel)
            reqs = [request(PROMPTS[i % 3], n=16, budget=budget, temperature=0.9, top_k=30, seed=70 + i % 3)
                    for i, budget in enumerate((0, 0, 0, 4, 4, 4, 16, 16, 16))]
            alone = [run(stub, r)[0] for r in reqs]
            for i in range(3):
                assert alone[i] == alone[i + 3] == alone[i + 6]
            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(lambda r: run(stub, r)[0], reqs)) == alone
