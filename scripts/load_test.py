"""A bounded load test with a verifier restart: many concurrent clients against both services,
one verifier replica SIGKILLed (or stopped with SIGTERM) and started again once mid-run.

    python scripts/load_test.py [--clients 64] [--requests 20] [--max-new-tokens 32] [--replicas 2] \
        [--restart kill|drain] [--out-json FILE]

Both services run as processes on loopback with the shipped pair (models/default) on CPU
(`bench.serve.Service`): `--replicas` verifiers, each with room for every client, and one
drafter pointed at all of them. After one warm-up request per client, `--clients` clients each send
`--requests` streaming Generate requests one after another. Once `--kill-at` of them have
finished, replica 0 is killed with SIGKILL, stays down `--down-s` seconds and is started
again on the same port; the drafter re-opens the sessions it lost there on another replica, or
on it once it is back (`--recovery-timeout`), and queues new requests meanwhile. With
`--restart drain` it gets SIGTERM instead, as a rolling restart does: it finishes its open
sessions while the drafter opens new ones on the other replicas, and exits once none is left
(so no session with tokens re-opens); it is started again once it has exited. Prompts are
windows of the target's held-out text. Every prompt is sent twice (greedy), by two clients at
different times, so a pair whose outputs differ means an output that depended on the batch
or on the restart.

Reported: failed requests (target 0), differing pairs, latency p50 / p99 / max and
time to first token p50 / p99, the outage, whether every slot of every replica is free at the end
(`Info().free_sessions`) and the drafter serves, and the resident memory (VmRSS) of every
process before the run and after it (replica 0's "after" is its restarted process).
Prints a table and, with --out-json, writes the numbers; exits non-zero when a request failed or
capacity is not back to full. A differing pair is reported, not failed: on CPU, float32 GEMMs
are not batch-invariant, and a near-tie can flip a greedy token (seen as 1 pair in 640 with
random-token prompts, neither request near the restart).
Nothing it starts is left running.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would be first on sys.path: the repository root goes there.
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT_DIR not in sys.path:
    sys.path.insert(0, ROOT_DIR)

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.serve import ROOT as SERVE_ROOT
from bench.serve import Service, free_port, heldout_windows, percentile
from common.config import load_target_config
from bench.bench_timing import out_json
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc

ROOT = Path(ROOT_DIR)


def log(message: str) -> None:
    print(f"[load] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/load_test.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default="models/default/target", help="target checkpoint (default the shipped one)")
    p.add_argument("--draft", default="models/default/draft", help="draft checkpoint (default the shipped one)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--requests", type=int, default=20, help="requests per client after its warm-up (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens: windows of the target's held-out text, random ids where "
                   "it has too few (default 32)")
    p.add_argument("--tree-budget", type=int, default=8, help="drafted nodes per tree (default 8)")
    p.add_argument("--kill-at", type=float, default=0.3,
                   help="kill replica 0 once this fraction of the requests has finished (default 0.3; "
                        "a negative value: no kill)")
    p.add_argument("--down-s", type=float, default=1.0, help="seconds replica 0 stays down (default 1)")
    p.add_argument("--restart", choices=("kill", "drain"), default="kill",
                   help="how replica 0 is stopped: SIGKILL, or SIGTERM and its drain (default kill)")
    p.add_argument("--replicas", type=int, default=2,
                   help="verifier processes, the drafter pointed at all of them (default 2)")
    p.add_argument("--recovery-timeout", type=float, default=300.0,
                   help="the drafter's --recovery-timeout and --queue-timeout in s (default 300)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request in s (default 600)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds a service may take to start (default 300)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--log-dir", help="keep the services' logs here (default: a temporary folder, removed)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    if a.clients < 1 or a.requests < 1 or a.max_new_tokens < 1 or a.prompt_len < 1 or a.tree_budget < 0:
        p.error("--clients, --requests, --max-new-tokens and --prompt-len must be >= 1, --tree-budget >= 0")
    if a.kill_at >= 1:
        p.error("--kill-at must be below 1 (a negative value: no kill)")
    if a.replicas < 1:
        p.error(f"--replicas must be >= 1, got {a.replicas}")
    if not a.down_s >= 0:
        p.error(f"--down-s must be >= 0, got {a.down_s}")
    a.target, a.draft = str((ROOT / a.target).resolve()), str((ROOT / a.draft).resolve())
    return a


# -- the services --------------------------------------------------------------------------------


# Run in a fresh interpreter before the service's own: ask for SIGTERM when the parent thread
# ends (PR_SET_PDEATHSIG, kept across exec), then become the service.
_DIE_WITH_PARENT_EXEC = "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15); os.execv(sys.argv[1], sys.argv[1:])"


class ThreadSafeService(Service):
    """A `Service` started without a pre-exec hook: the verifier is restarted while the clients'
    threads use gRPC, and Python code run between fork and exec there can crash the child."""

    def start(self, timeout_s: float) -> ThreadSafeService:
        log(f"starting {self.name}: {' '.join(self.argv)}")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(SERVE_ROOT), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT_EXEC, *self.argv], cwd=SERVE_ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.port = self._wait_listening(t0 + timeout_s, timeout_s)
        self._wait_serving(t0 + timeout_s)
        self.startup_s = time.perf_counter() - t0
        log(f"{self.name} listening on 127.0.0.1:{self.port} after {self.startup_s:.1f} s")
        return self


def verifier_service(a: argparse.Namespace, port: int, logs: Path, replica: int, run: int) -> Service:
    """Verifier replica `replica`, its `run`-th process; each has room for every client."""
    max_seq_len = -(-(a.prompt_len + a.max_new_tokens + a.tree_budget + 1) // 64) * 64
    argv = [sys.executable, "-m", "verifier_svc", "--target", a.target, "--draft", a.draft, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-sessions", str(a.clients), "--max-seq-len",
            str(max_seq_len), "--max-tree-nodes", str(a.tree_budget + 1)]
    return ThreadSafeService(f"verifier{replica}#{run}", argv, logs / f"verifier{replica}-{run}.log")


def drafter_service(a: argparse.Namespace, verifier_ports: list[int], logs: Path) -> Service:
    replicas = ",".join(f"127.0.0.1:{port}" for port in verifier_ports)
    argv = [sys.executable, "-m", "drafter_svc", "--target", a.target, "--draft", a.draft, "--host", "127.0.0.1",
            "--port", "0", "--device", "cpu", "--verifier", replicas,
            "--tree-budget", str(a.tree_budget), "--max-new-tokens", str(a.max_new_tokens),
            "--max-concurrent", str(a.clients), "--recovery-timeout", str(a.recovery_timeout),
            "--queue-timeout", str(a.recovery_timeout)]
    return ThreadSafeService("drafter", argv, logs / "drafter.log")


def rss_mib(service: Service) -> float | None:
    """The process's resident memory (VmRSS) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{service.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def free_sessions(address: str) -> int:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=10).free_sessions


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# -- the clients -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    client: int
    prompt: int  # index into the prompt pool
    tokens: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    ttft_s: float | None = None
    finish_reason: str = ""
    error: str = ""
    started: float = 0.0  # perf_counter at the start
    ended: float = 0.0  # perf_counter at the end


