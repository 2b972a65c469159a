"""Run the drafter service.

    python -m drafter_svc --draft DIR --target DIR --verifier HOST:PORT [--port 50050] [--tree-budget 15]
    python -m drafter_svc --draft DIR --target DIR --verifier local [--local-verifier-flags "..."]

Loads the DFlash draft plus the target's embed_tokens, lm_head and tokenizer, checks the
verifier serves the same target, and serves the public Generation API with gRPC health
and reflection; with --http-port, also the OpenAI-compatible HTTP API and /metrics. With
`--verifier local` it loads the whole target too and verifies in this process (one GPU for
both models). Every flag falls back to the environment variable named in its help.
"""
from __future__ import annotations

import os

# gRPC C-core's own INFO lines (a peer's GOAWAY at a restart, say) stay out of the log; set before grpc loads.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import asyncio
import dataclasses
import logging
import shlex
import signal

import torch

from common import compiles
from common.auth import ApiKeyError, check_api_key, read_api_key
from common.cli import FlagParser, fail
from common.config import CheckpointError
from common.devices import parse_device
from common.heap import freeze_startup_heap
from common.logs import add_logging_flags, setup_logging
from common.protocol import StatusError
from common.tls import ChannelTls, ServerTls, TlsError
from common.tracing import exporting, setup_tracing, shutdown_tracing
from drafter_svc.server import LOCAL, DrafterConfig, DrafterEngine, local_verifier_config, serve

