"""The fused sampling + accept stage (ddtree_kernels/fused_accept.py): Triton == the composed references.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py), which is slow: the
vocabularies are small, and the vocabulary chunk is lowered so that every row spans several
chunks with a ragged last one. Most filter cases keep few candidates per chunk, so that rows
whose thresholds the candidates cannot decide take the radix search over their whole row.
The radix is the kernels' 4 bits but in one case, 8 (the code is the same for any radix; in
the interpreter 8 bits cost more, in a loop over the digits).
Outputs must be equal: the fused stage sums in another order than torch, which can only
matter when a coin falls within rounding of a boundary (not on these seeds).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from common.tree import DraftTree
from ddtree_kernels import fused_accept
from ddtree_kernels.fused_accept import tree_accept, tree_accept_reference, tree_accept_triton
from ddtree_kernels.tree_sampling import BACKEND_ENV
from tests.reference import distinct_sibling_tokens
from tests.test_kernels import random_parents

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_stage(seed: int, bs: int, nodes: int, vocab: int, dtype: torch.dtype, *, shape: str = "random",
                 levels: int = 0, oracle: float = 0.7, boost: float = 4.0) -> dict[str, Tensor]:
    """Trees, logits and coins of one batch (on the CPU).

    levels > 0 quantises the logits to that many values (many ties, also at the maximum).
    oracle: the chance that a node's logits favour one of its children's tokens, by `boost`
    above the row's maximum (boost 0: tied with it, so the first maximum decides greedy).
    """
    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(bs):
        parents = random_parents(rng, shape, nodes)
        trees.append((parents, DraftTree.from_parents(distinct_sibling_tokens(rng, parents, vocab), parents)))
    if levels:
        logits = rng.integers(0, levels, size=(bs, nodes, vocab)) * 0.75
    else:
        logits = rng.normal(size=(bs, nodes, vocab)) * rng.uniform(0.5, 4.0, size=(bs, nodes, 1))
    for b, (parents, tree) in enumerate(trees):
        for node in range(nodes):
            children = [c for c in range(1, nodes) if parents[c] == node]
            if children and rng.random() < oracle:
                token = int(tree.tokens[int(rng.choice(children))])
                logits[b, node, token] = logits[b, node].max() + boost
    gen = torch.Generator().manual_seed(seed)
    return {
        "logits": torch.from_numpy(logits).to(dtype),
        "tokens": torch.stack([t.tokens for _, t in trees]),
        "next_token": torch.stack([t.next_token for _, t in trees]),
        "next_sibling": torch.stack([t.next_sibling for _, t in trees]),
        "coins": torch.rand(bs, nodes, generator=gen).clamp_min(2**-24),
        "final_coins": torch.rand(bs, generator=gen).clamp(2**-24, 1 - 2**-24),
    }


def row_params(vocab: int, bs: int, seed: int, kinds: list[tuple[int, float]]) -> dict[str, Tensor]:
    """Per-row temperature, top_k and top_p: the (k, p) pairs in turn, temperatures varied."""
    rng = np.random.default_rng(seed)
    pairs = [kinds[(seed + b) % len(kinds)] for b in range(bs)]
    return {
        "temperature": torch.tensor(rng.choice([0.05, 0.4, 1.0, 1.7], bs), dtype=torch.float32),
        "top_k": torch.tensor([k for k, _ in pairs], dtype=torch.int64),
        "top_p": torch.tensor([p for _, p in pairs], dtype=torch.float32),
    }


def run_on(device: str, impl, stage: dict[str, Tensor], **options) -> list[Tensor]:
    """predicts / accept_index / accept_num of impl on device copies of the inputs (fresh
    outputs), returned on the CPU."""
    bs, nodes = stage["tokens"].shape
    args = {k: v.to(device) for k, v in stage.items() if v is not None}
    options = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in options.items()}
    if options.get("greedy"):
        args.pop("coins"), args.pop("final_coins")
    # Garbage in every output entry: the stage must write each one itself (callers leave them unset).
    outputs = [torch.full((bs * nodes,), 7777, dtype=torch.int32, device=device),
               torch.full((bs, nodes), 7777, dtype=torch.int32, device=device),
               torch.full((bs,), 7777, dtype=torch.int32, device=device)]
    impl(args.pop("logits"), args.pop("tokens"), args.pop("next_token"), args.pop("next_sibling"), *outputs,
         **args, **options)
    return [t.cpu() for t in outputs]


def run(impl, stage: dict[str, Tensor], **options) -> list[Tensor]:
    return run_on(DEVICE, impl, stage, **options)


def assert_same(stage: dict[str, Tensor], **options) -> list[Tensor]:
    """The fused stage equals the reference; returns the reference's outputs."""
    expected = run(tree_accept_reference, stage, **options)
    actual = run(tree_accept_triton, stage, **options)
    for name, a, e in zip(("predicts", "accept_index", "accept_num"), actual, expected):
        assert torch.equal(a, e), f"{name} differs:\n{a}\n{e}"
    return expected