async def generate(stub, client: int, prompt_index: int, prompt: list[int], a: argparse.Namespace) -> Outcome:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=a.max_new_tokens,
                                 tree_budget=a.tree_budget)
    out = Outcome(client, prompt_index)
    start = out.started = time.perf_counter()
    try:
        async for reply in stub.Generate(request, timeout=a.request_timeout):
            if reply.HasField("final"):
                out.finish_reason = reply.final.finish_reason
            elif reply.delta.token_ids:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                out.tokens.extend(reply.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    out.ended = time.perf_counter()
    out.latency_s = out.ended - start
    return out


def make_prompts(a: argparse.Namespace, count: int, rng: random.Random) -> list[list[int]]:
    """`count` distinct prompts: windows of the target's held-out text (`bench.serve.heldout_windows`),
    spread over it, else random token ids (whose flat next-token distributions make near-ties,
    where float32 batch numerics can flip a greedy token)."""
    try:
        pool = heldout_windows(Path(a.target), a.prompt_len)
    except (OSError, ValueError):
        pool = []
    if len(pool) >= count:
        return [list(pool[i * len(pool) // count]) for i in range(count)]
    log(f"{len(pool)} held-out prompts of {a.prompt_len} tokens, {count} needed: random token ids instead")
    vocab = load_target_config(a.target).vocab_size
    return [[rng.randrange(1, vocab) for _ in range(a.prompt_len)] for _ in range(count)]


class Run:
    """The clients, and replica 0's kill and restart once `kill_after` requests have finished."""

    def __init__(self, a: argparse.Namespace, drafter: Service, verifiers: list[Service], logs: Path,
                 ports: list[int]):
        self.a, self.drafter, self.logs, self.ports = a, drafter, logs, ports
        self.verifiers = list(verifiers)  # the replicas' current processes
        rng = random.Random(a.seed)
        total = a.clients * a.requests
        self.prompts = make_prompts(a, (total + 1) // 2, rng)
        # Each prompt twice, spread over the run: client c's request r takes slot r * clients + c.
        order = [i // 2 for i in range(2 * len(self.prompts))][:total]
        rng.shuffle(order)
        self.plan = [[order[r * a.clients + c] for r in range(a.requests)] for c in range(a.clients)]
        self.kill_after = int(a.kill_at * total) if a.kill_at >= 0 else None
        self.finished = 0
        self.kill_due = threading.Event()  # set by the clients' loop, waited for by the main thread
        self.outage: dict[str, float] = {}
        self.killed_at = self.back_at = 0.0  # perf_counter of the kill and of the restarted verifier serving

    async def client(self, stub, c: int) -> list[Outcome]:
        outcomes = []
        for index in self.plan[c]:
            outcomes.append(await generate(stub, c, index, self.prompts[index], self.a))
            self.finished += 1
            if self.kill_after is not None and self.finished >= self.kill_after:
                self.kill_due.set()
        return outcomes

    def restart_verifier(self) -> None:
        """SIGKILL (or SIGTERM) replica 0, wait for it to exit, then `--down-s`, then start a new one
        on the same port. On the main thread, while the clients run on theirs: a service gets
        SIGTERM when the thread that started it ends."""
        at_request = self.finished  # the other replicas keep serving while this one is down
        proc = self.verifiers[0].proc
        log(f"{at_request} requests finished: {'SIGTERM' if self.a.restart == 'drain' else 'SIGKILL'} to verifier 0 "
            f"(pid {proc.pid})")
        killed = self.killed_at = time.perf_counter()
        if self.a.restart == "drain":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.kill()
        proc.wait()
        exited = time.perf_counter() - killed  # the drain's time
        time.sleep(self.a.down_s)
        self.verifiers[0] = verifier_service(self.a, self.ports[0], self.logs, 0, 2)
        self.verifiers[0].start(self.a.startup_timeout)
        self.back_at = time.perf_counter()
        self.outage = {"at_request": at_request, "verifier_down_s": time.perf_counter() - killed,
                       "exit_s": exited, "exit_code": proc.returncode, "restart_s": self.verifiers[0].startup_s}
        log(f"verifier 0 back after {self.outage['verifier_down_s']:.1f} s")

    async def warm_up(self) -> None:
        async with grpc.aio.insecure_channel(self.drafter.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GenerationStub(channel)
            results = await asyncio.gather(*(generate(stub, c, -1, self.prompts[c % len(self.prompts)], self.a)
                                             for c in range(self.a.clients)))
        bad = [r.error for r in results if r.error]
        if bad:
            raise RuntimeError(f"{len(bad)} warm-up requests failed: {bad[0]}")

    async def clients(self) -> tuple[list[Outcome], float]:
        channels = [grpc.aio.insecure_channel(self.drafter.address, options=CHANNEL_OPTIONS)
                    for _ in range(max(1, min(8, self.a.clients // 8)))]
        try:
            stubs = [pb_grpc.GenerationStub(ch) for ch in channels]
            started = time.perf_counter()
            per_client = await asyncio.gather(*(self.client(stubs[c % len(stubs)], c) for c in range(self.a.clients)))
            wall = time.perf_counter() - started
        finally:
            for ch in channels:
                await ch.close()
        return [o for outcomes in per_client for o in outcomes], wall

    def run(self) -> tuple[list[Outcome], float]:
        """The clients on a thread of their own; the kill and restart on this one."""
        done: list = []
        thread = threading.Thread(target=lambda: done.append(asyncio.run(self.clients())), name="clients")
        thread.start()
        if self.kill_after is not None:
            while not self.kill_due.wait(0.2) and thread.is_alive():
                pass
            if self.kill_due.is_set():
                self.restart_verifier()
            else:
                log("every request finished before the verifier was killed: --kill-at is too late")
        thread.join()
        if not done:
            raise RuntimeError("the clients failed (see above)")
        return done[0]


# -- the report ------------------------------------------------------------------------------------


def summarise(a: argparse.Namespace, outcomes: list[Outcome], wall: float, run: Run, memory: dict,
              capacity: dict, reopened: list[tuple[int, float]]) -> dict:
    """The report's numbers; `reopened`: (its tokens so far, seconds since its loss) of each re-open."""
    failed = [o for o in outcomes if o.error]
    by_prompt: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if not o.error:
            by_prompt.setdefault(o.prompt, []).append(o)
    pairs = [v for v in by_prompt.values() if len(v) == 2]
    differing = [(x, y) for x, y in pairs if x.tokens != y.tokens]

    def across_outage(o: Outcome) -> bool:  # in flight when the verifier was killed
        return bool(run.killed_at) and o.started < run.killed_at < o.ended
    latencies = [o.latency_s for o in outcomes if not o.error]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o.finish_reason or "error"] = reasons.get(o.finish_reason or "error", 0) + 1
    tokens = sum(len(o.tokens) for o in outcomes)

    def ms(value):
        return None if value is None else round(value * 1e3, 1)

    return {
        "clients": a.clients, "requests_per_client": a.requests, "requests": len(outcomes), "replicas": a.replicas,
        "restart": a.restart,
        "max_new_tokens": a.max_new_tokens, "prompt_len": a.prompt_len, "tree_budget": a.tree_budget,
        "failed": len(failed), "errors": sorted({o.error for o in failed})[:10],
        "pairs_compared": len(pairs), "pairs_differing": len(differing), "finish_reasons": reasons,
        "differing": [{"prompt": x.prompt, "tokens": [x.tokens, y.tokens], "across_outage": [across_outage(x),
                       across_outage(y)]} for x, y in differing[:10]],
        "requests_across_outage": sum(map(across_outage, outcomes)),
        "pairs_differing_across_outage": sum(1 for x, y in differing if across_outage(x) or across_outage(y)),
        "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "latency_ms": {"p50": ms(percentile(latencies, 50)), "p99": ms(percentile(latencies, 99)),
                       "max": ms(max(latencies, default=None))},
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p99": ms(percentile(ttfts, 99))},
        "outage": {k: round(v, 2) for k, v in run.outage.items()} | ({
            "sessions_reopened": len(reopened), "sessions_reopened_with_tokens": sum(1 for n, _ in reopened if n),
            "recovery_s": {"p50": percentile([s for _, s in reopened], 50),
                           "max": max((s for _, s in reopened), default=None)}}
            if run.outage else {}),
        "capacity": capacity, "rss_mib": memory,
    }


def print_table(r: dict) -> None:
    rows = [
        ("requests", f"{r['requests']} ({r['clients']} clients x {r['requests_per_client']})"),
        ("failed (target 0)", r["failed"]),
        ("pairs differing", (f"{r['pairs_differing']} of {r['pairs_compared']} "
                             f"({r['pairs_differing_across_outage']} with one in flight at the kill)")),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))),
        ("wall", f"{r['wall_s']} s, {r['tokens']} tokens, {r['tokens_per_s']} tok/s"),
        ("latency p50 / p99 / max", " / ".join(f"{r['latency_ms'][k]} ms" for k in ("p50", "p99", "max"))),
        ("ttft p50 / p99", " / ".join(f"{r['ttft_ms'][k]} ms" for k in ("p50", "p99"))),
        (f"replica 0 {'drained' if r['restart'] == 'drain' else 'killed'}",
         (f"after request {r['outage']['at_request']}, exited after {r['outage']['exit_s']} s (code "
          f"{r['outage']['exit_code']}), down {r['outage']['verifier_down_s']} s (restart {r['outage']['restart_s']} s), "
          f"{r['outage']['sessions_reopened']} sessions re-opened ({r['outage']['sessions_reopened_with_tokens']} with "
          f"tokens), {r['requests_across_outage']} requests in flight") if r["outage"] else "no"),
        ("session recovery p50 / max", (" / ".join(f"{r['outage']['recovery_s'][k]:.2f} s" for k in ("p50", "max"))
                                        if r["outage"] and r["outage"]["sessions_reopened"] else "-")),
        ("capacity back to full", (" / ".join(map(str, r["capacity"]["free_sessions"]))
                                   + f" of {r['capacity']['max_sessions']} slots free (per replica), drafter "
                                   f"{'SERVING' if r['capacity']['drafter_serving'] else 'NOT serving'}")),
    ]
    for name in r["rss_mib"]:
        m = r["rss_mib"][name]
        rows.append((f"{name} RSS before / after", f"{m['before']:.0f} / {m['after']:.0f} MiB"
                     if m["before"] is not None and m["after"] is not None else str(m)))
    width = max(len(k) for k, _ in rows)
    print(f"\nload test: {r['clients']} clients x {r['requests_per_client']} requests, "
          f"{r['max_new_tokens']} new tokens, tree budget {r['tree_budget']}, {r['replicas']} verifier replicas, CPU")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    for error in r["errors"]:
        print(f"  error: {error}")


def started(services: list[Service], run: Run | None) -> list[Service]:
    """Every service process started: the first verifiers, the drafter, and the restarted replica 0."""
    every = services + (run.verifiers if run is not None else [])
    return list({id(s): s for s in every if s.proc is not None}.values())


def capacity_back(verifiers: list[Service], max_sessions: int, timeout_s: float = 30.0) -> list[int]:
    """Each replica's free sessions, once every one has all `max_sessions` free (or after `timeout_s`:
    sessions close as their last replies are read)."""
    deadline = time.monotonic() + timeout_s
    while (free := [free_sessions(v.address) for v in verifiers]) != [max_sessions] * len(verifiers) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logs = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="load-test-"))
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(a.replicas)]
    services: list[Service] = []
    run = None
    try:
        verifiers = []
        for replica, port in enumerate(ports):
            verifiers.append(verifier_service(a, port, logs, replica, 1).start(a.startup_timeout))
            services.append(verifiers[-1])
        drafter = drafter_service(a, ports, logs).start(a.startup_timeout)
        services.append(drafter)
        run = Run(a, drafter, verifiers, logs, ports)
        asyncio.run(run.warm_up())
        memory = {"drafter": {"before": rss_mib(drafter)}}
        memory |= {f"verifier{i}": {"before": rss_mib(v)} for i, v in enumerate(verifiers)}
        log(f"warmed up; {a.clients} clients x {a.requests} requests")
        outcomes, wall = run.run()
        free = capacity_back(run.verifiers, a.clients)
        capacity = {"free_sessions": free, "max_sessions": a.clients, "drafter_serving": serving(drafter.address)}
        memory["drafter"]["after"] = rss_mib(drafter)
        for i, v in enumerate(run.verifiers):
            memory[f"verifier{i}"]["after"] = rss_mib(v)
        # drafter_svc.scheduler logs each re-open with how long after the lost link it came
        reopened = [(int(n), float(s)) for n, s in re.findall(r" re-opened after (\d+) tokens, ([0-9.]+) s after its ",
                                                              drafter.log_path.read_text(errors="replace"))]
        result = summarise(a, outcomes, wall, run, memory, capacity, reopened)
    except BaseException:
        for s in started(services, run):
            s.print_log_tail()
        raise
    finally:
        for s in reversed(started(services, run)):
            s.stop()
        if not a.log_dir:
            shutil.rmtree(logs, ignore_errors=True)
    print_table(result)
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.out_json}")
    ok = result["failed"] == 0 and capacity["free_sessions"] == [a.clients] * a.replicas and capacity["drafter_serving"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
