"""Per-round time split and bytes per round, read from the OpenTelemetry spans of real runs.

    python bench/trace_split.py --target DIR --draft DIR [--prompt TEXT] [--max-new-tokens N]
        [--budgets 0,4,16] [--device cpu] [--out-json FILE]

Starts the verifier and the drafter in this process on loopback (each on its own event
loop, exactly the servers `python -m verifier_svc` / `python -m drafter_svc` run), sends
one Generate request per budget, and averages over its rounds: the request's `round` spans
lead (by their links) to the drafter's `draft_step` spans and their `draft`, `tree_build`
and `verify_rpc` children; each round's `verify` span on the verifier (which covers the
verifier step its tree was batched in) leads (by its link) to that `verify_step` span and
its `forward`, `sample`, `commit` children. With one request at a time each step carries
one session's tree, so per step = per round; the rest of the RPC (verify_rpc - verify) is
transport plus encode/decode on both sides. Bytes are the link messages of the steps that
carried only trees (the drafter's GrpcLink counters).
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import torch  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from common.config import load_draft_config  # noqa: E402
from common.protocol import TreeEntry  # noqa: E402
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc  # noqa: E402
from bench.bench_timing import number_list, out_json
from common.tracing import setup_tracing  # noqa: E402
from drafter_svc.server import DrafterConfig, DrafterEngine  # noqa: E402
from drafter_svc.server import serve as serve_drafter  # noqa: E402
from tests.servers import ServerThread  # noqa: E402
from verifier_svc.server import VerifierConfig  # noqa: E402
from verifier_svc.server import serve as serve_verifier  # noqa: E402

STAGES = ["round", "draft", "tree_build", "verify_rpc", "verify", "forward", "sample", "commit"]


def split(spans, trace_id, step_bytes: list[tuple[int, int]]) -> dict:
    """Mean ms per round of each stage for the request whose `generate` span is in `trace_id`."""
    rounds = [s for s in spans if s.name == "round" and s.context.trace_id == trace_id]
    # drafter: round --link--> draft_step <--parent-- draft, tree_build, verify_rpc
    step_ids = {link.context.span_id for s in rounds for link in s.links}
    # verifier: verify (child of a round, covering the step) --link--> verify_step <--parent-- forward, ...
    round_ids = {s.context.span_id for s in rounds}
    verifies = [s for s in spans if s.name == "verify" and s.parent is not None and s.parent.span_id in round_ids]
    vstep_ids = {link.context.span_id for s in verifies for link in s.links}
    parents = {"draft": step_ids, "tree_build": step_ids, "verify_rpc": step_ids,
               "forward": vstep_ids, "sample": vstep_ids, "commit": vstep_ids}
    ms = {}
    for name in STAGES:
        if name == "round":
            group = rounds
        elif name == "verify":
            group = verifies
        else:
            group = [s for s in spans if s.name == name and s.parent is not None and s.parent.span_id in parents[name]]
        ms[name] = statistics.mean((s.end_time - s.start_time) / 1e6 for s in group) if group else 0.0
    ms["transport+codec"] = ms["verify_rpc"] - ms["verify"]
    return {
        "rounds": len(rounds),
        "ms_per_round": ms,
        "bytes_up_per_round": statistics.mean(up for up, _ in step_bytes) if step_bytes else 0,
        "bytes_down_per_round": statistics.mean(down for _, down in step_bytes) if step_bytes else 0,
        "mean_acceptance": statistics.mean(s.attributes.get("accepted", 0) + 1 for s in rounds) if rounds else 0,
    }


def record_tree_steps(link) -> list[tuple[int, int]]:
    """Wrap the drafter's GrpcLink: (bytes up, bytes down) of every message that carried only
    trees (one request at a time: the scheduler runs in lockstep, one message in flight)."""
    records: list[tuple[int, int]] = []
    send, receive = link.send, link.receive
    sent_of: list[tuple[bool, int]] = []

    def sending(entries):
        before = link.bytes_sent
        send(entries)
        sent_of.append((bool(entries) and all(isinstance(e, TreeEntry) for e in entries), link.bytes_sent - before))

    def receiving(on_notice=None):
        before = link.bytes_received
        results = receive(on_notice)
        trees_only, up = sent_of.pop(0)
        if trees_only:
            records.append((up, link.bytes_received - before))
        return results

    link.send, link.receive = sending, receiving
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint folder")
    p.add_argument("--draft", required=True, help="DFlash draft checkpoint folder")
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--budgets", default="0,4,16", help="comma-separated tree budgets")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device of both services")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args()
    budgets = number_list(a.budgets, "--budgets")
    exporter = InMemorySpanExporter()
    setup_tracing("trace-split").add_span_processor(SimpleSpanProcessor(exporter))
    layers = load_draft_config(a.draft).target_layer_ids
    vcfg = VerifierConfig(target_dir=a.target, feature_layer_ids=layers, host="127.0.0.1", port=0, device=a.device)
    results = {}
    with ServerThread(lambda: serve_verifier(vcfg)) as verifier:
        dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
        engine = DrafterEngine.start(DrafterConfig(draft_dir=a.draft, target_dir=a.target, device=a.device,
                                                   verifier=f"127.0.0.1:{verifier.port}"), dtype)
        step_bytes = record_tree_steps(engine.scheduler.link)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for budget in budgets:
                req = pb.GenerateRequest(text=a.prompt, max_new_tokens=a.max_new_tokens, tree_budget=budget)
                stub.GenerateOnce(req, timeout=600)  # warm-up
                exporter.clear()
                step_bytes.clear()
                stub.GenerateOnce(req, timeout=600)
                spans = exporter.get_finished_spans()
                root = next(s for s in spans if s.name == "generate")
                results[budget] = split(spans, root.context.trace_id, list(step_bytes))
    cols = ["round", "draft", "tree_build", "verify_rpc", "verify", "forward", "sample", "commit", "transport+codec"]
    print(f"{'budget':>6} {'rounds':>6} {'accept':>6} " + " ".join(f"{c:>15}" for c in cols) + "   bytes up/down")
    for budget, r in results.items():
        ms = r["ms_per_round"]
        print(f"{budget:>6} {r['rounds']:>6} {r['mean_acceptance']:>6.2f} " + " ".join(f"{ms[c]:>13.3f}ms" for c in cols)
              + f"   {r['bytes_up_per_round']:.0f}/{r['bytes_down_per_round']:.0f}")
    if a.out_json:
        Path(a.out_json).write_text(json.dumps({"device": a.device, "results": results}, indent=2))


if __name__ == "__main__":
    main()
