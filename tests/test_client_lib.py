"""The client library against both services on loopback (the shipped pair, on CPU): the sync
and asyncio clients give the same results, streams add up to their final result, cancelling
frees the verifier's session, errors carry their status; and the drafter logs one line per
request (gRPC and HTTP) and a start-up summary."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from common.config import load_draft_config
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tls import TlsError
from drafter_svc import client as client_cli
from drafter_svc.client_lib import (AsyncGenerationClient, ChatMessage, GenerationClient, GenerationDelta,
                                    GenerationError, GenerationResult, build_request)
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"
TARGET, DRAFT = str(SHIPPED / "target"), str(SHIPPED / "draft")
MAX_SESSIONS = 4
API_KEY = "client-lib-key"
PROMPT = "def fibonacci(n):"
LONG = dict(max_new_tokens=200, tree_budget=0)  # plain decoding, one token a round: a second or more on CPU
TIMEOUT = 60


class Records(logging.Handler):
    """Keeps every record of the services' loggers, from their start on (their threads included)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def requests(self, api: str | None = None) -> list[logging.LogRecord]:
        return [r for r in self.records if hasattr(r, "request_id") and api in (None, r.api)]


@pytest.fixture(scope="module")
def records():
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("drafter_svc", "verifier_svc")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield handler
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


@pytest.fixture(scope="module")
def verifier(records):
    cfg = VerifierConfig(target_dir=TARGET, feature_layer_ids=load_draft_config(DRAFT).target_layer_ids,
                         projection_dir=DRAFT, host="127.0.0.1", port=0, max_sessions=MAX_SESSIONS, max_seq_len=256,
                         max_tree_nodes=33)
    with ServerThread(lambda: serve_verifier(cfg)) as running:
        yield running


@pytest.fixture(scope="module")
def drafter(verifier):
    cfg = DrafterConfig(draft_dir=DRAFT, target_dir=TARGET, verifier=f"127.0.0.1:{verifier.port}", host="127.0.0.1",
                        port=0, tree_budget=8, max_new_tokens=12, verifier_wait_s=10, api_key=API_KEY)
    engine = DrafterEngine.start(cfg, torch.float32)
    with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0, http_port=0)) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def address(drafter) -> str:
    return f"127.0.0.1:{drafter.port}"


