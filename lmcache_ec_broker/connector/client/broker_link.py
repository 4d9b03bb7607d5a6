"""The client's link to its broker, in three parts that BrokerClient composes:

- ``dial``: a connection and its handshake, after the peer trust check (trust.py);
  returns the socket and the broker's HelloReply, or raises;
- ``Redial``: when to try again after a failure (a growing back-off), and the
  outage's one warning;
- ``Circuit``: what a hung broker trips (every call answers a miss at once) and the
  background prober that closes it again.

None of them holds a connection: BrokerClient keeps the Session that ``dial``'s
socket becomes (connector/client/session.py). The module docstring of broker_client.py gives the
failure model.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection

import msgspec

from ...protocol import FRAME_HEADER, PROTOCOL_VERSION, ErrorReply, Hello, HelloReply, Reply
from .errors import BrokerRefused, BrokerUnavailable
from .frames import _MAX_REPLY_BYTES
from .trust import check_peer

log = logging.getLogger("lmcache_ec_broker.connector.client")  # one name for the whole client


def _hello_frame(client_id: str) -> bytes:
    body = msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, client_id, os.getpid()))
    return FRAME_HEADER.pack(len(body)) + body


def _read_hello(sock: socket.socket, limit: int, fds: list[int]) -> object:
    """The handshake's reply, and into ``fds`` the descriptors that came with it,
    close-on-exec (the caller closes them). Nothing else is in flight: the broker sends nothing more
    before this client's next request."""
    data = b""
    need = FRAME_HEADER.size
    while len(data) < need:
        # Close-on-exec from the moment they arrive (MSG_CMSG_CLOEXEC): a program this
        # process executes, under another uid or not, inherits none of the segments.
        chunk, got, _flags, _addr = socket.recv_fds(
            sock, max(need - len(data), 1 << 12), 8, socket.MSG_CMSG_CLOEXEC
        )
        fds += got
        if not chunk:
            raise BrokerUnavailable("the broker closed the connection")
        data += chunk
        if need == FRAME_HEADER.size and len(data) >= need:
            (length,) = FRAME_HEADER.unpack_from(data)
            if length > limit:
                raise BrokerUnavailable(f"implausible handshake reply of {length} bytes")
            need += length
    try:
        return msgspec.msgpack.decode(data[FRAME_HEADER.size : need], type=Reply)
    except msgspec.MsgspecError as exc:
        raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc


