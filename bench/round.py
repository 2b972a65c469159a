"""One decoding round end to end: drafter and verifier on one GPU, over loopback gRPC.

    PYTHONPATH=. python bench/round.py [--modes ar,chain,8,16,32,64] [--rounds 32] [--out-json round.json]
    PYTHONPATH=. python bench/round.py --small          # toy sizes, runs on CPU too
    PYTHONPATH=. python bench/round.py --no-draft-graphs  # the draft step eagerly (compare)

The verifier runs in its own process (`verifier_svc.server.serve` with a TreeVerifier built
in memory: a random-weight TargetModel at Qwen3-8B dimensions, CUDA graphs as the server
uses them), with an in-memory span exporter. This process is the drafter: a random-weight
DFlash draft of the published Qwen3-8B shape (5 layers, block 16, hidden 4096, target layers
1, 9, 17, 25, 33) in a `DecodeSession` over a `GrpcVerifierLink`, i.e. the drafter service's
own loop, its draft step replaying CUDA graphs as the drafter service does (eager with
--no-draft-graphs; bench/draft_step.py times the draft step alone). Nothing is written to disk.

Per round (medians over the rounds of one generation, after a warm-up generation):
draft forward (synchronised), tree build, tree encode, the gRPC exchange, and inside it the
verifier's span times (forward, sample, commit, and the rest of its `verify` span: tree
validation + reply encode), feature decode; network = exchange - the verifier's span;
overhead = round - (draft forward + verify forward); bytes each way. With random weights
almost nothing is accepted, so each round carries the features of one or two tokens (about
40 KB per token at these dimensions). Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import torch

from bench.bench_timing import write_json
from common.config import DraftConfig
from common.layers import RotaryEmbedding
from common.protocol import SamplingParams, Verified
from common.rpc import pb, pb_grpc
from common.wire import encode_tree
from drafter_svc.draft_graphs import DraftGraphConfig
from drafter_svc.draft_model import DFlashDraftModel
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.session_loop import DecodeSession, GenerationConfig
from drafter_svc.verifier_client import GrpcVerifierLink, open_channel

from bench.verify import feature_layers, qwen3_8b_config, random_module_, random_target


def draft_config(small: bool, target) -> DraftConfig:
    layer_ids = feature_layers(target)
    if small:
        return DraftConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                           block_size=8, target_layer_ids=layer_ids, mask_token_id=target.vocab_size - 1,
                           num_target_layers=target.num_layers)
    return DraftConfig(vocab_size=151_936, hidden_size=4096, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=12_288, rms_norm_eps=1e-6, rope_theta=1e6, block_size=16,
                       target_layer_ids=layer_ids, mask_token_id=151_669, num_target_layers=36)


# ---------------------------------------------------------------------------------------
# The verifier process.
# ---------------------------------------------------------------------------------------


def _span_stats(spans) -> dict:
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    out = {}
    for name, group in by_name.items():
        group.sort(key=lambda s: s.start_time)
        out[name] = {"ms": [(s.end_time - s.start_time) / 1e6 for s in group],
                     "attributes": [dict(s.attributes or {}) for s in group]}
    return out


def verifier_main(conn, small: bool, device: str, cuda_graphs: bool, max_seq_len: int) -> None:
    """Child process: serve a random-weight verifier until told to stop; answer span queries."""
    import logging

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.tracing import setup_tracing
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
    config = VerifierConfig(target_dir="(random weights in memory)", feature_layer_ids=model.feature_layer_ids,
                            host="127.0.0.1", port=0, device=device, dtype=str(dtype).removeprefix("torch."),
                            max_sessions=2, max_seq_len=max_seq_len, cuda_graphs=cuda_graphs)
    runner = TargetRunner(model, config.max_sessions, max_seq_len, cuda_graphs=cuda_graphs)

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
            if command == "stats":
                conn.send(_span_stats(exporter.get_finished_spans()))
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

    def block_logits(self, *args, **kwargs):
        logits = super().block_logits(*args, **kwargs)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        return logits


class TimedLink(GrpcVerifierLink):
    """GrpcVerifierLink.verify split into tree encode, the exchange and feature decode."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def verify(self, tree, round_index: int, traceparent: str = "") -> Verified:
        t0 = time.perf_counter()
        msg = pb.DrafterMessage(tree=encode_tree(tree, round_index, traceparent))
        t1 = time.perf_counter()
        reply = self._exchange(msg, "verified").verified
        t2 = time.perf_counter()
        out = Verified(accepted_tokens=list(reply.accepted_tokens), next_token=reply.next_token,
                       features=self._features(reply.features))
        t3 = time.perf_counter()
        self.records.append({"encode_ms": (t1 - t0) * 1e3, "exchange_ms": (t2 - t1) * 1e3,
                             "decode_ms": (t3 - t2) * 1e3, "bytes_up": msg.ByteSize(),
                             "bytes_down": pb.VerifierMessage(verified=reply).ByteSize()})
        return out


