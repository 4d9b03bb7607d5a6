"""One POSIX shared-memory segment: create (broker), attach (clients), unlink.

Invariants kept here:
- The broker creates the segment with O_CREX, so it never adopts a segment it
  did not create; a stale segment of a dead broker is removed explicitly first
  (``remove_stale``), never silently reused.
- The creator holds an exclusive ``flock`` on the segment for as long as it lives
  (the kernel drops it when the process dies), and ``remove_stale`` unlinks only
  segments whose lock it can take. The socket lock alone cannot prove a segment
  stale: two containers with their own /tmp but one shared /dev/shm derive the
  same names from the same socket path, and each would see the other's live
  segments as a dead broker's.
- Pages are pre-faulted at creation (first-touch faults make later copies ~10x
  slower), and the room in /dev/shm is checked *before* creating, so a short
  /dev/shm is a clear refusal at start instead of SIGBUS on a later copy.
- ``unlink`` is idempotent; the broker calls it on every exit path.
- A client never writes while attaching: its pre-fault only reads (or asks the
  kernel to map pages without touching them). Another process may be copying
  into its own reservation at that moment; a read-modify-write of any byte here
  could put a stale value back over that copy.
- A client maps a segment only after checking (fstat) that a trusted uid owns it.
- The broker creates every segment 0600 and hands it to admitted clients over the
  socket as a file descriptor (SCM_RIGHTS, broker/connection.py): who may map it is
  decided by the broker's admission, not by the file's mode. What only the broker
  writes (the membership filter, the residency index, the journal's settled words)
  is a sealed memfd (``create_sealed``): no path reaches it, and no mapping but the
  one made before sealing can write it (root's included; a reopen through
  /proc/<pid>/fd maps PROT_WRITE only to EPERM).
- No segment name another uid can take first (issue 40, item 3): /dev/shm is
  world-writable, so a name derivable from one already visible (the journal's was
  ``<slab>-j``) could be created by someone else before the broker, and ``O_EXCL``
  would then keep the broker from starting, at every restart. Only the slab has a
  name, with a random part, and ``create`` raises ``SegmentExists`` so that the
  caller retries under a fresh one (broker/lifecycle.py ``create_slab``); every
  other segment is a memfd (``create_memfd``, ``create_sealed``): no name at all.
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


class SegmentExists(ShmError):
    """``create``: the name is taken (retry under another: see the invariants)."""


def _grow_hint(size: int) -> str:
    gib = max(1, -(-size // (1 << 30)))
    return (
        "Grow /dev/shm or use a smaller --shm-size: with Docker run the container with "
        f"--shm-size={gib + 1}g; on Kubernetes mount an emptyDir with medium: Memory "
        f"(sizeLimit >= {gib + 1}Gi) at /dev/shm; on a host: "
        f"mount -o remount,size={gib + 1}G /dev/shm."
    )


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


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
    """A mapped POSIX shared-memory segment."""

    def __init__(
        self, name: str, size: int, mm: mmap.mmap, owner: bool, lock_fd: int | None = None
    ) -> None:
        self.name = name
        self.size = size
        self.mm = mm
        self.owner = owner
        self._lock_fd = lock_fd  # the creator's flock (see the invariants); closed last
        self._unlinked = False
        self._shared: dict[bool, int] = {}  # read_only -> descriptor to hand over (share_fd)
        self._memfd: int | None = None  # a memfd segment's descriptor (create_memfd/_sealed)
        self._sealed = False  # the memfd is sealed: no descriptor of it maps writable

    @classmethod
    def create_sealed(cls, name: str, size: int, prefault: bool = False) -> Segment:
        """A segment only the broker writes: a memfd (no path in /dev/shm), mapped
        writable here, then sealed (F_SEAL_FUTURE_WRITE, no shrinking or growing) so
        that every other mapping of it, by any process, is read-only. ``name`` is a
        label (logs, the handshake, /proc/<pid>/fd's "/memfd:<name>"). ``prefault``:
        fault the pages in before sealing (as ``create`` does)."""
        if size <= 0:
            raise ShmError(f"segment size must be positive, got {size} bytes")
        try:
            fd = os.memfd_create(name.lstrip("/"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ShmError(f"cannot create sealed segment {name}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            if prefault:
                _populate_new(mm, size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise ShmError(f"cannot create sealed segment {name}: {exc}") from exc
            raise
        seg = cls(name, size, mm, owner=True)
        seg._memfd = fd
        seg._sealed = True
        seg._unlinked = True  # nothing to unlink: it goes with its last descriptor and mapping
        return seg

    @classmethod
    def create_memfd(cls, name: str, size: int) -> Segment:
        """A segment clients write too, with no name anywhere (a memfd, mapped
        writable here; admitted clients get its descriptor): nobody can take its name
        first, nor open it by one. ``name`` is a label, as in ``create_sealed``.

        Sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW, then F_SEAL_SEAL), though
        not against writes: a client holding the descriptor could otherwise ftruncate
        it, and every mapping's next read past the new end -- the broker's, every
        other client's (the put arena's check, compiled or not) -- dies of SIGBUS."""
        if size <= 0:
            raise ShmError(f"segment size must be positive, got {size} bytes")
        try:
            fd = os.memfd_create(name.lstrip("/"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ShmError(f"cannot create segment {name}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            mm = mmap.mmap(fd, size)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise ShmError(f"cannot create segment {name}: {exc}") from exc
            raise
        seg = cls(name, size, mm, owner=True)
        seg._memfd = fd
        seg._unlinked = True  # nothing to unlink: it goes with its last descriptor and mapping
        return seg

    def share_fd(self, read_only: bool = False) -> int:
        """The descriptor to hand to an admitted client (the broker keeps it open):
        a sealed segment's memfd, else one opened once for the purpose, read-only
        when ``read_only`` (the client can then map it read-only only). Never the
        creator's own descriptor: it carries the flock, and a client's mapping keeps
        its open file alive, so a dead broker's segment would look live to the next
        broker's ``remove_stale`` for as long as a client maps it."""
        own = self._memfd if self._memfd is not None else self._lock_fd
        if self._memfd is not None and (self._sealed or not read_only):
            return self._memfd
        if own is None:
            raise ShmError(f"segment {self.name} was not created by this process")
        fd = self._shared.get(read_only)
        if fd is None:
            flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
            fd = self._shared[read_only] = os.open(f"/proc/self/fd/{own}", flags)
        return fd

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
    def create(cls, name: str, size: int, mode: int = 0o600, prefault: bool = True) -> Segment:
        if size <= 0:
            raise ShmError(f"segment size must be positive, got {size} bytes")
        free = shm_free_bytes()
        if size > free:
            raise ShmError(
                f"/dev/shm has {free / (1 << 20):.0f} MiB free but the slab needs "
                f"{size / (1 << 20):.0f} MiB. {_grow_hint(size)}"
            )
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        except posix_ipc.ExistentialError as exc:
            raise SegmentExists(
                f"shared-memory segment {name} already exists; another broker owns it, "
                "a dead broker left it, or another user took the name first"
            ) from exc
        except (OSError, posix_ipc.Error) as exc:
            raise ShmError(f"cannot create shared-memory segment {name}: {exc}") from exc
        try:
            # Taken first: from here on no broker's remove_stale takes this segment for stale.
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The umask may have narrowed the mode; make it exactly what was asked.
            os.fchmod(shm.fd, mode)
            mm = mmap.mmap(shm.fd, size)
        except BaseException as exc:  # a stop signal during start-up included
            shm.close_fd()
            unlink_segment(name)
            if isinstance(exc, OSError):
                raise ShmError(f"cannot map shared-memory segment {name}: {exc}") from exc
            raise
        seg = cls(name, size, mm, owner=True, lock_fd=shm.fd)
        if prefault:
            try:
                _populate_new(mm, size)
            except BaseException:
                seg.close()
                seg.unlink()
                raise
        return seg

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
            for fd in self._shared.values():
                os.close(fd)
            self._shared = {}
            os.close(self._memfd)
            self._memfd = None

    def unlink(self) -> None:
        if self._unlinked:
            return
        self._unlinked = True
        unlink_segment(self.name)
        for fd in self._shared.values():
            os.close(fd)
        self._shared = {}
        # The flock goes only with the name: a closed but still-named segment keeps
        # looking live until its owner removes it (the owner always unlinks on exit).
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


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
