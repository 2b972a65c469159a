"""gRPC transport + codec cost of one link message, with the model taken out, per batch of sessions.

    PYTHONPATH=. python bench/transport.py [--batches 1,8,32] [--nodes 65] [--feature-rows 1,7]
        [--rounds 300] [--gaps-ms 0,3] [--trace] [--stages] [--feature-wire model|fp8]
        [--feature-rings off,on] [--unix-sockets off,on] [--out-json FILE]

The verifier runs in a child process: the real servicer, link handler, model worker and
`TreeVerifier` (link-message decode, tree walk and validation of every tree, ancestor masks,
commit bookkeeping, reply encode) over the bundled default target, whose batched verify
(`TargetRunner.launch_verify` / `finish_verify`) is replaced by a canned result that
accepts `--feature-rows` - 1 tokens per session and so returns that many rows of
Qwen3-8B-sized features each (context rows, as a projecting verifier sends them: 4096 bf16
= 8 KB per row); its prefill runs for real but returns features of that width. This process
drives a `GrpcLink` exactly as the drafter's scheduler does: it opens B sessions in one message, then sends `--rounds` link
messages, each carrying one `--nodes`-node tree for each of the B sessions, and times each
`GrpcLink.step` call (tracing off unless --trace; with it, spans as the scheduler makes
them: `draft_step` with `verify_rpc`, a `round` per session whose traceparent rides on its
tree).

Baseline: a bare bidirectional gRPC echo between two processes with the same bytes each
way as the link message and its reply, and the same client pattern (a request queue
feeding a synchronous stream). With `--gaps-ms`, the client busy-waits that long before
each message, as a drafter drafting does, while the server sits idle.

With `--stages`, both processes also record when each part of a message's way begins and ends
(`bench.timeline.Recorder`, host clock) and a second table gives the median of each part: the
drafter's encoding, the way up to the verifier's parse, its parse and decoding, the hand-off to
its model worker, the step's begin (tree checks, masks, the canned verify queued), its finish
(results, commit), the reply's encoding, the way back to the drafter's reader (the hand-off to
the event loop, gRPC's write and carry), the reader's hand-off, and the drafter's parse and
decoding. The recording adds a few microseconds per part.

The drafter reads the replies' rows as a drafter on a GPU does (`common.feature_wire.feature_reader`):
each reply's rows go to its device in one copy. Without a GPU it does only its host's part of
that (the rows' copy out of the reply into staging memory, `gpu_drafter_reader`). With
`--feature-wire fp8` the rows travel packed as the verifier's `--feature-wire fp8` sends them
(`common.feature_wire`: 4,100 bytes a row instead of 8,192); packing and unpacking run on the
services' GPUs, so they are left out here as the forward is: the canned rows are packed once,
and the drafter's host part adds the check of their scales.

`--feature-rings` and `--unix-sockets` time each case every way given: the replies' rows inline
or through the verifier's shared-memory ring (`common/feature_ring.py`), the messages through the
gRPC stream or through the Unix socket the verifier offers (`common/socket_link.py`), as to a
drafter on another host or on the verifier's.

The per-message Python / gRPC cost should be paid once per step whatever B is; what grows
with B is the bytes and the per-tree work. The table gives both: ms per message, and ms per
session (the message's cost / B). Prints a table of medians (ms) and writes JSON with
--out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import contextlib
import functools
import glob
import json
import multiprocessing as mp
import queue
import shutil
import statistics
import tempfile
import time

import grpc
import numpy as np
import torch
from opentelemetry import trace as otel_trace

from bench.bench_timing import number_list, out_json, write_json
from common.config import load_target_config
from common.feature_wire import FORMATS, FeatureReader, check_packed, feature_reader, wire_rows
from common.protocol import CloseEntry, OpenEntry, Prefilled, SamplingParams, TreeEntry, Verified
from common.rpc import CHANNEL_OPTIONS
from common.tracing import traceparent_of
from common.tree import DraftTree
from drafter_svc.link import GrpcLink, open_channel, verifier_stub
from tests.reference import distinct_sibling_tokens

TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "default", "target")
FEATURE_DIM = 4096  # Qwen3-8B's hidden size: the context rows a projecting verifier sends
ECHO = "/bench.Echo/Session"
PROMPT = [1, 2, 3]


def _tracing(service: str) -> None:
    """Record every span in memory (what bench/round.py and the tests do)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.tracing import setup_tracing

    setup_tracing(service, exporter=InMemorySpanExporter())


