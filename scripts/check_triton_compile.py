"""Compile every Triton kernel specialisation that the kernel wrappers launch, for a GPU, without one.

A kernel that runs in the interpreter (the CPU tests) can still fail to compile for the GPU,
and a kernel that compiles with one Triton release can fail with another: Triton specialises
each launch on its arguments (ints equal to 1 become constants, 16-divisible ints and
16-byte-aligned pointers get a divisibility hint) and some passes only fail on some of those
specialisations. This script finds the specialisations the wrappers really launch and compiles
each for the target GPU:

  phase 1 (this process, TRITON_INTERPRET=1): run the wrappers of ddtree_kernels/ on small CPU
      tensors with the interpreter's launch replaced by a recorder (no kernel body runs) and
      record each launch's arguments: dtype and address mod 16 of tensors, scalar values;
  phase 2 (a subprocess, no interpreter): derive each launch's specialisation with the
      Triton launcher's own binder (do_not_specialize included) and compile it with
      triton.compile for GPUTarget("cuda", ARCH, 32); no GPU or driver is needed.

Prints one line per failing specialisation (the kernel, the wrapper call that launched it, its
constexpr arguments, the error's first line) and a summary; exits 1 if any failed. --verbose
also lists what compiled and shows the tracebacks and the compiler's MLIR reproducers.

    .venv/bin/python scripts/check_triton_compile.py [--arch 90] [--verbose]

To check against another Triton release (e.g. the one your GPU servers run), install it into a folder
and put that folder first on PYTHONPATH, so that both phases import it:

    .venv/bin/python -m pip install --no-deps --target build/triton-3.6 triton==3.6.0
    PYTHONPATH=build/triton-3.6 .venv/bin/python scripts/check_triton_compile.py
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------
# Phase 1: record the launches.
# ---------------------------------------------------------------------------------------


def exercise(label) -> None:
    """Call every Triton wrapper in the shapes the server uses; label(text) names the next calls."""
    import torch

    from ddtree_kernels import pdl
    from ddtree_kernels.ddtree_select import select_on_device
    from ddtree_kernels.fused_accept import tree_accept_triton
    from ddtree_kernels.kv_move import move_kv_rows_triton
    from ddtree_kernels.layer_ops import add_rms_norm_triton, qk_norm_rope_store_triton, silu_mul_triton
    from ddtree_kernels.place_trees import place_trees
    from ddtree_kernels.skinny_gemm import SplitSum, skinny_config, skinny_linear, split_config, split_linear
    from ddtree_kernels.slot_attention import AttentionTiles, slot_attention_triton

    i32, i64 = torch.int32, torch.int64
    unforced_pdl = pdl.launch_options

    def forced_pdl(device):
        return {"PDL": True, "launch_pdl": True}

    for sessions, width in ((1, 15), (32, 15), (32, 64), (8, 200)):
        label(f"select_on_device S={sessions} W={width}")
        select_on_device(torch.zeros(sessions, 15, width), torch.zeros(sessions, 15, width, dtype=i64),
                         torch.zeros(sessions, dtype=i64), torch.full((sessions,), width, dtype=i64))
    for sessions, width, t in ((1, 15, 16), (32, 15, 16), (32, 15, 32), (8, 63, 64), (4, 127, 128)):
        label(f"place_trees S={sessions} W={width} T={t}")
        # The trees are columns of one packed buffer, the outputs views of one flat buffer, as
        # common.tree.DeviceTrees and verifier_svc/cuda_graphs.py's BatchInputs have them.
        packed = torch.zeros(sessions, 3 + 3 * width, dtype=i64)
        ints = torch.zeros(5 * sessions * t + sessions, dtype=i64)
        out = [ints[k * sessions * t: (k + 1) * sessions * t].view(sessions, t) for k in range(4)]
        place_trees(packed[:, : 1 + width], packed[:, 1 + width: 2 + 2 * width], packed[:, 2 + 2 * width],
                    torch.zeros(3, sessions, dtype=i64), min(width, 15), min(1 + width, t), *out,
                    ints[4 * sessions * t: 4 * sessions * t + sessions], torch.zeros(sessions, t, t, dtype=torch.bool))
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for t in (1, 9, 65):
            # Tree and sampling inputs are views of one buffer each, as verifier_svc/cuda_graphs.py's
            # _Inputs has them (so their addresses are not all 16-byte aligned).
            ints, floats = torch.zeros(4 * t + 3, dtype=i64), torch.zeros(t + 3)
            tree = (ints[:t][None], ints[2 * t: 3 * t][None], ints[3 * t: 4 * t][None])
            sampling = dict(coins=floats[:t][None], final_coins=floats[t: t + 1], temperature=floats[t + 1: t + 2],
                            top_k=ints[4 * t + 2: 4 * t + 3], top_p=floats[t + 2: t + 3])
            outputs = (torch.zeros(t, dtype=i32), torch.zeros(1, t, dtype=i32), torch.zeros(1, dtype=i32))
            for vocab in (1000, 151936):
                logits = torch.zeros(1, t, vocab, dtype=dtype)
                for stage, options in (("greedy", dict(greedy=True)),
                                       ("temperature only", dict(greedy=False, filters=False, **sampling)),
                                       ("filtered", dict(greedy=False, filters=True, **sampling))):
                    label(f"tree_accept_triton {stage} {name} T={t} V={vocab}")
                    tree_accept_triton(logits, *tree, *outputs, **options)

        # The forward pass's kernels, without and with programmatic dependent launch (which the
        # interpreter never takes: ddtree_kernels/pdl.py; here the recorder stands in for a GPU's launch).
        for with_pdl in (False, True):
            pdl.launch_options = forced_pdl if with_pdl else unforced_pdl
            tag = " pdl" if with_pdl else ""
            for t in (1, 16, 32):
                for n, k in ((6144, 4096), (4096, 12288), (151936, 4096), (1000, 200)):
                    if skinny_config(t, n, k) is not None:
                        label(f"skinny_linear {name} T={t} N={n} K={k}{tag}")
                        skinny_linear(torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype))
            for t in (16, 33, 64):
                for n, k in ((4096, 4096), (4096, 12288)):
                    if split_config(t, n, k) is not None:
                        label(f"split_linear {name} T={t} N={n} K={k}{tag}")
                        split_linear(torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype))
            for t in (1, 65):
                label(f"add_rms_norm_triton {name} T={t}{tag}")
                h, weight = torch.zeros(1, t, 4096, dtype=dtype), torch.ones(4096, dtype=dtype)
                add_rms_norm_triton(h, h.clone(), weight, 1e-6)
                add_rms_norm_triton(h, None, weight, 1e-6)
                add_rms_norm_triton(h, SplitSum(torch.zeros(2, 1, t, 4096), dtype), weight, 1e-6)
                label(f"silu_mul_triton {name} T={t}{tag}")
                silu_mul_triton(torch.zeros(1, t, 2 * 12288, dtype=dtype))
                label(f"qk_norm_rope_store_triton {name} T={t}{tag}")
                heads, kv_heads, d = 32, 8, 128
                qkv = torch.zeros(1, t, (heads + 2 * kv_heads) * d, dtype=dtype)
                cos = torch.zeros(1, t, d, dtype=dtype)
                cache = torch.zeros(2, kv_heads, 256, d, dtype=dtype)
                slots, positions = torch.zeros(1, dtype=i64), torch.zeros(1, t, dtype=i64)
                for norm in (torch.ones(d, dtype=dtype), None):
                    for q_heads in (heads, 0):  # 0: keys and values only
                        qk_norm_rope_store_triton(qkv[..., (heads - q_heads) * d:], cos, cos, norm, norm, 1e-6,
                                                  q_heads, kv_heads, cache, cache, slots, positions)
                label(f"move_kv_rows_triton {name} T={t}{tag}")
                src = torch.zeros(1, t, dtype=i64)
                move_kv_rows_triton(cache[None], cache[None], slots, src, src)
                label(f"slot_attention_triton {name} T={t}{tag}")
                q, mask = torch.zeros(1, heads, t, d, dtype=dtype), torch.ones(1, t, 256, dtype=torch.bool)
                for splits in (1, None):
                    for block in (16, 32, 64):  # attention_tiles' query blocks (which the CPU's count does not pick)
                        slot_attention_triton(q, cache, cache, slots, mask, splits=splits,
                                              tiles=AttentionTiles(block, 64, 4, 3))
        pdl.launch_options = unforced_pdl


def describe(value):
    """JSON description of a launch argument: tensors by dtype and address mod 16."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "align": value.data_ptr() % 16}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot describe a launch argument of type {type(value).__name__}")


