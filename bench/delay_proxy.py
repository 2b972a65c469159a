"""A TCP proxy that adds a fixed delay each way, to bench and test over a real round trip.

    python bench/delay_proxy.py --target HOST:PORT --delay-ms 5 [--listen-host H] [--listen-port N]

Each accepted connection is forwarded to the target. Every chunk read from one side is written
to the other `delay_ms` after it was read, so a request and its reply gain 2 x delay_ms. Bytes
and their order are kept exactly and bandwidth is not limited: each direction keeps a queue of
(due time, bytes), and whatever is due is written at once, so many small chunks still wait only
the delay (never a sum of sleeps). An end of stream is forwarded the same way (a half-close),
and the connection is closed once both directions have ended. It stands in for netem where that
is not available; it relays bytes only, so it works for gRPC (HTTP/2) or any other protocol.

As a library, from synchronous code (the proxy runs its own event loop in a daemon thread):

    with start_delay_proxy("127.0.0.1", verifier_port, delay_ms=5) as proxy:
        ...  # connect to proxy.address instead of the target

or, inside a running event loop, `proxy = DelayProxy(...); await proxy.start(); ...; await
proxy.aclose()`.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])  # run as a script: the repository, not bench/, on the path

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

CHUNK = 1 << 16  # bytes per read


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DelayProxy:
    """The proxy on the running event loop: `await start()`, then `await aclose()`."""

    def __init__(self, target_host: str, target_port: int, delay_ms: float, listen_host: str = "127.0.0.1",
                 listen_port: int = 0):
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.target_host, self.target_port = target_host, target_port
        self.delay_s = delay_ms / 1e3
        self.listen_host, self.port = listen_host, listen_port
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}  # task -> both sides

    @property
    def address(self) -> str:
        return host_port(self.listen_host, self.port)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and drop every open connection (both of its sockets)."""
        if self._server is not None:
            self._server.close()
        open_now = list(self._connections.items())
        for task, _ in open_now:
            task.cancel()
        await asyncio.gather(*(task for task, _ in open_now), return_exceptions=True)
        for _, writers in open_now:
            for writer in writers:
                writer.transport.abort()
        await asyncio.sleep(0)  # let the aborted transports release their sockets
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Registered here, synchronously, so that aclose() sees even a connection whose task has not run yet.
        writers = [writer]
        task = asyncio.get_running_loop().create_task(self._handle(reader, writers))
        self._connections[task] = writers
        task.add_done_callback(lambda done: self._connections.pop(done, None))

    async def _handle(self, client_reader: asyncio.StreamReader, writers: list[asyncio.StreamWriter]) -> None:
        """Connect to the target and relay both ways until both have ended; then close both sides."""
        client_writer = writers[0]
        try:
            target_reader, target_writer = await asyncio.open_connection(self.target_host, self.target_port)
            writers.append(target_writer)
            async with asyncio.TaskGroup() as group:  # one failing direction cancels the other
                group.create_task(self._relay(client_reader, target_writer))
                group.create_task(self._relay(target_reader, client_writer))
        except* OSError:  # the target is unreachable, or a side went away mid-write: close both
            pass
        finally:
            for writer in writers:
                writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk written `delay_s` after it was read; b"" marks the end."""
        loop = asyncio.get_running_loop()
        line: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(CHUNK)
                except OSError:  # a reset ends the stream like an EOF
                    data = b""
                line.append((loop.time() + self.delay_s, data))
                arrived.set()
                if not data:
                    return

        reading = asyncio.create_task(read())
        try:
            while True:
                while not line:
                    arrived.clear()
                    await arrived.wait()
                wait = line[0][0] - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                if not line[0][1]:  # the end of the stream is due
                    if writer.can_write_eof() and not writer.is_closing():
                        writer.write_eof()
                    return
                now, due = loop.time(), []
                while line and line[0][1] and line[0][0] <= now:  # everything due goes out in one write
                    due.append(line.popleft()[1])
                writer.writelines(due)
                await writer.drain()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


class ThreadedDelayProxy:
    """A DelayProxy on its own event loop in a daemon thread, for synchronous programs."""

    def __init__(self, proxy: DelayProxy):
        self.proxy = proxy
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._thread.start()
        try:
            self._call(proxy.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def connections(self) -> int:
        return self.proxy.connections

    def close(self) -> None:
        """Stop the proxy and its thread; idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.proxy.aclose())
        finally:
            self._stop_loop()

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> ThreadedDelayProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_delay_proxy(target_host: str, target_port: int, delay_ms: float, listen_host: str = "127.0.0.1",
                      listen_port: int = 0) -> ThreadedDelayProxy:
    """Start a proxy to target_host:target_port in a background thread; `.port` is where it listens."""
    return ThreadedDelayProxy(DelayProxy(target_host, target_port, delay_ms, listen_host, listen_port))


# ---------------------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------------------


def parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/delay_proxy.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Prints 'delay proxy listening on HOST:PORT' once ready; stops on SIGTERM "
                                       "or SIGINT, closing every connection.")
    p.add_argument("--target", required=True, type=parse_target, metavar="HOST:PORT",
                   help="where to forward each connection, e.g. 127.0.0.1:50051 or [::1]:50051")
    p.add_argument("--delay-ms", type=non_negative, default=5.0, metavar="MS",
                   help="delay added to every chunk in each direction, in ms; a round trip gains twice this "
                        "(default 5)")
    p.add_argument("--listen-host", default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default 127.0.0.1)")
    p.add_argument("--listen-port", type=int, default=0, metavar="PORT",
                   help="port to listen on; 0 picks a free one (default 0)")
    return p


async def serve(a: argparse.Namespace) -> None:
    proxy = await DelayProxy(*a.target, a.delay_ms, a.listen_host, a.listen_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"delay proxy listening on {proxy.address} -> {host_port(*a.target)}, {a.delay_ms:g} ms each way",
          flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.aclose()


if __name__ == "__main__":
    asyncio.run(serve(build_parser().parse_args()))