def max_seq_len(rounds: int, rows: int, nodes: int) -> int:
    """Room for the prompt, `rounds` rounds of `rows` committed tokens each, and one more tree."""
    return len(PROMPT) + (rounds + 1) * rows + nodes + 8


def _record_verifier(stages_dir: str) -> None:
    """Wrap the verifier's parts of a message's way to record them (`--stages`); before the service
    (and the canned encoders below) take the functions."""
    import common.wire as wire
    import verifier_svc.scheduler as scheduler
    import verifier_svc.server as server
    from bench.timeline import Recorder

    rec = Recorder(stages_dir, "verifier")
    worker = scheduler.ModelWorker
    worker.submit = rec.host("v.submit", worker.submit)
    worker._begin = rec.host("v.begin", worker._begin)
    worker._finish = rec.host("v.finish", worker._finish)
    server.decode_message = rec.host("v.parse", server.decode_message)
    server.decode_link_request = rec.host("v.decode", server.decode_link_request)
    wire.encode_link_response = rec.host("v.encode", wire.encode_link_response)


def _verifier_process(port_out, rows: int, trace: bool, sessions: int, seq_len: int, nodes: int,
                      stages_dir: str | None = None, feature_wire: str = "model") -> None:
    """Serve the real Verifier service with a canned batched verify until killed."""
    if stages_dir:
        _record_verifier(stages_dir)
    import verifier_svc.scheduler
    from common.wire import encode_link_notice, encode_link_response, feature_bytes
    from verifier_svc.server import VerifierConfig, load_verifier, serve
    from common.staging import HostCopy
    from verifier_svc.target_runner import PendingVerify, VerifiedBatch

    if trace:
        _tracing("verifier")
    # Feature layer 0: sessions ask for features (the canned ones below, of 8B width).
    config = VerifierConfig(target_dir=TARGET, feature_layer_ids=(0,), port=0, max_sessions=sessions,
                            max_seq_len=seq_len, max_tree_nodes=max(nodes, 1), cuda_graphs=False)
    verifier = load_verifier(config)
    runner = verifier.runner
    # Packed rows (--feature-wire fp8): packed once here; a GPU verifier packs them on its device.
    runner.feature_wire = FORMATS[feature_wire]
    width, dtype = wire_rows(FEATURE_DIM, runner.feature_wire, torch.bfloat16)
    features = runner.features_for_host(torch.zeros(sessions * rows, FEATURE_DIM, dtype=torch.bfloat16))
    path = list(range(rows))  # root + rows - 1 "accepted" nodes: rows feature rows per session
    real_prefill = runner.prefill

    def prefill(slots, prompts, pasts=None):
        logits, _ = real_prefill(slots, prompts, pasts)
        return logits, [torch.zeros(p.shape[0], FEATURE_DIM, dtype=torch.bfloat16) for p in prompts]

    def launch_verify(batch_rows, masks):
        return PendingVerify(list(batch_rows), HostCopy(), features)

    def finish_verify(pending):
        batch_rows = pending.rows
        # the accepted tokens read as `TargetRunner.finish_verify` reads them: each tree's tokens as a list
        tokens = [r.tree.token_list() for r in batch_rows]
        return VerifiedBatch(paths=[path] * len(batch_rows), bonus=[t[0] for t in tokens],
                             accepted=[t[1: len(path)] for t in tokens],
                             features=features[: len(batch_rows) * rows], logprobs=[None] * len(batch_rows))

    runner.prefill = prefill
    runner.launch_verify, runner.finish_verify = launch_verify, finish_verify
    # Replies and notices without rows (a close-only message, first tokens ahead of their prompt's
    # features) carry an empty tensor of the features' width.
    verifier_svc.scheduler.encode_link_response = (
        lambda step, results, feature_dim, _, step_s=0.0, **kw: encode_link_response(
            step, results, width, dtype, step_s, **kw))
    verifier_svc.scheduler.encode_link_notice = (
        lambda step, results, feature_dim, _: encode_link_notice(step, results, width, dtype))
    verifier_svc.scheduler.feature_bytes = lambda results, feature_dim, _: feature_bytes(results, width, dtype)

    async def main():
        _, port = await serve(config, verifier)
        port_out.put(port)
        await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def _recording_drafter(stages_dir: str):
    """Record the drafter's parts of a message's way (`--stages`) while inside; the link's
    functions are restored after."""
    import drafter_svc.link as link
    from bench.timeline import Recorder
    from common import socket_link

    rec = Recorder(stages_dir, "drafter")
    wrapped = [(link, "encode_link_request", "d.encode"), (link, "parse_link_response", "d.parse"),
               (link, "decode_link_response", "d.decode"), (link.GrpcLink, "send", "d.send"),
               (socket_link, "send_frame", "d.write")]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in wrapped]
    originals.append((link.GrpcLink, "_next_reply", link.GrpcLink._next_reply))
    for owner, attr, name in wrapped:
        setattr(owner, attr, rec.host(name, getattr(owner, attr)))
    next_reply = link.GrpcLink._next_reply

    def timed_next_reply(self):
        data, arrived = next_reply(self)  # `arrived`: when the reader thread got the bytes (perf_counter)
        end = time.monotonic_ns()
        rec.span("d.read", end - int((time.perf_counter() - arrived) * 1e9), end)  # its arrival to its read
        return data, arrived

    link.GrpcLink._next_reply = timed_next_reply
    try:
        yield
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