log = logging.getLogger("drafter_svc")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> DrafterConfig:
    d = DrafterConfig()
    p = FlagParser(prog="python -m drafter_svc", description=__doc__.split("\n\n")[0])
    p.flag("--draft", env="DRAFTER_DRAFT_DIR", default="", help="DFlash draft checkpoint folder")
    p.flag("--target", env="DRAFTER_TARGET_DIR", default="",
           help="target checkpoint folder; only embed_tokens, lm_head and the tokenizer are loaded")
    p.flag("--verifier", env="VERIFIER_ADDR", default=d.verifier,
           help="verifier address HOST:PORT, or several replicas HOST:PORT,HOST:PORT,... (a host name that resolves "
                "to several addresses is one replica per address): new sessions go to the least loaded one that "
                "answers, and the sessions of one that dies re-open on another (--recovery-timeout); or 'local': "
                "load the target in this process, on --device, linked in memory (one GPU for both models: one "
                "CUDA context instead of two time-slicing the GPU, no gRPC; rounds in lockstep) "
                f"(default {d.verifier})")
    p.flag("--local-verifier-flags", env="DRAFTER_LOCAL_VERIFIER_FLAGS", default="", raw=True,
           help="with --verifier local: the in-process verifier's settings, as `python -m verifier_svc` flags in one "
                "string, e.g. '--max-seq-len 4096 --graph-batches 1,8,32' (their VERIFIER_* environment fallbacks "
                "apply too); --target, --draft, --device, --dtype and --max-sessions default to this drafter's "
                "--target, --draft, --device, --dtype and --max-concurrent")
    p.flag("--host", env="DRAFTER_HOST", default=d.host, help=f"listen address (default {d.host})")
    p.flag("--port", env="DRAFTER_PORT", default=d.port, type=int, help=f"listen port, 0 = any free port (default {d.port})")
    p.flag("--device", env="DRAFTER_DEVICE", default="cuda" if torch.cuda.is_available() else "cpu",
           help="torch device of the draft model (default cuda if available, else cpu)")
    p.flag("--dtype", env="DRAFTER_DTYPE", default=d.dtype, choices=sorted(DTYPES),
           help="weights dtype; auto = bfloat16 on GPU, float32 on CPU")
    p.flag("--tree-budget", env="DRAFTER_TREE_BUDGET", default=d.tree_budget, type=int,
           help=f"default DDTree nodes per round when a request sets none (default {d.tree_budget})")
    p.switch("--chain", env="DRAFTER_CHAIN", default=d.chain,
             help="draft the argmax chain (vanilla DFlash) for requests that set no tree_budget")
    p.flag("--max-new-tokens", env="DRAFTER_MAX_NEW_TOKENS", default=d.max_new_tokens, type=int,
           help=f"default max_new_tokens when a request sets none (default {d.max_new_tokens})")
    p.flag("--max-concurrent", env="DRAFTER_MAX_CONCURRENT", default=d.max_concurrent, type=int,
           help=f"sessions batched at once (draft context slots; capped by the verifier's --max-sessions); more "
                f"requests wait in the queue (default {d.max_concurrent})")
    p.flag("--max-message-mb", env="DRAFTER_MAX_MESSAGE_MB", default=d.max_message_mb, type=int,
           help=f"largest request accepted, in MiB; larger ones get RESOURCE_EXHAUSTED (default {d.max_message_mb})")
    p.flag("--max-prompt-bytes", env="DRAFTER_MAX_PROMPT_BYTES", default=d.max_prompt_bytes, type=int,
           help="longest text prompt (or rendered chat) accepted, in UTF-8 bytes; longer ones get INVALID_ARGUMENT "
                f"before being tokenised (default {d.max_prompt_bytes})")
    p.flag("--verifier-wait", env="VERIFIER_WAIT_S", default=d.verifier_wait_s, type=float,
           help=f"seconds start-up waits for the verifier (default {d.verifier_wait_s:.0f})")
    p.flag("--queue-timeout", env="DRAFTER_QUEUE_TIMEOUT_S", default=d.queue_timeout_s, type=float,
           help="seconds a request waits for a free verifier session slot before RESOURCE_EXHAUSTED "
                f"(default {d.queue_timeout_s:.0f})")
    p.flag("--max-queue", env="DRAFTER_MAX_QUEUE", default=d.max_queue, type=int,
           help="requests that may wait for a session slot beyond the free ones; past that a request gets "
                "RESOURCE_EXHAUSTED at once, with a retry hint (trailing metadata retry-after-ms; HTTP Retry-After); "
                f"0 = none wait (default {d.max_queue})")
    p.flag("--prefill-chunk", env="DRAFTER_PREFILL_CHUNK", default=d.prefill_chunk, type=int,
           help="prompt tokens one step may prefill, over every session: a longer prompt is prefilled in "
                "chunks over several steps, between the other sessions' rounds, so that none waits more than one "
                f"chunk for it; 0 = no limit, each prompt in one piece (default {d.prefill_chunk})")
    p.flag("--prefill-chunk-idle", env="DRAFTER_PREFILL_CHUNK_IDLE", default=d.prefill_chunk_idle, type=int,
           help="prompt tokens one step may prefill while no session decodes (no round waits for the chunk), "
                "when more than --prefill-chunk: a prompt this long is prefilled in one piece, its first token "
                "after one forward instead of one per chunk; a session that begins to decode meanwhile waits for "
                "at most one such chunk, and so may the sessions of other drafters that share the verifier "
                "(on a CPU, whose attention computes every query-key pair of a piece, masked or not, a long "
                f"prompt's first token comes later); 0 = --prefill-chunk (default {d.prefill_chunk_idle})")
    p.flag("--prefill-ahead", env="DRAFTER_PREFILL_AHEAD", default=d.prefill_ahead, type=int,
           help="while no session decodes, how many chunks of a prompt may be sent ahead of the reply to its "
                "earlier ones: the verifier prefills the next chunk while the last one's features come back, "
                f"which shortens a long prompt's time to first token; 0 = one chunk at a time (default {d.prefill_ahead})")
    p.flag("--recovery-timeout", env="DRAFTER_RECOVERY_TIMEOUT_S", default=d.recovery_timeout_s, type=float,
           help="when a verifier link is lost (the verifier died or restarted), seconds each of its sessions "
                "keeps trying to re-open on a verifier that answers, by prefilling its prompt plus the tokens emitted "
                f"so far, before it fails with UNAVAILABLE; 0 = fail at once (default {d.recovery_timeout_s:g})")
    p.flag("--grace", env="DRAFTER_GRACE_S", default=d.grace_s, type=float,
           help="on SIGTERM or SIGINT, seconds running generations get to finish before they are cut "
                f"(default {d.grace_s:g})")
    p.switch("--trace-console", env="DRAFTER_TRACE_CONSOLE", default=d.trace_console,
             help="also print one line per span to stdout (name, ms, trace id prefix, key attributes)")
    p.switch("--no-cuda-graphs", env="DRAFTER_NO_CUDA_GRAPHS", default=not d.cuda_graphs,
             help="run the draft step eagerly on CUDA instead of replaying captured CUDA graphs")
    p.switch("--feature-ring", env="DRAFTER_FEATURE_RING", default=d.feature_ring, negatable=True,
             help="ask each verifier for a shared-memory ring for its replies' feature rows: on the verifier's "
                  "host they then skip gRPC (elsewhere the ring cannot be mapped and they come inline); "
                  "--no-feature-ring: always inline")
    p.switch("--unix-socket", env="DRAFTER_UNIX_SOCKET", default=d.unix_socket, negatable=True,
             help="ask each verifier, as each link begins, for a Unix socket for the link's messages: on the "
                  "verifier's host they then skip gRPC (elsewhere the socket cannot be reached and they keep the "
                  "gRPC stream); --no-unix-socket: always gRPC")
    p.flag("--pipelining", env="DRAFTER_PIPELINING", default=d.pipelining, choices=("auto", "on", "off"),
           help="on: with two or more sessions, keep --pipeline-groups link messages in flight (default two, "
                "each with half of them), so drafting one group overlaps verifying the others and the round trip; "
                "off: lockstep rounds, each "
                "reply awaited before drafting again; auto: on when --device is a GPU, and on the verifier's own "
                "GPU only from --shared-gpu-pipeline-sessions sessions; off on a CPU (default auto)")
    p.flag("--shared-gpu-pipeline-sessions", env="DRAFTER_SHARED_GPU_PIPELINE_SESSIONS",
           default=d.shared_gpu_pipeline_sessions, type=int,
           help="with --pipelining auto and the drafter on the verifier's own GPU: pipeline rounds only while at "
                "least this many sessions run or wait (fewer: two half-size verify passes on one device cost more "
                "than the host work they hide), or 16 while none drafts (plain decoding) "
                f"(default {d.shared_gpu_pipeline_sessions})")
    p.flag("--pipeline-groups", env="DRAFTER_PIPELINE_GROUPS", default=d.pipeline_groups, type=int,
           help="pipelined rounds: how many link messages are in flight, each with that share of the sessions "
                "(more groups keep the verifier's queue fuller while the drafter works on one, at the cost of "
                f"smaller verify passes) (default {d.pipeline_groups})")
    p.flag("--adaptive-budget", env="DRAFTER_ADAPTIVE_BUDGET", default=d.adaptive_budget,
           choices=("auto", "on", "off"),
           help="on: each step cuts every DDTree to the one budget that the verifier's measured step times and "
                "the observed acceptance promise the most tokens per second for (a request's tree_budget, or "
                "--tree-budget, is then a cap; 0 = plain decoding is always a candidate); off: every request's "
                "budget as given; auto: on when the verifier sends its cost table (--measure-costs) (default auto)")
    p.flag("--bench-oracle", env="DRAFTER_BENCH_ORACLE", default=d.bench_oracle,
           help="benchmarks only: a controlled-acceptance JSON file (see drafter_svc/oracle.py); the draft still "
                "runs, then its proposals are made to contain the target's greedy continuation at a set rate")
    p.flag("--http-port", env="DRAFTER_HTTP_PORT", default=d.http_port, type=int,
           help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models), "
                f"/health and /metrics, on --host; 0 = no HTTP server (default {d.http_port})")
    p.flag("--served-model-name", env="DRAFTER_SERVED_MODEL_NAME", default=d.served_model_name,
           help="model id of the HTTP API (default: the --target folder's name)")
    add_security_flags(p, d)
    add_logging_flags(p, "DRAFTER", d.log_level, d.log_format)
    a = p.parse_args(argv)
    tls, verifier_tls, api_key = security_settings(a)
    if not a.draft or not a.target:
        fail("--draft and --target are required (or DRAFTER_DRAFT_DIR and DRAFTER_TARGET_DIR)")
    if a.recovery_timeout < 0 or a.grace < 0:
        fail("--recovery-timeout and --grace must be >= 0")
    if a.max_queue < 0:
        fail(f"--max-queue must be >= 0, got {a.max_queue}")
    if a.prefill_chunk < 0:
        fail(f"--prefill-chunk must be >= 0 (0 = no limit), got {a.prefill_chunk}")
    if a.prefill_chunk_idle < 0:
        fail(f"--prefill-chunk-idle must be >= 0 (0 = --prefill-chunk), got {a.prefill_chunk_idle}")
    if a.prefill_ahead < 0:
        fail(f"--prefill-ahead must be >= 0, got {a.prefill_ahead}")
    if a.shared_gpu_pipeline_sessions < 2 or a.pipeline_groups < 2:
        fail("--shared-gpu-pipeline-sessions and --pipeline-groups must be >= 2, got "
             f"{a.shared_gpu_pipeline_sessions} and {a.pipeline_groups}")
    if a.tree_budget < 0 or a.max_new_tokens < 1 or a.max_concurrent < 1:
        fail("--tree-budget must be >= 0, --max-new-tokens and --max-concurrent >= 1")
    if a.max_message_mb < 1 or a.max_prompt_bytes < 1:
        fail("--max-message-mb and --max-prompt-bytes must be >= 1")
    for name, port in (("--port", a.port), ("--http-port", a.http_port)):
        if not 0 <= port <= 65535:
            fail(f"{name} must be in [0, 65535], got {port}")
    try:
        parse_device(a.device)
    except ValueError as exc:
        fail(f"--device: {exc}")
    if a.verifier != LOCAL and any(part.strip().lower() == LOCAL for part in a.verifier.split(",")):
        fail(f"--verifier {a.verifier!r}: '{LOCAL}' (the target in this process) stands alone, in lower case")
    if a.local_verifier_flags and a.verifier != LOCAL:
        fail("--local-verifier-flags is for --verifier local")
    if a.verifier == LOCAL and a.pipelining == "on":
        fail("--pipelining on needs a verifier service: with --verifier local rounds go in lockstep")
    cfg = DrafterConfig(draft_dir=a.draft, target_dir=a.target, verifier=a.verifier, host=a.host, port=a.port,
                         device=a.device, dtype=a.dtype, tree_budget=a.tree_budget, chain=a.chain,
                         max_new_tokens=a.max_new_tokens, max_concurrent=a.max_concurrent,
                         verifier_wait_s=a.verifier_wait, queue_timeout_s=a.queue_timeout,
                         max_queue=a.max_queue, prefill_chunk=a.prefill_chunk, prefill_ahead=a.prefill_ahead,
                         prefill_chunk_idle=a.prefill_chunk_idle,
                         recovery_timeout_s=a.recovery_timeout, grace_s=a.grace,
                         trace_console=a.trace_console, cuda_graphs=not a.no_cuda_graphs,
                         max_message_mb=a.max_message_mb, max_prompt_bytes=a.max_prompt_bytes,
                         pipelining=a.pipelining, shared_gpu_pipeline_sessions=a.shared_gpu_pipeline_sessions,
                         pipeline_groups=a.pipeline_groups, feature_ring=a.feature_ring, unix_socket=a.unix_socket,
                         adaptive_budget=a.adaptive_budget, bench_oracle=a.bench_oracle,
                         tls=tls, verifier_tls=verifier_tls, api_key=api_key, http_port=a.http_port,
                         served_model_name=a.served_model_name, log_level=a.log_level, log_format=a.log_format)
    if a.verifier != LOCAL:
        return cfg
    try:
        flags = shlex.split(a.local_verifier_flags)
    except ValueError as exc:
        fail(f"--local-verifier-flags: {exc}")
    return dataclasses.replace(cfg, local_verifier=local_verifier_config(cfg, flags))


