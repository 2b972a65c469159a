"""Logging and console tracing of the services: levels and formats (JSON lines with the records'
fields), their flags and env fallbacks, one compact line per span, the verifier's start-up
summary from its real entry point, and the drafter's progress while it waits for its verifier."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from common.logs import memory_summary, resident_bytes, setup_logging
from common.protocol import StatusError
from common.tracing import CompactSpanExporter

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "default"


@pytest.fixture
def root_logger():
    """The root logger, restored after the test (setup_logging replaces its handler and level)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_time_level_logger_message_and_extra_fields(root_logger):
    out = io.StringIO()
    setup_logging("info", "JSON", stream=out)
    log = logging.getLogger("drafter_svc.test")
    log.debug("not written")
    log.info("request %s done", "abc", extra={"request_id": "abc", "completion_tokens": 12, "path": Path("/x")})
    try:
        raise ValueError("boom")
    except ValueError:
        log.error("failed", exc_info=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert {"time", "level", "logger", "message"} <= set(first)
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "drafter_svc.test", "request abc done")
    assert (first["request_id"], first["completion_tokens"], first["path"]) == ("abc", 12, "/x")
    assert first["time"].endswith("+00:00") and "T" in first["time"]
    assert "lineno" not in first and "args" not in first  # LogRecord's own attributes are not fields
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_text_lines_and_levels(root_logger):
    out = io.StringIO()
    setup_logging("WARNING", "text", stream=out)
    setup_logging("WARNING", "text", stream=out)  # a second call replaces the handler: no doubled lines
    log = logging.getLogger("verifier_svc.test")
    log.info("quiet")
    log.warning("loud %d", 3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("WARNING verifier_svc.test: loud 3")
    for level, fmt in (("LOUD", "text"), ("INFO", "xml")):
        with pytest.raises(ValueError):
            setup_logging(level, fmt, stream=out)


def test_log_flags_and_environment_fallbacks(monkeypatch, capsys):
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    cfg = drafter_cli.parse_args(["--draft", "d", "--target", "t"])
    assert (cfg.log_level, cfg.log_format) == ("INFO", "text")
    cfg = drafter_cli.parse_args(["--draft", "d", "--target", "t", "--log-level", "debug", "--log-format", "json"])
    assert (cfg.log_level, cfg.log_format) == ("DEBUG", "json")
    monkeypatch.setenv("DRAFTER_LOG_LEVEL", "error")
    monkeypatch.setenv("VERIFIER_LOG_FORMAT", "json")
    monkeypatch.setenv("VERIFIER_LOG_LEVEL", "WARNING")
    assert drafter_cli.parse_args(["--draft", "d", "--target", "t"]).log_level == "ERROR"
    cfg = verifier_cli.parse_config(["--target", "t", "--device", "cpu"])
    assert (cfg.log_level, cfg.log_format) == ("WARNING", "json")
    for argv in (["--log-level", "loud"], ["--log-format", "xml"]):
        with pytest.raises(SystemExit):
            verifier_cli.parse_config(["--target", "t", "--device", "cpu", *argv])
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and len(err.splitlines()) == 1


def test_memory_summary_on_cpu():
    assert resident_bytes() > 1 << 20
    assert memory_summary("cpu").startswith("RSS ") and memory_summary("cpu").endswith(" MiB")


# -- console tracing -------------------------------------------------------------------------

def test_compact_span_lines():
    out = io.StringIO()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(CompactSpanExporter(out)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("round", attributes={"tree.nodes": 17, "accepted": 3, "ratio": 0.123456,
                                                           "ids": [1, 2, 3], "text": "x" * 100}) as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
    with tracer.start_as_current_span("verify", attributes={f"a{i}": i for i in range(9)}) as span:
        span.set_status(Status(StatusCode.ERROR, "bad tree"))
    provider.shutdown()
    first, second = out.getvalue().splitlines()
    word, name, duration, unit, trace, prefix, *attributes = first.split()
    assert (word, name, unit, trace, prefix) == ("span", "round", "ms", "trace", trace_id[:8])
    assert float(duration) >= 0
    assert attributes[:4] == ["tree.nodes=17", "accepted=3", "ratio=0.1235", "ids=1,2,3"]
    assert attributes[4].startswith("text=xxx") and attributes[4].endswith("...") and len(attributes[4]) == 45
    assert second.startswith("span verify ") and "ERROR (bad tree)" in second
    assert "a5=5" in second and "a6=6" not in second and second.endswith("(+3 attributes)")


def run_probe(probe: str) -> list[str]:
    """The lines a Python snippet prints in a process of its own, without the OTEL_ environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_trace_console_prints_one_line_per_span():
    """setup_tracing(console=True), as --trace-console calls it, writes compact lines to stdout."""
    probe = ("from common.tracing import setup_tracing, shutdown_tracing, tracer\n"
             "setup_tracing('probe', console=True)\n"
             "with tracer('t').start_as_current_span('generate', attributes={'prompt.tokens': 9}):\n"
             "    with tracer('t').start_as_current_span('round', attributes={'tree.nodes': 5}):\n"
             "        pass\n"
             "shutdown_tracing()\n")
    lines = run_probe(probe)
    assert len(lines) == 2  # the inner span ends first
    assert lines[0].startswith("span round ") and lines[0].endswith("tree.nodes=5")
    assert lines[1].startswith("span generate ") and lines[1].endswith("prompt.tokens=9")
    assert lines[0].split()[5] == lines[1].split()[5]  # one trace


def test_current_span_records_only_once_tracing_is_set_up():
    """The services' per-step spans (`current_span`, `use_span`) do nothing until a provider is
    installed, then record under the current span as start_as_current_span and use_span do."""
    probe = ("from opentelemetry import trace\n"
             "from common.tracing import current_span, setup_tracing, shutdown_tracing, tracer, use_span\n"
             "with current_span(tracer('t'), 'early') as span:\n"
             "    assert not span.is_recording() and not trace.get_current_span().is_recording()\n"
             "with use_span(tracer('t').start_span('early step'), end_on_exit=True):\n"
             "    assert not trace.get_current_span().is_recording()\n"
             "setup_tracing('probe', console=True)\n"
             "step = tracer('t').start_span('step')\n"
             "with use_span(step, end_on_exit=True):\n"
             "    with current_span(tracer('t'), 'stage') as span:\n"
             "        assert span.is_recording() and trace.get_current_span() is span\n"
             "shutdown_tracing()\n")
    lines = run_probe(probe)
    assert [line.split()[1] for line in lines] == ["stage", "step"]
    assert lines[0].split()[5] == lines[1].split()[5]  # the stage in the step's trace


# -- the services' start-up ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def verifier_process(log_file: Path, *extra: str):
    """`python -m verifier_svc` on the shipped pair (CPU, port 0), its stderr to `log_file`; yields
    (the process, its address) once it listens and handles SIGTERM; killed if still running."""
    args = [sys.executable, "-m", "verifier_svc", "--target", str(SHIPPED / "target"), "--draft",
            str(SHIPPED / "draft"), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--max-sessions", "2",
            "--max-seq-len", "128", *extra]
    with open(log_file, "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        listening = proc.stdout.readline()  # '' if it died
        assert listening.startswith("verifier listening on 127.0.0.1:"), log_file.read_text()
        yield proc, listening.split()[3].rstrip(",")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_verifier_main_logs_a_json_start_up_summary(tmp_path):
    """`python -m verifier_svc --log-format json` writes JSON lines, the ready summary among them."""
    log_file = tmp_path / "stderr.log"
    with verifier_process(log_file, "--log-format", "json") as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    records = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
    ready = next(r for r in records if r["message"].startswith("verifier ready on"))
    assert ready["level"] == "INFO" and ready["logger"] == "verifier_svc.server"
    assert "device cpu, dtype float32, KV 2 sessions x 128 tokens" in ready["message"]
    assert "verify CUDA graphs" in ready["message"] and "RSS " in ready["message"]
    assert any(r["message"].startswith("shutting down") for r in records)


def test_verifier_sigterm_drains_its_sessions_and_a_second_cuts_them(tmp_path):
    """SIGTERM: the verifier process keeps serving an open session (Info says `draining`), and a
    second SIGTERM ends the drain at once instead of after the 25 s grace."""
    import grpc

    from common.config import load_draft_config
    from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
    from tests.test_verifier_server import LinkStream, opening

    log_file = tmp_path / "stderr.log"
    with verifier_process(log_file) as (proc, address):
        layers = load_draft_config(SHIPPED / "draft").target_layer_ids
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.VerifierStub(channel)
            with LinkStream(stub) as link:
                (opened,) = link.send([opening(1, layers, prompt=[5, 6, 7])]).results
                assert opened.WhichOneof("kind") == "prefilled"
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while not stub.Info(pb.InfoRequest(), timeout=5).draining:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=15) == 0
    said = log_file.read_text()
    assert "draining: 1 sessions open" in said and "a second signal came with 1 sessions open" in said, said
    assert "Traceback" not in said, said


def test_drafter_reports_progress_while_it_waits_for_the_verifier(caplog):
    from drafter_svc.server import DrafterConfig, DrafterEngine

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = DrafterConfig(draft_dir=str(SHIPPED / "draft"), target_dir=str(SHIPPED / "target"), verifier=address,
                        host="127.0.0.1", port=0, verifier_wait_s=6)
    with caplog.at_level(logging.INFO, logger="drafter_svc"), pytest.raises(StatusError) as caught:
        DrafterEngine.start(cfg, torch.float32)
    assert caught.value.status == "UNAVAILABLE"
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the verifier")]
    assert waiting and all(m.startswith(f"waiting for the verifier at {address} (") and m.endswith(" of 6)")
                           for m in waiting)
