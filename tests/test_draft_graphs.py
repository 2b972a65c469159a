"""The drafter's batched draft step (`DFlashProposer`, `drafter_svc.draft_graphs`) on the CPU, float32.

The reference is per session and plain: the draft's hidden states over [all the session's
context features so far; its block] in one pass with concatenated K/V
(`tests.reference.dflash_hidden_reference`), logits = hidden[1:] @ lm_head.T. Sessions get
fresh random features (fixed seeds), different prompt lengths and 0..block_size new rows per
round (0 in the first round after `start`). On CUDA the same static-shape code is captured in
CUDA graphs (tests/gpu/test_draft_graphs_gpu.py, which imports `Player`, the scripts and
`close` from here); here `DraftGraphs(..., capture=False)` runs it eagerly, padded to its
(batch, KV) buckets.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

from common.buckets import auto_kv_buckets
from common.protocol import StatusError
from drafter_svc.__main__ import parse_args
from drafter_svc.draft_graphs import DraftGraphConfig, DraftGraphs, DraftInputs, DraftRow, context_capacity
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.link import LocalLink
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.session import GenerationConfig, GenerationResult
from tests.reference import dflash_hidden_reference
from verifier_svc.tree_verifier import VerifierLimits

MAX_SEQ = 200  # context_capacity(200, 8) = 256 positions per slot
BLOCK = 8  # the tiny drafts' block size
# Small buckets so that selection crosses them: a batch of 1-2 -> 2, 3-4 -> 4 (3 with 3 slots:
# buckets are capped by the slots), 5+ -> eager; contexts ending at <= 32 -> L 48, <= 80 -> 96,
# <= 112 -> 128, past that -> eager (L >= past + block_size new rows + a block).
SMALL = DraftGraphConfig(batch_buckets=(2, 4), kv_buckets=(48, 96, 128))
ROUND_ROWS = [1, 8, 3, 8, 5, 2, 8, 8, 7, 1, 4, 8, 6, 0]  # new rows per round after the first (0)


def _proposer(pair, slots: int = 4, config: DraftGraphConfig | None = None, max_seq: int = MAX_SEQ,
              share: DFlashProposer | None = None) -> DFlashProposer:
    """A CPU proposer (eager, no graphs), or with `config` the static-shape path run eagerly.
    `share`: reuse that proposer's weights (its own pool of slots)."""
    target, draft = pair
    if share is None:
        p = DFlashProposer.from_pretrained(draft, target, max_seq_len=max_seq, slots=slots)
    else:
        p = DFlashProposer(share.draft, share.embed_tokens, share.lm_head, max_seq, slots)
    assert p.graphs is None  # CPU: no CUDA graphs
    if config is not None:
        p.graphs = DraftGraphs(p.draft, p.embed_tokens, p.lm_head, p.pool, p.scratch_slot, config, capture=False)
    return p


def _features(p: DFlashProposer, rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, p.draft.fc.weight.shape[1], generator=torch.Generator().manual_seed(seed))


def _root(p: DFlashProposer, session: int, call: int) -> int:
    return (31 * session + 7 * call + 3) % p.lm_head.shape[0]


def reference_logits(p: DFlashProposer, features: torch.Tensor, root: int) -> torch.Tensor:
    """Block logits [block_size - 1, V] of one session whose context holds `features`."""
    block = [root] + [p.draft.cfg.mask_token_id] * (p.block_size - 1)
    with torch.inference_mode():
        hidden = dflash_hidden_reference(p.draft, p.embed_tokens, features, block)
    return hidden[1:] @ p.lm_head.T


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """max |got - want| <= tol * max |want|, in float32."""
    got, want = got.float(), want.float()
    return (got - want).abs().max().item() <= tol * want.abs().max().item()