def add_security_flags(p: FlagParser, d: DrafterConfig) -> None:
    """TLS of the public port and of the verifier link, and the public API's key."""
    p.flag("--tls-cert", env="DRAFTER_TLS_CERT", default=d.tls.cert,
           help="PEM certificate (chain) for the public port; with --tls-key it speaks TLS only")
    p.flag("--tls-key", env="DRAFTER_TLS_KEY", default=d.tls.key, help="PEM private key of --tls-cert")
    p.flag("--tls-client-ca", env="DRAFTER_TLS_CLIENT_CA", default=d.tls.client_ca,
           help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)")
    p.flag("--verifier-ca", env="DRAFTER_VERIFIER_CA", default=d.verifier_tls.ca,
           help="PEM CA bundle that signed the verifier's certificate: the link speaks TLS")
    p.flag("--verifier-cert", env="DRAFTER_VERIFIER_CERT", default=d.verifier_tls.cert,
           help="PEM client certificate (chain) presented to the verifier (mutual TLS; needs --verifier-ca)")
    p.flag("--verifier-key", env="DRAFTER_VERIFIER_KEY", default=d.verifier_tls.key,
           help="PEM private key of --verifier-cert")
    p.flag("--verifier-server-name", env="DRAFTER_VERIFIER_SERVER_NAME", default=d.verifier_tls.server_name,
           help="name the verifier's certificate must carry, when it is not the host of --verifier")
    p.flag("--api-key", env="DRAFTER_API_KEY", default=d.api_key,
           help="require 'authorization: Bearer KEY' metadata on every Generation call (health and reflection "
                "stay open); prefer --api-key-file, command lines are visible to other users")
    p.flag("--api-key-file", env="DRAFTER_API_KEY_FILE", default="", help="file holding the API key (see --api-key)")


