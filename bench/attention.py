"""The verify pass's attention over the cache slots, by launch shape, against its read floor.

    PYTHONPATH=. python bench/attention.py [--batches 1,16,32] [--trees 16,64] [--pasts 256,1024]
        [--tiles auto,masked,64x64w4s2,128x64w8s2] [--out-json attention.json]
    PYTHONPATH=. python bench/attention.py --small      # toy sizes, runs on CPU through the interpreter

Qwen3-8B attention shapes (32 query heads, 8 KV heads x 128, 36 layers, bf16 on CUDA): B
sessions, each with `past` tokens in its own cache slot and a tree of 1 + N tokens after them
(each node sees the past, itself and a random half of the nodes before it, as an ancestor mask
would). One replay of a CUDA graph runs `ddtree_kernels.slot_attention.slot_attention_triton` once per
layer, each layer over its own cache (so the K/V come from memory, not from L2), plus one
`key_ranges` for the whole pass, as `TargetModel.forward` does; the table gives the device time
per layer. Configurations (`--tiles`):

* `auto`: the kernel's own choice (`attention_tiles`);
* `masked`: the same, with the key ranges set to (0, L), so every key tile reads the mask and
  the keys after the last visible one are read too (what the kernel did before the ranges);
* `BMxBNwWsS[pP]`: BM query rows and BN keys per tile, W warps, S pipeline stages, P programs
  per SM (default 1).

floor: the K/V the pass must read (B x (past + 1 + N) keys x 8 heads x 128 x 2 x 2 bytes per
layer) at the read bandwidth measured in this run.
"""
from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel runs interpreted on the CPU

from bench.bench_timing import device_ms, measure_bandwidth, number_list, out_json, write_json  # noqa: E402
from ddtree_kernels.slot_attention import AttentionTiles, key_ranges, slot_attention_triton  # noqa: E402

_TILES = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)(?:p(\d+))?$")


def parse_tiles(text: str) -> AttentionTiles | str:
    if text in ("auto", "masked"):
        return text
    m = _TILES.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"tiles {text!r}: expected auto, masked or BMxBNwWsS[pP], e.g. 128x64w8s2")
    bm, bn, w, s, p = m.groups()
    return AttentionTiles(int(bm), int(bn), int(w), int(s), int(p or 1))


def tree_masks(batch: int, tokens: int, past: int, length: int, device) -> torch.Tensor:
    """[B, T, L] bool: the past, then each node sees itself and a random half of the earlier nodes."""
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    tree = (torch.rand(batch, tokens, tokens, generator=gen) < 0.5).tril()
    tree |= torch.eye(tokens, dtype=torch.bool)
    mask = torch.zeros(batch, tokens, length, dtype=torch.bool)
    mask[..., :past] = True
    mask[..., past:past + tokens] = tree
    return mask.to(device)


def config_name(config: AttentionTiles | str) -> str:
    if isinstance(config, str):
        return config
    return f"{config.block_m}x{config.block_n}w{config.warps}s{config.stages}p{config.programs_per_sm}"


def attention_fn(config: AttentionTiles | str):
    """fn(q, k_cache, v_cache, slots, mask, ranges) for one configuration."""
    tiles = None if isinstance(config, str) else config
    return lambda q, k, v, slots, mask, ranges: slot_attention_triton(q, k, v, slots, mask, ranges, tiles=tiles)


