"""gRPC transport + codec cost of one verify round, with the model taken out.

    PYTHONPATH=. python bench/transport.py [--nodes 65] [--feature-rows 1,7] [--rounds 300] [--out-json FILE]

The verifier runs in a child process: the real servicer, model worker and `TreeVerifier`
(tree decode and validation, ancestor mask, reply encode) over the bundled default target,
whose tree forward is replaced by a canned result carrying `--feature-rows` rows of
Qwen3-8B-sized features (5 x 4096 bf16 = 40 KB per row). This process drives a
`GrpcVerifierLink` exactly as the drafter does and times each `verify()` call (tracing off
unless --trace).
Baseline: a bare bidirectional gRPC echo between two processes with the same bytes each
way and the same client pattern (a request queue feeding a synchronous stream). With
`--gaps-ms`, the client busy-waits that long before each round, as a drafter drafting does,
while the server sits idle.
Prints a table of medians (ms) and writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import multiprocessing as mp
import queue
import statistics
import time

import grpc
import numpy as np
import torch
from opentelemetry import trace as otel_trace

from bench.bench_timing import write_json
from common.protocol import SamplingParams
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tracing import current_traceparent
from common.tree import DraftTree
from common.wire import encode_tree
from drafter_svc.verifier_client import GrpcVerifierLink, open_channel
from tests.reference import distinct_sibling_tokens

TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "default", "target")
FEATURE_DIM = 5 * 4096  # Qwen3-8B with a 5-layer DFlash draft
ECHO = "/bench.Echo/Session"


def _tracing(service: str) -> None:
    """Record every span in memory (what bench/round.py and the tests do)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.tracing import setup_tracing

    setup_tracing(service, exporter=InMemorySpanExporter())


def _verifier_process(port_out, rows: int, trace: bool) -> None:
    """Serve the real Verifier service with a canned tree forward until killed."""
    from verifier_svc.accept import AcceptResult
    from verifier_svc.server import VerifierConfig, load_verifier, serve

    if trace:
        _tracing("verifier")
    config = VerifierConfig(target_dir=TARGET, port=0, max_sessions=1, max_tree_nodes=1025, cuda_graphs=False)
    verifier = load_verifier(config)
    features = torch.zeros(rows, FEATURE_DIM, dtype=torch.bfloat16)
    runner = verifier.runner
    runner.verify_accept = lambda slot, past, tree, *a, **k: AcceptResult(path=torch.tensor([0]),
                                                                           bonus=int(tree.tokens[0]), features=features)
    runner.commit = lambda *a, **k: None

    async def main():
        _, port = await serve(config, verifier)
        port_out.put(port)
        await asyncio.Event().wait()

    asyncio.run(main())


def _echo_process(port_out, reply_bytes: int) -> None:
    """A bare grpc.aio bidirectional stream answering each message with `reply_bytes` bytes."""
    reply = bytes(reply_bytes)

    async def session(request_iterator, context):
        async for _ in request_iterator:
            yield reply

    async def main():
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(session)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Session": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _start(target, *args) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    port_out = ctx.Queue()
    proc = ctx.Process(target=target, args=(port_out, *args), daemon=True)
    proc.start()
    return proc, port_out.get(timeout=120)


def random_tree(nodes: int, vocab: int) -> DraftTree:
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, nodes)]
    return DraftTree.from_parents(distinct_sibling_tokens(rng, parents, vocab), parents)


