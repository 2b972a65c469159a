"""Chunked prefill: a prompt sent in chunks over several steps (`DraftScheduler.prefill_chunk`,
the verifier's Extend entries) gives the same K/V, features, first token, trees and output as
the prompt in one piece, alone and batched (float32); every step stays within its chunk of
prompt tokens while the other sessions keep their rounds; bad chunks fail their session only."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from common.protocol import (CloseEntry, Extended, ExtendEntry, OpenEntry, Prefilled, SamplingParams, StatusError,
                             TreeEntry)
from common.tree import DraftTree
from common.wire import notice_results
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.link import LocalLink
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.session import GenerationConfig
from verifier_svc.target_runner import TargetRunner, prefill_mask
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"
PROMPTS = [list(range(40, 77)), [5, 17, 42, 99, 3], list(range(200, 300))]  # 37, 5 and 100 tokens
N = 24


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=4, max_seq_len=256))


@pytest.fixture(scope="module")
def shipped():
    """The trained pair (its trees are accepted, so equal trees show as equal acceptance) and three
    held-out prompts of 40 to 120 tokens."""
    engine = LocalEngine.load(str(SHIPPED / "target"), str(SHIPPED / "draft"),
                              limits=VerifierLimits(max_sessions=4, max_seq_len=512))
    from bench.acceptance import load_prompts

    prompts = [ids for _, ids in load_prompts(SHIPPED / "target", engine.tokenizer, 3, 120)]
    return engine, [p[: 40 + 40 * i] for i, p in enumerate(prompts)]


def run(engine, requests, chunk):
    out = engine.generate_many(requests, prefill_chunk=chunk)
    assert not [o for o in out if isinstance(o, StatusError)], out
    return out


def test_chunked_prefill_equals_one_piece_in_the_runner(tiny_pair):
    """TargetRunner.prefill of a prompt in chunks after the K/V of the ones before: the same
    logits, features and K/V as one piece (float32), rows of different pasts in one call."""
    from verifier_svc.target_model import TargetModel

    model = TargetModel.from_pretrained(tiny_pair[0], (0, 1))
    runner = TargetRunner(model, 3, 256, 17)
    prompts = [torch.tensor(p) for p in PROMPTS]
    whole_logits, whole_features = runner.prefill([0, 1, 2], prompts)
    k_whole = runner.cache.k[:, :3].clone()
    runner.cache.k.zero_()
    cuts = [(0, 20, 37), (0, 5), (0, 33, 34, 100)]  # chunk boundaries of each prompt
    got_features = [[] for _ in prompts]
    got_logits = [None] * 3
    for step in range(3):  # each step takes the next chunk of every prompt that has one
        rows = [i for i, c in enumerate(cuts) if step + 1 < len(c)]
        logits, features = runner.prefill(rows, [prompts[i][cuts[i][step]: cuts[i][step + 1]] for i in rows],
                                          [cuts[i][step] for i in rows])
        for j, i in enumerate(rows):
            got_features[i].append(features[j])
            got_logits[i] = logits[j]
    for i, p in enumerate(prompts):
        n = p.shape[0]
        # float32 rounding: the chunks' GEMMs have other shapes than the whole prompt's
        torch.testing.assert_close(torch.cat(got_features[i]), whole_features[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_logits[i], whole_logits[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runner.cache.k[:, i, :, :n], k_whole[:, i, :, :n], rtol=1e-4, atol=1e-4)


def test_the_prefill_mask_is_causal_over_the_pasts_and_padding_sees_itself():
    """`prefill_mask` (built where the forward runs) against the rule cell by cell, for
    right-aligned chunks of random lengths after random pasts: a chunk token sees the cache
    positions up to its own, a padding column its own position alone."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = int(torch.randint(1, 5, (1,), generator=gen))
        sizes = torch.randint(1, 9, (b,), generator=gen).tolist()
        pasts = torch.randint(0, 12, (b,), generator=gen).tolist()
        t = max(sizes)
        length = max(pasts) + t
        in_prompt = torch.tensor([[c >= t - n for c in range(t)] for n in sizes])
        # chunk column j of row i goes to pasts[i] + (its index in the chunk); padding past the chunk
        cache_pos = torch.tensor([[pasts[i] + (c - (t - n) if c >= t - n else n + c) for c in range(t)]
                                  for i, n in enumerate(sizes)])
        mask = prefill_mask(cache_pos, in_prompt, length)
        assert mask.shape == (b, t, length) and mask.dtype == torch.bool
        for i in range(b):
            for c in range(t):
                pos = int(cache_pos[i, c])
                want = [k <= pos if in_prompt[i, c] else k == pos for k in range(length)]
                assert mask[i, c].tolist() == want, (i, c)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_output_equals_one_piece(engine, chunk):
    """Greedy and seeded sessions of several modes, batched, with prompts longer and shorter
    than the chunk: the tokens and rounds of the unchunked run."""
    configs = [GenerationConfig(N, mode=DraftMode("tree", 8)),
               GenerationConfig(N, SamplingParams(0.9, 20, 0.95, seed=3), mode=DraftMode("tree", 4)),
               GenerationConfig(N, mode=DraftMode("ar", 0))]
    requests = list(zip(PROMPTS, configs))
    want, got = run(engine, requests, 0), run(engine, requests, chunk)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and len(g.tokens) > 1
        assert g.acceptance_lengths == w.acceptance_lengths