@pytest.fixture
def chunk(monkeypatch):
    """Set the vocabulary chunk (and optionally the radix bits, the radix searches' block, the
    candidates per chunk, the candidates' sub-chunk and the searches' programs) of the fused
    kernels. The small sub-chunk takes the candidates from picked sub-chunks wherever their
    number (a power of two >= candidates + 1) times it is below the chunk. (The interpreter
    runs programs one after another, so its first search program claims every (row, chunk)
    pair and the others find none left; the GPU tests share them out.)"""
    def set_sizes(chunk_v: int, radix_bits: int = fused_accept.RADIX_BITS,
                  hist_block: int = fused_accept.HIST_BLOCK, candidates: int = fused_accept.CANDIDATES,
                  sub_chunk: int = 4, search_programs: int = 5) -> None:
        monkeypatch.setattr(fused_accept, "CHUNK_V", chunk_v)
        monkeypatch.setattr(fused_accept, "RADIX_BITS", radix_bits)
        monkeypatch.setattr(fused_accept, "HIST_BLOCK", hist_block)
        monkeypatch.setattr(fused_accept, "CANDIDATES", candidates)
        monkeypatch.setattr(fused_accept, "SUB_CHUNK", sub_chunk)
        monkeypatch.setattr(fused_accept, "SEARCH_PROGRAMS", search_programs)
    return set_sizes


# ---------------------------------------------------------------------------------------
# Greedy and temperature-only sampling.
# ---------------------------------------------------------------------------------------

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
PLAIN_CASES = [
    # (batch, nodes, V, dtype, chunk, tree shape, quantisation levels, oracle boost)
    (1, 1, 50, F32, 16, "random", 0, 4.0),  # the root only
    (4, 10, 97, BF16, 32, "random", 0, 4.0),
    (3, 12, 300, F32, 128, "deep", 4, 0.0),  # ties, also between the favoured child and the maximum
    (2, 16, 1000, BF16, 256, "chain", 0, 6.0),  # long paths, some holding every node
    (3, 9, 300, F16, 64, "wide", 3, 1.0),
]


@pytest.mark.parametrize("seed, case", list(enumerate(PLAIN_CASES)),
                         ids=[f"B{c[0]}-T{c[1]}-V{c[2]}-{str(c[3])[6:]}" for c in PLAIN_CASES])
def test_greedy_and_temperature_match_reference(seed, case, chunk):
    bs, nodes, vocab, dtype, chunk_v, shape, levels, boost = case
    chunk(chunk_v)
    stage = random_stage(seed, bs, nodes, vocab, dtype, shape=shape, levels=levels, boost=boost,
                         oracle=1.0 if shape == "chain" else 0.7)
    greedy = assert_same(stage, greedy=True)
    if nodes > 1 and shape == "chain":
        assert greedy[2].max().item() == nodes - 1  # a path holding every node
    off = row_params(vocab, bs, seed, [(0, 1.0), (vocab, 1.0), (vocab + 5, 2.0), (-1, 1.0)])
    temperature_only = assert_same(stage, greedy=False, temperature=off["temperature"], filters=False)
    # Rows with both filters off give the same through the filtered kernels.
    assert torch.equal(assert_same(stage, greedy=False, **off)[0], temperature_only[0])


