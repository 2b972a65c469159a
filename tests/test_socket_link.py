"""The link's Unix socket (common/socket_link.py): frames both ways, their bounds and ends, and
the offer's checks on both sides. Through the verifier service: tests/test_verifier_server.py."""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time

import pytest

from common import socket_link
from common.socket_link import (FRAME, NONCE_BYTES, PREFIX, SOCKET_NAME, SocketLinkError, SocketListener, SocketOffer,
                                connect, recv_frame, send_frame)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_frames_of_any_size_arrive_whole_and_in_order(pair):
    a, b = pair
    sizes = [0, 1, 7, (1 << 16) - 5, 1 << 16, (1 << 20) + 3]
    payloads = [os.urandom(n) for n in sizes]
    sender = threading.Thread(target=lambda: [send_frame(a, p) for p in payloads])
    sender.start()
    got = [recv_frame(b) for _ in sizes]
    sender.join()
    assert [bytes(g) for g in got] == payloads


def test_a_clean_end_is_none_and_a_cut_frame_an_error(pair):
    a, b = pair
    a.sendall(FRAME.pack(10) + b"12345")  # half a frame, then the end
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(SocketLinkError, match="cut short"):
        recv_frame(b)
    c, d = socket.socketpair()
    c.sendall(FRAME.pack(3) + b"abc")
    c.close()
    assert bytes(recv_frame(d)) == b"abc" and recv_frame(d) is None  # then the end, between frames
    d.close()


def test_a_frame_over_the_limit_is_refused_before_its_bytes_are_read(pair):
    a, b = pair
    a.sendall(FRAME.pack(1 << 30))
    with pytest.raises(SocketLinkError, match="limit is 1000"):
        recv_frame(b, max_frame=1000)


def test_a_timeout_before_a_frame_loses_nothing_and_a_begun_frame_is_waited_for(pair):
    a, b = pair
    b.settimeout(0.05)
    with pytest.raises(TimeoutError):
        recv_frame(b)

    def slow():  # the header, then the rest after more than the timeout
        a.sendall(FRAME.pack(6) + b"abc")
        time.sleep(0.2)
        a.sendall(b"def")

    sender = threading.Thread(target=slow)
    sender.start()
    assert bytes(recv_frame(b)) == b"abcdef"
    sender.join()
    assert b.gettimeout() == 0.05  # restored