def test_the_drafters_trees_are_the_same_whatever_the_chunk(shipped):
    """The draft's context grows chunk by chunk from the features each chunk returns: with the
    trained pair every round accepts what it accepted unchunked, logprobs included."""
    engine, prompts = shipped
    requests = [(p, GenerationConfig(32, mode=DraftMode("tree", 8), logprobs=2)) for p in prompts]
    want = run(engine, requests, 0)
    assert max(max(w.acceptance_lengths) for w in want) > 2
    for chunk in (13, 50):
        for w, g in zip(want, run(engine, requests, chunk)):
            assert g.tokens == w.tokens and g.acceptance_lengths == w.acceptance_lengths
            assert [t.logprob for t in g.logprobs] == pytest.approx([t.logprob for t in w.logprobs], abs=1e-5)


class _Recording(LocalLink):
    """The in-process link, keeping every message's entries."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.messages: list[list] = []

    def send(self, entries):
        self.messages.append(list(entries))
        super().send(entries)


def long_prompt_while_two_decode(engine, link, idle=0) -> dict:
    """Two sessions decode (16- and 5-token prompts) when a 100-token prompt arrives, over `link`
    with 16-token chunks (and `prefill_chunk_idle` = idle); each request's end by position."""
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=engine.verifier.feature_layer_ids,
                               queue_timeout_s=60.0, pipelined=False, prefill_chunk=16, prefill_chunk_idle=idle)
    ends = {}
    for i, prompt in enumerate(PROMPTS[:2]):
        scheduler.submit(prompt[:16], GenerationConfig(60, mode=DraftMode("tree", 4)),
                         lambda item, i=i: ends.__setitem__(i, item))
    for _ in range(3):  # both decoding
        scheduler.step()
    scheduler.submit(PROMPTS[2], GenerationConfig(4, mode=DraftMode("tree", 4)),
                     lambda item: ends.__setitem__(2, item))
    scheduler.run_until_idle()
    return ends


@pytest.mark.parametrize("mix", [True, False])
def test_each_step_stays_within_its_chunk_and_rounds_go_on(engine, mix):
    """Two sessions decode while a 100-token prompt arrives with a 16-token chunk: no message
    carries more than 16 prompt tokens, the long prompt takes several steps (its Open, then
    Extends), and each of those steps still carries a tree for both decoding sessions: in the
    chunk's own message where the verifier takes chunks into the trees' verify (`mix`), else in
    the message right before it (the in-process link then takes a step's prompt chunks in a
    message of their own, right behind its trees)."""
    engine.verifier.mix_prompts = mix
    link = _Recording(engine.verifier)
    try:
        ends = long_prompt_while_two_decode(engine, link)
    finally:
        engine.verifier.mix_prompts = True
    assert all(not isinstance(e, StatusError) for e in ends.values()) and len(ends) == 3
    chunk_messages = [m for m in link.messages if any(isinstance(e, (OpenEntry, ExtendEntry)) and len(e.prompt_ids) > 5
                                                      for e in m)]
    for m in link.messages:
        assert sum(len(e.prompt_ids) for e in m if isinstance(e, (OpenEntry, ExtendEntry))) <= 16
    long_chunks = [e for m in link.messages for e in m if isinstance(e, (OpenEntry, ExtendEntry)) and e.session_id == 3]
    assert [len(e.prompt_ids) for e in long_chunks] == [16] * 6 + [4]
    assert [e.more for e in long_chunks] == [True] * 6 + [False]
    assert isinstance(long_chunks[0], OpenEntry) and all(isinstance(e, ExtendEntry) for e in long_chunks[1:])
    for m in chunk_messages[2:]:  # after both short sessions opened: their rounds go on beside the chunks
        trees = m if mix else link.messages[next(i for i, x in enumerate(link.messages) if x is m) - 1]
        assert {e.session_id for e in trees if isinstance(e, TreeEntry)} == {1, 2}
        assert mix or not any(isinstance(e, TreeEntry) for e in m)
    assert ends[2].tokens == engine.generate(PROMPTS[2], GenerationConfig(4, mode=DraftMode("tree", 4))).tokens


