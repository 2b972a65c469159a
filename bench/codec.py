"""The link's codecs alone, per batch: the reply's (the verifier's encode, the drafter's parse +
decode) and the request's (the drafter's encode, the verifier's parse + decode), and the
verifier's checks of the request's trees (walk and masks).

    PYTHONPATH=. python bench/codec.py [--batches 1,8,32] [--rows 7] [--width 4096] [--nodes 16]
        [--reps 300] [--feature-wire model|fp8] [--out-json FILE]

A reply of B sessions' Verified results, each with `--rows` feature rows of `--width` bf16
values (4096: Qwen3-8B's hidden size, the context rows a projecting verifier sends), is
encoded as the verifier's model worker does (`common.wire.encode_link_response`, to the
bytes gRPC writes) and parsed and decoded as the drafter's link does (`parse_link_response`,
then `decode_link_response` over the features' view). A request of B `--nodes`-node trees is
encoded as the drafter's link does (`encode_link_request`, serialised) and parsed and decoded
as the verifier's link handler does (`decode_message`, `decode_link_request`); its trees are then
walked and their masks built as the verifier's step does (`walk_trees`, `ancestor_masks`). Before
the request, the drafter's trees: DraftTrees made from B sessions' selected DDTree nodes of
`--nodes - 1` drafted tokens (`DDTreeSelection.trees`, after `select_ddtrees` over random
logits). One process, no gRPC: bench/transport.py times the whole exchange.

The drafter's decoding includes its reading of the rows as a drafter on a GPU reads them (bench/transport.py's
`gpu_drafter_reader`; without a GPU, its host's part: the rows' copy out of the reply into
staging memory for one copy to the device, and with `--feature-wire fp8`, where the rows come
packed, the check of their scales); the draft step's inputs are then filled on the device.
Prints a table of means (ms; the better of two timings of `--reps` calls each) and writes JSON
with --out-json.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time

import torch

from bench.bench_timing import number_list, out_json, write_json
from bench.transport import gpu_drafter_reader, random_tree
from common.feature_wire import FORMATS, pack_rows, wire_rows
from common.protocol import StepResult, TreeEntry, Verified
from common.rpc import decode_message, pb
from common.tree import TreeLayout, ancestor_masks, walk_trees
from common.wire import (LinkLimits, decode_link_request, decode_link_response, encode_link_request,
                         encode_link_response, parse_link_response)
from drafter_svc.ddtree import select_ddtrees

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
    p.add_argument("--nodes", type=int, default=16, help="tree nodes per session in the request, root included "
                   "(default 16)")
    p.add_argument("--reps", type=int, default=300, help="timed calls per case (default 300)")
    p.add_argument("--feature-wire", choices=tuple(FORMATS), default="model",
                   help="feature rows in bf16, or packed as the verifier's --feature-wire fp8 sends them")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)
    batches = number_list(a.batches, "--batches")
    if not batches or min(batches) < 1 or a.rows < 1 or a.width < 1 or a.reps < 1 or a.nodes < 1:
        p.error("--batches, --rows, --width, --nodes and --reps must be >= 1")
    torch.set_num_threads(1)
    packed = a.feature_wire == "fp8"
    res = {"rows_per_session": a.rows, "width": a.width, "nodes": a.nodes, "reps": a.reps,
           "feature_wire": a.feature_wire, "rows": []}
    print(f"{'B':>4} {'reply MB':>9} {'encode':>8} {'decode':>8} {'trees':>7} {'req KB':>7} {'req enc':>8} "
          f"{'req dec':>8} {'walk':>7} {'masks':>7}")
    for batch in batches:
        features = torch.randn(batch * a.rows, a.width, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16)
        sent = pack_rows(features) if packed else features
        width, dtype = wire_rows(a.width, FORMATS[a.feature_wire], torch.bfloat16)
        results = [StepResult(s + 1, Verified([1] * (a.rows - 1), 2, sent[s * a.rows:(s + 1) * a.rows], 3))
                   for s in range(batch)]
        data = encode_link_response(1, results, width, dtype).data

        def decode():
            msg, view = parse_link_response(data)
            return decode_link_response(msg, vocab_size=VOCAB, feature_dim=a.width,
                                        max_feature_rows=batch * a.rows, feature_data=view,
                                        reader=gpu_drafter_reader(a.feature_wire))

        if not torch.cuda.is_available():  # the rows as they were sent (on a GPU, in the model's dtype there)
            assert torch.equal(torch.cat([r.outcome.features for r in decode()]), sent)
        encode = lambda: encode_link_response(1, results, width, dtype)  # noqa: E731

        logits = torch.randn(batch, a.nodes - 1, 1024, generator=torch.Generator().manual_seed(batch))
        selection = select_ddtrees(logits, [1] * batch, [a.nodes - 1] * batch)
        tree = random_tree(a.nodes, VOCAB)
        entries = [TreeEntry(s + 1, 2, tree) for s in range(batch)]
        request = encode_link_request(1, entries).SerializeToString()
        limits = LinkLimits(max_entries=batch, max_tree_nodes=a.nodes)
        decode_request = lambda: decode_link_request(decode_message(pb.LinkRequest, request), limits)  # noqa: E731
        trees = [e.tree for e in decode_request()]
        walk = lambda: walk_trees(trees, vocab_size=VOCAB, max_nodes=a.nodes, max_depth=a.nodes)  # noqa: E731
        layouts = walk()
        assert all(isinstance(layout, TreeLayout) for layout in layouts), layouts  # every tree walked, none refused

        def best(fn) -> float:  # the better of two timings: the first case warms up slowly
            return min(mean_ms(fn, a.reps) for _ in range(2))

        row = {"batch": batch, "reply_bytes": len(data), "request_bytes": len(request),
               "encode_ms": best(encode), "decode_ms": best(decode), "trees_ms": best(selection.trees),
               "request_encode_ms": best(lambda: encode_link_request(1, entries).SerializeToString()),
               "request_decode_ms": best(decode_request), "walk_ms": best(walk),
               "masks_ms": best(lambda: ancestor_masks(layouts, a.nodes))}
        res["rows"].append(row)
        print(f"{batch:>4} {len(data) / 1e6:>9.3f} {row['encode_ms']:>8.3f} {row['decode_ms']:>8.3f} "
              f"{row['trees_ms']:>7.3f} {len(request) / 1e3:>7.1f} {row['request_encode_ms']:>8.3f} "
              f"{row['request_decode_ms']:>8.3f} "
              f"{row['walk_ms']:>7.3f} {row['masks_ms']:>7.3f}", flush=True)
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
