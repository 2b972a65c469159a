"""Every Prometheus metric of both services, defined in one place.

Names follow Prometheus conventions: `ddtree_drafter_...` and `ddtree_verifier_...` (and
`ddtree_kernel_...`, which each process has for itself), base
units (`_seconds`), counters ending in `_total`. Updates are cheap host-side operations
(a lock and an add); none waits for a device. Step stage times are host times: on CUDA a
stage that only launches kernels returns before they finish, and the wait lands in the next
stage that copies results to the host (the drafter's tree build reads the draft's logits; the
verifier's whole step ends with its replies on the host, so its step time is complete).

The drafter serves them on its HTTP port (`/metrics`), the verifier on `--metrics-port`
(`serve_metrics`). Both use the process-wide default registry; each exposes its own metrics
(and the process and platform collectors), not the other service's.
"""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

from common.grpc_server import bind_error_reason

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_REQUEST = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_STAGE = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# -- drafter: requests (observed in drafter_svc/server.py from the scheduler's deliveries) ----------

REQUESTS = Counter("ddtree_drafter_requests_total", "Generations that ended (each choice of an HTTP request "
                   "with n choices or a batch of prompts counts; an HTTP request refused before any "
                   "generation counts once), by API (grpc, http), finish reason (stop, length, cancelled; none "
                   "for an error) and gRPC status code (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, "
                   "...)", ["api", "finish_reason", "code"])
HTTP_REQUESTS = Counter("ddtree_drafter_http_requests_total", "HTTP requests answered, by route (the path "
                        "pattern; unmatched for an unknown path) and status (a stream's is its first one)",
                        ["route", "status"])
PROMPT_TOKENS = Counter("ddtree_drafter_prompt_tokens_total",
                        "Prompt tokens of the generations submitted (each choice counts its prompt)")
GENERATED_TOKENS = Counter("ddtree_drafter_generated_tokens_total",
                           "Tokens delivered to clients (after stop strings: the sum of usage.completion_tokens)")
ROUNDS = Counter("ddtree_drafter_rounds_total", "Verify rounds that emitted tokens (the prefill not included)")
ACCEPTED_TOKENS = Counter("ddtree_drafter_accepted_tokens_total",
                          "Tokens emitted by verify rounds, bonus token included: accepted_tokens_total / "
                          "rounds_total is the mean acceptance length")
ACTIVE_SESSIONS = Gauge("ddtree_drafter_active_sessions", "Requests submitted and not yet ended (queued included)")
TIME_TO_FIRST_TOKEN = Histogram("ddtree_drafter_time_to_first_token_seconds",
                                "From a request's arrival (before tokenising) to its first token",
                                buckets=_LATENCY)
INTER_TOKEN_LATENCY = Histogram("ddtree_drafter_inter_token_latency_seconds",
                                "Time between rounds divided by the tokens the later one brought, observed once per "
                                "token (count = tokens after the first, sum = decode time)", buckets=_PER_TOKEN)
REQUEST_LATENCY = Histogram("ddtree_drafter_request_latency_seconds",
                            "From a request's arrival to its last token, for requests that ended normally",
                            buckets=_REQUEST)
VERIFIER_UP = Gauge("ddtree_drafter_verifier_up", "1 while the verifier answers, else 0 (the drafter's health)")

# -- drafter: scheduler steps (hooks in drafter_svc/scheduler.py) ------------------------------------

QUEUE_WAIT = Histogram("ddtree_drafter_queue_wait_seconds",
                       "From submission to admission (a draft slot and an open sent), once per request, at "
                       "its first token: to the admission whose open brought it (retries after a refusal "
                       "for capacity or a lost verifier included)", buckets=_LATENCY)
DRAFT_STEP = Histogram("ddtree_drafter_draft_seconds", "One batched draft step (every drafting session), host time",
                       buckets=_STAGE)
TREE_BUILD = Histogram("ddtree_drafter_tree_build_seconds", "One batched tree build (every drafting session)",
                       buckets=_STAGE)
VERIFY_RPC = Histogram("ddtree_drafter_verify_rpc_seconds",
                       "One link message's round trip: from building it to reading the verifier's reply",
                       buckets=_STAGE)
LINK = Histogram("ddtree_drafter_link_seconds",
                 "One link message's time on the wire and in the codecs, both ways and at both ends: its round "
                 "trip to its reply's arrival less the time the verifier held it (LinkResponse.held_seconds), "
                 "plus the reply's decoding; not observed in process",
                 buckets=_STAGE)
LINK_BYTES = Counter("ddtree_drafter_link_bytes_total",
                     "Bytes of the link's messages as serialised: to the verifiers (direction=up) and of their "
                     "replies (direction=down, target features included unless they came through a "
                     "shared-memory feature ring: direction=ring); not counted in process", ["direction"])
