"""``ClientLink``: one client's connection to its broker, kept across outages.

It owns what a connection is made of and what outlives one: the lock every data
operation holds, the current ``Session`` (connector/client/session.py), the broker epoch's
``Mappings`` (connector/client/mappings.py), the last handshake, the ``Redial`` back-off
and the ``Circuit`` (connector/client/broker_link.py), and the Served flusher's thread
(connector/client/served_flush.py). ``BrokerClient`` (broker_client.py) holds one and does the
cache's work over it; the failure model is broker_client.py's module docstring.

Invariants:
- ``session`` is None or a live connection of the broker whose epoch ``maps`` are
  for: a handshake naming another epoch drops the old mappings before the new
  segments are mapped, so no copy touches a stale segment.
- Mappings are dropped with a failed connect (a dead broker's shared memory stays
  charged while anyone maps it, and a restarting broker needs that memory).
- Nothing here waits for a broker while holding ``lock`` longer than one call's
  ``timeout_s``; the flusher takes ``lock`` with a timeout and never waits at all.
- The session's loss callback and the flusher hold the link weakly: a client nobody
  holds is freed at once, and its flusher thread ends.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import msgspec

from ...protocol import HelloReply
from ...shm.segment import ShmError
from . import index_path
from .broker_link import Circuit, Redial, close_fds, dial, probe
from .errors import BrokerRefused, BrokerUnavailable
from .mappings import Mappings
from .served_flush import GONE, ServedFlusher
from .session import Session

if TYPE_CHECKING:
    from .copy import SlabView


class ClientLink:
    def __init__(
        self,
        socket_path: str,
        trusted_uids: Collection[int],
        timeout_s: float,
        connect_timeout_s: float,
        max_backoff_s: float,
        prefault: bool,
        probe_interval_s: float,
    ) -> None:
        self.socket_path = socket_path
        self.trusted_uids = trusted_uids
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.prefault = prefault
        self.client_id = uuid.uuid4().hex
        self.lock = threading.RLock()
        self.session: Session | None = None  # the connection (None: not connected)
        self.maps: Mappings | None = None  # the current broker epoch's segments
        self.hello: HelloReply | None = None  # the last handshake (kept across outages)
        self.wrap: Callable[[Any], Any] | None = None  # BrokerClient.instrument_socket's
        self.reconnects = 0
        self.redial = Redial(socket_path, max_backoff_s)
        probe_timeout = max(timeout_s, connect_timeout_s)
        self.circuit = Circuit(
            socket_path,
            timeout_s,
            probe_interval_s,
            probe=lambda: probe(socket_path, trusted_uids, probe_timeout),
            on_close=self.redial.reset,
        )
        self._flusher = ServedFlusher(self._served_stepper())

    def live(self, raise_refusal: bool = False) -> Session | None:
        """The connection, made now if needed; None during an outage (a refusal raises
        only when asked: at construction; later it is an outage like any other)."""
        s = self.session
        if s is not None:
            return s
        if self.circuit.tripped or not self.redial.due():
            return None
        try:
            return self._connect()
        except (OSError, BrokerUnavailable, BrokerRefused, ShmError) as exc:
            if raise_refusal and isinstance(exc, BrokerRefused):
                raise
            if isinstance(exc, TimeoutError):  # connect or handshake hung
                self.circuit.trip()
            self.drop_maps()
            self.redial.failed(exc)
            return None

    def _connect(self) -> Session:
        sock, hello, fds = dial(
            self.socket_path,
            self.trusted_uids,
            self.client_id,
            self.connect_timeout_s,
            self.timeout_s,
        )
        if self.hello is not None:
            self.reconnects += 1
        maps = self.maps
        if maps is not None and maps.epoch != hello.epoch:
            self.drop_maps()  # the broker restarted: its old segments are gone
            maps = None
        if maps is None:
            maps = self.maps = Mappings(hello, self.trusted_uids, self.prefault, fds)
        else:
            close_fds(fds.values())  # the same epoch's segments, mapped already
        self.hello = hello
        arm = self._flusher.arm if index_path.SERVED_FLUSH_S is not None else None
        self.session = s = Session(sock, hello, maps.journal, self._on_lost(), self.wrap, arm)
        self.redial.connected()
        return s

    def _on_lost(self) -> Callable[[bool], None]:
        """What a session's wire calls when its connection fails (weakly bound)."""
        ref = weakref.ref(self)

        def lost(timed_out: bool) -> None:
            link = ref()
            if link is not None:
                link.drop_session()
                if timed_out:
                    link.circuit.trip()

        return lost

    def _served_stepper(self) -> Callable[[], float | None]:
        """The flusher thread's step (weakly bound, like _on_lost)."""
        ref = weakref.ref(self)

        def step() -> float | None:
            link = ref()
            return GONE if link is None else link._served_step()

        return step

    def _served_step(self) -> float | None:
        """The flusher's turn (served_flush.py): send the Served batch alone once it is
        SERVED_FLUSH_S old and no request carried it. Returns the seconds until the next
        turn, or None when nothing is pending. Never waits for the broker: the lock with
        a timeout (its holder is mid-call, and its request may carry the batch), then a
        non-blocking write (ServedBatch.send_nowait)."""
        flush_s = index_path.SERVED_FLUSH_S
        s = self.session
        if s is None or flush_s is None or self.circuit.tripped or not s.served.at:
            return None
        wait = s.served.at + flush_s - time.monotonic()
        if wait > 0:
            return wait
        if not self.lock.acquire(timeout=flush_s):
            return 0.0
        try:
            s = self.session
            sock = s.wire.sock if s is not None else None
            if s is None or sock is None or not s.served.at or self.circuit.tripped:
                return None
            try:
                return None if s.served.send_nowait(sock.fileno()) else flush_s
            except OSError:
                return None  # the connection failed: its next request finds out
        finally:
            self.lock.release()

    def drop_session(self) -> None:
        s, self.session = self.session, None
        if s is not None:
            s.close()

    def drop_maps(self) -> None:
        m, self.maps = self.maps, None
        if m is not None:
            m.close()

    def call(self, msg: msgspec.Struct) -> Any:
        """One request; raises BrokerUnavailable or BrokerRefused."""
        s = self.live()
        if s is None:
            raise BrokerUnavailable("not connected")
        return s.wire.call(msg)

    def slab(self) -> SlabView:
        """The slab mapped; a failure to map it is an outage (the connection, and
        everything it holds, goes; misses are served; reconnecting backs off)."""
        m = self.maps
        if m is not None and m.slab is not None:
            return m.slab
        if m is None:
            raise BrokerUnavailable("not connected")
        try:
            slab = m.map_slab()
        except ShmError as exc:
            self.drop_session()
            self.drop_maps()  # the next connection maps its own descriptors afresh
            self.redial.attach_failed(exc)
            raise BrokerUnavailable(str(exc)) from exc
        self.redial.attached()
        return slab

    def stop_threads(self) -> None:
        """The circuit's prober and the flusher end (close(), or the client freed)."""
        self.circuit.stop()
        self._flusher.stop()

    def release(self) -> None:
        """The connection and the mappings go (the caller holds ``lock`` or is the
        client's finalizer: nobody else can be using them)."""
        self.drop_session()
        self.drop_maps()
