"""Both services against hostile or careless peers: a busy port fails start-up, inbound
messages are capped, malformed bytes get INVALID_ARGUMENT with one line and no traceback,
and a long prompt is tokenised off the event loop, after a byte-length check."""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from tokenizers import Tokenizer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import load_draft_config
from common.grpc_server import MIB, check_bindable
from common.protocol import ContextTooLong
from common.rpc import GENERATION_SERVICE, VERIFIER_SERVICE, pb, pb_grpc
from drafter_svc.chat import ChatTemplate
from drafter_svc.server import DrafterConfig, DrafterEngine, longest_token_bytes
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

MAX_PROMPT_BYTES = 4096
SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "default" / "target" / "tokenizer.json"
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}  # what a fuzzed message may get


def verifier_config(pair, **changes) -> VerifierConfig:
    fields = dict(target_dir=str(pair[0]), feature_layer_ids=load_draft_config(pair[1]).target_layer_ids,
                  projection_dir=str(pair[1]), host="127.0.0.1", port=0, max_sessions=4, max_seq_len=128,
                  max_tree_nodes=17, max_message_mb=1)
    return VerifierConfig(**(fields | changes))


def drafter_config(pair, verifier_port: int) -> DrafterConfig:
    return DrafterConfig(draft_dir=str(pair[1]), target_dir=str(pair[0]), verifier=f"127.0.0.1:{verifier_port}",
                         host="127.0.0.1", port=0, tree_budget=4, max_new_tokens=4, verifier_wait_s=10,
                         max_message_mb=1, max_prompt_bytes=MAX_PROMPT_BYTES)


@pytest.fixture(scope="module")
def verifier(qwen3_pair):
    with ServerThread(lambda: serve_verifier(verifier_config(qwen3_pair))) as running:
        yield running


@pytest.fixture(scope="module")
def drafter(qwen3_pair, verifier):
    engine = DrafterEngine.start(drafter_config(qwen3_pair, verifier.port), torch.float32)
    with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as running:
        yield running


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO)
    return caplog


def assert_no_traceback(caplog) -> None:
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def assert_one_line_status(exc: grpc.RpcError, code: grpc.StatusCode, needle: str) -> None:
    assert exc.code() == code, (exc.code(), exc.details())
    assert needle in exc.details() and "\n" not in exc.details(), exc.details()


# Raw bytes on a real channel: no serializers, so garbage reaches the server as it is.
def raw_link(channel: grpc.Channel, messages: list[bytes], timeout: float = 10) -> list[bytes]:
    call = channel.stream_stream(f"/{VERIFIER_SERVICE}/Link")
    return list(call(iter(messages), timeout=timeout))


def raw_unary(channel: grpc.Channel, service: str, method: str, data: bytes, timeout: float = 10) -> bytes:
    return channel.unary_unary(f"/{service}/{method}")(data, timeout=timeout)


def raw_generate(channel: grpc.Channel, data: bytes, timeout: float = 10) -> list[bytes]:
    return list(channel.unary_stream(f"/{GENERATION_SERVICE}/Generate")(data, timeout=timeout))


def serving(channel: grpc.Channel, timeout: float = 5) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def generate_once(channel: grpc.Channel, req: pb.GenerateRequest, timeout: float = 60) -> pb.GenerateOnceResponse:
    return pb_grpc.GenerationStub(channel).GenerateOnce(req, timeout=timeout)


def token_request(ids=(5, 17, 42)) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(ids)), max_new_tokens=4)


def utf8_broken(req: pb.GenerateRequest, marker: str) -> bytes:
    """The request's bytes with `marker` (in a string field) replaced by invalid UTF-8 of its length."""
    data = req.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), b"\xff\xfe" + b"x" * (len(marker) - 2))


# -- 1. a busy port ---------------------------------------------------------------------------


