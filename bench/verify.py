"""Target verify pass at Qwen3-8B dimensions: eager vs CUDA graphs vs the weight-streaming floor.

    PYTHONPATH=. python bench/verify.py [--trees 16,32,64,128] [--past 1024] [--out-json verify.json]
    PYTHONPATH=. python bench/verify.py --small          # toy sizes, runs on CPU too

Builds `TargetModel` in memory with random bf16 weights (36 layers, hidden 4096, 32 / 8
heads x 128, MLP 12288, vocab 151,936, untied head; nothing is written to disk), fills one
KV slot with `--past` tokens, then times one tree-verify pass of 1 + N tokens per tree size:

* eager: `TargetRunner(cuda_graphs=False).verify`, the whole call (mask building included);
* graph: `TargetRunner.verify` replaying the captured graph (static KV length from the
  automatic ladder), the whole call with the input copies; `replay`: the replay alone;
* graph, full KV: the same with one static KV length = the whole cache;
* graph, sdpa attention: `TargetModel.attention = "sdpa"` (a K/V gather of the slot + SDPA
  with an additive mask), against the default (on CUDA the split-KV slot attention kernel,
  which reads the cache slot in place);
* graph + accept: forward + greedy / sampling accept + feature gather in one replay
  (`TargetRunner.verify_accept`), against the eager equivalent;
* decode: the plain one-token step (a T = 1 bucket);
* floor: (weights read per pass + the past's K/V) / read bandwidth measured in this run.

Also times one layer's attention in its variants and backends, and profiles one eager pass
(kernel time by category, kernel count). Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from bench.bench_timing import device_ms, measure_bandwidth, sync, wall_ms, write_json
from common.config import TargetConfig
from common.protocol import SamplingParams
from common.layers import RotaryEmbedding
from common.tree import ancestor_mask, walk_tree
from drafter_svc.ddtree import build_ddtree
from common.buckets import auto_kv_buckets
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs, cache_length
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner

QWEN3_8B_FEATURE_LAYERS = (1, 9, 17, 25, 33)  # DFlash's default for a 5-layer draft of a 36-layer target


def qwen3_8b_config(small: bool = False) -> TargetConfig:
    if small:
        return TargetConfig("Qwen3ForCausalLM", vocab_size=4096, hidden_size=128, num_layers=3, num_heads=4,
                            num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-6,
                            rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=4096,
                            eos_token_ids=())
    return TargetConfig("Qwen3ForCausalLM", vocab_size=151_936, hidden_size=4096, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=12_288, rms_norm_eps=1e-6,
                        rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40_960,
                        eos_token_ids=(151645,))


def feature_layers(cfg: TargetConfig) -> tuple[int, ...]:
    return tuple(i for i in QWEN3_8B_FEATURE_LAYERS if i < cfg.num_layers) or (0,)


def random_module_(module: torch.nn.Module, device, dtype, seed: int, std: float = 0.02) -> None:
    """Give a meta-device module random weights in place (norm weights 1), like from_pretrained does."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in module.state_dict().items():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        state[name] = t
    module.load_state_dict(state, strict=True, assign=True)


def random_target(cfg: TargetConfig, layer_ids, device, dtype, seed: int = 0) -> TargetModel:
    """A TargetModel with random weights, built in memory on `device`."""
    with torch.device("meta"):
        model = TargetModel(cfg, layer_ids)
    random_module_(model, device, dtype, seed)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
    return model.eval().requires_grad_(False)


def weight_bytes(model: TargetModel) -> dict:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return {"total": total, "embedding": embed, "streamed": total - embed}


