"""Prometheus metrics of both services (common/metrics.py): /metrics parses as Prometheus text on
the drafter's HTTP port and the verifier's --metrics-port, and the counters move by exactly what
a request did (tokens, rounds, requests by API, finish reason and status code)."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import load_target_config
from common.metrics import serve_metrics
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from tests.test_http_api import MODEL_NAME, PAIR, PROMPT, post, shipped_services, shipped_target_with_template


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    target = shipped_target_with_template(tmp_path_factory.mktemp("metrics") / MODEL_NAME)
    with shipped_services(target, max_sessions=4) as running:
        yield running


@pytest.fixture(scope="module")
def drafter(services):
    return services[1]


@pytest.fixture(scope="module")
def client(drafter):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{drafter.server.http_port}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


def page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page(port)) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


DRAFTER_FAMILIES = {
    "ddtree_drafter_requests": "counter", "ddtree_drafter_generated_tokens": "counter",
    "ddtree_drafter_prompt_tokens": "counter", "ddtree_drafter_rounds": "counter",
    "ddtree_drafter_accepted_tokens": "counter", "ddtree_drafter_active_sessions": "gauge",
    "ddtree_drafter_verifier_up": "gauge", "ddtree_drafter_time_to_first_token_seconds": "histogram",
    "ddtree_drafter_inter_token_latency_seconds": "histogram", "ddtree_drafter_request_latency_seconds": "histogram",
    "ddtree_drafter_queue_wait_seconds": "histogram", "ddtree_drafter_draft_seconds": "histogram",
    "ddtree_drafter_tree_build_seconds": "histogram", "ddtree_drafter_verify_rpc_seconds": "histogram",
    "ddtree_drafter_step_batch_size": "histogram", "ddtree_drafter_step_seconds": "histogram",
    "ddtree_drafter_link_seconds": "histogram", "ddtree_drafter_tree_budget": "histogram",
    "ddtree_drafter_budget_calibration": "gauge", "ddtree_drafter_link_bytes": "counter",
    "ddtree_drafter_http_requests": "counter",
}
VERIFIER_FAMILIES = {
    "ddtree_verifier_step_seconds": "histogram", "ddtree_verifier_step_batch_size": "histogram",
    "ddtree_verifier_verify_forward_seconds": "histogram", "ddtree_verifier_prefill_seconds": "histogram",
    "ddtree_verifier_sessions": "gauge", "ddtree_verifier_kv_slots": "gauge", "ddtree_verifier_inflight_steps": "gauge",
    "ddtree_verifier_draining": "gauge", "ddtree_verifier_worker_stalled_seconds": "gauge",
}


def test_metrics_parse_with_their_names_and_types(drafter, services):
    for port, expected in ((drafter.server.http_port, DRAFTER_FAMILIES),
                           (services[0].server.metrics.port, VERIFIER_FAMILIES)):
        families = {f.name: f.type for f in text_string_to_metric_families(page(port))}
        assert {name: families.get(name) for name in expected} == expected
        assert all(f.documentation for f in text_string_to_metric_families(page(port)))
    assert value(scrape(drafter.server.http_port), "ddtree_drafter_verifier_up") == 1
    verifier = scrape(services[0].server.metrics.port)
    assert value(verifier, "ddtree_verifier_kv_slots") == 4
    assert value(verifier, "ddtree_verifier_draining") == value(verifier, "ddtree_verifier_worker_stalled_seconds") == 0


def test_a_completion_moves_the_counters_by_its_usage(client, drafter, services):
    before, verifier_before = scrape(drafter.server.http_port), scrape(services[0].server.metrics.port)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    after, verifier_after = scrape(drafter.server.http_port), scrape(services[0].server.metrics.port)
    tokens = out.usage.completion_tokens
    assert tokens == 20 and out.choices[0].finish_reason == "length"
    assert moved(before, after, "ddtree_drafter_generated_tokens_total") == tokens
    assert moved(before, after, "ddtree_drafter_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved(before, after, "ddtree_drafter_requests_total", api="http", finish_reason="length", code="OK") == 1
    assert sum(moved(before, after, n, **dict(l)) for n, l in after if n == "ddtree_drafter_requests_total") == 1
    rounds = moved(before, after, "ddtree_drafter_rounds_total")
    # The prefill gives the first token; every later one came from a verify round.
    assert 1 <= rounds <= tokens - 1
    assert moved(before, after, "ddtree_drafter_accepted_tokens_total") == tokens - 1
    assert rounds < tokens - 1  # the shipped draft gets more than one token per round accepted
    assert moved(before, after, "ddtree_drafter_time_to_first_token_seconds_count") == 1
    assert moved(before, after, "ddtree_drafter_request_latency_seconds_count") == 1
    assert moved(before, after, "ddtree_drafter_queue_wait_seconds_count") == 1
    assert moved(before, after, "ddtree_drafter_inter_token_latency_seconds_count") == tokens - 1
    assert moved(before, after, "ddtree_drafter_draft_seconds_count") == rounds
    assert moved(before, after, "ddtree_drafter_tree_build_seconds_count") == rounds
    assert moved(before, after, "ddtree_drafter_step_batch_size_count") == rounds
    assert moved(before, after, "ddtree_drafter_step_batch_size_sum") == rounds  # one session in each
    assert moved(before, after, "ddtree_drafter_verify_rpc_seconds_count") >= rounds + 1  # the open, every tree
    assert moved(before, after, "ddtree_drafter_step_seconds_count") == moved(
        before, after, "ddtree_drafter_verify_rpc_seconds_count")
    # Every reply over gRPC says how long the verifier held its message: the link's own time is
    # observed for each, and is a part of the round trips.
    assert moved(before, after, "ddtree_drafter_link_seconds_count") == moved(
        before, after, "ddtree_drafter_verify_rpc_seconds_count")
    assert 0 < moved(before, after, "ddtree_drafter_link_seconds_sum") < moved(
        before, after, "ddtree_drafter_verify_rpc_seconds_sum")
    # The bytes both ways: the replies carry the target features of every emitted token but the
    # prefill's last (a prompt row and a path row each, hidden-size float32 context rows here),
    # the first reply's inline, the later ones' through the verifier's feature ring (one host).
    down = moved(before, after, "ddtree_drafter_link_bytes_total", direction="down")
    ring = moved(before, after, "ddtree_drafter_link_bytes_total", direction="ring")
    assert moved(before, after, "ddtree_drafter_link_bytes_total", direction="up") > 0
    hidden = load_target_config(PAIR / "target").hidden_size
    assert down + ring > (out.usage.prompt_tokens + tokens - 1) * 4 * hidden
    assert ring >= (tokens - 1) * 4 * hidden
    assert value(after, "ddtree_drafter_active_sessions") == 0
    # The verifier verified every round's tree and ran the open; the closed session freed its slot.
    assert moved(verifier_before, verifier_after, "ddtree_verifier_step_batch_size_sum") == rounds
    assert moved(verifier_before, verifier_after, "ddtree_verifier_step_seconds_count") >= rounds + 1
    assert moved(verifier_before, verifier_after, "ddtree_verifier_verify_forward_seconds_count") == rounds
    assert moved(verifier_before, verifier_after, "ddtree_verifier_prefill_seconds_count") == 1
    # The finished session's Close may still be in flight at the verifier: wait for it to be answered.
    # (The gauge is the process's: a verifier of an earlier test here may have left one, as a stop
    # that leaves a hung model worker behind does.)
    idle = value(verifier_before, "ddtree_verifier_inflight_steps")
    deadline = time.monotonic() + 30
    while value(scrape(services[0].server.metrics.port), "ddtree_verifier_inflight_steps") != idle:
        assert time.monotonic() < deadline, "a link message stayed in flight at the verifier"
        time.sleep(0.05)


def test_stop_and_errors_are_counted_by_reason_and_code(client, drafter):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    before = scrape(drafter.server.http_port)
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert post(drafter, "/v1/completions", {"prompt": PROMPT, "temperature": -1})[0] == 400  # the domain's check
    assert post(drafter, "/v1/completions", {"prompt": PROMPT, "n": 0})[0] == 400  # the HTTP layer's check
    with grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        once = stub.GenerateOnce(pb.GenerateRequest(text=PROMPT, max_new_tokens=5), timeout=60)
        with pytest.raises(grpc.RpcError):
            stub.GenerateOnce(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10 ** 9])), timeout=60)
    after = scrape(drafter.server.http_port)
    assert cut.choices[0].finish_reason == "stop"
    assert moved(before, after, "ddtree_drafter_requests_total", api="http", finish_reason="stop", code="OK") == 1
    assert moved(before, after, "ddtree_drafter_requests_total", api="http", finish_reason="none",
                 code="INVALID_ARGUMENT") == 2
    assert moved(before, after, "ddtree_drafter_requests_total", api="grpc", finish_reason="length", code="OK") == 1
    assert moved(before, after, "ddtree_drafter_requests_total", api="grpc", finish_reason="none",
                 code="INVALID_ARGUMENT") == 1
    assert moved(before, after, "ddtree_drafter_generated_tokens_total") == (
        cut.usage.completion_tokens + once.final.usage.completion_tokens)
    assert moved(before, after, "ddtree_drafter_request_latency_seconds_count") == 2  # the two that ended normally


def test_http_requests_are_counted_once_and_generations_each(drafter):
    """A request of 2 prompts x n 2 is one HTTP request of four generations; a refused one and an
    unknown path are one HTTP request each."""
    before = scrape(drafter.server.http_port)
    status, reply = post(drafter, "/v1/completions", {"prompt": [PROMPT, "x"], "n": 2, "max_tokens": 3})
    assert status == 200 and len(reply["choices"]) == 4
    assert post(drafter, "/v1/completions", {"prompt": PROMPT, "n": 0})[0] == 400
    assert post(drafter, "/v1/nothing", {})[0] == 404
    after = scrape(drafter.server.http_port)
    assert moved(before, after, "ddtree_drafter_http_requests_total", route="/v1/completions", status="200") == 1
    assert moved(before, after, "ddtree_drafter_http_requests_total", route="/v1/completions", status="400") == 1
    assert moved(before, after, "ddtree_drafter_http_requests_total", route="unmatched", status="404") == 1
    assert sum(moved(before, after, "ddtree_drafter_requests_total", api="http", finish_reason=reason, code="OK")
               for reason in ("length", "stop")) == 4  # (sampled at OpenAI's temperature 1: an EOS may come)


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_goes_away_cancels_its_generation(drafter, n):
    """A stream whose client disconnects is cancelled: each of its choices' sessions ends, counted
    as cancelled."""
    before = scrape(drafter.server.http_port)
    # (ignore_eos: sampled at OpenAI's temperature 1, a choice might end at an EOS before the cancel)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "stream": True, "n": n, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", drafter.server.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")  # the stream has begun
    deadline = time.monotonic() + 60  # a safety net only: the cancel takes one scheduler step
    while value(after := scrape(drafter.server.http_port), "ddtree_drafter_active_sessions") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert value(after, "ddtree_drafter_active_sessions") == 0
    assert moved(before, after, "ddtree_drafter_requests_total", api="http", finish_reason="cancelled",
                 code="CANCELLED") == n
    assert moved(before, after, "ddtree_drafter_generated_tokens_total") < 400 * n


def test_each_service_exposes_only_its_own_metrics():
    from common import metrics
    drafter, verifier = metrics.render("drafter").decode(), metrics.render("verifier").decode()
    assert "ddtree_drafter_draft_seconds" in drafter and "ddtree_verifier_" not in drafter
    assert "ddtree_verifier_step_seconds" in verifier and "ddtree_drafter_" not in verifier


def test_a_busy_metrics_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"^cannot serve metrics on 127.0.0.1:{port}: address already in use$"):
            asyncio.run(serve_metrics("127.0.0.1", port))