@pytest.fixture()
def verifier(tiny_pair):
    from verifier_svc.target_model import TargetModel

    model = TargetModel.from_pretrained(tiny_pair[0], (0, 1))
    return TreeVerifier(TargetRunner(model, 2, 64, 9), VerifierLimits(max_sessions=2, max_seq_len=64, max_tree_nodes=9))


def outcomes(verifier, entries):
    return [r.outcome if r is not None else None for r in verifier.step([("d", e) for e in entries])]


def test_bad_chunks_fail_their_session_only(verifier):
    greedy = SamplingParams()
    got = outcomes(verifier, [OpenEntry(1, [1, 2, 3], greedy, feature_layer_ids=(0, 1), more=True),
                              OpenEntry(2, [4, 5], greedy, more=True)])
    assert [type(o) for o in got] == [Extended, Extended] and got[0].features.shape[0] == 3
    got = outcomes(verifier, [TreeEntry(1, 1, DraftTree.root_only(3)), ExtendEntry(2, [6], more=True),
                              ExtendEntry(9, [1], more=False)])
    assert got[0].status == "FAILED_PRECONDITION" and "not all prefilled" in got[0].message  # session 1 closed
    assert isinstance(got[1], Extended)
    assert got[2].status == "NOT_FOUND"
    got = outcomes(verifier, [ExtendEntry(2, [7, 10**6])])
    assert got[0].status == "INVALID_ARGUMENT" and "outside the vocabulary" in got[0].message
    assert verifier.free_capacity == 2
    got = outcomes(verifier, [OpenEntry(3, list(range(1, 40)), greedy, more=True)])
    got = outcomes(verifier, [ExtendEntry(3, list(range(1, 30)))])
    assert got[0].status == "INVALID_ARGUMENT" and "does not fit max_seq_len" in got[0].message
    got = outcomes(verifier, [OpenEntry(4, [1, 2], greedy, feature_layer_ids=(0, 1), more=True)])
    got = outcomes(verifier, [ExtendEntry(4, [3], more=False)])
    assert isinstance(got[0], Prefilled) and got[0].features.shape[0] == 1
    got = outcomes(verifier, [ExtendEntry(4, [3]), CloseEntry(4)])
    assert got[0].status == "FAILED_PRECONDITION"  # two entries for one session: both fail
    assert verifier.free_capacity == 2


