"""Concurrency benchmark of the real services: N streaming clients against a drafter + verifier.

    PYTHONPATH=. python bench/serve.py --models qwen3-8b [--concurrency 1,4,8,16,32,64] [--taus 3,6] \
        [--max-new-tokens 128] [--out-json serve.json]
    PYTHONPATH=. python bench/serve.py --models default --device cuda [--accept-probs 0.7,0.9]
    PYTHONPATH=. python bench/serve.py --models default,qwen3-8b --out-json serve.json   # both setups
    PYTHONPATH=. python bench/serve.py --models default --device cpu --quick              # CPU smoke run
    PYTHONPATH=. python bench/serve.py --models qwen3-8b --small --device cpu --quick     # toy sizes, CPU
    PYTHONPATH=. python bench/serve.py --models default --delay-ms 5                      # 5 ms each way
    PYTHONPATH=. python bench/serve.py --models qwen3-8b --colocate                       # one process, one GPU

Both services run as their own processes on loopback (free ports, ready once each prints its
"listening on" line and answers SERVING on grpc.health.v1), and are stopped with SIGTERM
(then killed) however the run ends. The two services share this host, so the replies' feature rows
go through the verifier's shared-memory ring (`common/feature_ring.py`) unless `--no-feature-ring`;
`--ring-ab` runs each controlled-acceptance setting both ways (its inline twin named SETTING-inline);
so the link's messages go through the Unix socket the verifier offers (`common/socket_link.py`)
unless `--no-unix-socket`, and `--socket-ab` runs each setting through gRPC too (SETTING-grpc).
With `--delay-ms MS`, the drafters reach the verifier through
`bench/delay_proxy.py`, a TCP proxy (its own process) that delays every chunk by MS in each
direction: a link round trip gains 2 x MS, as between hosts (a userspace stand-in for netem), and
the rows travel inline and the messages through gRPC, as they would between hosts. With
`--colocate` there is no verifier service: each drafter runs with `--verifier local`, holding the
target in its own process (`--local-verifier-flags`: the flags the service would get), rounds
go in lockstep, and v-busy is not measured. Model setups (`--models`):

* `default`: the shipped trained pair (`--target`, `--draft`) through the real CLIs,
  `python -m verifier_svc` and `python -m drafter_svc`; prompts are token windows of the
  target's held-out standard-library files (`TARGET/corpus.json`).
* `qwen3-8b`: random weights at Qwen3-8B dimensions (36-layer target, 5-layer block-16 DFlash
  draft), built in memory by `bench/serve_roles.py`, which runs the same CLIs with only the
  checkpoint loaders swapped (the target gets a planted greedy successor per token, so that
  greedy outputs survive bf16 rounding; see there); prompts are random token ids. `--small`:
  toy dimensions.

Load: N clients at once (one grpc.aio stream each, the public `Generate` API, greedy, prompts
as token ids, every prompt distinct), each sending one short warm-up request (untimed), then
`--requests-per-client` requests one after another; a run's wall time is from the first
timed request to the last answer.

Runs, at every N: plain batched autoregressive decoding of the same target (`tree_budget 0`:
root-only trees, batched on the verifier like any others) over every prompt of the later
runs; with the `default` pair, tree mode at its real acceptance; then per `--accept-probs`
value (default: the p giving tau ~ 3 and ~ 6, tau = 1 + p (1 - p^D) / (1 - p), D = block
size - 1, found by bisection) the drafter restarted with `--bench-oracle`
(drafter_svc/oracle.py), fed the AR continuations, and tree mode (`--tree-budget`). The
drafter runs with its default `--pipelining auto` (lockstep here below 64 sessions: the two
services share one device); with `--lockstep` every oracle setting runs twice in the same run, with the
drafter started with `--pipelining on` and then `--pipelining off` (rows `SETTING-ls`). With
`--budgets 8,16,32,adaptive` every oracle setting runs once per budget (rows `SETTING bB`, with
the drafter's `--adaptive-budget off`) and once with `--adaptive-budget on` capped at the
largest (row `SETTING adaptive`; the verifier then measures its cost table, `--measure-costs on`).

Reported per (setting, N): completion tokens/s over all clients (tokens / wall time), tau
(mean of the responses' `Stats.mean_acceptance`; `tau_rounds` in the JSON = emitted tokens /
rounds), time to first token (request sent -> first token arrives, client side) p50 / p99,
inter-token latency p50 / p99 (per streamed delta after a request's first: the time since the
previous delta / the tokens it carries, one sample per token, pooled over clients), a
request's whole latency p50 / p99 (sent -> its stream ends; a change that brings the first
token sooner but the next ones later shows here), the
speed-up over AR at the same N, and `==AR`: the fraction of requests whose tokens equal the AR
tokens of the same prompt. Greedy decoding is lossless, so that is 1.0 up to rounding: in
bfloat16 the batch and tree shapes of the two runs round differently and near-ties flip
(`--dtype float32` checks it exactly). `v-busy` (`verifier_busy` in the JSON): the share of the
timed wall time the verifier spent in its model steps (the difference of its
`InfoResponse.busy_s` before and after), an upper bound on how busy its GPU was. A second table
splits the timed part of each run into its link messages, from both services' Prometheus
histograms (the drafter's `--http-port` /metrics and the verifier's `--metrics-port`, scraped
before and after): the drafter's draft step, tree build and link round trip, and the
verifier's step inside that round trip, as means per message. A third table (`steady` in the
JSON) gives the same over the run's steady window: from the moment the last client's first timed
request streams its first token to the moment the first client's last request ends, while every
client has its requests going (`SteadyWindow`; the services' /metrics scraped at both ends); a
finite run's ramp-up, when the prompts arrive together, and its drain, when clients end one by
one and the batch thins out, fall outside it. With `--repeats K` each (setting,
N) runs K times, one after another on the same services (its rows carry `repeat`), and a fourth
table (`repeat_summary` in the JSON) gives each one's median tok/s, min, max and spread; the
speed-ups are over plain decoding's median at the same N.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs ddtree_kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import contextlib
import ctypes
import json
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_timing import out_json, write_json
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from verifier_svc.cuda_graphs import GraphConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = "models/default/target"
DEFAULT_DRAFT = "models/default/draft"
LISTENING = re.compile(r"listening on \S+?:(\d+)")
WARMUP_TOKENS = 16  # new tokens of each client's warm-up request


def log(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------------


def _ints(text: str, minimum: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1."""
    return _ints(text, 1)


def count_list(text: str) -> list[int]:
    """Comma-separated integers >= 0."""
    return _ints(text, 0)


