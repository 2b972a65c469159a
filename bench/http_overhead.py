"""What the OpenAI-compatible HTTP API costs over gRPC: N concurrent streams through each, against
the same live drafter.

    PYTHONPATH=. python bench/http_overhead.py [--concurrency 64] [--max-new-tokens 64] [--repeats 4] \
        [--device cpu] [--out-json http_overhead.json]

Both services run as their own processes on loopback (the shipped pair by default, through the
real CLIs; bench/serve.py's `Service`), the drafter with `--http-port`. A phase sends N requests at
once, one stream each, all greedy with the same max_new_tokens, prompt i being the i-th held-out
token window of the target's corpus: through gRPC (`Generate`, grpc.aio) or through HTTP
(`POST /v1/completions` with `stream: true`, the prompt as token ids, aiohttp reading the
server-sent events). After one untimed warm-up phase each, `--repeats` pairs of phases run, gRPC
first in even repeats and HTTP first in odd ones, so both see the same work and the same drift. Every request is timed at the client:
latency (sent -> last token), time to first token. Greedy outputs are checked to be the same
through both APIs.

Reported per N: mean and p50 latency and TTFT through each API, and the per-request difference
HTTP - gRPC (request i of repeat r against request i of the same repeat through gRPC): mean and
p50. The clients run in this process, so the difference includes the client side: parsing JSON
events in Python against protobuf messages in C.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs ddtree_kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import json
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import grpc

from bench.bench_timing import number_list, out_json, write_json
from bench.serve import DEFAULT_DRAFT, DEFAULT_TARGET, ROOT, Service, heldout_windows, percentile
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc


def log(message: str) -> None:
    print(f"[http_overhead] {message}", file=sys.stderr, flush=True)


@dataclass
class Timed:
    """One request as its client saw it."""
    api: str
    prompt: int  # index of its prompt
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    text: str = ""
    error: str = ""


@dataclass
class Row:
    concurrency: int
    requests: int  # timed per API
    grpc_latency_ms: dict = field(default_factory=dict)  # mean, p50
    http_latency_ms: dict = field(default_factory=dict)
    grpc_ttft_ms: dict = field(default_factory=dict)
    http_ttft_ms: dict = field(default_factory=dict)
    latency_diff_ms: dict = field(default_factory=dict)  # HTTP - gRPC per request: mean, p50
    ttft_diff_ms: dict = field(default_factory=dict)
    same_text: float = 0.0  # share of requests whose text is the same through both APIs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET, help="target checkpoint folder (default the bundled one)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="DFlash draft checkpoint folder (default the bundled one)")
    p.add_argument("--device", default="cpu", help="torch device of both services (default cpu)")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--concurrency", default="64", help="comma-separated stream counts (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tree-budget", type=int, default=16, help="DDTree nodes drafted per round")
    p.add_argument("--repeats", type=int, default=4, help="timed gRPC / HTTP phase pairs per concurrency")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out-json", type=out_json, default="http_overhead.json", help="write the results here")
    a = p.parse_args(argv)
    a.concurrency = number_list(a.concurrency, "--concurrency")
    if not a.concurrency or min(a.concurrency) < 1 or a.repeats < 1 or a.max_new_tokens < 1:
        p.error("--concurrency values, --repeats and --max-new-tokens must be >= 1")
    return a


def free_port() -> int:
    """A port free now (the drafter's --http-port 0 means no HTTP server, so one is picked here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def via_grpc(stub, i: int, prompt: list[int], a: argparse.Namespace) -> Timed:
    rec = Timed("grpc", i)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=a.max_new_tokens)
    start = time.perf_counter()
    text = []
    try:
        async for reply in stub.Generate(request, timeout=a.timeout):
            if reply.HasField("delta"):
                if reply.delta.token_ids and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - start
                rec.tokens += len(reply.delta.token_ids)
                text.append(reply.delta.text)
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.latency_s, rec.text = time.perf_counter() - start, "".join(text)
    return rec


async def via_http(session: aiohttp.ClientSession, url: str, i: int, prompt: list[int],
                   a: argparse.Namespace) -> Timed:
    rec = Timed("http", i)
    body = {"model": "bench", "prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    text = []
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=a.timeout)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {await r.text()}"
            else:
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = chunk["error"]["message"]
                    elif chunk.get("usage"):
                        rec.tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - start
                        text.append(chunk["choices"][0]["text"])
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency_s, rec.text = time.perf_counter() - start, "".join(text)
    return rec


async def phase(api: str, stub, session, url: str, prompts: list[list[int]], a) -> list[Timed]:
    if api == "grpc":
        done = await asyncio.gather(*(via_grpc(stub, i, p, a) for i, p in enumerate(prompts)))
    else:
        done = await asyncio.gather(*(via_http(session, url, i, p, a) for i, p in enumerate(prompts)))
    failed = [r for r in done if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} {api} requests failed, e.g. {failed[0].error}")
    return list(done)


