"""The client's link to its broker: connecting and the handshake (after the peer
trust check), mapping the segments the handshake names (slab, membership filter,
placement journal, residency index), the reconnect back-off, and the circuit a
hung broker trips (a background prober closes it). A BrokerClient mixin; its
state is set up in BrokerClient.__init__ (the module docstring of client.py
gives the failure model)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import msgspec

from ..protocol import FRAME_HEADER, PROTOCOL_VERSION, ErrorReply, Hello, HelloReply, Reply
from ..shm.filter import FilterReader
from ..shm.journal import Journal
from ..shm.segment import Segment, ShmError
from . import index_path
from .errors import BrokerRefused, BrokerUnavailable
from .frames import _recv_exact
from .trust import check_peer

if TYPE_CHECKING:
    from .copy import SlabView

log = logging.getLogger("lmcache_ec_broker.connector.client")  # one name for the whole client


class BrokerLink:
    """Connection, trust, mappings and circuit of a BrokerClient."""

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def tripped(self) -> bool:
        """True while a hung broker is being probed: calls answer misses at once."""
        return self._tripped

    def _trip(self) -> None:
        """A wait timed out: stop using the broker until the prober hears from it."""
        self._drop_socket()
        if self._tripped:
            return
        self._tripped = True
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
            if self._tripped and self._probe_once():
                self._next_attempt = 0.0
                self._backoff = 0.0
                self._tripped = False
                log.info("lmcache-ec-broker at %s answers again", self.socket_path)

    def _probe_once(self) -> bool:
        """A throwaway connection and handshake, never under the client's lock."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(self.timeout_s, self.connect_timeout_s))
            sock.connect(self.socket_path)
            self._check_peer(sock)
            body = msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, uuid.uuid4().hex, os.getpid()))
            sock.sendall(FRAME_HEADER.pack(len(body)) + body)
            header = _recv_exact(sock, FRAME_HEADER.size)
            (length,) = FRAME_HEADER.unpack(header)
            if length > 1 << 20:
                return False
            reply = msgspec.msgpack.decode(_recv_exact(sock, length), type=Reply)
            return isinstance(reply, HelloReply)
        except (OSError, BrokerUnavailable, msgspec.MsgspecError):
            return False
        finally:
            sock.close()

    @property
    def epoch(self) -> str | None:
        return self._hello.epoch if self._hello else None

    def _ensure_connected(self, raise_refusal: bool = False) -> bool:
        """Connect if needed. A refusal (permission, too many connections) raises only
        when asked (at construction); later it is an outage like any other."""
        if self._sock is not None:
            return True
        if self._tripped:
            return False
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        try:
            self._connect()
        except (OSError, BrokerUnavailable, BrokerRefused, ShmError) as exc:
            if raise_refusal and isinstance(exc, BrokerRefused):
                raise
            if isinstance(exc, TimeoutError):  # connect or handshake hung
                self._trip()
            # Let go of the old mappings now: unlinked shared memory stays charged to
            # /dev/shm while anyone maps it, and a restarting broker needs that room.
            self._unmap()
            if self._filter is not None:
                self._filter.close()
                self._filter = None
            self._close_journal()
            self._close_index()
            self._back_off()
            if not self._outage_logged:
                log.warning(
                    "lmcache-ec-broker at %s is unavailable (%s); serving misses and "
                    "retrying in the background",
                    self.socket_path,
                    exc,
                )
                self._outage_logged = True
            return False
        if self._outage_logged:
            log.info("reconnected to lmcache-ec-broker at %s", self.socket_path)
        self._outage_logged = False
        if self._attach_error is None:  # else the backoff grows until a mapping works
            self._backoff = 0.0
        return True

    def _back_off(self) -> None:
        self._backoff = min(max(self._backoff * 2, 0.05), self.max_backoff_s)
        self._next_attempt = time.monotonic() + self._backoff

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.socket_path)
            self._check_peer(sock)
            sock.settimeout(self.timeout_s)
            try:
                sock.sendall(self._frame(Hello(PROTOCOL_VERSION, self.client_id, os.getpid())))
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refusing broker writes why and closes at once: its reason is queued
            self._sock = sock
            reply = self._read_replies(1)[0]
        except BaseException:
            self._drop_socket()
            sock.close()
            raise
        if isinstance(reply, ErrorReply):
            self._drop_socket()
            raise BrokerRefused(reply.code, reply.message)
        if not isinstance(reply, HelloReply):
            self._drop_socket()
            raise BrokerUnavailable(f"unexpected handshake reply {type(reply).__name__}")
        if self._hello is not None:
            self.reconnects += 1
            if self._hello.epoch != reply.epoch:
                self._unmap()  # the broker restarted: its old segment is gone
        self._hello = reply
        self._map_filter(reply)
        self._map_journal(reply)
        self._close_index()
        self._index = index_path.map_index(reply, self.trusted_uids)

    def _check_peer(self, sock: socket.socket) -> None:
        check_peer(sock, self.socket_path, self.trusted_uids)

    def _map_filter(self, hello: HelloReply) -> None:
        if self._filter is not None:
            self._filter.close()
            self._filter = None
        if hello.filter_name:
            try:
                self._filter = FilterReader(
                    hello.filter_name, hello.filter_size, owners=self.trusted_uids
                )
            except (ShmError, ValueError, OverflowError) as exc:
                log.warning("not using the broker's membership filter: %s", exc)

    def _close_index(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def _map_journal(self, hello: HelloReply) -> None:
        self._close_journal()
        if hello.put_arena_bytes and hello.journal_name:
            try:
                self._journal = Journal.attach(
                    hello.journal_name, hello.journal_size, self.trusted_uids
                )
            except (ShmError, ValueError, OverflowError) as exc:
                # Without it, arena puts are off and the filter is not trusted (_maybe_mask).
                log.warning("not using the broker's put arena: %s", exc)

    def _drop_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._rpos = self._rend = 0
        self._owed = 0
        self._posted_keys.clear()
        self._served_keys, self._served_nbytes, self._served_has = [], [], 0
        self._served_at = 0.0  # the counts die with the connection, like its pins
        self._own.clear()
        self._placing.clear()
        self._arena.clear()  # the broker frees the arena with the connection
        self._arena_slot = -1
        self._grant_owed = False

    def _unmap(self) -> None:
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _slab_view(self) -> SlabView:
        if self._slab is None:
            from .copy import SlabView

            hello = self._hello
            assert hello is not None
            try:
                self._segment = Segment.attach(
                    hello.segment_name, hello.segment_size, self.prefault, self.trusted_uids
                )
            except ShmError as exc:
                # An outage like any other: the connection (and everything it holds)
                # goes, misses are served, and reconnecting backs off.
                self._drop_socket()
                self._back_off()
                if self._attach_error is None:
                    log.warning(
                        "cannot map the shared memory of lmcache-ec-broker at %s (%s); "
                        "serving misses and retrying in the background",
                        self.socket_path,
                        exc,
                    )
                self._attach_error = str(exc)
                raise BrokerUnavailable(str(exc)) from exc
            self._slab = SlabView(self._segment.mm, hello.segment_size)
            if self._attach_error is not None:
                log.info("mapped the shared memory of lmcache-ec-broker at %s", self.socket_path)
                self._attach_error = None
                self._backoff = 0.0
        return self._slab
