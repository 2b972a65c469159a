"""A link's feature rows through shared memory, for a drafter on the verifier's host.

A reply's feature rows are most of its bytes (1.8 MB a step at 32 sessions, 8B dimensions), and
carrying them through gRPC is most of the link's time. Between two processes of one host they
need not cross it: a drafter asks for a ring (`LinkRequest.feature_ring`), the verifier creates
a file in shared memory for that link (`RingWriter`: in `--feature-ring-dir`, mode 0600, random
name, a header holding a random nonce, its memory allocated at once) and offers it in its reply
(`LinkResponse.ring`); the drafter maps it read-only (`RingReader`) and from then on a reply
carries only where its rows lie (`LinkResponse.features_at`). A drafter that cannot map it (another host or user, a container
without the verifier's /dev/shm, a nonce that differs) refuses it and keeps getting its rows
inline; so does every reply whose rows do not fit where the drafter has released them.

Positions count bytes since the ring began and only grow; a position's place in the file is its
remainder by the capacity, after the header. A reply's rows never wrap: rows that would pass
the end start at the next lap. The drafter copies a reply's rows out as it decodes it, then
releases them: each of its messages carries `ring_released`, the end of the last rows it read,
and the verifier reserves rows only where nothing unreleased lies. A link's replies reserve
their rows in the replies' order, so the releases only grow, and they are checked to.

The verifier unlinks the file as soon as the drafter has answered the offer (mapped or not), so
nothing is left behind when either process ends later; a verifier killed within that one round
trip leaves its file (named `ddtree-features-...`).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import tempfile
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

MAGIC = b"DDTRING1"
NONCE_BYTES = 16
HEADER = 4096  # the header's page; rows start page-aligned after it
PREFIX = "ddtree-features-"
MAX_CAPACITY = 1 << 36  # 64 GiB: a bound on an offer's size, checked before mapping it


class RingError(ValueError):
    """A ring position, size or offer that does not hold together (from the other side: wire data)."""


def default_dir() -> str:
    """Where rings are made by default: /dev/shm (memory) where there is one, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class RingOffer:
    """What a drafter needs to map a ring (LinkResponse.ring)."""
    path: str
    capacity: int
    nonce: bytes


def _header(capacity: int, nonce: bytes) -> bytes:
    return MAGIC + nonce + capacity.to_bytes(8, "little")


class RingWriter:
    """The verifier's side of one link's ring. `reserve` runs on the model worker's thread,
    `release` on the event loop's: a lock keeps the two positions consistent."""

    def __init__(self, capacity: int, directory: str):
        if capacity <= 0 or capacity > MAX_CAPACITY:
            raise ValueError(f"a feature ring of {capacity} bytes (1 to {MAX_CAPACITY})")
        self.capacity = capacity
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path = os.path.join(os.path.abspath(directory), PREFIX + secrets.token_hex(16))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            # Allocated now, not page by page as rows arrive: a full tmpfs (a container's 64 MB
            # /dev/shm) fails here (OSError: no ring, rows inline) instead of killing the process
            # with SIGBUS at a later write.
            os.posix_fallocate(fd, 0, HEADER + capacity)
            self._map = mmap.mmap(fd, HEADER + capacity)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        header = _header(capacity, self.nonce)
        self._map[:len(header)] = header
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER, count=capacity)
        self._linked = True
        self._lock = threading.Lock()
        self.mapped = False  # the drafter has mapped it: rows may go there
        self.head = 0  # rows reserved up to here
        self.released = 0  # the drafter has read the rows up to here

    def offer(self) -> RingOffer:
        return RingOffer(self.path, self.capacity, self.nonce)

    def answered(self, mapped: bool) -> None:
        """The drafter mapped the ring (rows may go there from now on) or refused it; either way
        the file's name is no longer needed."""
        self.mapped = mapped
        self._unlink()

    def release(self, position: int) -> None:
        """The drafter has read the rows up to `position` (wire data: RingError unless it lies
        between the last release and the rows reserved)."""
        with self._lock:
            if not self.released <= position <= self.head:
                raise RingError(f"ring released up to {position}, outside {self.released}..{self.head}")
            self.released = position

    def reserve(self, nbytes: int) -> int | None:
        """The position for `nbytes` of rows (one reply's), or None: not mapped, or no room
        until the drafter releases more (those rows then go inline)."""
        with self._lock:
            if not self.mapped or not 0 < nbytes <= self.capacity:
                return None
            at = self.head
            if at % self.capacity + nbytes > self.capacity:  # would pass the end: the next lap
                at += self.capacity - at % self.capacity
            if at + nbytes - self.released > self.capacity:
                return None
            self.head = at + nbytes
            return at

    def write(self, at: int, rows: Tensor) -> None:
        """Copy rows (a host tensor, `nbytes` as reserved at `at`) to their place."""
        flat = rows.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
        start = at % self.capacity
        self._data[start:start + flat.numel()].copy_(flat)

    def close(self) -> None:
        """No more rows go there; the file is unlinked if that is not done yet. The memory goes
        with the last reference (a reply still being encoded may hold one)."""
        self.mapped = False
        self._unlink()

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class RingReader:
    """The drafter's side: the offered ring mapped read-only. Raises OSError when the file
    cannot be opened or mapped, RingError when it is not the ring offered."""

    def __init__(self, offer: RingOffer):
        name = os.path.basename(offer.path)
        if not os.path.isabs(offer.path) or not name.startswith(PREFIX):
            raise RingError(f"a feature ring at {offer.path!r}")
        if not 0 < offer.capacity <= MAX_CAPACITY or len(offer.nonce) != NONCE_BYTES:
            raise RingError(f"a feature ring of {offer.capacity} bytes with a {len(offer.nonce)}-byte nonce")
        fd = os.open(offer.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != HEADER + offer.capacity:
                raise RingError(f"{offer.path} is not a feature ring of {offer.capacity} bytes")
            self._map = mmap.mmap(fd, HEADER + offer.capacity, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        header = _header(offer.capacity, offer.nonce)
        if self._map[:len(header)] != header:
            self._map.close()
            raise RingError(f"{offer.path} is not the feature ring offered (its header differs)")
        self.capacity = offer.capacity
        self.read_to = 0  # the end of the last rows read: what the next message releases

    def rows(self, at: int, nbytes: int) -> memoryview:
        """The `nbytes` at position `at` (a reply's rows, wire data: RingError unless they lie in
        the ring, unwrapped, after the rows read before). Read them, then `done(at + nbytes)`."""
        if at < self.read_to or not 0 < nbytes <= self.capacity or at % self.capacity + nbytes > self.capacity:
            raise RingError(f"rows of {nbytes} bytes at ring position {at} (capacity {self.capacity}, "
                            f"read to {self.read_to})")
        start = HEADER + at % self.capacity
        return memoryview(self._map)[start:start + nbytes]

    def done(self, position: int) -> None:
        """The rows up to `position` are copied out: the next message releases them."""
        self.read_to = position