def close_fds(fds: Collection[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def dial(
    socket_path: str,
    trusted: Collection[int],
    client_id: str,
    connect_timeout_s: float,
    timeout_s: float,
) -> tuple[socket.socket, HelloReply, dict[str, int]]:
    """Connect, check who listens, greet. Returns the socket, the broker's reply and
    the segments' descriptors it sent, by label (the caller closes them). Raises
    BrokerRefused (the broker said no, with its reason), BrokerImpostor (an
    untrusted uid listens), BrokerUnavailable or OSError (TimeoutError: it hangs)."""
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(connect_timeout_s)
    try:
        sock.connect(socket_path)
        check_peer(sock, socket_path, trusted)
        sock.settimeout(timeout_s)
        try:
            sock.sendall(_hello_frame(client_id))
        except (BrokenPipeError, ConnectionResetError):
            pass  # a refusing broker writes why and closes at once: its reason is queued
        reply = _read_hello(sock, _MAX_REPLY_BYTES, fds)
    except BaseException:
        close_fds(fds)
        sock.close()
        raise
    if not isinstance(reply, HelloReply) or len(fds) != len(reply.segment_fds):
        close_fds(fds)
        fds = []
    if isinstance(reply, ErrorReply):
        sock.close()
        raise BrokerRefused(reply.code, reply.message)
    if not isinstance(reply, HelloReply):
        sock.close()
        raise BrokerUnavailable(f"unexpected handshake reply {type(reply).__name__}")
    return sock, reply, dict(zip(reply.segment_fds, fds, strict=True)) if fds else {}


def probe(socket_path: str, trusted: Collection[int], timeout_s: float) -> bool:
    """A throwaway connection and handshake: does the broker answer?"""
    try:
        sock, _hello, fds = dial(socket_path, trusted, uuid.uuid4().hex, timeout_s, timeout_s)
    except (OSError, BrokerUnavailable, BrokerRefused):
        return False
    close_fds(fds.values())
    sock.close()
    return True


class Redial:
    """The reconnect back-off: after a failure the next attempt waits, growing from
    50 ms to ``max_backoff_s``; a warning is logged once per outage."""

    __slots__ = ("socket_path", "max_backoff_s", "backoff", "next_attempt", "_logged",
                 "_attach_error")  # fmt: skip

    def __init__(self, socket_path: str, max_backoff_s: float) -> None:
        self.socket_path = socket_path
        self.max_backoff_s = max_backoff_s
        self.backoff = 0.0
        self.next_attempt = 0.0
        self._logged = False
        self._attach_error: str | None = None  # set while the slab cannot be mapped

    def due(self) -> bool:
        return time.monotonic() >= self.next_attempt

    def back_off(self) -> None:
        self.backoff = min(max(self.backoff * 2, 0.05), self.max_backoff_s)
        self.next_attempt = time.monotonic() + self.backoff

    def reset(self) -> None:
        self.next_attempt = 0.0
        self.backoff = 0.0

    def failed(self, exc: BaseException) -> None:
        self.back_off()
        if not self._logged:
            log.warning(
                "lmcache-ec-broker at %s is unavailable (%s); serving misses and "
                "retrying in the background",
                self.socket_path,
                exc,
            )
            self._logged = True

    def connected(self) -> None:
        if self._logged:
            log.info("reconnected to lmcache-ec-broker at %s", self.socket_path)
        self._logged = False
        if self._attach_error is None:  # else the backoff grows until a mapping works
            self.backoff = 0.0

    def attach_failed(self, exc: BaseException) -> None:
        """The slab could not be mapped: an outage like any other."""
        self.back_off()
        if self._attach_error is None:
            log.warning(
                "cannot map the shared memory of lmcache-ec-broker at %s (%s); "
                "serving misses and retrying in the background",
                self.socket_path,
                exc,
            )
        self._attach_error = str(exc)

    def attached(self) -> None:
        if self._attach_error is not None:
            log.info("mapped the shared memory of lmcache-ec-broker at %s", self.socket_path)
            self._attach_error = None
            self.backoff = 0.0


class Circuit:
    """Set by a timeout, closed by the prober thread when the broker answers again.
    Invariant (kept by BrokerClient): while tripped, no call touches a socket."""

    __slots__ = ("socket_path", "timeout_s", "probe_interval_s", "tripped", "timeouts",
                 "_probe", "_on_close", "_prober", "_prober_pid", "_closing")  # fmt: skip

    def __init__(
        self,
        socket_path: str,
        timeout_s: float,
        probe_interval_s: float,
        probe: Callable[[], bool],
        on_close: Callable[[], None],
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.tripped = False
        self.timeouts = 0  # outages that cost a timeout (one per outage)
        self._probe = probe
        self._on_close = on_close
        self._prober: threading.Thread | None = None
        self._prober_pid = -1
        self._closing = threading.Event()

    def trip(self) -> None:
        """A wait timed out: stop using the broker until the prober hears from it."""
        if self.tripped:
            return
        self.tripped = True
        self.timeouts += 1
        log.warning(
            "lmcache-ec-broker at %s did not answer within %.3f s; serving misses without "
            "waiting until it answers a probe again (every %.2f s)",
            self.socket_path,
            self.timeout_s,
            self.probe_interval_s,
        )
        self._closing.clear()  # a client used again after close()
        alive = self._prober is not None and self._prober.is_alive()
        if not alive or self._prober_pid != os.getpid():  # one per process, it never exits
            self._prober_pid = os.getpid()
            self._prober = threading.Thread(
                target=self._probe_loop, name="lmcache-ec-probe", daemon=True
            )
            self._prober.start()

    def _probe_loop(self) -> None:
        while not self._closing.wait(self.probe_interval_s):
            if self.tripped and self._probe():
                self._on_close()
                self.tripped = False
                log.info("lmcache-ec-broker at %s answers again", self.socket_path)

    def stop(self) -> None:
        """The client closes: the prober stops at its next wake-up."""
        self._closing.set()