def test_second_server_on_a_busy_port_fails_and_the_first_serves_on(qwen3_pair, verifier, drafter,
                                                                    verifier_channel, drafter_channel):
    address = f"127.0.0.1:{verifier.port}"
    with pytest.raises(OSError, match=f"cannot listen on {address}"):
        verifier.call(serve_verifier(verifier_config(qwen3_pair, port=verifier.port)), timeout=60)
    engine = DrafterEngine.start(drafter_config(qwen3_pair, verifier.port), torch.float32)
    stopped, stop = [], engine.stop
    engine.stop = lambda: (stopped.append(True), stop())
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{drafter.port}"):
        drafter.call(serve_drafter(engine, "127.0.0.1", drafter.port), timeout=60)
    assert stopped  # the engine that found no port is not left running
    assert serving(verifier_channel) and serving(drafter_channel)
    assert pb_grpc.VerifierStub(verifier_channel).Info(pb.InfoRequest(), timeout=10).max_sessions == 4
    assert len(generate_once(drafter_channel, token_request()).token_ids) == 4


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=180)


def test_clis_on_a_busy_port_exit_with_one_line(qwen3_pair, verifier, verifier_channel):
    target, draft = str(qwen3_pair[0]), str(qwen3_pair[1])
    busy = str(verifier.port)
    for args in (("verifier_svc", "--target", target, "--host", "127.0.0.1", "--port", busy),
                 ("drafter_svc", "--target", target, "--draft", draft, "--device", "cpu", "--host", "127.0.0.1",
                  "--port", busy, "--verifier", f"127.0.0.1:{busy}", "--verifier-wait", "10")):
        r = run_cli(*args)
        assert r.returncode != 0, r.stderr
        assert f"error: cannot listen on 127.0.0.1:{busy}: address already in use" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "add_port" not in r.stderr, r.stderr  # no gRPC log line either
        assert r.stderr.strip().splitlines()[-1].startswith("error: cannot listen on")
    assert serving(verifier_channel)


def test_the_bind_check_names_the_reason():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"^cannot listen on 127.0.0.1:{port}: address already in use$"):
            check_bindable("127.0.0.1", port)
        with pytest.raises(OSError, match=f"^cannot listen on 192.0.2.1:{port}: cannot assign requested address$"):
            check_bindable("192.0.2.1", port)  # TEST-NET-1: no address of this host
    check_bindable("127.0.0.1", port)  # free again
    check_bindable("127.0.0.1", 0)  # any free port: nothing to check


# -- 2. message-size caps -----------------------------------------------------------------------


def test_verifier_cap_follows_the_limits():
    config = VerifierConfig(target_dir="t", max_sessions=8, max_seq_len=2048, max_tree_nodes=1025)
    assert config.max_receive_bytes() == 2 * MIB >= config.link_message_bytes()
    assert VerifierConfig(target_dir="t", max_message_mb=64).max_receive_bytes() == 64 * MIB
    for bad, needle in ((-1, ">= 0"), (1, "is below the")):
        with pytest.raises(ValueError, match=needle):
            VerifierConfig(target_dir="t", max_seq_len=1 << 20, max_message_mb=bad).check()


def test_oversize_link_message_is_resource_exhausted(verifier_channel, drafter_channel, log):
    big = pb.LinkRequest(step=1, tree_tokens=pb.PackedInts(data=b"\0" * (MIB + 1), width=1)).SerializeToString()
    exc = rpc_error(lambda: raw_link(verifier_channel, [big]))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
    exc = rpc_error(lambda: raw_unary(verifier_channel, VERIFIER_SERVICE, "Info", b"\0" * (MIB + 1)))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert serving(verifier_channel)
    assert len(generate_once(drafter_channel, token_request()).token_ids) == 4  # the drafter's own link is intact
    assert_no_traceback(log)


def test_oversize_request_is_resource_exhausted(drafter_channel, log):
    huge = token_request(ids=[7] * (MIB + 1))  # a byte per token id at least
    exc = rpc_error(lambda: generate_once(drafter_channel, huge))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
    assert serving(drafter_channel)
    assert len(generate_once(drafter_channel, token_request()).token_ids) == 4
    assert_no_traceback(log)


# -- 3. malformed input -------------------------------------------------------------------------


