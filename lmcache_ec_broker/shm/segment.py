"""One shared-memory segment: create (broker), attach (clients); older brokers'
named segments removed (``unlink_segment``, ``remove_stale``).

Invariants kept here:
- Every segment the broker makes is a memfd: no name in /dev/shm (nobody can take
  one first or open one by path), and nothing outlives the last descriptor and
  mapping -- a killed broker leaves no segment behind. The slab and the journal's
  placed words, which clients write, are sealed against resizing
  (``create_memfd``): a client holding the read-write descriptor could otherwise
  shrink it, and every other process's next access past the new end -- other
  clients' copies, the broker's -- would die of SIGBUS. What only the broker writes
  is sealed against writes too (``create_sealed``).
- The slab's pages are pre-faulted at creation (first-touch faults make later
  copies ~10x slower), after checking the memory it takes is there
  (``memory_free_bytes``: MemAvailable, or what is left of the cgroup's
  ``memory.max``): a short host or container is a clear refusal at start, not an
  out-of-memory kill while pre-faulting.
- Named segments are what older brokers made (the slab, and before the sealed
  memfds its -f, -j, -r), each under an exclusive ``flock`` its creator held for its
  life; ``remove_stale`` unlinks only those whose lock it can take. The
  socket lock alone cannot prove a segment stale: two containers with their own
  /tmp but one shared /dev/shm derive the same names from the same socket path,
  and each would see the other's live segments as a dead broker's.
- A memfd segment needs no unlinking: ``close`` drops the broker's descriptor and
  mapping, and the memory goes with the last client's.
- A client never writes while attaching: its pre-fault only reads (or asks the
  kernel to map pages without touching them). Another process may be copying
  into its own reservation at that moment; a read-modify-write of any byte here
  could put a stale value back over that copy.
- A client maps a segment only after checking (fstat) that a trusted uid owns it.
- The broker hands every segment to admitted clients over the socket as a file
  descriptor (SCM_RIGHTS, broker/connection.py): who may map it is decided by the
  broker's admission. What only the broker writes (the membership filter, the
  residency index, the journal's settled words) is a sealed memfd
  (``create_sealed``): no mapping but the one made before sealing can write it
  (root's included; a reopen through /proc/<pid>/fd maps PROT_WRITE only to EPERM).
- No segment name another uid can take first (issue 40, item 3): /dev/shm is
  world-writable, so a name derivable from one already visible could be created by
  someone else before the broker, and ``O_EXCL`` would then keep the broker from
  starting, at every restart. No segment has a name now.
- ``remove_stale`` touches only regular files the broker's uid owns, opened
  without following links or blocking: another uid's file under the prefix (a
  FIFO included) is left alone, never unlinked, never waited on.
- ``multiprocessing.shared_memory`` is deliberately not used: before Python 3.13
  its resource tracker unlinks segments that a process merely attached.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Collection

import posix_ipc

from ..sizes import format_size

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MADV_POPULATE_READ = 22  # Linux >= 5.14; not exported by Python 3.11's mmap module
_MADV_POPULATE_WRITE = 23
# The madvise calls tried, in order, before falling back to touching pages. Both
# only fault page-table entries in; neither reads nor writes the memory's contents.
_POPULATE_ADVICE: tuple[int, ...] = (_MADV_POPULATE_WRITE, _MADV_POPULATE_READ)
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not exported by Python 3.11's fcntl module


class ShmError(RuntimeError):
    """A shared-memory segment cannot be created or attached; the message says why."""


def memory_free_bytes(
    meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> tuple[int, str]:
    """What a new memfd's pages may take, and where the bound comes from: the host's
    MemAvailable, or less under this process's cgroup v2 ``memory.max`` (what is left
    of it). A memfd's pages are shared memory, charged as /dev/shm's are, but no
    /dev/shm size bounds them."""
    avail, source = -1, "MemAvailable"
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(cgroup) as f:
            paths = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")]
        base = os.path.join(root, paths[0].lstrip("/")) if paths else None
        if base is not None:
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    left = max(0, int(limit) - int(f.read().strip()))
                if avail < 0 or left < avail:
                    avail, source = left, f"cgroup memory.max {format_size(int(limit))}"
    except (OSError, ValueError, IndexError):
        pass
    return avail, source


def _madvise_populate(mm: mmap.mmap) -> bool:
    for advice in _POPULATE_ADVICE:
        try:
            mm.madvise(advice)
            return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _populate_new(mm: mmap.mmap, size: int) -> None:
    """Fault in a segment this process just created (it owns every byte: writing is fine)."""
    if size == 0 or _madvise_populate(mm):
        return
    chunk = bytes(1 << 24)
    for off in range(0, size, len(chunk)):
        n = min(len(chunk), size - off)
        mm[off : off + n] = chunk[:n]


def _populate_shared(mm: mmap.mmap, size: int) -> None:
    """Fault in a live segment others write to, by reading only (see the invariant)."""
    if size == 0 or _madvise_populate(mm):
        return
    try:
        mm.madvise(mmap.MADV_WILLNEED)
    except (OSError, ValueError, AttributeError):
        pass
    page = mmap.PAGESIZE
    view = memoryview(mm)
    try:
        sum(view[off] for off in range(0, size, page))  # one read per page maps it
    finally:
        view.release()


def check_owner(fd: int, name: str, owners: Collection[int]) -> None:
    """Refuse a segment not owned by one of ``owners``: someone else's memory would
    let them read every tensor written and feed back their own bytes."""
    uid = os.fstat(fd).st_uid
    if uid not in owners:
        raise ShmError(
            f"shared-memory segment {name} belongs to uid {uid}, not to the broker's uid "
            f"({' or '.join(map(str, sorted(owners)))}); refusing to map another user's memory"
        )


class Segment:
    """A mapped shared-memory segment: a memfd this process made, or one it attached."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self.mm = mm
        self.owner = owner
        self._memfd: int | None = None  # a memfd segment's descriptor (create_memfd/_sealed)

    @classmethod
    def _create_memfd(
        cls, name: str, size: int, seals: int, prefault: bool, what: str
    ) -> Segment:
        """A memfd of ``size`` bytes mapped writable here, pre-faulted if asked, then
        sealed with ``seals`` (after the mapping: F_SEAL_FUTURE_WRITE spares only the
        mappings made before it). ``name`` is a label (logs, the handshake,
        /proc/<pid>/fd's "/memfd:<name>")."""
        if size <= 0:
            raise ShmError(f"segment size must be positive, got {size} bytes")
        try:
            fd = os.memfd_create(name.lstrip("/"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ShmError(f"cannot create {what} {name}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            if prefault:
                _populate_new(mm, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise ShmError(f"cannot create {what} {name}: {exc}") from exc
            raise
        seg = cls(name, size, mm, owner=True)
        seg._memfd = fd
        return seg

    @classmethod
    def create_sealed(cls, name: str, size: int, prefault: bool = False) -> Segment:
        """A segment only the broker writes: a memfd (no path in /dev/shm), mapped
        writable here, then sealed (F_SEAL_FUTURE_WRITE, no shrinking or growing) so
        that every other mapping of it, by any process, is read-only. ``prefault``:
        fault the pages in before sealing."""
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE
        return cls._create_memfd(name, size, seals, prefault, "sealed segment")

    @classmethod
    def create_slab(cls, name: str, size: int) -> Segment:
        """The slab: a memfd (``create_memfd``, sealed against resizing: a client holding
        its descriptor cannot shrink it under everyone else's mappings), 0600, pre-faulted,
        after checking that the memory it takes is there: a short host or cgroup is a
        clear refusal at start, not an out-of-memory kill while pre-faulting."""
        free, source = memory_free_bytes()
        if 0 <= free < size:
            raise ShmError(
                f"the broker can use {format_size(free)} of memory ({source}) but the slab "
                f"needs {format_size(size)}: use a smaller --shm-size, or give the broker "
                "more memory (a container's memory limit)"
            )
        seg = cls.create_memfd(name, size, prefault=True)
        try:
            os.fchmod(seg.share_fd(), 0o600)
        except OSError as exc:
            seg.close()
            raise ShmError(f"cannot create segment {name}: {exc}") from exc
        return seg

    @classmethod
    def create_memfd(cls, name: str, size: int, prefault: bool = False) -> Segment:
        """A segment clients write too, with no name anywhere (a memfd, mapped
        writable here; admitted clients get its descriptor): nobody can take its name
        first, nor open it by one.

        Sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW), though not against
        writes: a client holding the descriptor could otherwise ftruncate it, and every
        mapping's next read past the new end -- the broker's, every other client's (the
        put arena's check, compiled or not) -- dies of SIGBUS."""
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        return cls._create_memfd(name, size, seals, prefault, "segment")

    def share_fd(self) -> int:
        """The descriptor to hand to an admitted client (the broker keeps it open): the
        memfd itself. What a client may only read is a sealed memfd (``create_sealed``):
        no writable mapping can be made of it, whatever the descriptor's mode."""
        own = self._memfd
        if own is None:
            raise ShmError(f"segment {self.name} was not created by this process")
        return own

    @classmethod
    def attach_fd(
        cls, fd: int, name: str, size: int, prefault: bool = True,
        owners: Collection[int] | None = None, writable: bool = True,
    ) -> Segment:  # fmt: skip
        """Map a segment from a descriptor the broker handed over (the caller keeps and
        closes ``fd``); read-only unless ``writable``. Checks as ``attach``."""
        if not isinstance(size, int) or size <= 0:
            raise ShmError(f"segment {name} announced with an invalid size {size!r}")
        try:
            if owners is not None:
                check_owner(fd, name, owners)
            have = os.fstat(fd).st_size
            if have < size:
                raise ShmError(f"segment {name} has {have} bytes, the broker announced {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, prot=prot)
        except (OSError, ValueError, OverflowError) as exc:
            raise ShmError(f"cannot map shared-memory segment {name}: {exc}") from exc
        if prefault and writable:
            _populate_shared(mm, size)
        return cls(name, size, mm, owner=False)

    @classmethod
    def attach(
        cls, name: str, size: int, prefault: bool = True, owners: Collection[int] | None = None
    ) -> Segment:
        """Map an existing segment read-write. ``owners``: the uids it may belong to
        (checked before mapping); None skips the check. Every failure is a ShmError."""
        if not isinstance(size, int) or size <= 0:
            raise ShmError(f"segment {name} announced with an invalid size {size!r}")
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise ShmError(
                f"shared-memory segment {name} does not exist (broker restarted?)"
            ) from exc
        except (OSError, ValueError, posix_ipc.Error) as exc:
            raise ShmError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            if owners is not None:
                check_owner(shm.fd, name, owners)
            if shm.size < size:
                raise ShmError(f"segment {name} has {shm.size} bytes, the broker announced {size}")
            mm = mmap.mmap(shm.fd, size)
        except (OSError, ValueError, OverflowError) as exc:
            raise ShmError(f"cannot map shared-memory segment {name}: {exc}") from exc
        finally:
            shm.close_fd()
        if prefault:
            _populate_shared(mm, size)
        return cls(name, size, mm, owner=False)

    def prefault_shared(self) -> None:
        """Fault in a segment mapped with ``attach_fd(prefault=False)``, reading only
        (the attach invariant: others may be copying into it)."""
        _populate_shared(self.mm, self.size)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            log.warning("segment %s still has live views; leaving the mapping to the GC", self.name)
        if self._memfd is not None:
            os.close(self._memfd)
            self._memfd = None


def map_readonly(
    name: str, size: int, owners: Collection[int] | None, fd: int | None, what: str
) -> mmap.mmap:
    """``size`` bytes of a broker-written segment, mapped read-only: from ``fd`` (handed
    over the socket; the caller closes it) or, without one, opened by name. Checked to
    belong to one of ``owners`` before mapping. ShmError says what failed."""
    own = fd is None
    if fd is None:
        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except (OSError, ValueError, posix_ipc.Error) as exc:
            raise ShmError(f"cannot open {what} {name}: {exc}") from exc
        fd = shm.fd
    try:
        if owners is not None:  # before mapping: another user's segment could lie
            check_owner(fd, name, owners)
        have = os.fstat(fd).st_size
        if not isinstance(size, int) or size <= 0 or have < size:
            raise ShmError(f"{what} {name} has {have} bytes, the broker announced {size}")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError, OverflowError) as exc:
        raise ShmError(f"cannot map {what} {name}: {exc}") from exc
    finally:
        if own:
            os.close(fd)


def unlink_segment(name: str) -> None:
    """Unlink ``name`` (leading slash) if it exists; for names only this process can
    have created (they carry its random epoch)."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def remove_stale(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (no leading slash),
    that this uid owns, and whose creator is dead: its flock can be taken. A segment
    still locked belongs to a live broker that this one cannot see (another mount
    namespace sharing /dev/shm): it is left alone, with a warning. Anything else
    under the prefix (another uid's file, a FIFO, a link) is left alone too: never
    opened in a way that could block, never unlinked (see the invariants).

    Only called after the broker has established that no live broker serves the
    socket these segments belong to.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    me = os.geteuid()
    for fname in names:
        if not fname.startswith(prefix):
            continue
        path = os.path.join(shm_dir, fname)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
                log.warning(
                    "/dev/shm/%s has this socket path's name but is not a segment of this "
                    "user's (uid %d, mode %o); leaving it alone",
                    fname, st.st_uid, st.st_mode,
                )  # fmt: skip
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone already, or not ours to open (nor to unlink)
        try:
            again = os.fstat(fd)
            if (again.st_ino, again.st_dev) != (st.st_ino, st.st_dev):
                continue  # replaced between the look and the open: not what was checked
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    log.warning("cannot lock /dev/shm/%s (%s); leaving it alone", fname, exc)
                    continue
                log.warning(
                    "shared-memory segment /dev/shm/%s has this socket path's name but a "
                    "live owner (a broker in another container or mount namespace sharing "
                    "/dev/shm with the same socket path?); leaving it alone. Give each "
                    "broker its own socket path.",
                    fname,
                )
                continue
            try:
                posix_ipc.unlink_shared_memory("/" + fname)
                removed.append(fname)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                pass
        finally:
            os.close(fd)
    return removed
