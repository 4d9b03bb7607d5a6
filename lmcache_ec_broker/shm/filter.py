"""A membership filter the broker publishes in shared memory: misses answered locally.

The broker (the only writer) keeps a counting filter over the keys its ``has()``
could answer True for; clients map the same segment read-only and answer a
definite miss without a round trip. A local "maybe" is always confirmed by the
broker, so the filter can only make an answer cheaper, never different.

Layout (little-endian): a 64-byte header, then ``nslots`` one-byte counters.

    magic 8s | version u32 | log2_slots u32 | nhashes u32 | flags u32 | salt 16s | pad

Each key maps to ``nhashes`` slots (blake2b keyed with the per-broker salt, so
hostile keys cannot be aimed at one slot). A slot counts the present keys that
map to it; 255 is sticky ("saturated": the count is unknown, so it never
decrements).

Invariant (what makes a local "absent" safe): every slot of a key is >= 1 from
before the broker first answers True for that key until after it last does.
The writer keeps it by ``add`` *before* a key becomes visible (before the commit
reply is sent) and ``remove`` only *after* it stopped being visible; counters
only change by one byte store at a time, so a concurrent (torn or stale) read
of a slot shared with other keys still sees >= 1 while this key is present. A
read racing an add can see 0 -- that key was not yet present when the read
started, so the cost is a missed hit, never a wrong answer.

Liveness: a broker that stops cleanly clears FLAG_LIVE, after which readers say
"maybe" for everything (and so reach the broker and notice the restart). A
killed broker cannot; the client therefore trusts its filter only while its
connection has been confirmed recently (see BrokerClient).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Collection

import posix_ipc

from .segment import Segment, ShmError, check_owner

MAGIC = b"LMECFLT1"
VERSION = 1
HEADER = struct.Struct("<8sIIII16s")
HEADER_SIZE = 64
FLAG_LIVE = 1
SATURATED = 255
NHASHES = 2
MIN_LOG2_SLOTS = 16
MAX_LOG2_SLOTS = 26
_FLAGS_OFFSET = 20
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_BATCH_MIN = 8  # below this the per-key loop is as fast as the batched reads

try:  # the client side has numpy (torch needs it); the broker never calls maybe_many
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


def slots_for(capacity_blocks: int) -> int:
    """log2 of the slot count: >= 16 slots per block the slab can hold, so even a slab
    full of one-block entries keeps the false-"maybe" rate near 1% (k=2)."""
    want = max(1, capacity_blocks) * 16
    return min(MAX_LOG2_SLOTS, max(MIN_LOG2_SLOTS, (want - 1).bit_length()))


class _Hasher:
    __slots__ = ("base", "mask", "nhashes")

    def __init__(self, salt: bytes, log2_slots: int, nhashes: int) -> None:
        self.base = hashlib.blake2b(digest_size=8, key=salt)  # copied per key: keying is paid once
        self.mask = (1 << log2_slots) - 1
        self.nhashes = nhashes

    def slots(self, key: str) -> tuple[int, ...]:
        d = self.base.copy()
        d.update(key.encode("utf-8", "surrogatepass"))
        h = int.from_bytes(d.digest(), "little")
        mask = self.mask
        if self.nhashes == 2:
            return (HEADER_SIZE + (h & mask), HEADER_SIZE + ((h >> 32) & mask))
        return tuple(HEADER_SIZE + ((h >> (32 * i)) & mask) for i in range(self.nhashes))


class FilterWriter:
    """The broker's side. Not thread-safe: the broker's loop is the only writer."""

    def __init__(self, name: str, log2_slots: int, mode: int = 0o600) -> None:
        if not MIN_LOG2_SLOTS <= log2_slots <= MAX_LOG2_SLOTS:
            raise ValueError(f"log2_slots must be in [{MIN_LOG2_SLOTS}, {MAX_LOG2_SLOTS}]")
        self.name = name
        self.nslots = 1 << log2_slots
        self.size = HEADER_SIZE + self.nslots
        self.segment = Segment.create(name, self.size, mode=mode)
        self.mm = self.segment.mm
        salt = os.urandom(16)
        self._hasher = _Hasher(salt, log2_slots, NHASHES)
        self.mm[:HEADER_SIZE] = HEADER.pack(
            MAGIC, VERSION, log2_slots, NHASHES, FLAG_LIVE, salt
        ).ljust(HEADER_SIZE, b"\0")
        self.saturated = 0

    def add(self, key: str) -> None:
        mm = self.mm
        for s in self._hasher.slots(key):
            c = mm[s]
            if c < SATURATED:
                mm[s] = c + 1
                if c + 1 == SATURATED:
                    self.saturated += 1

    def remove(self, key: str) -> None:
        """Only for a key previously added (and not yet removed) by the same tier."""
        mm = self.mm
        for s in self._hasher.slots(key):
            c = mm[s]
            if 0 < c < SATURATED:
                mm[s] = c - 1

    def maybe(self, key: str) -> bool:
        mm = self.mm
        return all(mm[s] for s in self._hasher.slots(key))

    def close(self) -> None:
        """Mark the filter dead (readers then say "maybe"), unlink and unmap it."""
        try:
            self.mm[_FLAGS_OFFSET : _FLAGS_OFFSET + 4] = struct.pack("<I", 0)
        except (ValueError, OSError):
            pass
        self.segment.unlink()
        self.segment.close()


class FilterReader:
    """A client's read-only view. ``maybe`` never blocks and never talks to the broker."""

    def __init__(self, name: str, size: int, owners: Collection[int] | None = None) -> None:
        # Mapped read-only: a buggy client cannot corrupt what every other client reads.
        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except (OSError, ValueError, posix_ipc.Error) as exc:
            raise ShmError(f"cannot open membership filter {name}: {exc}") from exc
        try:
            if owners is not None:  # before mapping: another user's filter could hide hits
                check_owner(shm.fd, name, owners)
            if shm.size < size:
                raise ShmError(f"filter {name} has {shm.size} bytes, the broker announced {size}")
            self.mm = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        try:
            self.mm.madvise(_MADV_POPULATE_READ)  # no first-touch faults on the hot path
        except (OSError, ValueError, AttributeError):
            pass
        magic, version, log2_slots, nhashes, _flags, salt = HEADER.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION:
            self.mm.close()
            raise ShmError(f"segment {name} is not a membership filter of this version")
        if HEADER_SIZE + (1 << log2_slots) > size:
            self.mm.close()
            raise ShmError(f"filter segment {name} is shorter than its header says")
        self._hasher = _Hasher(salt, log2_slots, nhashes)

    @property
    def live(self) -> bool:
        return bool(self.mm[_FLAGS_OFFSET] & FLAG_LIVE)

    def maybe(self, key: str) -> bool:
        """False only if the key was not present when the read started (see the invariant)."""
        mm = self.mm
        if not mm[_FLAGS_OFFSET] & FLAG_LIVE:
            return True
        for s in self._hasher.slots(key):
            if not mm[s]:
                return False
        return True

    def maybe_many(self, keys: list[str]) -> list[bool]:
        """``maybe`` for a batch: one keyed hash per key, then the slot reads done for the
        whole batch at once (numpy gather when available). Same answers as ``maybe``."""
        mm = self.mm
        if not mm[_FLAGS_OFFSET] & FLAG_LIVE:
            return [True] * len(keys)
        h = self._hasher
        if h.nhashes != 2 or len(keys) < _BATCH_MIN or _np is None:
            return [self.maybe(k) for k in keys]
        copy = h.base.copy
        digests = []
        for k in keys:
            d = copy()
            d.update(k.encode("utf-8", "surrogatepass"))
            digests.append(d.digest())
        x = _np.frombuffer(b"".join(digests), dtype="<u8")
        mask = _np.uint64(h.mask)
        slots = _np.frombuffer(mm, dtype=_np.uint8, offset=HEADER_SIZE, count=h.mask + 1)
        lo = slots[x & mask]
        hi = slots[(x >> _np.uint64(32)) & mask]
        return ((lo != 0) & (hi != 0)).tolist()

    def close(self) -> None:
        self.mm.close()
