"""The residency index: where each READY slab entry lies, published for clients.

The broker (the only writer) keeps an open-addressing table in shared memory,
next to the slab, with one slot per READY entry it could index: the key, its
extents in the slab, nbytes, dtype and shape. Clients map it read-only and answer
a ``has()`` hit, or copy a ``get``, without a round trip (connector/residency_read.py).

Only POSITIVES are trusted: a key the index lacks (never indexed, too long, its
probe window full, a slot being rewritten) is asked of the broker as before, so
the index can make an answer cheaper, never different.

Layout: a 64-byte header, then ``nslots`` slots of ``SLOT_BYTES`` bytes.

    header: magic 8s | version u32 | log2_slots u32 | flags u32 | slot_bytes u32
            | seed u64 | slab_size u64 | pad
    slot:   seq u64 (native) | gen u64 | nbytes u64 | keylen u16 | dtype u8
            | ndim u8 | nextents u8 | pad 3 | shape 6 x u64 | extents 4 x (u64, u64)
            | key bytes (KEY_CAP)

A key's home slot is the low bits of the xxh3-64 of its UTF-8 bytes (surrogatepass)
seeded with this header's seed (the filter's hash, its own seed); it lives in one
of the ``PROBES`` slots from there.

Seqlock (what makes a positive exact): ``seq`` is odd while the broker rewrites a
slot and bumps by one before and after every rewrite; ``gen`` is a broker-wide
count of published entries (never reused). A reader reads ``seq``, then the
fields (and, for a get, the slab bytes), then ``seq`` again, and trusts what it
read only if both reads are the same even value. ``seq`` is a native-order 8-byte
word written and read with one aligned 8-byte access (struct "@Q").

The writer's invariant (broker/store.py keeps it): a slot names a key's blocks
only while that key's entry is READY with those blocks. ``withdraw`` (seq odd,
slot cleared, seq even) runs BEFORE the entry's blocks can return to the
allocator or become writable by anyone (evict, delete, clear), and ``publish``
only AFTER the bytes are in place (commit, placement). Any later writer of those
blocks obtained them over the socket after the withdraw (a grant or reservation
reply), so by x86-TSO (stores seen in order, loads not reordered with loads, and
causality through the socket) a reader that saw their bytes also sees the bumped
``seq`` when it re-reads it. Hence an unchanged even ``seq`` means the bytes read
were the entry's, untorn. Python cannot issue a load fence, so clients use the
index only on x86-64 (``usable_here``).

Liveness: a broker that stops cleanly clears FLAG_LIVE; a killed one cannot, so
the client trusts the index only while its connection was confirmed recently, as
it does the membership filter. A restarted broker publishes a new index (a
new sealed memfd) that the client maps from the new handshake.
"""

from __future__ import annotations

import array
import os
import platform
import struct
from collections.abc import Collection

import xxhash

from ..protocol import DTYPE_ITEMSIZE, Extent
from .segment import Segment, ShmError, map_readonly

try:  # the client side has numpy (torch needs it); the broker never copies from the index
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is in the torch extra
    _np = None
try:  # compiled when the package was built (an optional extension: see _residency_copy.c)
    from ._residency_copy import ABSENT, CHANGED, COPIED, LAYOUT
    from ._residency_copy import contains as _contains_compiled
    from ._residency_copy import copy_into as _copy_into
    from ._residency_copy import find as _find_compiled
except ImportError:  # built without a C compiler: the Python reader below
    _copy_into = _find_compiled = _contains_compiled = None
    ABSENT, COPIED, CHANGED = 0, 1, 2
    LAYOUT = ()