# A message's way, part by part (`stage_medians`): (name, (span, edge), (span, edge)), the part
# running from the first point to the second; each span is the message's next one of that name.
STAGES = (
    ("drafter encode", ("d.send", 0), ("d.out", 0)),  # d.out: the bytes handed to gRPC's queue or the socket
    ("way up", ("d.out", 0), ("v.parse", 0)),
    ("verifier parse + decode", ("v.parse", 0), ("v.decode", 1)),
    ("hand-off to the worker", ("v.decode", 1), ("v.begin", 0)),
    ("begin (checks, masks)", ("v.begin", 0), ("v.begin", 1)),
    ("worker, to the finish", ("v.begin", 1), ("v.finish", 0)),
    ("finish (results, commit)", ("v.finish", 0), ("v.encode", 0)),
    ("reply encode", ("v.encode", 0), ("v.encode", 1)),
    ("way down", ("v.encode", 1), ("d.read", 0)),
    ("reader hand-off", ("d.read", 0), ("d.read", 1)),
    ("drafter parse + decode", ("d.parse", 0), ("d.decode", 1)),
    ("total", ("d.send", 0), ("d.decode", 1)),
)


def stage_medians(stages_dir: str, start_ns: int, end_ns: int) -> dict[str, float]:
    """Median ms of each part of `STAGES` over the messages sent in [start_ns, end_ns] (the first
    tenth left out), from both processes' records; one message in flight at a time."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for path in glob.glob(os.path.join(stages_dir, "*.jsonl")):
        with open(path) as f:
            for line in f:
                name, begin, end = json.loads(line)
                if name != "role" and start_ns <= begin <= end_ns:
                    spans.setdefault(name, []).append((begin, end))
    for found in spans.values():
        found.sort()
    sends = spans.get("d.send", [])
    parts: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for send in sends[len(sends) // 10: -1]:  # the last one's reply may fall outside the window
        # Where the bytes leave the drafter's code: the socket write's start, or (gRPC) the send's end.
        out = next((w[0] for w in spans.get("d.write", []) if send[0] <= w[0] <= send[1]), send[1])
        points: dict[str, tuple[int, int]] = {"d.send": send, "d.out": (out, out)}
        after = send[0]
        for name in ("v.parse", "v.decode", "v.begin", "v.finish", "v.encode", "d.read", "d.parse", "d.decode"):
            nxt = next((s for s in spans.get(name, []) if s[0] >= after), None)
            if nxt is None:
                break
            points[name] = nxt
            after = nxt[0]
        else:
            for stage, (a, i), (b, j) in STAGES:
                parts[stage].append((points[b][j] - points[a][i]) / 1e6)
    return {stage: statistics.median(v) for stage, v in parts.items() if v}


def _echo_process(port_out) -> None:
    """A bare grpc.aio bidirectional stream answering each message with as many bytes as its
    first 8 bytes say (little-endian), so one server serves every case."""
    replies: dict[int, bytes] = {}

    async def session(request_iterator, context):
        async for request in request_iterator:
            size = int.from_bytes(request[:8], "little")
            reply = replies.get(size)
            if reply is None:
                reply = replies[size] = bytes(size)
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


def with_root(tree: DraftTree, root: int) -> DraftTree:
    return DraftTree(torch.cat([torch.tensor([root]), tree.tokens[1:]]), tree.next_token, tree.next_sibling)


def tree_entries(trees: dict[int, DraftTree], round_index: int, traceparents: dict[int, str] | None = None):
    return [TreeEntry(sid, round_index, tree, (traceparents or {}).get(sid, "")) for sid, tree in trees.items()]


def _busy_wait(seconds: float) -> None:
    """Stand-in for the drafter's own work between steps (it keeps its core busy, as a CUDA sync does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _check(results, kind) -> None:
    for r in results:
        if not isinstance(r.outcome, kind):
            raise RuntimeError(f"session {r.session_id}: expected {kind.__name__}, got {r.outcome!r}")


