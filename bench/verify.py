"""Batched target verify step at Qwen3-8B dimensions: eager vs CUDA graphs vs the weight-streaming floor.

    PYTHONPATH=. python bench/verify.py [--batches 1,4,16,32] [--trees 16,32,64,128] [--past 1024]
                                        [--out-json verify.json]
    PYTHONPATH=. python bench/verify.py --small          # toy sizes, runs on CPU too

Builds `TargetModel` in memory with random bf16 weights (36 layers, hidden 4096, 32 / 8
heads x 128, MLP 12288, vocab 151,936, untied head; nothing is written to disk), fills B KV
slots with `--past` tokens each, then times one verify step of B trees of 1 + N tokens (one
forward of B x (1 + N) tokens, the batched accept and the batched KV compaction) for every
batch size B in `--batches` and tree size N in `--trees` (and N = 0, the plain decode step):

* eager: `TargetRunner(cuda_graphs=False).verify_batch` (greedy rows), the whole call (input
  staging and the two small device-to-host copies included); `eager fwd`: `forward_batch`
  alone (no accept, no compaction); `eager-s`: verify_batch with sampled rows;
* graph: `TargetRunner.verify_batch` replaying the captured (mode, B, T, L) graph (static KV
  length from the automatic ladder), the whole call; `graph-s`: sampled rows (the coin walk's "sample"
  graph, temperature 0.8, top-k 50, top-p 0.9); `graph-p`: greedy rows with repetition
  penalties (presence and frequency 0.5, repetition 1.2: their kernels' work); `replay`: the bare greedy graph replay
  (device time); `fwd rep`: the bare "forward" graph replay (forward only);
* prefill (`--prefill N`): one session's N-token prompt through the verifier's eager prefill;
* floor: (weights read per step + the B pasts' K/V) / read bandwidth measured in this run;
  `ms/sess`: graph time per session of the batch.

On the CPU (--small) the graph runner runs the same static-shape code eagerly at the bucket
shapes (`VerifyGraphs(capture=False)`): a smoke test of the code, not a measurement.

Also times one layer's attention in its variants and backends, and profiles one eager step
(kernel time by category, kernel count) on CUDA. Prints a table, writes JSON with --out-json.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs ddtree_kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from bench.bench_timing import device_ms, measure_bandwidth, number_list, out_json, sync, wall_ms, write_json
from common.buckets import auto_kv_buckets
from common.config import DraftConfig, TargetConfig
from common.layers import RotaryEmbedding
from common.protocol import SamplingParams
from common.tree import ancestor_masks, walk_trees
from drafter_svc.ddtree import build_ddtree
from drafter_svc.draft_model import DFlashDraftModel
from verifier_svc.accept import draw_coins
from verifier_svc.cuda_graphs import GraphConfig, VerifyGraphs, VerifyRow, cache_length
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


def draft_config(small: bool, target: TargetConfig) -> DraftConfig:
    """A DFlash draft for `target`: the published Qwen3-8B draft's shape (5 layers, block 16), or
    toy sizes with `small`."""
    layer_ids = feature_layers(target)
    if small:
        return DraftConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                           block_size=8, target_layer_ids=layer_ids, mask_token_id=target.vocab_size - 1,
                           num_target_layers=target.num_layers)
    return DraftConfig(vocab_size=151_936, hidden_size=4096, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=12_288, rms_norm_eps=1e-6, rope_theta=1e6, block_size=16,
                       target_layer_ids=layer_ids, mask_token_id=151_669, num_target_layers=36)


def random_projection(small: bool, device, dtype, seed: int = 1):
    """The fc + hidden_norm of `random_draft(small, device, dtype, seed)`, as the verifier holds them."""
    from common.feature_projection import FeatureProjection

    draft = random_draft(small, device, dtype, seed)[0]
    with torch.device("meta"):
        proj = FeatureProjection(draft.cfg)
    proj.fc, proj.hidden_norm = draft.fc, draft.hidden_norm
    return proj


def random_draft(small: bool, device, dtype, seed: int = 1) -> tuple[DFlashDraftModel, torch.Tensor, torch.Tensor]:
    """(draft, embed_tokens, lm_head) with random weights, built on `device`."""
    cfg = draft_config(small, qwen3_8b_config(small))
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg)
    random_module_(draft, device, dtype, seed=seed)
    draft.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
    draft.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    embed = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype).normal_(0, 0.02, generator=gen)
    head = torch.empty_like(embed).normal_(0, 0.02, generator=gen)
    return draft, embed, head


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


def make_runner(model: TargetModel, slots: int, max_seq: int, headroom: int, *, config: GraphConfig | None = None
                ) -> TargetRunner:
    """A runner of `slots` sessions: eager (config None) or with the verify graphs of `config`; on
    the CPU those run eagerly at the bucket shapes (exercises the static-shape code)."""
    device = model.embed_tokens.weight.device
    if config is None:
        return TargetRunner(model, slots, max_seq, headroom, cuda_graphs=False)
    if device.type == "cuda":
        return TargetRunner(model, slots, max_seq, headroom, graph_config=config)
    runner = TargetRunner(model, slots, max_seq, headroom, cuda_graphs=False)
    runner.graphs = VerifyGraphs(model, runner.cache, max_seq, runner.scratch_slot, config, capture=False)
    return runner


def fill_slots(runner: TargetRunner, prompt: torch.Tensor, slots: int) -> None:
    """Prefill slot 0 with the prompt and copy its K/V into slots 1 .. slots - 1."""
    runner.prefill([0], [prompt])
    past = prompt.shape[0]
    for kv in (runner.cache.k, runner.cache.v):
        kv[:, 1:slots, :, :past] = kv[:, :1, :, :past]


def make_tree(cfg: TargetConfig, budget: int, seed: int, block: int = 16):
    """A DDTree of `budget` drafted nodes from random block logits (a realistic shape)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(block - 1, cfg.vocab_size, generator=gen) * 3
    return build_ddtree(logits, int(torch.randint(cfg.vocab_size, (1,), generator=gen)), budget)