def test_greedy_ties_take_the_first_maximum(chunk):
    """All logits equal but a few maxima: argmax is the first one, in any chunk."""
    chunk(16)
    stage = random_stage(0, 2, 6, 60, BF16, shape="chain", oracle=0.0)
    stage["logits"].zero_()
    stage["logits"][:, :, [17, 40, 59]] = 1.0
    stage["tokens"][:, 1:] = 17
    expected = assert_same(stage, greedy=True)
    assert expected[2].tolist() == [5, 5]
    assert expected[0].view(2, 6)[:, -1].tolist() == [17, 17]


# ---------------------------------------------------------------------------------------
# top-k / top-p.
# ---------------------------------------------------------------------------------------


def filter_kinds(vocab: int) -> list[tuple[int, float]]:
    """(top_k, top_p) pairs: each filter alone at its edges, both, and neither."""
    return [(1, 1.0), (vocab - 1, 1.0), (7, 1.0), (0, 1e-6), (0, 0.999), (0, 0.6), (vocab, 0.9),
            (5, 0.5), (1, 0.3), (vocab - 1, 0.95), (0, 1.0)]


FILTER_CASES = [
    # (batch, nodes, V, dtype, chunk, radix bits, tree shape, quantisation levels, candidates per chunk)
    (6, 3, 97, BF16, 32, 4, "random", 0, 4),
    (5, 4, 300, F32, 128, 4, "deep", 0, 2),
    (5, 4, 1000, BF16, 256, 4, "random", 5, 8),
    (4, 3, 300, F16, 128, 4, "wide", 0, 32),
    (3, 4, 97, F32, 64, 4, "chain", 3, 4),
    (6, 3, 97, BF16, 64, 8, "chain", 0, 64),
]


@pytest.mark.parametrize("repeat", [0, 1])
@pytest.mark.parametrize("index, case", list(enumerate(FILTER_CASES)),
                         ids=[f"B{c[0]}-T{c[1]}-V{c[2]}-{str(c[3])[6:]}-r{c[5]}-c{c[8]}" for c in FILTER_CASES])
def test_top_k_top_p_match_reference(repeat, index, case, chunk):
    bs, nodes, vocab, dtype, chunk_v, radix_bits, shape, levels, candidates = case
    chunk(chunk_v, radix_bits, candidates=candidates)
    seed = index + len(FILTER_CASES) * repeat
    stage = random_stage(100 + seed, bs, nodes, vocab, dtype, shape=shape, levels=levels)
    assert_same(stage, greedy=False, **row_params(vocab, bs, seed, filter_kinds(vocab)))


def test_filters_keep_ties_and_long_paths(chunk):
    """Quantised logits tie at the top-k / top-p boundaries; favoured children give long paths."""
    chunk(32, 4, candidates=4)
    vocab, bs, nodes = 70, 4, 6
    stage = random_stage(7, bs, nodes, vocab, BF16, shape="chain", levels=3, oracle=1.0, boost=12.0)
    params = row_params(vocab, bs, 1, [(2, 1.0), (3, 0.7), (0, 0.5), (vocab - 2, 0.999)])
    expected = assert_same(stage, greedy=False, **params)
    assert expected[2].max().item() >= 3


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_candidates_and_radix_search_find_the_same_floors(dtype, chunk):
    """The two ways to a row's floor agree: candidates that hold whole chunks decide every row,
    two per chunk send the flat rows (top-p needs many keys) and big top-k to the radix search,
    which skips the chunks whose largest key is below its range (row 0's far tail) and reads
    several blocks per chunk."""
    vocab, bs, nodes = 200, 4, 3
    stage = random_stage(11, bs, nodes, vocab, dtype, shape="chain", oracle=1.0, boost=8.0)
    logits = stage["logits"]
    logits[0, :, 100:] -= 20.0  # row 0: every key past the first chunks is far below the head
    logits[1] = (logits[1] * 0.05).to(dtype)  # flat: top-p 0.8 keeps most of the row
    params = {"temperature": torch.tensor([1.0, 1.0, 0.7, 1.3]), "top_k": torch.tensor([3, 0, 20, 2]),
              "top_p": torch.tensor([1.0, 0.8, 0.95, 0.99])}

    def stats(candidates: int):
        chunk(64, 4, hist_block=16, candidates=candidates)
        out = fused_accept._row_stats(logits.to(DEVICE), nodes, greedy=False, filters=True,
                                      **{k: v.to(DEVICE) for k, v in params.items()})
        return out.floor.cpu(), out.kept.cpu(), out.exact.cpu()

    whole_floor, whole_kept, whole_exact = stats(64)
    assert whole_exact.all()  # nothing left out of the candidates
    floor, kept, exact = stats(2)
    assert 0 < exact.sum() < exact.numel()  # both ways taken
    assert torch.equal(floor, whole_floor)
    torch.testing.assert_close(kept, whole_kept, rtol=1e-5, atol=0)
    assert_same(stage, greedy=False, **params)  # and both equal the reference