class _Counting(_Recording):
    """The recording link, also counting the most messages in flight (sent, not yet received)."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.most_in_flight = 0

    def send(self, entries):
        super().send(entries)
        self.most_in_flight = max(self.most_in_flight, self.in_flight)


def lone_prompt(engine, link, ahead, config, chunk=16, idle=0):
    """Run PROMPTS[2] (100 tokens) alone through a scheduler over `link`; its result."""
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=engine.verifier.feature_layer_ids,
                               eos_token_ids=engine.eos_token_ids, queue_timeout_s=60.0, pipelined=False,
                               prefill_chunk=chunk, prefill_ahead=ahead, prefill_chunk_idle=idle)
    ends = {}
    scheduler.submit(PROMPTS[2], config, lambda item: ends.__setitem__(0, item))
    scheduler.run_until_idle()
    return ends[0]


@pytest.mark.parametrize("ahead", [1, 2])
def test_chunks_go_ahead_of_their_replies_while_nothing_decodes(engine, ahead):
    """A lone prompt's chunks go `prefill_ahead` messages ahead of the reply to the earlier ones
    (so the verifier prefills one while the last one's features come back); the tokens, rounds
    and chunks are those of one chunk at a time, and of the prompt in one piece."""
    config = GenerationConfig(N, mode=DraftMode("tree", 8))
    one_at_a_time, ahead_link = _Counting(engine.verifier), _Counting(engine.verifier)
    want = lone_prompt(engine, one_at_a_time, 0, config)
    got = lone_prompt(engine, ahead_link, ahead, config)
    assert one_at_a_time.most_in_flight == 1 and ahead_link.most_in_flight == 1 + ahead
    assert got.tokens == want.tokens == engine.generate(PROMPTS[2], config).tokens
    assert got.acceptance_lengths == want.acceptance_lengths
    chunks = [[len(e.prompt_ids) for e in m if isinstance(e, (OpenEntry, ExtendEntry))] for m in ahead_link.messages]
    assert [c for m in chunks for c in m] == [16] * 6 + [4]
    assert engine.verifier.free_capacity == 4


@pytest.mark.parametrize("idle, sizes", [(128, [100]), (40, [40, 40, 20]), (8, [16] * 6 + [4])])
def test_while_nothing_decodes_a_step_takes_the_idle_budget(engine, idle, sizes):
    """With no session decoding, a lone prompt goes in chunks of `prefill_chunk_idle` where that is
    more than `prefill_chunk` (in one piece when it fits), else of `prefill_chunk`; the tokens and
    rounds are those of the 16-token chunks."""
    config = GenerationConfig(N, mode=DraftMode("tree", 8))
    chunked, link = _Recording(engine.verifier), _Recording(engine.verifier)
    want = lone_prompt(engine, chunked, 1, config)
    got = lone_prompt(engine, link, 1, config, idle=idle)
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
    chunks = [len(e.prompt_ids) for m in link.messages for e in m if isinstance(e, (OpenEntry, ExtendEntry))]
    assert chunks == sizes
    assert engine.verifier.free_capacity == 4


def test_a_prompt_arriving_while_sessions_decode_keeps_the_chunk(engine):
    """The idle budget is for steps when no session decodes: a 100-token prompt that arrives while
    two sessions decode goes in `prefill_chunk` pieces (16 tokens) whatever `prefill_chunk_idle`."""
    link = _Recording(engine.verifier)
    ends = long_prompt_while_two_decode(engine, link, idle=128)
    assert all(not isinstance(e, StatusError) for e in ends.values()) and len(ends) == 3
    long_chunks = [len(e.prompt_ids) for m in link.messages for e in m
                   if isinstance(e, (OpenEntry, ExtendEntry)) and e.session_id == 3]
    assert long_chunks == [16] * 6 + [4]


def test_a_negative_idle_budget_is_refused(engine):
    with pytest.raises(ValueError, match="prefill_chunk_idle"):
        DraftScheduler(_Recording(engine.verifier), engine.proposer, max_sessions=4, prefill_chunk=16,
                       prefill_chunk_idle=-1)


def test_a_refused_open_drops_the_chunk_sent_ahead_and_retries(engine):
    """The verifier is full when a long prompt's Open arrives: the Open is refused and the chunk
    sent ahead of its reply fails (no such session); the session waits, opens again once a slot
    frees, and produces the tokens it produces alone; every slot is free at the end."""
    verifier, config = engine.verifier, GenerationConfig(N, mode=DraftMode("tree", 8))
    others = [("other", OpenEntry(100 + i, [1, 2, 3], SamplingParams())) for i in range(4)]
    assert all(not isinstance(r.outcome, StatusError) for r in verifier.step(others))  # every slot taken
    link = _Counting(verifier)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=verifier.feature_layer_ids,
                               eos_token_ids=engine.eos_token_ids, queue_timeout_s=60.0, pipelined=False,
                               prefill_chunk=16, prefill_ahead=1)
    ends = {}
    scheduler.submit(PROMPTS[2], config, lambda item: ends.__setitem__(0, item))
    for _ in range(4):  # the Open and the chunk ahead of its reply go out; both replies come back
        scheduler.step()
    assert link.most_in_flight == 2 and not ends
    first = [type(e) for e in link.messages[0]] + [type(e) for e in link.messages[1]]
    assert first == [OpenEntry, ExtendEntry]
    assert verifier.close_owner("other") == 4
    scheduler.run_until_idle()
    assert ends[0].tokens == engine.generate(PROMPTS[2], config).tokens
    assert verifier.free_capacity == 4


def test_a_prompt_cancelled_with_chunks_ahead_ends_cleanly(engine):
    """A lone prompt cancelled while chunks of it are in flight (after each step, two were sent
    and the older one answered) ends with finish reason "cancelled" once their replies are in,
    and its verifier slot is closed."""
    link = _Counting(engine.verifier)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=engine.verifier.feature_layer_ids,
                               queue_timeout_s=60.0, pipelined=False, prefill_chunk=16, prefill_ahead=1)
    ends = {}
    sid = scheduler.submit(PROMPTS[2], GenerationConfig(N, mode=DraftMode("tree", 8)),
                           lambda item: ends.__setitem__(0, item))
    scheduler.step()
    scheduler.step()
    assert link.most_in_flight == 2 and link.in_flight == 1
    scheduler.cancel(sid)
    scheduler.run_until_idle()
    assert not isinstance(ends[0], StatusError) and ends[0].finish_reason == "cancelled"
    assert link.in_flight == 0 and engine.verifier.free_capacity == 4


def test_a_stale_reply_does_not_touch_the_session_opened_again(engine):
    """Pipelined (two messages in flight): B's Open is refused (the verifier is full) while its
    next chunk is already on the way; B opens again before that chunk's reply (NOT_FOUND) comes
    back, and the reply, to the earlier admission, must be dropped rather than fail B. Both
    sessions then produce the tokens they produce alone."""
    verifier = engine.verifier
    others = [("other", OpenEntry(100 + i, [1, 2, 3], SamplingParams())) for i in range(3)]
    assert all(not isinstance(r.outcome, StatusError) for r in verifier.step(others))  # one slot left
    link = _Counting(verifier)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=verifier.feature_layer_ids,
                               eos_token_ids=engine.eos_token_ids, queue_timeout_s=60.0, pipelined=True,
                               pipeline_min_sessions=2, prefill_chunk=64, prefill_ahead=1)
    config, ends = GenerationConfig(N, mode=DraftMode("tree", 8)), {}
    for i in (1, 2):  # A: 5 tokens, takes the slot; B: 100 tokens, refused
        scheduler.submit(PROMPTS[i], config, lambda item, i=i: ends.__setitem__(i, item))
    for _ in range(3):
        scheduler.step()
    b_entries = [[type(e).__name__ for e in m if e.session_id == 2] for m in link.messages
                 if any(e.session_id == 2 for e in m)]
    assert b_entries[:3] == [["OpenEntry"], ["ExtendEntry"], ["OpenEntry"]]  # re-opened before the stale reply
    scheduler.run_until_idle()
    assert verifier.close_owner("other") == 3
    for i in (1, 2):
        assert not isinstance(ends[i], StatusError), ends[i]
        assert ends[i].tokens == engine.generate(PROMPTS[i], config).tokens
    assert verifier.free_capacity == 4


class _ShortFeatures(LocalLink):
    """The in-process link, dropping the last feature row of every Prefilled it hands back."""

    def receive(self, on_notice=None):
        results = super().receive(on_notice)
        for r in results:
            if isinstance(r.outcome, Prefilled):
                r.outcome.features = r.outcome.features[:-1]
        return results


def test_bad_prompt_features_fail_the_session_after_its_first_token(engine):
    """The first token goes to the client before the last chunk's features extend the draft
    context; features that do not fit the chunk then fail the session with INTERNAL (after that
    token), and its verifier slot is closed."""
    link = _ShortFeatures(engine.verifier)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=engine.verifier.feature_layer_ids,
                               queue_timeout_s=60.0, pipelined=False, prefill_chunk=16)
    updates = []
    scheduler.submit(PROMPTS[2], GenerationConfig(N, mode=DraftMode("tree", 8)), updates.append)
    scheduler.run_until_idle()
    want = engine.generate(PROMPTS[2], GenerationConfig(N, mode=DraftMode("tree", 8))).tokens
    assert [u.tokens for u in updates[:-1]] == [want[:1]]
    assert isinstance(updates[-1], StatusError) and updates[-1].status == "INTERNAL"
    assert "feature rows" in updates[-1].message
    assert engine.verifier.free_capacity == 4


class _Noticing(LocalLink):
    """The in-process link with the gRPC link's notices: before it returns a reply, the first
    tokens of the prompts the reply completes (with features) go to `on_notice`, the token
    shifted by `shift`; `seen` keeps what the clients had received right after each notice."""

    def __init__(self, verifier, updates: list, shift: int = 0):
        super().__init__(verifier)
        self.updates, self.shift, self.seen = updates, shift, []

    def receive(self, on_notice=None):
        results = super().receive()
        notice = notice_results(results)
        for r in notice:
            r.outcome.token += self.shift
        if notice and on_notice is not None:
            on_notice(notice)
            self.seen.append([getattr(u, "tokens", u) for u in self.updates])
        return results


def noticed_run(engine, config, shift=0, prompt=PROMPTS[2]):
    updates = []
    link = _Noticing(engine.verifier, updates, shift)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4, feature_layer_ids=engine.verifier.feature_layer_ids,
                               eos_token_ids=engine.eos_token_ids, queue_timeout_s=60.0, pipelined=False,
                               prefill_chunk=16)
    scheduler.submit(prompt, config, updates.append)
    scheduler.run_until_idle()
    return link, updates


def test_the_first_token_goes_out_at_its_notice(engine):
    """The client has the first token when the notice comes, before the reply with the prompt's
    features; the output is the same, and the token is not sent twice."""
    config = GenerationConfig(N, mode=DraftMode("tree", 8))
    link, updates = noticed_run(engine, config)
    want = engine.generate(PROMPTS[2], config)
    assert link.seen == [[want.tokens[:1]]]
    assert [t for u in updates[:-1] for t in u.tokens] == want.tokens == updates[-1].tokens
    assert 0 < updates[-1].time_to_first_token_s < updates[-1].elapsed_s
    assert engine.verifier.free_capacity == 4


def test_a_session_its_noticed_first_token_ends_is_closed_after_the_reply(engine):
    """max_new_tokens 1: the notice's token ends the request; it is delivered once, and the
    session ends when the reply comes (its verifier slot closed)."""
    link, updates = noticed_run(engine, GenerationConfig(1, mode=DraftMode("tree", 8)))
    assert link.seen == [[updates[0].tokens]] and len(updates) == 2
    assert updates[-1].tokens == updates[0].tokens and updates[-1].finish_reason == "length"
    assert engine.verifier.free_capacity == 4


def test_a_reply_whose_first_token_differs_from_its_notice_fails_the_session(engine):
    """A verifier whose reply contradicts its notice: the session fails with INTERNAL after the
    noticed token, and its verifier slot is closed."""
    link, updates = noticed_run(engine, GenerationConfig(N, mode=DraftMode("tree", 8)), shift=1)
    assert len(link.seen) == 1 and len(updates) == 2
    assert isinstance(updates[-1], StatusError) and updates[-1].status == "INTERNAL"
    assert "differs from its notice" in updates[-1].message
    assert engine.verifier.free_capacity == 4


@pytest.fixture()
def prompts_apart(engine):
    """The engine's verifier prefilling every chunk on its own (`--no-mixed-prompts`): the
    in-process link then takes a step's prompt chunks in a message of their own."""
    engine.verifier.mix_prompts = False
    yield
    engine.verifier.mix_prompts = True


@pytest.mark.usefixtures("prompts_apart")
def test_a_prompt_sent_apart_has_its_first_token_out_before_its_first_tree(engine):
    """In process a new prompt goes in a message of its own behind the decoding sessions' trees;
    its first token reaches the client when that reply is applied (the trees' next message was
    sent before it), before the message that carries the session's first tree."""
    out = {1: [], 2: [], 3: []}

    class Watching(_Recording):
        seen_at_first_tree = None

        def send(self, entries):
            first_tree = any(isinstance(e, TreeEntry) and e.session_id == 3 for e in entries)
            if self.seen_at_first_tree is None and first_tree:
                self.seen_at_first_tree = [getattr(u, "tokens", None) for u in out[3]]
            super().send(entries)

    link = Watching(engine.verifier)
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=4,
                               feature_layer_ids=engine.verifier.feature_layer_ids,
                               eos_token_ids=engine.eos_token_ids, queue_timeout_s=60.0, pipelined=False)
    config = GenerationConfig(24, mode=DraftMode("tree", 4))
    for sid, prompt in ((1, PROMPTS[0]), (2, PROMPTS[1])):
        scheduler.submit(prompt, config, out[sid].append)
    for _ in range(3):  # both decoding
        scheduler.step()
    scheduler.submit(PROMPTS[2], config, out[3].append)
    scheduler.run_until_idle()
    opens = [m for m in link.messages if any(isinstance(e, OpenEntry) and e.session_id == 3 for e in m)]
    assert len(opens) == 1 and not any(isinstance(e, TreeEntry) for e in opens[0])  # apart from the trees
    want = engine.generate(PROMPTS[2], config).tokens
    assert link.seen_at_first_tree == [want[:1]]
    assert out[3][-1].tokens == want


