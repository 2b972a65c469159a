"""Verifier replicas (drafter_svc.replicas): routing, failover of only the lost replica's sessions,
re-probing, the --verifier address list; the scheduler over two in-process verifiers; and both
services with two verifiers, one killed mid-generation."""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time

import grpc
import pytest
import torch

from common.protocol import CloseEntry, ExtendEntry, LinkLost, OpenEntry, Prefilled, SamplingParams, StatusError, StepResult, \
    TreeEntry, Verified
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tls import ChannelTls
from common.tree import DraftTree
from drafter_svc.drafter import DraftMode
from drafter_svc.generate import LocalEngine
from drafter_svc.link import LocalLink
from drafter_svc import replicas
from drafter_svc.replicas import Replica, ReplicaLink, State, check_replica, verifier_addresses
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.server import serve as serve_drafter
from drafter_svc.session import GenerationConfig, GenerationResult
from tests.servers import ServerThread
from tests.test_e2e import MAX_SESSIONS, PROMPTS, _verifier_process, drafter_engine, request, verifier_config, wait_full
from verifier_svc.server import serve as serve_verifier
from verifier_svc.tree_verifier import VerifierLimits

FAST = (0.01, 0.05)  # probe backoff of the unit tests


# -- ReplicaLink over fake links --------------------------------------------------------------------


class FakeLink:
    """Answers every open (Prefilled) and tree (Verified) of a message when it is received;
    `fail` makes the next receive raise it, as a broken stream does."""

    def __init__(self):
        self.sent: list[list] = []
        self.pending: collections.deque = collections.deque()
        self.fail: StatusError | None = None
        self.verifier_step_s = self.link_s = 0.0
        self.closed = 0
        self.answers = True
        self.refuse_opens: StatusError | None = None  # each open's result while set (a draining verifier's)

    def send(self, entries):
        self.sent.append(list(entries))
        self.pending.append(list(entries))

    def receive(self, on_notice=None):
        entries = self.pending.popleft()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.verifier_step_s = 0.01 * len(entries)
        opened = self.refuse_opens or Prefilled(1, torch.zeros(1, 2), 64)
        return [StepResult(e.session_id, opened if isinstance(e, OpenEntry)
                           else Verified([], 2, torch.zeros(1, 2), e.round))
                for e in entries if not isinstance(e, CloseEntry)]

    def probe(self):
        return self.answers

    def close(self):
        self.closed += 1
        self.pending.clear()  # a closed stream's replies are gone


class FakeVerifier:
    """A replica's Info: raises while `down`."""

    def __init__(self, max_sessions=4, down=False):
        self.max_sessions, self.down, self.asked = max_sessions, down, 0
        self.draining = False

    def __call__(self):
        self.asked += 1
        if self.down:
            raise StatusError("UNAVAILABLE", "down")
        return pb.InfoResponse(max_sessions=self.max_sessions, draining=self.draining)


def replica_set(*sizes, up=True, check=lambda info: None):
    """A ReplicaLink over FakeLinks ("a", "b", ...), all UP (or all NEW and down)."""
    links = [FakeLink() for _ in sizes]
    infos = [FakeVerifier(n, down=not up) for n in sizes]
    replicas = [Replica("abcdef"[i], link, info, State.UP if up else State.NEW, n if up else 0)
                for i, (link, info, n) in enumerate(zip(links, infos, sizes))]
    return ReplicaLink(replicas, check, backoff_s=FAST), links, infos


def opens(*sids):
    return [OpenEntry(sid, [1, 2], SamplingParams()) for sid in sids]


def tree(sid, round=1):
    return TreeEntry(sid, round, DraftTree.root_only(1))


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_opens_go_to_the_least_loaded_replica():
    link, links, _ = replica_set(2, 4)
    results = link.step(opens(1, 2, 3, 4))
    assert [r.session_id for r in results] == [1, 2, 3, 4]
    # a 0/2, b 0/4 -> a; a 1/2 vs b 0/4 -> b; a 1/2 vs b 1/4 -> b; a 1/2 vs b 2/4: a (fewer sessions)
    assert link.placement() == {"a": {1, 4}, "b": {2, 3}}
    assert [[e.session_id for e in m] for m in links[0].sent] == [[1, 4]]
    link.close()