_staging = torch.empty(0, dtype=torch.uint8)  # reused, as PyTorch's cache of pinned host blocks is


def _host_part(rows: torch.Tensor, packed: bool) -> torch.Tensor:
    """What a GPU drafter's host does with a reply's feature rows (`common.feature_wire.feature_reader`):
    check the scales of packed ones, and copy them out of the reply into pinned memory for the
    copy to the device; the rest (the copy, the unpack) runs on the device. The rows come back
    as they were sent (the benchmarks read only their count)."""
    global _staging
    if packed:
        check_packed(rows)
    flat = rows.reshape(-1).view(torch.uint8)
    if _staging.numel() < flat.numel():
        _staging = torch.empty(flat.numel(), dtype=torch.uint8)
    return _staging[: flat.numel()].copy_(flat).view(rows.dtype).view(rows.shape)


def gpu_drafter_reader(feature_wire: str) -> FeatureReader:
    """How a drafter on a GPU reads the replies' rows: the real reader where there is a GPU, else its
    host's part alone (`_host_part`)."""
    if torch.cuda.is_available():
        return feature_reader(FORMATS[feature_wire], torch.device("cuda"), torch.bfloat16)
    packed = feature_wire == "fp8"
    return FeatureReader(packed, functools.partial(_host_part, packed=packed))