MAGIC = b"LMECRES1"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQQ")
HEADER_SIZE = 64
FLAG_LIVE = 1
_FLAGS_OFFSET = 16
SLOT_BYTES = 256
MAX_DIMS = 6
MAX_EXTENTS = 4
_FIXED = struct.Struct("<QQHBBB3x6Q8Q")  # gen .. extents; at offset 8 of a slot
_FIXED_AT = 8
KEY_AT = _FIXED_AT + _FIXED.size  # 144
KEY_CAP = SLOT_BYTES - KEY_AT  # 112 bytes of UTF-8
SEQ = struct.Struct("@Q")  # native: one aligned 8-byte load/store (see the module doc)
_SEQ_MASK = (1 << 64) - 1  # the word wraps (after 2**63 rewrites of one slot); 2**64 is even
_KEYLEN = struct.Struct("<H")
_KEYLEN_AT = 24  # the keylen field of _FIXED, from the slot's start
_xxh3 = xxhash.xxh3_64_intdigest
PROBES = 8
MIN_LOG2_SLOTS = 10
MAX_LOG2_SLOTS = 18  # 64 MiB at most; more entries than that fall back to the broker
# dtype codes: positions in the protocol's dtype table (the same release on both
# sides: the version check refuses another layout); 0 = none.
DTYPES: tuple[str, ...] = ("",) + tuple(DTYPE_ITEMSIZE)
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES) if name}
_ITEMSIZES = bytes([0] + [DTYPE_ITEMSIZE[name] for name in DTYPES[1:]])  # the compiled find's
# The layout as _residency_copy.c spells it (its LAYOUT): a stale build of another
# layout is not used -- the Python reader is.
_LAYOUT = (
    HEADER_SIZE, _FLAGS_OFFSET, FLAG_LIVE, SLOT_BYTES, _FIXED_AT + 8, _KEYLEN_AT,
    _KEYLEN_AT + 2, _KEYLEN_AT + 3, _KEYLEN_AT + 4, _FIXED_AT + 24, _FIXED_AT + 24 + 8 * MAX_DIMS,
    KEY_AT, KEY_CAP, MAX_DIMS, MAX_EXTENTS, PROBES,
)  # fmt: skip
if LAYOUT != _LAYOUT:
    _copy_into = _find_compiled = _contains_compiled = None
_MADV_POPULATE_READ = 22