@pytest.fixture(scope="module")
def client(address):
    with GenerationClient(address, api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def verifier_stub(verifier):
    with grpc.insecure_channel(f"127.0.0.1:{verifier.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.VerifierStub(channel)


def free_sessions(verifier_stub) -> int:
    return verifier_stub.Info(pb.InfoRequest(), timeout=10).free_sessions


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll until `condition()` (the server frees a cancelled session on its own threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


def wait_full(verifier_stub) -> None:
    wait_until(lambda: free_sessions(verifier_stub) == MAX_SESSIONS, f"verifier capacity back to {MAX_SESSIONS}")


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


# -- results ---------------------------------------------------------------------------------

def test_sync_and_async_results_are_equal(client, address):
    options = dict(max_new_tokens=24, tree_budget=8)
    once = client.generate(PROMPT, timeout=TIMEOUT, **options)
    streamed = list(client.stream(PROMPT, timeout=TIMEOUT, **options))

    async def both():
        async with AsyncGenerationClient(address, api_key=API_KEY) as c:
            result = await c.generate(PROMPT, timeout=TIMEOUT, **options)
            items = [item async for item in c.stream(PROMPT, timeout=TIMEOUT, **options)]
            return result, items

    async_once, async_streamed = run_async(both())
    assert isinstance(once, GenerationResult) and once.completion_tokens == len(once.token_ids) == 24
    assert once.finish_reason == "length" and once.prompt_tokens > 0 and once.text
    assert once.rounds == len(once.acceptance_lengths) > 0 and once.mean_acceptance >= 1.0
    assert 0 < once.time_to_first_token_s <= once.elapsed_s
    for result in (streamed[-1], async_once, async_streamed[-1]):
        assert isinstance(result, GenerationResult)
        # Greedy: the same output and rounds every time (timings differ).
        assert (result.text, result.token_ids, result.finish_reason, result.prompt_tokens, result.completion_tokens,
                result.acceptance_lengths) == (once.text, once.token_ids, once.finish_reason, once.prompt_tokens,
                                               once.completion_tokens, once.acceptance_lengths)
    assert [d for d in streamed[:-1]] == [d for d in async_streamed[:-1]]


def test_stream_deltas_concatenate_to_the_final_result(client):
    *deltas, final = client.stream(PROMPT, max_new_tokens=30, stop=["\n\n"], timeout=TIMEOUT)
    assert deltas and all(isinstance(d, GenerationDelta) for d in deltas)
    assert isinstance(final, GenerationResult)
    assert "".join(d.text for d in deltas) == final.text
    assert tuple(t for d in deltas for t in d.token_ids) == final.token_ids
    assert deltas[0].round == 0 and len(deltas[0].token_ids) == 1  # the prefill's first token
    rounds = [d.round for d in deltas if d.token_ids]
    assert rounds == sorted(rounds) and rounds[-1] <= final.rounds


def test_token_id_prompts_and_sampling_options(client):
    ids = (5, 17, 42, 99, 3)
    result = client.generate(token_ids=ids, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                             timeout=TIMEOUT)
    again = client.generate(token_ids=list(ids), max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                            timeout=TIMEOUT)
    assert result.prompt_tokens == len(ids) and result.completion_tokens == 10
    assert again.token_ids == result.token_ids  # seeded: the same tokens


def test_ignore_eos_generates_past_the_models_end_of_sequence_tokens(client, drafter):
    """With the drafter's EOS set to a token the greedy output emits (the shipped model's own EOS
    never comes this early), a request stops at it; with ignore_eos it runs to max_new_tokens."""
    ids = (5, 17, 42, 99, 3)
    plain = client.generate(token_ids=ids, max_new_tokens=12, timeout=TIMEOUT)
    eos = plain.token_ids[3]
    scheduler = drafter.engine.scheduler
    saved, scheduler.eos_token_ids = scheduler.eos_token_ids, frozenset({eos})
    try:
        stopped = client.generate(token_ids=ids, max_new_tokens=12, timeout=TIMEOUT)
        kept = client.generate(token_ids=ids, max_new_tokens=12, ignore_eos=True, timeout=TIMEOUT)
    finally:
        scheduler.eos_token_ids = saved
    first = plain.token_ids.index(eos)
    assert stopped.token_ids == plain.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert kept.token_ids == plain.token_ids and kept.finish_reason == "length"


def test_logit_bias_bans_and_favours_tokens(client):
    """Banning the greedy output's first token changes it; +100 on a token makes it every token."""
    ids = (5, 17, 42, 99, 3)
    plain = client.generate(token_ids=ids, max_new_tokens=8, timeout=TIMEOUT)
    banned = client.generate(token_ids=ids, max_new_tokens=8, logit_bias={plain.token_ids[0]: -100},
                             timeout=TIMEOUT)
    forced = client.generate(token_ids=ids, max_new_tokens=8, logit_bias={42: 100.0}, timeout=TIMEOUT)
    assert banned.token_ids[0] != plain.token_ids[0] and plain.token_ids[0] not in banned.token_ids
    assert list(forced.token_ids) == [42] * 8
    assert build_request(PROMPT, logit_bias={3: 1.5}).logit_bias[3] == 1.5


def test_penalties_reach_the_verifier_and_are_checked(client):
    """A strong frequency and presence penalty make the greedy output repeat fewer tokens (through
    the real services); an out-of-range one is INVALID_ARGUMENT naming it."""
    ids = (5, 17, 42, 99, 3)
    plain = client.generate(token_ids=ids, max_new_tokens=32, ignore_eos=True, timeout=TIMEOUT)
    penalised = client.generate(token_ids=ids, max_new_tokens=32, ignore_eos=True, frequency_penalty=2.0,
                                presence_penalty=2.0, repetition_penalty=1.5, timeout=TIMEOUT)
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids)), (plain.token_ids, penalised.token_ids)
    with pytest.raises(GenerationError) as err:
        client.generate(token_ids=ids, max_new_tokens=4, repetition_penalty=-1.0, timeout=TIMEOUT)
    assert err.value.code == "INVALID_ARGUMENT" and "repetition_penalty must be in (0, 100]" in err.value.message
    request = build_request(PROMPT, presence_penalty=0.5, frequency_penalty=None)
    assert request.sampling.presence_penalty == 0.5 and not request.sampling.HasField("frequency_penalty")


def test_min_tokens_hold_back_stop_strings(client):
    """A stop string that the greedy output completes in its second token cuts it there, unless
    min_tokens asks for 6 tokens first (the shipped model's EOS never comes that early)."""
    ids = (5, 17, 42, 99, 3)
    plain = client.generate(token_ids=ids, max_new_tokens=12, timeout=TIMEOUT)
    stop = client.generate(token_ids=ids, max_new_tokens=2, timeout=TIMEOUT).text[-1]
    cut = client.generate(token_ids=ids, max_new_tokens=12, stop=[stop], timeout=TIMEOUT)
    kept = client.generate(token_ids=ids, max_new_tokens=12, stop=[stop], min_tokens=6, timeout=TIMEOUT)
    assert len(cut.token_ids) <= 2 and cut.finish_reason == "stop"
    assert len(kept.token_ids) >= 6 and kept.token_ids == plain.token_ids[:len(kept.token_ids)]
    assert kept.text.startswith(plain.text[:plain.text.index(stop)]) and stop in kept.text


def test_logprobs_sync_async_and_streamed_agree(client, address):
    """Typed logprobs: one per token, the same through GenerateOnce, the stream and asyncio;
    none unless asked."""
    options = dict(max_new_tokens=16, logprobs=2, timeout=TIMEOUT)
    once = client.generate(PROMPT, **options)
    *deltas, streamed = client.stream(PROMPT, **options)

    async def async_once():
        async with AsyncGenerationClient(address, api_key=API_KEY) as c:
            return await c.generate(PROMPT, **options)

    assert len(once.logprobs) == len(once.token_ids) == 16
    assert [t.token_id for t in once.logprobs] == list(once.token_ids)
    assert all(len(t.top) == 2 and t.logprob <= 0 for t in once.logprobs)
    assert streamed.logprobs == tuple(t for d in deltas for t in d.logprobs) == once.logprobs
    assert run_async(async_once()).logprobs == once.logprobs
    assert client.generate(PROMPT, max_new_tokens=4, timeout=TIMEOUT).logprobs is None


def test_cli_prints_logprobs(address, capsys):
    client_cli.main(["--server", address, "--api-key", API_KEY, "--max-new-tokens", "6", "--logprobs", "1", "--json",
                     PROMPT])
    out = json.loads(capsys.readouterr().out)
    assert [t["token"] for t in out["logprobs"]] == out["tokens"] and all(len(t["top"]) == 1 for t in out["logprobs"])
    client_cli.main(["--server", address, "--api-key", API_KEY, "--max-new-tokens", "6", "--logprobs", "1", PROMPT])
    table = capsys.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(table) if line.split()[:2] == ["token", "logprob"])
    assert [int(line.split()[0]) for line in table[first + 1:]] == out["tokens"]


