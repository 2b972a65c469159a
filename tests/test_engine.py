"""The engine's invariants on tiny random checkpoints: greedy == autoregressive, seeds,
alone and batched with other sessions (the same scheduler and verifier step as the services)."""
import collections
import dataclasses
import time

import pytest

from common.protocol import SamplingParams, TreeEntry
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.session import GenerationConfig
from tests.reference import OracleProposer, hf_greedy
from verifier_svc.tree_verifier import VerifierLimits

PROMPTS = [[5, 17, 42, 99, 3], [300, 12], list(range(60, 100))]
MODES = [DraftMode("ar", 0), DraftMode("chain", 0)] + [DraftMode("tree", b) for b in (0, 1, 4, 16, 64)]
N = 24


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=6, max_seq_len=256))


def greedy(engine, prompt, mode, n=N):
    return engine.generate(prompt, GenerationConfig(max_new_tokens=n, mode=mode))


def test_ar_matches_transformers(engine, tiny_pair):
    for prompt in PROMPTS:
        assert greedy(engine, prompt, DraftMode("ar", 0)).tokens == hf_greedy(tiny_pair[0], prompt, N)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m.kind}{m.budget}")
def test_greedy_equals_ar(engine, mode):
    for prompt in PROMPTS:
        ar = greedy(engine, prompt, DraftMode("ar", 0))
        out = greedy(engine, prompt, mode)
        assert out.tokens == ar.tokens
        assert len(out.tokens) == N and out.finish_reason == "length"
        assert sum(out.acceptance_lengths) + 1 >= N


def _oracle_run(engine, prompt, mode, rank1_every):
    oracle = OracleProposer(engine.verifier.runner.model, block_size=8, rank1_every=rank1_every)
    config = GenerationConfig(max_new_tokens=40, mode=mode)
    return dataclasses.replace(engine, proposer=oracle).generate(prompt, config)


def test_matching_draft_accepts_many_tokens_and_stays_exact(engine):
    prompt = PROMPTS[0]
    ar = greedy(engine, prompt, DraftMode("ar", 0), n=40).tokens
    chain = _oracle_run(engine, prompt, DraftMode("chain", 0), rank1_every=5)
    tree = _oracle_run(engine, prompt, DraftMode("tree", 16), rank1_every=5)
    assert chain.tokens == ar and tree.tokens == ar
    assert tree.mean_acceptance > 3.0, tree.acceptance_lengths
    # Siblings recover the decoy depths that stop the chain.
    assert tree.mean_acceptance > chain.mean_acceptance


def test_same_seed_same_output(engine):
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123)
    config = GenerationConfig(max_new_tokens=N, sampling=sampling, mode=DraftMode("tree", 8))
    a = engine.generate(PROMPTS[0], config)
    b = engine.generate(PROMPTS[0], config)
    assert a.tokens == b.tokens
    other = engine.generate(PROMPTS[0], GenerationConfig(N, SamplingParams(1.0, 50, 0.9, 7), mode=DraftMode("tree", 8)))
    assert other.tokens != a.tokens


def test_sessions_free_their_slots(engine):
    before = engine.verifier.free_capacity
    greedy(engine, PROMPTS[1], DraftMode("tree", 4), n=5)
    assert engine.verifier.free_capacity == before


def test_stop_tokens_end_generation(engine):
    ar = greedy(engine, PROMPTS[0], DraftMode("ar", 0)).tokens
    stop = ar[5]
    first = ar.index(stop)
    out = engine.generate(PROMPTS[0], GenerationConfig(N, stop_token_ids=(stop,), mode=DraftMode("tree", 16)))
    assert out.tokens == ar[: first + 1] and out.finish_reason == "stop"


