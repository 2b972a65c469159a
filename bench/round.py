"""One decoding step end to end: drafter and verifier on one GPU, over loopback gRPC.

    PYTHONPATH=. python bench/round.py [--modes ar,chain,8,16,32,64] [--sessions 1] [--rounds 32]
        [--out-json round.json]
    PYTHONPATH=. python bench/round.py --sessions 1,8,32   # the same step with 1, 8 and 32 sessions batched
    PYTHONPATH=. python bench/round.py --small          # toy sizes, runs on CPU too
    PYTHONPATH=. python bench/round.py --no-draft-graphs  # the draft step eagerly (compare)

The verifier runs in its own process (`verifier_svc.server.serve` with a TreeVerifier built
in memory: a random-weight TargetModel at Qwen3-8B dimensions, CUDA graphs as the server
uses them), with an in-memory span exporter. This process is the drafter: a random-weight
DFlash draft of the published Qwen3-8B shape (5 layers, block 16, hidden 4096, target layers
1, 9, 17, 25, 33) under the drafter service's own `DraftScheduler`, over a `GrpcLink` (one
`Link` stream), its draft step replaying CUDA graphs as the drafter service does (eager with
--no-draft-graphs; bench/draft_step.py times the draft step alone). Nothing is written to disk.

For each sessions count N (`--sessions`, comma-separated) and mode, N requests are submitted
at once; after the step that opens them all, every step drafts all N sessions in one batched
draft step and sends their N trees in one link message. The scheduler is stepped here
(`DraftScheduler.step`) for `--rounds` such steps, then the requests are cancelled. Per step
(medians over the steps of a case, the first two skipped as warm-up when there are more
than four; a warm-up case per N runs first), read from the spans: the drafter's `draft_step`
and its `draft` (forward, synchronised), `tree_build` and `verify_rpc` (the link exchange as
the scheduler sees it) children, and, joined through the `round` -> `verify` -> `verify_step`
span links, the verifier's `verify_step` and its `forward` / `sample` / `commit` children
(v-other: the rest of the verifier's step: tree walk and validation, ancestor masks);
net+codec = exchange - the verifier's step span (both sides' codec, gRPC, the worker hop);
encode / decode: the drafter's own share of it (link-message encode; reply decode and
checks); loop = step - draft - build - exchange (spans, deliveries); overhead = step - (draft
forward + verify forward); bytes each way per link message; step/N: the step per session.
With random weights almost nothing is accepted, so each session's result carries the
features of one or two tokens (about 40 KB per token at these dimensions). Prints a table,
writes JSON with --out-json (missing values, e.g. a span the verifier does not emit, are null).
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import functools
import math
import multiprocessing as mp
import statistics
import time

import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.bench_timing import out_json, write_json
from common.protocol import SamplingParams, StatusError
from common.tracing import setup_tracing
from drafter_svc.draft_graphs import DraftGraphConfig
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.link import GrpcLink, open_channel, verifier_stub
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.session import GenerationConfig, GenerationResult, RoundUpdate

from bench.verify import draft_config, feature_layers, qwen3_8b_config, random_draft, random_projection, random_target


# ---------------------------------------------------------------------------------------
# The verifier process.
# ---------------------------------------------------------------------------------------


def _span_records(spans) -> list[dict]:
    """What the drafter needs of the verifier's spans to join them to its own (picklable)."""
    return [{"name": s.name, "id": s.context.span_id, "parent": s.parent.span_id if s.parent is not None else None,
             "links": [link.context.span_id for link in s.links], "start": s.start_time, "end": s.end_time,
             "attributes": dict(s.attributes or {})} for s in spans]