class Player:
    """Plays a script of session events on a proposer and records every session's logits.

    Events: ("start", s, prompt_rows), ("finish", s), or ("propose", [(s, k), ...]): one
    `propose` call for those sessions, session s getting its next k feature rows.
    `alone=True` splits every propose into one call per session.
    """

    def __init__(self, proposer: DFlashProposer, streams: dict[int, torch.Tensor], alone: bool = False):
        self.p, self.streams, self.alone = proposer, streams, alone
        self.states, self.pos = {}, {}
        self.calls = 0
        self.records: list[tuple[int, int, int, int, torch.Tensor]] = []  # (call, session, rows, root, logits)
        self.selected: list[tuple[int, int] | None] = []  # the graphs' (B, L) per batched call
        if proposer.graphs is not None:  # record which path each call took
            graphs = proposer.graphs
            graphs.run = lambda rows, verified=None: self._ran(type(graphs).run(graphs, rows, verified))
        self.ran_graphs: list[bool] = []

    def _ran(self, logits):
        self.ran_graphs.append(logits is not None)
        return logits

    def play(self, script) -> "Player":
        for event in script:
            if event[0] == "start":
                _, s, n = event
                self.states[s] = self.p.start(list(range(n)), self.streams[s][:n])
                self.pos[s] = n
                assert self.states[s].length == n
            elif event[0] == "finish":
                self.p.finish(self.states.pop(event[1]))
            elif self.alone:
                for item in event[1]:
                    self._propose([item], self.calls)
                self.calls += 1
            else:
                self._propose(event[1], self.calls)
                self.calls += 1
        return self

    def _propose(self, items, call: int) -> None:
        sessions = [s for s, _ in items]
        new = [self.streams[s][self.pos[s]: self.pos[s] + k] for s, k in items]
        roots = [_root(self.p, s, call) for s in sessions]
        if self.p.graphs is not None:
            self.selected.append(self.p.graphs.select(len(items), max(self.states[s].length for s in sessions)))
        logits = self.p.propose([self.states[s] for s in sessions], roots, [[r] * len(f) for r, f in zip(roots, new)],
                                new)
        assert logits.shape == (len(items), self.p.block_size - 1, self.p.lm_head.shape[0])
        if self.p.graphs is not None:  # the static path ran exactly when a bucket fits
            assert len(self.ran_graphs) == len(self.selected) and self.ran_graphs[-1] == (self.selected[-1] is not None)
        for i, ((s, k), root) in enumerate(zip(items, roots)):
            self.pos[s] += k
            assert self.states[s].length == self.pos[s]
            self.records.append((call, s, self.pos[s], root, logits[i]))

    def by_key(self) -> dict[tuple[int, int], torch.Tensor]:
        return {(call, s): logits for call, s, _, _, logits in self.records}

    def check_reference(self, tol: float = 1e-5) -> None:
        for call, s, rows, root, logits in self.records:
            want = reference_logits(self.p, self.streams[s][:rows], root)
            assert close(logits, want, tol), (call, s, rows, (logits.float() - want.float()).abs().max().item())


def reference_script() -> list:
    """Three sessions of different prompt lengths, every round all of them with different new
    rows; mid-way session 1 finishes and session 3 takes its (used) slot."""
    script = [("start", 0, 20), ("start", 1, 3), ("start", 2, 1), ("propose", [(0, 0), (1, 0), (2, 0)])]
    rows = ROUND_ROWS * 2
    for r in range(len(rows)):
        if r == 12:
            script += [("finish", 1), ("start", 3, 9)]
            script.append(("propose", [(0, rows[r]), (2, rows[(r + 5) % len(rows)]), (3, 0)]))
        elif r < 12:
            script.append(("propose", [(0, rows[r]), (1, rows[(r + 3) % len(rows)]), (2, rows[(r + 5) % len(rows)])]))
        else:
            script.append(("propose", [(0, rows[r]), (2, rows[(r + 5) % len(rows)]), (3, rows[(r + 9) % len(rows)])]))
    return script + [("finish", 0), ("finish", 2), ("finish", 3)]


def feature_streams(p: DFlashProposer, n: int, seed: int = 0) -> dict[int, torch.Tensor]:
    return {s: _features(p, MAX_SEQ, seed + 100 * s) for s in range(n)}