def test_results_come_back_in_entry_order_across_replicas():
    link, links, _ = replica_set(4, 4)
    link.step(opens(1, 2, 3, 4))  # a: 1, 3; b: 2, 4
    results = link.step([CloseEntry(4), tree(2), tree(1), tree(3)])
    assert [r.session_id for r in results] == [2, 1, 3]
    assert all(isinstance(r.outcome, Verified) for r in results)
    assert [type(e).__name__ for e in links[1].sent[-1]] == ["CloseEntry", "TreeEntry"]
    assert [e.session_id for e in links[0].sent[-1]] == [1, 3]
    assert link.placement() == {"a": {1, 3}, "b": {2}}
    assert link.verifier_step_s == pytest.approx(0.02)  # the slower reply's
    link.close()


@pytest.mark.parametrize("status", ["UNAVAILABLE", "INTERNAL"])
def test_a_failing_replica_loses_only_its_sessions(status):
    link, links, infos = replica_set(4, 4)
    infos[0].down = True
    link.step(opens(1, 2, 3, 4))  # a: 1, 3; b: 2, 4
    links[0].fail = StatusError(status, "verifier: socket closed")
    results = link.step([tree(1), tree(2), tree(3), tree(4)])
    outcome = {r.session_id: r.outcome for r in results}
    assert isinstance(outcome[2], Verified) and isinstance(outcome[4], Verified)
    for sid in (1, 3):
        assert isinstance(outcome[sid], StatusError) and outcome[sid].status == status
        assert isinstance(outcome[sid], LinkLost) == (status == "UNAVAILABLE")
    assert link.replicas[0].state is State.DOWN and links[0].closed == 1
    assert link.placement() == {"a": set(), "b": {2, 4}} and link.up
    sent = len(links[0].sent)
    results = link.step([CloseEntry(1), tree(3)] + opens(5))  # a close for a lost session is dropped
    assert [r.session_id for r in results] == [3, 5]
    assert isinstance(results[0].outcome, LinkLost) and isinstance(results[1].outcome, Prefilled)
    assert len(links[0].sent) == sent and link.placement()["b"] == {2, 4, 5}
    link.close()


def test_a_lost_replica_is_probed_with_backoff_and_used_again():
    link, links, infos = replica_set(4, 4)
    infos[0].down = True
    link.step(opens(1, 2))
    links[0].fail = StatusError("UNAVAILABLE", "gone")
    link.step([tree(1), tree(2)])
    time.sleep(0.3)
    assert link.replicas[0].state is State.DOWN
    assert 2 <= infos[0].asked <= 0.3 / FAST[0]  # backed off: not asked at every turn
    infos[0].down = False
    wait_until(lambda: link.replicas[0].state is State.UP)
    assert link.step(opens(1))[0].outcome.token == 1  # the re-open goes to the emptier one: a
    assert link.placement() == {"a": {1}, "b": {2}}
    link.close()


def test_with_no_healthy_replica_opens_get_link_lost_at_once():
    link, links, infos = replica_set(4, 4, up=False)
    assert not link.up and not link.probe()
    results = link.step(opens(1, 2))
    assert all(isinstance(r.outcome, LinkLost) for r in results)
    assert links[0].sent == links[1].sent == []
    infos[1].down = False
    wait_until(lambda: link.up)
    assert isinstance(link.step(opens(1))[0].outcome, Prefilled) and link.placement()["b"] == {1}
    link.close()


def test_an_idle_probe_finds_a_dead_replica_and_a_draining_one():
    link, links, infos = replica_set(4, 4, 4)
    infos[0].down = infos[1].down = True
    infos[2].draining = True
    assert not link.probe() and not link.up
    assert [r.state for r in link.replicas] == [State.DOWN, State.DOWN, State.DRAINING]
    link.close()


def test_a_replica_that_serves_something_else_is_refused():
    def check(info):
        if info.max_sessions == 3:
            raise StatusError("FAILED_PRECONDITION", "target mismatch")
    link, links, infos = replica_set(3, 4, up=False, check=check)
    infos[0].down = infos[1].down = False
    wait_until(lambda: link.replicas[1].state is State.UP)
    wait_until(lambda: link.replicas[0].state is State.REFUSED)
    link.step(opens(1, 2, 3))
    assert link.placement() == {"a": set(), "b": {1, 2, 3}}
    link.close()


