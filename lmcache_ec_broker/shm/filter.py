"""A membership filter the broker publishes in shared memory: misses answered locally.

The broker (the only writer) keeps a counting filter over the keys its ``has()``
could answer True for; clients map the same segment read-only and answer a
definite miss without a round trip. A local "maybe" is always confirmed by the
broker, so the filter can only make an answer cheaper, never different.

Layout (little-endian): a 64-byte header, then ``nslots`` one-byte counters.

    magic 8s | version u32 | log2_slots u32 | nhashes u32 | flags u32 | seed u64 | pad

A key's hash is xxh3-64 of its UTF-8 bytes (lone surrogates encoded as
"surrogatepass") seeded with the per-broker random ``seed``; its two slots are
the two little-endian u32 words of the hash's 8-byte canonical digest, masked to
``log2_slots`` bits. Broker and clients share ``key_digest`` below, and the
batched read decodes the same bytes, so they agree on every key.

Why xxh3 and not a keyed cryptographic hash (version 1 used blake2b keyed with a
16-byte salt): a blake2b call costs ~0.55 us per key from Python, xxh3 ~0.08 us,
and the filter exists to make a 64-key miss cheaper than a round trip. The
property kept is weaker, stated precisely: xxh3 is a non-cryptographic hash, not
a PRF, so nothing proves that keys chosen without the 64-bit seed cannot be
aimed at chosen slots (the seed makes that harder than an unseeded hash, no
more). That is acceptable because (1) every client that maps the filter reads
the seed from this header anyway, so the seed only ever hid slots from remote
key authors (e.g. request-supplied multimodal uuids), and (2) aimed keys can
only cause the filter's one failure mode: slots that read >= 1 (or saturate,
stickily) answer "maybe" for other keys, which costs those lookups the round
trip they would pay with the filter off -- never a wrong answer.

Invariant (what makes a local "absent" safe): every slot of a key is >= 1 from
before the broker first answers True for that key until after it last does.
The writer keeps it by ``add`` *before* a key becomes visible (before the commit
reply is sent) and ``remove`` only *after* it stopped being visible; counters
only change by one byte store at a time, so a concurrent (torn or stale) read
of a slot shared with other keys still sees >= 1 while this key is present. A
read racing an add can see 0 -- that key was not yet present when the read
started, so the cost is a missed hit, never a wrong answer.

Partial: the invariant needs every key a tier could answer True for folded in.
A remote tier that cannot fold all of them (``remote_filter_keys: 0``, no key
listing, or more keys than it may fold: the oldest were forgotten) would make an
"absent" wrong -- a hit the broker would find in the store, never asked for. While
that is so, the broker sets FLAG_PARTIAL *before* it removes such a key, and
readers say "maybe" for everything: every miss reaches the broker, which asks the
store.

Liveness: a broker that stops cleanly clears FLAG_LIVE, after which readers say
"maybe" for everything (and so reach the broker and notice the restart). A
killed broker cannot; the client therefore trusts its filter only while its
connection has been confirmed recently (see BrokerClient).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection

import xxhash

from .segment import Segment, ShmError, map_readonly

MAGIC = b"LMECFLT1"
VERSION = 2  # 2: xxh3-64 with a u64 seed (1: blake2b keyed with a 16-byte salt)
HEADER = struct.Struct("<8sIIIIQ")
HEADER_SIZE = 64
FLAG_LIVE = 1
FLAG_PARTIAL = 2  # absences prove nothing (see "Partial")
SATURATED = 255
NHASHES = 2  # the two 32-bit halves of one 64-bit hash: the layout has no room for more
MIN_LOG2_SLOTS = 16
MAX_LOG2_SLOTS = 26  # <= 32: a slot index is one 32-bit half of the hash
_FLAGS_OFFSET = 20
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_BATCH_MIN = 16  # below this the per-key loop beats numpy's fixed cost (benchmarks/filter_probe.py)
_xxh3 = xxhash.xxh3_64_digest
_WORDS = struct.Struct("<II")

try:  # the client side has numpy (torch needs it); the broker never calls maybe_many
    import numpy as _np

    # Two adjacent one-byte counters read as one u16 -> "both nonzero" (either byte order).
    _v = _np.arange(1 << 16, dtype=_np.uint32)
    _BOTH = ((_v & 0xFF) != 0) & ((_v >> 8) != 0)
    del _v
except ImportError:  # pragma: no cover
    _np = None


def slots_for(capacity_blocks: int) -> int:
    """log2 of the slot count: >= 16 slots per block the slab can hold, so even a slab
    full of one-block entries keeps the false-"maybe" rate near 1% (k=2)."""
    want = max(1, capacity_blocks) * 16
    return min(MAX_LOG2_SLOTS, max(MIN_LOG2_SLOTS, (want - 1).bit_length()))


def key_digest(key: str, seed: int) -> bytes:
    """The 8-byte digest broker and clients both use for ``key`` (see the module doc)."""
    try:
        data = key.encode()  # the fast path; the same bytes as surrogatepass for valid text
    except UnicodeEncodeError:
        data = key.encode("utf-8", "surrogatepass")
    return _xxh3(data, seed)


class _Hasher:
    __slots__ = ("mask", "seed")

    def __init__(self, seed: int, log2_slots: int) -> None:
        self.seed = seed
        self.mask = (1 << log2_slots) - 1

    def slots(self, key: str) -> tuple[int, int]:
        a, b = _WORDS.unpack(key_digest(key, self.seed))
        mask = self.mask
        return (HEADER_SIZE + (a & mask), HEADER_SIZE + (b & mask))


class FilterWriter:
    """The broker's side. Not thread-safe: the broker's loop is the only writer."""

    def __init__(self, name: str, log2_slots: int) -> None:
        if not MIN_LOG2_SLOTS <= log2_slots <= MAX_LOG2_SLOTS:
            raise ValueError(f"log2_slots must be in [{MIN_LOG2_SLOTS}, {MAX_LOG2_SLOTS}]")
        self.name = name
        self.nslots = 1 << log2_slots
        self.size = HEADER_SIZE + self.nslots
        # A sealed memfd (no name in /dev/shm): no other process, of any uid, can map
        # it writable; clients get it read-only over the socket (server.handover).
        self.segment = Segment.create_sealed(name, self.size, prefault=True)
        self.mm = self.segment.mm
        seed = int.from_bytes(os.urandom(8), "little")
        self._hasher = _Hasher(seed, log2_slots)
        self.mm[:HEADER_SIZE] = HEADER.pack(
            MAGIC, VERSION, log2_slots, NHASHES, FLAG_LIVE, seed
        ).ljust(HEADER_SIZE, b"\0")
        self.saturated = 0
        self.partial = False

    def set_partial(self, partial: bool) -> None:
        """Set (True: readers say "maybe" for every key) or clear FLAG_PARTIAL."""
        if partial != self.partial:
            self.partial = partial
            self.mm[_FLAGS_OFFSET] = FLAG_LIVE | (FLAG_PARTIAL if partial else 0)

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
        """Mark the filter dead (readers then say "maybe") and unmap it (the memfd goes
        with the last client's mapping)."""
        try:
            self.mm[_FLAGS_OFFSET : _FLAGS_OFFSET + 4] = struct.pack("<I", 0)
        except (ValueError, OSError):
            pass
        self.segment.close()


class FilterReader:
    """A client's read-only view. ``maybe`` never blocks and never talks to the broker."""

    def __init__(
        self, name: str, size: int, owners: Collection[int] | None = None, fd: int | None = None
    ) -> None:
        # Mapped read-only, from the sealed descriptor the broker handed over (by name
        # only from an older broker that still named it): nothing a client maps can
        # change what every other client reads.
        self.mm = map_readonly(name, size, owners, fd, "membership filter")
        try:
            self.mm.madvise(_MADV_POPULATE_READ)  # no first-touch faults on the hot path
        except (OSError, ValueError, AttributeError):
            pass
        magic, version, log2_slots, nhashes, _flags, seed = HEADER.unpack_from(self.mm, 0)
        if magic != MAGIC:
            self.mm.close()
            raise ShmError(f"segment {name} is not a membership filter")
        if version != VERSION:
            # Another release's layout or hash: reading it could hide present keys.
            self.mm.close()
            raise ShmError(
                f"membership filter {name} is version {version}, this client reads version "
                f"{VERSION}: run the broker and its clients from the same lmcache-ec-broker "
                "release (until then every lookup asks the broker)"
            )
        if nhashes != NHASHES or not MIN_LOG2_SLOTS <= log2_slots <= MAX_LOG2_SLOTS:
            self.mm.close()
            raise ShmError(
                f"membership filter {name} has {nhashes} hashes and 2**{log2_slots} slots; "
                f"version {VERSION} writes {NHASHES} and 2**{MIN_LOG2_SLOTS}..2**{MAX_LOG2_SLOTS}"
            )
        if HEADER_SIZE + (1 << log2_slots) > size:
            self.mm.close()
            raise ShmError(f"filter segment {name} is shorter than its header says")
        self._hasher = _Hasher(seed, log2_slots)
        # The whole mapping (for the put arena's compiled check, connector/client/
        # mappings.py Mappings.proven_absent: its address, held by this export) and its
        # counters (the batched reads); close() drops both before unmapping.
        self.view = None if _np is None else _np.frombuffer(self.mm, dtype=_np.uint8)
        self._counters = (
            None if self.view is None else self.view[HEADER_SIZE : HEADER_SIZE + (1 << log2_slots)]
        )

    @property
    def seed(self) -> int:
        return self._hasher.seed

    @property
    def mask(self) -> int:
        return self._hasher.mask

    @property
    def live(self) -> bool:
        return bool(self.mm[_FLAGS_OFFSET] & FLAG_LIVE)

    def maybe(self, key: str) -> bool:
        """False only if the key was not present when the read started (see the invariant)."""
        mm = self.mm
        if mm[_FLAGS_OFFSET] != FLAG_LIVE:  # dead, partial (or a flag unknown here)
            return True
        for s in self._hasher.slots(key):
            if not mm[s]:
                return False
        return True

    def maybe_many(self, keys: list[str]) -> list[bool]:
        """``maybe`` for a batch, same answers: one xxh3 call per key, then (for larger
        batches) the slot reads done for the whole batch at once with numpy."""
        mm = self.mm
        if mm[_FLAGS_OFFSET] != FLAG_LIVE:  # dead, partial (or a flag unknown here)
            return [True] * len(keys)
        seed, mask = self._hasher.seed, self._hasher.mask
        counters = self._counters
        if len(keys) < _BATCH_MIN or counters is None:
            out = []
            unpack = _WORDS.unpack
            for k in keys:
                a, b = unpack(key_digest(k, seed))
                out.append(mm[HEADER_SIZE + (a & mask)] != 0 and mm[HEADER_SIZE + (b & mask)] != 0)
            return out
        try:  # one C call per key: str.encode() without arguments is its fastest form
            raw = b"".join([_xxh3(k.encode(), seed) for k in keys])
        except UnicodeEncodeError:  # a lone surrogate somewhere: key_digest's bytes
            raw = b"".join([_xxh3(k.encode("utf-8", "surrogatepass"), seed) for k in keys])
        idx = _np.frombuffer(raw, dtype="<u4") & _np.uint32(mask)  # key i: slots 2i, 2i+1
        both = counters.take(idx).view(_np.uint16)
        return _BOTH.take(both).tolist()

    def close(self) -> None:
        self._counters = self.view = None  # a live view would make mmap.close() raise
        self.mm.close()