def test_propose_matches_reference(tiny_pair):
    """Batched `propose` (the eager path at the batch's own shape) == the per-session reference."""
    p = _proposer(tiny_pair, slots=3)
    player = Player(p, feature_streams(p, 4)).play(reference_script())
    assert player.calls == 1 + 2 * len(ROUND_ROWS) and len(player.records) == 3 * player.calls
    assert max(player.pos.values()) > 128  # long enough to cross every small bucket below
    player.check_reference()
    assert p.free_slots == 3


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_path_matches_reference(qwen3_pair, backend, kernel_env):
    """The static-shape step (padded to its buckets, run eagerly) == the reference; with
    DDTREE_KERNELS=triton also through the fused Triton kernels the CUDA graphs run (here in
    the Triton interpreter)."""
    kernel_env("DDTREE_KERNELS", backend)
    p = _proposer(qwen3_pair, slots=3, config=SMALL)
    script = reference_script()
    want_used = {(3, 48), (3, 96), (3, 128), None}  # 3 slots: batch buckets (2, 3)
    if backend == "triton":  # the interpreter is slow: five calls that still cross every bucket
        script = [("start", 0, 20), ("start", 1, 3), ("propose", [(0, 0), (1, 0)]),  # (2, 48)
                  ("start", 2, 70), ("propose", [(0, 8), (1, 5), (2, 0)]),  # (3, 96)
                  ("finish", 1), ("start", 3, 105), ("propose", [(3, 0), (2, 8)]),  # (2, 128)
                  ("propose", [(3, 8)]), ("propose", [(3, 8), (0, 3)])]  # (2, 128), eager
        want_used = {(2, 48), (3, 96), (2, 128), None}
    player = Player(p, feature_streams(p, 4, seed=7)).play(script)
    assert set(player.selected) == want_used, player.selected
    player.check_reference()


def batching_script(seed: int = 0) -> list:
    """Five sessions; every call a random subset of 1..5 of them with 0..8 new rows each (0 in a
    session's first call), so batches and contexts cross every small bucket."""
    rng = random.Random(seed)
    prompts = (30, 3, 12, 1, 40)
    script: list = [("start", s, n) for s, n in enumerate(prompts)]
    pos, fresh = list(prompts), set(range(5))
    for _ in range(40):
        subset = sorted(rng.sample(range(5), rng.randint(1, 5)))
        items = []
        for s in subset:
            k = 0 if s in fresh else min(rng.randint(0, BLOCK), MAX_SEQ - BLOCK - pos[s])
            fresh.discard(s)
            pos[s] += k
            items.append((s, k))
        script.append(("propose", items))
    return script


def test_batching_changes_no_output(tiny_pair):
    """The same sessions batched (eagerly at the batch's shape, or padded to a (batch, KV)
    bucket of the static path, or eagerly past the largest ones) == each session alone."""
    script = batching_script()
    first = _proposer(tiny_pair, slots=5)
    alone = Player(first, feature_streams(first, 5, seed=1), alone=True).play(script)
    want = alone.by_key()
    batched = Player(_proposer(tiny_pair, slots=5, share=first), alone.streams).play(script)
    static = Player(_proposer(tiny_pair, slots=5, config=SMALL, share=first), alone.streams).play(script)
    used = set(static.selected)
    assert {b for b, _ in filter(None, used)} == {2, 4} and None in used
    assert {k for _, k in filter(None, used)} == {48, 96, 128}
    assert max(alone.pos.values()) > 112  # some calls fall back to eager for the KV length
    for player in (batched, static):
        got = player.by_key()
        assert got.keys() == want.keys()
        for key, logits in got.items():
            # float32 GEMMs of another shape round differently: a few 1e-6 relative
            assert close(logits, want[key], 1e-5), (key, (logits - want[key]).abs().max().item())
    # Spot-check the common answer against the reference too.
    alone.records = alone.records[::7]
    alone.check_reference()


# ---------------------------------------------------------------------------------------
# Buckets, capacity, config.
# ---------------------------------------------------------------------------------------


def test_capacity_and_config_validation():
    assert context_capacity(2048, 16) == 2176  # 2048 + 2 * 16, rounded up to 128
    assert context_capacity(100, 8) == 128 and context_capacity(MAX_SEQ, BLOCK) == 256
    assert context_capacity(112, 8) == 128 and context_capacity(113, 8) == 256
    DraftGraphConfig().check()
    for bad in (dict(batch_buckets=()), dict(batch_buckets=(0, 2)), dict(kv_buckets=()), dict(kv_buckets=(0,)),
                dict(max_kv_buckets=0), dict(warmup_iters=0)):
        with pytest.raises(ValueError):
            DraftGraphConfig(**bad).check()