def test_a_replica_that_never_answered_is_logged_once(caplog):
    """A replica named in --verifier that does not answer at start-up (a typo, a dead host) is
    said once, not left out in silence (nor logged at every ask)."""
    with caplog.at_level(logging.WARNING, logger="drafter_svc.replicas"):
        link, links, infos = replica_set(4, up=False)
        wait_until(lambda: infos[0].asked >= 4)
        link.close()
    said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert said == ["verifier at a does not answer (down); it is asked again until it does"], said


def test_a_refused_replica_is_taken_once_it_serves_the_same_model(monkeypatch, caplog):
    """An operator who restarts a refused verifier with the right flags gets it back (asked again
    every REFUSED_RETRY_S), and the refusal is logged once, not at every ask."""
    monkeypatch.setattr(replicas, "REFUSED_RETRY_S", 0.05)
    wrong = {"flags": True}

    def check(info):
        if wrong["flags"]:
            raise StatusError("FAILED_PRECONDITION", "max_seq_len 1024, the first has 2048")
    link, links, infos = replica_set(4, up=False, check=check)
    infos[0].down = False
    with caplog.at_level(logging.ERROR, logger="drafter_svc.replicas"):
        wait_until(lambda: link.replicas[0].state is State.REFUSED and infos[0].asked >= 4)
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1
    (lost,) = link.step(opens(1))  # a request meanwhile is told why no verifier takes it
    assert isinstance(lost.outcome, LinkLost)
    assert lost.outcome.message == "no verifier is reachable (a refused: max_seq_len 1024, the first has 2048)"
    wrong["flags"] = False
    wait_until(lambda: link.replicas[0].state is State.UP)
    link.step(opens(1))
    assert link.placement() == {"a": {1}}
    link.close()


def test_two_messages_in_flight_lose_the_failed_replicas_part_of_each():
    link, links, _ = replica_set(4, 4)
    link.step(opens(1, 2, 3, 4))  # a: 1, 3; b: 2, 4
    link.send([tree(1), tree(2)])
    link.send([tree(3), tree(4)])
    links[0].fail = StatusError("UNAVAILABLE", "gone")
    first, second = link.receive(), link.receive()
    assert [(r.session_id, type(r.outcome).__name__) for r in first] == [(1, "LinkLost"), (2, "Verified")]
    assert [(r.session_id, type(r.outcome).__name__) for r in second] == [(3, "LinkLost"), (4, "Verified")]
    link.close()


def test_a_draining_replica_keeps_its_sessions_and_takes_no_new_ones(monkeypatch, caplog):
    """A verifier shutting down refuses opens with UNAVAILABLE: that open re-opens elsewhere (a
    LinkLost), the replica takes no new sessions while its own go on, and once it holds none and
    has stopped it is probed as a lost one, so that its restart is taken back."""
    monkeypatch.setattr(replicas, "DRAIN_PROBE_S", 0.02)
    link, links, infos = replica_set(4, 4)
    link.step(opens(1, 2))  # a: 1; b: 2
    links[0].refuse_opens = StatusError("UNAVAILABLE", "the verifier is shutting down")
    infos[0].draining = True
    with caplog.at_level(logging.INFO, logger="drafter_svc.replicas"):
        results = link.step(opens(3, 4))  # a: 3 (refused); b: 4
        (refused,) = [r.outcome for r in results if r.session_id == 3]
        assert isinstance(refused, LinkLost) and "shutting down" in refused.message
        assert link.replicas[0].state is State.DRAINING and link.up
        assert link.placement() == {"a": {1}, "b": {2, 4}}
        opened = link.step(opens(3, 5) + [tree(1)])  # new sessions go to b; a's session goes on there
        assert all(isinstance(r.outcome, (Prefilled, Verified)) for r in opened)
        assert link.placement() == {"a": {1}, "b": {2, 3, 4, 5}}
        time.sleep(0.1)
        assert link.replicas[0].state is State.DRAINING and links[0].closed == 0  # it drains: still ours
        link.step([CloseEntry(1)])
        time.sleep(0.1)
        assert link.replicas[0].state is State.DRAINING  # no session left, but it still says it drains
        infos[0].down = True  # it has stopped
        wait_until(lambda: link.replicas[0].state is State.DOWN and links[0].closed == 1)
        links[0].refuse_opens, infos[0].draining, infos[0].down = None, False, False  # restarted
        wait_until(lambda: link.replicas[0].state is State.UP)
    said = [r.getMessage() for r in caplog.records]
    assert any("verifier at a is draining" in m for m in said) and "verifier at a has drained" in said, said
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), said
    link.step(opens(6))
    assert link.placement()["a"] == {6}
    link.close()


