"""The remote tier on Mooncake Store: entries move between the broker's slab and
the cluster's memory pool with no copy of ours in between.

Enabled with ``remote_url: mooncakestore://<master host:port>`` (LMCache's scheme).
The broker's whole slab is registered with the Mooncake client once; then

- write-behind is ``batch_put_from_multi_buffers``: one Mooncake object per entry,
  gathered from [header slot, slab extent 1, extent 2, ...] -- the transfer engine
  reads the pinned extents itself (from 8 MiB a put session: payload first while it
  is checksummed, header last, readable only when whole);
- promotion is ``batch_get_into_multi_buffers``: the object scattered into
  [header slot, reserved extent 1, ...] -- the transfer engine writes the reserved
  extents itself; the header and the checksum are checked before it counts (from
  4 MiB: ranged chunks, each checksummed while the next one moves);
- lookup reads only the headers, for a whole batch in one ``get_into_ranges`` call.

The object is exactly the remote value format of ``remote_value.py`` (header +
payload), so a value is untrusted input here as it is in Redis: key, dtype, shape,
length, checksum and (with ``remote_hmac_key_file``) the signature are checked;
anything else is a miss plus ``remote_refused_values``.

Header slots live in a small registered mapping of this module's own (never in the
slab): a slot belongs to one Mooncake call and is freed by the thread that made the
call when it returns -- not by a coroutine that stopped waiting -- so a call that
outlives its deadline never writes into memory someone else was given.

Mooncake semantics this tier relies on (0.3.13, docs/mooncake.md): ``put`` never overwrites
(the same key always carries the same bytes here, so that is fine); every read
grants the reader a lease (10 s) during which ``remove`` answers -706 (HAS_LEASE):
deletes are retried after the lease; the objects live in the segments the clients
(brokers) contribute, so a broker that stops takes its objects with it, and a master
restart loses every object -- both cost only hits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import mmap
import os
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from ...protocol import Extent
from .base import (
    EntryMeta,
    LowerTier,
    SlabAccess,
    TierCorrupt,
    TierError,
    TierEvents,
    TierMiss,
    TierUnavailable,
)
from .circuit import CircuitBreaker, State
from .mooncake_config import EXTRA_HINT, SCHEME, MooncakeSettings
from .remote_stats import REMOTE_COUNTERS, REMOTE_GAUGES, record_latency
from .remote_value import (
    FIXED,
    BadValue,
    Verifier,
    checksum,
    default_algo,
    encode_header,
    fixed_lengths,
    parse_header,
)

log = logging.getLogger("lmcache_ec_broker.mooncake")


# Mooncake error codes (mooncake-store/include/types.h)
NO_SPACE = -200
INVALID_PARAMS = -600
NOT_FOUND = -704
HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

SLOT = 8192  # one header slot: >= MAX_HEADER, page-friendly
PROBE = 512  # header bytes read per key at lookup (a typical header is ~150-300 bytes)
_BATCH_WRITES = 32
_BATCH_WRITE_BYTES = 256 << 20
_MAX_DELETE_TRIES = 6
_CLOSE_WAIT_S = 5.0
_LOOKUP_CHUNK = 64  # keys per batched header read (each needs a header slot)
# Batches from this size on are written in a put session that overlaps the checksum
# with the transfer (measured: 0.25x -> 0.99x of a bare put_from at 130 MiB); below
# it the session's three extra round trips cost more than the overlap saves.
_SESSION_MIN_BYTES = 8 << 20
# Promotions from this size on read in ranged chunks (about a quarter of the entry,
# at least 2 MiB), checksumming one while the next moves. Smaller ones in one call:
# their extra round trips would cost more than the overlap saves.
_PIPELINE_MIN_BYTES = 4 << 20
_PIPELINE_CHUNK = 2 << 20
_PIPELINE_PARTS = 4
_REFUSED_TTL_S = 60.0

# The same stats names as the Redis backend (tests/test_remote_mooncake.py checks it),
# plus remote_lease_conflicts (deletes deferred by a reader's Mooncake lease).
COUNTERS = (*REMOTE_COUNTERS, "remote_lease_conflicts")
GAUGES = REMOTE_GAUGES


def import_store_class() -> Any:
    """Mooncake's client class, or TierError naming the extra to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierError(
            f"remote_url {SCHEME}:// needs the Mooncake client, which is not installed "
            f"({exc}); install it with: {EXTRA_HINT}"
        ) from None
    return MooncakeDistributedStore


def _chunk_extents(extents: list[Extent], chunk: int) -> list[list[Extent]]:
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


def _check_meta(nbytes: int, dtype: str, shape: tuple[int, ...], meta: EntryMeta) -> None:
    if (nbytes, dtype, tuple(shape)) != (meta.nbytes, meta.dtype, tuple(meta.shape)):
        raise BadValue(
            f"header says {dtype}{list(shape)}, lookup said {meta.dtype}{list(meta.shape)}"
        )