def usable_here() -> bool:
    """The reader's argument needs x86-TSO load ordering (see the module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def slots_for(nblocks: int) -> int:
    """log2 of the slot count: twice the most entries the slab can hold, a power of two."""
    want = max(1, nblocks) * 2
    return min(MAX_LOG2_SLOTS, max(MIN_LOG2_SLOTS, (want - 1).bit_length()))


def index_size(log2_slots: int) -> int:
    return HEADER_SIZE + (SLOT_BYTES << log2_slots)


def encode_key(key: str) -> bytes:
    try:
        return key.encode()
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")


class ResidencyWriter:
    """The broker's side. Not thread-safe: the broker's loop is the only writer."""

    def __init__(self, name: str, log2_slots: int, slab_size: int) -> None:
        if not MIN_LOG2_SLOTS <= log2_slots <= MAX_LOG2_SLOTS:
            raise ValueError(f"log2_slots must be in [{MIN_LOG2_SLOTS}, {MAX_LOG2_SLOTS}]")
        self.name = name
        self.nslots = 1 << log2_slots
        self._mask = self.nslots - 1
        self.size = index_size(log2_slots)
        # A sealed memfd (no name in /dev/shm): no other process, of any uid, can map
        # it writable, so no one but this writer can forge a slot; clients get it
        # read-only over the socket (server.handover). Not prefaulted: pages are
        # charged as slots are first written.
        self.segment = Segment.create_sealed(name, self.size)
        self.mm = self.segment.mm
        self.seed = int.from_bytes(os.urandom(8), "little")
        self.mm[:HEADER_SIZE] = HEADER.pack(
            MAGIC, VERSION, log2_slots, FLAG_LIVE, SLOT_BYTES, self.seed, slab_size
        ).ljust(HEADER_SIZE, b"\0")
        self._slot_of: dict[str, int] = {}  # indexed key -> its slot
        self._used = bytearray(self.nslots)  # 1 where a slot holds a key
        # Each slot's seq, the broker's copy (always even here): published, never read
        # back from the segment, which another process may have rewritten.
        self._seq = array.array("Q", bytes(8 * self.nslots))
        self._gen = 0
        self.unindexed = 0  # entries not indexed (long key, many extents/dims, full window)

    def publish(
        self, key: str, nbytes: int, dtype: str, shape: list[int], extents: list[Extent]
    ) -> bool:
        """Index a key whose entry just became READY (its bytes are in place)."""
        if key in self._slot_of:
            self.withdraw(key)  # never two slots for one key
        kb = encode_key(key)
        code = DTYPE_CODE.get(dtype, 0)
        if (
            len(kb) > KEY_CAP
            or not kb
            or not code
            or len(shape) > MAX_DIMS
            or len(extents) > MAX_EXTENTS
        ):
            self.unindexed += 1
            return False
        home = _xxh3(kb, self.seed) & self._mask
        used = self._used
        for i in range(PROBES):
            slot = (home + i) & self._mask
            if not used[slot]:
                break
        else:
            self.unindexed += 1
            return False
        self._gen += 1
        flat_shape = list(shape) + [0] * (MAX_DIMS - len(shape))
        flat_ext: list[int] = []
        for off, n in extents:
            flat_ext += (off, n)
        flat_ext += [0] * (2 * MAX_EXTENTS - len(flat_ext))
        mm = self.mm
        at = HEADER_SIZE + slot * SLOT_BYTES
        seq = self._seq[slot]
        SEQ.pack_into(mm, at, seq + 1)  # odd: being rewritten
        _FIXED.pack_into(
            mm, at + _FIXED_AT, self._gen, nbytes, len(kb), code, len(shape), len(extents),
            *flat_shape, *flat_ext,
        )  # fmt: skip
        mm[at + KEY_AT : at + KEY_AT + len(kb)] = kb
        seq = (seq + 2) & _SEQ_MASK
        SEQ.pack_into(mm, at, seq)  # even: readable
        self._seq[slot] = seq
        used[slot] = 1
        self._slot_of[key] = slot
        return True

    def withdraw(self, key: str) -> None:
        """Unindex ``key``; call BEFORE its blocks may be freed or written (module doc)."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return
        mm = self.mm
        at = HEADER_SIZE + slot * SLOT_BYTES
        seq = self._seq[slot]
        SEQ.pack_into(mm, at, seq + 1)
        mm[at + _FIXED_AT : at + KEY_AT] = bytes(KEY_AT - _FIXED_AT)  # keylen 0: empty
        seq = (seq + 2) & _SEQ_MASK
        SEQ.pack_into(mm, at, seq)
        self._seq[slot] = seq
        self._used[slot] = 0

    def holds(self, key: str) -> bool:
        """Whether ``key`` is indexed now (a client can copy it without asking)."""
        return key in self._slot_of

    @property
    def entries(self) -> int:
        return len(self._slot_of)

    def close(self) -> None:
        """Mark the index dead (readers then ask the broker) and unmap it (the memfd
        goes with the last client's mapping)."""
        try:
            struct.pack_into("<I", self.mm, _FLAGS_OFFSET, 0)
        except (ValueError, OSError):
            pass
        self.segment.close()


class Found:
    """One positive read from the index: where the entry lies, and the slot's ``seq``
    to confirm against after a copy (``ResidencyReader.unchanged``)."""

    __slots__ = ("at", "dtype", "extents", "gen", "nbytes", "seq", "shape")

    def __init__(
        self, at: int, seq: int, gen: int, nbytes: int, dtype: str, shape: list[int],
        extents: list[Extent],
    ) -> None:  # fmt: skip
        self.at = at
        self.seq = seq
        self.gen = gen
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = shape
        self.extents = extents