def test_select_picks_the_smallest_fitting_bucket(qwen3_pair):
    p = _proposer(qwen3_pair, slots=4, config=SMALL)
    g = p.graphs
    assert p.pool.capacity == 256 and p.pool.num_slots == 5 and p.free_slots == 4
    assert g.batch_buckets == (2, 4) and g.kv_buckets == (48, 96, 128) and g.num_graphs == 0 and not g.capture
    assert g.select(1, 0) == (2, 48)
    assert g.select(2, 32) == (2, 48)  # 32 + 8 new rows + a block of 8 = 48
    assert g.select(2, 33) == (2, 96)
    assert g.select(3, 80) == (4, 96)
    assert g.select(4, 81) == (4, 128)
    assert g.select(4, 112) == (4, 128)
    assert g.select(4, 113) is None  # past the largest KV bucket: eager
    assert g.select(5, 0) is None  # past the largest batch bucket: eager
    # More new rows than the padding holds: no graph (the caller runs the step eagerly).
    slot = p.start([], _features(p, 4, 0)).slot
    assert g.run([DraftRow(slot, 4, 1, _features(p, BLOCK + 1, 1))]) is None
    assert g.run([DraftRow(slot, 4, 1, _features(p, BLOCK, 1))]).shape == (1, BLOCK - 1, p.lm_head.shape[0])

    # Buckets are capped by the slots (the scratch slot excluded) and by the capacity.
    capped = DraftGraphs(p.draft, p.embed_tokens, p.lm_head, p.pool, p.scratch_slot,
                         DraftGraphConfig(batch_buckets=(1, 2, 64), kv_buckets=(48, 10_000)), capture=False)
    assert capped.batch_buckets == (1, 2, 4) and capped.kv_buckets == (48, 256)
    ladder = DraftGraphs(p.draft, p.embed_tokens, p.lm_head, p.pool, p.scratch_slot, capture=False)
    assert ladder.kv_buckets == auto_kv_buckets(256, DraftGraphConfig().max_kv_buckets)
    assert ladder.kv_buckets[-1] == p.pool.capacity and ladder.batch_buckets == (1, 2, 4)
    assert ladder.select(4, MAX_SEQ) == (4, 256)  # a full context still fits the largest bucket
    with pytest.raises(ValueError, match="CUDA"):
        DraftGraphs(p.draft, p.embed_tokens, p.lm_head, p.pool, p.scratch_slot, capture=True)
    with pytest.raises(ValueError):
        DraftGraphs(p.draft, p.embed_tokens, p.lm_head, p.pool, p.scratch_slot, DraftGraphConfig(batch_buckets=()),
                    capture=False)


# ---------------------------------------------------------------------------------------
# Slots.
# ---------------------------------------------------------------------------------------


def test_slots_are_taken_and_given_back(qwen3_pair):
    p = _proposer(qwen3_pair, slots=2)
    f = _features(p, 10, 0)
    assert p.free_slots == 2
    a = p.start([1, 2, 3], f[:3])
    b = p.start([1], f[:1])
    assert p.free_slots == 0 and len({a.slot, b.slot, p.scratch_slot}) == 3  # the scratch slot is never lent
    with pytest.raises(StatusError) as err:
        p.start([1], f[:1])
    assert err.value.status == "RESOURCE_EXHAUSTED" and p.free_slots == 0
    p.finish(a)
    assert p.free_slots == 1
    with pytest.raises(ValueError):
        p.finish(a)  # twice would hand one slot to two sessions
    assert p.free_slots == 1
    c = p.start([1], f[:1])
    assert c.slot == a.slot and p.free_slots == 0
    p.finish(b)
    p.finish(c)
    assert p.free_slots == 2


def test_prompt_too_long_frees_its_slot(qwen3_pair):
    p = _proposer(qwen3_pair, slots=2, config=SMALL)
    with pytest.raises(ValueError, match="max_seq_len"):
        p.start([], _features(p, MAX_SEQ + 1, 0))
    assert p.free_slots == 2
    # A prompt of exactly max_seq_len rows fits; so does its block (positions max_seq_len ..).
    f = _features(p, MAX_SEQ, 1)
    state = p.start([], f)
    logits = p.propose([state], [5], [[]], [f[:0]])
    assert close(logits[0], reference_logits(p, f, 5), 1e-5)
    p.finish(state)
    assert p.free_slots == 2