def time_case(shape: dict, batch: int, tokens: int, past: int, impls: dict, device, dtype, reps: int) -> list:
    """Device ms per layer of each implementation (name -> `attention_fn`'s kind of function)
    for one (batch, tokens, past)."""
    layers, heads, kv_heads, d = shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    length = past + tokens
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [torch.randn(2, batch, kv_heads, length + 64, d, device=device, dtype=dtype, generator=gen)
              for _ in range(layers)]
    q = torch.randn(batch, heads, tokens, d, device=device, dtype=dtype, generator=gen)
    slots = torch.randperm(batch, device=device)
    mask = tree_masks(batch, tokens, past, length, device)
    every_key = torch.tensor([[0, length]] * batch, dtype=torch.int32, device=device)  # for "masked"
    want = slot_attention_triton(q, caches[0][0], caches[0][1], slots, mask)
    rows = []
    for name, fn in impls.items():
        def one_pass(fn=fn, masked=name == "masked"):
            ranges = every_key if masked else key_ranges(mask)
            for cache in caches:
                fn(q, cache[0], cache[1], slots, mask, ranges)

        ranges = every_key if name == "masked" else key_ranges(mask)
        same = torch.allclose(fn(q, caches[0][0], caches[0][1], slots, mask, ranges).float(),
                              want.float(), atol=2e-2, rtol=2e-2)
        if device.type == "cuda":
            one_pass()  # compile outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass()
            ms = device_ms(graph.replay, device, reps)
        else:
            ms = device_ms(one_pass, device, reps)
        rows.append({"batch": batch, "tokens": tokens, "past": past, "config": name, "ms_per_layer": ms / layers,
                     "same_as_auto": same})
        print(f"  B {batch:3d} T {tokens:3d} past {past:5d} {name:>16s} {1e3 * ms / layers:9.1f} us/layer"
              f"{'' if same else '  DIFFERS'}", flush=True)
    return rows


def main(argv=None, extra: dict | None = None) -> dict:
    """Run the benchmark; `extra` adds implementations (name -> fn) to compare."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="toy sizes (2 layers, 4 / 2 heads x 16), float32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default=None, help="sessions per pass, comma-separated (default 1,16,32; small 1,2)")
    p.add_argument("--trees", default="16,64", help="drafted nodes per tree, comma-separated (default 16,64)")
    p.add_argument("--pasts", default=None, help="tokens in each slot before the tree (default 256,1024; small 40)")
    p.add_argument("--tiles", default="auto,masked", help="configurations, comma-separated (default auto,masked)")
    p.add_argument("--reps", type=int, default=None, help="timed replays (default 20 on GPU, 2 on CPU)")
    p.add_argument("--out-json", type=out_json, default=None, help="write the results here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    small = a.small or not cuda
    shape = (dict(layers=2, heads=4, kv_heads=2, head_dim=16) if small
             else dict(layers=36, heads=32, kv_heads=8, head_dim=128))
    dtype = torch.float32 if small else torch.bfloat16
    batches = number_list((a.batches or ("1,2" if small else "1,16,32")), "--batches")
    trees = number_list(a.trees, "--trees")
    pasts = number_list((a.pasts or ("40" if small else "256,1024")), "--pasts")
    impls = {config_name(c): attention_fn(c) for c in (parse_tiles(x) for x in a.tiles.split(","))}
    impls.update(extra or {})
    reps = a.reps or (20 if cuda else 2)
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "shape": shape, "dtype": str(dtype).removeprefix("torch."), "argv": sys.argv[1:]}
    res["bandwidth"] = measure_bandwidth(device, 2.0 if cuda else 0.05)
    read_bw = res["bandwidth"]["read_TBps"] * 1e12
    rows = []
    for batch in batches:
        for nodes in trees:
            for past in pasts:
                rows += time_case(shape, batch, 1 + nodes, past, impls, device, dtype, reps)
    for r in rows:
        kv = r["batch"] * (r["past"] + r["tokens"]) * shape["kv_heads"] * shape["head_dim"] * 2 * 2
        r["floor_ms_per_layer"] = kv / read_bw * 1e3
        r["x_floor"] = r["ms_per_layer"] / r["floor_ms_per_layer"]
    res["rows"] = rows
    print(f"\nslot attention, us per layer (read floor at {res['bandwidth']['read_TBps']:.2f} TB/s):")
    print(f"{'B':>4} {'T':>4} {'past':>5} {'config':>16} {'us':>9} {'floor':>7} {'x floor':>8}")
    for r in rows:
        print(f"{r['batch']:4d} {r['tokens']:4d} {r['past']:5d} {r['config']:>16s} {1e3 * r['ms_per_layer']:9.1f}"
              f" {1e3 * r['floor_ms_per_layer']:7.1f} {r['x_floor']:8.2f}")
    write_json(a.out_json, res)
    return res


if __name__ == "__main__":
    main()