async def _uncancellable(fut: asyncio.Future[Any]) -> Any:
    """Await ``fut`` to its end even if the caller is cancelled (then re-raise the
    cancellation): the reserved extents must stay reserved while a transfer may still
    write into them."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


def _offsets(start: int, extents: list[Extent]) -> list[int]:
    """Destination offsets of the non-empty extents in an object whose payload begins at ``start``."""
    out, pos = [], start
    for _, n in extents:
        if n:
            out.append(pos)
        pos += n
    return out


class _Busy(TierUnavailable):
    """Every header slot is in use: this call is refused, the store is not at fault."""


class _Slots:
    """Fixed-size header slots in one registered anonymous mapping of our own."""

    def __init__(self, count: int) -> None:
        self.mm = mmap.mmap(-1, count * SLOT)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = count * SLOT
        self._free = list(range(count))
        self._lock = threading.Condition()

    def take(self, n: int, wait_s: float = 0.0) -> list[int] | None:
        """``n`` free slots, waiting up to ``wait_s`` for them; None if there are not."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._free) >= n, wait_s):
                return None
            got, self._free[-n:] = self._free[-n:], []
            return got

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            self._lock.notify_all()

    def ptr(self, slot: int) -> int:
        return self.address + slot * SLOT

    def read(self, slot: int, n: int) -> bytes:
        return bytes(self.mm[slot * SLOT : slot * SLOT + n])

    def write(self, slot: int, data: bytes) -> None:
        self.mm[slot * SLOT : slot * SLOT + len(data)] = data


class _Write(msgspec.Struct):
    key: str
    meta: EntryMeta
    extents: list[Extent]
    future: asyncio.Future[None]


class _Delete(msgspec.Struct):
    key: str
    tries: int = 0
    not_before: float = 0.0


class _Clear(msgspec.Struct):
    not_before: float = 0.0