class _SlowReplies(_Recording):
    """The recording link whose replies to messages of trees take `wait_s` (a device that verifies
    slowly), noting each send and receive in `events`."""

    def __init__(self, verifier, wait_s: float):
        super().__init__(verifier)
        self.wait_s, self.events, self.times = wait_s, [], {}

    def send(self, entries):
        self.events.append(("send", len(self.messages)))
        self.times[self.events[-1]] = time.perf_counter()
        super().send(entries)

    def receive(self, on_notice=None):
        index = len(self.messages) - self.in_flight  # the oldest message in flight
        self.times[("receive", index)] = time.perf_counter()
        if any(isinstance(e, TreeEntry) for e in self.messages[index]):
            time.sleep(self.wait_s)
        self.events.append(("receive", index))
        return super().receive(on_notice)


def run_with_arrivals(engine, link, prompts, *, max_sessions=4, chunk=0, at_s=0.1, config=None):
    """Session 1 decodes over `link` (a `_SlowReplies`) until one slow reply of trees has been read;
    sessions 2, 3, ... (`prompts`) arrive `at_s` into the next one (None: just before it is sent),
    then all run to their ends with quick replies. Returns the prompts and results by session, and
    the index of that next message of trees."""
    scheduler = DraftScheduler(link, engine.proposer, max_sessions=max_sessions,
                               feature_layer_ids=engine.verifier.feature_layer_ids, eos_token_ids=engine.eos_token_ids,
                               queue_timeout_s=60.0, pipelined=False, prefill_chunk=chunk)
    requests, ends = {1: PROMPTS[0][:16]}, {}
    requests.update({sid: p for sid, p in enumerate(prompts, 2)})

    def submit(sids):
        for sid in sids:
            scheduler.submit(requests[sid], config or ARRIVALS_CONFIG,
                             lambda item, sid=sid: ends.__setitem__(sid, item))

    submit([1])
    while not any(isinstance(e, TreeEntry) for m in link.messages[-1:] for e in m):  # until a step sends trees
        scheduler.step()
    while link.in_flight:  # and their slow reply is read: its round trip is known
        scheduler.step()
    during = len(link.messages)  # the trees the next step sends
    if at_s is None:
        submit(range(2, len(requests) + 1))
        scheduler.step()
    else:
        timer = threading.Timer(at_s, submit, (range(2, len(requests) + 1),))
        timer.start()
        scheduler.step()
        timer.join()
    link.wait_s = 0.0
    scheduler.run_until_idle()
    return requests, ends, during


