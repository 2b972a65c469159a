"""The link reply's codec alone: the verifier's encode and the drafter's parse + decode, per batch.

    PYTHONPATH=. python bench/codec.py [--batches 1,8,32] [--rows 7] [--width 4096] [--reps 300] [--out-json FILE]

A reply of B sessions' Verified results, each with `--rows` feature rows of `--width` bf16
values (4096: Qwen3-8B's hidden size, the context rows a projecting verifier sends), is
encoded as the verifier's model worker does (`common.wire.encode_link_response`, to the
bytes gRPC writes) and parsed and decoded as the drafter's link does (`parse_link_response`,
then `decode_link_response` over the features' view). One process, no gRPC: bench/transport.py
times the whole exchange. Prints a table of means (ms; the better of two timings of `--reps`
calls each) and writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time

import torch

from bench.bench_timing import write_json
from common.protocol import StepResult, Verified
from common.wire import decode_link_response, encode_link_response, parse_link_response

VOCAB = 151_936


def mean_ms(fn, reps: int) -> float:
    for _ in range(max(1, reps // 10)):  # warm-up
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--batches", default="1,8,32", help="sessions per reply, comma-separated (default 1,8,32)")
    p.add_argument("--rows", type=int, default=7, help="feature rows per session (default 7)")
    p.add_argument("--width", type=int, default=4096, help="feature width (default 4096)")
    p.add_argument("--reps", type=int, default=300, help="timed calls per case (default 300)")
    p.add_argument("--out-json", help="write the results here")
    a = p.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",") if x.strip()]
    if not batches or min(batches) < 1 or a.rows < 1 or a.width < 1 or a.reps < 1:
        p.error("--batches, --rows, --width and --reps must be >= 1")
    torch.set_num_threads(1)
    res = {"rows_per_session": a.rows, "width": a.width, "reps": a.reps, "rows": []}
    print(f"{'B':>4} {'reply MB':>9} {'encode':>8} {'decode':>8}")
    for batch in batches:
        features = torch.randn(batch * a.rows, a.width, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16)
        results = [StepResult(s, Verified([1] * (a.rows - 1), 2, features[s * a.rows:(s + 1) * a.rows], 3))
                   for s in range(batch)]
        data = encode_link_response(1, results, a.width, torch.bfloat16).data

        def decode():
            msg, view = parse_link_response(data)
            return decode_link_response(msg, vocab_size=VOCAB, feature_dim=a.width,
                                        max_feature_rows=batch * a.rows, feature_data=view)

        assert torch.equal(torch.cat([r.outcome.features for r in decode()]), features)
        encode = lambda: encode_link_response(1, results, a.width, torch.bfloat16)  # noqa: E731
        row = {"batch": batch, "reply_bytes": len(data),  # the better of two timings: the first case warms up slowly
               "encode_ms": min(mean_ms(encode, a.reps) for _ in range(2)),
               "decode_ms": min(mean_ms(decode, a.reps) for _ in range(2))}
        res["rows"].append(row)
        print(f"{batch:>4} {len(data) / 1e6:>9.3f} {row['encode_ms']:>8.3f} {row['decode_ms']:>8.3f}", flush=True)
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