def random_proposer(small: bool, device, dtype, max_seq_len: int, cuda_graphs: bool = True,
                    cls: type[DFlashProposer] = SyncedProposer) -> DFlashProposer:
    """A random-weight draft of the bench's shape with the target's embedding and head (one context slot)."""
    target = qwen3_8b_config(small)
    cfg = draft_config(small, target)
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg)
    random_module_(draft, device, dtype, seed=1)
    draft.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
    draft.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(2)
    embed = torch.empty(target.vocab_size, target.hidden_size, device=device, dtype=dtype).normal_(0, 0.02, generator=gen)
    head = torch.empty_like(embed).normal_(0, 0.02, generator=gen)
    return cls(draft, embed, head, max_seq_len, cuda_graphs, DraftGraphConfig(slots=1))


def parse_mode(text: str) -> DraftMode:
    if text in ("ar", "chain"):
        return DraftMode(text, 0)
    return DraftMode("tree", int(text))


def run_mode(stub, proposer, mode: DraftMode, prompt: list[int], rounds: int, layer_ids) -> dict:
    link = TimedLink(stub, layer_ids, timeout_s=600)
    # Room for a full tree in every round; the loop stops after `rounds` rounds (closing the session).
    config = GenerationConfig(max_new_tokens=20 * (rounds + 1), sampling=SamplingParams(), mode=mode)
    session = DecodeSession(link, proposer, prompt, config)
    updates, stamps = [], []
    last = time.perf_counter()
    for update in session:
        now = time.perf_counter()
        if update.round > 0:
            updates.append(update)
            stamps.append((now - last) * 1e3)
        last = now
        if len(updates) >= rounds or session.result.finish_reason:
            break
    return {"updates": updates, "round_ms": stamps, "link": link.records, "result": session.result}