class MooncakeTier(LowerTier):
    name = "remote"
    counter_names = COUNTERS
    remote = True

    def __init__(self, settings: MooncakeSettings) -> None:
        self.s = settings
        self.counters: dict[str, int | float] = dict.fromkeys(COUNTERS, 0)
        self._store: Any = None
        self._store_cls: Any = None
        self._slots: _Slots | None = None
        self._slab: SlabAccess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: TierEvents | None = None
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # counters, queues and key sets shared with threads
        self._queue: collections.deque[_Write | _Delete | _Clear] = collections.deque()
        self._queued_writes = 0
        self._writing = 0  # writes taken off the queue, not finished yet (the writer thread's)
        self._deferred: list[Any] = []  # deletes waiting for a lease (or the store) to end
        self._drain_until = 0.0
        self._wake = threading.Condition(self._lock)
        self._reads = ThreadPoolExecutor(4, thread_name_prefix="ecb-mooncake-read")
        # one thread: a pipelined read's chunks are checksummed in order
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ecb-mooncake-hash")
        self._threads: list[threading.Thread] = []
        self._inflight: set[asyncio.Future[Any]] = set()
        self._header_sizes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._tombstones: set[str] = set()
        self._clears_pending = 0  # clear() queued, not yet applied: every lookup misses
        self._refused: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._last_warning = 0.0
        self._reported: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.circuit = CircuitBreaker(threshold=3, backoff_s=0.5, max_backoff_s=30.0)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        self._store_cls = import_store_class()
        if self.s.protocol not in ("tcp", "rdma"):
            raise TierError(f"mooncake_protocol must be tcp or rdma, got {self.s.protocol!r}")
        if self.s.protocol == "rdma" and not self.s.device_name:
            raise TierError("mooncake_protocol rdma needs mooncake_device_name (e.g. mlx5_0)")
        # Mooncake reads these at setup; bound its own waits by ours unless the operator chose.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(int(self.s.timeout_s * 1000), 100)))
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(int(self.s.timeout_s * 4), 2)))
        # One attempt per setup call (its retries hold the GIL); _connect_loop retries.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        # write batches hold up to _BATCH_WRITES slots, lookups _LOOKUP_CHUNK, reads one each
        self._slots = _Slots(_BATCH_WRITES + 4 * _LOOKUP_CHUNK + 64)

    def expected_keys(self, block_size: int) -> int:
        return self.s.max_reported_keys

    def start(self, loop: asyncio.AbstractEventLoop, slab: SlabAccess, events: TierEvents) -> None:
        self._loop, self._slab, self._events = loop, slab, events
        for target, name in (
            (self._connect_loop, "ecb-mooncake-connect"),
            (self._writer_loop, "ecb-mooncake-write"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._monitor_loop, name="ecb-mooncake-monitor", daemon=True)
        t.start()
        self._threads.append(t)

    def _connect_loop(self) -> None:
        """Set up the client and register the slab once; the tier is down until then.
        A master that is down at start only delays this (retried with backoff)."""
        backoff = 0.5
        while not self._stopping.is_set():
            store = None
            try:
                # Mooncake's setup holds the GIL while it waits for the master (measured:
                # 4.5 s per attempt, the broker's event loop frozen meanwhile): call it
                # only once the master's port answers a plain connect, which does not.
                self._probe_master()
                store = self._store_cls()
                rc = store.setup(
                    self.s.local_hostname,
                    self.s.metadata_server,
                    self.s.global_segment_size,
                    self.s.local_buffer_size,
                    self.s.protocol,
                    self.s.device_name,
                    self.s.master,
                )
                if rc != 0:
                    raise RuntimeError(f"setup returned {rc}")
                assert self._slab is not None and self._slots is not None
                for addr, size in (
                    (self._slab.address, self._slab.size),
                    (self._slots.address, self._slots.size),
                ):
                    rc = store.register_buffer(addr, size)
                    if rc != 0:
                        raise RuntimeError(f"register_buffer returned {rc}")
            except Exception as exc:  # noqa: BLE001 - any failure here means "still down"
                log.warning(
                    "Mooncake master %s not reachable (%s); retrying in %.1fs",
                    self.s.master,
                    exc,
                    backoff,
                )
                if store is not None:
                    with contextlib.suppress(Exception):
                        store.close()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self._store = store
            self._connected.set()
            log.info("Mooncake remote tier connected to %s (%s)", self.s.master, self.s.protocol)
            return

    def _probe_master(self) -> None:
        host, _, port = self.s.master.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=self.s.timeout_s):
            pass

    async def shutdown(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        with self._lock:
            # the writer keeps draining queued writes until half the deadline
            self._drain_until = time.monotonic() + deadline_s / 2
            self._deferred.clear()
            self._stopping.set()
            self._wake.notify_all()
        for t in self._threads:
            await asyncio.to_thread(t.join, max(0.0, end - time.monotonic()))
        # Writes still queued are abandoned (their futures end; the coordinator unpins).
        with self._lock:
            left = [op for op in self._queue if isinstance(op, _Write)]
            self._queue.clear()
            self._queued_writes = 0
        for op in left:
            self._finish(op.future, None)
        pending = [f for f in self._inflight if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, end - time.monotonic()))
        still = [f for f in self._inflight if not f.done()]
        if still:
            log.error("Mooncake tier: %d transfers still running at shutdown", len(still))
        self._reads.shutdown(wait=False)
        self._hasher.shutdown(wait=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        store, self._store = self._store, None
        self._connected.clear()
        self._reads.shutdown(wait=False)
        self._hasher.shutdown(wait=False)
        if store is None:
            return

        def release() -> None:
            try:
                if self._slab is not None:
                    store.unregister_buffer(self._slab.address)
                if self._slots is not None:
                    store.unregister_buffer(self._slots.address)
                store.close()  # unmounts this broker's segment: its objects leave the store
            except Exception as exc:  # noqa: BLE001
                log.warning("Mooncake client close: %s", exc)

        # With the master down Mooncake retries its unmount RPC for a long time:
        # bounded here, the process exits without waiting for it.
        t = threading.Thread(target=release, name="ecb-mooncake-close", daemon=True)
        t.start()
        t.join(_CLOSE_WAIT_S)
        if t.is_alive():
            log.warning("Mooncake client did not close within %.0fs (master down?)", _CLOSE_WAIT_S)

    # ------------------------------------------------------------ helpers

    def _observe(self, seconds: float) -> None:
        with self._lock:
            record_latency(self.counters, seconds)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _mkey(self, key: str) -> str:
        return self.s.key_prefix + key

    def _available(self) -> Any:
        store = self._store
        if store is None or not self._connected.is_set():
            raise TierUnavailable(f"Mooncake master {self.s.master} not connected")
        if not self.circuit.allow():
            raise TierUnavailable("Mooncake circuit open (recent failures)")
        return store

    def _failure(self) -> None:
        was_open = self.circuit.state is State.OPEN
        self.circuit.failure()
        if not was_open and self.circuit.state is State.OPEN:
            self._count("remote_circuit_opens")

    def _report_added(self, key: str) -> None:
        """Loop thread only."""
        if self.s.max_reported_keys <= 0:
            return
        if self._events is None or key in self._reported:
            if key in self._reported:
                self._reported.move_to_end(key)
            return
        self._events.added(self, key)
        self._reported[key] = None
        while len(self._reported) > self.s.max_reported_keys:
            old, _ = self._reported.popitem(last=False)
            self._events.removed(self, old)

    def _report_removed(self, key: str) -> None:
        """Loop thread only."""
        if key in self._reported:
            del self._reported[key]
            if self._events is not None:
                self._events.removed(self, key)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed in between
                pass

    def _finish(self, fut: asyncio.Future[Any], exc: BaseException | None) -> None:
        def done() -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

        self._call_soon(done)

    def _remember(
        self, od: collections.OrderedDict[str, Any], key: str, value: Any, cap: int = 65536
    ) -> None:
        od[key] = value
        od.move_to_end(key)
        while len(od) > cap:
            od.popitem(last=False)

    def _refuse(self, key: str, why: str) -> None:
        with self._lock:
            self.counters["remote_refused_values"] += 1
            self._remember(self._refused, key, time.monotonic() + _REFUSED_TTL_S)
            self._header_sizes.pop(key, None)
            self._known.pop(key, None)
            now = time.monotonic()
            loud = now - self._last_warning >= 10.0  # a hostile writer must not flood the log
            if loud:
                self._last_warning = now
        (log.warning if loud else log.debug)(
            "Mooncake value for key %r refused: %s (remote_refused_values counts them)",
            key[:200],
            why,
        )
        self._call_soon(self._report_removed, key)

    def _is_refused(self, key: str, now: float) -> bool:
        until = self._refused.get(key)
        if until is None:
            return False
        if now >= until:
            del self._refused[key]
            return False
        return True

    def _limit(self) -> int:
        limit = self.s.max_entry_size or (self._slab.size if self._slab else 1 << 62)
        return limit

    # ------------------------------------------------------------ lookups

    async def lookup(self, keys: Sequence[str]) -> list[EntryMeta | None]:
        store = self._available()
        keys = list(keys)
        fut = asyncio.get_running_loop().run_in_executor(
            self._reads, self._lookup_sync, store, keys
        )
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        try:
            metas = await asyncio.wait_for(asyncio.shield(fut), self.s.timeout_s)
        except asyncio.TimeoutError:
            self._failure()
            raise TierUnavailable(f"Mooncake lookup took longer than {self.s.timeout_s}s") from None
        except _Busy:
            if not self.circuit.up:  # this call held the half-open probe: retry it later
                self._failure()
            raise
        except TierUnavailable:
            self._failure()
            raise
        except Exception as exc:
            self._failure()
            raise TierUnavailable(f"Mooncake lookup failed: {exc}") from exc
        self.circuit.success()
        for key, meta in zip(keys, metas, strict=True):
            if meta is None:
                with self._lock:
                    self._known.pop(key, None)
                self._report_removed(key)
            else:
                self._report_added(key)
        return metas

    def _lookup_sync(self, store: Any, keys: list[str]) -> list[EntryMeta | None]:
        """Read every key's header in one batched ranged read (a second one for the
        few whose object or header does not fit the probe). Runs on a read thread."""
        out: list[EntryMeta | None] = [None] * len(keys)
        now = time.monotonic()
        with self._lock:
            if self._clears_pending:
                return out
            ask = [
                i
                for i, k in enumerate(keys)
                if k not in self._tombstones and not self._is_refused(k, now)
            ]
        t0 = time.perf_counter()
        for lo in range(0, len(ask), _LOOKUP_CHUNK):
            self._lookup_chunk(store, keys, ask[lo : lo + _LOOKUP_CHUNK], out)
        self._observe(time.perf_counter() - t0)
        hits = sum(m is not None for m in out)
        with self._lock:
            self.counters["remote_hits"] += hits
            self.counters["remote_misses"] += len(keys) - hits
        return out

    def _lookup_chunk(
        self, store: Any, keys: list[str], ask: list[int], out: list[EntryMeta | None]
    ) -> None:
        assert self._slots is not None
        slots = self._slots.take(len(ask), self.s.timeout_s)
        if slots is None:
            raise _Busy("Mooncake tier busy (no free header slots)")
        try:
            first = self._ranged(store, [keys[i] for i in ask], slots, [PROBE] * len(ask))
            again: list[tuple[int, int, int]] = []  # (index in ask, slot, length to read)
            for j, rc in enumerate(first):
                key = keys[ask[j]]
                if rc == INVALID_PARAMS:  # object shorter than the probe: read its fixed part
                    again.append((j, slots[j], FIXED.size))
                    continue
                if rc < 0:
                    self._lookup_error(key, rc)
                    continue
                data = self._slots.read(slots[j], PROBE)
                try:
                    hsize, _ = fixed_lengths(data)
                except BadValue as exc:
                    self._refuse(key, str(exc))
                    continue
                if hsize > PROBE:
                    again.append((j, slots[j], hsize))
                    continue
                out[ask[j]] = self._meta_from(key, data)
            if again:
                got = self._ranged(
                    store,
                    [keys[ask[j]] for j, _, _ in again],
                    [s for _, s, _ in again],
                    [n for _, _, n in again],
                )
                for (j, slot, n), rc in zip(again, got, strict=True):
                    key = keys[ask[j]]
                    if rc < 0:
                        if rc == INVALID_PARAMS:
                            self._refuse(key, "object is shorter than a value header")
                        else:
                            self._lookup_error(key, rc)
                        continue
                    data = self._slots.read(slot, n)
                    try:
                        hsize, _ = fixed_lengths(data)
                    except BadValue as exc:
                        self._refuse(key, str(exc))
                        continue
                    if hsize > n:  # only the fixed part was read: now the whole header
                        rc2 = self._ranged(store, [key], [slot], [hsize])[0]
                        if rc2 < 0:
                            self._lookup_error(key, rc2)
                            continue
                        data = self._slots.read(slot, hsize)
                    out[ask[j]] = self._meta_from(key, data)
        finally:
            self._slots.give(slots)

    def _ranged(self, store: Any, keys: list[str], slots: list[int], sizes: list[int]) -> list[int]:
        assert self._slots is not None
        res = store.get_into_ranges(
            [self._slots.ptr(s) for s in slots],
            [[self._mkey(k)] for k in keys],
            [[[0]] for _ in keys],
            [[[0]] for _ in keys],
            [[[n]] for n in sizes],
        )
        out = [int(r[0][0]) if r and r[0] else RPC_FAIL for r in res]
        if any(rc == RPC_FAIL for rc in out):
            raise TierUnavailable(f"Mooncake master {self.s.master} RPC failed")
        return out

    def _lookup_error(self, key: str, rc: int) -> None:
        if rc == NOT_FOUND:
            return
        self._count("remote_read_errors")
        log.debug("Mooncake header read of %r failed: %d", key[:200], rc)

    def _meta_from(self, key: str, data: bytes) -> EntryMeta | None:
        try:
            h = parse_header(data, key, self._limit(), self.s.hmac_key)
        except BadValue as exc:
            self._refuse(key, str(exc))
            return None
        with self._lock:
            self._remember(self._header_sizes, key, h.size)
            self._remember(self._known, key, None)
        return EntryMeta(h.nbytes, h.dtype, h.shape)

    # ------------------------------------------------------------ data

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None]:
        return self._read_into(key, meta, list(extents))

    async def _read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> None:
        assert self._slots is not None
        slots = self._slots.take(1)  # before the circuit hands out a probe
        if slots is None:
            raise _Busy("Mooncake tier busy (no free header slots)")
        try:
            store = self._available()
        except TierUnavailable:
            self._slots.give(slots)
            raise
        fut = asyncio.get_running_loop().run_in_executor(
            self._reads, self._read_sync, store, key, meta, extents, slots[0]
        )
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        # No deadline of ours here: the transfer engine writes into the reserved
        # extents until the call returns, so this must not end before it does.
        # Mooncake bounds the call itself (MC_TRANSFER_TIMEOUT / MC_RPC_TIMEOUT_MS).
        try:
            await _uncancellable(fut)
        except TierMiss:
            self.circuit.success()  # the store answered
            with self._lock:
                self._known.pop(key, None)
            self._report_removed(key)
            raise
        except TierCorrupt:
            self.circuit.success()
            raise
        except TierUnavailable:
            self._failure()
            raise
        except Exception as exc:
            self._failure()
            raise TierUnavailable(f"Mooncake read of {key!r} failed: {exc}") from exc
        self.circuit.success()

    def _read_sync(
        self, store: Any, key: str, meta: EntryMeta, extents: list[Extent], slot: int
    ) -> None:
        assert self._slots is not None and self._slab is not None
        if meta.nbytes >= _PIPELINE_MIN_BYTES:
            try:
                self._read_pipelined(store, key, meta, extents, slot)
            finally:
                self._slots.give([slot])
            return
        try:
            with self._lock:
                hsize = self._header_sizes.get(key)
            if hsize is None:
                hsize = len(self._expected_header(key, meta))
            ptrs = [self._slots.ptr(slot)] + [self._slab.address + start for start, _ in extents]
            sizes = [hsize] + [n for _, n in extents]
            total = sum(sizes)
            t0 = time.perf_counter()
            rc = int(store.batch_get_into_multi_buffers([self._mkey(key)], [ptrs], [sizes])[0])
            if rc == RPC_FAIL:
                raise TierUnavailable(f"Mooncake master {self.s.master} RPC failed")
            if rc == NOT_FOUND:
                raise TierMiss(key)
            if rc in (INVALID_PARAMS, TRANSFER_FAIL):
                # Sizes that do not add up to the object fail the transfer too
                # (-600 short, -800 long): tell a bad value from a dead peer.
                size = int(store.get_size(self._mkey(key)))
                if size == NOT_FOUND:
                    raise TierMiss(key)
                if size >= 0 and size != total:
                    self._refuse(key, f"object is {size} bytes, its header implies {total}")
                    raise TierCorrupt(key)
            if rc < 0:
                self._count("remote_read_errors")
                raise TierMiss(f"{key}: Mooncake read failed ({rc})")
            if rc != total:
                self._refuse(key, f"read {rc} bytes, expected {total}")
                raise TierCorrupt(key)
            try:
                h = parse_header(
                    self._slots.read(slot, hsize), key, self._limit(), self.s.hmac_key, total
                )
                if (h.nbytes, h.dtype, h.shape) != (meta.nbytes, meta.dtype, tuple(meta.shape)):
                    raise BadValue(
                        f"header says {h.dtype}{list(h.shape)}, lookup said {meta.dtype}{list(meta.shape)}"
                    )
                v = Verifier(h)
                with self._slab.views(extents) as views:
                    for view in views:
                        v.update(view)
                v.finish()
            except BadValue as exc:
                self._refuse(key, str(exc))
                raise TierCorrupt(key) from None
            self._observe(time.perf_counter() - t0)
            self._count("remote_bytes_read", meta.nbytes)
        finally:
            self._slots.give([slot])

    def _read_pipelined(
        self, store: Any, key: str, meta: EntryMeta, extents: list[Extent], slot: int
    ) -> None:
        """A large entry in ranged chunks, straight into the reserved extents; while
        chunk k+1 is in flight, another thread checksums chunk k (the checksum would
        otherwise add ~70% to a promotion: blake3 ~1.4 GB/s against ~1 GB/s TCP)."""
        assert self._slots is not None and self._slab is not None
        mkey = self._mkey(key)
        with self._lock:
            hsize = self._header_sizes.get(key)
        if hsize is None:
            hsize = len(self._expected_header(key, meta))
        total = hsize + meta.nbytes
        t0 = time.perf_counter()
        size = int(store.get_size(mkey))
        if size == RPC_FAIL:
            raise TierUnavailable(f"Mooncake master {self.s.master} RPC failed")
        if size == NOT_FOUND:
            raise TierMiss(key)
        if size < 0:
            self._count("remote_read_errors")
            raise TierMiss(f"{key}: Mooncake get_size failed ({size})")
        if size != total:
            self._refuse(key, f"object is {size} bytes, its header implies {total}")
            raise TierCorrupt(key)
        chunks = _chunk_extents(extents, max(_PIPELINE_CHUNK, -(-meta.nbytes // _PIPELINE_PARTS)))
        hashing: list[Any] = []
        verifier: Verifier | None = None
        try:
            pos = 0
            for k, pieces in enumerate(chunks):
                buffers = [self._slab.address]
                dst = [[[start for start, _ in pieces]]]
                src = [[[hsize + pos + sum(n for _, n in pieces[:i]) for i in range(len(pieces))]]]
                sizes = [[[n for _, n in pieces]]]
                if k == 0:  # the header rides with the first chunk, into its own slot
                    buffers.append(self._slots.ptr(slot))
                    dst.append([[0]])
                    src.append([[0]])
                    sizes.append([[hsize]])
                res = store.get_into_ranges(buffers, [[mkey]] * len(buffers), dst, src, sizes)
                codes = [int(rc) for per_buf in res for per_key in per_buf for rc in per_key]
                want = [n for per_buf in sizes for per_key in per_buf for n in per_key]
                if any(rc == RPC_FAIL for rc in codes):
                    raise TierUnavailable(f"Mooncake master {self.s.master} RPC failed")
                if any(rc == NOT_FOUND for rc in codes):
                    raise TierMiss(key)
                if codes != want:
                    self._count("remote_read_errors")
                    raise TierMiss(f"{key}: Mooncake ranged read failed ({codes[:4]})")
                if k == 0:
                    try:
                        h = parse_header(
                            self._slots.read(slot, hsize),
                            key,
                            self._limit(),
                            self.s.hmac_key,
                            total,
                        )
                        _check_meta(h.nbytes, h.dtype, h.shape, meta)
                    except BadValue as exc:
                        self._refuse(key, str(exc))
                        raise TierCorrupt(key) from None
                    verifier = Verifier(h)
                assert verifier is not None
                hashing.append(self._hasher.submit(self._hash_into, verifier, pieces))
                pos += sum(n for _, n in pieces)
            for f in hashing:
                f.result()
            assert verifier is not None
            try:
                verifier.finish()
            except BadValue as exc:
                self._refuse(key, str(exc))
                raise TierCorrupt(key) from None
        finally:
            for f in hashing:  # never leave a thread reading extents we may lose
                f.exception()
        self._observe(time.perf_counter() - t0)
        self._count("remote_bytes_read", meta.nbytes)

    def _hash_into(self, verifier: Verifier, pieces: list[Extent]) -> None:
        assert self._slab is not None
        with self._slab.views(pieces) as views:
            for view in views:
                verifier.update(view)

    def _expected_header(self, key: str, meta: EntryMeta) -> bytes:
        algo = default_algo(self.s.hmac_key)
        return encode_header(
            key, meta.dtype, list(meta.shape), bytes(32), meta.nbytes, algo, self.s.hmac_key
        )

    def write(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None] | None:
        if self._stopping.is_set():
            return None
        if self._store is None:  # not connected yet (master down at start)
            self._count("remote_write_drops")
            return None
        if self.s.max_entry_size and meta.nbytes > self.s.max_entry_size:
            return None
        with self._lock:
            if key in self._known:
                self.counters["remote_writes_skipped"] += 1
                return None
            if self._queued_writes >= self.s.write_queue or self.circuit.state is State.OPEN:
                self.counters["remote_write_drops"] += 1
                return None
            assert self._loop is not None
            fut: asyncio.Future[None] = self._loop.create_future()
            self._tombstones.discard(key)
            self._queue.append(_Write(key, meta, list(extents), fut))
            self._queued_writes += 1
            self._wake.notify()
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def delete(self, keys: Sequence[str]) -> list[bool]:
        out = []
        with self._lock:
            for key in keys:
                held = key in self._known or key in self._reported
                self._known.pop(key, None)
                self._header_sizes.pop(key, None)
                self._tombstones.add(key)
                self._queue.append(_Delete(key))
                out.append(held)
            self._wake.notify()
        for key in keys:
            self._report_removed(key)
        return out

    def clear(self) -> int:
        """Removes this broker's namespace (``remote_key_prefix``) from the shared store:
        every broker using the same prefix loses those entries too."""
        with self._lock:
            n = len(self._known | self._reported.keys())
            self._known.clear()
            self._header_sizes.clear()
            self._clears_pending += 1
            self._queue.append(_Clear())
            self._wake.notify()
        for key in list(self._reported):
            self._report_removed(key)
        return n

    # ------------------------------------------------------------ writer thread

    def _next_ops(self) -> list[_Write | _Delete | _Clear] | None:
        """The next run of queued operations, in queue order: consecutive writes as
        one batch, or one delete/clear. None: stop. Called with the lock held."""
        while True:
            now = time.monotonic()
            due = [d for d in self._deferred if d.not_before <= now]
            if due:
                self._deferred = [d for d in self._deferred if d.not_before > now]
                self._queue.extend(due)
            if self._queue:
                break
            if self._stopping.is_set():
                return None
            wait = min([d.not_before - now for d in self._deferred] + [1.0])
            self._wake.wait(max(wait, 0.01))
        if self._stopping.is_set() and time.monotonic() > self._drain_until:
            return None
        first = self._queue.popleft()
        if not isinstance(first, _Write):
            return [first]
        ops: list[_Write | _Delete | _Clear] = [first]
        self._queued_writes -= 1
        nbytes = first.meta.nbytes
        while (
            self._queue
            and isinstance(self._queue[0], _Write)
            and len(ops) < _BATCH_WRITES
            and nbytes < _BATCH_WRITE_BYTES
        ):
            op = self._queue.popleft()
            assert isinstance(op, _Write)
            ops.append(op)
            nbytes += op.meta.nbytes
            self._queued_writes -= 1
        self._writing = len(ops)
        return ops

    def _writer_loop(self) -> None:
        """One thread applies queued writes, deletes and clears in order, so a delete
        is never overtaken by an earlier write of the same key."""
        while True:
            with self._lock:
                ops = self._next_ops()
            if ops is None:
                return
            store = self._store
            if store is None or not self._connected.is_set():
                with self._lock:
                    self._writing = 0
                for op in ops:
                    if isinstance(op, _Write):
                        self._count("remote_write_drops")
                        self._finish(op.future, None)
                    else:  # keep it for when the store is back
                        with self._lock:
                            later = time.monotonic() + 1.0
                            self._deferred.append(
                                _Delete(op.key, op.tries, later)
                                if isinstance(op, _Delete)
                                else _Clear(later)
                            )
                continue
            if isinstance(ops[0], _Write):
                try:
                    self._write_batch(store, [op for op in ops if isinstance(op, _Write)])
                finally:
                    with self._lock:
                        self._writing = 0
            else:
                try:
                    self._apply(store, ops[0])  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001 - never kill the writer thread
                    log.warning("Mooncake remove failed: %s", exc)

    def _write_batch(self, store: Any, batch: list[_Write]) -> None:
        """Write a batch of pinned entries as one Mooncake put session each:
        reserve (header + payload), transfer the payloads straight from the slab
        while another thread checksums them, then write the headers and end the
        session -- an object becomes readable only then, whole."""
        assert self._slots is not None and self._slab is not None
        slots = self._slots.take(len(batch), self.s.timeout_s) or []
        if len(slots) < len(batch):
            self._slots.give(slots)
            for op in batch:
                self._count("remote_write_drops")
                self._finish(op.future, None)
            return
        try:
            if sum(op.meta.nbytes for op in batch) >= _SESSION_MIN_BYTES:
                outcome = self._put_session(store, batch, slots)
            else:
                outcome = self._put_small(store, batch, slots)
        except Exception as exc:  # noqa: BLE001 - count, never kill the writer thread
            log.warning("Mooncake write-behind batch failed: %s", exc)
            outcome = dict.fromkeys(range(len(batch)), "error")
            self._failure()
        finally:
            self._slots.give(slots)
        written = 0
        for i, op in enumerate(batch):
            result = outcome.get(i, "error")
            if result in ("written", "present"):
                with self._lock:
                    self._remember(self._known, op.key, None)
                    if result == "written":
                        written += 1
                        self.counters["remote_writes"] += 1
                        self.counters["remote_bytes_written"] += op.meta.nbytes
                    else:
                        self.counters["remote_writes_skipped"] += 1
                self._call_soon(self._report_added, op.key)
            else:
                self._count("remote_write_errors")
            self._finish(op.future, None)

    def _put_small(self, store: Any, batch: list[_Write], slots: list[int]) -> dict[int, str]:
        """Small entries: checksum, then one gathered put per entry in one call (the
        session's extra round trips would cost more than the overlap saves). A key
        the store already holds is not overwritten (Mooncake's put keeps the first)."""
        assert self._slots is not None and self._slab is not None
        algo = default_algo(self.s.hmac_key)
        hlen = []
        for j, op in enumerate(batch):
            with self._slab.views(op.extents) as views:
                digest = checksum(views, algo)
            header = encode_header(
                op.key, op.meta.dtype, list(op.meta.shape), digest, op.meta.nbytes, algo,
                self.s.hmac_key,
            )  # fmt: skip
            self._slots.write(slots[j], header)
            hlen.append(len(header))
        t0 = time.perf_counter()
        res = store.batch_put_from_multi_buffers(
            [self._mkey(op.key) for op in batch],
            [
                [self._slots.ptr(slots[j])] + [self._slab.address + a for a, n in op.extents if n]
                for j, op in enumerate(batch)
            ],
            [[hlen[j]] + [n for _, n in op.extents if n] for j, op in enumerate(batch)],
        )
        self._observe(time.perf_counter() - t0)
        codes = [int(rc) for rc in res]
        if any(rc == RPC_FAIL for rc in codes):
            self._failure()
        else:
            self.circuit.success()
        return {i: "written" if rc == 0 else "error" for i, rc in enumerate(codes)}

    def _put_session(self, store: Any, batch: list[_Write], slots: list[int]) -> dict[int, str]:
        """Per batch index: "written", "present" (someone stored it) or "error"."""
        assert self._slots is not None and self._slab is not None
        out: dict[int, str] = {}
        exist = store.batch_is_exist([self._mkey(op.key) for op in batch])
        todo: list[int] = []
        for i, ex in enumerate(exist):
            if int(ex) == 1:
                out[i] = "present"
            else:
                todo.append(i)
        if not todo:
            self.circuit.success()
            return out
        algo = default_algo(self.s.hmac_key)
        hlen = {i: len(self._expected_header(batch[i].key, batch[i].meta)) for i in todo}
        keys = [self._mkey(batch[i].key) for i in todo]
        t0 = time.perf_counter()
        started = store.batch_put_session_start(
            keys, [hlen[i] + batch[i].meta.nbytes for i in todo]
        )
        rpc_failed = any(int(rc) == RPC_FAIL for rc in started)
        live = []
        for i, rc in zip(todo, started, strict=True):
            if int(rc) == 0:
                live.append(i)
            else:
                out[i] = "error"
                log.debug("Mooncake put of %r refused: %d", batch[i].key[:200], int(rc))
        if not live:
            if rpc_failed:
                self._failure()
            else:
                self.circuit.success()
            return out
        digests: dict[int, bytes] = {}

        def hash_all() -> None:
            for i in live:
                with self._slab.views(batch[i].extents) as views:  # type: ignore[union-attr]
                    digests[i] = checksum(views, algo)

        hasher = threading.Thread(target=hash_all, name="ecb-mooncake-hash", daemon=True)
        hasher.start()
        try:
            with_payload = [i for i in live if batch[i].meta.nbytes > 0]
            moved = store.batch_put_from_multi_buffer_ranges(
                [self._mkey(batch[i].key) for i in with_payload],
                [[self._slab.address + a for a, n in batch[i].extents if n] for i in with_payload],
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
            op = batch[i]
            header = encode_header(
                op.key, op.meta.dtype, list(op.meta.shape), digests[i], op.meta.nbytes, algo,
                self.s.hmac_key,
            )  # fmt: skip
            self._slots.write(slots[j], header)
        headed = store.batch_put_from_multi_buffer_ranges(
            [self._mkey(batch[i].key) for i in live],
            [[self._slots.ptr(slots[j])] for j in range(len(live))],
            [[hlen[i]] for i in live],
            [[0] for _ in live],
        )
        ok &= {i for i, rc in zip(live, headed, strict=True) if int(rc) == hlen[i]}
        good = [i for i in live if i in ok]
        bad = [i for i in live if i not in ok]
        if bad:
            store.batch_put_session_revoke([self._mkey(batch[i].key) for i in bad])
        ended = (
            store.batch_put_session_end([self._mkey(batch[i].key) for i in good]) if good else []
        )
        for i, rc in zip(good, ended, strict=True):
            out[i] = "written" if int(rc) == 0 else "error"
        for i in bad:
            out[i] = "error"
        self._observe(time.perf_counter() - t0)
        if rpc_failed or any(int(rc) == RPC_FAIL for rc in ended):
            self._failure()
        else:
            self.circuit.success()
        return out

    def _apply(self, store: Any, op: _Delete | _Clear) -> None:
        if isinstance(op, _Clear):
            try:
                rc = store.remove_by_regex("^" + re.escape(self.s.key_prefix), False)
                log.info("Mooncake clear of prefix %r: %s", self.s.key_prefix, rc)
            finally:
                with self._lock:
                    self._tombstones.clear()
                    self._clears_pending -= 1
            return
        rc = int(store.remove(self._mkey(op.key), False))
        if rc == HAS_LEASE and op.tries + 1 < _MAX_DELETE_TRIES:
            # Someone read it within the lease TTL: the master keeps it until the
            # lease ends. Lookups from here miss (tombstone); retry after the lease.
            self._count("remote_lease_conflicts")
            with self._lock:
                self._deferred.append(
                    _Delete(op.key, op.tries + 1, time.monotonic() + 2.0 * (op.tries + 1))
                )
            return
        if rc not in (0, NOT_FOUND):
            self._count("remote_write_errors")
            log.warning("Mooncake remove of %r failed: %d", op.key[:200], rc)
        with self._lock:
            if not any(isinstance(q, _Write) and q.key == op.key for q in self._queue) and not any(
                d.key == op.key for d in self._deferred if isinstance(d, _Delete)
            ):
                self._tombstones.discard(op.key)

    # ------------------------------------------------------------ key listing

    def _monitor_loop(self) -> None:
        """Probe the master while the circuit is not closed (writes alone never
        would: they are dropped while it is open), and fold the keys the store holds
        under our prefix into the membership filter (so this node's clients ask for
        what other nodes wrote). A key missed here costs only a hit; one listed but
        gone costs one lookup round trip."""
        host = self.s.master.rpartition(":")[0]
        url = f"http://{host}:{self.s.admin_port}/get_all_keys"
        last_list = 0.0
        while not self._stopping.wait(0.5 if not self.circuit.up else 0.2):
            store = self._store
            if store is None or not self._connected.is_set():
                continue
            if not self.circuit.up:
                try:
                    rc = int(store.is_exist(self._mkey("\0probe")))
                except Exception:  # noqa: BLE001
                    rc = RPC_FAIL
                if rc in (0, 1):
                    self.circuit.success()
                else:
                    self._failure()
                    continue
            if self.s.key_poll_s <= 0 or time.monotonic() - last_list < self.s.key_poll_s:
                continue
            last_list = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=self.s.timeout_s) as resp:
                    body = resp.read(256 << 20)
            except Exception as exc:  # noqa: BLE001
                log.debug("Mooncake key listing failed: %s", exc)
                self._failure()  # the admin port is the master's: count it as down
                continue
            prefix = self.s.key_prefix
            keys = {
                line[len(prefix) :]
                for line in body.decode("utf-8", "replace").split("\n")
                if line.startswith(prefix) and len(line) > len(prefix)
            }
            self._call_soon(self._fold_keys, keys)

    def _fold_keys(self, keys: set[str]) -> None:
        with self._lock:
            skip = set(self._tombstones)
            for key in [k for k in self._known if k not in keys]:
                del self._known[key]  # gone from the store (evicted, master restarted)
        for key in list(self._reported):
            if key not in keys:
                self._report_removed(key)
        learned = 0
        for key in keys:
            if key not in skip and key not in self._reported:
                self._report_added(key)
                learned += 1
        if learned:
            self._count("remote_announcements", learned)

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self.counters)
            # In flight counts too: zero means every accepted write has ended.
            out["remote_pending_writes"] = self._queued_writes + self._writing
        out["remote_up"] = int(self._connected.is_set() and self.circuit.up)
        out["remote_known_keys"] = len(self._reported)
        return out

    @classmethod
    def empty_stats(cls) -> dict[str, int | float]:
        return dict.fromkeys((*COUNTERS, *GAUGES), 0)