def security_settings(a) -> tuple[ServerTls, ChannelTls, str]:
    """The TLS settings and API key from the flags, checked (files readable, keys matching their
    certificates); exits with one line otherwise."""
    tls = ServerTls(cert=a.tls_cert, key=a.tls_key, client_ca=a.tls_client_ca)
    verifier_tls = ChannelTls(ca=a.verifier_ca, cert=a.verifier_cert, key=a.verifier_key,
                              server_name=a.verifier_server_name, flag_prefix="--verifier-")
    if a.api_key and a.api_key_file:
        fail("give --api-key or --api-key-file, not both")
    try:
        tls.check()
        verifier_tls.check()
        api_key = read_api_key(a.api_key_file) if a.api_key_file else a.api_key
        if api_key:
            check_api_key(api_key)
    except (TlsError, ApiKeyError) as exc:
        fail(str(exc))
    return tls, verifier_tls, api_key


async def run(cfg: DrafterConfig) -> None:
    dtype = DTYPES[cfg.dtype] or (torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32)
    engine = await asyncio.to_thread(DrafterEngine.start, cfg, dtype)
    server, port = await serve(engine, cfg.host, cfg.port, http_port=cfg.http_port or None)
    http = f", HTTP on {cfg.host}:{server.http_port}" if server.http is not None else ""
    freeze_startup_heap()
    compiles.serving()
    print(f"drafter listening on {cfg.host}:{port}{http} (verifier {cfg.verifier})", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("shutting down (grace %g s)", cfg.grace_s)
    await server.stop(grace=cfg.grace_s)


def main(argv=None) -> None:
    cfg = parse_args(argv)
    setup_logging(cfg.log_level, cfg.log_format)
    compiles.watch()  # kernel compiles timed; those while serving logged (`compiles.serving`)
    if exporting(cfg.trace_console):
        setup_tracing("drafter", console=cfg.trace_console)
    try:
        asyncio.run(run(cfg))
    except (CheckpointError, StatusError, ValueError, OSError) as exc:  # OSError: the port cannot be bound
        fail(str(exc))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