def stats_ms(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) * 1e3, "p50": percentile(values, 50) * 1e3}


async def measure(grpc_address: str, http_port: int, n: int, windows: list[tuple[int, ...]], a) -> Row:
    prompts = [list(windows[i % len(windows)]) for i in range(n)]
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # one connection per stream, as N independent clients
    async with grpc.aio.insecure_channel(grpc_address, options=CHANNEL_OPTIONS) as channel, \
            aiohttp.ClientSession(connector=connector) as session:
        stub = pb_grpc.GenerationStub(channel)
        for api in ("grpc", "http"):  # warm-up: connections, caches, the allocator
            await phase(api, stub, session, url, prompts, a)
        runs: list[tuple[list[Timed], list[Timed]]] = []
        for r in range(a.repeats):
            log(f"N={n}: repeat {r + 1}/{a.repeats}")
            order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")  # no API always goes first
            done = {api: await phase(api, stub, session, url, prompts, a) for api in order}
            runs.append((done["grpc"], done["http"]))
    grpc_all = [t for g, _ in runs for t in g]
    http_all = [t for _, h in runs for t in h]
    pairs = [(g, h) for gs, hs in runs for g, h in zip(gs, hs)]
    return Row(concurrency=n, requests=len(grpc_all),
               grpc_latency_ms=stats_ms([t.latency_s for t in grpc_all]),
               http_latency_ms=stats_ms([t.latency_s for t in http_all]),
               grpc_ttft_ms=stats_ms([t.ttft_s for t in grpc_all]),
               http_ttft_ms=stats_ms([t.ttft_s for t in http_all]),
               latency_diff_ms=stats_ms([h.latency_s - g.latency_s for g, h in pairs]),
               ttft_diff_ms=stats_ms([h.ttft_s - g.ttft_s for g, h in pairs]),
               same_text=sum(g.text == h.text for g, h in pairs) / len(pairs))


def print_table(rows: list[Row]) -> None:
    head = (f"{'N':>4} {'reqs':>5} | {'gRPC lat mean/p50 ms':>21} | {'HTTP lat mean/p50 ms':>21} | "
            f"{'diff mean/p50 ms':>17} | {'TTFT diff mean/p50':>19} | {'same':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def pair(d: dict) -> str:
            return f"{d['mean']:9.1f} /{d['p50']:9.1f}"
        print(f"{r.concurrency:>4} {r.requests:>5} | {pair(r.grpc_latency_ms):>21} | {pair(r.http_latency_ms):>21} | "
              f"{r.latency_diff_ms['mean']:7.2f} /{r.latency_diff_ms['p50']:7.2f} | "
              f"{r.ttft_diff_ms['mean']:8.2f} /{r.ttft_diff_ms['p50']:8.2f} | {r.same_text:5.2f}")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    python = sys.executable
    pair = ["--target", a.target, "--draft", a.draft]
    sessions = str(max(a.concurrency))
    common = ["--host", "127.0.0.1", "--port", "0", "--device", a.device, "--dtype", a.dtype]
    windows = heldout_windows(ROOT / a.target, a.prompt_len)
    http_port = free_port()
    with tempfile.TemporaryDirectory(prefix="http-overhead-") as tmp:
        verifier = Service("verifier", [python, "-m", "verifier_svc", *pair, *common, "--max-sessions", sessions,
                                        "--max-seq-len", str(a.prompt_len + a.max_new_tokens + a.tree_budget + 8),
                                        "--max-tree-nodes", str(a.tree_budget + 1)], Path(tmp) / "verifier.log")
        drafter = None
        try:
            verifier.start(600)
            drafter = Service("drafter", [python, "-m", "drafter_svc", *pair, *common, "--verifier", verifier.address,
                                          "--tree-budget", str(a.tree_budget), "--max-concurrent", sessions,
                                          "--http-port", str(http_port)], Path(tmp) / "drafter.log").start(600)
            rows = [asyncio.run(measure(drafter.address, http_port, n, windows, a)) for n in a.concurrency]
        finally:
            if drafter is not None:
                drafter.stop()
            verifier.stop()
    print_table(rows)
    result = {"benchmark": "http_overhead", "device": a.device, "dtype": a.dtype, "target": a.target,
              "draft": a.draft, "max_new_tokens": a.max_new_tokens, "prompt_len": a.prompt_len,
              "tree_budget": a.tree_budget, "repeats": a.repeats, "cpus": os.cpu_count(),
              "python": platform.python_version(), "rows": [asdict(r) for r in rows]}
    write_json(a.out_json, result)
    log(f"wrote {a.out_json}")


if __name__ == "__main__":
    main()