def record_launches() -> list[dict]:
    """Phase 1: the distinct launches of exercise(), each with the label of its first call."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    launches, context = {}, [""]

    def record(self, *args, grid, warmup=False, **kwargs):
        launch = {"module": self.fn.__module__, "name": self.fn.__name__,
                  "args": [describe(a) for a in args], "kwargs": {k: describe(v) for k, v in kwargs.items()}}
        launches.setdefault(json.dumps(launch, sort_keys=True), {**launch, "label": context[0]})

    InterpretedFunction.run = record
    exercise(lambda text: context.__setitem__(0, text))
    return list(launches.values())


# ---------------------------------------------------------------------------------------
# Phase 2: compile them (run without the interpreter).
# ---------------------------------------------------------------------------------------


class _TensorArg:
    """Stands in for a tensor argument: what Triton's specialisation reads (dtype, address)."""

    def __init__(self, dtype: str, align: int):
        import torch

        self.dtype = getattr(torch, dtype)
        self._address = 1024 + align

    def data_ptr(self) -> int:
        return self._address


def _rebuild(value):
    return _TensorArg(**value) if isinstance(value, dict) else value


def compile_launches(launches: list[dict], arch: int, verbose: bool) -> int:
    """Phase 2: compile each launch's specialisation; print the failures; return their count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    seen, failed = set(), 0
    for launch in launches:
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        kwargs = {k: _rebuild(v) for k, v in launch["kwargs"].items()}
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*map(_rebuild, launch["args"]), **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        key = repr((launch["module"], launch["name"], signature, constexprs, attrs))
        if key in seen:
            continue
        seen.add(key)
        consts = {fn.arg_names[path[0]]: value for path, value in constexprs.items()}
        try:
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            if verbose:
                print(f"ok   {launch['name']} [{launch['label']}] {consts}")
        except Exception as error:  # noqa: BLE001 - report every failure, whatever raised it
            failed += 1
            lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
            print(f"FAIL {launch['name']} [{launch['label']}] {consts}: {lines[0][:200]}")
            if verbose:
                traceback.print_exc()
    print(f"triton {triton.__version__}, sm_{arch}: {len(launches)} distinct launches, {len(seen)} specialisations, "
          f"{failed} failed to compile")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (default 90)")
    parser.add_argument("--verbose", "-v", action="store_true", help="also list what compiled, and tracebacks")
    parser.add_argument("--compile", metavar="LAUNCHES_JSON", help=argparse.SUPPRESS)  # phase 2 (internal)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.compile:
        return 1 if compile_launches(json.loads(Path(args.compile).read_text()), args.arch, args.verbose) else 0

    launches = record_launches()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.json"
        path.write_text(json.dumps(launches))
        command = [sys.executable, __file__, "--compile", str(path), "--arch", str(args.arch)]
        # Triton's compiler writes MLIR reproducers of each failure to stderr: shown with --verbose only.
        done = subprocess.run(command + ["--verbose"] * args.verbose, env=env, cwd=ROOT, stderr=subprocess.PIPE,
                              text=True)
    if args.verbose or done.returncode not in (0, 1):
        sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