def test_ignore_eos_generates_past_the_models_end_of_sequence_tokens(engine):
    """With a token the greedy output emits as the model's EOS, a request stops at it (inclusive),
    one with ignore_eos runs to max_new_tokens with plain decoding's tokens, and both do so in one
    batch; an explicit stop token id still stops an ignore_eos request."""
    ar = greedy(engine, PROMPTS[0], DraftMode("ar", 0)).tokens
    eos = ar[5]
    first = ar.index(eos)
    with_eos = dataclasses.replace(engine, eos_token_ids=(eos,))
    tree = DraftMode("tree", 16)
    stops, runs_on, ar_on = with_eos.generate_many([
        (PROMPTS[0], GenerationConfig(N, mode=tree)),
        (PROMPTS[0], GenerationConfig(N, mode=tree, ignore_eos=True)),
        (PROMPTS[0], GenerationConfig(N, mode=DraftMode("ar", 0), ignore_eos=True))])
    assert stops.tokens == ar[: first + 1] and stops.finish_reason == "stop"
    assert runs_on.tokens == ar_on.tokens == ar and runs_on.finish_reason == "length"
    out = with_eos.generate(PROMPTS[0], GenerationConfig(N, stop_token_ids=(eos,), mode=tree, ignore_eos=True))
    assert out.tokens == ar[: first + 1] and out.finish_reason == "stop"


def test_generation_stops_at_kv_capacity(tiny_pair):
    target, draft = tiny_pair
    small = LocalEngine.load(str(target), str(draft), limits=VerifierLimits(max_sessions=1, max_seq_len=16))
    prompt = PROMPTS[0]
    out = small.generate(prompt, GenerationConfig(max_new_tokens=100, mode=DraftMode("tree", 16)))
    ar = small.generate(prompt, GenerationConfig(max_new_tokens=100, mode=DraftMode("ar", 0)))
    assert out.tokens == ar.tokens
    assert out.finish_reason == "length" and len(prompt) + len(out.tokens) == 16 + 1


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)


def test_batched_sessions_equal_their_one_session_twins(engine):
    """Greedy sessions of every mode, batched with each other and with sampled ones, give
    exactly their tokens alone (== autoregressive); seeded sampled ones their tokens alone."""
    requests = [(PROMPTS[i % len(PROMPTS)], GenerationConfig(N, mode=mode)) for i, mode in enumerate(MODES)]
    requests += [(p, GenerationConfig(N, sampling=SAMPLED, mode=DraftMode("tree", 8))) for p in PROMPTS]
    batched = engine.generate_many(requests)
    for (prompt, config), out in zip(requests, batched):
        alone = engine.generate(prompt, config)
        assert out.tokens == alone.tokens, (prompt, config.mode, config.sampling)
        if config.sampling.greedy:
            assert out.tokens == greedy(engine, prompt, DraftMode("ar", 0)).tokens
    assert engine.verifier.free_capacity == engine.verifier.limits.max_sessions
    assert engine.proposer.free_slots == engine.verifier.limits.max_sessions


def test_more_requests_than_slots_queue_and_complete(engine):
    """Twice as many requests as KV slots: the rest wait for free slots, outputs unchanged."""
    limit = engine.verifier.limits.max_sessions
    requests = [(PROMPTS[i % len(PROMPTS)] + [i], GenerationConfig(8, mode=DraftMode("tree", 4)))
                for i in range(2 * limit)]
    batched = engine.generate_many(requests)
    for (prompt, config), out in zip(requests, batched):
        assert out.tokens == greedy(engine, prompt, DraftMode("ar", 0), n=8).tokens
    assert engine.verifier.free_capacity == limit


@pytest.mark.parametrize("groups", [2, 3])
def test_pipelined_rounds_change_no_output(engine, groups):
    """Pipelined (`groups` link messages in flight, that share of the sessions each, new sessions
    joining as others end) gives every session exactly its lockstep tokens, greedy and seeded,
    and has `groups` messages of trees in flight at a time (prompt chunks go apart, behind
    them); capacity comes back in full."""
    from drafter_svc.link import LocalLink

    class CountingLink(LocalLink):
        most = 0
        trees = collections.deque()  # whether each message in flight carries trees

        def send(self, entries):
            super().send(entries)
            self.trees.append(any(isinstance(e, TreeEntry) for e in entries))
            self.most = max(self.most, sum(self.trees))

        def receive(self, on_notice=None):
            self.trees.popleft()
            return super().receive(on_notice)

    requests = [(PROMPTS[i % len(PROMPTS)] + [i], GenerationConfig(N - 2 * (i % 4), mode=mode))
                for i, mode in enumerate(MODES + MODES[2:])]
    requests += [(p, GenerationConfig(N, sampling=SAMPLED, mode=DraftMode("tree", 8))) for p in PROMPTS]
    lockstep = engine.generate_many(requests)
    link = CountingLink(engine.verifier)
    scheduler = _scheduler(engine, engine.proposer, pipelined=True, pipeline_groups=groups)
    scheduler.link = link
    ends = _ends(scheduler, requests)
    scheduler.run_until_idle()
    for (prompt, config), end, alone in zip(requests, ends, lockstep):
        assert end["items"][-1].tokens == alone.tokens, (prompt, config.mode, config.sampling)
    assert link.most == groups
    assert engine.verifier.free_capacity == engine.verifier.limits.max_sessions
    assert engine.proposer.free_slots == engine.verifier.limits.max_sessions