def make_batch(cfg: TargetConfig, batch: int, budget: int, past: int, sampling: SamplingParams):
    """B rows (slots 0 .. B - 1, each at `past`) of different trees of `budget` drafted nodes,
    and their masks, derived as `TreeVerifier` derives them."""
    trees = [make_tree(cfg, budget, seed=1000 * budget + b) for b in range(batch)]
    layouts = walk_trees(trees, vocab_size=cfg.vocab_size, max_nodes=10_000, max_depth=10_000)
    masks = ancestor_masks(layouts, max(t.num_nodes for t in trees))
    gen = torch.Generator().manual_seed(budget)
    rows = [VerifyRow(b, past, tree, lay.depths, sampling,
                      None if sampling.greedy else draw_coins(gen, tree.num_nodes))
            for b, (tree, lay) in enumerate(zip(trees, layouts))]
    return rows, masks


def replay_ms(runner: TargetRunner, mode: str, rows, masks, reps: int) -> float | None:
    """Device time of the bare graph replay (after one real call staged the inputs)."""
    g = runner.graphs
    if g is None or not g.capture:
        return None
    nodes = max(r.tree.num_nodes for r in rows)
    shape = g.select(mode, len(rows), nodes, max(r.past for r in rows) + nodes)
    if shape is None:
        return None
    g.run(mode, rows, masks)  # stage these rows' inputs
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

    from ddtree_kernels.slot_attention import slot_attention_triton

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