def logit_keys(logits: Tensor) -> Tensor:
    """The kernels' keys (int64) of bf16 / fp16 / fp32 logits: ordered like the values, -0.0 as +0.0."""
    bits = (logits.view(torch.int32) if logits.dtype == F32 else logits.view(torch.int16)).long()
    sign = 1 << (logits.element_size() * 8 - 1)
    bits = torch.where(bits == -sign, 0, bits)
    return torch.where(bits < 0, bits ^ (sign - 1), bits) + sign


def search_buffers(monkeypatch, logits: Tensor, nodes: int, params: dict[str, Tensor]):
    """_row_stats on logits, with the searches' buffers (the candidates) it used."""
    seen = []
    run_searches = fused_accept._run_searches
    monkeypatch.setattr(fused_accept, "_run_searches", lambda search, *a: (seen.append(search), run_searches(search, *a)))
    stats = fused_accept._row_stats(logits.to(DEVICE), nodes, greedy=False, filters=True,
                                    **{k: v.to(DEVICE) for k, v in params.items()})
    return stats, seen[0]


@pytest.mark.parametrize("dtype, sub_chunk", [(BF16, 4), (BF16, 16), (F32, 2)])
def test_candidates_are_each_chunks_largest_keys(dtype, sub_chunk, chunk, monkeypatch):
    """Each chunk's candidates are its largest keys, ties once each, and its left-out key the next
    one, whether taken from picked sub-chunks (sub-chunks of 4 or 2: 8 of them are picked) or
    from the whole chunk (16): with many ties (also across sub-chunks and at the boundary),
    -0.0 and +0.0, -inf, and a last chunk of 3 keys (fewer than the candidates)."""
    chunk(64, candidates=4, sub_chunk=sub_chunk)
    vocab, bs, nodes = 4 * 64 + 3, 3, 2
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(bs, nodes, vocab, generator=gen)
    logits[0] = torch.randint(0, 3, (nodes, vocab), generator=gen) * 0.5  # ties everywhere
    logits[1, :, ::7] = 1.5  # ties across sub-chunks, above the rest
    logits[1, 0, 64:128] = -0.0
    logits[1, 0, 100:110] = 0.0
    logits[2, :, 3::5] = -float("inf")
    logits = logits.to(dtype)
    params = {"temperature": torch.ones(bs), "top_k": torch.tensor([3, 0, 5]), "top_p": torch.tensor([1.0, 0.5, 0.9])}
    _, search = search_buffers(monkeypatch, logits, nodes, params)
    keys = torch.nn.functional.pad(logit_keys(logits.view(bs * nodes, vocab)), (0, 5 * 64 - vocab), value=-1)
    ranked = torch.nn.functional.pad(keys.view(bs * nodes, 5, 64).sort(-1, descending=True).values, (0, 5), value=-1)
    assert torch.equal(search.candidates.cpu().long(), ranked[..., :4])
    assert torch.equal(search.left_out.cpu().long(), ranked[..., 4])