ARRIVALS_CONFIG = GenerationConfig(12, mode=DraftMode("tree", 4))


def arrival_during_a_reply(engine, prompts, chunk, config=ARRIVALS_CONFIG):
    """`run_with_arrivals` over replies of 1 s, each output checked against its session alone;
    returns the link, the first message that opened an arrival, and the message of trees they
    arrived during."""
    link = _SlowReplies(engine.verifier, 1.0)  # the arrivals come 0.1 s in, well before 0.8 s (busy machines)
    requests, ends, during = run_with_arrivals(engine, link, prompts, chunk=chunk, config=config)
    for sid, prompt in requests.items():
        assert ends[sid].tokens == engine.generate(prompt, config).tokens
    assert engine.verifier.free_capacity == 4
    opened = next(i for i, m in enumerate(link.messages)
                  if any(isinstance(e, OpenEntry) and e.session_id > 1 for e in m))
    return link, opened, during


@pytest.mark.usefixtures("prompts_apart")
def test_a_request_arriving_while_a_reply_is_awaited_opens_before_it_is_read(engine):
    """In process, a request that arrives while the host waits for a reply of trees is opened at
    once, in a message of its own sent before that reply is read (its prefill is queued behind
    that verify), not with the next message of trees; the outputs are those of each alone."""
    link, opened, during = arrival_during_a_reply(engine, [PROMPTS[1]], chunk=0)
    assert any(isinstance(e, TreeEntry) for e in link.messages[during])
    assert not any(isinstance(e, TreeEntry) for e in link.messages[opened])
    assert opened == during + 1  # no message of trees went between
    assert link.events.index(("send", opened)) < link.events.index(("receive", during))


