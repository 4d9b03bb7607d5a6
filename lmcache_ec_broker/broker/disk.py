"""The disk tier: write-behind of committed entries, promotion back into the slab.

One safetensors file per entry (``diskfile.py``) in ``local_disk``. The event
loop only does bookkeeping; file I/O runs on worker threads:

- one *writer* thread owns every change to the directory (write, unlink,
  quarantine), in FIFO order, so a delete queued after a write always wins and
  a later write of the same key always lands after an earlier delete;
- *reader* threads copy files into reserved slab blocks for promotions.

Invariants:
1. An entry is pinned (store connection ``DISK_CONN``) while its bytes are being
   written, so its blocks cannot be reused under the writer.
2. A promotion reserves blocks through the store, fills them off the loop and
   commits only after the checksum matched; otherwise it aborts. Readers never
   see a partial or unverified entry.
3. ``used_bytes + reserved_bytes <= capacity_bytes``: room is made (LRU files
   unlinked, queued before the new write) before a write is queued, so the
   directory never holds more than the capacity of entry files.
4. A file that fails validation is never served: it is dropped from the index
   and moved to ``quarantine/`` (or removed, for stale temp files).
5. Memory eviction keeps the disk copy; delete and clear remove it.
6. Every indexed key counts once in the store's membership filter (if published),
   added before has() can answer True for it and removed after; the memory tier
   counts its own keys separately, so the filter covers both tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..config import format_size
from ..protocol import ErrorReply, Extent, GetReply, Hit, ReserveReply, ReserveStatus
from .diskfile import (
    LOCK_FILE,
    QUARANTINE_DIR,
    SUFFIX,
    TMP_PREFIX,
    CorruptFile,
    file_size_for,
    key_to_filename,
    read_into,
    read_meta_path,
    slab_views,
    write_file,
)
from .store import Entry, Store, StoreListener

log = logging.getLogger("lmcache_ec_broker.disk")

DISK_CONN = -1  # the store connection the disk tier reserves and pins with
_PROGRESS_EVERY_S = 2.0
_SHUTDOWN_FLUSH_S = 120.0
# Monotonic counters of the disk tier (exported as counters by the metrics endpoint).
DISK_COUNTERS = (
    "promotions",
    "disk_writes",
    "disk_errors",
    "disk_writes_skipped",
    "disk_evictions",
    "disk_quarantined",
)


class DiskError(RuntimeError):
    """The disk tier cannot start; the message says why and what to do."""


@dataclass(slots=True)
class DiskEntry:
    fname: str
    file_size: int
    nbytes: int
    dtype: str
    shape: list[int]
    ino: int


@dataclass(slots=True, eq=False)
class _Write:
    key: str
    extents: list[Extent]
    dtype: str
    shape: list[int]
    nbytes: int
    size: int
    pin: int
    cancelled: bool = False


@dataclass(slots=True, eq=False)
class _Promotion:
    future: asyncio.Future[bool]
    pin: int = 0
    waiters: int = 0
    cancelled: bool = False  # deleted or cleared meanwhile: do not resurrect it


class DiskTier(StoreListener):
    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        store: Store,
        file_mode: int = 0o600,
        max_pending_bytes: int | None = None,
        readers: int = 2,
    ) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.store = store
        self.file_mode = file_mode & 0o666
        # Write-behind holds pins; past this many bytes in flight new writes are
        # skipped rather than letting pinned entries starve the slab (one write is
        # always allowed, however large).
        self.max_pending_bytes = max_pending_bytes or max(store.capacity_bytes // 4, 1)
        self.index: OrderedDict[str, DiskEntry] = OrderedDict()  # LRU first
        self.used_bytes = 0
        self.reserved_bytes = 0  # room held for queued writes
        self.pending: dict[str, _Write] = {}
        self.pending_bytes = 0
        self._promoting: dict[str, _Promotion] = {}
        self._n_readers = readers
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mm: Any = None
        self._lock_fd = -1
        self._dir_fd = -1
        self._closing = False
        self._inflight: set[asyncio.Future[Any]] = set()
        self._next_listener = store.listener
        self._warned: dict[str, float] = {}
        self.counters = dict.fromkeys(DISK_COUNTERS, 0)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create/lock the directory and rebuild the index from it (before serving)."""
        d = self.directory
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(
                os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise DiskError(f"cannot use local_disk {d}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise DiskError(
                f"local_disk {d} is in use by another broker; give each broker its own directory"
            ) from None
        self._dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._scan()
        self.store.open_connection(DISK_CONN)
        self.store.listener = self

    def attach(self, mm: Any) -> None:
        """The broker's own mapping of the slab, which the worker threads copy through."""
        self._mm = mm

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ec-disk-writer")
        self._readers = ThreadPoolExecutor(self._n_readers, thread_name_prefix="ec-disk-reader")

    async def shutdown(self) -> None:
        """Finish promotions and flush queued writes; then stop the threads."""
        self._closing = True
        pending = len(self.pending)
        if self._inflight:
            if pending:
                log.info("disk tier: flushing %d pending writes", pending)
            _done, late = await asyncio.wait(set(self._inflight), timeout=_SHUTDOWN_FLUSH_S)
            if late:
                log.warning("disk tier: %d writes/reads still running at shutdown", len(late))
        for pool in (self._writer, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writer = self._readers = None
        self.store.close_connection(DISK_CONN)

    def close(self) -> None:
        """Release the directory (idempotent; also on failed starts)."""
        self._mm = None
        for attr in ("_dir_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)

    # ------------------------------------------------------------ start-up scan

    def _scan(self) -> None:
        d = self.directory
        t0 = last = time.monotonic()
        found: list[tuple[float, str, DiskEntry]] = []
        seen = stale_tmp = foreign = 0
        with os.scandir(d) as it:
            for de in it:
                name = de.name
                if name in (LOCK_FILE, QUARANTINE_DIR):
                    continue
                if name.startswith(TMP_PREFIX):  # a write cut short by a crash
                    with contextlib.suppress(OSError):
                        os.unlink(de.path)
                    stale_tmp += 1
                    continue
                if not name.endswith(SUFFIX) or not de.is_file(follow_symlinks=False):
                    foreign += 1
                    continue
                seen += 1
                try:
                    meta = read_meta_path(de.path)
                    if key_to_filename(meta.key) != name:
                        raise CorruptFile("file name does not match the key it holds")
                    st = de.stat(follow_symlinks=False)
                except CorruptFile as exc:
                    self._quarantine_now(name, str(exc))
                    continue
                except OSError as exc:
                    log.warning("disk tier: cannot read %s: %s; skipping it", de.path, exc)
                    continue
                found.append(
                    (
                        st.st_mtime,
                        meta.key,
                        DiskEntry(
                            name, meta.file_size, meta.nbytes, meta.dtype, meta.shape, st.st_ino
                        ),
                    )
                )
                now = time.monotonic()
                if now - last >= _PROGRESS_EVERY_S:
                    last = now
                    log.info("disk tier: scanned %d files in %s so far ...", seen, d)
        found.sort(key=lambda t: t[0])  # oldest first: LRU order survives restarts via mtime
        for _mtime, key, entry in found:
            self._index_put(key, entry)
        evicted = 0
        while self.used_bytes > self.capacity_bytes and self.index:
            entry = self._index_pop(next(iter(self.index)))
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, entry.fname))
            evicted += 1
        if stale_tmp:
            log.info("disk tier: removed %d unfinished temp files of a previous run", stale_tmp)
        if foreign:
            log.warning("disk tier: left %d files that are not entries alone in %s", foreign, d)
        if evicted:
            log.info("disk tier: removed %d oldest entries to fit max_local_disk_size", evicted)
        log.info(
            "disk tier at %s: %d entries (%s of %s) indexed in %.2fs",
            d,
            len(self.index),
            format_size(self.used_bytes),
            format_size(self.capacity_bytes),
            time.monotonic() - t0,
        )

    def _quarantine_now(self, fname: str, reason: str, ino: int | None = None) -> None:
        """Move a bad file aside (any thread that owns the directory right now)."""
        src = os.path.join(self.directory, fname)
        qdir = os.path.join(self.directory, QUARANTINE_DIR)
        try:
            if ino is not None and os.stat(src, follow_symlinks=False).st_ino != ino:
                return  # replaced by a newer, valid write meanwhile
            os.makedirs(qdir, mode=0o700, exist_ok=True)
            dst = os.path.join(qdir, fname)
            if os.path.lexists(dst):
                dst = f"{dst}.{time.time_ns()}"
            os.rename(src, dst)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("disk tier: cannot quarantine %s (%s); removing it", src, exc)
            with contextlib.suppress(OSError):
                os.unlink(src)
            dst = "(removed)"
        self.counters["disk_quarantined"] += 1
        log.warning("disk tier: %s is not servable (%s); moved to %s", src, reason, dst)

    # ------------------------------------------------------------ threads

    def _submit(self, pool: ThreadPoolExecutor | None, fn: Any, *args: Any) -> asyncio.Future[Any]:
        assert pool is not None and self._loop is not None
        fut = self._loop.run_in_executor(pool, fn, *args)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _queue_fs(self, fn: Any, *args: Any) -> None:
        """A directory change in FIFO order with the writes; runs even while closing."""
        if self._writer is None:
            return
        fut = self._submit(self._writer, fn, *args)
        fut.add_done_callback(_log_failure)

    def _unlink(self, fname: str, ino: int | None) -> None:
        path = os.path.join(self.directory, fname)
        try:
            if ino is not None and os.stat(path, follow_symlinks=False).st_ino != ino:
                return
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _remove_all(self) -> None:
        with os.scandir(self.directory) as it:
            for de in it:
                if de.name.endswith(SUFFIX) and not de.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(de.path)

    def _warn(self, what: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            log.warning(msg, *args)

    # ------------------------------------------------------------ index

    def _index_put(self, key: str, entry: DiskEntry) -> None:
        """Index a published file. The store's membership filter (clients answer misses
        from it) learns the key first: has() answers True for it from now on."""
        old = self.index.get(key)
        if old is None:
            if self.store.membership is not None:
                self.store.membership.add(key)
        else:
            self.used_bytes -= old.file_size
        self.index[key] = entry
        self.index.move_to_end(key)
        self.used_bytes += entry.file_size

    def _index_pop(self, key: str) -> DiskEntry | None:
        """Unindex; the filter forgets the key only after has() stopped counting it."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.file_size
            if self.store.membership is not None:
                self.store.membership.remove(key)
        return entry

    # ------------------------------------------------------------ capacity

    def _make_room(self, size: int) -> bool:
        """Evict LRU files until ``size`` more bytes fit; unlinks are queued before the write."""
        while self.used_bytes + self.reserved_bytes + size > self.capacity_bytes:
            if not self.index:
                return False
            entry = self._index_pop(next(iter(self.index)))
            self.counters["disk_evictions"] += 1
            self._queue_fs(self._unlink, entry.fname, entry.ino)
        return True

    def touch(self, key: str) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    # ------------------------------------------------------------ store listener

    def on_ready(self, entry: Entry) -> None:
        try:
            self._write_behind(entry)
        finally:
            self._next_listener.on_ready(entry)

    def on_evicted(self, entry: Entry) -> None:
        self._next_listener.on_evicted(entry)  # the disk copy stays

    def on_deleted(self, key: str) -> None:
        self.remove(key)
        self._next_listener.on_deleted(key)

    def _write_behind(self, entry: Entry) -> None:
        key = entry.key
        if key in self._promoting:
            self.touch(key)  # came from this disk copy
            return
        known = self.index.get(key)
        if known is not None and (known.nbytes, known.dtype, known.shape) == (
            entry.nbytes,
            entry.dtype,
            entry.shape,
        ):
            self.touch(key)
            return
        if self._closing or self._mm is None or self._writer is None:
            return
        size = file_size_for(key, entry.dtype, entry.shape)
        if size > self.capacity_bytes:
            self.counters["disk_writes_skipped"] += 1
            self._warn(
                "too-large",
                "disk tier: an entry of %s exceeds max_local_disk_size; not written to disk",
                format_size(size),
            )
            return
        if self.pending_bytes and self.pending_bytes + entry.nbytes > self.max_pending_bytes:
            self.counters["disk_writes_skipped"] += 1
            self._warn(
                "backlog",
                "disk tier: write-behind backlog over %s; skipping writes "
                "until the disk catches up",
                format_size(self.max_pending_bytes),
            )
            return
        if known is not None:
            self.remove(key)
        if not self._make_room(size):
            self.counters["disk_writes_skipped"] += 1
            return
        job = _Write(
            key,
            list(entry.extents),
            entry.dtype,
            list(entry.shape),
            entry.nbytes,
            size,
            self.store.pin_entry(DISK_CONN, entry),
        )
        old = self.pending.get(key)
        if old is not None:
            old.cancelled = True
        self.pending[key] = job
        self.pending_bytes += job.nbytes
        self.reserved_bytes += size
        fut = self._submit(self._writer, self._write_job, job)
        fut.add_done_callback(lambda f: self._write_done(job, f))

    def _write_job(self, job: _Write) -> tuple[int, int] | None:
        if job.cancelled:
            return None
        with slab_views(self._mm, job.extents) as views:
            return write_file(
                self.directory, self._dir_fd, job.key, job.dtype, job.shape, views, self.file_mode
            )

    def _write_done(self, job: _Write, fut: asyncio.Future[tuple[int, int] | None]) -> None:
        if DISK_CONN in self.store.conns:
            self.store.release(DISK_CONN, [job.pin])
        self.pending_bytes -= job.nbytes
        self.reserved_bytes -= job.size
        if self.pending.get(job.key) is job:
            del self.pending[job.key]
        exc = fut.exception() if not fut.cancelled() else None
        result = None if fut.cancelled() or exc is not None else fut.result()
        if exc is not None:
            self.counters["disk_errors"] += 1
            self._warn("write", "disk tier: writing %r failed: %s", job.key[:200], exc)
            return
        if job.cancelled or result is None:
            return
        file_size, ino = result
        self._index_put(
            job.key,
            DiskEntry(key_to_filename(job.key), file_size, job.nbytes, job.dtype, job.shape, ino),
        )
        self.counters["disk_writes"] += 1
        # size == file_size by construction; re-check in case the format ever drifts.
        if file_size != job.size:
            self._make_room(0)

    # ------------------------------------------------------------ requests

    def remove(self, key: str) -> bool:
        """Forget ``key`` on disk (delete/clear); True if there was something to forget."""
        job = self.pending.pop(key, None)
        if job is not None:
            job.cancelled = True
        entry = self._index_pop(key)
        prom = self._promoting.get(key)
        if prom is not None:
            prom.cancelled = True
        if job is None and entry is None:
            return False
        self._queue_fs(self._unlink, key_to_filename(key), None)
        return True

    def clear(self) -> int:
        n = len(self.index)
        for job in self.pending.values():
            job.cancelled = True
        self.pending.clear()
        for prom in self._promoting.values():
            prom.cancelled = True
        for key in list(self.index):
            self._index_pop(key)
        self._queue_fs(self._remove_all)
        return n

    def delete(self, keys: list[str], deleted: list[bool]) -> list[bool]:
        """After ``store.delete``: also delete the disk-only ones."""
        return [d or self.remove(k) for k, d in zip(keys, deleted, strict=True)]

    def has(self, keys: list[str], hits: list[bool], lease_ms: int) -> list[bool]:
        """After ``store.has``: a disk-only key is a hit too (a later get promotes it).
        With a lease (the caller will load soon) the promotion starts right away."""
        out = list(hits)
        counters = self.store.counters
        for i, key in enumerate(keys):
            if key not in self.index:
                continue
            self.index.move_to_end(key)
            if hits[i]:
                continue
            out[i] = True
            counters["has_misses"] -= 1
            counters["has_hits"] += 1
            if lease_ms > 0 and not self._closing:
                self._promotion(key)
        return out

    def get(self, conn: int, keys: list[str]) -> GetReply | Awaitable[GetReply]:
        items = self.store.get(conn, keys)
        missing = []
        for i, key in enumerate(keys):
            if key in self.index:
                self.index.move_to_end(key)
                if items[i] is None:
                    missing.append(i)
        if not missing or self._closing or self._readers is None:
            return GetReply(items)
        # Not a miss unless the promotion fails; uncounted now so the counter never goes down.
        self.store.counters["misses"] -= len(missing)
        return self._get_promoted(conn, keys, items, missing)

    async def _get_promoted(
        self, conn: int, keys: list[str], items: list[Hit | None], missing: list[int]
    ) -> GetReply:
        proms: dict[str, _Promotion] = {}
        for i in missing:
            if keys[i] not in proms:
                proms[keys[i]] = p = self._promotion(keys[i])
                p.waiters += 1
        try:
            await asyncio.wait([p.future for p in proms.values()])
            ok = [i for i in missing if _succeeded(proms[keys[i]].future)]
            if conn not in self.store.conns:
                ok = []  # the client left meanwhile: nothing to pin for it
            self.store.counters["misses"] += len(missing) - len(ok)
            if ok:
                hits = self.store.get(conn, [keys[i] for i in ok])  # counts hits (or misses)
                for i, hit in zip(ok, hits, strict=True):
                    items[i] = hit
        finally:
            for p in proms.values():
                p.waiters -= 1
                self._release_promotion(p)
        return GetReply(items)

    # ------------------------------------------------------------ promotion

    def _promotion(self, key: str) -> _Promotion:
        prom = self._promoting.get(key)
        if prom is None:
            assert self._loop is not None
            prom = _Promotion(self._loop.create_future())
            self._promoting[key] = prom
            task = self._loop.create_task(self._promote(key, prom))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        return prom

    def _release_promotion(self, prom: _Promotion) -> None:
        """Drop the promotion's pin once it is done and every waiting get has pinned."""
        if prom.pin and prom.waiters == 0 and prom.future.done():
            if DISK_CONN in self.store.conns:
                self.store.release(DISK_CONN, [prom.pin])
            prom.pin = 0

    async def _promote(self, key: str, prom: _Promotion) -> None:
        ok = False
        try:
            ok = await self._promote_into_slab(key, prom)
        except Exception:
            log.exception("disk tier: promoting %r failed", key[:200])
        finally:
            del self._promoting[key]
            prom.future.set_result(ok)
            self._release_promotion(prom)

    async def _promote_into_slab(self, key: str, prom: _Promotion) -> bool:
        store = self.store
        entry = self.index.get(key)
        if entry is None or self._mm is None:
            return False
        reply = store.reserve(DISK_CONN, key, entry.nbytes, entry.dtype, entry.shape)
        if isinstance(reply, ErrorReply):
            self._warn("promote", "disk tier: cannot promote %r: %s", key[:200], reply.message)
            return False
        assert isinstance(reply, ReserveReply)
        if reply.status == ReserveStatus.PRESENT:
            prom.pin = store.pin_entry(DISK_CONN, store.entries[key])
            return True
        if reply.status != ReserveStatus.RESERVED:
            return False  # a client is writing this key right now
        try:
            await self._submit(self._readers, self._read_job, key, entry.fname, reply.extents)
        except FileNotFoundError:
            self._drop_if_current(key, entry)
            store.abort(DISK_CONN, reply.token)
            return False
        except CorruptFile as exc:
            store.abort(DISK_CONN, reply.token)
            self.counters["disk_errors"] += 1
            if self._drop_if_current(key, entry):
                self._queue_fs(self._quarantine_now, entry.fname, str(exc), entry.ino)
            return False
        except BaseException as exc:
            if DISK_CONN in store.conns:
                store.abort(DISK_CONN, reply.token)
            if isinstance(exc, OSError):
                self.counters["disk_errors"] += 1
                self._warn("read", "disk tier: reading %s failed: %s", entry.fname, exc)
                return False
            raise
        if prom.cancelled:
            store.abort(DISK_CONN, reply.token)
            return False
        if store.commit(DISK_CONN, reply.token) is not None:
            return False
        self.counters["promotions"] += 1
        prom.pin = store.pin_entry(DISK_CONN, store.entries[key])
        return True

    def _read_job(self, key: str, fname: str, extents: list[Extent]) -> None:
        path = os.path.join(self.directory, fname)
        with slab_views(self._mm, extents) as views:
            read_into(path, key, views)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the LRU order rebuilt at the next start

    def _drop_if_current(self, key: str, entry: DiskEntry) -> bool:
        if self.index.get(key) is entry:
            self._index_pop(key)
            return True
        return False

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        return {
            "disk_entries": len(self.index),
            "disk_used_bytes": self.used_bytes,
            "disk_capacity_bytes": self.capacity_bytes,
            "disk_pending_writes": len(self.pending),
            **self.counters,
        }


EMPTY_STATS = {
    "disk_entries": 0,
    "disk_used_bytes": 0,
    "disk_capacity_bytes": 0,
    "disk_pending_writes": 0,
    "promotions": 0,
    "disk_writes": 0,
    "disk_errors": 0,
    "disk_writes_skipped": 0,
    "disk_evictions": 0,
    "disk_quarantined": 0,
}


def _succeeded(fut: asyncio.Future[bool]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None and fut.result()


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("disk tier: directory operation failed: %s", fut.exception())
