"""Run the drafter service.

    python -m drafter_svc --draft DIR --target DIR --verifier HOST:PORT [--port 50050] [--tree-budget 16]

Loads the DFlash draft plus the target's embed_tokens, lm_head and tokenizer, checks the
verifier serves the same target, and serves the public Generation API with gRPC health
and reflection. Every flag falls back to the environment variable named in its help.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import torch

from common.cli import env_default, fail
from common.config import CheckpointError
from common.protocol import StatusError
from common.tracing import setup_tracing, shutdown_tracing
from drafter_svc.server import DrafterConfig, DrafterEngine, serve

log = logging.getLogger("drafter_svc")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> DrafterConfig:
    d = DrafterConfig()
    p = argparse.ArgumentParser(prog="python -m drafter_svc", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=env_default("DRAFT_DIR", ""), help="DFlash draft checkpoint folder [DRAFT_DIR]")
    p.add_argument("--target", default=env_default("TARGET_DIR", ""),
                   help="target checkpoint folder; only embed_tokens, lm_head and the tokenizer are loaded [TARGET_DIR]")
    p.add_argument("--verifier", default=env_default("VERIFIER_ADDR", d.verifier),
                   help=f"verifier address HOST:PORT [VERIFIER_ADDR] (default {d.verifier})")
    p.add_argument("--host", default=env_default("DRAFTER_HOST", d.host), help=f"listen address [DRAFTER_HOST] (default {d.host})")
    p.add_argument("--port", type=int, default=env_default("DRAFTER_PORT", d.port, int),
                   help=f"listen port, 0 = any free port [DRAFTER_PORT] (default {d.port})")
    p.add_argument("--device", default=env_default("DRAFTER_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"),
                   help="torch device of the draft model [DRAFTER_DEVICE] (default cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=env_default("DRAFTER_DTYPE", d.dtype),
                   help="weights dtype; auto = bfloat16 on GPU, float32 on CPU [DRAFTER_DTYPE]")
    p.add_argument("--tree-budget", type=int, default=env_default("TREE_BUDGET", d.tree_budget, int),
                   help=f"default DDTree nodes per round when a request sets none [TREE_BUDGET] (default {d.tree_budget})")
    p.add_argument("--chain", action="store_true", default=env_default("DRAFT_CHAIN", False, _flag),
                   help="draft the argmax chain (vanilla DFlash) for requests that set no tree_budget [DRAFT_CHAIN]")
    p.add_argument("--max-new-tokens", type=int, default=env_default("MAX_NEW_TOKENS", d.max_new_tokens, int),
                   help=f"default max_new_tokens when a request sets none [MAX_NEW_TOKENS] (default {d.max_new_tokens})")
    p.add_argument("--max-concurrent", type=int, default=env_default("MAX_CONCURRENT", d.max_concurrent, int),
                   help=f"Generate calls running at once [MAX_CONCURRENT] (default {d.max_concurrent})")
    p.add_argument("--verifier-wait", type=float, default=env_default("VERIFIER_WAIT_S", d.verifier_wait_s, float),
                   help=f"seconds start-up waits for the verifier [VERIFIER_WAIT_S] (default {d.verifier_wait_s:.0f})")
    p.add_argument("--queue-timeout", type=float, default=env_default("QUEUE_TIMEOUT_S", d.queue_timeout_s, float),
                   help="seconds a request waits for a free verifier session slot before RESOURCE_EXHAUSTED "
                        f"[QUEUE_TIMEOUT_S] (default {d.queue_timeout_s:.0f})")
    p.add_argument("--trace-console", action="store_true", help="also print spans to stdout")
    a = p.parse_args(argv)
    if not a.draft or not a.target:
        fail("--draft and --target are required (or DRAFT_DIR and TARGET_DIR)")
    if a.tree_budget < 0 or a.max_new_tokens < 1 or a.max_concurrent < 1:
        fail("--tree-budget must be >= 0, --max-new-tokens and --max-concurrent >= 1")
    return DrafterConfig(draft_dir=a.draft, target_dir=a.target, verifier=a.verifier, host=a.host, port=a.port,
                         device=a.device, dtype=a.dtype, tree_budget=a.tree_budget, chain=a.chain,
                         max_new_tokens=a.max_new_tokens, max_concurrent=a.max_concurrent,
                         verifier_wait_s=a.verifier_wait, queue_timeout_s=a.queue_timeout,
                         trace_console=a.trace_console)


def _flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes", "on")


async def run(cfg: DrafterConfig) -> None:
    dtype = DTYPES[cfg.dtype] or (torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32)
    engine = await asyncio.to_thread(DrafterEngine.start, cfg, dtype)
    server, port = await serve(engine, cfg.host, cfg.port)
    print(f"drafter listening on {cfg.host}:{port} (verifier {cfg.verifier})", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("shutting down")
    await server.stop(grace=5.0)


def main(argv=None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    setup_tracing("drafter", console=cfg.trace_console)
    try:
        asyncio.run(run(cfg))
    except (CheckpointError, StatusError, ValueError) as exc:
        fail(str(exc))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