def test_top_k_floor_at_the_candidates_boundary(chunk, monkeypatch):
    """Rows whose k-th largest key is at the candidates' edge: tied with a left-out key (the radix
    search must decide, and finds it), or just above every left-out key (the candidates decide)."""
    chunk(64, candidates=4, sub_chunk=4)
    vocab, bs = 256, 6
    logits = torch.randn(bs, 1, vocab, generator=torch.Generator().manual_seed(3)) - 6.0
    logits[:2, 0, [1, 20, 40, 41, 63]] = 3.0  # five tied in chunk 0: the fifth is left out
    logits[2:, 0, [1, 20, 40, 41]] = 3.0  # four in chunk 0, then 2.75 in chunk 1, 2.5 left out of chunk 0
    logits[2:, 0, 63] = 2.5
    logits[2:, 0, 100] = 2.75
    logits = logits.to(BF16)
    top_k = torch.tensor([4, 5, 4, 5, 6, 7])
    params = {"temperature": torch.ones(bs), "top_k": top_k, "top_p": torch.ones(bs)}
    stats, _ = search_buffers(monkeypatch, logits, 1, params)
    expected = logit_keys(logits[:, 0]).sort(-1, descending=True).values.gather(1, top_k[:, None] - 1)[:, 0]
    assert torch.equal(stats.floor.cpu(), expected)
    assert stats.exact.cpu().tolist() == [0, 0, 1, 1, 0, 0]
    stage = random_stage(4, bs, 1, vocab, BF16)
    stage["logits"] = logits
    for top_p in (1.0, 0.3):  # top-p after top-k: its head ends in the tie, or at 2.75
        assert_same(stage, greedy=False, **(params | {"top_p": torch.full((bs,), top_p)}))


# ---------------------------------------------------------------------------------------
# Position-keyed sampling.
# ---------------------------------------------------------------------------------------

KEYED_CASES = [
    # (batch, nodes, V, dtype, chunk, radix bits, tree shape, quantisation levels, candidates per chunk)
    (6, 4, 97, BF16, 32, 4, "random", 0, 4),
    (5, 5, 300, F32, 128, 4, "deep", 0, 32),
    (4, 6, 200, BF16, 64, 4, "chain", 3, 2),  # ties, also at the filters' boundaries
    (3, 4, 300, F16, 128, 4, "wide", 0, 8),
]


@pytest.mark.parametrize("index, case", list(enumerate(KEYED_CASES)),
                         ids=[f"B{c[0]}-T{c[1]}-V{c[2]}-{str(c[3])[6:]}" for c in KEYED_CASES])
def test_keyed_accept_matches_reference(index, case, chunk):
    """The fused keyed stage (filters' floors from the candidates or the radix search, the noise
    hashed in the kernel, the walk over the chunks' maxima) equals keyed_scores + the greedy
    walk; greedy rows are mixed in, and seeds and positions vary per row and node."""
    bs, nodes, vocab, dtype, chunk_v, radix_bits, shape, levels, candidates = case
    chunk(chunk_v, radix_bits, candidates=candidates)
    stage = random_stage(300 + index, bs, nodes, vocab, dtype, shape=shape, levels=levels, oracle=0.0)
    del stage["coins"], stage["final_coins"]
    params = row_params(vocab, bs, index, filter_kinds(vocab))
    rng = np.random.default_rng(index)
    options = dict(greedy_rows=torch.tensor([b % 3 == 1 for b in range(bs)]),
                   seeds=torch.tensor(rng.integers(0, 2**63 - 1, bs), dtype=torch.int64),
                   positions=torch.tensor(rng.integers(1, 5000, (bs, 1)) + np.arange(nodes)[None], dtype=torch.int64),
                   **params)
    options["temperature"] = torch.where(options["greedy_rows"], 1.0, options["temperature"])
    expected = run(fused_accept.tree_accept_keyed_reference, stage, **options)
    actual = run(fused_accept.tree_accept_keyed_triton, stage, **options)
    for name, a, e in zip(("predicts", "accept_index", "accept_num"), actual, expected):
        assert torch.equal(a, e), f"{name} differs:\n{a}\n{e}"


