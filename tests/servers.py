"""Running real servers inside the test process, on loopback with ephemeral ports."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import grpc

from common.rpc import CHANNEL_OPTIONS


class ServerThread:
    """Runs an asyncio server on its own event loop in a daemon thread.

    `start` is a coroutine function returning (server, port) where `server.stop(grace)` is
    a coroutine; use as a context manager, `port` is the bound port.
    """

    def __init__(self, start: Callable[[], Awaitable[tuple[object, int]]]):
        self._start = start
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self.server, self.port = None, 0

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        try:
            self.server, self.port = self.call(self._start(), timeout=60)
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self.server.stop(0), timeout=30)
        finally:
            self._close_loop()

    def call(self, coro, timeout: float = 10):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def loopback_channel(port: int) -> grpc.Channel:
    """A channel to one of the tests' servers on 127.0.0.1."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
