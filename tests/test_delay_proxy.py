"""The delay proxy relays bytes exactly, adds its delay once per direction (not once per chunk),
carries real gRPC calls, and closes its connections when it closes."""
from __future__ import annotations

import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.delay_proxy import start_delay_proxy

ROOT = Path(__file__).resolve().parents[1]


class EchoServer:
    """A threaded TCP echo server that records each connection's bytes and when it ended."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytearray] = []
        self.ended: list[threading.Event] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            got, ended = bytearray(), threading.Event()
            self.received.append(got)
            self.ended.append(ended)
            threading.Thread(target=self._echo, args=(conn, got, ended), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket, got: bytearray, ended: threading.Event) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    got += data
                    conn.sendall(data)
            except OSError:
                pass
        ended.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        assert data, f"connection ended after {len(out)} of {n} bytes"
        out += data
    return bytes(out)


def recv_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while data := sock.recv(1 << 16):
        out += data
    return bytes(out)


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_bytes_pass_intact_both_ways_and_half_close_ends_the_connection(echo):
    rng = random.Random(0)
    sizes = [rng.choice([1, 2, 7, 100, 1500, 65536, 300_000]) for _ in range(200)]
    chunks = [rng.randbytes(n) for n in sizes]
    payload = b"".join(chunks)
    with start_delay_proxy("127.0.0.1", echo.port, delay_ms=1) as proxy, connect(proxy.port) as sock:

        def send() -> None:
            for chunk in chunks:
                sock.sendall(chunk)
                if rng.random() < 0.1:
                    time.sleep(0.001)  # some chunks alone, most back to back
            sock.shutdown(socket.SHUT_WR)  # half-close: the echo ends, then the proxy closes us

        sender = threading.Thread(target=send)
        sender.start()
        back = recv_all(sock)  # returns at the end of stream, which must come after every byte
        sender.join(10)
        assert len(back) == len(payload) and back == payload  # target -> client
        assert echo.ended[0].wait(5)
        assert bytes(echo.received[0]) == payload  # client -> target
        assert len(echo.received) == 1
        assert wait_until(lambda: proxy.connections == 0)  # nothing left open once both sides ended


def test_a_round_trip_takes_twice_the_delay(echo):
    delay_ms = 20
    with start_delay_proxy("127.0.0.1", echo.port, delay_ms=delay_ms) as proxy, connect(proxy.port) as sock:
        sock.sendall(b"warm-up")
        recv_exactly(sock, 7)
        trips = []
        for i in range(5):
            start = time.perf_counter()
            sock.sendall(b"ping %d" % i)
            assert recv_exactly(sock, 6) == b"ping %d" % i
            trips.append((time.perf_counter() - start) * 1e3)
    assert min(trips) >= 2 * delay_ms
    assert statistics.median(trips) < 2 * delay_ms + 30, trips


def test_many_small_chunks_wait_the_delay_once_not_once_each(echo):
    delay_ms, messages = 20, 100
    with start_delay_proxy("127.0.0.1", echo.port, delay_ms=delay_ms) as proxy, connect(proxy.port) as sock:
        start = time.perf_counter()
        for i in range(messages):
            sock.sendall(b"%04d" % i)
            time.sleep(0.001)  # separate reads at the proxy, each delayed
        sent = time.perf_counter() - start
        back = recv_exactly(sock, 4 * messages)
        total = time.perf_counter() - start
    assert back == b"".join(b"%04d" % i for i in range(messages))
    assert total >= 2 * delay_ms / 1e3
    # Sequential sleeps would take messages x delay (2 s); a delay line takes the sending time + 2 x delay.
    assert total < sent + (2 * delay_ms + 150) / 1e3, (sent, total)


def echo_handler() -> grpc.GenericRpcHandler:
    """/test.Echo/Stream: a bidirectional stream of raw bytes echoed back."""
    stream = grpc.stream_stream_rpc_method_handler(lambda requests, context: requests)
    return grpc.method_handlers_generic_handler("test.Echo", {"Stream": stream})


@pytest.fixture
def grpc_server():
    server = grpc.server(ThreadPoolExecutor(8))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([echo_handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def test_grpc_calls_work_through_the_proxy(grpc_server):
    delay_ms = 10
    rng = random.Random(1)
    with start_delay_proxy("127.0.0.1", grpc_server, delay_ms=delay_ms) as proxy, \
            grpc.insecure_channel(proxy.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        start = time.perf_counter()
        assert check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        assert time.perf_counter() - start >= 2 * delay_ms / 1e3  # the call itself crossed the proxy

        # Concurrent streams multiplexed on one connection, with messages past HTTP/2's flow-control window.
        stream = channel.stream_stream("/test.Echo/Stream")
        payloads = [[rng.randbytes(rng.choice([10, 5000, 400_000])) for _ in range(5)] for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            echoed = list(pool.map(lambda msgs: list(stream(iter(msgs), timeout=20)), payloads))
        assert echoed == payloads
        assert proxy.connections == 1


def test_closing_the_proxy_closes_its_connections(echo):
    proxy = start_delay_proxy("127.0.0.1", echo.port, delay_ms=1)
    try:
        with connect(proxy.port) as sock:
            sock.sendall(b"hello")
            assert recv_exactly(sock, 5) == b"hello"
            assert proxy.connections == 1
            proxy.close()
            try:
                assert sock.recv(16) == b""  # the client's side ends...
            except ConnectionResetError:
                pass
            assert echo.ended[0].wait(5)  # ...and so does the target's
        with pytest.raises(ConnectionRefusedError):  # and nothing listens any more
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    finally:
        proxy.close()  # a second close is harmless


def test_an_unreachable_target_closes_the_client():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]  # bound but not listening: connections are refused
        with start_delay_proxy("127.0.0.1", dead_port, delay_ms=1) as proxy, connect(proxy.port) as sock:
            try:
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
            assert wait_until(lambda: proxy.connections == 0)


def test_command_line_relays_and_stops_on_sigterm(echo):
    argv = [sys.executable, "bench/delay_proxy.py", "--target", f"127.0.0.1:{echo.port}", "--delay-ms", "2"]
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            line = proc.stdout.readline()
            assert line.startswith("delay proxy listening on 127.0.0.1:"), line
            port = int(line.split()[4].rsplit(":", 1)[1])
            with connect(port) as sock:
                sock.sendall(b"through the cli")
                assert recv_exactly(sock, 15) == b"through the cli"
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(10) == 0
                assert echo.ended[0].wait(5)  # it closed the connection on the way out
            assert proc.stderr.read() == ""
        finally:
            if proc.poll() is None:
                proc.kill()