def test_keyed_accept_follows_the_noise_to_long_paths(chunk):
    """Trees whose every child holds its node's keyed sample: the walk accepts whole paths."""
    from ddtree_kernels.keyed_sampling import keyed_sample_reference

    chunk(32, 4)
    bs, nodes, vocab = 3, 6, 70
    stage = random_stage(21, bs, nodes, vocab, F32, shape="chain", oracle=0.0)
    del stage["coins"], stage["final_coins"]
    seeds, temperature = torch.tensor([3, 4, 5]), torch.tensor([0.7, 1.0, 1.4])
    top_k, top_p = torch.tensor([0, 10, 0]), torch.tensor([1.0, 1.0, 0.9])
    positions = torch.arange(nodes)[None].repeat(bs, 1) + 10
    for b in range(bs):  # make each chain node's token the keyed sample after its parent
        for i in range(1, nodes):
            row = stage["logits"][b, i - 1][None]
            stage["tokens"][b, i] = keyed_sample_reference(row, seeds[b:b + 1], positions[b, i - 1:i], temperature[b:b + 1],
                                                           top_k[b:b + 1], top_p[b:b + 1])[0]
    options = dict(greedy_rows=torch.zeros(bs, dtype=torch.bool), seeds=seeds, positions=positions,
                   temperature=temperature, top_k=top_k, top_p=top_p)
    expected = run(fused_accept.tree_accept_keyed_reference, stage, **options)
    actual = run(fused_accept.tree_accept_keyed_triton, stage, **options)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert expected[2].tolist() == [nodes - 1] * bs


# ---------------------------------------------------------------------------------------
# Dispatch and argument checking.
# ---------------------------------------------------------------------------------------


def test_dispatch_follows_device_and_env(monkeypatch, kernel_env):
    calls = []
    for backend in ("reference", "triton"):
        monkeypatch.setattr(fused_accept, f"tree_accept_{backend}", lambda *a, _b=backend, **k: calls.append(_b))
    logits = torch.zeros(1, 2, 3, device=DEVICE)
    for env, want in ((None, "triton" if DEVICE == "cuda" else "reference"), ("reference", "reference"),
                      ("triton", "triton")):
        if env is None:
            kernel_env(BACKEND_ENV, None)
        else:
            kernel_env(BACKEND_ENV, env)
        calls.clear()
        tree_accept(logits, *[None] * 6, greedy=True)
        assert calls == [want]


def bad(stage: dict, **changes) -> dict:
    return {**stage, **changes}


BAD_ARGS = [
    (lambda s: bad(s, logits=s["logits"].to(torch.float64)), {}, "logits must be a 3-D bfloat16"),
    (lambda s: bad(s, logits=s["logits"][:, :0]), {}, "T >= 1"),
    (lambda s: bad(s, tokens=s["tokens"].int()), {}, "tokens must be torch.int64"),
    (lambda s: bad(s, next_sibling=s["next_sibling"][:, :-1].contiguous()), {}, "next_sibling must have shape"),
    (lambda s: bad(s, coins=s["coins"].t().contiguous().t()), {}, "coins must be contiguous"),
    (lambda s: bad(s, final_coins=None), {}, "sampling needs final_coins"),
    (lambda s: s, {"top_k": None}, "sampling needs top_k"),
    (lambda s: s, {"top_p": torch.ones(3, dtype=torch.float64)}, "top_p must be torch.float32"),
    (lambda s: s, {"temperature": torch.ones(2)}, "temperature must have shape"),
]


@pytest.mark.parametrize("impl", [tree_accept_reference, tree_accept_triton])
@pytest.mark.parametrize("corrupt, options, message", BAD_ARGS, ids=[b[2] for b in BAD_ARGS])
def test_bad_arguments_raise(impl, corrupt, options, message):
    stage = corrupt(random_stage(0, 3, 4, 20, F32))
    params = {"temperature": torch.ones(3), "top_k": torch.zeros(3, dtype=torch.int64), "top_p": torch.ones(3),
              **options}
    with pytest.raises(ValueError, match=message):
        run(impl, stage, greedy=False, **params)


def test_bad_outputs_raise():
    stage = random_stage(0, 2, 4, 20, F32)
    args = [stage[k] for k in ("logits", "tokens", "next_token", "next_sibling")]
    good = [torch.zeros(8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    for i, wrong, message in ((0, torch.zeros(8, dtype=torch.int64), "predicts must be torch.int32"),
                              (1, torch.zeros(2, 3, dtype=torch.int32), "accept_index must have shape"),
                              (2, torch.zeros(3, dtype=torch.int32), "accept_num must have shape")):
        outputs = list(good)
        outputs[i] = wrong
        with pytest.raises(ValueError, match=message):
            tree_accept_triton(*args, *outputs, greedy=True)