def add_setup_flags(p: argparse.ArgumentParser) -> None:
    """The model setup's flags, shared with bench/prefill_stall.py: --small, --target, --draft, --device, --dtype."""
    p.add_argument("--small", action="store_true", help="qwen3-8b setup at toy dimensions (runs on CPU)")
    p.add_argument("--target", help=f"target checkpoint of the default setup (default {DEFAULT_TARGET})")
    p.add_argument("--draft", help=f"draft checkpoint of the default setup (default {DEFAULT_DRAFT})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of both services (default cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="model dtype of both services; auto = bfloat16 on CUDA, float32 on CPU (default auto)")


def budget_list(text: str) -> list[int | str]:
    """Comma-separated budgets >= 0 and/or "adaptive"."""
    try:
        out = [x.strip() if x.strip() == "adaptive" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected budgets and/or 'adaptive', got {text!r}") from None
    if not out or any(isinstance(x, int) and x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected budgets >= 0 and/or 'adaptive', got {text!r}")
    return out


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/serve.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="qwen3-8b",
                   help="model setups, comma-separated: default (the shipped trained pair) and/or qwen3-8b "
                        "(random weights at Qwen3-8B dimensions) (default qwen3-8b)")
    add_setup_flags(p)
    p.add_argument("--drafter-device", default=None,
                   help="the drafter's own device, e.g. cuda:1 beside a verifier on cuda:0 (default: --device)")
    p.add_argument("--verifier-tp", type=int, default=1,
                   help="the verifier's --tensor-parallel ranks, one GPU each from --device on (default 1)")
    p.add_argument("--concurrency", type=int_list, default=None,
                   help="concurrent clients N, comma-separated (default 1,4,8,16,32,64; 1,4 with --quick)")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="timed requests per client and N, after one warm-up request (default 2; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each mode, setting and N, one after another on the same services; the "
                        "tables give every run, and with more than one a summary gives each one's median tok/s and "
                        "spread (single runs of one tree differ by a few percent: compare medians) (default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 32 with --quick)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per request (default 128; 32 with --quick); fewer when EOS comes first")
    p.add_argument("--tree-budget", type=int, default=15,
                   help="drafted nodes per tree in tree mode (default 15, the drafter's)")
    p.add_argument("--taus", type=float_list, default=[3.0, 6.0],
                   help="target acceptance lengths for the oracle runs; each becomes an accept probability "
                        "(default 3,6)")
    p.add_argument("--accept-probs", type=float_list, default=None,
                   help="oracle accept probabilities, comma-separated, instead of --taus")
    p.add_argument("--no-real", action="store_true",
                   help="default setup: skip tree mode at the pair's real acceptance (no oracle)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="verifier KV slots and drafter --max-concurrent (default max of --concurrency)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="verifier tokens per session (default prompt + new tokens + tree, rounded up to 64)")
    p.add_argument("--graph-batches", type=int_list, default=None,
                   help="verifier --graph-batches (default the --concurrency values: the buckets the run needs)")
    p.add_argument("--graph-trees", default=None,
                   help="verifier --graph-trees (default 0,TREE_BUDGET: AR and tree mode)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="both services without CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="prompt and oracle seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="smoke-run defaults: concurrency 1,4, 1 request per client, 32-token prompts, 32 new tokens")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a service may take to start listening (default 900)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request in s (default 600)")
    p.add_argument("--log-dir", default=None,
                   help="keep the services' logs and the oracle files here (default: a temporary folder, removed)")
    p.add_argument("--deterministic", action="store_true",
                   help="the verifier with batch-invariant kernels (--deterministic), for its cost against the default")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts prefill through the verifier's captured CUDA graphs (its default; the verify "
                        "graphs then include a tree bucket that holds the prompt); --no-prefill-graphs: the "
                        "verifier with --no-prefill-graphs, prefilling eagerly")
    p.add_argument("--mixed-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="prompt chunks beside trees ride the trees' verify forward where that costs less (the "
                        "verifier's default); --no-mixed-prompts: the verifier with --no-mixed-prompts, every chunk "
                        "prefilled on its own")
    p.add_argument("--lockstep", action="store_true",
                   help="also run each controlled-acceptance setting with the drafter in lockstep (--pipelining off; "
                        "its rows are named SETTING-ls), to compare with the default pipelined rounds")
    p.add_argument("--sequential", action="store_true",
                   help="also run each N > 1's timed requests one after another through one client, and report "
                        "the concurrent wall time over that sequential one (conc/seq) and whether the outputs match")
    p.add_argument("--colocate", action="store_true",
                   help="no verifier service: each drafter loads the target itself (--verifier local, given the "
                        "verifier flags this run would give the service), one process and CUDA context for both models")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="delay the drafter <-> verifier link this many ms each way, through bench/delay_proxy.py "
                        "(default 0: direct)")
    p.add_argument("--no-feature-ring", action="store_true",
                   help="the drafters take their feature rows inline through gRPC, as from another host, instead of "
                        "through the verifier's shared-memory ring (always so with --delay-ms, which stands in for "
                        "another host)")
    p.add_argument("--ring-ab", action="store_true",
                   help="also run each controlled-acceptance setting with the drafter taking its rows inline "
                        "(--no-feature-ring; its rows are named SETTING-inline), to compare with the ring's in one run")
    p.add_argument("--no-unix-socket", action="store_true",
                   help="the drafters' link messages go through the gRPC stream, as from another host, instead of "
                        "through the Unix socket the verifier offers (always so with --delay-ms)")
    p.add_argument("--socket-ab", action="store_true",
                   help="also run each controlled-acceptance setting with the drafter's messages through gRPC "
                        "(--no-unix-socket; its rows are named SETTING-grpc), to compare with the socket's in one run")
    p.add_argument("--budgets", type=budget_list, default=None,
                   help="tree budgets to compare in each controlled-acceptance setting, e.g. 8,16,32,adaptive "
                        "(adaptive: the drafter with --adaptive-budget on, capped at the largest fixed one; the "
                        "others with --adaptive-budget off); default: --tree-budget alone, the drafter's default")
    p.add_argument("--timeline", metavar="DIR", default=None,
                   help="qwen3-8b setup only: both services record host spans and device intervals into DIR "
                        "(summarise with bench/timeline.py DIR)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    quick = a.quick
    a.concurrency = a.concurrency or ([1, 4] if quick else [1, 4, 8, 16, 32, 64])
    given = {"--requests-per-client": a.requests_per_client, "--prompt-len": a.prompt_len,
             "--max-new-tokens": a.max_new_tokens, "--max-seq-len": a.max_seq_len, "--max-sessions": a.max_sessions}
    for flag, value in given.items():  # None: the default; 0 would read as one below
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    a.requests_per_client = a.requests_per_client or (1 if quick else 2)
    a.prompt_len = a.prompt_len or (32 if quick else 128)
    a.max_new_tokens = a.max_new_tokens or (32 if quick else 128)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    # The services run in the repository root: the defaults are relative to it, given paths to here.
    a.target = str(Path(a.target).resolve()) if a.target else DEFAULT_TARGET
    a.draft = str(Path(a.draft).resolve()) if a.draft else DEFAULT_DRAFT
    a.max_sessions = a.max_sessions or max(a.concurrency)
    if a.budgets is not None:  # the largest one sizes the trees
        a.tree_budget = max([b for b in a.budgets if b != "adaptive"], default=a.tree_budget)
    needed = a.prompt_len + a.max_new_tokens + a.tree_budget + 1
    if a.max_seq_len is not None and a.max_seq_len < needed:
        p.error(f"--max-seq-len {a.max_seq_len} does not hold a request: --prompt-len + --max-new-tokens + the "
                f"largest tree + 1 = {needed}")
    a.max_seq_len = a.max_seq_len or -(-needed // 64) * 64
    a.graph_batches = a.graph_batches or sorted(set(a.concurrency))
    # With --prefill-graphs the prompts need a tree bucket that holds them (and its cache headroom).
    prefill_bucket = next((b for b in GraphConfig.tree_buckets if b + 1 >= a.prompt_len), 0) if a.prefill_graphs else 0
    a.verifier_tree_nodes = max(a.tree_budget, prefill_bucket) + 1
    a.graph_trees = a.graph_trees or ",".join(map(str, sorted({0, a.tree_budget, prefill_bucket} | {
        b for b in a.budgets or () if b != "adaptive"})))
    bad = [m for m in a.models if m not in ("default", "qwen3-8b")]
    if a.timeline and a.models != ["qwen3-8b"]:
        p.error("--timeline needs --models qwen3-8b (the roles of bench/serve_roles.py record it)")
    if bad or not a.models:
        p.error(f"--models takes default and/or qwen3-8b, got {','.join(bad) or 'nothing'}")
    if min(a.requests_per_client, a.repeats, a.prompt_len, a.max_new_tokens, a.tree_budget) < 1:
        p.error("--requests-per-client, --repeats, --prompt-len, --max-new-tokens and --tree-budget must be >= 1")
    if a.max_sessions < max(a.concurrency):
        p.error(f"--max-sessions {a.max_sessions} is below the largest concurrency {max(a.concurrency)}")
    if a.delay_ms < 0:
        p.error("--delay-ms must be >= 0")
    if a.colocate and (a.delay_ms or a.verifier_tp > 1 or a.lockstep or a.ring_ab or a.no_feature_ring
                       or a.socket_ab or a.no_unix_socket):
        p.error("--colocate has no link to delay or to carry rows, no verifier to shard and only lockstep rounds")
    if a.accept_probs is not None and not all(0 <= x <= 1 for x in a.accept_probs):
        p.error("--accept-probs must be in [0, 1]")
    return a


# ---------------------------------------------------------------------------------------
# Controlled acceptance.
# ---------------------------------------------------------------------------------------


def tau_of(p: float, depth: int) -> float:
    """Expected tokens per round of a chain accepting each of `depth` drafted tokens with probability p."""
    return 1.0 + sum(p ** d for d in range(1, depth + 1))


def prob_for_tau(tau: float, depth: int) -> float:
    """The p with tau_of(p, depth) == tau, by bisection (tau is increasing in p)."""
    if not 1.0 <= tau <= depth + 1:
        raise ValueError(f"tau {tau} is outside [1, {depth + 1}] for a block of {depth} drafted tokens")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_of(mid, depth) < tau else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Setting:
    """One drafter configuration of the tree-mode runs."""
    name: str
    accept_prob: float | None = None  # None: no oracle (the draft's real acceptance)
    target_tau: float | None = None
    lockstep: bool = False  # the drafter started with --pipelining off
    budget: int | None = None  # the requests' tree_budget (None: --tree-budget)
    adaptive: bool = False  # the drafter started with --adaptive-budget on (the budget is then a cap)
    inline: bool = False  # the drafter started with --no-feature-ring (rows inline, as from another host)
    grpc: bool = False  # the drafter started with --no-unix-socket (messages through gRPC, as from another host)


def oracle_settings(a: argparse.Namespace, block_size: int) -> list[Setting]:
    """The controlled-acceptance settings, each followed by its lockstep twin with --lockstep."""
    depth = block_size - 1
    if a.accept_probs is not None:
        settings = [Setting(f"p={p:.3f}", p, tau_of(p, depth)) for p in a.accept_probs]
    else:
        settings = []
        for tau in a.taus:
            try:
                p = prob_for_tau(tau, depth)
            except ValueError as exc:
                raise SystemExit(f"error: --taus: {exc}") from None
            log(f"tau {tau:g} with {depth} drafted tokens per block -> accept_prob {p:.4f}")
            settings.append(Setting(f"tau~{tau:g}", p, tau))
    if a.lockstep:
        settings = [x for s in settings
                    for x in (s, Setting(s.name + "-ls", s.accept_prob, s.target_tau, lockstep=True))]
    if a.ring_ab:
        settings = [x for s in settings for x in (s, replace(s, name=s.name + "-inline", inline=True))]
    if a.socket_ab:
        settings = [x for s in settings for x in (s, replace(s, name=s.name + "-grpc", grpc=True))]
    if a.budgets is None:
        return settings
    fixed = [b for b in a.budgets if b != "adaptive"]
    cap = max(fixed, default=a.tree_budget)
    return [replace(s, name=f"{s.name} " + ("adaptive" if b == "adaptive" else f"b{b}"),
                                budget=cap if b == "adaptive" else b, adaptive=b == "adaptive")
            for s in settings for b in a.budgets]


def write_oracle(path: Path, accept_prob: float, continuations: dict[tuple[int, ...], list[int]], seed: int) -> None:
    """The --bench-oracle file (drafter_svc/oracle.py's format)."""
    rows = [{"prompt_token_ids": list(prompt), "tokens": tokens} for prompt, tokens in continuations.items()]
    path.write_text(json.dumps({"accept_prob": accept_prob, "seed": seed, "continuations": rows}))


# ---------------------------------------------------------------------------------------
# The services.
# ---------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the benchmark dies without cleaning up (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A port free right now on loopback (for the services' HTTP endpoints, which take no port 0)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Service:
    """One service process: started on a free port, ready when it prints its port and is SERVING."""

    def __init__(self, name: str, argv: list[str], log_path: Path, metrics_port: int = 0):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.metrics_port = metrics_port  # where it serves /metrics (the flag is in argv), 0 = nowhere
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.startup_s = 0.0

    def start(self, timeout_s: float) -> "Service":
        log(f"starting {self.name}: {' '.join(self.argv)}")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.port = self._wait_listening(t0 + timeout_s, timeout_s)
        self._wait_serving(t0 + timeout_s)
        self.startup_s = time.perf_counter() - t0
        log(f"{self.name} listening on 127.0.0.1:{self.port} after {self.startup_s:.1f} s")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _wait_listening(self, deadline: float, timeout_s: float) -> int:
        while time.perf_counter() < deadline:
            found = LISTENING.search(self.log_path.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                self.fail(f"exited with code {self.proc.returncode} before listening")
            time.sleep(0.2)
        self.fail(f"did not start listening within {timeout_s:.0f} s")

    def _wait_serving(self, deadline: float) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.perf_counter() < deadline:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        self.fail("did not report SERVING")

    def print_log_tail(self, lines: int = 30) -> None:
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        sys.stderr.write("".join(f"  {self.name}| {line}\n" for line in tail))

    def fail(self, why: str):
        self.print_log_tail()
        raise RuntimeError(f"{self.name} {why} (log above)")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not stop within {timeout_s:.0f} s: killing it")
            self.proc.kill()
            self.proc.wait()
        log(f"{self.name} stopped (exit {self.proc.returncode})")


@dataclass
class Setup:
    """A model setup: how to start its two services, and what its prompts and oracle need."""
    name: str
    verifier_argv: list[str]
    drafter_argv: list[str]  # without --verifier / --bench-oracle
    block_size: int
    vocab_size: int
    real_acceptance: bool  # also run tree mode without the oracle
    heldout_target: Path | None = None  # prompts from this target's held-out files; None = random ids


def common_verifier_flags(a: argparse.Namespace, service: bool = True) -> list[str]:
    """The verifier's flags; service=False: without its address (an in-process verifier's)."""
    flags = ["--host", "127.0.0.1", "--port", "0"] if service else []
    flags += ["--device", a.device, "--dtype", a.dtype, "--max-sessions", str(a.max_sessions),
             "--max-seq-len", str(a.max_seq_len), "--max-tree-nodes", str(a.verifier_tree_nodes),
             "--graph-batches", ",".join(map(str, a.graph_batches)), "--graph-trees", a.graph_trees]
    flags += ["--measure-costs", "on"] if "adaptive" in (a.budgets or ()) else []
    flags += ["--deterministic"] if a.deterministic else []
    flags += [] if a.prefill_graphs else ["--no-prefill-graphs"]
    flags += [] if a.mixed_prompts else ["--no-mixed-prompts"]
    flags += ["--tensor-parallel", str(a.verifier_tp)] if a.verifier_tp > 1 else []
    return flags + (["--no-cuda-graphs"] if a.no_cuda_graphs else [])


def common_drafter_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--host", "127.0.0.1", "--port", "0", "--device", a.drafter_device or a.device, "--dtype", a.dtype,
             "--tree-budget", str(a.tree_budget),
             "--max-new-tokens", str(a.max_new_tokens), "--max-concurrent", str(a.max_sessions)]
    return flags + (["--no-cuda-graphs"] if a.no_cuda_graphs else [])


def make_setup(name: str, a: argparse.Namespace) -> Setup:
    python = sys.executable
    if name == "default":
        from common.config import load_draft_config, load_target_config

        pair = ["--target", a.target, "--draft", a.draft]
        return Setup("default", [python, "-m", "verifier_svc", *pair, *common_verifier_flags(a)],
                     [python, "-m", "drafter_svc", *pair, *common_drafter_flags(a)],
                     load_draft_config(ROOT / a.draft).block_size, load_target_config(ROOT / a.target).vocab_size,
                     real_acceptance=not a.no_real, heldout_target=ROOT / a.target)
    from bench.serve_roles import block_size
    from bench.verify import qwen3_8b_config

    roles = [python, "bench/serve_roles.py"]
    small = ["--small"] if a.small else []
    small += ["--timeline", str(Path(a.timeline).resolve())] if a.timeline else []
    return Setup("qwen3-8b" + (" (small)" if a.small else ""),
                 [*roles, "verifier", *small, *common_verifier_flags(a)],
                 [*roles, "drafter", *small, *common_drafter_flags(a)],
                 block_size(a.small), qwen3_8b_config(a.small).vocab_size, real_acceptance=False)


# ---------------------------------------------------------------------------------------
# Prompts: distinct per (N, client, request); request 0 of each client is its warm-up.
# ---------------------------------------------------------------------------------------


def heldout_windows(target_dir: Path, prompt_len: int) -> list[tuple[int, ...]]:
    """Every distinct `prompt_len`-token window of the target's held-out files, in order."""
    from common.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    heads = json.loads((target_dir / "corpus.json").read_text()).get("heldout_heads") or {}
    seen: dict[tuple[int, ...], None] = {}
    for _, text in sorted(heads.items()):
        ids = tokenizer.encode(text).ids
        for start in range(len(ids) - prompt_len + 1):
            seen.setdefault(tuple(ids[start:start + prompt_len]))
    return list(seen)


def make_prompts(setup: Setup, a: argparse.Namespace) -> dict[int, list[list[list[int]]]]:
    """prompts[N][client][request] (request 0 = warm-up), all distinct."""
    needed = sum(a.concurrency) * (1 + a.requests_per_client)
    if setup.heldout_target is not None:
        pool = heldout_windows(setup.heldout_target, a.prompt_len)
        if len(pool) < needed:
            raise SystemExit(f"error: the held-out files give {len(pool)} distinct {a.prompt_len}-token prompts, "
                             f"{needed} are needed: lower --prompt-len, --requests-per-client or --concurrency")
        chosen = [list(pool[i * len(pool) // needed]) for i in range(needed)]  # spread over the files
    else:
        rng = random.Random(a.seed)
        chosen = [[rng.randrange(setup.vocab_size) for _ in range(a.prompt_len)] for _ in range(needed)]
    if len({tuple(c) for c in chosen}) != needed:
        raise SystemExit("error: prompts repeat; use a longer --prompt-len")
    it = iter(chosen)
    return {n: [[next(it) for _ in range(1 + a.requests_per_client)] for _ in range(n)] for n in a.concurrency}


# ---------------------------------------------------------------------------------------
# The load.
# ---------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token after the first delta
    elapsed_s: float = 0.0
    finish_reason: str = ""
    rounds: int = 0
    mean_acceptance: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)
    error: str = ""
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) of each delta


class SteadyWindow:
    """The stretch of a run while every client has its requests going: from the moment the last
    client's first timed request streams its first token to the moment the first client's last
    request ends. A finite run ramps up (prompts arriving together) and drains (clients ending
    one by one, their sessions leaving the batch); this window counts neither. Both services'
    /metrics are scraped at its two ends, in a thread, so that the clients go on meanwhile; each
    end's time is its scrape's midpoint."""

    def __init__(self, clients: int, urls: list[str]):
        self.clients, self.urls = clients, urls
        self.waiting = clients  # clients whose first timed token has not come yet
        self.ended = 0  # clients whose requests have all ended
        self.begin: tuple[float, dict[str, float]] | None = None
        self.end: tuple[float, dict[str, float]] | None = None
        self._scrapes: list[asyncio.Task] = []

    def first_token(self) -> None:
        self.waiting -= 1
        if self.waiting == 0 and not self.ended:  # (a client that ended first leaves no window)
            self._scrapes.append(asyncio.ensure_future(self._mark("begin")))

    def client_done(self) -> None:
        self.ended += 1
        if self.ended == 1 and self.waiting == 0:  # the first client to end, once the window began
            self._scrapes.append(asyncio.ensure_future(self._mark("end")))

    async def _mark(self, which: str) -> None:
        start = time.perf_counter()
        values = await asyncio.to_thread(scrape, self.urls) if self.urls else {}
        setattr(self, which, ((start + time.perf_counter()) / 2, values))

    async def done(self) -> None:
        """Wait for the scrapes under way."""
        await asyncio.gather(*self._scrapes)

    def summary(self, requests: list[Request]) -> dict | None:
        """The window's length, the completion tokens a second streamed in it, and the step breakdown
        over it (`step_breakdown`; rounds_per_s included); None when the first client ended before
        the last one began."""
        if self.begin is None or self.end is None:
            return None
        (t0, before), (t1, after) = self.begin, self.end
        window = t1 - t0
        tokens = sum(n for r in requests for t, n in r.deltas if t0 <= t <= t1)
        out = {"window_s": window, "completion_tokens": tokens, "tokens_per_s": tokens / window if window > 0 else None}
        out.update(step_breakdown(before, after, window) if self.urls else {})
        return out


async def generate(stub, prompt: list[int], budget: int, max_new: int, timeout_s: float,
                   on_first_token: Callable[[], None] | None = None) -> Request:
    """One streaming Generate call, timed at the client; `on_first_token` is called as its first token arrives."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new, tree_budget=budget)
    rec = Request(prompt)
    start = last = time.perf_counter()
    try:
        async for reply in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if reply.HasField("final"):
                final = reply.final
                rec.finish_reason, rec.rounds = final.finish_reason, final.stats.rounds
                rec.mean_acceptance = final.stats.mean_acceptance
                rec.acceptance_lengths = list(final.stats.acceptance_lengths)
                continue
            n = len(reply.delta.token_ids)
            if n == 0:  # text only (the held-back tail)
                continue
            if rec.ttft_s is None:
                rec.ttft_s = now - start
                if on_first_token is not None:
                    on_first_token()
            else:
                rec.itl_s.extend([(now - last) / n] * n)
            last = now
            rec.deltas.append((now, n))
            rec.tokens.extend(reply.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.elapsed_s = time.perf_counter() - start
    return rec


async def client(stub, prompts: list[list[int]], budget: int, max_new: int, timeout_s: float,
                 window: SteadyWindow | None = None) -> list[Request]:
    """One client's requests, one after another; it tells `window` of its first token and of its end."""
    done = []
    for p in prompts:
        first = window.first_token if window is not None and not done else None
        done.append(await generate(stub, p, budget, max_new, timeout_s, on_first_token=first))
    if window is not None:
        window.client_done()
    return done


# Histograms of both services' /metrics whose means per observation make the step breakdown.
STEP_PARTS = {"draft": "ddtree_drafter_draft_seconds", "build": "ddtree_drafter_tree_build_seconds",
              "rpc": "ddtree_drafter_verify_rpc_seconds", "vstep": "ddtree_verifier_step_seconds",
              "vfwd": "ddtree_verifier_verify_forward_seconds", "link": "ddtree_drafter_link_seconds"}
# Kernel compiles while serving (each stalled a step), summed over the services.
COMPILES, COMPILE_SECONDS = "ddtree_kernel_compiles_total", "ddtree_kernel_compile_seconds_sum"
ROUNDS = "ddtree_drafter_rounds_total"  # verify rounds that emitted tokens, summed over the sessions
TREES = "ddtree_drafter_step_batch_size"  # sessions with a tree in each message that carries trees
BUDGET = "ddtree_drafter_tree_budget"  # the adaptive budget's choice per message (only with a planner)
LINK_BYTES = "ddtree_drafter_link_bytes_total"  # the link's bytes, by direction (up, down, ring); none in process


def scrape(urls: list[str]) -> dict[str, float]:
    """The _sum and _count samples of the STEP_PARTS, TREES and BUDGET histograms at these /metrics URLs, the
    drafters' rounds (ROUNDS), their link's bytes down, the ring's rows included (LINK_BYTES), and the
    kernel compiles while serving (COMPILES, COMPILE_SECONDS), these four summed over the URLs."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {*STEP_PARTS.values(), TREES, BUDGET}
    values: dict[str, float] = {COMPILES: 0.0, COMPILE_SECONDS: 0.0, ROUNDS: 0.0, LINK_BYTES: 0.0}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.name in wanted and sample.name.endswith(("_sum", "_count")):
                    values[sample.name] = sample.value
                elif sample.name in (COMPILES, COMPILE_SECONDS) and sample.labels.get("phase") == "serving":
                    values[sample.name] += sample.value
                elif sample.name == ROUNDS or (sample.name == LINK_BYTES
                                               and sample.labels.get("direction") in ("down", "ring")):
                    values[sample.name] += sample.value
    return values


def step_breakdown(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float | None]:
    """Per link message over a run (ms: each part's total time / the messages): the drafter's draft
    and tree build, its round trip (rpc), the link's own part of it (gRPC and codecs, where there
    is a wire) and the verifier's steps (vstep); step = wall / messages, other = step - draft -
    build - rpc, queue = rpc - vstep - link (the verifier's wait behind other steps, hand-offs, and a
    reply's wait for the drafter's read),
    link_share = link / step; down_kb: the replies' bytes (KB, None in process); rounds_per_s: the sessions'
    verify rounds a second; tree_messages and
    trees_per_message: the messages that carry trees, and their mean sessions; budget: the adaptive
    budget's mean choice (None without one); compiles and
    compile_ms: the kernel compiles while serving in the run (each stalled a step) and their time."""
    messages = after.get(STEP_PARTS["rpc"] + "_count", 0.0) - before.get(STEP_PARTS["rpc"] + "_count", 0.0)

    def per_message(name: str) -> float | None:  # None: nothing observed it (no verifier service)
        if not messages or after.get(name + "_count", 0.0) == before.get(name + "_count", 0.0):
            return None
        return 1e3 * (after[name + "_sum"] - before.get(name + "_sum", 0.0)) / messages

    out: dict[str, float | None] = {f"{k}_ms": per_message(v) for k, v in STEP_PARTS.items()}
    out["messages"] = messages
    out["step_ms"] = 1e3 * wall / messages if messages else None
    parts = [out[k] for k in ("draft_ms", "build_ms", "rpc_ms")]  # the first two are None in plain decoding
    out["other_ms"] = (out["step_ms"] - sum(p or 0.0 for p in parts)
                       if out["step_ms"] is not None and out["rpc_ms"] is not None else None)
    known = [out[k] for k in ("rpc_ms", "vstep_ms", "link_ms")]
    out["queue_ms"] = known[0] - known[1] - known[2] if None not in known else None
    out["link_share"] = out["link_ms"] / out["step_ms"] if out["link_ms"] is not None and out["step_ms"] else None
    out["rounds_per_s"] = (after.get(ROUNDS, 0.0) - before.get(ROUNDS, 0.0)) / wall if wall > 0 else None
    down = after.get(LINK_BYTES, 0.0) - before.get(LINK_BYTES, 0.0)
    out["down_kb"] = down / messages / 1e3 if messages and down else None
    def mean(name: str) -> float | None:  # a histogram's mean observation in the run (None: none)
        count = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
        return (after[name + "_sum"] - before.get(name + "_sum", 0.0)) / count if count else None

    out["tree_messages"] = after.get(TREES + "_count", 0.0) - before.get(TREES + "_count", 0.0)
    out["trees_per_message"] = mean(TREES)
    out["budget"] = mean(BUDGET)
    out["compiles"] = after.get(COMPILES, 0.0) - before.get(COMPILES, 0.0)
    out["compile_ms"] = 1e3 * (after.get(COMPILE_SECONDS, 0.0) - before.get(COMPILE_SECONDS, 0.0))
    return out


async def run_load(address: str, verifier_address: str | None, prompts: list[list[list[int]]], budget: int,
                   max_new: int, timeout_s: float, metrics_urls: list[str] = ()
                   ) -> tuple[list[Request], list[Request], float, float, dict, dict | None]:
    """All clients' warm-up requests at once, then their timed requests: (warm-ups, timed, wall s,
    the verifier's busy share of the timed wall time: InfoResponse.busy_s before and after, None
    without a verifier service, the step breakdown of the timed part from the services' /metrics,
    and the steady window's summary, `SteadyWindow.summary`)."""
    async with contextlib.AsyncExitStack() as stack:
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        stub, info = pb_grpc.GenerationStub(channel), None
        if verifier_address is not None:
            verifier_channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(verifier_address, options=CHANNEL_OPTIONS))
            info = pb_grpc.VerifierStub(verifier_channel).Info
        warm = await asyncio.gather(*(generate(stub, p[0], budget, min(WARMUP_TOKENS, max_new), timeout_s)
                                      for p in prompts))
        before = scrape(list(metrics_urls)) if metrics_urls else {}
        busy = (await info(pb.InfoRequest())).busy_s if info else 0.0
        window = SteadyWindow(len(prompts), list(metrics_urls))
        start = time.perf_counter()
        timed = await asyncio.gather(*(client(stub, p[1:], budget, max_new, timeout_s, window) for p in prompts))
        wall = time.perf_counter() - start
        await window.done()
        busy = (await info(pb.InfoRequest())).busy_s - busy if info else None
        parts = step_breakdown(before, scrape(list(metrics_urls)), wall) if metrics_urls else {}
    share = None if busy is None else busy / wall if wall > 0 else 0.0
    timed = [r for per_client in timed for r in per_client]
    return list(warm), timed, wall, share, parts, window.summary(timed)


async def run_sequential(address: str, prompts: list[list[list[int]]], budget: int, max_new: int,
                         timeout_s: float) -> tuple[list[Request], float]:
    """The timed requests of every client, one after another through one client: (requests, wall s)."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        done = await client(stub, [q for p in prompts for q in p[1:]], budget, max_new, timeout_s)
        return done, time.perf_counter() - start


# ---------------------------------------------------------------------------------------
# Summaries.
# ---------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarise(mode: str, setting: Setting | None, n: int, timed: list[Request], wall: float,
              reference: dict[tuple[int, ...], list[int]] | None) -> dict:
    ok = [r for r in timed if not r.error]
    tokens = sum(len(r.tokens) for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    latency = [r.elapsed_s for r in ok]
    rounds = sum(r.rounds for r in ok)
    row = {
        "mode": mode, "setting": setting.name if setting else "ar",
        "accept_prob": setting.accept_prob if setting else None, "target_tau": setting.target_tau if setting else None,
        "concurrency": n, "requests": len(ok), "errors": len(timed) - len(ok),
        "error_examples": sorted({r.error for r in timed if r.error})[:3],
        "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tau": sum(r.mean_acceptance for r in ok) / len(ok) if ok else None,
        "tau_rounds": sum(sum(r.acceptance_lengths) for r in ok) / rounds if rounds else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "latency_p50_ms": ms(percentile(latency, 50)), "latency_p99_ms": ms(percentile(latency, 99)),
        "finish_reasons": {k: sum(r.finish_reason == k for r in ok) for k in sorted({r.finish_reason for r in ok})},
        "equals_ar": None,
    }
    if reference is not None and ok:
        row["equals_ar"] = sum(reference.get(tuple(r.prompt)) == r.tokens for r in ok) / len(ok)
    return row


def add_speedups(rows: list[dict]) -> None:
    """Each row's tok/s over plain decoding's at its N (the median of plain decoding's runs there)."""
    ar = {n: statistics.median(r["tokens_per_s"] for r in rows if r["mode"] == "ar" and r["concurrency"] == n)
          for n in {r["concurrency"] for r in rows if r["mode"] == "ar"}}
    for r in rows:
        base = ar.get(r["concurrency"])
        r["speedup_vs_ar"] = r["tokens_per_s"] / base if base else None


def repeat_summary(rows: list[dict]) -> list[dict]:
    """Per setting, mode and N (in the rows' order): the runs' median tok/s, their min and max,
    the spread (max - min) / median, and the median over plain decoding's median at that N."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["mode"], r["concurrency"]), []).append(r["tokens_per_s"])
    ar = {n: statistics.median(v) for (_, mode, n), v in groups.items() if mode == "ar"}
    out = []
    for (setting, mode, n), values in groups.items():
        median = statistics.median(values)
        out.append({"setting": setting, "mode": mode, "concurrency": n, "runs": len(values),
                    "tokens_per_s_median": median, "tokens_per_s_min": min(values), "tokens_per_s_max": max(values),
                    "spread": (max(values) - min(values)) / median if median > 0 else None,
                    "speedup_vs_ar": median / ar[n] if ar.get(n) else None})
    return out


def _cell(value, width: int, digits: int = 1) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, str):
        return f"{value:>{width}}"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{value:>{width}.{digits}f}"


def print_table(result: dict) -> None:
    o = result["options"]
    print(f"\nserve bench: {result['setup']} on {result['device']} ({o['dtype']} dtype, torch {result['torch']}), "
          f"prompt {o['prompt_len']}, {o['max_new_tokens']} new tokens, tree budget {o['tree_budget']}, "
          f"{o['requests_per_client']} timed request(s) per client, greedy, "
          + (f"link delayed {o['delay_ms']:g} ms each way" if o.get("delay_ms") else "direct link"))
    print("tok/s = all completion tokens / wall time of the N's run; tau = mean Stats.mean_acceptance; "
          "TTFT = request sent -> first token (client); ITL = per streamed delta: gap since the previous "
          "delta / its tokens, one sample per token; lat = request sent -> its last token (client); "
          "==AR = fraction of requests with the AR tokens; v-busy = "
          "share of the wall time the verifier spent in its model steps (InfoResponse.busy_s); conc/seq "
          "(--sequential) = wall time of the N concurrent clients / the same requests one after another")
    head = [("setting", 16), ("mode", 5), ("N", 4), ("reqs", 5), ("err", 4), ("tokens", 7), ("tok/s", 9),
            ("vs AR", 6), ("tau", 5), ("ttft50", 8), ("ttft99", 8), ("itl50", 7), ("itl99", 7), ("lat50", 8),
            ("lat99", 8), ("==AR", 5),
            ("v-busy", 6), ("conc/seq", 8)]
    print(" ".join(f"{h:>{w}}" for h, w in head) + "   (latencies in ms)")
    for r in result["runs"]:
        cells = [_cell(r["setting"], 16), _cell(r["mode"], 5), _cell(r["concurrency"], 4), _cell(r["requests"], 5),
                 _cell(r["errors"], 4), _cell(r["completion_tokens"], 7), _cell(r["tokens_per_s"], 9),
                 _cell(r.get("speedup_vs_ar"), 6, 2), _cell(r["tau"], 5, 2), _cell(r["ttft_p50_ms"], 8),
                 _cell(r["ttft_p99_ms"], 8), _cell(r["itl_p50_ms"], 7, 2), _cell(r["itl_p99_ms"], 7, 2),
                 _cell(r.get("latency_p50_ms"), 8), _cell(r.get("latency_p99_ms"), 8), _cell(r["equals_ar"], 5, 2),
                 _cell(r.get("verifier_busy"), 6, 2),
                 _cell(r.get("concurrent_over_sequential"), 8, 2)]
        print(" ".join(cells))
    print("\nstep breakdown of the timed runs, ms per link message (each part's total / the messages; both "
          "services' /metrics): step = wall / messages; draft, build = the drafter's draft steps and tree builds; "
          "rpc = its link round trips; vstep = the verifier's steps, vfwd = their batched verifies (forward, "
          "accept, KV compaction); link = gRPC and the codecs at both ends (rpc less the time the verifier held "
          "the message; no wire in process), link% = link / step; queue = rpc - vstep - link (waiting in the "
          "verifier behind other steps, hand-offs, a reply waiting for the drafter's read); down-KB = a reply's "
          "bytes (target features included, through gRPC or the feature ring); other = step - draft - "
          "build - rpc (the drafter's scheduling and deliveries); rnd/s = the sessions' verify rounds a second; "
          "trees = the mean sessions with a tree in the messages that carry trees (tmsgs of them); budget = the "
          "adaptive budget's mean choice (drafted nodes a tree keeps at most); comp, comp-ms = "
          "kernel compiles while serving during the run (each stalled a step; the services' logs name them) "
          "and their time")
    head = [("setting", 16), ("mode", 5), ("N", 4), ("msgs", 6), ("step", 7), ("draft", 7), ("build", 7),
            ("rpc", 7), ("vstep", 7), ("vfwd", 7), ("link", 7), ("link%", 6), ("down-KB", 8), ("queue", 7),
            ("other", 7),
            ("rnd/s", 7), ("tmsgs", 6), ("trees", 6), ("budget", 6), ("comp", 5), ("comp-ms", 8)]
    print(" ".join(f"{h:>{w}}" for h, w in head))
    for r in result["runs"]:
        b = r.get("step_breakdown") or {}
        share = 100 * b["link_share"] if b.get("link_share") is not None else None
        cells = [_cell(r["setting"], 16), _cell(r["mode"], 5), _cell(r["concurrency"], 4),
                 _cell(int(b["messages"]) if "messages" in b else None, 6)] + [
                 _cell(b.get(k), 7, 2) for k in ("step_ms", "draft_ms", "build_ms", "rpc_ms", "vstep_ms", "vfwd_ms",
                                                 "link_ms")] + [
                 _cell(share, 6, 1), _cell(b.get("down_kb"), 8, 1), _cell(b.get("queue_ms"), 7, 2),
                 _cell(b.get("other_ms"), 7, 2),
                 _cell(b.get("rounds_per_s"), 7, 0),
                 _cell(int(b["tree_messages"]) if "tree_messages" in b else None, 6),
                 _cell(b.get("trees_per_message"), 6, 1), _cell(b.get("budget"), 6, 1),
                 _cell(int(b["compiles"]) if "compiles" in b else None, 5), _cell(b.get("compile_ms"), 8, 1)]
        print(" ".join(cells))
    print("\nsteady window of the timed runs (from the last client's first token to the first client's last "
          "token: every client has its requests going; no ramp-up, no drain): window = its seconds; tok/s = "
          "completion tokens streamed in it / its length; rnd/s = the sessions' verify rounds a second in it; "
          "msgs, step, trees, link% as in the step breakdown, over the window")
    head = [("setting", 16), ("mode", 5), ("N", 4), ("window", 7), ("tok/s", 9), ("rnd/s", 7), ("msgs", 6),
            ("step", 7), ("trees", 6), ("link%", 6)]
    print(" ".join(f"{h:>{w}}" for h, w in head))
    for r in result["runs"]:
        w = r.get("steady") or {}
        share = 100 * w["link_share"] if w.get("link_share") is not None else None
        print(" ".join([_cell(r["setting"], 16), _cell(r["mode"], 5), _cell(r["concurrency"], 4),
                        _cell(w.get("window_s"), 7, 2), _cell(w.get("tokens_per_s"), 9),
                        _cell(w.get("rounds_per_s"), 7, 0),
                        _cell(int(w["messages"]) if "messages" in w else None, 6), _cell(w.get("step_ms"), 7, 2),
                        _cell(w.get("trees_per_message"), 6, 1), _cell(share, 6, 1)]))
    if result.get("repeat_summary"):
        print("\nrepeated runs (--repeats): tok/s median, min and max; spread = (max - min) / median; "
              "vs AR = median / plain decoding's median")
        head = [("setting", 16), ("mode", 5), ("N", 4), ("runs", 5), ("median", 9), ("min", 9), ("max", 9),
                ("spread", 7), ("vs AR", 6)]
        print(" ".join(f"{h:>{w}}" for h, w in head))
        for r in result["repeat_summary"]:
            print(" ".join([_cell(r["setting"], 16), _cell(r["mode"], 5), _cell(r["concurrency"], 4),
                            _cell(r["runs"], 5), _cell(r["tokens_per_s_median"], 9), _cell(r["tokens_per_s_min"], 9),
                            _cell(r["tokens_per_s_max"], 9), _cell(r["spread"], 7, 3),
                            _cell(r["speedup_vs_ar"], 6, 2)]))


# ---------------------------------------------------------------------------------------
# One setup end to end.
# ---------------------------------------------------------------------------------------


def run_mode(drafter: Service, verifier: Service | None, mode: str, setting: Setting | None, a: argparse.Namespace,
             prompts: dict[int, list[list[list[int]]]], reference: dict | None,
             outputs: dict[tuple[int, ...], list[int]] | None, result: dict, save: Callable[[], None]) -> None:
    """Every N of one (mode, setting); AR runs fill `outputs` with each prompt's tokens."""
    budget = 0 if mode == "ar" else setting.budget if setting and setting.budget is not None else a.tree_budget
    label = mode if setting is None else f"{mode} {setting.name}"
    for n, repeat in ((n, repeat) for n in a.concurrency for repeat in range(a.repeats)):
        log(f"{label}: N={n}, {n} warm-up + {n * a.requests_per_client} timed requests"
            + (f" (run {repeat + 1} of {a.repeats})" if a.repeats > 1 else ""))
        services = [drafter] + ([verifier] if verifier is not None else [])
        urls = [f"http://127.0.0.1:{service.metrics_port}/metrics" for service in services]
        warm, timed, wall, busy, parts, steady = asyncio.run(run_load(drafter.address, verifier and verifier.address,
                                                                      prompts[n], budget,
                                                                      a.max_new_tokens, a.request_timeout, urls))
        if outputs is not None:
            outputs.update({tuple(r.prompt): r.tokens for r in warm + timed if not r.error})
        row = summarise(mode, setting, n, timed, wall, reference)
        row["repeat"] = repeat
        row["verifier_busy"] = busy
        row["step_breakdown"] = parts
        row["steady"] = steady
        if a.sequential and n > 1:
            alone, seq_wall = asyncio.run(run_sequential(drafter.address, prompts[n], budget, a.max_new_tokens,
                                                         a.request_timeout))
            mine = {tuple(r.prompt): r.tokens for r in alone if not r.error}
            row["sequential_wall_s"] = seq_wall
            row["concurrent_over_sequential"] = wall / seq_wall
            row["equals_sequential"] = sum(mine.get(tuple(r.prompt)) == r.tokens for r in timed) / max(1, len(timed))
            log(f"{label}: N={n}: the same requests one after another: {seq_wall:.2f} s, concurrent/sequential "
                f"{wall / seq_wall:.2f}, same outputs {row['equals_sequential']:.2f}")
        result["runs"].append(row)
        add_speedups(result["runs"])
        if a.repeats > 1:
            result["repeat_summary"] = repeat_summary(result["runs"])
        save()  # keep what is done even if the run is cut short
        errors = f", {row['errors']} errors: {row['error_examples']}" if row["errors"] else ""
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        log(f"{label}: N={n}: {row['completion_tokens']} tokens in {wall:.2f} s = {row['tokens_per_s']:.1f} tok/s, "
            f"tau {tau}{errors}")
        if row["errors"]:
            drafter.print_log_tail(12)


def run_setup(name: str, a: argparse.Namespace, work: Path, result: dict, save: Callable[[], None]) -> None:
    """Start the verifier once, then a drafter per setting; run every mode at every N into `result`."""
    setup = make_setup(name, a)
    prompts = make_prompts(setup, a)
    settings = ([Setting("real")] if setup.real_acceptance else []) + oracle_settings(a, setup.block_size)
    result.update({"setup": setup.name, "device": device_name(a.device), "torch": torch.__version__,
                   "python": platform.python_version(), "options": vars(a), "block_size": setup.block_size,
                   "commands": {"verifier": setup.verifier_argv, "drafters": []}, "startup_s": {},
                   "settings": [asdict(x) for x in settings], "runs": []})
    services: list[Service] = []
    try:
        verifier = link = None
        if a.colocate:  # each drafter holds the target
            result["commands"]["verifier"] = []
        else:
            port = free_port()
            verifier = Service("verifier", setup.verifier_argv + ["--metrics-port", str(port)],
                               work / f"{name}-verifier.log", port)
            services.append(verifier)
            verifier.start(a.startup_timeout)
            result["startup_s"]["verifier"] = verifier.startup_s
            link = verifier
        if a.delay_ms > 0:  # the drafters' link goes through the delay proxy; Info and health stay direct
            argv = [sys.executable, "bench/delay_proxy.py", "--target", verifier.address, "--delay-ms", str(a.delay_ms)]
            result["commands"]["delay_proxy"] = argv
            link = Service("delay proxy", argv, work / f"{name}-delay-proxy.log")
            services.append(link)
            link.start(a.startup_timeout)

        def start_drafter(tag: str, oracle: Path | None, lockstep: bool = False, adaptive: bool = False,
                          inline: bool = False, grpc: bool = False) -> Service:
            argv = setup.drafter_argv + (["--verifier", "local", "--local-verifier-flags",
                                          shlex.join(common_verifier_flags(a, service=False))] if a.colocate
                                         else ["--verifier", link.address])
            argv += ["--bench-oracle", str(oracle)] if oracle else []
            argv += ["--pipelining", "off" if lockstep else "on"] if a.lockstep else []
            argv += ["--adaptive-budget", "on" if adaptive else "off"] if a.budgets is not None else []
            argv += ["--no-feature-ring"] if inline or a.no_feature_ring or a.delay_ms > 0 else []
            argv += ["--no-unix-socket"] if grpc or a.no_unix_socket or a.delay_ms > 0 else []
            port = free_port()
            argv += ["--http-port", str(port)]  # its /metrics, for the step breakdown
            result["commands"]["drafters"].append(argv)
            drafter = Service("drafter", argv, work / f"{name}-drafter-{tag}.log", port)
            services.append(drafter)
            drafter.start(a.startup_timeout)
            result["startup_s"][f"drafter {tag}"] = drafter.startup_s
            return drafter

        drafter = start_drafter("plain", None)
        ar_tokens: dict[tuple[int, ...], list[int]] = {}
        run_mode(drafter, verifier, "ar", None, a, prompts, None, ar_tokens, result, save)
        started = None  # (accept_prob, lockstep, adaptive, inline, grpc) of the oracle drafter running
        for i, setting in enumerate(settings):
            wanted = (setting.accept_prob, setting.lockstep, setting.adaptive, setting.inline, setting.grpc)
            if setting.accept_prob is not None and wanted != started:  # the oracle's runs need a drafter of their own
                drafter.stop()
                oracle = work / f"{name}-oracle-{i}.json"
                write_oracle(oracle, setting.accept_prob, ar_tokens, a.seed)
                drafter = start_drafter(f"oracle-{i}", oracle, setting.lockstep, setting.adaptive, setting.inline,
                                        setting.grpc)
                started = wanted
            run_mode(drafter, verifier, "tree", setting, a, prompts, ar_tokens, None, result, save)
    finally:
        for service in reversed(services):
            service.stop()


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop the services.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    all_results = {"bench": "serve", "argv": [sys.argv[0], *(sys.argv[1:] if argv is None else argv)],
                   "device": device_name(a.device), "torch": torch.__version__, "setups": []}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        work = Path(a.log_dir) if a.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in a.models:
            result: dict = {}
            all_results["setups"].append(result)
            run_setup(name, a, work, result, lambda: write_json(a.out_json, all_results))
            print_table(result)
            write_json(a.out_json, all_results)
    return all_results


def failed_requests(results: dict) -> int:
    return sum(r["errors"] for setup in results["setups"] for r in setup.get("runs", []))


if __name__ == "__main__":
    failed = failed_requests(main(sys.argv[1:]))
    if failed:
        log(f"{failed} requests failed (see the errors column and the drafter logs)")
    sys.exit(1 if failed else 0)