def test_build_request_sets_only_what_is_given():
    req = build_request(PROMPT)
    assert req.WhichOneof("prompt") == "text" and not req.HasField("max_new_tokens")
    assert not req.sampling.HasField("temperature") and not req.HasField("tree_budget")
    req = build_request(messages=[ChatMessage("system", "Be brief."), {"role": "user", "content": "hi"},
                                  ("assistant", "ok")], template_kwargs={"enable_thinking": False},
                        add_generation_prompt=False, stop="END", tree_budget=0, seed=3)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief."), ("user", "hi"),
                                                                ("assistant", "ok")]
    assert dict(req.chat.template_kwargs) == {"enable_thinking": "false"}
    assert req.chat.add_generation_prompt is False and list(req.stop) == ["END"]
    assert req.HasField("tree_budget") and req.tree_budget == 0 and req.sampling.seed == 3
    assert not req.ignore_eos and build_request(PROMPT, ignore_eos=True).ignore_eos
    assert req.min_tokens == 0
    assert build_request(PROMPT, min_tokens=5).min_tokens == 5


# -- cancellation ----------------------------------------------------------------------------

def test_closing_a_stream_frees_the_verifier_session(client, verifier_stub):
    wait_full(verifier_stub)
    stream = client.stream(PROMPT, timeout=TIMEOUT, **LONG)
    first = next(stream)
    assert isinstance(first, GenerationDelta)
    assert free_sessions(verifier_stub) == MAX_SESSIONS - 1
    stream.close()
    wait_full(verifier_stub)