def test_malformed_link_message_is_invalid_argument(verifier_channel, log):
    exc = rpc_error(lambda: raw_link(verifier_channel, [b"\xff\xff\xff\xff"]))
    assert_one_line_status(exc, grpc.StatusCode.INVALID_ARGUMENT, "malformed LinkRequest")
    exc = rpc_error(lambda: raw_unary(verifier_channel, VERIFIER_SERVICE, "Info", b"\x0a\xff"))
    assert_one_line_status(exc, grpc.StatusCode.INVALID_ARGUMENT, "malformed InfoRequest")
    assert_no_traceback(log)
    closed = [r.getMessage() for r in log.records if "INVALID_ARGUMENT: bad link message" in r.getMessage()]
    assert closed and all("\n" not in m for m in closed)


def test_fuzzed_link_messages_get_clean_statuses(verifier_channel, log):
    rng = random.Random(0)
    valid = pb.LinkRequest(step=1, entries=[pb.SessionEntry(session_id=1, open=pb.Open(prompt_token_ids=[5, 6, 7]))],
                           tree_tokens=pb.PackedInts(data=b"\1\2", width=1)).SerializeToString()
    codes = set()
    for i in range(150):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            flipped = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            data = bytes(flipped)
        try:
            raw_link(verifier_channel, [data])
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.add(exc.code())
            assert "\n" not in exc.details()
    assert codes <= CLEAN and grpc.StatusCode.INVALID_ARGUMENT in codes, codes
    assert serving(verifier_channel)
    assert_no_traceback(log)


@pytest.mark.parametrize("case", ["text", "chat", "stop", "garbage"])
def test_malformed_request_is_invalid_argument(drafter_channel, log, case):
    if case == "text":
        data = utf8_broken(pb.GenerateRequest(text="MARKER-TEXT"), "MARKER-TEXT")
    elif case == "chat":
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="MARKER-CHAT")])
        data = utf8_broken(pb.GenerateRequest(chat=chat), "MARKER-CHAT")
    elif case == "stop":
        data = utf8_broken(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5]), stop=["MARKER-STOP"]), "MARKER-STOP")
    else:
        data = b"\x0a\xff\xff\xff\xff"
    needle = "malformed GenerateRequest"
    assert_one_line_status(rpc_error(lambda: raw_generate(drafter_channel, data)), grpc.StatusCode.INVALID_ARGUMENT,
                           needle)
    exc = rpc_error(lambda: raw_unary(drafter_channel, GENERATION_SERVICE, "GenerateOnce", data))
    assert_one_line_status(exc, grpc.StatusCode.INVALID_ARGUMENT, needle)
    assert_no_traceback(log)


def test_fuzzed_requests_get_clean_statuses(drafter_channel, log):
    rng = random.Random(1)
    valid = pb.GenerateRequest(text="hello world", max_new_tokens=2, stop=["x"]).SerializeToString()
    codes = set()
    for _ in range(100):
        flipped = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        try:
            raw_unary(drafter_channel, GENERATION_SERVICE, "GenerateOnce", bytes(flipped), timeout=30)
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.add(exc.code())
            assert "\n" not in exc.details()
    assert codes <= CLEAN and grpc.StatusCode.INVALID_ARGUMENT in codes, codes
    assert_no_traceback(log)


# -- 4. tokenising off the event loop -----------------------------------------------------------