def test_a_send_the_peer_does_not_take_waits_and_may_give_up(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    waited = []

    def give_up(seconds: float) -> None:
        waited.append(seconds)
        if seconds >= 0.2:
            raise TimeoutError("gone")

    with pytest.raises(TimeoutError):
        send_frame(a, os.urandom(4 << 20), give_up)
    assert waited == sorted(waited) and 0.2 <= waited[-1] < 0.3


def test_two_sides_that_both_send_before_reading_do_not_wait_on_each_other(pair):
    """The verifier's writes of replies wait for the drafter to read them, and it stops reading
    while they wait; the drafter reads the replies while its own send waits, so both go through."""
    drafter, verifier = pair
    for s in pair:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    reply, message = os.urandom(4 << 20), os.urandom(4 << 20)
    got = []

    def verifier_side():
        send_frame(verifier, reply)  # waits until the drafter reads it
        got.append(recv_frame(verifier))

    other = threading.Thread(target=verifier_side)
    other.start()
    early = []
    send_frame(drafter, message, lambda seconds: early.extend(
        recv_frame(drafter) for _ in range(1) if socket_link.readable(drafter)))
    other.join(10)
    assert bytes(early[0]) == reply and bytes(got[0]) == message


def _listen(tmp_path, max_frame: int = 1 << 20) -> SocketListener:
    listener = SocketListener(str(tmp_path), max_frame)
    folder = os.path.dirname(listener.path)
    assert os.path.basename(folder).startswith(PREFIX) and os.path.basename(listener.path) == SOCKET_NAME
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and stat.S_ISSOCK(os.stat(listener.path).st_mode)
    assert len(listener.nonce) == NONCE_BYTES
    return listener


def test_the_drafter_connects_with_the_nonce_and_frames_flow_both_ways(tmp_path):
    async def main():
        listener = _listen(tmp_path)
        sock = await asyncio.to_thread(connect, listener.offer(), 2.0)
        stream = await listener.accept()
        assert os.listdir(tmp_path) == []  # the socket's file and directory are gone once connected
        send_frame(sock, b"up")
        assert await stream.read() == b"up"
        await stream.write(b"down" * 1000)
        assert bytes(await asyncio.to_thread(recv_frame, sock)) == b"down" * 1000
        sock.close()
        assert await stream.read() is None  # the drafter's end
        for _ in range(4):  # replies it no longer reads go nowhere, without an error
            await stream.write(bytes(1 << 20))
        assert stream.gone
        stream.close()

    asyncio.run(main())


def test_a_frame_sent_from_another_thread_goes_whole_and_in_order_with_the_event_loops(tmp_path):
    """`send_now` (the model worker's thread) sends what the socket takes at once and leaves the
    rest to `write_rest`; while bytes the event loop wrote wait in its buffer it sends nothing."""
    async def main():
        listener = _listen(tmp_path)
        sock = await asyncio.to_thread(connect, listener.offer(), 2.0)
        stream = await listener.accept()
        small, large, after = os.urandom(100), os.urandom(8 << 20), os.urandom(1000)
        assert len(await asyncio.to_thread(stream.send_now, small)) == 0  # all of it went
        assert bytes(await asyncio.to_thread(recv_frame, sock)) == small
        rest = await asyncio.to_thread(stream.send_now, large)  # more than the socket holds: the drafter reads later
        assert 0 < len(rest) < len(large)
        reading = asyncio.ensure_future(asyncio.to_thread(lambda: [bytes(recv_frame(sock)) for _ in range(2)]))
        await stream.write_rest(rest)
        await stream.write(after)
        assert await reading == [large, after]
        stream._writer.write(FRAME.pack(len(large)) + large)  # queued by the event loop, not yet sent
        assert stream._writer.transport.get_write_buffer_size() > 0
        assert stream.send_now(small) is None  # so this one waits its turn
        reading = asyncio.ensure_future(asyncio.to_thread(lambda: [bytes(recv_frame(sock)) for _ in range(2)]))
        await stream._writer.drain()
        await stream.write(small)
        assert await reading == [large, small]
        sock.close()
        assert await stream.read() is None
        for _ in range(4):  # to a drafter gone, nothing is left to send and nothing raises
            stream.send_now(bytes(1 << 20))
        assert stream.gone and len(stream.send_now(small)) == 0
        stream.close()

    asyncio.run(main())


@pytest.mark.parametrize("first", ["another nonce", "nothing", "a long frame"])
def test_a_connection_without_the_nonce_is_refused(tmp_path, first):
    async def main():
        listener = _listen(tmp_path)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(listener.path)
        if first == "another nonce":
            send_frame(raw, bytes(NONCE_BYTES))
        elif first == "a long frame":  # refused at its header: no megabyte is awaited
            raw.sendall(FRAME.pack(1 << 20))
        else:
            raw.close()
        with pytest.raises(SocketLinkError, match="nonce"):
            await listener.accept()
        assert os.listdir(tmp_path) == []
        raw.close()

    asyncio.run(main())


def test_the_verifier_refuses_frames_over_its_limit_and_cut_ones(tmp_path):
    async def main():
        listener = _listen(tmp_path, max_frame=100)
        sock = await asyncio.to_thread(connect, listener.offer(), 2.0)
        stream = await listener.accept()
        sock.sendall(FRAME.pack(101))
        with pytest.raises(SocketLinkError, match="limit is 100"):
            await stream.read()
        stream.close()
        sock.close()
        listener = _listen(tmp_path)
        sock = await asyncio.to_thread(connect, listener.offer(), 2.0)
        stream = await listener.accept()
        sock.sendall(FRAME.pack(10) + b"abc")
        sock.close()
        with pytest.raises(SocketLinkError, match="cut short"):
            await stream.read()
        stream.close()

    asyncio.run(main())


def test_a_closed_offer_leaves_nothing_behind(tmp_path):
    listener = _listen(tmp_path)
    listener.close()
    listener.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        connect(listener.offer(), 1.0)


def test_the_drafter_connects_only_to_a_private_socket_of_its_user(tmp_path):
    nonce = bytes(NONCE_BYTES)
    for path in ("relative/" + PREFIX + "x/" + SOCKET_NAME, str(tmp_path / "elsewhere" / SOCKET_NAME),
                 str(tmp_path / (PREFIX + "x") / "other.sock")):
        with pytest.raises(SocketLinkError, match="a socket link at"):
            connect(SocketOffer(path, nonce), 1.0)
    with pytest.raises(SocketLinkError, match="nonce"):
        connect(SocketOffer(str(tmp_path / (PREFIX + "x") / SOCKET_NAME), b"short"), 1.0)
    folder = tmp_path / (PREFIX + "open")
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    (folder / SOCKET_NAME).write_text("")
    with pytest.raises(SocketLinkError, match="private directory"):
        connect(SocketOffer(str(folder / SOCKET_NAME), nonce), 1.0)
    os.chmod(folder, 0o700)
    with pytest.raises(SocketLinkError, match="not a socket"):  # a regular file there
        connect(SocketOffer(str(folder / SOCKET_NAME), nonce), 1.0)
    (folder / SOCKET_NAME).unlink()
    os.symlink(str(tmp_path), folder / SOCKET_NAME)
    with pytest.raises(SocketLinkError, match="not a socket"):  # nor a link to one
        connect(SocketOffer(str(folder / SOCKET_NAME), nonce), 1.0)


def test_the_sockets_default_dir_exists():
    from common.feature_ring import default_dir  # the sockets' default directory too

    assert os.path.isdir(default_dir())