def _ints(text: str | None, default: list[int], flag: str) -> list[int]:
    return number_list(text, flag) if text else default


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="toy sizes (runs on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when there is a GPU, else cpu)")
    p.add_argument("--batches", default=None, help="sessions per step, comma-separated (default 1,4,16,32; small 1,4)")
    p.add_argument("--trees", default=None, help="drafted nodes per tree, comma-separated (default 16,32,64,128)")
    p.add_argument("--past", type=int, default=None, help="tokens already in each session's KV slot (default 1024)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV capacity per session in tokens")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20 on GPU, 3 on CPU)")
    p.add_argument("--no-attention", action="store_true", help="skip the attention micro-benchmark")
    p.add_argument("--no-profile", action="store_true", help="skip the kernel profile")
    p.add_argument("--prefill", default=None,
                   help="prompt lengths, comma-separated, whose one-session prefill (the verifier's eager "
                        "`TargetRunner.prefill`, wall with sync) to time after the verify steps (default none)")
    p.add_argument("--out-json", type=out_json, help="write the results here")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = qwen3_8b_config(a.small)
    batches = sorted(set(_ints(a.batches, [1, 4] if a.small else [1, 4, 16, 32], "--batches")))
    trees = _ints(a.trees, [8, 16] if a.small else [16, 32, 64, 128], "--trees")
    if min(batches) < 1 or min(trees) < 0:
        p.error("--batches must be >= 1 and --trees >= 0")
    past = a.past if a.past is not None else (48 if a.small else 1024)
    max_seq = min(a.max_seq_len, 256) if a.small else a.max_seq_len
    if past + 1 + max(trees) > max_seq:
        p.error(f"--past {past} + the largest tree do not fit --max-seq-len {max_seq}")
    reps = a.reps or (20 if cuda else 3)
    res: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                 "dtype": str(dtype).removeprefix("torch."), "past": past, "batches": batches, "trees": trees,
                 "max_seq_len": max_seq, "config": cfg.__dict__ | {"eos_token_ids": list(cfg.eos_token_ids)}}
    print(f"# verify bench on {res['device']} ({res['dtype']}), past {past}, batches {batches}, "
          f"max_seq_len {max_seq}", flush=True)

    res["bandwidth"] = measure_bandwidth(device, 2.0 if cuda else 0.05)
    read_bw = res["bandwidth"]["read_TBps"] * 1e12
    print(f"read {res['bandwidth']['read_TBps']:.2f} TB/s, copy {res['bandwidth']['copy_TBps']:.2f} TB/s", flush=True)

    t0 = time.perf_counter()
    model = random_target(cfg, feature_layers(cfg), device, dtype)
    sync(device)
    wb = weight_bytes(model)
    res["weights"] = wb | {"build_s": time.perf_counter() - t0}
    res["kv_bytes_past"] = kv_bytes(cfg, past, dtype)  # one session's
    res["floor_weights_only_ms"] = wb["streamed"] / read_bw * 1e3 if cuda else None
    print(f"weights {wb['total'] / 1e9:.2f} GB ({wb['streamed'] / 1e9:.2f} GB streamed per step)"
          + (f", weights-only floor {res['floor_weights_only_ms']:.3f} ms" if cuda else ""), flush=True)

    buckets = tuple(sorted({0, *trees}))
    headroom = 1 + max(buckets)
    full = cache_length(max_seq, headroom)
    ladder = auto_kv_buckets(full)
    needed = tuple(sorted({min(k for k in ladder if k >= past + 1 + b) for b in buckets}))
    res["kv_buckets"] = {"ladder": list(ladder), "used": list(needed), "full": full}
    slots = max(batches)
    config = GraphConfig(tree_buckets=buckets, batch_buckets=tuple(batches), kv_buckets=needed,
                         modes=("forward", "greedy", "sample"), max_tokens=slots * headroom)

    t0 = time.perf_counter()
    eager = make_runner(model, slots, max_seq, headroom)
    graph = make_runner(model, slots, max_seq, headroom, config=config)
    sync(device)
    res["graphs"] = {"capture_s": time.perf_counter() - t0, "count": graph.graphs.num_graphs,
                     "captured": graph.graphs.capture}
    print(f"captured {res['graphs']['count']} graphs in {res['graphs']['capture_s']:.1f} s", flush=True)

    prompt = torch.randint(cfg.vocab_size, (past,), generator=torch.Generator().manual_seed(0))
    for r in (eager, graph):
        fill_slots(r, prompt, slots)
    sync(device)

    rows_out = []
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for batch in batches:
        # On a CPU the pass is bound by its arithmetic, not by reading the weights: no floor there.
        floor_ms = (wb["streamed"] + batch * res["kv_bytes_past"]) / read_bw * 1e3 if cuda else None
        for budget in [0] + trees:
            greedy_rows, masks = make_batch(cfg, batch, budget, past, SamplingParams())
            sampled_rows, _ = make_batch(cfg, batch, budget, past, sampling)
            penalized_rows, _ = make_batch(cfg, batch, budget, past, PENALIZED)
            n = max(r.tree.num_nodes for r in greedy_rows)
            row = {"batch": batch, "drafted": budget, "tokens": n, "step_tokens": batch * n}
            e_reps = max(3, reps // 2)
            row["eager_ms"] = wall_ms(lambda: eager.verify_batch(greedy_rows, masks), device, e_reps)
            row["eager_forward_ms"] = wall_ms(lambda: eager.forward_batch(greedy_rows, masks), device, e_reps)
            row["eager_sample_ms"] = wall_ms(lambda: eager.verify_batch(sampled_rows, masks), device, e_reps)
            row["graph_ms"] = wall_ms(lambda: graph.verify_batch(greedy_rows, masks), device, reps)
            row["graph_sample_ms"] = wall_ms(lambda: graph.verify_batch(sampled_rows, masks), device, reps)
            row["graph_penalized_ms"] = wall_ms(lambda: graph.verify_batch(penalized_rows, masks), device, reps)
            row["graph_replay_ms"] = replay_ms(graph, "greedy", greedy_rows, masks, reps)
            row["graph_forward_replay_ms"] = replay_ms(graph, "forward", greedy_rows, masks, reps)
            shape = graph.graphs.select("greedy", batch, n, past + n)
            row["graph_shape"] = list(shape) if shape else None  # (B, T, L) of the graph; None: eager fallback
            row["floor_ms"] = floor_ms
            row["graph_over_floor"] = row["graph_ms"] / floor_ms if floor_ms else None
            row["eager_over_graph"] = row["eager_ms"] / row["graph_ms"]
            row["graph_ms_per_session"] = row["graph_ms"] / batch
            # Greedy agreement of graph vs eager on these trees (bf16: other shapes may flip near-ties).
            g, e = graph.verify_batch(greedy_rows, masks), eager.verify_batch(greedy_rows, masks)
            row["greedy_same_as_eager"] = g.paths == e.paths and g.bonus == e.bonus
            rows_out.append(row)
            res["verify"] = rows_out
            write_json(a.out_json, res)  # keep what is done even if the run is cut short
            print(f"  B {batch:3d} tokens {n:4d}: eager {row['eager_ms']:8.2f} (fwd {row['eager_forward_ms']:8.2f})  "
                  f"graph {row['graph_ms']:8.2f} (replay {row['graph_replay_ms'] or float('nan'):7.2f})  "
                  f"sample eager/graph {row['eager_sample_ms']:8.2f}/{row['graph_sample_ms']:8.2f}  "
                  + (f"  floor {floor_ms:6.2f} ms" if floor_ms else ""), flush=True)
    res["verify"] = rows_out
    prefill = _ints(a.prefill, [], "--prefill")
    if prefill and max(prefill) > max_seq:
        p.error(f"--prefill {max(prefill)} does not fit --max-seq-len {max_seq}")
    res["prefill"] = []
    for n in prefill:  # overwrites slot 0's cache: after the verify steps
        tokens = torch.randint(cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        ms = wall_ms(lambda: eager.prefill([0], [tokens]), device, max(3, reps // 4))
        res["prefill"].append({"tokens": n, "ms": ms})
        print(f"  prefill of {n} tokens (one session, eager): {ms:.2f} ms", flush=True)

    if cuda and not a.no_attention:
        att = []
        for n in [1 + t for t in trees if t in (16, 64)] or [1 + trees[-1]]:
            for kv_len in sorted({min(k for k in ladder if k >= past + n), full}):
                att += attention_variants(cfg, n, kv_len, past, device, dtype, reps=30)
        res["attention"] = att
    if cuda and not a.no_profile:
        budget = 64 if 64 in trees else trees[-1]
        for batch in sorted({batches[0], batches[-1]}):
            rows, masks = make_batch(cfg, batch, budget, past, SamplingParams())
            res[f"profile_eager_b{batch}"] = profile_pass(lambda: eager.verify_batch(rows, masks), device)

    print_table(res)
    write_json(a.out_json, res)
    return res


# Greedy rows with every repetition penalty on (the "graph-p" column): the penalties' own cost.
PENALIZED = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def _cell(value) -> str:
    if value is None:
        return f"{'-':>8}"
    if isinstance(value, (bool, int)):
        return f"{str(value):>8}"
    return f"{value:8.3f}"


def print_table(res: dict) -> None:
    floor = (f"floor = ({res['weights']['streamed'] / 1e9:.2f} GB of weights + B x {res['kv_bytes_past'] / 1e9:.3f} "
             f"GB of K/V) / {res['bandwidth']['read_TBps']:.2f} TB/s" if res["device"] != "cpu" else
             "no floor on a CPU, whose pass is bound by its arithmetic")
    print(f"\nbatched verify step, past {res['past']} per session ({res['device']}, {res['dtype']}); "
          f"{floor}; times in ms (wall per call, synced; replay: device time)")
    head = ("B", "tokens", "eager", "eag-fwd", "eager-s", "graph", "graph-s", "graph-p", "replay", "fwd-rep", "floor",
            "g/floor", "eag/gr", "ms/sess", "same")
    print(" ".join(f"{h:>8}" for h in head))
    for r in res["verify"]:
        vals = (r["batch"], r["tokens"], r["eager_ms"], r["eager_forward_ms"], r["eager_sample_ms"], r["graph_ms"],
                r["graph_sample_ms"], r.get("graph_penalized_ms"), r["graph_replay_ms"], r["graph_forward_replay_ms"],
                r["floor_ms"], r["graph_over_floor"], r["eager_over_graph"], r["graph_ms_per_session"],
                r["greedy_same_as_eager"])
        print(" ".join(_cell(v) for v in vals))
    if res.get("attention"):
        print("\nattention, one layer, batch 1 (device ms):")
        for r in res["attention"]:
            print(f"  T={r['tokens']:4d} L={r['kv_len']:5d} {r['variant']:16s} {r['backend']:10s} "
                  + (f"{r['ms']:.4f}" if "ms" in r else r["error"]))
    for key in sorted(k for k in res if k.startswith("profile_")):
        prof = res[key]
        cats = ", ".join(f"{k} {v:.2f}" for k, v in prof["by_category_ms"].items())
        print(f"\n{key}: {prof['kernels']} kernels, {prof['kernel_ms']:.2f} ms of kernel time ({cats})")
        for t in prof["top"][:8]:
            print(f"  {t['ms']:7.3f} ms x{t['count']:5d} {t['name']}")


if __name__ == "__main__":
    main(sys.argv[1:])