def test_a_chunk_answered_after_its_refused_open_moved_keeps_the_new_placement():
    """An open refused by a draining replica while its next prompt chunk is on the way there
    re-opens on another replica; that chunk's error, answered later, leaves the new placement."""
    link, links, _ = replica_set(4, 4)
    links[0].refuse_opens = StatusError("UNAVAILABLE", "the verifier is shutting down")

    def receive(on_notice=None):  # its open refused, so a chunk of that session: NOT_FOUND
        return [StepResult(e.session_id, StatusError("NOT_FOUND", "no such session") if isinstance(e, ExtendEntry)
                           else links[0].refuse_opens) for e in links[0].pending.popleft()]
    links[0].receive = receive
    link.send(opens(1))  # to a
    link.send([ExtendEntry(1, [3, 4])])  # ahead of the open's reply: to a as well
    (refused,) = link.receive()
    assert isinstance(refused.outcome, LinkLost) and link.replicas[0].state is State.DRAINING
    link.send(opens(1))  # the re-open: to b
    (chunk,) = link.receive()
    assert chunk.outcome.status == "NOT_FOUND"
    (opened,) = link.receive()
    assert isinstance(opened.outcome, Prefilled) and link.placement() == {"a": set(), "b": {1}}
    link.close()


def test_verifier_addresses(monkeypatch):
    tls = ChannelTls(ca="ca.pem", flag_prefix="--verifier-")
    table = {"svc": ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "dual": ["127.0.0.1", "::1"], "one": ["10.0.0.9"]}

    def getaddrinfo(host, port, type=0):
        if host not in table:
            raise socket.gaierror("unknown")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in table[host]]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    got = verifier_addresses("svc:50051, one:7,nowhere:8,one:7", tls)
    assert [a.address for a in got] == ["10.0.0.1:50051", "10.0.0.2:50051", "one:7", "nowhere:8"]
    assert [a.tls.server_name for a in got] == ["svc", "svc", "", ""]
    assert [a.address for a in verifier_addresses("dual:1", ChannelTls())] == ["dual:1"]
    assert verifier_addresses("svc:1", ChannelTls())[0].tls == ChannelTls()  # plaintext stays plaintext
    with pytest.raises(ValueError):
        verifier_addresses(" , ", tls)


def test_check_replica_names_what_differs():
    first = pb.InfoResponse(max_seq_len=128, max_tree_nodes=65, sampling="keyed")
    check_replica(first, pb.InfoResponse(max_seq_len=128, max_tree_nodes=65, sampling="keyed", max_sessions=9))
    with pytest.raises(StatusError) as err:
        check_replica(first, pb.InfoResponse(max_seq_len=64, max_tree_nodes=65, sampling="coins"))
    assert err.value.status == "FAILED_PRECONDITION"
    assert "max_seq_len 64, the first has 128" in err.value.message and "sampling 'coins'" in err.value.message
    with pytest.raises(StatusError) as err:
        check_replica(first, pb.InfoResponse(max_seq_len=128, max_tree_nodes=65, sampling="keyed", deterministic=True))
    assert "deterministic" in err.value.message
    with pytest.raises(StatusError) as err:  # its feature rows would reach a link that reads them otherwise
        check_replica(first, pb.InfoResponse(max_seq_len=128, max_tree_nodes=65, sampling="keyed",
                                             feature_wire="fp8-e4m3-rowscale"))
    assert "feature_wire 'fp8-e4m3-rowscale', the first has ''" in err.value.message


# -- the scheduler over two in-process verifiers ----------------------------------------------------


class DyingLink(LocalLink):
    """An in-process verifier that dies (its sessions and replies gone) at its `die_at`-th send."""

    def __init__(self, verifier, die_at: int | None = None):
        super().__init__(verifier)
        self.die_at, self.sends = die_at, 0

    def send(self, entries):
        self.sends += 1
        if self.sends == self.die_at:
            self.close()  # its sessions and replies gone
            raise StatusError("UNAVAILABLE", "verifier went away")
        super().send(entries)