def time_link(port: int, tree: DraftTree, batch: int, rounds: int, trace: bool, gap_s: float, vocab: int,
              seq_len: int, feature_wire: str = "model", feature_ring: bool = False, unix_socket: bool = False) -> dict:
    """Open `batch` sessions in one message, then time `rounds` messages of one tree per session
    (the rows through the verifier's shared-memory ring with `feature_ring`, the messages through
    a Unix socket with `unix_socket`)."""
    channel = open_channel(f"127.0.0.1:{port}")
    link = GrpcLink(verifier_stub(channel), vocab_size=vocab, feature_dim=FEATURE_DIM, max_seq_len=seq_len,
                    features=gpu_drafter_reader(feature_wire), feature_ring=feature_ring, unix_socket=unix_socket)
    tracer = otel_trace.get_tracer(__name__)
    sids = list(range(1, batch + 1))
    requests = {sid: tracer.start_span("generate") for sid in sids} if trace else {}
    opened = link.step([OpenEntry(sid, PROMPT, SamplingParams(), traceparent_of(requests[sid]) if trace else "",
                                  feature_layer_ids=(0,)) for sid in sids])
    _check(opened, Prefilled)
    trees = {r.session_id: with_root(tree, r.outcome.token) for r in opened}
    times, wire, up, down, rows = [], [], [], [], 0
    window_start = time.monotonic_ns()  # the timed messages' (for `stage_medians`)
    for r in range(1, rounds + 1):
        _busy_wait(gap_s)
        sent, received = link.bytes_sent, link.bytes_received
        start = time.perf_counter()
        if trace:
            with tracer.start_as_current_span("draft_step", attributes={"sessions": batch}) as step_span:
                links = [otel_trace.Link(step_span.get_span_context())]
                spans = {sid: tracer.start_span("round", context=otel_trace.set_span_in_context(requests[sid]),
                                                links=links) for sid in sids}
                entries = tree_entries(trees, r, {sid: traceparent_of(span) for sid, span in spans.items()})
                with tracer.start_as_current_span("verify_rpc"):
                    results = link.step(entries)
                for span in spans.values():
                    span.end()
        else:
            results = link.step(tree_entries(trees, r))
        times.append((time.perf_counter() - start) * 1e3)
        wire.append(link.link_s * 1e3)  # the round trip less the verifier's hold, plus the reply's decoding
        up.append(link.bytes_sent - sent)
        down.append(link.bytes_received - received)
        if r == 1:
            _check(results, Verified)
            rows = sum(res.outcome.features.shape[0] for res in results)
    window = (window_start, time.monotonic_ns())
    width, dtype = wire_rows(FEATURE_DIM, FORMATS[feature_wire], torch.bfloat16)
    link.step([CloseEntry(sid) for sid in sids])
    for span in requests.values():
        span.end()
    link.close()
    channel.close()
    warm = times[len(times) // 10:]
    warm_wire = wire[len(wire) // 10:]
    return {"median_ms": statistics.median(warm), "p90_ms": float(np.percentile(warm, 90)),
            "wire_median_ms": statistics.median(warm_wire),
            "held_median_ms": statistics.median(t - w for t, w in zip(warm, warm_wire)),
            "request_bytes": int(statistics.median(up)), "reply_bytes": int(statistics.median(down)),
            "feature_rows": rows, "feature_bytes": rows * width * dtype.itemsize, "window_ns": window}


def time_echo(port: int, request_bytes: int, reply_bytes: int, rounds: int, gap_s: float) -> dict:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    call_fn = channel.stream_stream(ECHO)
    requests: queue.Queue = queue.Queue()
    end = object()
    replies = iter(call_fn(iter(requests.get, end)))
    payload = reply_bytes.to_bytes(8, "little") + bytes(max(0, request_bytes - 8))
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
    p.add_argument("--batches", default="1,8,32", help="sessions per link message, comma-separated (default 1,8,32)")
    p.add_argument("--nodes", type=int, default=65, help="tree nodes per session, root included (default 65)")
    p.add_argument("--feature-rows", default="1,7", help="feature rows per session's result, comma-separated "
                   "(default 1,7)")
    p.add_argument("--rounds", type=int, default=300, help="timed link messages per case (default 300)")
    p.add_argument("--gaps-ms", default="0,3", help="drafter work between messages, comma-separated ms (default "
                   "0,3); the server idles meanwhile, as the verifier does while a real drafter drafts")
    p.add_argument("--trace", action="store_true", help="record spans in both processes, as bench/round.py does")
    p.add_argument("--stages", action="store_true", help="also time each part of a message's way (both processes' "
                   "host clocks) and print their medians")
    p.add_argument("--feature-wire", choices=tuple(FORMATS), default="model",
                   help="feature rows as the verifier's --feature-wire sends them: model (bf16) or fp8 (packed, "
                   "half the bytes); default model")
    p.add_argument("--feature-rings", default="off,on",
                   help="off: the rows travel inline in the replies, as to a drafter on another host; on: through "
                   "the verifier's shared-memory ring (common/feature_ring.py), as to one on its host; "
                   "comma-separated (default off,on)")
    p.add_argument("--unix-sockets", default="off,on",
                   help="off: the messages go through the gRPC stream, as to a drafter on another host; on: "
                   "through the Unix socket the verifier offers (common/socket_link.py), as to one on its host; "
                   "comma-separated (default off,on)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    rings, sockets = (_switches(p, a.feature_rings, "--feature-rings"), _switches(p, a.unix_sockets, "--unix-sockets"))
    batches, feature_rows = number_list(a.batches, "--batches"), number_list(a.feature_rows, "--feature-rows")
    gaps = number_list(a.gaps_ms, "--gaps-ms", float)
    if a.nodes < 1 or a.rounds < 10:
        p.error("--nodes must be >= 1 and --rounds >= 10")
    if not batches or min(batches) < 1 or not feature_rows or min(feature_rows) < 1:
        p.error("--batches and --feature-rows must be >= 1")
    if max(feature_rows) > a.nodes:
        p.error("--feature-rows cannot exceed --nodes (a session accepts at most nodes - 1 tokens)")

    torch.set_num_threads(1)
    if a.trace:
        _tracing("drafter")
    vocab = load_target_config(TARGET).vocab_size
    tree = random_tree(a.nodes, vocab)
    res = {"trace": a.trace, "feature_wire": a.feature_wire, "nodes": a.nodes, "cpus": os.cpu_count(),
           "rounds": a.rounds, "rows": []}
    print(f"# transport bench: {a.nodes}-node trees, batches {batches}, {a.rounds} messages per case", flush=True)
    stages_dir = tempfile.mkdtemp(prefix="transport-stages-") if a.stages else None
    echo_proc, echo_port = _start(_echo_process)
    try:
        for rows in feature_rows:
            seq_len = max_seq_len(a.rounds, rows, a.nodes)
            proc, port = _start(_verifier_process, rows, a.trace, max(batches), seq_len, a.nodes, stages_dir,
                                a.feature_wire)
            try:
                with _recording_drafter(stages_dir) if stages_dir else contextlib.nullcontext():
                    links = {(b, gap, ring, sock): time_link(port, tree, b, a.rounds, a.trace, gap / 1e3, vocab,
                                                             seq_len, a.feature_wire, ring == "on", sock == "on")
                             for b in batches for gap in gaps for ring in rings for sock in sockets}
            finally:
                proc.kill()
            for (b, gap, ring, sock), link in links.items():
                window = link.pop("window_ns")
                if stages_dir:
                    link["stages_ms"] = stage_medians(stages_dir, *window)
                echo = time_echo(echo_port, link["request_bytes"], link["reply_bytes"], a.rounds, gap / 1e3)
                overhead = link["median_ms"] - echo["median_ms"]
                res["rows"].append({"batch": b, "feature_rows": rows, "gap_ms": gap, "feature_ring": ring,
                                    "unix_socket": sock,
                                    "request_bytes": link["request_bytes"], "reply_bytes": link["reply_bytes"],
                                    "link": link, "echo": echo, "overhead_ms": overhead,
                                    "link_per_session_ms": link["median_ms"] / b,
                                    "echo_per_session_ms": echo["median_ms"] / b,
                                    "overhead_per_session_ms": overhead / b})
            write_json(a.out_json, res)
    finally:
        echo_proc.kill()
        if stages_dir:
            shutil.rmtree(stages_dir, ignore_errors=True)
    print_table(res)
    write_json(a.out_json, res)
    return res


def _switches(p: argparse.ArgumentParser, text: str, flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("off", "on") for v in values):
        p.error(f"{flag} takes off, on or both")
    return values


def print_table(res: dict) -> None:
    print(f"\n{'B':>3} {'rows':>4} {'gap':>5} {'ring':>4} {'sock':>4} {'bytes up':>9} {'bytes down':>10} {'link':>8} "
          f"{'link p90':>9} "
          f"{'held':>7} {'wire':>7} {'echo':>8} {'echo p90':>9} {'ours':>8} {'link/B':>8} {'echo/B':>8} {'ours/B':>8}")
    for row in res["rows"]:
        link, echo = row["link"], row["echo"]
        print(f"{row['batch']:3d} {row['feature_rows']:4d} {row['gap_ms']:5.1f} {row['feature_ring']:>4} "
              f"{row.get('unix_socket', 'off'):>4} "
              f"{row['request_bytes']:9d} "
              f"{row['reply_bytes']:10d} {link['median_ms']:8.3f} {link['p90_ms']:9.3f} {link['held_median_ms']:7.3f} "
              f"{link['wire_median_ms']:7.3f} {echo['median_ms']:8.3f} "
              f"{echo['p90_ms']:9.3f} {row['overhead_ms']:8.3f} {row['link_per_session_ms']:8.3f} "
              f"{row['echo_per_session_ms']:8.3f} {row['overhead_per_session_ms']:8.3f}")
    print("(ms per link message of B sessions' trees, and per session (/B); rows = feature rows per session; "
          "ring = the rows through the verifier's shared-memory ring (bytes down then leave them out); "
          "sock = the messages through the Unix socket the verifier offers instead of gRPC; "
          "ours = link - echo: servicer, worker hop, tree validation, codec; held = the verifier's hold of the "
          "message, its decoding to its reply's encoding (LinkResponse.held_seconds: the worker hop, tree "
          "validation, masks, the canned verify); wire = link - held: gRPC both ways, the drafter's encoding "
          "and decoding, the verifier's parse and its reply's way to the event loop's write)")
    staged = [row for row in res["rows"] if row["link"].get("stages_ms")]
    if staged:
        cases = [f"B={row['batch']} g={row['gap_ms']:g} {row['feature_ring']}/{row.get('unix_socket', 'off')}"
                 for row in staged]
        print(f"\n{'part of the way (median ms)':<28}" + "".join(f"{case:>18}" for case in cases))
        for stage, _, _ in STAGES:
            times = [row["link"]["stages_ms"].get(stage, float("nan")) for row in staged]
            print(f"{stage:<28}" + "".join(f"{t:18.3f}" for t in times))


if __name__ == "__main__":
    main()