def verifier_main(conn, small: bool, device: str, cuda_graphs: bool, max_seq_len: int, sessions: int,
                  graph_batches: tuple[int, ...], raw_features: bool) -> None:
    """Child process: serve a random-weight verifier until told to stop; answer span queries."""
    import logging

    from verifier_svc.server import VerifierConfig, serve
    from verifier_svc.target_runner import TargetRunner
    from verifier_svc.tree_verifier import TreeVerifier

    logging.basicConfig(level=logging.INFO, format="verifier %(levelname)s %(name)s: %(message)s")
    exporter = InMemorySpanExporter()
    setup_tracing("verifier", exporter=exporter)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = qwen3_8b_config(small)
    t0 = time.perf_counter()
    model = random_target(cfg, feature_layers(cfg), dev, dtype, seed=0)
    if not raw_features:  # the drafter's random fc + hidden_norm, as `--draft` has the verifier apply them
        model.feature_projection = random_projection(small, dev, dtype)
    config = VerifierConfig(target_dir="(random weights in memory)", feature_layer_ids=model.feature_layer_ids,
                            host="127.0.0.1", port=0, device=device, dtype=str(dtype).removeprefix("torch."),
                            max_sessions=sessions, max_seq_len=max_seq_len, cuda_graphs=cuda_graphs,
                            graph_batches=graph_batches)
    runner = TargetRunner(model, config.max_sessions, max_seq_len, config.max_tree_nodes, cuda_graphs=cuda_graphs,
                          graph_config=config.graph_config())
    verifier = TreeVerifier(runner, config.limits())
    startup_s = time.perf_counter() - t0

    async def run() -> None:
        server, port = await serve(config, verifier)
        conn.send({"port": port, "startup_s": startup_s,
                   "graphs": runner.graphs.num_graphs if runner.graphs is not None else 0,
                   "capture_s": runner.graphs.capture_s if runner.graphs is not None else 0.0})
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "spans":
                conn.send(_span_records(exporter.get_finished_spans()))
                exporter.clear()
            else:
                break
        await server.stop(1)

    asyncio.run(run())
    conn.send("stopped")


# ---------------------------------------------------------------------------------------
# The drafter side.
# ---------------------------------------------------------------------------------------


class SyncedProposer(DFlashProposer):
    """Waits for the device at the end of the draft forward, so its time is not billed to the tree build."""

    def propose(self, *args, **kwargs):
        logits = super().propose(*args, **kwargs)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        return logits


class _TimedQueue:
    """The link's request queue, stamping when a message is handed to gRPC."""

    def __init__(self, inner, stamps: dict):
        self.inner, self.stamps = inner, stamps

    def put(self, item):
        self.stamps["sent"] = time.perf_counter()
        self.inner.put(item)

    def get(self, *args, **kwargs):
        return self.inner.get(*args, **kwargs)