@pytest.mark.parametrize("max_rows", [8192, 12], ids=["one_call", "split"])
def test_prompts_taken_together_equal_the_reference(qwen3_pair, monkeypatch, max_rows):
    """`take_prompts`: many sessions' prompt chunks (first chunks, which take slots, and next
    ones) go into their contexts in few batched extensions, padded to the longest; each context
    then gives the block of the reference over its rows, as taking them one at a time does. A
    session it cannot take gets its error and keeps no slot; the others are taken."""
    p = _proposer(qwen3_pair, slots=4)
    p.max_prompt_rows = max_rows
    one = _proposer(qwen3_pair, slots=4, share=p)
    calls = []
    extend = p.draft.extend
    monkeypatch.setattr(p.draft, "extend", lambda *args: (calls.append(args[3].shape[:2]), extend(*args))[1])
    feats = [_features(p, 40, seed) for seed in range(3)]
    first, second = [5, 12, 3], [4, 7, 1]
    states = p.take_prompts([None] * 3, [[0] * n for n in first], [f[:n] for f, n in zip(feats, first)])
    assert calls == ([(3, 12)] if max_rows > 12 else [(2, 5), (1, 12)])  # a call takes <= max_rows padded rows
    states = p.take_prompts(states, [[0] * n for n in second],
                            [f[a: a + n] for f, a, n in zip(feats, first, second)])
    assert [s.length for s in states] == [a + b for a, b in zip(first, second)] and p.free_slots == 1
    alone = []
    for f, a, b in zip(feats, first, second):
        alone.append(one.start([0] * a, f[:a]))
        one.extend(alone[-1], [0] * b, f[a: a + b])
    roots = [5, 9, 13]
    got = p.propose(states, roots, [[]] * 3, [feats[0][:0]] * 3)
    want = one.propose(alone, roots, [[]] * 3, [feats[0][:0]] * 3)
    for i, (f, a, b) in enumerate(zip(feats, first, second)):
        assert close(got[i], reference_logits(p, f[: a + b], roots[i]), 1e-5)
        assert close(got[i], want[i], 1e-5)
    # One slot left: the first new session takes it, the second finds none; a chunk past
    # max_seq_len fails its session alone (a new one gives its slot back).
    calls.clear()
    out = p.take_prompts([None, None, states[0]], [[0], [0], [0]],
                         [feats[0][:1], feats[1][:1], _features(p, MAX_SEQ, 7)])
    assert isinstance(out[0], type(states[0])) and out[0].length == 1 and calls == [(1, 1)]
    assert isinstance(out[1], StatusError) and out[1].status == "RESOURCE_EXHAUSTED"
    assert isinstance(out[2], ValueError) and "max_seq_len" in str(out[2]) and states[0].length == first[0] + second[0]
    assert p.free_slots == 0
    p.finish(out[0])
    out = p.take_prompts([None], [[0]], [_features(p, MAX_SEQ + 1, 8)])
    assert isinstance(out[0], ValueError) and p.free_slots == 1
    for state in states:
        p.finish(state)
    assert p.free_slots == 4


def _script_one(rows=(0, 3, 8, 1, 8, 5)) -> list:
    return [("start", 0, 17)] + [("propose", [(0, k)]) for k in rows]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_no_stale_kv_in_a_reused_slot(qwen3_pair, static):
    """A finished session's slot filled with NaN (as if stale or garbage), then taken again:
    the new session's logits equal those of a fresh proposer (the slot is zeroed when taken;
    masked columns must hold finite values since 0 * NaN is NaN)."""
    config = SMALL if static else None
    fresh = _proposer(qwen3_pair, slots=2, config=config)
    streams = feature_streams(fresh, 2, seed=3)
    want = Player(fresh, streams).play(_script_one()).by_key()
    p = _proposer(qwen3_pair, slots=2, config=config, share=fresh)
    Player(p, {0: streams[1]}).play(_script_one((0, 8, 8, 8)) + [("finish", 0)])  # an earlier session
    assert p.free_slots == 2
    p.pool.kv.fill_(float("nan"))  # every slot but the scratch one is free now
    p.pool.kv[p.scratch_slot] = 0
    got = Player(p, streams).play(_script_one()).by_key()
    for key in want:
        assert torch.isfinite(got[key]).all() and torch.equal(got[key], want[key]), key