def test_a_request_arriving_while_a_reply_is_awaited_joins_the_next_trees(engine):
    """Where the verifier takes prompt chunks into the trees' verify (the default), a request
    that arrives while the host waits for a reply of trees goes in the next message, beside the
    trees, and rides their verify; the outputs are those of each alone."""
    link, opened, during = arrival_during_a_reply(engine, [PROMPTS[1]], chunk=0)
    assert opened == during + 1 and any(isinstance(e, TreeEntry) for e in link.messages[opened])
    assert link.events.index(("send", opened)) > link.events.index(("receive", during))


def test_plain_decodings_arrivals_open_apart_while_prompts_ride_trees(engine):
    """Where the verifier takes prompts into the trees' verify, plain decoding (root-only rows, too
    narrow for a prompt's) still opens an arrival during a reply in a message of its own."""
    link, opened, during = arrival_during_a_reply(engine, [PROMPTS[1]], chunk=0,
                                                  config=GenerationConfig(12, mode=DraftMode("ar")))
    assert engine.verifier.mix_prompts and opened == during + 1
    assert not any(isinstance(e, TreeEntry) for e in link.messages[opened])
    assert link.events.index(("send", opened)) < link.events.index(("receive", during))


@pytest.mark.usefixtures("prompts_apart")
def test_arrivals_stay_within_the_steps_prompt_chunk(engine):
    """Arrivals during a reply open within what their step left of `prefill_chunk`: a 12-token
    and a 5-token prompt under a 16-token chunk open at once, the second with a 4-token chunk
    (the rest follows later); between two messages of trees there are never more than 16
    prompt tokens."""
    link, opened, during = arrival_during_a_reply(engine, [PROMPTS[0][:12], PROMPTS[1]], chunk=16)
    assert link.events.index(("send", opened)) < link.events.index(("receive", during))
    opens = {e.session_id: e for m in link.messages for e in m if isinstance(e, OpenEntry)}
    assert (len(opens[2].prompt_ids), opens[2].more) == (12, False)
    assert (len(opens[3].prompt_ids), opens[3].more) == (4, True)
    stretch = 0
    for m in link.messages:
        if any(isinstance(e, TreeEntry) for e in m):
            stretch = 0
        stretch += sum(len(e.prompt_ids) for e in m if isinstance(e, (OpenEntry, ExtendEntry)))
        assert stretch <= 16