class TimedLink(GrpcLink):
    """GrpcLink's send + receive split into message encode, the wire exchange and reply decode
    (+ checks); the scheduler runs in lockstep here, so one message is in flight at a time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []
        self._stamps: dict = {}

    def _connect(self) -> None:
        super()._connect()
        self._requests = _TimedQueue(self._requests, self._stamps)

    def _next_reply(self):
        data, arrived = super()._next_reply()
        self._stamps["received"] = arrived  # the link's reader thread took it off the stream then
        return data, arrived

    def send(self, entries) -> None:
        self._stamps.clear()
        self._stamps.update(t0=time.perf_counter(), bytes_sent=self.bytes_sent, bytes_received=self.bytes_received)
        super().send(entries)

    def receive(self, on_notice=None):
        results = super().receive(on_notice)
        t3 = time.perf_counter()
        t0 = self._stamps["t0"]
        t1, t2 = self._stamps.get("sent", t0), self._stamps.get("received", t3)
        self.records.append({"encode_ms": (t1 - t0) * 1e3, "wire_ms": (t2 - t1) * 1e3, "decode_ms": (t3 - t2) * 1e3,
                             "bytes_up": self.bytes_sent - self._stamps["bytes_sent"],
                             "bytes_down": self.bytes_received - self._stamps["bytes_received"]})
        return results


def random_proposer(small: bool, device, dtype, max_seq_len: int, cuda_graphs: bool = True,
                    cls: type[DFlashProposer] = SyncedProposer, slots: int = 1,
                    batch_buckets: tuple[int, ...] | None = None, projected: bool = False) -> DFlashProposer:
    """A random-weight draft of the bench's shape with the target's embedding and head, `slots`
    context slots, draft graphs for `batch_buckets` sessions per step (default: the default
    buckets up to `slots`); `projected`: it is sent context rows (the verifier projects)."""
    draft, embed, head = random_draft(small, device, dtype)
    buckets = batch_buckets or tuple(b for b in DraftGraphConfig.batch_buckets if b <= slots) or (slots,)
    return cls(draft, embed, head, max_seq_len, slots, cuda_graphs, DraftGraphConfig(batch_buckets=buckets),
               projected)


def parse_mode(text: str) -> DraftMode:
    if text in ("ar", "chain"):
        return DraftMode(text, 0)
    return DraftMode("tree", int(text))


def run_case(scheduler: DraftScheduler, link: TimedLink, exporter: InMemorySpanExporter, mode: DraftMode,
             prompts: list[list[int]], rounds: int, max_new: int) -> dict:
    """Submit one request per prompt, step until all are open, time `rounds` steps, cancel them."""
    ends: dict[int, object] = {}
    updates: list[RoundUpdate] = []

    def take(index: int, item) -> None:  # called on this thread, inside scheduler.step()
        if isinstance(item, (GenerationResult, StatusError)):
            ends[index] = item
        else:
            updates.append(item)

    config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(), mode=mode)
    sids = [scheduler.submit(prompt, config, functools.partial(take, i)) for i, prompt in enumerate(prompts)]
    opened = 0
    while opened < len(prompts):  # the open step(s): one Open per session, prefill on the verifier
        before = opened
        scheduler.step()
        opened = sum(1 for u in updates if u.round == 0)
        if ends:
            raise RuntimeError(f"a session ended while opening: {next(iter(ends.values()))!r}")
        if opened == before:
            time.sleep(0.01)
    exporter.clear()
    first_record = len(link.records)
    step_ms = []
    for _ in range(rounds):
        start = time.perf_counter()
        scheduler.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    spans = exporter.get_finished_spans()
    records = link.records[first_record:]
    early = len(ends)
    for sid in sids:
        scheduler.cancel(sid)
    scheduler.run_until_idle()
    errors = [e for e in ends.values() if isinstance(e, StatusError)]
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed: {errors[0].status}: {errors[0].message}")
    return {"step_ms": step_ms, "records": records, "spans": spans, "ended_early": early}


def med(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def _ms(s) -> float:
    start, end = (s["start"], s["end"]) if isinstance(s, dict) else (s.start_time, s.end_time)
    return (end - start) / 1e6


def join_steps(run: dict, verifier_spans: list[dict]) -> list[dict]:
    """One dict per timed step: its drafter spans and, through its rounds, its verifier spans."""
    spans = run["spans"]
    steps = sorted((s for s in spans if s.name == "draft_step"), key=lambda s: s.start_time)
    children: dict[int, dict[str, object]] = {}
    for s in spans:
        if s.parent is not None and s.name in ("draft", "tree_build", "verify_rpc"):
            children.setdefault(s.parent.span_id, {})[s.name] = s
    rounds: dict[int, list] = {}
    for s in spans:
        if s.name == "round":
            for link in s.links:
                rounds.setdefault(link.context.span_id, []).append(s)
    by_id = {s["id"]: s for s in verifier_spans}
    verify_of_round = {s["parent"]: s for s in verifier_spans if s["name"] == "verify"}
    vchildren: dict[int, dict[str, dict]] = {}
    for s in verifier_spans:
        if s["parent"] is not None and s["name"] in ("forward", "sample", "commit"):
            vchildren.setdefault(s["parent"], {})[s["name"]] = s
    out = []
    for step in steps:
        mine = rounds.get(step.context.span_id, [])
        verifies = [verify_of_round[r.context.span_id] for r in mine if r.context.span_id in verify_of_round]
        vstep_ids = {link for v in verifies for link in v["links"]}
        vstep = by_id.get(next(iter(vstep_ids))) if len(vstep_ids) == 1 else None
        out.append({"step": step, "children": children.get(step.context.span_id, {}), "rounds": mine,
                    "vstep": vstep, "vchildren": vchildren.get(vstep["id"], {}) if vstep else {},
                    "vsteps": len(vstep_ids)})
    return out


def summarise(name: str, sessions: int, run: dict, verifier_spans: list[dict], skip: int) -> dict:
    steps = join_steps(run, verifier_spans)
    if len(steps) != len(run["step_ms"]) or len(run["records"]) != len(run["step_ms"]):
        raise RuntimeError(f"{len(run['step_ms'])} steps timed, {len(steps)} draft_step spans, "
                           f"{len(run['records'])} link messages")
    steps, wall, recs = steps[skip:], run["step_ms"][skip:], run["records"][skip:]

    def child(st, key, which="children"):
        s = st[which].get(key)
        return _ms(s) if s is not None else None

    rounds = [r for st in steps for r in st["rounds"]]
    row = {
        "mode": name,
        "sessions": sessions,
        "steps": len(steps),
        "sessions_per_step": med(st["step"].attributes.get("sessions", 0) for st in steps),
        "ended_early": run["ended_early"],
        "tree_nodes": med(r.attributes.get("tree.nodes", 0) for r in rounds),
        "accepted_per_round": float(statistics.mean([r.attributes.get("accepted", 0) + 1 for r in rounds] or [0])),
        "step_ms": med(wall),
        "draft_step_ms": med(_ms(st["step"]) for st in steps),
        "draft_ms": med(child(st, "draft") for st in steps),
        "tree_build_ms": med(child(st, "tree_build") for st in steps),
        "exchange_ms": med(child(st, "verify_rpc") for st in steps),
        "encode_ms": med(r["encode_ms"] for r in recs),
        "wire_ms": med(r["wire_ms"] for r in recs),
        "decode_ms": med(r["decode_ms"] for r in recs),
        "verify_step_ms": med(_ms(st["vstep"]) if st["vstep"] else None for st in steps),
        "forward_ms": med(child(st, "forward", "vchildren") for st in steps),
        "sample_ms": med(child(st, "sample", "vchildren") for st in steps),
        "commit_ms": med(child(st, "commit", "vchildren") for st in steps),
        "verifier_steps_per_step": med(st["vsteps"] for st in steps),
        "bytes_up": med(r["bytes_up"] for r in recs),
        "bytes_down": med(r["bytes_down"] for r in recs),
    }

    def z(key):  # a missing span counts as 0 in the differences (no `draft` span: nobody drafted)
        v = row[key]
        return 0.0 if math.isnan(v) else v

    row["verifier_other_ms"] = row["verify_step_ms"] - z("forward_ms") - z("sample_ms") - z("commit_ms")
    row["net_codec_ms"] = row["exchange_ms"] - row["verify_step_ms"]
    row["network_ms"] = row["wire_ms"] - row["verify_step_ms"]
    row["loop_other_ms"] = row["step_ms"] - z("draft_ms") - z("tree_build_ms") - row["exchange_ms"]
    row["overhead_ms"] = row["step_ms"] - z("draft_ms") - z("forward_ms")
    row["net_codec_share"] = row["net_codec_ms"] / row["step_ms"]
    row["step_per_session_ms"] = row["step_ms"] / max(1, row["sessions_per_step"])
    return row


def parse_sessions(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--modes", default="ar,chain,8,16,32,64", help="ar, chain or a tree budget, comma-separated")
    p.add_argument("--sessions", type=parse_sessions, default=[1],
                   help="concurrent sessions per step: N, or a comma-separated list of N (default 1)")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per case (default 32; 6 with --small)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; 32 with --small)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV capacity per session in tokens")
    p.add_argument("--no-cuda-graphs", action="store_true", help="verifier without CUDA graphs")
    p.add_argument("--no-draft-graphs", action="store_true", help="draft step without CUDA graphs")
    p.add_argument("--raw-features", action="store_true",
                   help="the verifier sends raw layer features (default: context rows, the draft's fc + "
                        "hidden_norm applied on the verifier, as `python -m verifier_svc --draft` does)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rounds = a.rounds or (6 if a.small else 32)
    prompt_len = a.prompt_len or (32 if a.small else 512)
    max_seq = min(a.max_seq_len, 512) if a.small else a.max_seq_len
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ar", "chain") and not m.isdigit()]
    if bad or not modes:
        p.error(f"--modes takes ar, chain and tree budgets (integers >= 0), got {a.modes!r}")
    sessions = sorted(set(a.sessions))
    skip = 2 if rounds > 4 else 0
    # Room for the prompt, every step's tokens (a round emits at most block_size) and a full tree:
    # no session may end on length, nor have its trees cut short, during the timed steps.
    block = draft_config(a.small, qwen3_8b_config(a.small)).block_size
    max_budget = max([parse_mode(m).budget for m in modes] + [16, block])
    if prompt_len + (rounds + 8) * block + max_budget + 1 > max_seq:
        p.error(f"--max-seq-len {max_seq} is too short for a {prompt_len}-token prompt, {rounds + 8} steps of up to "
                f"{block} tokens and a {max_budget}-node tree; raise it or lower --rounds / --prompt-len")

    exporter = InMemorySpanExporter()
    setup_tracing("drafter", exporter=exporter)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=verifier_main, args=(child, a.small, a.device, not a.no_cuda_graphs, max_seq,
                                                   max(sessions), tuple(sessions), a.raw_features), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
                 "rounds": rounds, "sessions": sessions, "cuda_graphs": not a.no_cuda_graphs,
                 "raw_features": a.raw_features, "modes": []}
    try:
        proposer = random_proposer(a.small, device, dtype, max_seq, not a.no_draft_graphs, slots=max(sessions),
                                   batch_buckets=tuple(sessions), projected=not a.raw_features)
        res["draft_graphs"] = proposer.graphs.num_graphs if proposer.graphs is not None else 0
        if not parent.poll(900):
            raise RuntimeError("the verifier did not start")
        info = parent.recv()
        res["verifier_start"] = info | {"wall_s": time.perf_counter() - t0}
        print(f"# round bench on {res['device']}: verifier on port {info['port']} "
              f"({info['graphs']} graphs in {info['capture_s']:.1f} s), {res['draft_graphs']} draft graphs, "
              f"sessions {sessions}", flush=True)
        channel = open_channel(f"127.0.0.1:{info['port']}")
        layer_ids = proposer.draft.cfg.target_layer_ids
        vocab = proposer.embed_tokens.shape[0]
        link = TimedLink(verifier_stub(channel), vocab_size=vocab,
                         feature_dim=proposer.feature_dim, max_seq_len=max_seq)
        scheduler = DraftScheduler(link, proposer, max_sessions=max(sessions), feature_layer_ids=layer_ids,
                                   queue_timeout_s=600.0, pipelined=False)  # one step = one message and its reply
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(vocab, (prompt_len,), generator=gen).tolist() for _ in range(max(sessions))]
        max_new = max_seq - prompt_len - 1

        def spans_of_verifier() -> list[dict]:
            parent.send("spans")
            return parent.recv()

        for n in sessions:
            run_case(scheduler, link, exporter, DraftMode("tree", 16), prompts[:n], 3, max_new)  # warm-up
            spans_of_verifier()
            for name in modes:
                run = run_case(scheduler, link, exporter, parse_mode(name), prompts[:n], rounds, max_new)
                row = summarise(name, n, run, spans_of_verifier(), skip)
                res["modes"].append(row)
                write_json(a.out_json, _json_safe(res))  # keep what is done even if the run is cut short
                print(f"  N={n:<3} {name:>5}: step {row['step_ms']:.2f} ms ({row['step_per_session_ms']:.2f} per "
                      f"session), draft {row['draft_ms']:.2f}, verify forward {row['forward_ms']:.2f}, "
                      f"net+codec {row['net_codec_ms']:.2f}", flush=True)
        scheduler.stop()
        channel.close()
    finally:
        try:
            parent.send("stop")
            parent.poll(30) and parent.recv()
        except (BrokenPipeError, EOFError, OSError):
            pass
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
    for r in res["modes"]:
        chain = next((c for c in res["modes"] if c["mode"] == "chain" and c["sessions"] == r["sessions"]), None)
        r["over_chain_ms"] = r["step_ms"] - chain["step_ms"] if chain else None
    print_table(res)
    write_json(a.out_json, _json_safe(res))
    return res


def _json_safe(obj):
    """NaN (a value with no samples, e.g. a span the verifier does not emit) as null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def print_table(res: dict) -> None:
    print(f"\nper-step split, medians in ms ({res['device']}, {res['dtype']}, prompt {res['prompt_len']}, "
          f"verifier CUDA graphs {'on' if res['cuda_graphs'] else 'off'}, draft CUDA graphs "
          f"{'on' if res.get('draft_graphs') else 'off'}); N sessions per step; exchange = verify_rpc span; "
          f"net+cod = exchange - verify_step; overhead = step - (draft + verify forward)")
    cols = [("N", "sessions"), ("mode", "mode"), ("nodes", "tree_nodes"), ("acc", "accepted_per_round"),
            ("step", "step_ms"), ("draft", "draft_ms"), ("build", "tree_build_ms"), ("exchange", "exchange_ms"),
            ("encode", "encode_ms"), ("v-step", "verify_step_ms"), ("forward", "forward_ms"),
            ("sample", "sample_ms"), ("commit", "commit_ms"), ("v-other", "verifier_other_ms"),
            ("net+cod", "net_codec_ms"), ("decode", "decode_ms"), ("loop", "loop_other_ms"),
            ("overhd", "overhead_ms"), ("net%", "net_codec_share"), ("B-up", "bytes_up"),
            ("B-down", "bytes_down"), ("step/N", "step_per_session_ms"), ("vs-chain", "over_chain_ms")]
    print(" ".join(f"{h:>8}" for h, _ in cols))
    for r in res["modes"]:
        cells = []
        for _, key in cols:
            v = r.get(key)
            if isinstance(v, float) and math.isnan(v):
                cells.append(f"{'-':>8}")
            elif key == "net_codec_share" and isinstance(v, float):
                cells.append(f"{100 * v:7.1f}%")
            elif isinstance(v, float):
                cells.append(f"{v:8.3f}" if abs(v) < 1000 else f"{v:8.0f}")
            else:
                cells.append(f"{str(v):>8}")
        print(" ".join(cells))
    if any(r.get("ended_early") for r in res["modes"]):
        print("(some sessions ended during the timed steps: see sessions_per_step / ended_early in the JSON)")


if __name__ == "__main__":
    main(sys.argv[1:])
