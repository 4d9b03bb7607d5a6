"""The local disk tier: one safetensors file per entry (``file.py``).

The event loop only does bookkeeping; file I/O runs on worker threads:

- one *writer* thread owns every change to the directory (write, unlink,
  quarantine), in FIFO order, so a delete queued after a write always wins and
  a later write of the same key always lands after an earlier delete;
- *reader* threads copy files into reserved slab extents for promotions.

Invariants:
1. ``used_bytes + reserved_bytes <= capacity_bytes``: room is made (LRU files
   unlinked, queued before the new write) before a write is queued, so the
   directory never holds more than the capacity of entry files.
2. A held key (a lease covers it: ``hold``) is never chosen for LRU eviction; a
   write that finds no room without evicting held keys is skipped instead.
3. A file that fails validation is never served: it is dropped from the index
   and moved to ``quarantine/`` (capped: oldest quarantined files go first).
4. Every indexed key is reported once to the events sink (``added`` before
   ``peek`` answers it, ``removed`` after it stopped).
5. The tier touches the slab only inside the extents of a ``read_into`` or
   ``write`` call, until the returned awaitable completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ....protocol import Extent
from ....sizes import format_size
from ..base import (
    EntryMeta,
    LowerTier,
    SlabAccess,
    TierCorrupt,
    TierError,
    TierEvents,
    TierMiss,
    TierUnavailable,
)
from .directory import prepare_directory
from .file import (
    LOCK_FILE,
    QUARANTINE_DIR,
    SUFFIX,
    TMP_PREFIX,
    CorruptFile,
    UnverifiableFile,
    file_size_for,
    key_to_filename,
    read_into,
    read_meta_path,
    write_file,
)

log = logging.getLogger("lmcache_ec_broker.disk")

_PROGRESS_EVERY_S = 2.0
_MIN_QUARANTINE_CAP = 64 << 20

# Monotonic counters of the disk tier (exported as counters by the metrics endpoint).
DISK_COUNTERS = (
    "disk_writes",
    "disk_errors",
    "disk_writes_skipped",
    "disk_evictions",
    "disk_quarantined",
    "disk_quarantine_dropped",
)
DISK_GAUGES = (
    "disk_entries",
    "disk_used_bytes",
    "disk_capacity_bytes",
    "disk_pending_writes",
    "disk_held",
    "disk_quarantine_bytes",
)

DiskError = TierError  # the disk tier cannot start; kept for callers of the old name


@dataclass(slots=True)
class DiskEntry:
    fname: str
    file_size: int
    meta: EntryMeta
    ino: int


@dataclass(slots=True, eq=False)
class _Write:
    key: str
    extents: list[Extent]
    meta: EntryMeta
    size: int
    cancelled: bool = False


class DiskTier(LowerTier):
    name = "disk"
    counter_names = DISK_COUNTERS

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        max_pending_bytes: int = 64 << 20,
        readers: int = 2,
        quarantine_cap: int | None = None,
    ) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        # Write-behind pins slab entries; past this many bytes in flight new writes
        # are skipped rather than letting pinned entries starve the slab (one write
        # is always allowed, however large).
        self.max_pending_bytes = max(max_pending_bytes, 1)
        # Quarantined files are evidence, not cache: bounded so a disk that keeps
        # corrupting files cannot fill the file system.
        self.quarantine_cap = (
            quarantine_cap
            if quarantine_cap is not None
            else min(max(capacity_bytes // 10, _MIN_QUARANTINE_CAP), max(capacity_bytes, 1))
        )
        self.index: OrderedDict[str, DiskEntry] = OrderedDict()  # LRU first
        self.used_bytes = 0
        self.reserved_bytes = 0  # room held for queued writes
        self.pending: dict[str, _Write] = {}
        self.pending_bytes = 0
        self._held: dict[str, int] = {}
        self._n_readers = readers
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slab: SlabAccess | None = None
        self._events: TierEvents | None = None
        self._lock_fd = -1
        self._dir_fd = -1
        self._was_private = True  # no other uid could reach the files before open()
        self._closing = False
        self._inflight: set[asyncio.Future[Any]] = set()
        self._warned: dict[str, float] = {}
        # (file name, size), oldest first; touched only by the thread owning the directory.
        self._quarantine: deque[tuple[str, int]] = deque()
        self.quarantine_bytes = 0
        self.counters = dict.fromkeys(DISK_COUNTERS, 0)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create/lock the directory and rebuild the index from it (before serving)."""
        d = self.directory
        try:
            # 0700, ours: else a TierError naming the fix.
            self._was_private = prepare_directory(d)
            self._lock_fd = os.open(
                os.path.join(d, LOCK_FILE),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
        except OSError as exc:
            raise TierError(f"cannot use local_disk {d}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise TierError(
                f"local_disk {d} is in use by another broker; give each broker its own directory"
            ) from None
        self._dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._scan_quarantine()
        self._scan()

    def start(self, loop: asyncio.AbstractEventLoop, slab: SlabAccess, events: TierEvents) -> None:
        self._loop = loop
        self._slab = slab
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ec-disk-writer")
        self._readers = ThreadPoolExecutor(self._n_readers, thread_name_prefix="ec-disk-reader")
        self._events = events
        for key in self.index:  # indexed by the start-up scan, before any lookup
            events.added(self, key)

    async def shutdown(self, deadline_s: float) -> None:
        """Flush queued writes and finish reads for up to ``deadline_s`` seconds;
        writes not started by then are abandoned (the entries stay in the slab
        until the process exits, the disk keeps its older state)."""
        self._closing = True
        if self._inflight:
            if self.pending:
                log.info(
                    "disk tier: flushing %d pending writes (up to %.0fs)",
                    len(self.pending),
                    deadline_s,
                )
            _done, late = await asyncio.wait(set(self._inflight), timeout=max(deadline_s, 0))
            if late:
                abandoned = sum(1 for job in self.pending.values() if not job.cancelled)
                for job in self.pending.values():
                    job.cancelled = True  # queued jobs return at once
                log.warning(
                    "disk tier: shutdown_flush_s=%.0f passed with %d writes not flushed; "
                    "abandoning them (raise shutdown_flush_s and the supervisor's stop "
                    "timeout to flush more)",
                    deadline_s,
                    abandoned,
                )
                # At most the one write and the reads already copying finish now.
                await asyncio.wait(set(self._inflight))
        for pool in (self._writer, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writer = self._readers = None
        self._slab = None

    def close(self) -> None:
        """Release the directory (idempotent; also on failed starts)."""
        self._slab = None
        for attr in ("_dir_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)

    def expected_keys(self, block_size: int) -> int:
        return self.capacity_bytes // max(block_size, 1)

    # ------------------------------------------------------------ start-up scan

    def _scan(self) -> None:
        d = self.directory
        t0 = last = time.monotonic()
        found: list[tuple[float, str, DiskEntry]] = []
        seen = stale_tmp = foreign = unverifiable = 0
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
                    meta = read_meta_path(de.path, unreachable=self._was_private)
                    if key_to_filename(meta.key) != name:
                        raise CorruptFile("file name does not match the key it holds")
                    st = de.stat(follow_symlinks=False)
                except UnverifiableFile:
                    unverifiable += 1  # valid, but this install cannot check it: keep it
                    continue
                except CorruptFile as exc:
                    self._quarantine_now(name, str(exc))
                    continue
                except OSError as exc:
                    log.warning("disk tier: cannot read %s: %s; skipping it", de.path, exc)
                    continue
                em = EntryMeta(meta.nbytes, meta.dtype, tuple(meta.shape))
                found.append(
                    (st.st_mtime, meta.key, DiskEntry(name, meta.file_size, em, st.st_ino))
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
            assert entry is not None
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, entry.fname))
            evicted += 1
        if stale_tmp:
            log.info("disk tier: removed %d unfinished temp files of a previous run", stale_tmp)
        if foreign:
            log.warning("disk tier: left %d files that are not entries alone in %s", foreign, d)
        if unverifiable:
            log.warning(
                "disk tier: %d files carry blake3 checksums but the blake3 package is not "
                "installed; they are left in place and not served (pip install blake3)",
                unverifiable,
            )
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

    def _scan_quarantine(self) -> None:
        qdir = os.path.join(self.directory, QUARANTINE_DIR)
        found: list[tuple[float, str, int]] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(qdir) as it:
            for de in it:
                with contextlib.suppress(OSError):
                    if de.is_file(follow_symlinks=False):
                        st = de.stat(follow_symlinks=False)
                        found.append((st.st_mtime, de.name, st.st_size))
        found.sort()
        for _mtime, name, size in found:
            self._quarantine.append((name, size))
            self.quarantine_bytes += size
        self._trim_quarantine(0)

    def _trim_quarantine(self, incoming: int) -> None:
        """Remove the oldest quarantined files until ``incoming`` more bytes fit the cap."""
        qdir = os.path.join(self.directory, QUARANTINE_DIR)
        while self._quarantine and self.quarantine_bytes + incoming > self.quarantine_cap:
            name, size = self._quarantine.popleft()
            self.quarantine_bytes -= size
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(qdir, name))
            self.counters["disk_quarantine_dropped"] += 1

    def _quarantine_now(self, fname: str, reason: str, ino: int | None = None) -> None:
        """Move a bad file aside (the thread that owns the directory right now)."""
        src = os.path.join(self.directory, fname)
        qdir = os.path.join(self.directory, QUARANTINE_DIR)
        try:
            st = os.stat(src, follow_symlinks=False)
            if ino is not None and st.st_ino != ino:
                return  # replaced by a newer, valid write meanwhile
            if st.st_size > self.quarantine_cap:
                os.unlink(src)
                dst = "(removed: larger than the quarantine cap)"
                self.counters["disk_quarantine_dropped"] += 1
            else:
                self._trim_quarantine(st.st_size)
                os.makedirs(qdir, mode=0o700, exist_ok=True)
                dst = os.path.join(qdir, fname)
                if os.path.lexists(dst):
                    dst = f"{dst}.{time.time_ns()}"
                os.rename(src, dst)
                self._quarantine.append((os.path.basename(dst), st.st_size))
                self.quarantine_bytes += st.st_size
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
        """Index a published file; the events sink learns the key first."""
        old = self.index.get(key)
        if old is None:
            if self._events is not None:
                self._events.added(self, key)
        else:
            self.used_bytes -= old.file_size
        self.index[key] = entry
        self.index.move_to_end(key)
        self.used_bytes += entry.file_size

    def _index_pop(self, key: str) -> DiskEntry | None:
        """Unindex; the events sink forgets the key only after peek stopped answering it."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.file_size
            if self._events is not None:
                self._events.removed(self, key)
        return entry

    # ------------------------------------------------------------ capacity

    def _make_room(self, size: int) -> bool:
        """Evict LRU unheld files until ``size`` more bytes fit; unlinks are queued
        before the write. False (nothing evicted) if only held files could make room."""
        need = self.used_bytes + self.reserved_bytes + size - self.capacity_bytes
        if need <= 0:
            return True
        victims: list[str] = []
        for key, entry in self.index.items():
            if key in self._held:
                continue
            victims.append(key)
            need -= entry.file_size
            if need <= 0:
                break
        if need > 0:
            return False
        for key in victims:
            entry = self._index_pop(key)
            assert entry is not None
            self.counters["disk_evictions"] += 1
            self._queue_fs(self._unlink, entry.fname, entry.ino)
        return True

    def touch(self, key: str) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    def hold(self, key: str) -> None:
        self._held[key] = self._held.get(key, 0) + 1

    def unhold(self, key: str) -> None:
        n = self._held.get(key, 0)
        if n <= 1:
            self._held.pop(key, None)
        else:
            self._held[key] = n - 1

    # ------------------------------------------------------------ lookups

    def peek(self, keys: Sequence[str]) -> list[EntryMeta | None]:
        out: list[EntryMeta | None] = []
        for key in keys:
            entry = self.index.get(key)
            out.append(entry.meta if entry is not None else None)
        return out

    # ------------------------------------------------------------ write-behind

    def write(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None] | None:
        known = self.index.get(key)
        if known is not None and known.meta == meta:
            self.touch(key)
            return None
        if self._closing or self._slab is None or self._writer is None:
            return None
        size = file_size_for(key, meta.dtype, list(meta.shape))
        if size > self.capacity_bytes:
            self.counters["disk_writes_skipped"] += 1
            self._warn(
                "too-large",
                "disk tier: an entry of %s exceeds max_local_disk_size; not written to disk",
                format_size(size),
            )
            return None
        if self.pending_bytes and self.pending_bytes + meta.nbytes > self.max_pending_bytes:
            self.counters["disk_writes_skipped"] += 1
            self._warn(
                "backlog",
                "disk tier: write-behind backlog over %s; skipping writes "
                "until the disk catches up",
                format_size(self.max_pending_bytes),
            )
            return None
        if known is not None:
            self._forget(key)
        if not self._make_room(size):
            self.counters["disk_writes_skipped"] += 1
            return None
        job = _Write(key, list(extents), meta, size)
        old = self.pending.get(key)
        if old is not None:
            old.cancelled = True
        self.pending[key] = job
        self.pending_bytes += meta.nbytes
        self.reserved_bytes += size
        fut = self._submit(self._writer, self._write_job, job)
        fut.add_done_callback(lambda f: self._write_done(job, f))
        return fut

    def _write_job(self, job: _Write) -> tuple[int, int] | None:
        slab = self._slab
        if job.cancelled or slab is None:
            return None
        with slab.views(job.extents) as views:
            return write_file(
                self.directory,
                self._dir_fd,
                job.key,
                job.meta.dtype,
                list(job.meta.shape),
                views,
            )

    def _write_done(self, job: _Write, fut: asyncio.Future[tuple[int, int] | None]) -> None:
        self.pending_bytes -= job.meta.nbytes
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
            return  # deleted meanwhile: the unlink queued behind this write removes the file
        file_size, ino = result
        self._index_put(job.key, DiskEntry(key_to_filename(job.key), file_size, job.meta, ino))
        self.counters["disk_writes"] += 1
        # size == file_size by construction; re-check in case the format ever drifts.
        if file_size != job.size:
            self._make_room(0)

    # ------------------------------------------------------------ delete / clear

    def _forget(self, key: str) -> bool:
        job = self.pending.pop(key, None)
        if job is not None:
            job.cancelled = True
        entry = self._index_pop(key)
        if job is None and entry is None:
            return False
        self._queue_fs(self._unlink, key_to_filename(key), None)
        return True

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return [self._forget(key) for key in keys]

    def clear(self) -> int:
        n = len(self.index)
        for job in self.pending.values():
            job.cancelled = True
        self.pending.clear()
        for key in list(self.index):
            self._index_pop(key)
        self._queue_fs(self._remove_all)
        return n

    # ------------------------------------------------------------ promotion reads

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None]:
        return self._read(key, meta, extents)

    async def _read(self, key: str, meta: EntryMeta, extents: list[Extent]) -> None:
        entry = self.index.get(key)
        if entry is None or entry.meta != meta:
            raise TierMiss(key)
        if self._readers is None or self._closing:
            raise TierUnavailable("disk tier is shutting down")
        try:
            await self._submit(self._readers, self._read_job, key, entry.fname, extents)
        except FileNotFoundError:
            self._drop_if_current(key, entry)
            raise TierMiss(key) from None
        except UnverifiableFile as exc:
            self._drop_if_current(key, entry)  # left on disk for an install with blake3
            raise TierUnavailable(str(exc)) from None
        except CorruptFile as exc:
            self.counters["disk_errors"] += 1
            if self._drop_if_current(key, entry):
                self._queue_fs(self._quarantine_now, entry.fname, str(exc), entry.ino)
            raise TierCorrupt(str(exc)) from None
        except OSError as exc:
            self.counters["disk_errors"] += 1
            self._warn("read", "disk tier: reading %s failed: %s", entry.fname, exc)
            raise TierUnavailable(str(exc)) from None

    def _read_job(self, key: str, fname: str, extents: list[Extent]) -> None:
        slab = self._slab
        if slab is None:
            raise OSError("the slab is no longer mapped")
        path = os.path.join(self.directory, fname)
        with slab.views(extents) as views:
            read_into(path, key, views)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the LRU order rebuilt at the next start

    def _drop_if_current(self, key: str, entry: DiskEntry) -> bool:
        if self.index.get(key) is entry:
            self._index_pop(key)
            return True
        return False

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int | float]:
        return {
            "disk_entries": len(self.index),
            "disk_used_bytes": self.used_bytes,
            "disk_capacity_bytes": self.capacity_bytes,
            "disk_pending_writes": len(self.pending),
            "disk_held": len(self._held),
            "disk_quarantine_bytes": self.quarantine_bytes,
            **self.counters,
        }

    @classmethod
    def empty_stats(cls) -> dict[str, int | float]:
        return dict.fromkeys(DISK_GAUGES + DISK_COUNTERS, 0)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("disk tier: directory operation failed: %s", fut.exception())
