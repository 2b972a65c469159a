r"""Worst round stall that decoding sessions see while a long prompt arrives (chunked prefill).

    PYTHONPATH=. python bench/prefill_stall.py --models qwen3-8b [--chunks 0,512] [--decoders 16] \
        [--long-prompt 4096] [--decoder-new-tokens 512] [--out-json prefill_stall.json]
    PYTHONPATH=. python bench/prefill_stall.py --models default --device cpu --chunks 0,64 --decoders 4 \
        --long-prompt 400 --decoder-new-tokens 320 --max-seq-len 512          # CPU smoke run

For every value C of `--chunks`, the script starts the two real services as their own
processes, exactly as bench/serve.py does for the chosen `--models` setup (the verifier,
then the drafter with `--prefill-chunk C`; C = 0 means the whole prompt in one piece, no
chunking), and:

1. warms up: one request with a long prompt and short requests from every decoding client,
   all at once (untimed; the first long prefill pays one-off costs);
2. starts `--decoders` streaming Generate clients (short prompts, greedy, `--tree-budget`,
   `--decoder-new-tokens` new tokens each), recording when every streamed delta arrives;
3. once every client has its first token, lets them decode `--warmup-s` more seconds, then
   sends ONE request with a `--long-prompt`-token prompt and 16 new tokens;
4. waits for everything to finish and stops both services.

Prompts: with `--models default`, the decoders' prompts are windows of the target's
held-out files (as in bench/serve.py) and the long prompt is those files' tokens joined
(repeated when they are shorter); with `--models qwen3-8b`, random token ids.

Reported per chunk value (times are client side, gaps between consecutive deltas of one
decoding client):

* worst stall: the largest gap of any decoding client that overlaps the interval from the
  long request being sent to its first token + 0.05 s;
* base p50 / p99: the decoders' gaps before the long request was sent (after all of them had
  their first token): what a round normally takes;
* long TTFT: the long request's time to first token;
* tok/s: the decoders' tokens per second, from the moment all had their first token to the
  last delta; "in window": the same over the stall interval only;
* active: how many decoders were still decoding when the long request got its first token
  (fewer than --decoders: raise --decoder-new-tokens).
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
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from bench import serve
from bench.bench_timing import out_json, write_json
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc

LONG_NEW_TOKENS = 16  # new tokens of the long request
WINDOW_PAD_S = 0.05  # the stall window ends this long after the long request's first token
WARMUP_TOKENS = 16  # new tokens of each warm-up request


def log(message: str) -> None:
    print(f"[prefill-stall] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/prefill_stall.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="qwen3-8b", choices=("qwen3-8b", "default"),
                   help="model setup: qwen3-8b (random weights at Qwen3-8B dimensions, bench/serve_roles.py) or "
                        "default (the shipped trained pair) (default qwen3-8b)")
    serve.add_setup_flags(p)
    p.add_argument("--chunks", type=serve.count_list, default=[0, 512],
                   help="the drafter's --prefill-chunk values to compare, comma-separated; 0 = the whole prompt "
                        "in one piece (default 0,512)")
    p.add_argument("--decoders", type=int, default=16, help="decoding clients streaming at once (default 16)")
    p.add_argument("--long-prompt", type=int, default=4096, help="tokens of the long prompt (default 4096)")
    p.add_argument("--decoder-prompt-len", type=int, default=128, help="prompt tokens of each decoder (default 128)")
    p.add_argument("--decoder-new-tokens", type=int, default=512,
                   help="new tokens per decoder; enough that they still decode when the long prompt has been "
                        "served (default 512)")
    p.add_argument("--tree-budget", type=int, default=16, help="drafted nodes per tree of every request (default 16)")
    p.add_argument("--warmup-s", type=float, default=1.0,
                   help="seconds the decoders decode after all have their first token, before the long request "
                        "is sent (default 1.0)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="verifier tokens per session (default: the longest request + a tree, rounded up to 256)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="both services without CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a service may take to start listening (default 900)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request in s (default 600)")
    p.add_argument("--log-dir", default=None,
                   help="keep the services' logs here (default: a temporary folder, removed at the end)")
    p.add_argument("--out-json", type=out_json, help="write the setup and all numbers here")
    return p


def needed_seq_len(a: argparse.Namespace) -> int:
    """Tokens per session the longest request needs: prompt + new tokens + one tree."""
    return max(a.long_prompt + LONG_NEW_TOKENS, a.decoder_prompt_len + a.decoder_new_tokens) + a.tree_budget + 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if min(a.decoders, a.long_prompt, a.decoder_prompt_len, a.decoder_new_tokens) < 1:
        p.error("--decoders, --long-prompt, --decoder-prompt-len and --decoder-new-tokens must be >= 1")
    if a.tree_budget < 0 or a.warmup_s < 0:
        p.error("--tree-budget and --warmup-s must be >= 0")
    a.max_seq_len = a.max_seq_len or -(-needed_seq_len(a) // 256) * 256
    if a.max_seq_len < needed_seq_len(a):
        p.error(f"--max-seq-len {a.max_seq_len} is below the {needed_seq_len(a)} tokens the longest request needs "
                f"(prompt + new tokens + a tree of {a.tree_budget} + 1)")
    return a


def serve_options(a: argparse.Namespace) -> argparse.Namespace:
    """bench/serve.py's options for the same services: sessions for every decoder plus the long request."""
    sessions = a.decoders + 1
    argv = ["--models", a.models, "--device", a.device, "--dtype", a.dtype, "--tree-budget", str(max(1, a.tree_budget)),
            "--concurrency", str(sessions), "--max-sessions", str(sessions), "--max-seq-len", str(a.max_seq_len),
            "--max-new-tokens", str(a.decoder_new_tokens), "--graph-batches", f"{a.decoders},{sessions}",
            "--startup-timeout", str(a.startup_timeout)]
    argv += ["--small"] if a.small else []
    argv += ["--no-cuda-graphs"] if a.no_cuda_graphs else []
    argv += ["--target", a.target] if a.target else []
    argv += ["--draft", a.draft] if a.draft else []
    return serve.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Prompts.