def test_masked_columns_and_padding_rows_are_ignored(qwen3_pair):
    """Finite garbage in a held slot past what its session has written, and NaN in the scratch
    slot the padding batch rows use, change nothing."""
    fresh = _proposer(qwen3_pair, slots=4, config=SMALL)
    streams = feature_streams(fresh, 3, seed=5)
    script = [("start", 0, 17), ("start", 1, 4), ("start", 2, 30), ("propose", [(0, 0), (1, 0), (2, 0)]),
              ("propose", [(0, 3), (1, 8), (2, 1)]), ("propose", [(0, 8), (2, 5)]), ("propose", [(1, 2)])]
    want = Player(fresh, streams).play(script).by_key()
    p = _proposer(qwen3_pair, slots=4, config=SMALL, share=fresh)
    player = Player(p, streams)
    player.play(script[:3])
    for state in player.states.values():
        unwritten = p.pool.kv[state.slot, ..., state.length:, :]
        unwritten.copy_(1e3 * torch.randn_like(unwritten))
    p.pool.kv[p.scratch_slot] = float("nan")
    got = player.play(script[3:]).by_key()
    assert [b for b, _ in player.selected] == [4, 4, 2, 2]  # batches of 3, 3, 2, 1: padded but one
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("adjacent", [True, False], ids=["one-tensor", "apart"])
def test_fill_puts_each_sessions_rows_first_in_its_batch_row(adjacent):
    """`DraftInputs.fill`: session i's k new feature rows land in rows 0 .. k - 1 of its batch row
    (the rest keep what was there), from a reply's rows handed out as back-to-back slices of one
    tensor or as separate tensors; roots, pasts, new lengths and slots as given, padding after."""
    counts, width, batch, room = [2, 0, 5, 1], 8, 5, 6
    inp = DraftInputs(batch, room, 16, width, mask_token_id=7, dtype=torch.float32, device=torch.device("cpu"),
                      pinned=False)
    inp.features.fill_(-1.0)
    flat = torch.randn(sum(counts), width)
    parts = list(flat.split(counts)) if adjacent else [c.clone() for c in flat.split(counts)]
    rows = [DraftRow(slot=3 + i, past=10 * i, root=100 + i, features=f) for i, f in enumerate(parts)]
    inp.fill(rows, scratch_slot=0)
    for i, (k, f) in enumerate(zip(counts, parts)):
        assert torch.equal(inp.features[i, :k], f)
        assert bool((inp.features[i, k:] == -1.0).all())
    assert bool((inp.features[len(rows):] == -1.0).all())
    assert inp.tokens[:, 0].tolist() == [100, 101, 102, 103, 0] and bool((inp.tokens[:, 1:] == 7).all())
    assert inp.past.tolist() == [0, 10, 20, 30, 0] and inp.new_length.tolist() == [2, 10, 25, 31, 0]
    assert inp.slot.tolist() == [3, 4, 5, 6, 0]
    assert inp.row_index[: sum(counts)].tolist() == [0, 1, 12, 13, 14, 15, 16, 18]


# ---------------------------------------------------------------------------------------
# End to end: greedy generation through the static-shape draft path.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_pair):
    """(engine with the static-shape draft path run eagerly, its plain eager twin, a cache of
    autoregressive outputs) over one verifier."""
    target, draft = tiny_pair
    limits = VerifierLimits(max_sessions=3, max_seq_len=MAX_SEQ)
    plain = LocalEngine.load(str(target), str(draft), limits=limits)
    assert plain.proposer.graphs is None
    static = _proposer(tiny_pair, slots=3, config=SMALL, share=plain.proposer)
    return LocalEngine(plain.verifier, static, plain.tokenizer, plain.eos_token_ids), plain, {}


PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [7, 7, 8]]
LENGTHS = [MAX_SEQ - len(PROMPTS[0]) - 1, 50, 90]  # the first may run to max_seq_len (past the buckets)


@pytest.mark.parametrize("mode", [DraftMode("chain", 0), DraftMode("tree", 4), DraftMode("tree", 16)],
                         ids=lambda m: f"{m.kind}{m.budget}")
