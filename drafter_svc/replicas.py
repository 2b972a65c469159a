"""Verifier replicas: one `VerifierLink` over several verifiers, with failover.

`--verifier` names the replicas (`verifier_addresses`: comma-separated HOST:PORT; a name that
resolves to several addresses is one replica per address). `ReplicaLink` keeps one `GrpcLink`
per replica and routes every entry of a scheduler message: an open to the healthy replica with
the fewest sessions for its size, a tree or a close to its session's replica. A message goes
out as one sub-message per replica that has entries, and its results come back in the
order of the message's entries, so the scheduler sees one link (pipelining included: several
messages may be in flight, each remembering where its entries went).

When a replica's stream fails, only that replica is lost: its link is closed, each of its
sessions' entries in flight gets a `LinkLost` result (the scheduler re-opens them elsewhere, or
on it once it is back: `DraftScheduler._recover`), or the failure itself when it is not
UNAVAILABLE (a bad reply), and the other replicas' sessions carry on untouched. A thread of its
own asks lost replicas (and those that never answered) for their Info, with backoff, and
brings them back once they answer and pass the check that they serve the same model; one that
does not is refused, with one logged line, and asked again every `REFUSED_RETRY_S` (an operator
may restart it with the right flags). An open that finds no healthy replica gets
`LinkLost` at once, so the link is `up` exactly while some replica is.

A replica that refuses an open with UNAVAILABLE is shutting down (it drains): it takes no new
sessions, the refused one re-opens elsewhere (a `LinkLost`), and its open sessions run on there.
The prober asks it every `DRAIN_PROBE_S` whether it still drains, and once it holds none of our
sessions and has stopped, probes it as a lost one, so that its restart is taken back.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from common.protocol import CloseEntry, Entry, LinkLost, OpenEntry, StatusError, StepResult
from common.rpc import pb, pb_grpc
from common.tls import ChannelTls
from drafter_svc.link import OnNotice, VerifierLink, connect_error, status_error

log = logging.getLogger(__name__)
WAIT_REPORT_S = 5.0  # while start-up waits for a verifier, a progress line this often
REFUSED_RETRY_S = 10.0  # a refused replica is asked again this often
DRAIN_PROBE_S = 1.0  # a draining replica is asked this often whether it still is (it has stopped once not)
# Fields of a replica's Info that must equal the first replica's: they shape the drafter's
# sessions (length, trees, features) and make a re-opened session's output the same.
SAME_AS_FIRST = ("max_seq_len", "max_tree_nodes", "feature_projection", "sampling", "deterministic", "feature_wire")


# -- addresses and start-up --------------------------------------------------------------------


@dataclass(frozen=True)
class VerifierAddress:
    """Where one replica is, and the TLS settings to dial it with."""
    address: str
    tls: ChannelTls


def verifier_addresses(spec: str, tls: ChannelTls) -> list[VerifierAddress]:
    """The replicas `--verifier` names: comma-separated HOST:PORT. A host name that resolves to
    several addresses of one family (a headless service) is one replica per address, dialled by
    address with the name kept as the TLS server name; anything else is dialled as given."""
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"--verifier names no address: {spec!r}")
    found: dict[str, VerifierAddress] = {}
    for part in parts:
        host, _, port = part.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        several = _resolve(host, int(port)) if host and port.isdigit() else []
        if len(several) < 2:
            found.setdefault(part, VerifierAddress(part, tls))
            continue
        named = dataclasses.replace(tls, server_name=tls.server_name or host) if tls.enabled else tls
        for ip in several:
            address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            found.setdefault(address, VerifierAddress(address, named))
    return list(found.values())


def _resolve(host: str, port: int) -> list[str]:
    """The distinct IPv4 addresses of `host`, else its IPv6 ones ([] when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    for family in (socket.AF_INET, socket.AF_INET6):
        ips = list(dict.fromkeys(sockaddr[0] for fam, _, _, _, sockaddr in infos if fam == family))
        if ips:
            return ips
    return []


def wait_for_verifier(addresses: Sequence[str], stubs: Sequence[pb_grpc.VerifierStub], wait_s: float,
                      check: Callable[[pb.InfoResponse], None]) -> tuple[int, pb.InfoResponse, set[int]]:
    """Ask every replica for its Info at once until one answers and passes `check`, for at most
    `wait_s`; returns its index, its Info and the replicas refused meanwhile (each logged).
    Raises StatusError: UNAVAILABLE when none answered in time, the refusal when all were refused."""
    start = time.monotonic()
    deadline, next_report = start + wait_s, start + WAIT_REPORT_S
    done = threading.Event()
    calls: dict[int, grpc.Future] = {}
    failures: dict[int, grpc.RpcError] = {}
    retry_at: dict[int, float] = {}
    refused: set[int] = set()
    draining: set[int] = set()  # answered, shutting down
    try:
        while True:
            now = time.monotonic()
            for i, stub in enumerate(stubs):
                if i not in calls and i not in refused and retry_at.get(i, 0.0) <= now:
                    retry_at.pop(i, None)
                    calls[i] = stub.Info.future(pb.InfoRequest(), timeout=max(0.1, min(5.0, deadline - now)),
                                                wait_for_ready=True)
                    calls[i].add_done_callback(lambda _: done.set())
            done.wait(max(0.0, min(deadline, next_report, *retry_at.values()) - now))
            done.clear()
            for i, call in [(i, call) for i, call in calls.items() if call.done()]:
                del calls[i]
                try:
                    info = call.result()
                except grpc.RpcError as exc:  # a call that fails at once is asked again a little later
                    failures[i], retry_at[i] = exc, time.monotonic() + 0.2
                    continue
                if info.draining:  # shutting down: asked again until another answers (or its restart does)
                    draining.add(i)
                    retry_at[i] = time.monotonic() + 0.2
                    continue
                try:
                    check(info)
                except StatusError as exc:
                    log.error("verifier at %s refused: %s", addresses[i], exc.message)
                    refused.add(i)
                    if len(refused) == len(stubs):
                        raise
                    continue
                return i, info, refused
            now = time.monotonic()
            if now >= deadline:
                for i, call in calls.items():  # each call's timeout ends by the deadline (0.1 s after at most)
                    if (exc := call.exception()) is not None:
                        failures[i] = exc
                reasons = {addresses[i]: status_error(connect_error(stubs[i], failures[i])).message
                           for i in failures if i not in refused}
                reasons.update((addresses[i], "it is shutting down") for i in draining if i not in failures)
                if len(stubs) == 1:
                    raise StatusError("UNAVAILABLE", f"verifier at {addresses[0]} did not answer within {wait_s:.0f} "
                                                     f"s: {reasons.get(addresses[0], 'no answer')}")
                raise StatusError("UNAVAILABLE", f"no verifier answered within {wait_s:.0f} s: "
                                                 + "; ".join(f"{a}: {why}" for a, why in reasons.items()))
            if now >= next_report:
                log.info("waiting for the verifier at %s (%.0f s of %.0f)", ", ".join(addresses), now - start, wait_s)
                next_report = now + WAIT_REPORT_S
    finally:
        for call in calls.values():
            call.cancel()


def _reason(exc: Exception) -> str:
    """The first line of why a call failed: a gRPC error's details, else the exception's text or type."""
    text = (exc.details() if hasattr(exc, "details") else str(exc)) or type(exc).__name__
    return text.splitlines()[0]


def check_replica(first: pb.InfoResponse, info: pb.InfoResponse) -> None:
    """Raise StatusError(FAILED_PRECONDITION) unless `info` serves as the first replica does
    (`SAME_AS_FIRST`)."""
    differ = [f"{name} {getattr(info, name)!r}, the first has {getattr(first, name)!r}"
              for name in SAME_AS_FIRST if getattr(info, name) != getattr(first, name)]
    if differ:
        raise StatusError("FAILED_PRECONDITION", "serves unlike the first verifier: " + "; ".join(differ))


# -- the link -------------------------------------------------------------------------------------


class State(enum.Enum):
    NEW = "new"            # has not answered yet: probed
    UP = "up"              # takes sessions
    DRAINING = "draining"  # shutting down: its sessions run on there, new ones go elsewhere
    DOWN = "down"          # its link failed: probed with backoff (also while its Info says it drains)
    REFUSED = "refused"    # serves another model or shape: unused, asked again every REFUSED_RETRY_S


@dataclass
class Replica:
    """One verifier of the set, as `ReplicaLink` tracks it."""
    address: str
    link: VerifierLink
    ask_info: Callable[[], pb.InfoResponse]  # its Info; raises (grpc.RpcError, ...) when it does not answer
    state: State = State.NEW
    max_sessions: int = 0  # from its Info
    sessions: set[int] = field(default_factory=set)  # open or opening there
    backoff_s: float = 0.0
    retry_at: float = 0.0  # monotonic time of its next probe (while not UP)
    silent_reported: bool = False  # a NEW one that did not answer has been logged
    refusal: str = ""  # why it is REFUSED

    def load(self) -> float:
        return len(self.sessions) / max(1, self.max_sessions)


@dataclass
class _Message:
    """A message in flight: for each open and tree entry, its session and the replica whose
    reply answers it (or the LinkLost it got at once); the replicas sent a part; lost parts."""
    asked: list[tuple[int, int | LinkLost]]
    parts: list[int]
    lost: dict[int, StatusError] = field(default_factory=dict)  # replica index -> what its entries get


class ReplicaLink:
    """Several verifiers as one `VerifierLink` (the module docstring says how)."""

    def __init__(self, replicas: Sequence[Replica], check: Callable[[pb.InfoResponse], None] = lambda info: None,
                 backoff_s: tuple[float, float] = (0.05, 1.0)):
        self.replicas = list(replicas)
        self.check = check  # raises StatusError when a replica that answers does not serve our model
        self.backoff_s = backoff_s  # (first, largest) wait between probes of a replica that does not answer
        self.verifier_step_s = self.link_s = 0.0
        self._owner: dict[int, int] = {}  # session id -> the replica it is open (or opening) on
        self._inflight: collections.deque[_Message] = collections.deque()  # oldest first
        self._lock = threading.Lock()  # replica states and sessions, shared with the prober
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="verifier-prober", daemon=True)
        self._prober.start()

    @property
    def up(self) -> bool:
        """Whether some replica takes sessions."""
        return any(r.state is State.UP for r in self.replicas)

    @property
    def bytes_sent(self) -> int:
        return sum(getattr(r.link, "bytes_sent", 0) for r in self.replicas)

    @property
    def bytes_received(self) -> int:
        return sum(getattr(r.link, "bytes_received", 0) for r in self.replicas)

    def placement(self) -> dict[str, set[int]]:
        """The sessions each replica holds, by address."""
        with self._lock:
            return {r.address: set(r.sessions) for r in self.replicas}

    # -- the VerifierLink protocol ----------------------------------------------------------------

    def send(self, entries: Sequence[Entry]) -> None:
        """Route the entries and send each replica its part (a close for a lost session is dropped)."""
        parts: dict[int, list[Entry]] = {}
        asked: list[tuple[int, int | LinkLost]] = []
        with self._lock:
            for e in entries:
                if isinstance(e, CloseEntry):
                    i = self._unassign(e.session_id)
                    if i is not None:
                        parts.setdefault(i, []).append(e)
                    continue
                if isinstance(e, OpenEntry):
                    self._unassign(e.session_id)
                    i = self._least_loaded()
                    if i is None:
                        asked.append((e.session_id, LinkLost("no verifier is reachable" + self._refusals())))
                        continue
                    self._owner[e.session_id] = i
                    self.replicas[i].sessions.add(e.session_id)
                elif (i := self._owner.get(e.session_id)) is None:
                    asked.append((e.session_id, LinkLost("its verifier was lost")))
                    continue
                parts.setdefault(i, []).append(e)
                asked.append((e.session_id, i))
        self._inflight.append(_Message(asked, list(parts)))
        for i, part in parts.items():
            try:
                self.replicas[i].link.send(part)
            except StatusError as exc:
                self._lose(i, exc)

    def receive(self, on_notice: OnNotice | None = None) -> list[StepResult]:
        """The results of the oldest message in flight, in the order of its entries (each
        replica's notices go to `on_notice` as they come)."""
        message = self._inflight.popleft()
        replies: dict[int, Iterator[StepResult]] = {}
        self.verifier_step_s = 0.0
        links = []
        for i in message.parts:
            if i in message.lost:
                continue
            replica = self.replicas[i]
            try:
                replies[i] = iter(replica.link.receive(on_notice))
            except StatusError as exc:
                message.lost[i] = self._lose(i, exc)
                continue
            replica.backoff_s = 0.0
            self.verifier_step_s = max(self.verifier_step_s, replica.link.verifier_step_s)
            links.append(replica.link.link_s)
        self.link_s = links[0] if len(links) == 1 else 0.0  # one link's time: for a message one replica answered
        results = []
        for sid, via in message.asked:
            if isinstance(via, LinkLost):
                results.append(StepResult(sid, via))
            elif via in message.lost:
                results.append(StepResult(sid, message.lost[via]))
            else:
                result = next(replies[via])
                if isinstance(result.outcome, StatusError):  # the session is closed there
                    with self._lock:
                        if self._owner.get(sid) == via:  # not re-opened elsewhere since (a chunk sent ahead)
                            self._unassign(sid)
                    if result.outcome.status == "UNAVAILABLE":  # an open it refused while shutting down
                        self._set_draining(via, result.outcome.message)
                        result = StepResult(sid, LinkLost(f"verifier at {self.replicas[via].address}: "
                                                          f"{result.outcome.message}"))
                results.append(result)
        return results

    def step(self, entries: Sequence[Entry]) -> list[StepResult]:
        self.send(entries)
        return self.receive()

    def probe(self) -> bool:
        """Whether some replica answers: asks the healthy ones for their Info now (one that does
        not answer is lost, one that says it drains is draining); the others are the prober's."""
        for i, replica in enumerate(self.replicas):
            if replica.state is not State.UP:
                continue
            try:
                draining = replica.ask_info().draining
            except Exception as exc:  # grpc.RpcError, or a broken answer
                self._lose(i, StatusError("UNAVAILABLE", f"it does not answer Info ({_reason(exc)})"))
                continue
            if draining:
                self._set_draining(i, "its Info says it shuts down")
        return self.up

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._prober.join(5.0)
        for replica in self.replicas:
            replica.link.close()

    # -- routing and failures ----------------------------------------------------------------------

    def _least_loaded(self) -> int | None:
        """The healthy replica with the fewest sessions for its size (under the lock)."""
        healthy = [i for i, r in enumerate(self.replicas) if r.state is State.UP]
        return min(healthy, key=lambda i: (self.replicas[i].load(), len(self.replicas[i].sessions)), default=None)

    def _refusals(self) -> str:
        """Why replicas are refused, for the error of a request that finds none to take it (under
        the lock): an operator then sees that a restart with other flags, not an outage, is why."""
        refused = [f"{r.address} refused: {r.refusal}" for r in self.replicas if r.state is State.REFUSED]
        return f" ({'; '.join(refused)})" if refused else ""

    def _unassign(self, sid: int) -> int | None:
        """Forget where a session is (under the lock); returns the replica it was on."""
        i = self._owner.pop(sid, None)
        if i is not None:
            self.replicas[i].sessions.discard(sid)
        return i

    def _set_draining(self, i: int, why: str) -> None:
        """Replica `i` is shutting down (it refused an open with UNAVAILABLE, or its Info says so):
        it takes no new sessions from now on, and its open ones carry on there."""
        replica = self.replicas[i]
        with self._lock:
            if replica.state is not State.UP:
                return
            replica.state, replica.retry_at = State.DRAINING, time.monotonic() + DRAIN_PROBE_S
            others = any(r.state is State.UP for r in self.replicas)
        log.info("verifier at %s is draining (%s): the sessions it holds end there, new ones %s", replica.address,
                 why, "go to the other replicas" if others else "wait for a replica")
        self._wake.set()  # the prober watches it

    def _lose(self, i: int, exc: StatusError) -> StatusError:
        """Replica `i` failed: close its link, forget its sessions, probe it with backoff; its parts
        of the messages in flight get LinkLost (or `exc` itself when it is not UNAVAILABLE), returned."""
        replica = self.replicas[i]
        error = LinkLost(f"verifier at {replica.address} lost: {exc.message}") if exc.status == "UNAVAILABLE" else exc
        with self._lock:
            drained = replica.state is State.DRAINING and not replica.sessions
            replica.state = State.DOWN
            for sid in replica.sessions:
                self._owner.pop(sid, None)
            lost = len(replica.sessions)
            replica.sessions.clear()
            self._back_off(replica)
        replica.link.close()
        for message in self._inflight:
            if i in message.parts:
                message.lost.setdefault(i, error)
        if drained:
            log.info("verifier at %s has drained", replica.address)
        else:
            log.warning("verifier at %s lost with %d sessions (%s: %s)", replica.address, lost, exc.status, exc.message)
        self._wake.set()
        return error

    def _back_off(self, replica: Replica) -> None:
        first, largest = self.backoff_s
        replica.backoff_s = min(max(2 * replica.backoff_s, first), largest)
        replica.retry_at = time.monotonic() + replica.backoff_s

    # -- the prober thread -----------------------------------------------------------------------

    def _probe_loop(self) -> None:
        """Probe every replica not up when its wait is due, until closed."""
        while not self._closed.is_set():
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [r for r in self.replicas if r.state is not State.UP and r.retry_at <= now]
            for replica in due:
                self._probe_one(replica)
            with self._lock:
                waits = [r.retry_at for r in self.replicas if r.state is not State.UP]
            self._wake.wait(max(0.0, min(waits) - time.monotonic()) if waits else None)

    def _probe_one(self, replica: Replica) -> None:
        """Ask a replica for its Info: it comes up when it answers and passes the check, is refused
        (one logged line, asked again after `REFUSED_RETRY_S`) when it fails the check, and backs off
        when it does not answer."""
        if replica.state is State.DRAINING:
            self._probe_draining(replica)
            return
        try:
            info = replica.ask_info()
        except Exception as exc:  # grpc.RpcError, or whatever a broken answer raises: not up
            if replica.state is State.NEW and not replica.silent_reported:  # say so once: a typo, a dead host
                replica.silent_reported = True
                log.warning("verifier at %s does not answer (%s); it is asked again until it does",
                            replica.address, _reason(exc))
            with self._lock:
                if replica.state is State.REFUSED:
                    replica.retry_at = time.monotonic() + REFUSED_RETRY_S
                else:
                    self._back_off(replica)
            return
        if info.draining:  # shutting down: asked again (a restart) as one that does not answer
            with self._lock:
                self._back_off(replica)
            return
        try:
            self.check(info)
        except StatusError as exc:
            if replica.state is not State.REFUSED:
                log.error("verifier at %s refused: %s", replica.address, exc.message)
            with self._lock:
                replica.state, replica.retry_at = State.REFUSED, time.monotonic() + REFUSED_RETRY_S
                replica.refusal = exc.message
            return
        with self._lock:
            replica.state, replica.max_sessions = State.UP, info.max_sessions
        log.info("verifier at %s up (%d sessions)", replica.address, info.max_sessions)

    def _probe_draining(self, replica: Replica) -> None:
        """Whether a draining replica has stopped: once it holds none of our sessions and its Info
        fails or no longer says it drains (a restart), its link is closed and it is probed as a
        lost one (it comes back up once it answers). Its sessions' own messages find a failure."""
        try:
            draining = replica.ask_info().draining
        except Exception:  # grpc.RpcError, or a broken answer: it has stopped
            draining = False
        with self._lock:
            if draining or replica.sessions:
                replica.retry_at = time.monotonic() + DRAIN_PROBE_S
                return
            replica.state, replica.backoff_s, replica.retry_at = State.DOWN, 0.0, time.monotonic()
        replica.link.close()
        log.info("verifier at %s has drained", replica.address)