def _busy_wait(seconds: float) -> None:
    """Stand-in for the drafter's own work between rounds (it keeps its core busy, as a CUDA sync does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_link(port: int, tree: DraftTree, rounds: int, trace: bool, gap_s: float) -> dict:
    channel = open_channel(f"127.0.0.1:{port}")
    link = GrpcVerifierLink(pb_grpc.VerifierStub(channel), feature_layer_ids=())
    root = link.open([1, 2, 3], SamplingParams()).token
    tree = DraftTree(torch.cat([torch.tensor([root]), tree.tokens[1:]]), tree.next_token, tree.next_sibling)
    times = []
    reply_bytes = 0
    tracer = otel_trace.get_tracer(__name__)
    for r in range(1, rounds + 1):
        _busy_wait(gap_s)
        start = time.perf_counter()
        if trace:
            with tracer.start_as_current_span("verify_rpc"):
                verified = link.verify(tree, r, current_traceparent())
        else:
            verified = link.verify(tree, r)
        times.append((time.perf_counter() - start) * 1e3)
        reply_bytes = verified.features.numel() * 2
    link.close()
    channel.close()
    warm = times[len(times) // 10:]
    return {"median_ms": statistics.median(warm), "p90_ms": float(np.percentile(warm, 90)),
            "feature_bytes": reply_bytes}


def time_echo(port: int, request_bytes: int, rounds: int, gap_s: float) -> dict:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    call_fn = channel.stream_stream(ECHO)
    requests: queue.Queue = queue.Queue()
    end = object()
    replies = iter(call_fn(iter(requests.get, end)))
    payload = bytes(request_bytes)
    times = []
    for _ in range(rounds):
        _busy_wait(gap_s)
        start = time.perf_counter()
        requests.put(payload)
        next(replies)
        times.append((time.perf_counter() - start) * 1e3)
    requests.put(end)
    channel.close()
    warm = times[len(times) // 10:]
    return {"median_ms": statistics.median(warm), "p90_ms": float(np.percentile(warm, 90))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nodes", type=int, default=65, help="tree nodes, root included (default 65)")
    p.add_argument("--feature-rows", default="1,7", help="feature rows per reply, comma-separated (default 1,7)")
    p.add_argument("--rounds", type=int, default=300, help="timed rounds per case (default 300)")
    p.add_argument("--gaps-ms", default="0,3", help="drafter work between rounds, comma-separated ms (default "
                   "0,3); the server idles meanwhile, as the verifier does while a real drafter drafts")
    p.add_argument("--trace", action="store_true", help="record spans in both processes, as bench/round.py does")
    p.add_argument("--out-json", help="write the results here")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.rounds < 10:
        p.error("--nodes must be >= 1 and --rounds >= 10")

    torch.set_num_threads(1)
    if a.trace:
        _tracing("drafter")
    tree = random_tree(a.nodes, 4096)
    request_bytes = pb.DrafterMessage(tree=encode_tree(tree, 1)).ByteSize()
    res = {"trace": a.trace, "nodes": a.nodes, "request_bytes": request_bytes, "cpus": os.cpu_count(), "rows": []}
    print(f"# transport bench: tree of {a.nodes} nodes ({request_bytes} B up), {a.rounds} rounds per case", flush=True)
    gaps = [float(x) for x in a.gaps_ms.split(",")]
    for rows in [int(x) for x in a.feature_rows.split(",")]:
        proc, port = _start(_verifier_process, rows, a.trace)
        try:
            links = [time_link(port, tree, a.rounds, a.trace, gap / 1e3) for gap in gaps]
        finally:
            proc.kill()
        reply_bytes = links[0]["feature_bytes"] + 16
        proc, port = _start(_echo_process, reply_bytes)
        try:
            echoes = [time_echo(port, request_bytes, a.rounds, gap / 1e3) for gap in gaps]
        finally:
            proc.kill()
        for gap, link, echo in zip(gaps, links, echoes):
            res["rows"].append({"feature_rows": rows, "gap_ms": gap, "reply_bytes": reply_bytes, "link": link,
                                "echo": echo, "overhead_ms": link["median_ms"] - echo["median_ms"]})
        write_json(a.out_json, res)

    print(f"\n{'rows':>5} {'gap':>5} {'bytes down':>10} {'link':>8} {'link p90':>9} {'echo':>8} {'echo p90':>9} "
          f"{'ours':>8}")
    for row in res["rows"]:
        print(f"{row['feature_rows']:5d} {row['gap_ms']:5.1f} {row['reply_bytes']:10d} {row['link']['median_ms']:8.3f} "
              f"{row['link']['p90_ms']:9.3f} {row['echo']['median_ms']:8.3f} {row['echo']['p90_ms']:9.3f} "
              f"{row['overhead_ms']:8.3f}")
    print("(ms per round; ours = link - echo: servicer, worker hop, validation, codec)")
    return res


if __name__ == "__main__":
    main()