def med(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def summarise(name: str, run: dict, spans: dict, skip: int) -> dict:
    ups, recs, rounds = run["updates"][skip:], run["link"][skip:], run["round_ms"][skip:]
    verify = spans.get("verify", {"ms": [], "attributes": []})
    n = len(run["updates"])
    server = {k: spans.get(k, {"ms": []})["ms"] for k in ("verify", "forward", "sample", "commit")}
    # The verifier's spans of this session: the last n of each (prefill has its own forward/sample).
    server = {k: v[-n:][skip:] for k, v in server.items()}
    row = {
        "mode": name,
        "rounds": len(ups),
        "tree_nodes": med(u.tree_nodes for u in ups),
        "accepted_per_round": statistics.mean(run["result"].acceptance_lengths[skip:] or [0]),
        "round_ms": med(rounds),
        "draft_ms": med(u.draft_s * 1e3 for u in ups),
        "tree_build_ms": med(u.tree_build_s * 1e3 for u in ups),
        "rpc_ms": med(u.verify_s * 1e3 for u in ups),
        "encode_ms": med(r["encode_ms"] for r in recs),
        "exchange_ms": med(r["exchange_ms"] for r in recs),
        "decode_ms": med(r["decode_ms"] for r in recs),
        "server_verify_ms": med(server["verify"]),
        "forward_ms": med(server["forward"]),
        "sample_ms": med(server["sample"]),
        "commit_ms": med(server["commit"]),
        "bytes_up": med(r["bytes_up"] for r in recs),
        "bytes_down": med(r["bytes_down"] for r in recs),
    }
    row["server_other_ms"] = row["server_verify_ms"] - row["forward_ms"] - row["sample_ms"] - row["commit_ms"]
    row["network_ms"] = row["exchange_ms"] - row["server_verify_ms"]
    row["loop_other_ms"] = row["round_ms"] - row["draft_ms"] - row["tree_build_ms"] - row["rpc_ms"]
    row["overhead_ms"] = row["round_ms"] - row["draft_ms"] - row["forward_ms"]
    row["grpc_codec_ms"] = row["network_ms"] + row["encode_ms"] + row["decode_ms"] + row["server_other_ms"]
    row["grpc_codec_share"] = row["grpc_codec_ms"] / row["round_ms"]
    row["verify_span_tree_nodes"] = med(a.get("tree.nodes", 0) for a in verify["attributes"][-n:][skip:])
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default="ar,chain,8,16,32,64", help="ar, chain or a tree budget, comma-separated")
    p.add_argument("--rounds", type=int, default=None, help="rounds per mode (default 32; 6 with --small)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; 32 with --small)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--no-cuda-graphs", action="store_true", help="verifier without CUDA graphs")
    p.add_argument("--no-draft-graphs", action="store_true", help="draft step without CUDA graphs")
    p.add_argument("--out-json", help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rounds = a.rounds or (6 if a.small else 32)
    prompt_len = a.prompt_len or (32 if a.small else 512)
    max_seq = min(a.max_seq_len, 512) if a.small else a.max_seq_len
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    skip = 2 if rounds > 4 else 0

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=verifier_main, args=(child, a.small, a.device, not a.no_cuda_graphs, max_seq),
                       daemon=True)
    t0 = time.perf_counter()
    proc.start()
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
                 "rounds": rounds, "cuda_graphs": not a.no_cuda_graphs, "modes": []}
    try:
        proposer = random_proposer(a.small, device, dtype, max_seq, not a.no_draft_graphs)
        res["draft_graphs"] = proposer.graphs.num_graphs if proposer.graphs is not None else 0
        if not parent.poll(900):
            raise RuntimeError("the verifier did not start")
        info = parent.recv()
        res["verifier_start"] = info | {"wall_s": time.perf_counter() - t0}
        print(f"# round bench on {res['device']}: verifier on port {info['port']} "
              f"({info['graphs']} graphs in {info['capture_s']:.1f} s)", flush=True)
        channel = open_channel(f"127.0.0.1:{info['port']}")
        stub = pb_grpc.VerifierStub(channel)
        layer_ids = proposer.draft.cfg.target_layer_ids
        vocab = proposer.embed_tokens.shape[0]
        prompt = torch.randint(vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        run_mode(stub, proposer, DraftMode("tree", 16), prompt, 4, layer_ids)  # warm-up (compiles, allocates)
        parent.send("stats")
        parent.recv()
        for name in modes:
            run = run_mode(stub, proposer, parse_mode(name), prompt, rounds, layer_ids)
            parent.send("stats")
            spans = parent.recv()
            row = summarise(name, run, spans, skip)
            res["modes"].append(row)
            write_json(a.out_json, res)  # keep what is done even if the run is cut short
            print(f"  {name:>5}: round {row['round_ms']:.2f} ms, draft {row['draft_ms']:.2f}, verify forward "
                  f"{row['forward_ms']:.2f}, overhead {row['overhead_ms']:.2f}", flush=True)
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
    chain = next((r for r in res["modes"] if r["mode"] == "chain"), None)
    for r in res["modes"]:
        r["over_chain_ms"] = r["round_ms"] - chain["round_ms"] if chain else None
    print_table(res)
    write_json(a.out_json, res)
    return res


def print_table(res: dict) -> None:
    print(f"\nround split, medians in ms ({res['device']}, {res['dtype']}, prompt {res['prompt_len']}, "
          f"verifier CUDA graphs {'on' if res['cuda_graphs'] else 'off'}, draft CUDA graphs "
          f"{'on' if res.get('draft_graphs') else 'off'}); overhead = round - (draft + verify forward)")
    cols = [("mode", "mode"), ("nodes", "tree_nodes"), ("acc", "accepted_per_round"), ("round", "round_ms"),
            ("draft", "draft_ms"), ("build", "tree_build_ms"), ("encode", "encode_ms"), ("network", "network_ms"),
            ("forward", "forward_ms"), ("sample", "sample_ms"), ("commit", "commit_ms"),
            ("srv-oth", "server_other_ms"), ("decode", "decode_ms"), ("loop", "loop_other_ms"),
            ("overhd", "overhead_ms"), ("grpc%", "grpc_codec_share"), ("B-up", "bytes_up"),
            ("B-down", "bytes_down"), ("vs-chain", "over_chain_ms")]
    print(" ".join(f"{h:>8}" for h, _ in cols))
    for r in res["modes"]:
        cells = []
        for _, key in cols:
            v = r.get(key)
            if key == "grpc_codec_share" and isinstance(v, float):
                cells.append(f"{100 * v:7.1f}%")
            elif isinstance(v, float):
                cells.append(f"{v:8.3f}" if abs(v) < 1000 else f"{v:8.0f}")
            else:
                cells.append(f"{str(v):>8}")
        print(" ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