class CountingLink(LocalLink):
    """An in-process verifier that counts the statuses of the errors it answers."""

    def __init__(self, verifier):
        super().__init__(verifier)
        self.errors: collections.Counter = collections.Counter()

    def receive(self, on_notice=None):
        results = super().receive(on_notice)
        self.errors.update(r.outcome.status for r in results if isinstance(r.outcome, StatusError))
        return results


@pytest.fixture(scope="module")
def engines(qwen3_pair):
    """Two in-process verifiers, of 6 and 3 sessions (and the first one's draft, 6 slots)."""
    return [LocalEngine.load(str(qwen3_pair[0]), str(qwen3_pair[1]), limits=VerifierLimits(max_sessions=n,
                                                                                          max_seq_len=256))
            for n in (6, 3)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["lockstep", "pipelined"])
def test_scheduler_moves_only_the_lost_replicas_sessions(engines, caplog, pipelined):
    """Two verifiers, one dies mid-generation: its sessions re-open on the other (waiting there
    for room: it is too small for all of them at first) and end with their undisturbed tokens;
    the other's sessions are never re-opened."""
    a, b = engines
    modes = [DraftMode("tree", 8), DraftMode("chain", 0), DraftMode("ar", 0), DraftMode("tree", 4)]
    requests = [(PROMPTS[i % 3] + [i], GenerationConfig(24 + 4 * i, mode=modes[i % 4])) for i in range(6)]
    undisturbed = [r.tokens for r in a.generate_many(requests)]
    dying, survivor = DyingLink(a.verifier, die_at=4), CountingLink(b.verifier)
    info = pb.InfoResponse(max_sessions=3)
    link = ReplicaLink([Replica("a", dying, FakeVerifier(down=True), State.UP, 6),
                        Replica("b", survivor, lambda: info, State.UP, 3)], backoff_s=FAST)
    scheduler = DraftScheduler(link, a.proposer, max_sessions=6, feature_layer_ids=a.verifier.feature_layer_ids,
                               recovery_timeout_s=30.0, pipelined=pipelined)
    ends = [[] for _ in requests]
    for end, (prompt, config) in zip(ends, requests):
        scheduler.submit(prompt, config, end.append)
    placed = {}
    step = scheduler.step

    def stepping():  # the placement just before the replica dies
        if dying.sends == dying.die_at - 1 and not placed:
            placed.update(link.placement())
        return step()
    scheduler.step = stepping
    with caplog.at_level(logging.INFO, logger="drafter_svc.scheduler"):
        scheduler.run_until_idle()
    reopened = {int(r.getMessage().split()[1]) for r in caplog.records if " re-opened after " in r.getMessage()}
    assert all(isinstance(end[-1], GenerationResult) for end in ends), [end[-1] for end in ends]
    assert [end[-1].tokens for end in ends] == undisturbed
    assert len(placed["a"]) == 4 and len(placed["b"]) == 2 and reopened == placed["a"]
    assert survivor.errors["RESOURCE_EXHAUSTED"] > 0  # re-opens refused for room waited for it
    assert b.verifier.free_capacity == 3 and a.proposer.free_slots == 6
    link.close()


# -- both services, two verifiers, one killed -------------------------------------------------------