def kv_bytes(cfg: TargetConfig, past: int, dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * past * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def make_runner(model: TargetModel, max_seq: int, *, graphs: bool, tree_buckets=(), kv_buckets=None,
                modes=("forward",)) -> TargetRunner:
    """A one-slot runner; with graphs on CPU the static-shape path runs eagerly (exercises the code)."""
    device = model.embed_tokens.weight.device
    if not graphs:
        return TargetRunner(model, 1, max_seq, cuda_graphs=False)
    config = GraphConfig(tree_buckets=tuple(tree_buckets), kv_buckets=kv_buckets, modes=tuple(modes))
    if device.type == "cuda":
        return TargetRunner(model, 1, max_seq, graph_config=config)
    runner = TargetRunner(model, 1, cache_length(max_seq, config), cuda_graphs=False)
    runner.max_seq_len = max_seq
    runner.graphs = VerifyGraphs(model, runner.cache, max_seq, config, capture=False)
    return runner


def make_tree(cfg: TargetConfig, budget: int, seed: int, block: int = 16):
    """A DDTree of `budget` drafted nodes from random block logits (a realistic shape), its layout."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(block - 1, cfg.vocab_size, generator=gen) * 3
    tree = build_ddtree(logits, int(torch.randint(cfg.vocab_size, (1,), generator=gen)), budget)
    lay = walk_tree(tree, vocab_size=cfg.vocab_size, max_nodes=10_000, max_depth=10_000)
    return tree, lay.depths, ancestor_mask(lay.parents, lay.depths)


def replay_ms(runner: TargetRunner, mode: str, n: int, past: int, reps: int) -> float | None:
    """Device time of the bare graph replay (after one real call staged the inputs)."""
    g = runner.graphs
    if g is None or not g.capture:
        return None
    shape = g.select(mode, n, past)
    if shape is None:
        return None
    graph, _ = g._graphs[(mode, *shape)]
    return device_ms(graph.replay, runner.device, reps)


def attention_variants(cfg: TargetConfig, tokens: int, kv_len: int, past: int, device, dtype, reps: int) -> list:
    """One layer's attention at [tokens x kv_len]: variants x SDPA backends (device time)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(1, h, tokens, d, device=device, dtype=dtype)
    k = torch.randn(1, kvh, kv_len, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.zeros(1, 1, tokens, kv_len, dtype=torch.bool, device=device)
    mask[..., :past] = True
    mask[..., past:past + tokens] = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    group = h // kvh
    cache = torch.randn(2, 4, kvh, kv_len + 256, d, device=device, dtype=dtype)  # [K/V, slots, heads, len, D]
    slots = torch.tensor([1], device=device)

    from kernels.slot_attention import slot_attention_triton

    variants = {
        "gqa_bool": lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        "gqa_additive": lambda m=additive: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        "folded_additive": lambda m=additive: F.scaled_dot_product_attention(
            q.reshape(1, kvh, group * tokens, d), k, v, attn_mask=m.repeat(1, 1, group, 1)),
        "kv_gather": lambda: (cache[0, slots, :, :kv_len], cache[1, slots, :, :kv_len]),
        "gather+gqa_bool": lambda m=mask: F.scaled_dot_product_attention(
            q, cache[0, slots, :, :kv_len], cache[1, slots, :, :kv_len], attn_mask=m, enable_gqa=True),
        "slot_triton": lambda m=mask: slot_attention_triton(q, cache[0], cache[1], slots, m[:, 0]),
    }
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for name, fn in variants.items():
        for backend, choice in backends.items():
            if name in ("kv_gather", "slot_triton", "gather+gqa_bool") and backend != "default":
                continue
            ctx = sdpa_kernel([choice]) if choice is not None else nullcontext()
            try:
                with ctx:
                    ms = device_ms(fn, device, reps)
                rows.append({"variant": name, "backend": backend, "tokens": tokens, "kv_len": kv_len, "ms": ms})
            except Exception as exc:  # a backend that refuses these inputs
                rows.append({"variant": name, "backend": backend, "tokens": tokens, "kv_len": kv_len,
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
    return rows


_CATEGORIES = [
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "xmma", "splitk")),
    ("attention", ("fmha", "attention", "flash", "attn")),
    ("index/copy", ("index", "scatter", "gather", "copy", "cat", "memcpy", "fill")),
    ("reduce", ("reduce", "norm", "mean", "sum")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
]


def profile_pass(fn, device) -> dict:
    """Kernel device time by category and kernel count for one call of fn (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    by_category: dict[str, float] = {}
    kernels = 0
    total_us = 0.0
    top = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        name = evt.key.lower()
        cat = next((c for c, keys in _CATEGORIES if any(k in name for k in keys)), "other")
        by_category[cat] = by_category.get(cat, 0.0) + us
        kernels += evt.count
        total_us += us
        top.append((us, evt.count, evt.key[:90]))
    top.sort(reverse=True)
    return {"kernel_ms": total_us / 1e3, "kernels": kernels,
            "by_category_ms": {k: v / 1e3 for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "top": [{"ms": us / 1e3, "count": c, "name": n} for us, c, n in top[:12]]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trees", default=None, help="drafted nodes per tree, comma-separated (default 16,32,64,128)")
    p.add_argument("--past", type=int, default=None, help="tokens already in the KV cache (default 1024)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20 on GPU, 3 on CPU)")
    p.add_argument("--no-attention", action="store_true", help="skip the attention micro-benchmark")
    p.add_argument("--no-profile", action="store_true", help="skip the kernel profile")
    p.add_argument("--out-json", help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = qwen3_8b_config(a.small)
    trees = [int(x) for x in a.trees.split(",")] if a.trees else ([8, 16] if a.small else [16, 32, 64, 128])
    past = a.past if a.past is not None else (48 if a.small else 1024)
    max_seq = min(a.max_seq_len, 256) if a.small else a.max_seq_len
    reps = a.reps or (20 if cuda else 3)
    res: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                 "dtype": str(dtype).removeprefix("torch."), "past": past, "trees": trees, "max_seq_len": max_seq,
                 "config": cfg.__dict__ | {"eos_token_ids": list(cfg.eos_token_ids)}}
    print(f"# verify bench on {res['device']} ({res['dtype']}), past {past}, max_seq_len {max_seq}", flush=True)

    res["bandwidth"] = measure_bandwidth(device, 2.0 if cuda else 0.05)
    read_bw = res["bandwidth"]["read_TBps"] * 1e12
    print(f"read {res['bandwidth']['read_TBps']:.2f} TB/s, copy {res['bandwidth']['copy_TBps']:.2f} TB/s", flush=True)

    t0 = time.perf_counter()
    model = random_target(cfg, feature_layers(cfg), device, dtype)
    sync(device)
    wb = weight_bytes(model)
    res["weights"] = wb | {"build_s": time.perf_counter() - t0}
    res["kv_bytes_past"] = kv_bytes(cfg, past, dtype)
    floor_ms = (wb["streamed"] + res["kv_bytes_past"]) / read_bw * 1e3
    res["floor_ms"] = floor_ms
    res["floor_weights_only_ms"] = wb["streamed"] / read_bw * 1e3
    print(f"weights {wb['total'] / 1e9:.2f} GB ({wb['streamed'] / 1e9:.2f} GB streamed per pass), "
          f"floor {floor_ms:.3f} ms (weights only {res['floor_weights_only_ms']:.3f} ms)", flush=True)

    buckets = tuple(sorted({0, *trees}))
    probe = GraphConfig(tree_buckets=buckets)
    ladder = auto_kv_buckets(cache_length(max_seq, probe))
    needed = tuple(sorted({min(k for k in ladder if k >= past + 1 + b) for b in buckets}))
    res["kv_buckets"] = {"ladder": list(ladder), "used": list(needed), "full": cache_length(max_seq, probe)}

    t0 = time.perf_counter()
    eager = make_runner(model, max_seq, graphs=False)
    graph = make_runner(model, max_seq, graphs=True, tree_buckets=buckets, kv_buckets=needed,
                        modes=("forward", "greedy", "sample"))
    graph_full = make_runner(model, max_seq, graphs=True, tree_buckets=buckets, kv_buckets=(cache_length(max_seq, probe),),
                             modes=("forward",))
    model.attention = "sdpa"
    graph_sdpa = make_runner(model, max_seq, graphs=True, tree_buckets=buckets, kv_buckets=needed, modes=("forward",))
    model.attention = "auto"
    sync(device)
    res["graphs"] = {"capture_s": time.perf_counter() - t0,
                     "count": sum(r.graphs.num_graphs for r in (graph, graph_full, graph_sdpa))}
    print(f"captured {res['graphs']['count']} graphs in {res['graphs']['capture_s']:.1f} s", flush=True)

    prompt = torch.randint(cfg.vocab_size, (past,), generator=torch.Generator().manual_seed(0))
    for r in (eager, graph, graph_full, graph_sdpa):
        r.prefill(0, prompt)
    sync(device)

    def with_sdpa_attention(fn):
        def run():
            model.attention = "sdpa"
            try:
                return fn()
            finally:
                model.attention = "auto"
        return run

    rows = []
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for budget in [0] + trees:
        tree, depths, mask = make_tree(cfg, budget, seed=budget)
        n = tree.num_nodes
        coins = torch.rand(n + 1, generator=torch.Generator().manual_seed(n)).clamp_(1e-7, 1 - 2**-24)
        row = {"drafted": budget, "tokens": n}

        def verify(r):
            return lambda: r.verify(0, past, tree.tokens, depths, mask)

        def accept(r, s):
            return lambda: r.verify_accept(0, past, tree, depths, mask, s, coins)

        e_reps = max(3, reps // 2)
        row["eager_ms"] = wall_ms(verify(eager), device, e_reps)
        row["eager_sdpa_ms"] = wall_ms(with_sdpa_attention(verify(eager)), device, e_reps)
        row["graph_ms"] = wall_ms(verify(graph), device, reps)
        row["graph_replay_ms"] = replay_ms(graph, "forward", n, past, reps)
        row["graph_fullkv_ms"] = wall_ms(verify(graph_full), device, reps)
        row["graph_sdpa_ms"] = wall_ms(with_sdpa_attention(verify(graph_sdpa)), device, reps)
        row["graph_sdpa_replay_ms"] = replay_ms(graph_sdpa, "forward", n, past, reps)
        row["accept_greedy_graph_ms"] = wall_ms(accept(graph, SamplingParams()), device, reps)
        row["accept_sample_graph_ms"] = wall_ms(accept(graph, sampling), device, reps)
        row["accept_greedy_eager_ms"] = wall_ms(accept(eager, SamplingParams()), device, e_reps)
        row["accept_sample_eager_ms"] = wall_ms(accept(eager, sampling), device, e_reps)
        row["floor_ms"] = floor_ms
        best = min(row["graph_ms"], row["graph_sdpa_ms"])
        row["graph_over_floor"] = row["graph_ms"] / floor_ms
        row["best_graph_over_floor"] = best / floor_ms
        row["eager_over_graph"] = row["eager_ms"] / row["graph_ms"]
        # Greedy agreement of graph vs eager on this tree (bf16: different kernels may flip near-ties).
        g_path = graph.verify_accept(0, past, tree, depths, mask, SamplingParams())
        e_path = eager.verify_accept(0, past, tree, depths, mask, SamplingParams())
        row["greedy_same_as_eager"] = g_path.path.tolist() == e_path.path.tolist() and g_path.bonus == e_path.bonus
        rows.append(row)
        res["verify"] = rows
        write_json(a.out_json, res)  # keep what is done even if the run is cut short
        print(f"  tokens {n:4d}: eager {row['eager_ms']:7.2f}  graph {row['graph_ms']:7.2f} "
              f"(replay {row['graph_replay_ms'] or float('nan'):6.2f})  sdpa-attn {row['graph_sdpa_ms']:6.2f}  "
              f"full-kv {row['graph_fullkv_ms']:6.2f}  +accept g/s {row['accept_greedy_graph_ms']:6.2f}/"
              f"{row['accept_sample_graph_ms']:6.2f} ms", flush=True)
    res["verify"] = rows

    if cuda and not a.no_attention:
        att = []
        for n in [1 + t for t in trees if t in (16, 64)] or [1 + trees[-1]]:
            for kv_len in sorted({min(k for k in ladder if k >= past + n), cache_length(max_seq, probe)}):
                att += attention_variants(cfg, n, kv_len, past, device, dtype, reps=30)
        res["attention"] = att
    if cuda and not a.no_profile:
        tree, depths, mask = make_tree(cfg, 64 if 64 in trees else trees[-1], seed=1)
        res["profile_eager"] = profile_pass(lambda: eager.verify(0, past, tree.tokens, depths, mask), device)
        res["profile_eager_sdpa_attention"] = profile_pass(
            with_sdpa_attention(lambda: eager.verify(0, past, tree.tokens, depths, mask)), device)

    print_table(res)
    write_json(a.out_json, res)
    return res


def _cell(value) -> str:
    if value is None:
        return f"{'-':>8}"
    if isinstance(value, (bool, int)):
        return f"{str(value):>8}"
    return f"{value:8.3f}"


def print_table(res: dict) -> None:
    print(f"\nverify pass, past {res['past']} ({res['device']}, {res['dtype']}); "
          f"floor {res['floor_ms']:.3f} ms = {(res['weights']['streamed'] + res['kv_bytes_past']) / 1e9:.2f} GB / "
          f"{res['bandwidth']['read_TBps']:.2f} TB/s; times in ms (wall per call, synced)")
    head = ("tokens", "eager", "graph", "replay", "full-kv", "sdpa", "sdpa-rep", "g/floor", "best/fl",
            "eag/gr", "acc-g", "acc-s", "eacc-g", "eacc-s", "same")
    print(" ".join(f"{h:>8}" for h in head))
    for r in res["verify"]:
        vals = (r["tokens"], r["eager_ms"], r["graph_ms"], r["graph_replay_ms"], r["graph_fullkv_ms"],
                r["graph_sdpa_ms"], r["graph_sdpa_replay_ms"], r["graph_over_floor"], r["best_graph_over_floor"],
                r["eager_over_graph"], r["accept_greedy_graph_ms"], r["accept_sample_graph_ms"],
                r["accept_greedy_eager_ms"], r["accept_sample_eager_ms"], r["greedy_same_as_eager"])
        print(" ".join(_cell(v) for v in vals))
    if res.get("attention"):
        print("\nattention, one layer (device ms):")
        for r in res["attention"]:
            print(f"  T={r['tokens']:4d} L={r['kv_len']:5d} {r['variant']:16s} {r['backend']:10s} "
                  + (f"{r['ms']:.4f}" if "ms" in r else r["error"]))
    for key in ("profile_eager", "profile_eager_sdpa_attention"):
        if res.get(key):
            prof = res[key]
            cats = ", ".join(f"{k} {v:.2f}" for k, v in prof["by_category_ms"].items())
            print(f"\n{key}: {prof['kernels']} kernels, {prof['kernel_ms']:.2f} ms of kernel time ({cats})")
            for t in prof["top"][:8]:
                print(f"  {t['ms']:7.3f} ms x{t['count']:5d} {t['name']}")


if __name__ == "__main__":
    main(sys.argv[1:])