class GatedTokenizer:
    """The engine's tokenizer, its `encode_batch` held until `release` and its calls recorded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.threads = tokenizer, []
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode_batch(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        self.entered.set()
        assert self.gate.wait(30)
        return self.tokenizer.encode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def gated(drafter, monkeypatch):
    engine = drafter.server.engine
    tokenizer = GatedTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)
    yield tokenizer
    tokenizer.gate.set()


def test_health_answers_while_a_prompt_is_tokenised(drafter, drafter_channel, gated):
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate_once, drafter_channel, pb.GenerateRequest(text="hello world", max_new_tokens=4))
        assert gated.entered.wait(10), "the prompt was not tokenised"
        started = time.monotonic()
        assert serving(drafter_channel, timeout=5)
        assert time.monotonic() - started < 2 and not pending.done()
        gated.gate.set()
        assert len(pending.result(60).token_ids) == 4
    assert gated.threads and all(t is not drafter._thread for t in gated.threads)


def test_tokenising_lets_the_event_loop_run():
    """The shipped byte-level BPE tokenizer's `encode` holds the interpreter lock for its whole
    run, so a long prompt tokenised in a worker thread would still stall every stream and health
    check on the event loop; the engine's tokenize must let go of it."""
    tokenizer = Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    stand_in = SimpleNamespace(cfg=SimpleNamespace(max_prompt_bytes=1 << 21), tokenizer=tokenizer, longest_token_bytes=0)
    text = "x " * 400_000

    async def tokenise_beside_a_heartbeat() -> tuple[float, float]:
        done, gaps = asyncio.Event(), [0.0]

        async def beat():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()
        beating = asyncio.create_task(beat())
        await asyncio.sleep(0.02)  # the heartbeat runs before the tokeniser starts
        started = time.perf_counter()
        ids = await asyncio.to_thread(DrafterEngine.tokenize, stand_in, text)
        took = time.perf_counter() - started
        done.set()
        await beating
        assert len(ids) >= 400_000
        return took, max(gaps)
    took, worst_gap = asyncio.run(tokenise_beside_a_heartbeat())
    assert worst_gap < took / 2, (worst_gap, took)  # `encode` itself: one gap of the whole run


def test_a_text_too_long_for_any_tokenisation_is_refused_before_tokenising():
    """Past (max_seq_len - 1) x the longest token's bytes x 4 a text cannot fit the context,
    however it tokenises: ContextTooLong at once, not after seconds of tokenising; below, the
    tokenizer decides."""
    tokenizer = Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    longest = longest_token_bytes(tokenizer)
    assert longest >= max(len(tokenizer.decode([i]).encode()) for i in range(tokenizer.get_vocab_size()))
    stand_in = SimpleNamespace(cfg=SimpleNamespace(max_prompt_bytes=1 << 24), tokenizer=tokenizer,
                               longest_token_bytes=longest, info=SimpleNamespace(max_seq_len=64))
    bound = 4 * 63 * longest
    with pytest.raises(ContextTooLong, match=f"prompt of {bound + 1} bytes cannot fit the verifier's max_seq_len 64"):
        DrafterEngine.tokenize(stand_in, "x" * (bound + 1))
    assert len(DrafterEngine.tokenize(stand_in, "x" * bound)) > 0


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prompt_past_max_prompt_bytes_is_refused_before_tokenising(drafter, drafter_channel, gated, monkeypatch,
                                                                   kind):
    if kind == "text":
        req = pb.GenerateRequest(text="é" * (MAX_PROMPT_BYTES // 2 + 1))  # 2 bytes per character
        size = MAX_PROMPT_BYTES + 2
    else:
        monkeypatch.setattr(drafter.server.engine, "chat_template",
                            ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}))
        req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="a" * MAX_PROMPT_BYTES),
                                                        pb.ChatMessage(role="user", content="b")]))
        size = MAX_PROMPT_BYTES + 1  # the rendered text
    started = time.monotonic()
    exc = rpc_error(lambda: generate_once(drafter_channel, req))
    assert_one_line_status(exc, grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt of {size} bytes exceeds the server's limit of {MAX_PROMPT_BYTES} bytes")
    assert time.monotonic() - started < 5 and not gated.threads


@pytest.mark.parametrize("module, args, needle", [
    ("drafter_svc", ["--max-message-mb", "0"], "--max-message-mb and --max-prompt-bytes must be >= 1"),
    ("drafter_svc", ["--max-prompt-bytes", "x"], "--max-prompt-bytes"),
    ("verifier_svc", ["--max-message-mb", "-1"], "max_message_mb must be >= 0"),
])
def test_bad_limit_flags_exit_with_one_line(qwen3_pair, module, args, needle):
    target, draft = str(qwen3_pair[0]), str(qwen3_pair[1])
    base = ["--target", target] + (["--draft", draft] if module == "drafter_svc" else [])
    r = run_cli(module, *base, *args)
    assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
