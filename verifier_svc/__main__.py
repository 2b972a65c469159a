"""Run the verifier service: the target model behind the Verifier gRPC API.

    python -m verifier_svc --target DIR [--draft DIR [--raw-features] | --feature-layers 1,9,17] [--port 50051]

Every flag falls back to an environment variable (VERIFIER_PORT, ...) and then to the
default in `VerifierConfig`. Prints "verifier listening on HOST:PORT" when ready; SIGTERM
or SIGINT drains and stops it (health NOT_SERVING, new sessions refused, open ones get --grace
seconds to end; a second signal cuts them).
"""
from __future__ import annotations

import os

# gRPC C-core's own INFO lines (a peer's GOAWAY at a restart, say) stay out of the log; set before grpc loads.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal

from common import compiles
from common.cli import FlagParser, fail
from common.config import CheckpointError, check_draft_fits_target, load_draft_config, load_target_config
from common.feature_wire import FORMATS
from common.heap import freeze_startup_heap
from common.logs import add_logging_flags, setup_logging
from common.tls import ServerTls
from common.tracing import exporting, setup_tracing, shutdown_tracing
from verifier_svc.server import VerifierConfig, load_runner, load_verifier, serve
from verifier_svc.tensor_parallel import leader
from verifier_svc.tree_verifier import TreeVerifier

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(VerifierConfig)}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m verifier_svc", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def flag(name: str, field: str | None, help: str, type=str, env: str | None = None):
        env = env or "VERIFIER_" + name.removeprefix("--").replace("-", "_").upper()
        default = _DEFAULTS.get(field) if field else None
        p.flag(name, env=env, default=None if default is dataclasses.MISSING else default, help=help, type=type)

    flag("--target", "target_dir", "target checkpoint folder (config.json + safetensors); required")
    flag("--draft", None, "DFlash draft checkpoint folder: its config.json gives the feature layers "
         "(target_layer_ids), and the verifier applies its fc + hidden_norm to the features, sending "
         "hidden-size context rows (see --raw-features)")
    flag("--feature-layers", None, "target layers whose hidden states go to the drafter, e.g. 1,9,17 "
         "(id l = transformers' hidden_states[l + 1], as DFlash; instead of --draft; neither = no features)",
         type=_int_list)
    flag("--host", "host", "address to listen on")
    flag("--port", "port", "port to listen on (0 = any free port)", type=int)
    flag("--metrics-port", "metrics_port", "port of the Prometheus /metrics endpoint (HTTP, on --host); 0 = off",
         type=int)
    flag("--device", "device", "torch device: auto, cpu, cuda, cuda:1, ...")
    flag("--dtype", "dtype", "model dtype: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    flag("--max-sessions", "max_sessions", "concurrent sessions (KV cache slots)", type=int)
    flag("--max-seq-len", "max_seq_len", "tokens per session: prompt + generated + one tree", type=int)
    flag("--max-tree-nodes", "max_tree_nodes", "largest tree accepted, root included", type=int)
    flag("--max-tree-depth", "max_tree_depth", "deepest tree accepted", type=int)
    flag("--idle-timeout", "idle_timeout_s", "seconds without a message before a session is closed", type=float)
    flag("--open-timeout", "open_timeout_s", "seconds a session opened may go without its first tree before it is "
         "closed (its KV slot freed)", type=float, env="VERIFIER_OPEN_TIMEOUT_S")
    flag("--grace", "grace_s", "on SIGTERM, seconds the open sessions get to end (new ones are refused, so "
         "drafters open them on other replicas) before their links are cut; it exits as soon as none is left, "
         "and a second SIGTERM cuts them at once", type=float)
    flag("--stall-timeout", "stall_timeout_s", "seconds the model worker may have work without progress (a hung "
         "device) before health turns NOT_SERVING and Info UNAVAILABLE, so that drafters move its sessions; 0 = never",
         type=float, env="VERIFIER_STALL_TIMEOUT_S")
    flag("--max-inflight", "max_inflight", "unanswered messages per drafter link before the verifier stops "
         "reading it (back-pressure)", type=int)
    flag("--feature-ring-mb", "feature_ring_mb", "MiB of shared memory per drafter link for the replies' feature "
         "rows, offered to drafters that ask: one on this host maps it and its rows no longer cross gRPC (others "
         "refuse it and get them inline); 0 = none offered", type=int, env="VERIFIER_FEATURE_RING_MB")
    flag("--feature-ring-dir", "feature_ring_dir", "directory of those rings' files (each unlinked once its "
         "drafter has answered); empty = /dev/shm, or the temp directory without one", env="VERIFIER_FEATURE_RING_DIR")
    p.switch("--unix-socket", env="VERIFIER_UNIX_SOCKET", default=_DEFAULTS["unix_socket"], negatable=True,
             help="offer each drafter that asks a Unix socket for its link's messages: one on this host connects "
                  "and they no longer cross gRPC (others keep the gRPC stream); --no-unix-socket: none offered")
    flag("--unix-socket-dir", "unix_socket_dir", "directory under which each offered socket gets a directory of its "
         "own, mode 0700 (removed once the drafter has connected); empty = /dev/shm, or the temp directory "
         "without one", env="VERIFIER_UNIX_SOCKET_DIR")
    flag("--max-message-mb", "max_message_mb", "inbound message cap in MiB (larger messages get RESOURCE_EXHAUSTED); "
         "0 = what the largest link message at --max-sessions, --max-seq-len and --max-tree-nodes needs", type=int)
    flag("--graph-batches", "graph_batches", "batch buckets (rows per step: a tree each, and the prompt segments of "
         "--mixed-prompts) of the captured verify CUDA graphs; those above --max-sessions plus half as many again "
         "(at least 8) are cut to that", type=_int_list)
    flag("--graph-trees", "graph_trees", "tree buckets (drafted nodes) of the captured verify CUDA graphs; larger "
         "trees run eagerly", type=_int_list)
    flag("--tls-cert", None, "PEM certificate (chain) to serve TLS with; with --tls-key the port speaks TLS only")
    flag("--tls-key", None, "PEM private key of --tls-cert")
    flag("--tls-client-ca", None, "PEM CA bundle: drafters must present a client certificate it signed (mutual TLS)")
    p.switch("--trace-console", env="VERIFIER_TRACE_CONSOLE", default=_DEFAULTS["trace_console"],
             help="print one line per trace span to stdout: name, ms, trace id prefix, key attributes (OTLP "
                  "export is set by OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.flag("--sampling", env="VERIFIER_SAMPLING", default=_DEFAULTS["sampling"], choices=("keyed", "coins"),
           help="how sampled requests sample: keyed = position-keyed (Gumbel noise keyed by seed, position and "
                "token: a seeded output equals seeded plain decoding whatever the trees, budget or batch); coins = "
                "the target-only coin walk with per-session coins (SGLang's semantics); both fused kernels "
                f"(default {_DEFAULTS['sampling']})")
    p.switch("--deterministic", env="VERIFIER_DETERMINISTIC", default=_DEFAULTS["deterministic"],
             help="batch-invariant kernels: a token's logits do not depend on the tree, the batch or its padding, "
                  "so greedy tree decoding equals greedy plain decoding bit for bit in bf16 too (the default "
                  "kernels promise that in float32; in bf16 a near-tie may flip); costs verify speed")
    p.switch("--prefill-graphs", env="VERIFIER_PREFILL_GRAPHS", default=_DEFAULTS["prefill_graphs"], negatable=True,
             help="prefill prompt chunks of up to 4 sessions per step (each chunk no longer than the largest "
                  "--graph-trees bucket) by replaying captured CUDA graphs instead of eagerly: a short prompt's "
                  "prefill then costs its device time rather than the eager launches; more graphs to capture "
                  "(--no-prefill-graphs: eager prefills)")
    p.switch("--mixed-prompts", env="VERIFIER_MIXED_PROMPTS", default=_DEFAULTS["mixed_prompts"], negatable=True,
             help="prompt chunks that arrive beside trees ride the trees' verify forward, cut into rows of the "
                  "trees' width, where that costs less than a prefill of their own (one weight pass fewer per "
                  "step with arrivals); --no-mixed-prompts: every chunk gets a prefill of its own")
    flag("--tensor-parallel", "tensor_parallel", "shard the target over this many processes, one GPU each (from "
         "--device cuda:N on), Megatron-style with an all-reduce after o_proj and down_proj; rank 0 serves",
         type=int)
    p.flag("--measure-costs", env="VERIFIER_MEASURE_COSTS", default=_DEFAULTS["measure_costs"],
           choices=("auto", "on", "off"),
           help="time the verify step per (batch bucket, tree bucket) at start-up and send the table to drafters "
                "for their adaptive tree budget; auto = on when CUDA graphs are captured (default auto)")
    p.switch("--raw-features", env="VERIFIER_RAW_FEATURES", default=False,
             help="with --draft: send the raw layer features (n_layers x hidden per token) and leave the "
             "draft's fc + hidden_norm to the drafter")
    p.flag("--feature-wire", env="VERIFIER_FEATURE_WIRE", default=_DEFAULTS["feature_wire"], choices=tuple(FORMATS),
           help="how feature rows travel to drafters: model = in the model's dtype; fp8 = each row as float8_e4m3fn "
                "values and a float32 scale, half the bytes of bf16 rows; the rounding changes the drafts (and so "
                f"the acceptance), never the output (default {_DEFAULTS['feature_wire']})")
    p.switch("--no-cuda-graphs", env="VERIFIER_NO_CUDA_GRAPHS", default=not _DEFAULTS["cuda_graphs"],
             help="run the verify step eagerly on CUDA instead of replaying captured CUDA graphs")
    add_logging_flags(p, "VERIFIER", _DEFAULTS["log_level"], _DEFAULTS["log_format"])
    return p


def feature_layers(args: argparse.Namespace) -> tuple[int, ...]:
    """From --feature-layers, or from the draft's config.json, checked against the target."""
    if args.draft and args.feature_layers is not None:
        fail("give --draft or --feature-layers, not both")
    if not args.draft:
        return args.feature_layers or ()
    try:
        draft = load_draft_config(args.draft)
        check_draft_fits_target(draft, load_target_config(args.target))
    except CheckpointError as exc:
        fail(str(exc))
    return draft.target_layer_ids


def parse_config(argv: list[str] | None = None) -> VerifierConfig:
    """Flags > environment > VerifierConfig defaults; exits with one line on a bad value."""
    args = build_parser().parse_args(argv)
    if not args.target:
        fail("--target is required (or set VERIFIER_TARGET)")
    config = VerifierConfig(
        target_dir=args.target, feature_layer_ids=feature_layers(args),
        projection_dir=args.draft if args.draft and not args.raw_features else "", host=args.host, port=args.port,
        device=args.device, dtype=args.dtype, max_sessions=args.max_sessions, max_seq_len=args.max_seq_len,
        max_tree_nodes=args.max_tree_nodes, max_tree_depth=args.max_tree_depth, idle_timeout_s=args.idle_timeout,
        open_timeout_s=args.open_timeout,
        grace_s=args.grace, stall_timeout_s=args.stall_timeout, trace_console=args.trace_console,
        cuda_graphs=not args.no_cuda_graphs,
        max_inflight=args.max_inflight, graph_batches=tuple(args.graph_batches), graph_trees=tuple(args.graph_trees),
        sampling=args.sampling, deterministic=args.deterministic, prefill_graphs=args.prefill_graphs,
        mixed_prompts=args.mixed_prompts,
        tensor_parallel=args.tensor_parallel,
        max_message_mb=args.max_message_mb,
        feature_ring_mb=args.feature_ring_mb, feature_ring_dir=args.feature_ring_dir,
        unix_socket=args.unix_socket, unix_socket_dir=args.unix_socket_dir,
        measure_costs=args.measure_costs, feature_wire=args.feature_wire,
        metrics_port=args.metrics_port, log_level=args.log_level, log_format=args.log_format,
        tls=ServerTls(cert=args.tls_cert or "", key=args.tls_key or "", client_ca=args.tls_client_ca or ""),
    )
    try:
        config.check()
    except ValueError as exc:
        fail(str(exc))
    return config


async def run(config: VerifierConfig, verifier: TreeVerifier) -> str | None:
    """Serve until SIGTERM/SIGINT; returns an error message if the server cannot start."""
    try:
        server, port = await serve(config, verifier, metrics_port=config.metrics_port or None)
    except (OSError, ValueError) as exc:  # the port cannot be bound; TLS files gone since start-up
        return str(exc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    served = f", metrics on {config.host}:{server.metrics.port}" if server.metrics is not None else ""
    freeze_startup_heap()
    compiles.serving()
    print(f"verifier listening on {config.host}:{port}{served}", flush=True)
    await stop.wait()
    logging.getLogger("verifier_svc").info("shutting down (grace %g s%s)", config.grace_s,
                                           "; a second signal cuts the drain" if config.grace_s else "")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.cut)
    await server.stop(config.grace_s)
    return None


def main(argv: list[str] | None = None, load=load_runner) -> None:
    """`load(config, rank, world)` builds each rank's TargetRunner (benchmarks pass their own, a
    module-level function, since tensor-parallel ranks are processes of their own)."""
    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format)
    compiles.watch()  # kernel compiles timed; those while serving logged (`compiles.serving`)
    with contextlib.ExitStack() as ranks:
        try:
            # Tensor parallel: the other ranks run in processes of their own until this one stops them.
            runner = ranks.enter_context(leader(config, load)) if config.tensor_parallel > 1 else load(config, 0, 1)
            verifier = load_verifier(config, runner)
        except (CheckpointError, ValueError) as exc:
            fail(str(exc))
        if exporting(config.trace_console):
            setup_tracing("verifier", console=config.trace_console)
        try:
            error = asyncio.run(run(config, verifier))
        finally:
            shutdown_tracing()
    if error:
        fail(error)


if __name__ == "__main__":
    main()