class ResidencyReader:
    """A client's read-only view; never blocks, never talks to the broker."""

    def __init__(
        self,
        name: str,
        size: int,
        slab_size: int,
        owners: Collection[int] | None = None,
        fd: int | None = None,
    ) -> None:
        if not isinstance(size, int) or size < HEADER_SIZE:
            raise ShmError(f"index {name} announced with {size!r} bytes")
        # Read-only, from the broker's sealed descriptor (by name only from an older
        # broker); the owner is checked first: another user's index could point
        # anywhere in the slab.
        self.mm = map_readonly(name, size, owners, fd, "residency index")
        try:
            self.mm.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError, AttributeError):
            pass
        magic, version, log2_slots, _flags, slot_bytes, seed, slab = HEADER.unpack_from(self.mm)
        problem = None
        if magic != MAGIC:
            problem = "is not a residency index"
        elif version != VERSION or slot_bytes != SLOT_BYTES:
            problem = (
                f"is version {version}, this client reads version {VERSION}: run the broker "
                "and its clients from the same lmcache-ec-broker release"
            )
        elif not MIN_LOG2_SLOTS <= log2_slots <= MAX_LOG2_SLOTS or index_size(log2_slots) > size:
            problem = f"announces 2**{log2_slots} slots, more than its {size} bytes hold"
        elif slab != slab_size:
            problem = f"describes a {slab}-byte slab, the broker announced {slab_size}"
        if problem is not None:
            self.mm.close()
            raise ShmError(f"residency index {name} {problem}")
        self.seed = seed
        self.mask = (1 << log2_slots) - 1
        self.slab_size = slab_size
        # For the compiled copy: the mapping's address, through a numpy view that holds
        # an export of it (the mapping cannot be closed while the view lives, and every
        # call passes the view along, so not during a call either); close() drops it.
        self._view = None
        self._addr = 0
        if _copy_into is not None and _np is not None:
            self._view = _np.frombuffer(self.mm, dtype=_np.uint8)
            self._addr = self._view.ctypes.data

    @property
    def compiled(self) -> bool:
        """Whether ``copy_into`` runs the compiled copy (else the caller takes ``find``)."""
        return self._view is not None

    @property
    def live(self) -> bool:
        return bool(self.mm[_FLAGS_OFFSET] & FLAG_LIVE)

    def find(self, key: str) -> Found | None:
        """The entry ``key`` if the index holds it, consistent and inside the slab; None
        otherwise (ask the broker). A corrupt slot is a None, never an exception.
        Compiled when the package has the extension (the same answers as
        ``_find_python``: tests/test_residency_copy.py)."""
        view = self._view
        if view is None:
            return self._find_python(key)
        kb = encode_key(key)
        mask = self.mask
        got = _find_compiled(
            view, self._addr, view.nbytes, mask, _xxh3(kb, self.seed) & mask, kb,
            self.slab_size, _ITEMSIZES,
        )  # fmt: skip
        if got is None:
            return None
        at, seq, gen, nbytes, code, shape, extents = got
        return Found(at, seq, gen, nbytes, DTYPES[code], list(shape), list(extents))

    def _find_python(self, key: str) -> Found | None:
        """``find`` without the extension (and the reference its tests compare with)."""
        mm = self.mm
        if not mm[_FLAGS_OFFSET] & FLAG_LIVE:
            return None
        kb = encode_key(key)
        n = len(kb)
        if not n or n > KEY_CAP:
            return None
        home = _xxh3(kb, self.seed) & self.mask
        seq_from, fixed_from, mask = SEQ.unpack_from, _FIXED.unpack_from, self.mask
        for i in range(PROBES):
            at = HEADER_SIZE + ((home + i) & mask) * SLOT_BYTES
            (seq,) = seq_from(mm, at)
            if seq & 1:
                continue
            f = fixed_from(mm, at + _FIXED_AT)
            if f[2] != n or mm[at + KEY_AT : at + KEY_AT + n] != kb:
                continue
            if seq_from(mm, at)[0] != seq:
                return None  # rewritten under us: ask
            return self._checked(at, seq, f)
        return None

    def contains(self, key: str) -> bool:
        """``find(key) is not None`` without decoding the entry (has() needs no more;
        a get checks every field it copies by). Compiled when the package has it."""
        view = self._view
        if view is None:
            return self._contains_python(key)
        kb = encode_key(key)
        mask = self.mask
        return _contains_compiled(
            view, self._addr, view.nbytes, mask, _xxh3(kb, self.seed) & mask, kb
        )

    def _contains_python(self, key: str) -> bool:
        mm = self.mm
        if not mm[_FLAGS_OFFSET] & FLAG_LIVE:
            return False
        try:
            kb = key.encode()
        except UnicodeEncodeError:
            kb = key.encode("utf-8", "surrogatepass")
        n = len(kb)
        if not n or n > KEY_CAP:
            return False
        home = _xxh3(kb, self.seed)
        seq_from, len_from, mask = SEQ.unpack_from, _KEYLEN.unpack_from, self.mask
        for i in range(PROBES):
            at = HEADER_SIZE + ((home + i) & mask) * SLOT_BYTES
            (seq,) = seq_from(mm, at)
            if (
                not seq & 1
                and len_from(mm, at + _KEYLEN_AT)[0] == n
                and mm[at + KEY_AT : at + KEY_AT + n] == kb
            ):
                return seq_from(mm, at)[0] == seq
        return False

    def _checked(self, at: int, seq: int, f: tuple[int, ...]) -> Found | None:
        """Bounds-check every field against the slab and the dtype table."""
        gen, nbytes, _keylen, code, ndim, next_ = f[:6]
        if not 0 < code < len(DTYPES) or ndim > MAX_DIMS or not 0 < next_ <= MAX_EXTENTS:
            return None
        dtype = DTYPES[code]
        shape = list(f[6 : 6 + ndim])
        count = 1
        for d in shape:
            count *= d
        if count * DTYPE_ITEMSIZE[dtype] != nbytes:
            return None
        raw = f[6 + MAX_DIMS :]
        extents: list[Extent] = []
        total = 0
        size = self.slab_size
        for j in range(next_):
            off, ln = raw[2 * j], raw[2 * j + 1]
            if ln <= 0 or off + ln > size:
                return None
            extents.append((off, ln))
            total += ln
        if total != nbytes:
            return None
        return Found(at, seq, gen, nbytes, dtype, shape, extents)

    def unchanged(self, found: Found) -> bool:
        """True if the slot was not rewritten since ``find``: what was copied from its
        extents in between is the entry's bytes (the module doc's argument)."""
        return SEQ.unpack_from(self.mm, found.at)[0] == found.seq and bool(
            self.mm[_FLAGS_OFFSET] & FLAG_LIVE
        )

    def copy_into(
        self, key: str, dst: int, nbytes: int, dtype: str, shape: tuple[int, ...],
        slab_base: int, slab_size: int,
    ) -> int:  # fmt: skip
        """``find`` + the copy + ``unchanged`` in one compiled call (``compiled`` must be
        True): copy ``key``'s entry into the ``nbytes`` bytes at ``dst`` (a contiguous CPU
        tensor's, of the same dtype and shape) from the slab mapped at ``slab_base``.
        ABSENT: ``dst`` untouched (not indexed, or not this dtype and shape: ask the
        broker); COPIED: ``dst`` holds the entry's bytes; CHANGED: ``dst`` was written but
        the slot changed, its bytes must not be shown. Exactly the answers of the Python
        path (tests/test_residency_copy.py compares them on corrupt slots too)."""
        view = self._view
        code = DTYPE_CODE.get(dtype, 0)
        if view is None or not code:
            return ABSENT
        kb = encode_key(key)
        mask = self.mask
        return _copy_into(
            view, self._addr, view.nbytes, mask, _xxh3(kb, self.seed) & mask, kb,
            slab_base, slab_size, dst, nbytes, code, shape,
        )  # fmt: skip

    def close(self) -> None:
        self._view = None  # its export first: a mapping with exports cannot close
        try:
            self.mm.close()
        except BufferError:  # a compiled read in another thread holds the view still:
            pass  # the mapping goes with the last export (as Segment.close leaves it)