def test_nothing_waits_for_arrivals_while_no_session_could_open(engine):
    """With every session slot taken, the host reads a reply of trees as soon as it has sent the
    next step (an arrival could not open before it anyway); it goes on once the slot is free."""
    link = _SlowReplies(engine.verifier, 1.0)
    _, ends, slow = run_with_arrivals(engine, link, [PROMPTS[1]], max_sessions=1, at_s=None)
    assert link.times[("receive", slow)] - link.times[("send", slow)] < 0.4  # 0.8 s if it waited for arrivals
    assert ends[2].tokens == engine.generate(PROMPTS[1], ARRIVALS_CONFIG).tokens


@pytest.mark.usefixtures("prompts_apart")
def test_a_link_failing_under_an_arrivals_open_fails_the_sessions_cleanly(engine):
    """The link fails on the message that opens an arrival during a reply: every session gets the
    link's status (no internal error, none left waiting), and the scheduler goes on."""

    class Failing(_SlowReplies):
        def send(self, entries):
            if self.in_flight and all(isinstance(e, OpenEntry) for e in entries):
                raise StatusError("UNAVAILABLE", "the verifier went away")
            super().send(entries)

    link = Failing(engine.verifier, 1.0)
    _, ends, _ = run_with_arrivals(engine, link, [PROMPTS[1]])
    link.close()  # the verifier's slots that the dropped replies held
    assert [(e.status, e.message) for e in (ends[1], ends[2])] == [("UNAVAILABLE", "the verifier went away")] * 2
    assert engine.verifier.free_capacity == 4
