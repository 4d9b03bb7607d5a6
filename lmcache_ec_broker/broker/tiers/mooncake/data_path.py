"""Mooncake Store's data path for the remote tier: entries move between the broker's
slab and the cluster's memory pool with no copy of ours in between.

- write-behind is ``batch_put_from_multi_buffers``: one Mooncake object per entry,
  gathered from [header slot, slab extent 1, extent 2, ...] -- the transfer engine
  reads the pinned extents itself (from 8 MiB a put session: payload first while it
  is checksummed, header last, readable only when whole);
- promotion is ``batch_get_into_multi_buffers``: the object scattered into
  [header slot, reserved extent 1, ...]; the header and the checksum are checked
  before it counts (from 4 MiB: ranged chunks, each checksummed while the next moves);
- lookup reads only the headers, for a whole batch in one ``get_into_ranges`` call.

Header slots live in a small registered mapping of this module's own (never in the
slab): a slot belongs to one Mooncake call and is freed by the thread that made the
call when it returns, so a call that outlives its deadline never writes into memory
someone else was given.

Mooncake's ``put`` never overwrites: a write of a key whose stored value was refused
removes it first (``force``), so the fresh value replaces it.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from ....protocol import Extent
from ..base import EntryMeta, SlabAccess, TierMiss
from ..remote.tier import Meter
from ..remote.transport import LookupAnswer, Outcome, Retry, StoreDown, WriteItem
from ..remote.value import (
    FIXED,
    MAX_HEADER,
    BadValue,
    Header,
    Verifier,
    checksum,
    default_algo,
    encode_header,
    fixed_lengths,
    parse_header,
)
from .settings import MooncakeSettings

# Mooncake error codes (mooncake-store/include/types.h)
NO_SPACE = -200
INVALID_PARAMS = -600
NOT_FOUND = -704
HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

MASTER = "mooncake master"  # the one node of a Mooncake store (its breaker)
SLOT = 8192  # one header slot: >= MAX_HEADER, page-friendly
PROBE = 512  # header bytes read per key at lookup (a typical header is ~150-300 bytes)
BATCH_WRITES = 32
BATCH_WRITE_BYTES = 256 << 20
LOOKUP_CHUNK = 64  # keys per batched header read (each needs a header slot)
# Batches from this size on are written in a put session that overlaps the checksum
# with the transfer (measured: 0.25x -> 0.99x of a bare put_from at 130 MiB); below
# it the session's three extra round trips cost more than the overlap saves.
_SESSION_MIN_BYTES = 8 << 20
# Promotions from this size on read in ranged chunks (about a quarter of the entry,
# at least 2 MiB), checksumming one while the next moves.
_PIPELINE_MIN_BYTES = 4 << 20
_PIPELINE_CHUNK = 2 << 20
_PIPELINE_PARTS = 4
# A get no lookup preceded (``fetch``) reads an object up to this size (header +
# payload: every entry below the pipelined size) in ONE transfer into a staging
# buffer of the tier's own, because the slab range can only be reserved once the
# header has said dtype and shape; the verified payload is then copied into the
# range (measured at 2 MiB: a memcpy ~0.2 ms against a second transfer plus a
# second thread hand-off ~0.5-0.8 ms). Larger objects: their header, then the
# pipelined read straight into the range.
STAGE_BYTES = _PIPELINE_MIN_BYTES + SLOT
STAGES = 2  # = the tier's read threads; a fetch finding none free looks up instead
_UNSTAGE_CHUNK = 256 << 10  # copied then checksummed while still in the cache


class Slots:
    """Fixed-size slots (header slots; staging buffers) in one registered anonymous
    mapping of our own."""

    def __init__(self, count: int, slot_size: int = SLOT) -> None:
        self.slot_size = slot_size
        self.mm = mmap.mmap(-1, count * slot_size)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = count * slot_size
        self._free = list(range(count))
        self._lock = threading.Condition()

    def take(self, n: int, wait_s: float = 0.0) -> list[int]:
        """``n`` free slots, waiting up to ``wait_s``; Retry (not the store's fault) if not."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._free) >= n, wait_s):
                raise Retry(0.05, "Mooncake tier busy (no free header slots)")
            got, self._free[-n:] = self._free[-n:], []
            return got

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            self._lock.notify_all()

    def ptr(self, slot: int) -> int:
        return self.address + slot * self.slot_size

    def read(self, slot: int, n: int) -> bytes:
        at = slot * self.slot_size
        return bytes(self.mm[at : at + n])

    def write(self, slot: int, data: bytes) -> None:
        at = slot * self.slot_size
        self.mm[at : at + len(data)] = data

    def try_take(self) -> int | None:
        """One free slot now, or None (no wait)."""
        with self._lock:
            return self._free.pop() if self._free else None


def chunk_extents(extents: list[Extent], chunk: int) -> list[list[Extent]]:
    """The extents cut into consecutive chunks of about ``chunk`` bytes (payload order)."""
    out: list[list[Extent]] = []
    cur: list[Extent] = []
    room = chunk
    for start, n in extents:
        while n > 0:
            take = min(n, room)
            cur.append((start, take))
            start, n, room = start + take, n - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk
    if cur:
        out.append(cur)
    return out


def _offsets(start: int, extents: list[Extent]) -> list[int]:
    """Destination offsets of the non-empty extents in an object whose payload begins at ``start``."""
    out, pos = [], start
    for _, n in extents:
        if n:
            out.append(pos)
        pos += n
    return out


def _down(why: str) -> StoreDown:
    return StoreDown([MASTER], why)


class Fetched(msgspec.Struct, frozen=True):
    """What a fetch's transfer found: the value's meta from its checked header and,
    when ``staged``, the whole value in a staging buffer (payload after the header),
    its checksum not verified yet: ``unstage`` does it."""

    meta: EntryMeta
    header: Header
    staged: bool


class MooncakeIO:
    """Reads, writes and header lookups against one connected store client."""

    def __init__(
        self, settings: MooncakeSettings, slots: Slots, meter: Meter, stages: Slots | None = None
    ) -> None:
        self.s = settings
        self.slots = slots
        self.stages = stages
        self.meter = meter
        self._lock = threading.Lock()
        self._header_sizes: collections.OrderedDict[str, int] = collections.OrderedDict()
        # one thread: a pipelined read's chunks are checksummed in order
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ecb-mooncake-hash")

    def close(self) -> None:
        self._hasher.shutdown(wait=False)

    def mkey(self, key: str) -> str:
        return self.s.key_prefix + key

    def limit(self, slab: SlabAccess | None) -> int:
        return self.s.max_entry_size or (slab.size if slab else 1 << 62)

    def _remember_size(self, key: str, size: int) -> None:
        with self._lock:
            self._header_sizes[key] = size
            self._header_sizes.move_to_end(key)
            while len(self._header_sizes) > 65536:
                self._header_sizes.popitem(last=False)

    def _header_size(self, key: str, meta: EntryMeta) -> int:
        with self._lock:
            hsize = self._header_sizes.get(key)
        return hsize if hsize is not None else len(self.expected_header(key, meta))

    def expected_header(self, key: str, meta: EntryMeta) -> bytes:
        algo = default_algo(self.s.hmac_key)
        return encode_header(
            key, meta.dtype, list(meta.shape), bytes(32), meta.nbytes, algo, self.s.hmac_key
        )

    # ------------------------------------------------------------ headers

    def _ranged(self, store: Any, keys: list[str], slots: list[int], sizes: list[int]) -> list[int]:
        res = store.get_into_ranges(
            [self.slots.ptr(s) for s in slots],
            [[self.mkey(k)] for k in keys],
            [[[0]] for _ in keys],
            [[[0]] for _ in keys],
            [[[n]] for n in sizes],
        )
        out = [int(r[0][0]) if r and r[0] else RPC_FAIL for r in res]
        if any(rc == RPC_FAIL for rc in out):
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        return out

    def read_headers(self, store: Any, keys: list[str]) -> list[bytes | int | BadValue]:
        """Per key its whole header's bytes, a negative Mooncake code, or BadValue."""
        out: list[bytes | int | BadValue] = []
        t0 = time.perf_counter()
        for lo in range(0, len(keys), LOOKUP_CHUNK):
            out += self._header_chunk(store, keys[lo : lo + LOOKUP_CHUNK])
        self.meter.observe(time.perf_counter() - t0)
        return out

    def _header_chunk(self, store: Any, keys: list[str]) -> list[bytes | int | BadValue]:
        slots = self.slots.take(len(keys), self.s.timeout_s)
        out: list[bytes | int | BadValue] = [NOT_FOUND] * len(keys)
        try:
            first = self._ranged(store, keys, slots, [PROBE] * len(keys))
            again: list[tuple[int, int]] = []  # (index, length to read)
            for j, rc in enumerate(first):
                if rc == INVALID_PARAMS:  # object shorter than the probe: read its fixed part
                    again.append((j, FIXED.size))
                elif rc < 0:
                    out[j] = rc
                else:
                    data = self.slots.read(slots[j], PROBE)
                    try:
                        hsize, _ = fixed_lengths(data)
                    except BadValue as exc:
                        out[j] = exc
                        continue
                    if hsize > PROBE:
                        again.append((j, hsize))
                    else:
                        out[j] = data
            if again:
                got = self._ranged(
                    store, [keys[j] for j, _ in again], [slots[j] for j, _ in again],
                    [n for _, n in again],
                )  # fmt: skip
                for (j, n), rc in zip(again, got, strict=True):
                    if rc < 0:
                        out[j] = (
                            BadValue("object is shorter than a value header")
                            if rc == INVALID_PARAMS
                            else rc
                        )
                        continue
                    data = self.slots.read(slots[j], n)
                    try:
                        hsize, _ = fixed_lengths(data)
                    except BadValue as exc:
                        out[j] = exc
                        continue
                    if hsize > n:  # only the fixed part was read: now the whole header
                        rc2 = self._ranged(store, [keys[j]], [slots[j]], [hsize])[0]
                        if rc2 < 0:
                            out[j] = rc2
                            continue
                        data = self.slots.read(slots[j], hsize)
                    out[j] = data
        finally:
            self.slots.give(slots)
        return out

    def lookup(self, store: Any, keys: list[str], slab: SlabAccess | None) -> list[LookupAnswer]:
        out: list[LookupAnswer] = []
        for key, got in zip(keys, self.read_headers(store, keys), strict=True):
            if isinstance(got, BadValue):
                out.append(got)
            elif isinstance(got, int):
                if got != NOT_FOUND:
                    self.meter.count("remote_read_errors")
                out.append(None)
            else:
                try:
                    h = parse_header(got, key, self.limit(slab), self.s.hmac_key)
                except BadValue as exc:
                    out.append(exc)
                    continue
                self._remember_size(key, h.size)
                out.append(EntryMeta(h.nbytes, h.dtype, h.shape))
        return out

    # ------------------------------------------------------------ fetch: a get no lookup preceded

    def _object_size(self, store: Any, mkey: str, key: str) -> int:
        """The stored object's size in bytes (a master RPC, no transfer). Raises
        StoreDown (master unreachable) or TierMiss (absent, or the call failed)."""
        size = int(store.get_size(mkey))
        if size == RPC_FAIL:
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        if size == NOT_FOUND:
            raise TierMiss(key)
        if size < 0:
            self.meter.count("remote_read_errors")
            raise TierMiss(f"{key}: Mooncake get_size failed ({size})")
        return size

    def fetch(self, store: Any, key: str, stage: int, slab: SlabAccess | None) -> Fetched:
        """The value of ``key`` with no lookup before it: the whole object in one
        transfer into staging buffer ``stage`` (``get_into`` with the stage's size: it
        moves an object up to that size and answers its length, so no master RPC asks
        the size first -- measured 90-120 us a hit), its header parsed (exact total
        length) and its payload checksummed there. An object larger than a staging
        buffer (``get_into`` refuses it, -600): its size, then only its header
        (``staged`` False; the caller reserves, then ``read_into``). Raises TierMiss,
        BadValue, StoreDown."""
        assert self.stages is not None
        mkey = self.mkey(key)
        t0 = time.perf_counter()
        rc = int(store.get_into(mkey, self.stages.ptr(stage), self.stages.slot_size))
        if rc == INVALID_PARAMS:  # larger than a stage (or replaced by one meanwhile)
            size = self._object_size(store, mkey, key)
            if size <= self.stages.slot_size:
                self.meter.count("remote_read_errors")
                raise TierMiss(f"{key}: Mooncake read failed ({rc}, object {size} bytes)")
            got = self.read_headers(store, [key])[0]
            if isinstance(got, BadValue):
                raise got
            if isinstance(got, int):
                if got != NOT_FOUND:
                    self.meter.count("remote_read_errors")
                raise TierMiss(key)
            h = parse_header(got, key, self.limit(slab), self.s.hmac_key, size)
            self._remember_size(key, h.size)
            return Fetched(EntryMeta(h.nbytes, h.dtype, h.shape), h, False)
        if rc == RPC_FAIL:
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        if rc == NOT_FOUND:
            raise TierMiss(key)
        if rc < 0:
            self.meter.count("remote_read_errors")
            raise TierMiss(f"{key}: Mooncake read failed ({rc})")
        # get_into moves the whole object or fails: rc is its length, checked exactly.
        at = stage * self.stages.slot_size
        h = parse_header(
            self.stages.mm[at : at + min(rc, MAX_HEADER)], key, self.limit(slab),
            self.s.hmac_key, rc,
        )  # fmt: skip
        self.meter.observe(time.perf_counter() - t0)
        self.meter.count("remote_staged_reads")
        return Fetched(EntryMeta(h.nbytes, h.dtype, h.shape), h, True)

    def unstage(self, stage: int, fetched: Fetched, extents: list[Extent], slab: SlabAccess) -> None:
        """Copy a staged payload into the extents reserved for it (exactly its length:
        the caller checked), checksumming each piece in the slab right after its copy
        (still in the cache: measured at 2 MiB, 0.45 ms against 0.63 ms for a checksum
        of the staging buffer and then the copy). BadValue on a mismatch: the caller
        must then abort the reservation -- nothing was visible."""
        assert self.stages is not None
        pos = stage * self.stages.slot_size + fetched.header.size
        v = Verifier(fetched.header)
        with memoryview(self.stages.mm) as src, slab.views(extents) as views:
            for view in views:
                for lo in range(0, len(view), _UNSTAGE_CHUNK):
                    with view[lo : lo + _UNSTAGE_CHUNK] as piece:
                        piece[:] = src[pos : pos + len(piece)]
                        v.update(piece)
                        pos += len(piece)
        v.finish()
        self.meter.count("remote_bytes_read", fetched.meta.nbytes)

    # ------------------------------------------------------------ reads

    def read_into(
        self, store: Any, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess
    ) -> None:
        slot = self.slots.take(1, self.s.timeout_s)[0]
        try:
            if meta.nbytes >= _PIPELINE_MIN_BYTES:
                self._read_pipelined(store, key, meta, extents, slot, slab)
            else:
                self._read_small(store, key, meta, extents, slot, slab)
        finally:
            self.slots.give([slot])

    def _read_small(
        self, store: Any, key: str, meta: EntryMeta, extents: list[Extent], slot: int,
        slab: SlabAccess,
    ) -> None:  # fmt: skip
        hsize = self._header_size(key, meta)
        ptrs = [self.slots.ptr(slot)] + [slab.address + start for start, _ in extents]
        sizes = [hsize] + [n for _, n in extents]
        total = sum(sizes)
        t0 = time.perf_counter()
        rc = int(store.batch_get_into_multi_buffers([self.mkey(key)], [ptrs], [sizes])[0])
        if rc == RPC_FAIL:
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        if rc == NOT_FOUND:
            raise TierMiss(key)
        if rc in (INVALID_PARAMS, TRANSFER_FAIL):
            # Sizes that do not add up to the object fail the transfer too
            # (-600 short, -800 long): tell a bad value from a dead peer.
            size = int(store.get_size(self.mkey(key)))
            if size == NOT_FOUND:
                raise TierMiss(key)
            if size >= 0 and size != total:
                raise BadValue(f"object is {size} bytes, its header implies {total}")
        if rc < 0:
            self.meter.count("remote_read_errors")
            raise TierMiss(f"{key}: Mooncake read failed ({rc})")
        if rc != total:
            raise BadValue(f"read {rc} bytes, expected {total}")
        h = parse_header(
            self.slots.read(slot, hsize), key, self.limit(slab), self.s.hmac_key, total
        )
        _check_meta(h.nbytes, h.dtype, h.shape, meta)
        v = Verifier(h)
        with slab.views(extents) as views:
            for view in views:
                v.update(view)
        v.finish()
        self.meter.observe(time.perf_counter() - t0)
        self.meter.count("remote_bytes_read", meta.nbytes)

    def _read_pipelined(
        self, store: Any, key: str, meta: EntryMeta, extents: list[Extent], slot: int,
        slab: SlabAccess,
    ) -> None:  # fmt: skip
        """A large entry in ranged chunks, straight into the reserved extents; while
        chunk k+1 is in flight, another thread checksums chunk k."""
        mkey = self.mkey(key)
        hsize = self._header_size(key, meta)
        total = hsize + meta.nbytes
        t0 = time.perf_counter()
        size = self._object_size(store, mkey, key)
        if size != total:
            raise BadValue(f"object is {size} bytes, its header implies {total}")
        chunks = chunk_extents(extents, max(_PIPELINE_CHUNK, -(-meta.nbytes // _PIPELINE_PARTS)))
        hashing: list[Any] = []
        verifier: Verifier | None = None
        try:
            pos = 0
            for k, pieces in enumerate(chunks):
                buffers = [slab.address]
                dst = [[[start for start, _ in pieces]]]
                src = [[[hsize + pos + sum(n for _, n in pieces[:i]) for i in range(len(pieces))]]]
                sizes = [[[n for _, n in pieces]]]
                if k == 0:  # the header rides with the first chunk, into its own slot
                    buffers.append(self.slots.ptr(slot))
                    dst.append([[0]])
                    src.append([[0]])
                    sizes.append([[hsize]])
                res = store.get_into_ranges(buffers, [[mkey]] * len(buffers), dst, src, sizes)
                codes = [int(rc) for per_buf in res for per_key in per_buf for rc in per_key]
                want = [n for per_buf in sizes for per_key in per_buf for n in per_key]
                if any(rc == RPC_FAIL for rc in codes):
                    raise _down(f"Mooncake master {self.s.master} RPC failed")
                if any(rc == NOT_FOUND for rc in codes):
                    raise TierMiss(key)
                if codes != want:
                    self.meter.count("remote_read_errors")
                    raise TierMiss(f"{key}: Mooncake ranged read failed ({codes[:4]})")
                if k == 0:
                    h = parse_header(
                        self.slots.read(slot, hsize), key, self.limit(slab), self.s.hmac_key, total
                    )
                    _check_meta(h.nbytes, h.dtype, h.shape, meta)
                    verifier = Verifier(h)
                assert verifier is not None
                hashing.append(self._hasher.submit(_hash_into, slab, verifier, pieces))
                pos += sum(n for _, n in pieces)
            for f in hashing:
                f.result()
            assert verifier is not None
            verifier.finish()
        finally:
            for f in hashing:  # never leave a thread reading extents we may lose
                f.exception()
        self.meter.observe(time.perf_counter() - t0)
        self.meter.count("remote_bytes_read", meta.nbytes)

    # ------------------------------------------------------------ writes

    def write(self, store: Any, items: Sequence[WriteItem], slab: SlabAccess) -> list[Outcome]:
        """Per item STORED, PRESENT (a valid value is there) or FAILED."""
        out: dict[int, Outcome] = {}
        replace = {i for i, it in enumerate(items) if it.overwrite}
        check = [i for i in range(len(items)) if i not in replace]
        if check:
            found = self.lookup(store, [items[i].key for i in check], slab)
            for i, got in zip(check, found, strict=True):
                if isinstance(got, EntryMeta):
                    out[i] = Outcome.PRESENT
                elif isinstance(got, BadValue):
                    replace.add(i)
        for i in sorted(replace):
            # A refused value is removed first: Mooncake's put never overwrites.
            rc = int(store.remove(self.mkey(items[i].key), True))
            if rc == RPC_FAIL:
                raise _down(f"Mooncake master {self.s.master} RPC failed")
        todo = [i for i in range(len(items)) if i not in out]
        if todo:
            batch = [items[i] for i in todo]
            slots = self.slots.take(len(batch), self.s.timeout_s)
            try:
                if sum(it.meta.nbytes for it in batch) >= _SESSION_MIN_BYTES:
                    done = self._put_session(store, batch, slots, slab)
                else:
                    done = self._put_small(store, batch, slots, slab)
            finally:
                self.slots.give(slots)
            for j, i in enumerate(todo):
                out[i] = done.get(j, Outcome.FAILED)
                if out[i] is Outcome.STORED:
                    self.meter.count("remote_bytes_written", items[i].meta.nbytes)
        return [out[i] for i in range(len(items))]

    def _header(self, it: WriteItem, digest: bytes) -> bytes:
        algo = default_algo(self.s.hmac_key)
        return encode_header(
            it.key, it.meta.dtype, list(it.meta.shape), digest, it.meta.nbytes, algo,
            self.s.hmac_key,
        )  # fmt: skip

    def _put_small(
        self, store: Any, batch: list[WriteItem], slots: list[int], slab: SlabAccess
    ) -> dict[int, Outcome]:
        """Small entries: checksum, then one gathered put per entry in one call."""
        algo = default_algo(self.s.hmac_key)
        hlen = []
        for j, it in enumerate(batch):
            with slab.views(it.extents) as views:
                digest = checksum(views, algo)
            header = self._header(it, digest)
            self.slots.write(slots[j], header)
            hlen.append(len(header))
        t0 = time.perf_counter()
        res = store.batch_put_from_multi_buffers(
            [self.mkey(it.key) for it in batch],
            [
                [self.slots.ptr(slots[j])] + [slab.address + a for a, n in it.extents if n]
                for j, it in enumerate(batch)
            ],
            [[hlen[j]] + [n for _, n in it.extents if n] for j, it in enumerate(batch)],
        )
        self.meter.observe(time.perf_counter() - t0)
        codes = [int(rc) for rc in res]
        if codes and all(rc == RPC_FAIL for rc in codes):
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        return {i: _outcome(rc) for i, rc in enumerate(codes)}

    def _put_session(
        self, store: Any, batch: list[WriteItem], slots: list[int], slab: SlabAccess
    ) -> dict[int, Outcome]:
        """Reserve (header + payload), transfer the payloads straight from the slab
        while another thread checksums them, then write the headers and end the
        session -- an object becomes readable only then, whole."""
        out: dict[int, Outcome] = {}
        algo = default_algo(self.s.hmac_key)
        hlen = {i: len(self.expected_header(it.key, it.meta)) for i, it in enumerate(batch)}
        keys = [self.mkey(it.key) for it in batch]
        t0 = time.perf_counter()
        started = store.batch_put_session_start(
            keys, [hlen[i] + it.meta.nbytes for i, it in enumerate(batch)]
        )
        if started and all(int(rc) == RPC_FAIL for rc in started):
            raise _down(f"Mooncake master {self.s.master} RPC failed")
        live = [i for i, rc in enumerate(started) if int(rc) == 0]
        for i, rc in enumerate(started):
            if int(rc) != 0:
                out[i] = _outcome(int(rc))
        if not live:
            return out
        digests: dict[int, bytes] = {}

        def hash_all() -> None:
            for i in live:
                with slab.views(batch[i].extents) as views:
                    digests[i] = checksum(views, algo)

        hasher = threading.Thread(target=hash_all, name="ecb-mooncake-hash", daemon=True)
        hasher.start()
        try:
            with_payload = [i for i in live if batch[i].meta.nbytes > 0]
            moved = store.batch_put_from_multi_buffer_ranges(
                [keys[i] for i in with_payload],
                [[slab.address + a for a, n in batch[i].extents if n] for i in with_payload],
                [[n for _, n in batch[i].extents if n] for i in with_payload],
                [_offsets(hlen[i], batch[i].extents) for i in with_payload],
            )
        finally:
            hasher.join()
        ok = {
            i for i, rc in zip(with_payload, moved, strict=True) if int(rc) == batch[i].meta.nbytes
        }
        ok |= {i for i in live if batch[i].meta.nbytes == 0}
        for j, i in enumerate(live):
            self.slots.write(slots[j], self._header(batch[i], digests[i]))
        headed = store.batch_put_from_multi_buffer_ranges(
            [keys[i] for i in live],
            [[self.slots.ptr(slots[j])] for j in range(len(live))],
            [[hlen[i]] for i in live],
            [[0] for _ in live],
        )
        ok &= {i for i, rc in zip(live, headed, strict=True) if int(rc) == hlen[i]}
        good = [i for i in live if i in ok]
        bad = [i for i in live if i not in ok]
        if bad:
            store.batch_put_session_revoke([keys[i] for i in bad])
        ended = store.batch_put_session_end([keys[i] for i in good]) if good else []
        for i, rc in zip(good, ended, strict=True):
            out[i] = Outcome.STORED if int(rc) == 0 else Outcome.FAILED
        for i in bad:
            out[i] = Outcome.FAILED
        self.meter.observe(time.perf_counter() - t0)
        return out


def _outcome(rc: int) -> Outcome:
    """A put's code: 0 stored; no space is the store saying no (alive); else failed."""
    if rc == 0:
        return Outcome.STORED
    return Outcome.REJECTED if rc == NO_SPACE else Outcome.FAILED


def _check_meta(nbytes: int, dtype: str, shape: tuple[int, ...], meta: EntryMeta) -> None:
    if (nbytes, dtype, tuple(shape)) != (meta.nbytes, meta.dtype, tuple(meta.shape)):
        raise BadValue(
            f"header says {dtype}{list(shape)}, lookup said {meta.dtype}{list(meta.shape)}"
        )


def _hash_into(slab: SlabAccess, verifier: Verifier, pieces: list[Extent]) -> None:
    with slab.views(pieces) as views:
        for view in views:
            verifier.update(view)