# ---------------------------------------------------------------------------------------


def heldout_ids(target_dir: Path) -> list[int]:
    """The tokens of the target's held-out files, joined in file order."""
    from common.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    heads = json.loads((target_dir / "corpus.json").read_text()).get("heldout_heads") or {}
    return [i for _, text in sorted(heads.items()) for i in tokenizer.encode(text).ids]


Prompts = tuple[list[list[int]], list[list[int]], list[int], list[int]]


def make_prompts(setup: serve.Setup, a: argparse.Namespace) -> Prompts:
    """(decoders' warm-up prompts, decoders' timed prompts, warm-up long prompt, timed long prompt)."""
    n = 2 * a.decoders
    if setup.heldout_target is not None:
        pool = serve.heldout_windows(setup.heldout_target, a.decoder_prompt_len)
        if len(pool) < n:
            raise SystemExit(f"error: the held-out files give {len(pool)} distinct {a.decoder_prompt_len}-token "
                             f"prompts, {n} are needed: lower --decoder-prompt-len or --decoders")
        short = [list(pool[i * len(pool) // n]) for i in range(n)]  # spread over the files
        ids = heldout_ids(setup.heldout_target)
        tiled = ids * (-(-2 * a.long_prompt // len(ids)) + 1)
        half = len(ids) // 2  # the warm-up starts elsewhere, so the two long prompts differ
        long_warm, long_timed = tiled[half:half + a.long_prompt], tiled[:a.long_prompt]
    else:
        rng = random.Random(a.seed)
        short = [[rng.randrange(setup.vocab_size) for _ in range(a.decoder_prompt_len)] for _ in range(n)]
        long_warm, long_timed = ([rng.randrange(setup.vocab_size) for _ in range(a.long_prompt)] for _ in range(2))
    return short[:a.decoders], short[a.decoders:], long_warm, long_timed


# ---------------------------------------------------------------------------------------
# The load.
# ---------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streaming Generate call: when it was sent and when each delta with tokens arrived."""
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # perf_counter() seconds, one per delta
    counts: list[int] = field(default_factory=list)  # tokens of each delta
    finish_reason: str = ""
    error: str = ""

    @property
    def first(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None


async def stream(stub, prompt: list[int], budget: int, max_new: int, timeout_s: float, rec: Stream,
                 on_first=lambda: None) -> Stream:
    """Run one Generate call into `rec`; `on_first()` is called once, at the first token or at the end."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new, tree_budget=budget)
    rec.sent = time.perf_counter()
    try:
        async for reply in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if reply.HasField("final"):
                rec.finish_reason = reply.final.finish_reason
            elif reply.delta.token_ids:  # deltas with text only (a held-back tail) carry no token
                rec.arrivals.append(now)
                rec.counts.append(len(reply.delta.token_ids))
                if len(rec.arrivals) == 1:
                    on_first()
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    if not rec.arrivals:
        on_first()
    return rec


async def run_load(address: str, prompts: Prompts, a: argparse.Namespace) -> tuple[list[Stream], Stream, float]:
    """Warm-up, then the decoders and the long request: (decoders, long request, when all decoders had
    their first token)."""
    warm_short, timed_short, long_warm, long_timed = prompts
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        log(f"warm-up: one {len(long_warm)}-token prompt and {len(warm_short)} short ones")
        warm = await asyncio.gather(
            stream(stub, long_warm, a.tree_budget, WARMUP_TOKENS, a.request_timeout, Stream()),
            *(stream(stub, p, a.tree_budget, WARMUP_TOKENS, a.request_timeout, Stream()) for p in warm_short))
        for w in warm:
            if w.error:
                log(f"warm-up request failed: {w.error}")

        started = asyncio.Event()
        waiting = [len(timed_short)]

        def on_first() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                started.set()

        decoders = [Stream() for _ in timed_short]
        log(f"{len(decoders)} decoders, {a.decoder_new_tokens} new tokens each")
        tasks = [asyncio.create_task(stream(stub, p, a.tree_budget, a.decoder_new_tokens, a.request_timeout, rec,
                                            on_first)) for p, rec in zip(timed_short, decoders)]
        await started.wait()
        all_first = time.perf_counter()
        log(f"all decoders have their first token; {a.warmup_s:g} s more, then the long request")
        await asyncio.sleep(a.warmup_s)
        long = Stream()
        await stream(stub, long_timed, a.tree_budget, LONG_NEW_TOKENS, a.request_timeout, long)
        log("long request done; waiting for the decoders")
        await asyncio.gather(*tasks)
    return decoders, long, all_first


# ---------------------------------------------------------------------------------------
# Summary.
# ---------------------------------------------------------------------------------------


def gaps(rec: Stream) -> list[tuple[float, float, int]]:
    """(previous delta's arrival, this delta's arrival, its tokens) for every delta after the first."""
    return [(t0, t1, n) for t0, t1, n in zip(rec.arrivals, rec.arrivals[1:], rec.counts[1:])]


def tokens_per_s(decoders: list[Stream], start: float, end: float) -> float | None:
    """Tokens of the deltas arriving in (start, end], per second."""
    tokens = sum(n for d in decoders for t, n in zip(d.arrivals, d.counts) if start < t <= end)
    return tokens / (end - start) if end > start else None


def summarise(chunk: int, decoders: list[Stream], long: Stream, all_first: float) -> dict:
    """The numbers of one chunk value (times in ms)."""
    w0 = long.sent
    w1 = (long.first if long.first is not None else time.perf_counter()) + WINDOW_PAD_S
    worst, where = None, None
    baseline = []
    for i, d in enumerate(decoders):
        for t0, t1, n in gaps(d):
            if t1 > w0 and t0 < w1 and (worst is None or t1 - t0 > worst):
                worst, where = t1 - t0, {"decoder": i, "start_after_send_ms": (t0 - w0) * 1e3, "tokens": n}
            if t0 >= all_first and t1 <= w0:
                baseline.append(t1 - t0)
    ends = [d.arrivals[-1] for d in decoders if d.arrivals]
    base_p50 = serve.percentile(baseline, 50)
    return {
        "chunk": chunk,
        "worst_stall_ms": serve.ms(worst),
        "worst_stall": where,
        "stall_over_base_p50": worst / base_p50 if worst is not None and base_p50 else None,
        "base_gap_p50_ms": serve.ms(base_p50),
        "base_gap_p99_ms": serve.ms(serve.percentile(baseline, 99)),
        "base_gaps": len(baseline),
        "long_ttft_ms": serve.ms(long.first - long.sent) if long.first is not None else None,
        "long_tokens": sum(long.counts),
        "decoder_tokens_per_s": tokens_per_s(decoders, all_first, max(ends, default=all_first)),
        "window_tokens_per_s": tokens_per_s(decoders, w0, w1),
        "window_ms": (w1 - w0) * 1e3,
        "decoders_active": sum(1 for t in ends if long.first is not None and t > long.first),
        "decoder_tokens": sum(sum(d.counts) for d in decoders),
        "finish_reasons": {k: sum(d.finish_reason == k for d in decoders)
                           for k in sorted({d.finish_reason for d in decoders})},
        "errors": sum(1 for d in decoders + [long] if d.error),
        "error_examples": sorted({d.error for d in decoders + [long] if d.error})[:3],
        # Every delta's arrival, ms after the long request was sent: enough to redraw the timeline.
        "timeline_ms": {"long": [(t - w0) * 1e3 for t in long.arrivals],
                        "decoders": [[round((t - w0) * 1e3, 3) for t in d.arrivals] for d in decoders]},
    }


def _cell(value, width: int, digits: int = 1) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{value:>{width}.{digits}f}"


def print_table(result: dict) -> None:
    s = result["setup"]
    print(f"\nprefill stall: {s['model']} on {s['device_name']} ({s['dtype']}, torch {s['torch']}), "
          f"{s['decoders']} decoders ({s['decoder_prompt_len']}-token prompts, tree budget {s['tree_budget']}), "
          f"one {s['long_prompt']}-token prompt after {s['warmup_s']:g} s of decoding")
    print("stall = largest gap between two deltas of a decoder overlapping [long sent, long first token + "
          f"{WINDOW_PAD_S * 1e3:.0f} ms]; base = decoders' gaps before the long request; active = decoders still "
          "decoding at the long request's first token")
    head = [("chunk", 6), ("active", 6), ("base50", 8), ("base99", 8), ("stall", 9), ("x base", 7),
            ("longTTFT", 9), ("tok/s", 8), ("win tok/s", 9), ("err", 4)]
    print(" ".join(f"{h:>{w}}" for h, w in head) + "   (times in ms)")
    for r in result["runs"]:
        print(" ".join([_cell(r["chunk"], 6), _cell(r["decoders_active"], 6), _cell(r["base_gap_p50_ms"], 8),
                        _cell(r["base_gap_p99_ms"], 8), _cell(r["worst_stall_ms"], 9),
                        _cell(r["stall_over_base_p50"], 7, 2), _cell(r["long_ttft_ms"], 9),
                        _cell(r["decoder_tokens_per_s"], 8), _cell(r["window_tokens_per_s"], 9),
                        _cell(r["errors"], 4)]))


# ---------------------------------------------------------------------------------------
# One chunk value end to end.
# ---------------------------------------------------------------------------------------


def run_chunk(chunk: int, a: argparse.Namespace, setup: serve.Setup, prompts: Prompts, work: Path,
              result: dict) -> dict:
    """Start the verifier and a drafter with --prefill-chunk `chunk`, run the load, stop both."""
    services: list[serve.Service] = []
    try:
        verifier = serve.Service("verifier", setup.verifier_argv, work / f"chunk{chunk}-verifier.log")
        services.append(verifier)
        verifier.start(a.startup_timeout)
        argv = setup.drafter_argv + ["--verifier", verifier.address]
        argv += ["--prefill-chunk", str(chunk)]
        drafter = serve.Service("drafter", argv, work / f"chunk{chunk}-drafter.log")
        services.append(drafter)
        drafter.start(a.startup_timeout)
        result["commands"][str(chunk)] = {"verifier": verifier.argv, "drafter": argv}
        decoders, long, all_first = asyncio.run(run_load(drafter.address, prompts, a))
        row = summarise(chunk, decoders, long, all_first)
        row["startup_s"] = {"verifier": verifier.startup_s, "drafter": drafter.startup_s}
        if row["errors"]:
            log(f"{row['errors']} requests failed: {row['error_examples']}")
            drafter.print_log_tail(12)
        return row
    finally:
        for service in reversed(services):
            service.stop()


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop the services.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    options = serve_options(a)
    setup = serve.make_setup(a.models, options)
    prompts = make_prompts(setup, a)
    dtype = a.dtype if a.dtype != "auto" else "bfloat16" if a.device.startswith("cuda") else "float32"
    result = {
        "bench": "prefill_stall", "argv": [sys.argv[0], *(sys.argv[1:] if argv is None else argv)],
        "setup": {"model": setup.name, "device": a.device, "device_name": serve.device_name(a.device),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "dtype": dtype,
                  "torch": torch.__version__, "python": platform.python_version(), "decoders": a.decoders,
                  "long_prompt": a.long_prompt, "long_new_tokens": LONG_NEW_TOKENS,
                  "decoder_prompt_len": a.decoder_prompt_len, "decoder_new_tokens": a.decoder_new_tokens,
                  "tree_budget": a.tree_budget, "warmup_s": a.warmup_s, "max_seq_len": a.max_seq_len,
                  "chunks": a.chunks, "window_pad_s": WINDOW_PAD_S},
        "options": vars(a), "commands": {}, "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="prefill-stall-") as tmp:
        work = Path(a.log_dir) if a.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for chunk in a.chunks:
            log(f"chunk {chunk}: {'whole prompt in one piece' if chunk == 0 else f'{chunk} tokens per piece'}")
            try:
                row = run_chunk(chunk, a, setup, prompts, work, result)
            except RuntimeError as exc:  # a service did not start (its log tail is printed above)
                raise SystemExit(f"error: {exc}") from None
            result["runs"].append(row)
            write_json(a.out_json, result)  # keep what is done even if a later value fails
            stall = f"{row['worst_stall_ms']:.1f} ms" if row["worst_stall_ms"] is not None else "-"
            ttft = f"{row['long_ttft_ms']:.1f} ms" if row["long_ttft_ms"] is not None else "-"
            log(f"chunk {chunk}: worst stall {stall}, long TTFT {ttft}, "
                f"{row['decoders_active']}/{a.decoders} decoders still decoding at its first token")
            if row["decoders_active"] < a.decoders:
                log("some decoders had finished before the long request's first token: raise --decoder-new-tokens")
    print_table(result)
    return result


if __name__ == "__main__":
    out = main(sys.argv[1:])
    sys.exit(1 if any(r["errors"] for r in out["runs"]) else 0)