def test_cancelling_async_calls_frees_the_verifier_session(address, verifier_stub):
    wait_full(verifier_stub)

    async def cancel_both() -> bool:
        async with AsyncGenerationClient(address, api_key=API_KEY) as c:
            # A unary call: cancel its task while its session is open on the verifier.
            task = asyncio.ensure_future(c.generate(PROMPT, timeout=TIMEOUT, **LONG))
            while free_sessions(verifier_stub) == MAX_SESSIONS and not task.done():
                await asyncio.sleep(0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            cancelled = task.cancelled()
            await asyncio.to_thread(wait_full, verifier_stub)
            # A stream: left after its first delta (aclosing closes it, which cancels the call).
            async with contextlib.aclosing(c.stream(PROMPT, timeout=TIMEOUT, **LONG)) as stream:
                async for item in stream:
                    assert isinstance(item, GenerationDelta)
                    assert free_sessions(verifier_stub) == MAX_SESSIONS - 1
                    break
            return cancelled

    assert run_async(cancel_both())
    wait_full(verifier_stub)


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("options, needle", [
    (dict(prompt=PROMPT, top_p=1.5), "top_p"),
    (dict(token_ids=[1, 2, 10**9]), "outside the vocabulary"),
    (dict(token_ids=[]), "empty"),
    (dict(messages=[{"role": "user", "content": "hi"}]), "template"),  # the shipped target has no chat template
])
def test_bad_requests_raise_invalid_argument(client, address, options, needle):
    with pytest.raises(GenerationError) as caught:
        client.generate(timeout=TIMEOUT, **options)
    assert caught.value.code == "INVALID_ARGUMENT" and needle in caught.value.message
    with pytest.raises(GenerationError) as caught:
        list(client.stream(timeout=TIMEOUT, **options))
    assert caught.value.code == "INVALID_ARGUMENT" and needle in caught.value.message

    async def via_async():
        async with AsyncGenerationClient(address, api_key=API_KEY) as c:
            with pytest.raises(GenerationError) as caught:
                await c.generate(timeout=TIMEOUT, **options)
            return caught.value

    error = run_async(via_async())
    assert error.code == "INVALID_ARGUMENT" and needle in error.message


@pytest.mark.parametrize("options", [
    dict(),                                          # no prompt
    dict(prompt="a", token_ids=[1]),                 # two prompts
    dict(prompt="a", max_new_tokens=-1),             # not a uint32
    dict(prompt="a", top_k="many"),                  # not a number
    dict(token_ids=[1], template_kwargs={"a": "b"}),  # chat options without a chat
    dict(messages=[{"role": "user"}]),               # no content
])
def test_requests_that_cannot_be_built_raise_before_sending(options):
    with pytest.raises(GenerationError) as caught:
        build_request(**options)
    assert caught.value.code == "INVALID_ARGUMENT"


def test_missing_or_wrong_api_key_is_unauthenticated(address):
    for key in ("", "wrong"):
        with GenerationClient(address, api_key=key) as c, pytest.raises(GenerationError) as caught:
            c.generate(PROMPT, timeout=TIMEOUT)
        assert caught.value.code == "UNAUTHENTICATED"


def test_unreachable_server_is_unavailable():
    with GenerationClient("127.0.0.1:1") as c, pytest.raises(GenerationError) as caught:
        c.generate(PROMPT, timeout=TIMEOUT)
    assert caught.value.code == "UNAVAILABLE"


def test_tls_settings_are_checked_at_construction(tmp_path):
    with pytest.raises(TlsError, match="need --ca"):
        GenerationClient("127.0.0.1:1", cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"))
    with pytest.raises(TlsError, match="cannot read"):
        AsyncGenerationClient("127.0.0.1:1", ca=str(tmp_path / "missing.pem"))


# -- the command-line client ------------------------------------------------------------------

def test_cli_stats_table_matches_the_result(address, capsys):
    client_cli.main(["--server", address, "--api-key", API_KEY, "--max-new-tokens", "20", "--stats", "--json",
                     PROMPT])
    out = json.loads(capsys.readouterr().out)
    rows = out["per_round"]
    assert [r["round"] for r in rows] == list(range(out["rounds"] + 1))
    assert [r["emitted"] for r in rows[1:]] == out["acceptance_lengths"] and rows[0]["emitted"] == 1
    assert sum(r["delivered"] for r in rows) == out["completion_tokens"] == len(out["tokens"])
    assert "".join(r["text"] for r in rows) == out["text"]
    # Every verify round says where its time went; the prefill's round has no such split.
    assert rows[0]["verify_ms"] is None and out["rounds"] >= 1
    for r in rows[1:]:
        assert r["nodes"] >= r["emitted"] >= 1
        assert r["verify_ms"] > 0 and r["network_ms"] >= 0
        assert (r["draft_ms"] > 0 and r["build_ms"] > 0) if r["nodes"] > 1 else r["draft_ms"] == r["build_ms"] == 0
    client_cli.main(["--server", address, "--api-key", API_KEY, "--max-new-tokens", "20", "--stats", PROMPT])
    captured = capsys.readouterr()
    assert captured.out.strip() == out["text"].strip()
    table = captured.err.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("# per round"))
    assert table[header + 1].split()[:7] == ["round", "emitted", "nodes", "draft", "build", "network", "verify"]
    assert len(table) - header - 2 == out["rounds"] + 1


def test_cli_errors_are_one_line(address, capsys):
    with pytest.raises(SystemExit) as caught:
        client_cli.main(["--server", address, "--api-key", API_KEY, "--top-p", "2", PROMPT])
    assert caught.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: INVALID_ARGUMENT: top_p") and len(err.splitlines()) == 1


# -- the drafter's logs ----------------------------------------------------------------------

def test_start_up_summaries(drafter, records):
    lines = [r.getMessage() for r in records.records]
    verifier = next(line for line in lines if line.startswith("verifier ready on"))
    assert "device cpu, dtype float32" in verifier and f"KV {MAX_SESSIONS} sessions x 256 tokens" in verifier
    assert "0 verify CUDA graphs (eager)" in verifier and "RSS " in verifier
    drafter_line = next(line for line in lines if line.startswith("drafter ready on"))
    assert f"{MAX_SESSIONS} draft context slots" in drafter_line and "0 draft CUDA graphs" in drafter_line
    assert "HTTP on 127.0.0.1:" in drafter_line and "RSS " in drafter_line


def test_one_log_line_per_request_over_grpc_and_http(client, drafter, records):
    before = len(records.requests())
    result = client.generate(PROMPT, max_new_tokens=16, timeout=TIMEOUT)
    with pytest.raises(GenerationError):
        client.generate(PROMPT, top_p=1.5, timeout=TIMEOUT)
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 8}).encode()
    http = urllib.request.Request(f"http://127.0.0.1:{drafter.server.http_port}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(http, timeout=TIMEOUT) as reply:
        completion = json.loads(reply.read())
    # The line is written when the handler's generator closes, just after the reply went out.
    wait_until(lambda: len(records.requests()) >= before + 3, "three request lines")
    ok, bad, over_http = records.requests()[before:before + 3]
    assert (ok.api, ok.status, ok.finish_reason) == ("grpc", "OK", "length")
    assert (ok.prompt_tokens, ok.completion_tokens, ok.rounds) == (result.prompt_tokens, result.completion_tokens,
                                                                   result.rounds)
    assert ok.mean_acceptance == pytest.approx(result.mean_acceptance) and ok.latency_s > 0
    assert ok.request_id in ok.getMessage() and "16 completion tokens" in ok.getMessage()
    assert (bad.status, bad.completion_tokens, bad.levelno) == ("INVALID_ARGUMENT", 0, logging.INFO)
    assert "top_p" in bad.getMessage()
    assert (over_http.api, over_http.status) == ("http", "OK")
    assert over_http.completion_tokens == completion["usage"]["completion_tokens"] == 8
    assert len({ok.request_id, bad.request_id, over_http.request_id}) == 3


def test_a_cancelled_request_logs_what_it_delivered(client, verifier_stub, records):
    wait_full(verifier_stub)
    before = len(records.requests())
    stream = client.stream(PROMPT, timeout=TIMEOUT, **LONG)
    delivered = len(next(stream).token_ids)
    stream.close()
    wait_until(lambda: len(records.requests()) > before, "the cancelled request's line")
    line = records.requests()[before]
    assert line.status == "CANCELLED" and line.mean_acceptance is None
    assert line.completion_tokens >= delivered
    wait_full(verifier_stub)


@pytest.mark.parametrize("options, needle", [
    (dict(max_new_tokens=-1), "max_new_tokens: "),
    (dict(max_new_tokens=1 << 40), "max_new_tokens: "),
    (dict(seed=-1), "seed: "),
    (dict(logprobs=-1), "logprobs: "),
    (dict(tree_budget=-1), "tree_budget: "),
    (dict(top_k="many"), "top_k: "),
])
def test_values_the_request_cannot_hold_name_their_field(options, needle):
    """protobuf's own message ("Value out of range: -1") does not say which argument was wrong."""
    from drafter_svc.client_lib import build_request

    with pytest.raises(GenerationError) as caught:
        build_request(PROMPT, **options)
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.message.startswith(needle), caught.value.message