def test_greedy_generation_unchanged(engines, mode, monkeypatch):
    """Three requests batched through `LocalEngine.generate_many` (ending at different times,
    so the batch shrinks): static path == plain eager path == autoregressive decoding. Both
    draft most steps behind the verify, from its results as the device holds them."""
    static, plain, ar = engines
    behind = []
    take = DraftInputs._take_verified
    monkeypatch.setattr(DraftInputs, "_take_verified", lambda self, n, v: (behind.append(n), take(self, n, v)))
    if not ar:
        for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
            ar[i] = plain.generate(prompt, GenerationConfig(max_new_tokens=n, mode=DraftMode("ar", 0))).tokens
    requests = [(prompt, GenerationConfig(max_new_tokens=n, mode=mode)) for prompt, n in zip(PROMPTS, LENGTHS)]
    out = static.generate_many(requests)
    before = plain.generate_many(requests)
    for i, (a, b) in enumerate(zip(out, before)):
        assert not isinstance(a, StatusError) and not isinstance(b, StatusError), (a, b)
        assert a.tokens == b.tokens == ar[i]
        assert a.acceptance_lengths == b.acceptance_lengths
    assert static.proposer.free_slots == plain.proposer.free_slots == 3
    # Every round's tree but the last (root-only, no room left) was drafted, and each drafted behind its verify.
    rounds = sum(len(r.acceptance_lengths) for r in out + before)
    assert rounds - 2 * len(PROMPTS) <= sum(behind) <= rounds


class _FailingLink(LocalLink):
    """The in-process link, failing as a whole at its `fail_at`-th message."""

    def __init__(self, verifier, fail_at: int):
        super().__init__(verifier)
        self.fail_at, self.steps = fail_at, 0

    def send(self, entries):
        self.steps += 1
        if self.steps == self.fail_at:
            raise StatusError("UNAVAILABLE", "verifier went away")
        super().send(entries)


def test_sessions_give_their_slot_back(engines):
    """However sessions end (done, cancelled mid-way, or failed with their link), their draft
    slots are free again."""
    static, _, _ = engines
    proposer, verifier = static.proposer, static.verifier

    def run(link, cancel: bool = False) -> list:
        scheduler = DraftScheduler(link, proposer, max_sessions=3, feature_layer_ids=verifier.feature_layer_ids,
                                   eos_token_ids=(), queue_timeout_s=60.0)
        ends: dict[int, object] = {}
        sids: list[int] = []

        def deliver(i: int, item) -> None:  # called on the scheduler's loop, after every submit
            if isinstance(item, (GenerationResult, StatusError)):
                ends[i] = item
            elif cancel and i == 1 and item.round == 2:
                scheduler.cancel(sids[i])

        config = GenerationConfig(max_new_tokens=30, mode=DraftMode("tree", 8))
        for i, prompt in enumerate(PROMPTS):
            sids.append(scheduler.submit(prompt, config, functools.partial(deliver, i)))
        scheduler.run_until_idle()
        link.close()
        assert proposer.free_slots == 3
        return [ends[i] for i in range(len(PROMPTS))]

    done = run(LocalLink(verifier))
    assert [len(r.tokens) for r in done] == [30, 30, 30]
    cancelled = run(LocalLink(verifier), cancel=True)
    assert cancelled[1].finish_reason == "cancelled" and len(cancelled[1].tokens) < 30
    assert [r.tokens for r in cancelled[::2]] == [r.tokens for r in done[::2]]
    failed = run(_FailingLink(verifier, fail_at=4))
    assert all(isinstance(e, StatusError) and e.status == "UNAVAILABLE" for e in failed), failed
    assert run(LocalLink(verifier))[0].tokens == done[0].tokens  # the verifier's sessions were closed too


def test_no_cuda_graphs_flag(monkeypatch):
    args = ["--draft", "d", "--target", "t"]
    monkeypatch.delenv("DRAFTER_NO_CUDA_GRAPHS", raising=False)
    assert parse_args(args).cuda_graphs
    assert not parse_args(args + ["--no-cuda-graphs"]).cuda_graphs
    monkeypatch.setenv("DRAFTER_NO_CUDA_GRAPHS", "1")
    assert not parse_args(args).cuda_graphs