def test_a_verifier_killed_mid_generation_moves_only_its_sessions(qwen3_pair, caplog):
    """Two verifiers behind one drafter, one SIGKILLed mid-generation: its sessions re-open on the
    other and every output (greedy, and seeded under keyed sampling) is that of an undisturbed run;
    the survivor's sessions are not re-opened, and its capacity is back to full afterwards."""
    victim, victim_port = _verifier_process(verifier_config(qwen3_pair), 0, "--sampling", "keyed", "--max-sessions",
                                            str(MAX_SESSIONS))
    survivor_cfg = verifier_config(qwen3_pair, projection_dir="", max_seq_len=1024, sampling="keyed",
                                   max_tree_nodes=VerifierLimits.max_tree_nodes)
    try:
        with ServerThread(lambda: serve_verifier(survivor_cfg)) as survivor:
            engine = drafter_engine(qwen3_pair, 0, verifier=f"127.0.0.1:{victim_port},127.0.0.1:{survivor.port}",
                                    recovery_timeout_s=60.0)
            addresses = [f"127.0.0.1:{victim_port}", f"127.0.0.1:{survivor.port}"]
            wait_until(lambda: all(r.state is State.UP for r in engine.scheduler.link.replicas))
            with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                    grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel, \
                    grpc.insecure_channel(addresses[1], options=CHANNEL_OPTIONS) as survivor_channel, \
                    caplog.at_level(logging.INFO, logger="drafter_svc.scheduler"):
                stub = pb_grpc.GenerationStub(channel)
                reqs = [request(PROMPTS[i % 3] + [i], n=64, budget=(0, 8, 16, 8)[i], temperature=(0, 0, 0, 0.9)[i],
                                top_k=30, seed=11) for i in range(4)]
                undisturbed = [[t for reply in stub.Generate(r, timeout=60) for t in reply.delta.token_ids]
                               for r in reqs]
                calls = [stub.Generate(r, timeout=120) for r in reqs]
                got = [list(next(call).delta.token_ids) for call in calls]  # a few tokens each, then one dies
                placed = engine.scheduler.link.placement()
                victim.kill()
                victim.wait()
                for tokens, call in zip(got, calls):
                    for reply in call:
                        tokens.extend(reply.delta.token_ids)
                reopened = {int(r.getMessage().split()[1]) for r in caplog.records
                            if " re-opened after " in r.getMessage()}
                assert got == undisturbed and all(len(t) == 64 for t in got)
                assert placed[addresses[0]] and placed[addresses[1]]
                assert reopened and reopened <= placed[addresses[0]] and not reopened & placed[addresses[1]]
                wait_full(pb_grpc.VerifierStub(survivor_channel))
                assert engine.scheduler.proposer.free_slots == engine.scheduler.max_sessions
    finally:
        victim.kill()
        victim.wait()


# -- both services, two verifiers, one shut down ----------------------------------------------------


def test_a_verifier_shut_down_mid_generation_drains(qwen3_pair, caplog):
    """Two verifiers behind one drafter, one stopped (SIGTERM's drain) mid-generation: its open
    sessions finish there (none re-opens), requests arriving meanwhile go to the other, every
    output is that of an undisturbed run, and the stop returns once its last session ends."""
    cfg = verifier_config(qwen3_pair, sampling="keyed")
    with ServerThread(lambda: serve_verifier(cfg)) as first, ServerThread(lambda: serve_verifier(cfg)) as second:
        addresses = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
        engine = drafter_engine(qwen3_pair, 0, verifier=",".join(addresses), recovery_timeout_s=60.0)
        wait_until(lambda: all(r.state is State.UP for r in engine.scheduler.link.replicas))
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel, \
                caplog.at_level(logging.INFO):
            stub = pb_grpc.GenerationStub(channel)
            reqs = [request(PROMPTS[i % 3] + [i], n=96, budget=(0, 8, 16, 8)[i], temperature=(0, 0, 0, 0.9)[i],
                            top_k=30, seed=11) for i in range(4)]
            undisturbed = [[t for reply in stub.Generate(r, timeout=60) for t in reply.delta.token_ids]
                           for r in reqs]
            calls = [stub.Generate(r, timeout=120) for r in reqs[:2]]
            got = [list(next(call).delta.token_ids) for call in calls]
            placed = engine.scheduler.link.placement()
            assert placed[addresses[0]] and placed[addresses[1]], placed
            began = time.monotonic()
            stopping = asyncio.run_coroutine_threadsafe(first.server.stop(60.0), first.loop)
            late = [stub.Generate(r, timeout=120) for r in reqs[2:]]  # opened during the drain
            for tokens, call in zip(got, calls):
                for reply in call:
                    tokens.extend(reply.delta.token_ids)
            got += [[t for reply in call for t in reply.delta.token_ids] for call in late]
            assert got == undisturbed and all(len(t) == 96 for t in got)
            stopping.result(30)
            assert time.monotonic() - began < 30  # the drain ended with its sessions, not the grace
            wait_until(lambda: engine.scheduler.link.replicas[0].state is State.DOWN)
            # (the prober logs the drain once it has closed the link, after the state it sets)
            wait_until(lambda: any("has drained" in r.getMessage() for r in caplog.records))
        said = [r.getMessage() for r in caplog.records]
        # Only opens refused by the draining verifier re-opened (none of its sessions with tokens).
        assert all(" re-opened after 0 tokens" in m and "shutting down" in m for m in said if " re-opened " in m), said
        assert f"verifier at {addresses[0]} has drained" in said, said
        engine.stop()
