"""A link's messages through a Unix socket, for a drafter on the verifier's host.

Over gRPC each link message crosses several threads in each process before its bytes reach the
code that reads them: on the drafter gRPC's request thread on the way up and a reader thread on
the way down, on the verifier gRPC's completion queue and the event loop, each a hand-off that
waits for the interpreter lock. Between two processes of one host they need not: a drafter
asks for one in a hello, its stream's first message (`LinkRequest.unix_socket`, no
entries); the verifier listens on a Unix socket in a directory of its own (`SocketListener`:
mode 0700, in `--unix-socket-dir`: /dev/shm by default, as the feature rings) and offers its path and a random nonce in the hello's reply
(`LinkResponse.unix_socket`). The drafter connects, sends the nonce as its first frame, and from
then on the link's messages, the same bytes as over gRPC, go through the socket as frames: a
4-byte little-endian length, then the message. The drafter's scheduler thread writes its
messages and reads the replies itself. The verifier reads on its event loop; a reply goes out
from the model worker's thread that encoded it, where the link's writer waits for exactly that
reply (`SocketStream.send_now`; what the socket does not take at once, the event loop sends
next), else from the event loop. The gRPC stream stays open beside it: either side ending it
ends the link, and a verifier that fails the link says why there.

A drafter that cannot reach the socket (another host or user, a container without the
verifier's directory) keeps sending over gRPC, which withdraws the offer. The verifier removes
the socket's file and directory as soon as the drafter has connected, or the offer is withdrawn
or times out, or the link ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import select
import secrets
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "ddtree-link-"
SOCKET_NAME = "link.sock"
NONCE_BYTES = 16
FRAME = struct.Struct("<I")  # a frame's length, before its bytes
MAX_FRAME = (1 << 31) - 1  # protobuf's limit on a message: a drafter's bound on a reply's frame
WAIT_POLL_S = 0.05  # how often a send that the socket does not take looks around (`send_frame`)


class SocketLinkError(ValueError):
    """A frame or an offer that does not hold together (from the other side: wire data)."""


@dataclass(frozen=True)
class SocketOffer:
    """What a drafter needs to connect (LinkResponse.unix_socket)."""
    path: str
    nonce: bytes


# -- the verifier's side (asyncio) -----------------------------------------------------------


class SocketStream:
    """One connected socket link, on the verifier's event loop; `send_now` may also be called
    from another thread (the model worker's), at a time when nothing else writes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int,
                 sock: socket.socket | None = None):
        """`sock`: the connected socket itself, for `send_now` (None: it always leaves the frame to `write`)."""
        self._reader, self._writer, self.max_frame, self._sock = reader, writer, max_frame, sock
        self.gone = False  # a write found the drafter gone: its replies have no one to go to

    async def read(self) -> bytes | None:
        """The next frame's bytes; None when the drafter closed the socket between frames.
        SocketLinkError for a frame over `max_frame` or cut short."""
        try:
            header = await self._reader.readexactly(FRAME.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise SocketLinkError("a socket-link frame cut short") from None
            return None
        except ConnectionError:  # reset by the drafter: as closed
            return None
        (size,) = FRAME.unpack(header)
        if size > self.max_frame:
            raise SocketLinkError(f"a socket-link frame of {size} bytes, the limit is {self.max_frame}")
        try:
            return await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise SocketLinkError("a socket-link frame cut short") from None

    async def write(self, data: bytes) -> None:
        """Send one frame; nothing once the drafter has gone (its end, read next, ends the link)."""
        if self.gone:
            return
        try:
            self._writer.writelines((FRAME.pack(len(data)), data))
            await self._writer.drain()
        except ConnectionError:
            self.gone = True

    def send_now(self, data: bytes) -> memoryview | None:
        """Send one frame from the calling thread as far as the socket takes it without waiting,
        where no bytes the event loop wrote are still queued (`write`'s): what is left of it
        (empty: all of it went), for `write_rest` to send next, before any other frame; None where
        nothing was sent (bytes queued, or no socket): the caller sends it with `write`. A reply
        the model worker sends itself reaches the drafter without waiting for the event loop.
        The caller makes sure that nothing else writes meanwhile."""
        if self.gone:
            return memoryview(b"")
        if self._sock is None or self._writer.transport.get_write_buffer_size():
            return None
        header = FRAME.pack(len(data))
        try:
            sent = self._sock.sendmsg((header, data), (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:  # the drafter has gone: its end, read next, ends the link
            self.gone = True
            return memoryview(b"")
        if sent < len(header):
            return memoryview(header[sent:] + data)
        return memoryview(data)[sent - len(header):]

    async def write_rest(self, rest: memoryview) -> None:
        """The rest of a frame `send_now` began (its bytes as they are: no header of their own)."""
        if self.gone or not rest:
            return
        try:
            self._writer.write(rest)
            await self._writer.drain()
        except ConnectionError:
            self.gone = True

    def close(self) -> None:
        self._writer.close()


class SocketListener:
    """A Unix socket offered to one drafter link: in a fresh directory of mode 0700 (only this
    user may connect), with a random nonce the connecting drafter must send first."""

    def __init__(self, directory: str, max_frame: int):
        self.max_frame = max_frame
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._dir = tempfile.mkdtemp(prefix=PREFIX, dir=os.path.abspath(directory))  # mode 0700
        self.path = os.path.join(self._dir, SOCKET_NAME)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.bind(self.path)
            self._socket.listen(1)
            self._socket.setblocking(False)
        except BaseException:
            self.close()
            raise

    def offer(self) -> SocketOffer:
        return SocketOffer(self.path, self.nonce)

    async def accept(self) -> SocketStream:
        """The drafter's connection, once its first frame is the nonce (SocketLinkError if not). The
        socket's file and directory are removed as it connects: nobody else can."""
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self._socket)
        self.close()
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        stream = SocketStream(reader, writer, NONCE_BYTES, conn)  # the first frame: the nonce, and no more
        try:
            nonce = await stream.read()
        except SocketLinkError:
            nonce = None
        if nonce is None or not hmac.compare_digest(nonce, self.nonce):
            stream.close()
            raise SocketLinkError("the socket link's first frame is not the nonce offered")
        stream.max_frame = self.max_frame
        return stream

    def close(self) -> None:
        """Stop listening and remove the socket's file and directory (safe to call again)."""
        self._socket.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- the drafter's side (blocking, on the scheduler's thread) --------------------------------


def connect(offer: SocketOffer, timeout: float) -> socket.socket:
    """Connect to an offered socket link and send its nonce. Raises SocketLinkError for an offer
    that is not a verifier's socket of this user (a path elsewhere, not a socket, a directory
    others may enter), OSError when it cannot be reached (another host, another container)."""
    directory, name = os.path.split(offer.path)
    if (not os.path.isabs(offer.path) or name != SOCKET_NAME or not os.path.basename(directory).startswith(PREFIX)
            or len(offer.nonce) != NONCE_BYTES):
        raise SocketLinkError(f"a socket link at {offer.path!r} with a {len(offer.nonce)}-byte nonce")
    folder, sock_info = os.lstat(directory), os.lstat(offer.path)
    if not stat.S_ISDIR(folder.st_mode) or folder.st_mode & 0o077 or folder.st_uid != os.getuid():
        raise SocketLinkError(f"{directory} is not a private directory of this user")
    if not stat.S_ISSOCK(sock_info.st_mode) or sock_info.st_uid != os.getuid():
        raise SocketLinkError(f"{offer.path} is not a socket of this user")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(offer.path)
        send_frame(sock, offer.nonce)
    except BaseException:
        sock.close()
        raise
    return sock


def send_frame(sock: socket.socket, data: bytes, waiting: Callable[[float], None] | None = None) -> None:
    """Send one frame. While the socket takes none of it for WAIT_POLL_S, `waiting(seconds)` is
    called with the time waited so far: it may read what the other side sent meanwhile (a side
    that stops reading while its own writes wait for this one would otherwise wait forever), or
    raise to give up (the frame is then cut: the link is lost)."""
    frame = memoryview(FRAME.pack(len(data)) + data)
    sent, waited = 0, 0.0
    while sent < len(frame):
        if not select.select([], [sock], [], WAIT_POLL_S)[1]:
            waited += WAIT_POLL_S
            if waiting is not None:
                waiting(waited)
            continue
        waited = 0.0
        try:  # what fits now: a blocking send would wait for the whole rest
            sent += sock.send(frame[sent:], socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass


def readable(sock: socket.socket) -> bool:
    """Whether a read would not wait: bytes have come, or the other side's end."""
    return bool(select.select([sock], [], [], 0)[0])


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> bytearray | None:
    """The next frame's bytes, or None when the verifier closed the socket between frames.
    SocketLinkError for a frame over `max_frame` or cut short; TimeoutError when the socket's
    timeout passes before a frame begins (nothing is lost: the next call reads it). Once a frame
    has begun, its rest is waited for without the timeout: it is on its way."""
    timeout = sock.gettimeout()
    try:
        header = _recv_into(sock, bytearray(FRAME.size), begun=False)
        if header is None:
            return None
        (size,) = FRAME.unpack(header)
        if size > max_frame:
            raise SocketLinkError(f"a socket-link frame of {size} bytes, the limit is {max_frame}")
        return _recv_into(sock, bytearray(size), begun=True)
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)


def _recv_into(sock: socket.socket, buffer: bytearray, begun: bool) -> bytearray | None:
    """Fill `buffer`; None at a clean end before a frame has begun."""
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        try:
            n = sock.recv_into(view[got:])
        except ConnectionError:  # reset by the verifier: as closed
            n = 0
        if not n:
            if not begun and got == 0:
                return None
            raise SocketLinkError("a socket-link frame cut short")
        if not begun:
            sock.settimeout(None)
            begun = True
        got += n
    return buffer
