"""The broker process's life: claim the socket path, bind, run, clean up.

Starting is race-free: a broker first takes an exclusive lock on
``<socket>.lock`` and holds it for its whole life, and only the lock holder may
probe, unlink or bind the socket path and its stale segments. Two ``start``s on
one path therefore never remove each other's socket or slab: the second one
refuses with a message naming the first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import socket
import stat

log = logging.getLogger("lmcache_ec_broker")


class BrokerError(RuntimeError):
    """The broker cannot start; the message says why and what to do."""


def segment_prefix(socket_path: str) -> str:
    """Segment names derive from the socket path, so a restart can find its stale segments."""
    digest = hashlib.sha1(os.path.realpath(socket_path).encode()).hexdigest()[:12]
    return f"lmcache-ec-{digest}-"


def probe_socket(path: str, timeout: float = 1.0) -> bool:
    """True if something accepts connections on ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


class SocketLock:
    """An exclusive ``flock`` on ``<socket>.lock``, held for the broker's life.

    Invariant: the holder's open file is the one the path names. The holder
    unlinks the path *before* it lets go of the lock, and an acquirer re-checks
    the path after locking, so a lock taken on a just-unlinked file is retried
    rather than trusted.
    """

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path + ".lock"
        self.fd = -1

    def acquire(self) -> None:
        for _ in range(100):
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
                )
            except OSError as exc:
                raise BrokerError(
                    f"cannot create the lock file {self.path}: {exc.strerror}"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    sock = self.path.removesuffix(".lock")
                    raise BrokerError(
                        f"a broker is already running on {sock} (or starting: it holds "
                        f"{self.path}); stop it first (lmcache-ec-broker stop --socket {sock}) "
                        "or choose another --socket"
                    ) from None
                raise BrokerError(f"cannot lock {self.path}: {exc.strerror}") from exc
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)  # the previous holder unlinked it as we locked: take the new one
        raise BrokerError(f"cannot take the lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def claim_socket_path(path: str) -> SocketLock:
    """Lock the path, then refuse a live broker on it or remove a dead one's socket."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BrokerError(f"the socket's directory {parent} does not exist")
    lock = SocketLock(path)
    lock.acquire()
    try:
        if os.path.lexists(path):
            if probe_socket(path):
                raise BrokerError(
                    f"a broker is already running on {path}; stop it first "
                    f"(lmcache-ec-broker stop --socket {path}) or choose another --socket"
                )
            if not is_socket(path):
                raise BrokerError(f"{path} exists and is not a socket; refusing to replace it")
            log.warning("removing stale socket %s of a dead broker", path)
            os.unlink(path)
    except BaseException:
        lock.release()
        raise
    return lock


def bind_socket(path: str, mode: int, group_gid: int | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # never exists with looser permissions, not even briefly
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise BrokerError(f"cannot bind socket {path}: {exc}") from exc
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def resolve_group(name: str | None) -> int | None:
    if name is None:
        return None
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise BrokerError(f"socket_group {name!r} does not exist") from exc