@pytest.mark.parametrize("min_sessions, kind, plain_from, most", [
    (4, "tree", 16, 2), (5, "tree", 16, 1), (64, "ar", 4, 2), (64, "tree", 4, 1), (3, "ar", 5, 2)])
def test_pipelining_starts_from_its_session_count(engine, monkeypatch, min_sessions, kind, plain_from, most):
    """`pipeline_min_sessions` (the drafter on the verifier's own GPU): with 4 sessions, rounds
    are pipelined from 4 (two messages in flight) and stay in lockstep from 5 (one), with the
    same tokens either way; while no session drafts (plain decoding), a threshold above
    PLAIN_PIPELINE_SESSIONS gives way to it."""
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler

    monkeypatch.setattr(DraftScheduler, "PLAIN_PIPELINE_SESSIONS", plain_from)

    class CountingLink(LocalLink):
        most = 0

        def send(self, entries):
            super().send(entries)
            self.most = max(self.most, self.in_flight)

    mode = DraftMode("tree", 8) if kind == "tree" else DraftMode("ar", 0)
    requests = [(PROMPTS[i % len(PROMPTS)] + [i], GenerationConfig(N, mode=mode)) for i in range(4)]
    lockstep = engine.generate_many(requests)
    link = CountingLink(engine.verifier)
    scheduler = _scheduler(engine, engine.proposer, pipelined=True, pipeline_min_sessions=min_sessions)
    scheduler.link = link
    ends = _ends(scheduler, requests)
    scheduler.run_until_idle()
    assert [end["items"][-1].tokens for end in ends] == [alone.tokens for alone in lockstep]
    assert link.most == most


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_adaptive_budget_observes_what_a_step_costs_the_pipeline(engine, pipelined):
    """The planner is given what a step costs: in lockstep its round trip; pipelined (two
    messages of trees in flight) the time since the previous reply, about half a message's
    round trip, which holds the other message's verify too (the link waits 40 ms a reply).
    Its choices and calibration reach the metrics."""
    from prometheus_client import REGISTRY

    from drafter_svc.budget import BudgetPlanner
    from drafter_svc.link import LocalLink

    class PacedLink(LocalLink):
        sent = collections.deque()
        trips = []  # each message of trees: its send to its reply

        def send(self, entries):
            super().send(entries)
            self.sent.append(time.perf_counter() if any(isinstance(e, TreeEntry) for e in entries) else None)

        def receive(self, on_notice=None):
            time.sleep(0.04)
            results = super().receive(on_notice)
            if (sent := self.sent.popleft()) is not None:
                self.trips.append(time.perf_counter() - sent)
            return results

    planner = BudgetPlanner({(b, t): 1e-4 for b in (1, 2, 4) for t in (1, 8, 16)})
    observed = []
    observe = planner.observe
    planner.observe = lambda choice, step_s, accepted: observed.append(step_s) or observe(choice, step_s, accepted)
    requests = [(PROMPTS[i % len(PROMPTS)] + [i], GenerationConfig(N, mode=DraftMode("tree", 8))) for i in range(4)]
    scheduler = _scheduler(engine, engine.proposer, pipelined=pipelined, planner=planner)
    scheduler.link = link = PacedLink(engine.verifier)
    chosen = REGISTRY.get_sample_value("ddtree_drafter_tree_budget_count") or 0.0
    ends = _ends(scheduler, requests)
    scheduler.run_until_idle()
    assert all(len(end["items"][-1].tokens) == N for end in ends)
    assert len(observed) >= 8 and len(link.trips) >= 8
    # Its choices and calibration are exported (/metrics): one choice a message it planned.
    assert REGISTRY.get_sample_value("ddtree_drafter_tree_budget_count") - chosen == len(observed)
    assert REGISTRY.get_sample_value("ddtree_drafter_budget_calibration") == planner.alpha

    def median(values):
        return sorted(values)[len(values) // 2]

    ratio = median(observed[2:-2]) / median(link.trips[2:-2])
    assert ratio < 0.8 if pipelined else ratio >= 1.0


def test_sessions_recover_from_a_lost_verifier_link(engine):
    """The link fails twice mid-generation (UNAVAILABLE; the verifier drops the link's sessions):
    every session re-opens with its prompt plus the tokens so far and ends with exactly its
    undisturbed greedy tokens; slots and capacity come back in full."""
    from common.protocol import StatusError
    from drafter_svc.link import LocalLink

    class FlakyLink(LocalLink):
        sends = 0

        def send(self, entries):
            self.sends += 1
            if self.sends in (4, 9):
                self.close()  # what a dead link does: its sessions and replies are gone
                raise StatusError("UNAVAILABLE", "verifier went away")
            super().send(entries)

    requests = [(PROMPTS[i % len(PROMPTS)] + [i], GenerationConfig(N, mode=mode))
                for i, mode in enumerate([DraftMode("tree", 16), DraftMode("chain", 0), DraftMode("ar", 0),
                                          DraftMode("tree", 4)])]
    undisturbed = engine.generate_many(requests)
    link = FlakyLink(engine.verifier)
    scheduler = _scheduler(engine, engine.proposer, recovery_timeout_s=30.0)
    scheduler.link = link
    ends = _ends(scheduler, requests)
    scheduler.run_until_idle()
    assert link.sends > 9
    for end, alone in zip(ends, undisturbed):
        assert end["items"][-1].tokens == alone.tokens
    assert engine.verifier.free_capacity == engine.verifier.limits.max_sessions
    assert engine.proposer.free_slots == engine.verifier.limits.max_sessions


def test_a_request_waits_for_a_verifier_one_recovery_timeout_from_its_arrival(engine):
    """A request that has had no token counts its wait for a verifier from its arrival, its time
    in the queue included (it used to get a fresh --recovery-timeout at its first failed open), and
    its error says how long it waited."""
    import time

    from common.protocol import StatusError
    from drafter_svc.link import LocalLink

    class DeadLink(LocalLink):
        def send(self, entries):
            raise StatusError("UNAVAILABLE", "verifier went away")

    scheduler = _scheduler(engine, engine.proposer, recovery_timeout_s=5.0)
    scheduler.link = DeadLink(engine.verifier)
    waited, fresh = _ends(scheduler, [(PROMPTS[0], GenerationConfig(8)), (PROMPTS[1], GenerationConfig(8))])
    scheduler._take_commands()
    scheduler._waiting[0].arrived -= 12.0  # as if it had waited 12 s in the queue
    scheduler._waiting[1].arrived -= 4.8  # 0.2 s of its 5 left
    started = time.monotonic()
    scheduler.run_until_idle()
    for end, seconds in ((waited, 12), (fresh, 5)):
        error = end["items"][-1]
        assert isinstance(error, StatusError) and error.status == "UNAVAILABLE", error
        assert error.message.startswith(f"verifier unavailable for {seconds} s"), error.message
        assert error.message.endswith(": verifier went away"), error.message  # what the loss said
    assert 0.15 < time.monotonic() - started < 3.0
    assert engine.proposer.free_slots == engine.verifier.limits.max_sessions


def test_a_request_whose_opens_failed_counts_one_queue_wait_and_its_first_token(engine):
    """Opens lost with the verifier are retried; the request's queue wait is observed once (to the
    admission whose open brought its first token), not at every retry, and its time to first
    token is kept."""
    from prometheus_client import REGISTRY

    from common.protocol import StatusError
    from drafter_svc.link import LocalLink

    class FailingFirst(LocalLink):
        sends = 0

        def send(self, entries):
            self.sends += 1
            if self.sends <= 3:
                raise StatusError("UNAVAILABLE", "verifier went away")
            super().send(entries)

    def waits() -> float:
        return REGISTRY.get_sample_value("ddtree_drafter_queue_wait_seconds_count") or 0.0

    requests = [(PROMPTS[0], GenerationConfig(8))]
    alone = engine.generate_many(requests)
    scheduler = _scheduler(engine, engine.proposer, recovery_timeout_s=30.0)
    scheduler.link = FailingFirst(engine.verifier)
    before = waits()
    (end,) = _ends(scheduler, requests)
    scheduler.run_until_idle()
    result = end["items"][-1]
    assert scheduler.link.sends > 3 and result.tokens == alone[0].tokens
    assert waits() - before == 1 and result.time_to_first_token_s > 0


def _scheduler(engine, proposer, **kwargs):
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler

    return DraftScheduler(LocalLink(engine.verifier), proposer, max_sessions=engine.verifier.limits.max_sessions,
                          feature_layer_ids=engine.verifier.feature_layer_ids, **kwargs)


def _ends(scheduler, requests):
    ends = [{} for _ in requests]
    for end, (prompt, config) in zip(ends, requests):
        scheduler.submit(prompt, config, lambda item, end=end: end.setdefault("items", []).append(item))
    return ends


def test_a_failing_draft_step_fails_its_sessions_and_frees_their_slots(engine):
    """A bug in a step (here the draft forward raising) fails that step's sessions with INTERNAL;
    the scheduler still closes them on the verifier, so its capacity comes back."""
    import time

    from common.protocol import StatusError

    class Broken(OracleProposer):
        def propose(self, *args):
            raise RuntimeError("boom")

    scheduler = _scheduler(engine, Broken(engine.verifier.runner.model, block_size=8))
    ends = _ends(scheduler, [(p, GenerationConfig(8, mode=DraftMode("tree", 4))) for p in PROMPTS])
    scheduler.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (all("items" in e and isinstance(e["items"][-1], StatusError)
                                                       for e in ends)
                                                   and engine.verifier.free_capacity == engine.verifier.limits.max_sessions):
            time.sleep(0.02)
    finally:
        scheduler.stop()
    assert all(e["items"][-1].status == "INTERNAL" for e in ends)
    assert engine.verifier.free_capacity == engine.verifier.limits.max_sessions


@pytest.mark.parametrize("accept_prob", [0.0, 0.7, 1.0])
def test_controlled_acceptance_sets_tau_and_keeps_outputs(engine, accept_prob):
    """The benchmark-only oracle: the real draft runs, then its trees hold the target's greedy
    continuation up to a random depth (each depth with `accept_prob`). Outputs stay exactly AR;
    tau is 1 at p = 0, block_size at p = 1, in between otherwise."""
    from drafter_svc.oracle import ControlledAcceptance

    n = 40
    ar = {tuple(p): greedy(engine, p, DraftMode("ar", 0), n=n).tokens for p in PROMPTS}
    hook = ControlledAcceptance(accept_prob, ar, seed=3)
    scheduler = _scheduler(engine, engine.proposer, logits_hook=hook)
    ends = _ends(scheduler, [(p, GenerationConfig(n, mode=DraftMode("tree", 16))) for p in PROMPTS])
    scheduler.run_until_idle()
    results = [e["items"][-1] for e in ends]
    assert [r.tokens for r in results] == [ar[tuple(p)] for p in PROMPTS]
    block = engine.proposer.block_size
    full = [a for r in results for a in r.acceptance_lengths[:-1]]  # the last round is cut by the length limit
    tau = sum(full) / len(full)
    if accept_prob == 0.0:
        assert tau == 1.0
    elif accept_prob == 1.0:
        assert tau == block
    else:
        assert 1.5 < tau < block - 1


@pytest.mark.parametrize("watches_text", [False, True])
def test_round_deliveries_wait_for_the_next_draft_step_unless_the_receiver_watches_text(engine, watches_text):
    """A running session's tokens reach its receiver once the next draft step is queued (while the
    device drafts); its last round and result right away, in order. A receiver that may end the
    session (stop strings) gets every round before the next draft; the outputs are the same."""
    from drafter_svc.session import GenerationResult, RoundUpdate

    events = []

    class Recording(OracleProposer):
        def propose(self, *args):
            events.append("draft")
            return super().propose(*args)

    scheduler = _scheduler(engine, Recording(engine.verifier.runner.model, block_size=8, rank1_every=3))
    items = []

    def deliver(item):
        items.append(item)
        events.append("result" if isinstance(item, GenerationResult) else f"round {item.round}")

    scheduler.submit(PROMPTS[0], GenerationConfig(30, mode=DraftMode("tree", 8)), deliver, watches_text=watches_text)
    scheduler.run_until_idle()
    rounds = [item.round for item in items if isinstance(item, RoundUpdate)]
    assert rounds == list(range(len(rounds))) and isinstance(items[-1], GenerationResult)
    assert [t for item in items[:-1] for t in item.tokens] == items[-1].tokens
    assert items[-1].tokens == greedy(engine, PROMPTS[0], DraftMode("ar", 0), n=30).tokens
    drafts = [i for i, e in enumerate(events) if e == "draft"]  # the last rounds, with no room left, draft nothing
    assert len(drafts) > 4
    for r in range(1, min(len(rounds) - 1, len(drafts))):  # round r comes with draft r (0-based): after it if batched
        at = events.index(f"round {r}")
        assert (at == drafts[r] - 1) if watches_text else (at == drafts[r] + 1), (r, events)
    assert events[-2:] == [f"round {rounds[-1]}", "result"]


def test_a_receiver_that_ends_a_batched_session_stops_it_after_the_round_in_flight(engine):
    """Without `watches_text` a round's tokens reach the receiver after the next round is sent;
    if it answers True ("stop") the session ends then: that round's tokens are dropped, the result
    holds the tokens up to the round it stopped at, and its slots come back."""
    from drafter_svc.session import GenerationResult, RoundUpdate

    scheduler = _scheduler(engine, OracleProposer(engine.verifier.runner.model, block_size=8, rank1_every=3))
    items = []

    def deliver(item):
        items.append(item)
        return isinstance(item, RoundUpdate) and item.round == 2

    scheduler.submit(PROMPTS[0], GenerationConfig(40, mode=DraftMode("tree", 8)), deliver)
    scheduler.run_until_idle()
    result = items[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "stop"
    assert [item.round for item in items[:-1]] == [0, 1, 2]
    assert result.tokens == [t for item in items[:-1] for t in item.tokens]
    assert result.tokens == greedy(engine, PROMPTS[0], DraftMode("ar", 0), n=40).tokens[:len(result.tokens)]
    assert len(result.acceptance_lengths) == 3  # rounds 1 and 2, and the one in flight when it stopped
    assert engine.verifier.free_capacity == engine.verifier.limits.max_sessions


def test_the_prompts_of_a_reply_go_into_the_draft_contexts_together(engine, monkeypatch):
    """The prompts one reply prefills extend their draft contexts in one batched call
    (`DraftScheduler._grow_contexts`); the outputs are plain decoding's."""
    from drafter_svc.drafter import DFlashProposer

    ar = [greedy(engine, p, DraftMode("ar", 0)).tokens for p in PROMPTS]
    calls = []
    take = DFlashProposer.take_prompts
    monkeypatch.setattr(DFlashProposer, "take_prompts", lambda self, *args: (calls.append(len(args[0])),
                                                                             take(self, *args))[1])
    out = engine.generate_many([(p, GenerationConfig(N, mode=DraftMode("tree", 6))) for p in PROMPTS])
    assert [o.tokens for o in out] == ar and calls == [len(PROMPTS)]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("where", ["behind_verify", "after_reply"])
def test_drafting_ahead_of_a_reply_gives_the_trees_of_drafting_after_it(engine, monkeypatch, pipelined, where):
    """The next draft step is queued before the reply is applied: with the verifier in process,
    right behind the verify, from its results on the device (`DraftScheduler._draft_behind`);
    otherwise as soon as the reply comes (`DraftScheduler._draft_ahead`); a session's first one
    as soon as its context holds the prompt (`DraftScheduler._draft_started`). The trees sent,
    and so the outputs, are those of drafting when the next message is built: each session gets
    its own rows, and its new feature rows enter its context once, also when the rows drafted
    ahead go unused (drafted again, from the context as it is)."""
    from common.protocol import TreeEntry, Verified
    from common.tree import DeviceTree
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler, _DraftAhead

    behind = where == "behind_verify"
    original = DraftScheduler._confirm_behind if behind else DraftScheduler._draft_ahead

    draft_started, block = DraftScheduler._draft_started, DraftScheduler._block

    def run(ahead: bool):
        sent, drafted, started, fresh = [], [], [], []

        class Recording(LocalLink):
            def send(self, entries):
                trees = [(e.session_id, e.tree.on_host() if isinstance(e.tree, DeviceTree) else e.tree)
                         for e in entries if isinstance(e, TreeEntry)]
                sent.append([(sid, t.tokens.tolist(), t.next_token.tolist(), t.next_sibling.tolist())
                             for sid, t in trees])
                super().send(entries)

        if not behind:
            Recording.verified_on_device = lambda self: None

        def counted(self, *args):
            results = args[-2]
            picked = original(self, *args)
            drafted.append((len(picked), sum(isinstance(r.outcome, Verified) for r in results)))
            return picked

        def counted_start(self):
            blocks = len(self._ahead)
            draft_started(self)
            started.extend(len(a.rows) for a in self._ahead[blocks:])

        monkeypatch.setattr(DraftScheduler, "_confirm_behind" if behind else "_draft_ahead", counted)
        def counted_block(self, sessions, blocks):
            fresh.append(sum(all(a.row(s) is None for a in blocks) for s in sessions))
            return block(self, sessions, blocks)

        monkeypatch.setattr(DraftScheduler, "_draft_started", counted_start)
        monkeypatch.setattr(DraftScheduler, "_block", counted_block)
        if not ahead:
            monkeypatch.setattr(DraftScheduler, "_draft_behind", lambda self, sessions: None)
            monkeypatch.setattr(DraftScheduler, "_draft_ahead", lambda self, results, epochs: frozenset())
            monkeypatch.setattr(DraftScheduler, "_draft_started", lambda self: self._started.clear())
        scheduler = DraftScheduler(Recording(engine.verifier), engine.proposer,
                                   max_sessions=engine.verifier.limits.max_sessions,
                                   feature_layer_ids=engine.verifier.feature_layer_ids, pipelined=pipelined)
        ends = _ends(scheduler, [(p, GenerationConfig(N, mode=DraftMode("tree", 6))) for p in PROMPTS])
        scheduler.run_until_idle()
        monkeypatch.undo()
        return [e["items"][-1].tokens for e in ends], sent, drafted, started, fresh

    tokens, sent, drafted, started, fresh = run(ahead=True)
    late_tokens, late_sent, late_drafted, late_started, late_fresh = run(ahead=False)
    assert sum(started) == len(PROMPTS) and not late_started  # every session's first tree drafted at its start
    assert sum(late_fresh) > 2 * len(PROMPTS) and (pipelined or sum(fresh) == 0)  # in lockstep all drafted ahead
    assert tokens == late_tokens == [greedy(engine, p, DraftMode("ar", 0)).tokens for p in PROMPTS]
    assert sum(len(trees) for trees in sent) > 2 * len(PROMPTS) and sent == late_sent and not late_drafted
    monkeypatch.setattr(_DraftAhead, "row", lambda self, s: None)  # every row drafted ahead goes unused
    assert run(ahead=True)[:2] == (tokens, sent)
    verified = [n for _, n in drafted if n]
    assert len(verified) > 2 * (2 if pipelined else 1) and all(n == len(PROMPTS) for n in verified[:4]) != pipelined
    if behind:  # every session a reply verified was drafted behind its verify, but for a root-only last tree
        assert sum(n - picked for picked, n in drafted) <= len(PROMPTS), drafted
    else:  # every session a reply verified was drafted ahead, but in the last rounds (no room left)
        assert sum(1 for picked, n in drafted if n and picked == n) >= len(verified) - 2 * len(PROMPTS), drafted
    assert engine.proposer.free_slots == engine.verifier.limits.max_sessions


def test_a_run_that_fails_frees_its_sessions_for_the_next(engine, monkeypatch):
    """A bug mid-run (a step that raises) reaches the caller, and the verifier frees the run's
    sessions: the next run is served, and gives the same tokens as before."""
    from drafter_svc.scheduler import DraftScheduler

    want = greedy(engine, PROMPTS[2], DraftMode("tree", 4)).tokens
    step, calls = DraftScheduler.step, []

    def failing(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug")
        return step(self)

    monkeypatch.setattr(DraftScheduler, "step", failing)
    config = GenerationConfig(max_new_tokens=N, mode=DraftMode("tree", 4))
    with pytest.raises(RuntimeError, match="a bug"):
        engine.generate_many([(p, config) for p in PROMPTS])
    monkeypatch.setattr(DraftScheduler, "step", step)
    assert not engine.verifier._sessions
    assert greedy(engine, PROMPTS[2], DraftMode("tree", 4)).tokens == want