STEP = Histogram("ddtree_drafter_step_seconds",
                 "One link message from the start of its drafting to its reply applied (tokens delivered): "
                 "a round of its sessions", buckets=_STAGE)
STEP_BATCH_SIZE = Histogram("ddtree_drafter_step_batch_size", "Sessions with a tree in one link message",
                            buckets=_BATCH)
TREE_BUDGET = Histogram("ddtree_drafter_tree_budget",
                        "The adaptive budget's choice for one link message: the drafted nodes its trees keep at "
                        "most (0 = plain decoding); observed only with --adaptive-budget",
                        buckets=(0, 7, 15, 31, 63, 127, 255, 511, 1023))
BUDGET_CALIBRATION = Gauge("ddtree_drafter_budget_calibration",
                           "The adaptive budget's calibration: drafted tokens accepted over those the draft's "
                           "probabilities promised, smoothed (1 = a calibrated draft); set with --adaptive-budget")

# -- verifier (hooks in verifier_svc/scheduler.py; gauges set in verifier_svc/server.py) -------------

VERIFIER_STEP = Histogram("ddtree_verifier_step_seconds",
                          "One batched verifier step: every link's opens and trees (forward, accept, KV compaction) "
                          "with the results on the host", buckets=_STAGE)
VERIFIER_FORWARD = Histogram("ddtree_verifier_verify_forward_seconds",
                             "The batched verify of one step's trees: forward, accept and KV compaction, with the "
                             "results on the host", buckets=_STAGE)
VERIFIER_PREFILL = Histogram("ddtree_verifier_prefill_seconds",
                             "One batched prefill of opening sessions, from its launch to its first tokens on the host",
                             buckets=_STAGE)
VERIFIER_STEP_BATCH_SIZE = Histogram("ddtree_verifier_step_batch_size", "Trees verified in one step",
                                     buckets=_BATCH)
VERIFIER_SESSIONS = Gauge("ddtree_verifier_sessions", "Sessions open (KV cache slots in use)")
VERIFIER_KV_SLOTS = Gauge("ddtree_verifier_kv_slots", "KV cache slots (--max-sessions)")
VERIFIER_INFLIGHT_STEPS = Gauge("ddtree_verifier_inflight_steps",
                                "Link messages handed to the model worker and not yet answered")
VERIFIER_DRAINING = Gauge("ddtree_verifier_draining", "1 while the verifier shuts down (new sessions refused)")
VERIFIER_STALLED = Gauge("ddtree_verifier_worker_stalled_seconds",
                         "How long the model worker has had work without progress (0 while it has none or progresses)")

# -- both services: kernel compiles (hooks in common/compiles.py) ---------------------------------------

KERNEL_COMPILES = Counter("ddtree_kernel_compiles_total",
                          "Triton kernel compiles in this process (a load from Triton's on-disk cache counts too), "
                          "by phase: startup, or serving (each one stalled the step that launched it)", ["phase"])
KERNEL_COMPILE_SECONDS = Histogram("ddtree_kernel_compile_seconds", "One Triton kernel compile, by phase",
                                   ["phase"], buckets=_LATENCY)


def track_inflight_step(future: asyncio.Future) -> None:
    """Count a link message as in flight until its future is done (result, error or cancelled)."""
    VERIFIER_INFLIGHT_STEPS.inc()
    future.add_done_callback(_step_done)


def _step_done(_future: asyncio.Future) -> None:
    VERIFIER_INFLIGHT_STEPS.dec()


def observe_inter_token_latency(tokens: int, seconds: float) -> None:
    """A round that brought `tokens` tokens `seconds` after the previous one: one observation per token."""
    if tokens > 0:
        per_token = seconds / tokens
        for _ in range(tokens):
            INTER_TOKEN_LATENCY.observe(per_token)


class _ServiceMetrics:
    """The default registry without the other service's metrics (both are defined in every process)."""

    def __init__(self, service: str):
        self.skip = "ddtree_verifier_" if service == "drafter" else "ddtree_drafter_"

    def collect(self):
        return (family for family in REGISTRY.collect() if not family.name.startswith(self.skip))


def render(service: str) -> bytes:
    """The Prometheus text exposition of this process's metrics for `service` ("drafter" or "verifier")."""
    return generate_latest(_ServiceMetrics(service))


def metrics_handler(service: str):
    """`GET /metrics` of `service` for an aiohttp app."""
    async def handle(_request: web.Request) -> web.Response:
        response = web.Response(body=render(service))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
    return handle


class MetricsServer:
    """A running `/metrics` endpoint on the caller's event loop."""

    def __init__(self, runner: web.AppRunner, port: int):
        self.runner, self.port = runner, port

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_metrics(host: str, port: int) -> MetricsServer:
    """Serve `/metrics` on host:port (0 = any free port). OSError when it cannot be bound."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler("verifier"))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot serve metrics on {host}:{port}: {bind_error_reason(exc)}") from None
    return MetricsServer(runner, runner.addresses[0][1])
