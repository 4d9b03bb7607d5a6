"""One client connection of the broker: framing, ordering, back-pressure, admission.

Each connection is an ``asyncio.Protocol`` (no coroutine per message: the
control plane is latency-bound). Requests on one connection are answered in
order: while a slow request (a promotion from a lower tier) is in flight, later
frames of the same connection wait in ``queued``; other connections keep being
served.

Invariants kept here:
- a client that stops reading its replies: past the transport's high-water mark
  we stop reading from it, and past ``_WRITE_HARD_CAP`` buffered reply bytes it is
  disconnected (which releases everything it held);
- a client that pipelines requests behind a slow one: past ``MAX_QUEUED_FRAMES``
  queued frames we stop reading from it until the queue drains;
- nothing but a ``Hello`` of this protocol version is handled before the greeting;
- a request that reads keys first settles reservations other connections posted
  the commits of (``BrokerServer.settle_reservations``), so a get after another
  client's put returned finds the entry;
- such a request read *during* another connection's settle is deferred, never
  handled nested: the connection holds it (and reads nothing more) until the
  server's ``run_deferred`` resumes it, after the request being settled.

What a request does is ``BrokerServer.dispatch``'s business (``server.py``).
"""

from __future__ import annotations

import array
import asyncio
import collections
import logging
import os
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

import msgspec

from ..protocol import (
    PROTOCOL_VERSION,
    Delete,
    ErrorCode,
    ErrorReply,
    FrameReader,
    Get,
    Has,
    Hello,
    HelloReply,
    Lookup,
    OkReply,
    ProtocolError,
    Publish,
    Reserve,
    WaitReady,
    encode_frame,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator

    from ..config import BrokerConfig
    from ..shm.filter import FilterWriter
    from ..shm.journal import Journal
    from ..shm.residency import ResidencyWriter
    from ..shm.segment import Segment
    from .access import AccessPolicy
    from .coordinator import Coordinator
    from .store import Store

log = logging.getLogger("lmcache_ec_broker")

_WRITE_HIGH_WATER = 1 << 20
_WRITE_HARD_CAP = 16 << 20
# Frames a connection may have queued behind an in-flight async request before
# the broker stops reading from it (it resumes when the queue is empty).
MAX_QUEUED_FRAMES = 64
# Requests whose keys are settled first (see BrokerServer.settle_reservations): a
# delete made after another client's put returned must find that entry too.
_READS_KEYS = (Has, Get, Lookup, Delete, Publish, WaitReady)
_SETTLES = (*_READS_KEYS, Reserve)  # a Reserve settles its key too
# The most common reply (Release, Commit, Unlease, ...) is a constant: encoded once.
_OK_FRAME = encode_frame(msgspec.msgpack.Encoder(), OkReply())


class Host(Protocol):
    """What a connection uses of the server that accepted it (``BrokerServer``, which
    imports this module; this module does not import it back)."""

    config: BrokerConfig
    epoch: str
    conn_ids: Iterator[int]
    connections: dict[int, Connection]
    counters: dict[str, int]
    access: AccessPolicy
    store: Store
    tiers: Coordinator
    decoder: msgspec.msgpack.Decoder
    segment: Segment | None
    filter: FilterWriter | None
    journal: Journal | None
    residency: ResidencyWriter | None
    settling_for: int
    deferred: collections.deque[Connection]

    def encode_frame(self, msg: msgspec.Struct) -> bytes: ...
    def settle_reservations(self, conn: int, keys: Collection[str]) -> None: ...
    def dispatch(
        self, conn: int, msg: object, peer_uid: int = -1
    ) -> msgspec.Struct | Awaitable[msgspec.Struct] | None: ...
    def observe(self, op: str, started: float) -> None: ...
    def run_deferred(self) -> None: ...
    def handover(self) -> tuple[list[str], list[int]]: ...


class Connection(asyncio.Protocol):
    def __init__(self, server: Host) -> None:
        self.server = server
        self.conn_id = next(server.conn_ids)
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader(server.config.max_frame_bytes)
        self.greeted = False
        self.closed = False
        self.busy = False  # an async request is in flight; later frames wait
        self.queued: collections.deque[bytes] = collections.deque()
        self.write_paused = False  # the peer does not read its replies
        self.queue_paused = False  # too many frames queued behind a slow request
        self.peer_uid = -1  # from SO_PEERCRED at admission
        self.fd = -1  # the socket's descriptor (settle_reservations reads it directly)

    # ---------------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        srv = self.server
        sock = transport.get_extra_info("socket")
        pid, uid, refusal = srv.access.admit(sock, len(srv.connections))
        self.fd = sock.fileno()
        self.peer_uid = uid
        srv.tiers.open_connection(self.conn_id)
        srv.connections[self.conn_id] = self
        if refusal is None:  # charged to its process and uid, or refused (quotas.py)
            refusal = srv.store.admit_peer(self.conn_id, pid, uid)
        if refusal is not None:
            self.send(refusal)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.queued.clear()
        srv = self.server
        srv.connections.pop(self.conn_id, None)
        slot = srv.store.arena_slot(self.conn_id)
        srv.tiers.close_connection(self.conn_id)  # frees its arena with the rest
        if slot >= 0 and srv.journal is not None:
            srv.journal.reset(slot)  # nothing of this connection is pending any more

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or self.closed or t.is_closing():
            return
        if self.write_paused or self.queue_paused:
            t.pause_reading()
        else:
            t.resume_reading()

    @property
    def paused(self) -> bool:
        return self.write_paused or self.queue_paused

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        self._drain()

    def read_pending(self) -> None:
        """Read and handle what this client already sent, now, out of the loop's turn.

        Used when another connection asks for a key this one has reserved: its client
        posts the Commit (does not wait for it), so the commit may already sit in this
        socket. Frames are handled in their order, as data_received would; EOF and
        errors are left to the transport, which sees them again on its next read."""
        t = self.transport
        if self.busy or self.closed or self.paused or t is None or t.is_closing():
            return  # paused: its reading is held back on purpose (see _update_reading)
        for _ in range(4):  # bounded: the writer's commit is near the front
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:  # BlockingIOError: nothing pending
                return
            if not data:
                return
            self.data_received(data)
            if self.busy or self.closed or self.paused:
                return

    def drain_pending(self) -> bool:
        """Read and handle everything this client sent so far (the journal's stall
        excuse, shm/journal.py). True if none of it can be an honest client's Place
        left unhandled: all of it was read (the socket answered EAGAIN) and handled or
        held behind a request the client waits for -- or the connection is busy with
        such a request or does not read its replies (an honest client sends nothing
        after a request it waits for until the reply, and reads its replies: its Places
        before that request were handled when it was read). False if it could not be
        read to the end (closed, or more than 64 reads' worth)."""
        t = self.transport
        for _ in range(64):
            if self.closed or t is None or t.is_closing():
                return False
            if self.busy or self.paused:
                return True
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            self.data_received(data)
        return False

    def _drain(self) -> None:
        """Handle buffered frames; while busy, queue up to MAX_QUEUED_FRAMES of them
        and leave the rest in the read buffer with reading paused."""
        while not self.closed:
            if self.busy and len(self.queued) >= MAX_QUEUED_FRAMES:
                if not self.queue_paused:
                    self.queue_paused = True
                    self.server.counters["queue_pauses"] += 1
                    self._update_reading()
                return
            try:
                body = self.frames.next_frame()
            except ProtocolError as exc:
                self.send(ErrorReply(ErrorCode.BAD_REQUEST, str(exc)))
                self.close()
                return
            if body is None:
                return
            if self.busy:
                self.queued.append(body)
            else:
                self.handle_frame(body)

    # ---------------------------------------------------------------- helpers

    def send(self, reply: msgspec.Struct) -> None:
        t = self.transport
        if t is None or self.closed or t.is_closing():
            return
        t.write(_OK_FRAME if type(reply) is OkReply else self.server.encode_frame(reply))
        # The buffer passes the hard cap only after passing the high-water mark, and the
        # transport calls pause_writing synchronously inside write() when it does: the
        # size is only worth asking for while writing is paused.
        if self.write_paused and t.get_write_buffer_size() > _WRITE_HARD_CAP:
            log.warning("client %d does not read its replies; disconnecting it", self.conn_id)
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def handle_frame(self, body: bytes) -> None:
        self._handle(body)
        srv = self.server
        if srv.deferred and not srv.settling_for:
            srv.run_deferred()  # requests read during this one's settle, in turn

    def defer(self, body: bytes) -> None:
        """Hold ``body`` (a request that settles, read during another connection's
        settle) and everything after it until ``resume``: first in the queue, as
        behind a slow request (``busy``: read_pending reads no more meanwhile)."""
        self.busy = True
        self.queued.appendleft(body)
        self.server.deferred.append(self)

    def resume(self) -> None:
        """Handle what waited behind a slow or deferred request, in order."""
        self.busy = False
        while self.queued and not self.busy and not self.closed:
            self._handle(self.queued.popleft())
        if not self.busy and not self.closed:
            self._drain()  # frames left in the read buffer while the queue was full
            if self.queue_paused and not self.busy:
                self.queue_paused = False
                self._update_reading()

    def _handle(self, body: bytes) -> None:
        srv = self.server
        started = time.perf_counter()
        try:
            msg = srv.decoder.decode(body)
        except msgspec.MsgspecError as exc:
            self.send(ErrorReply(ErrorCode.BAD_REQUEST, f"malformed request: {exc}"))
            return
        if not self.greeted:
            if not isinstance(msg, Hello):
                self.send(ErrorReply(ErrorCode.NOT_HELLO, "the first request must be hello"))
                self.close()
                return
            self.hello(msg)
            return
        if isinstance(msg, _SETTLES):
            if srv.settling_for:  # read inside another connection's settle: not now
                self.defer(body)
                return
            srv.settle_reservations(
                self.conn_id, (msg.key,) if isinstance(msg, Reserve) else msg.keys
            )
        try:
            reply = srv.dispatch(self.conn_id, msg, self.peer_uid)
        except Exception as exc:  # a bug must not take the broker down for everyone
            log.exception("internal error handling %s", type(msg).__name__)
            reply = ErrorReply(ErrorCode.INTERNAL, f"internal broker error: {exc!r}")
        if reply is None:  # a request answered by no reply (Served)
            srv.observe(type(msg).__name__, started)
            return
        # Replies are Structs (a C type check); anything else is the awaitable of a slow
        # request (the Awaitable ABC check costs a microsecond per request).
        if not isinstance(reply, msgspec.Struct):
            self.busy = True
            asyncio.ensure_future(self._finish_async(reply, type(msg).__name__, started))
            return
        self.send(reply)
        srv.observe(type(msg).__name__, started)

    async def _finish_async(self, pending: Awaitable, op: str, started: float) -> None:
        try:
            reply = await pending
        except Exception as exc:
            log.exception("internal error handling %s", op)
            reply = ErrorReply(ErrorCode.INTERNAL, f"internal broker error: {exc!r}")
        self.send(reply)
        srv = self.server
        srv.observe(op, started)
        self.resume()
        if srv.deferred and not srv.settling_for:
            srv.run_deferred()

    def hello(self, msg: Hello) -> None:
        srv = self.server
        if msg.version != PROTOCOL_VERSION:
            self.send(
                ErrorReply(
                    ErrorCode.VERSION_MISMATCH,
                    f"client speaks protocol version {msg.version}, this broker speaks "
                    f"{PROTOCOL_VERSION}; install the same lmcache-ec-broker version on both sides",
                )
            )
            self.close()
            return
        self.greeted = True
        seg = srv.segment
        assert seg is not None
        labels, fds = srv.handover()
        self.greet(
            HelloReply(
                version=PROTOCOL_VERSION,
                segment_name=seg.name,
                segment_size=seg.size,
                block_size=srv.store.block_size,
                epoch=srv.epoch,
                broker_pid=os.getpid(),
                max_frame_bytes=srv.config.max_frame_bytes,
                filter_name=srv.filter.name if srv.filter else "",
                filter_size=srv.filter.size if srv.filter else 0,
                put_arena_bytes=srv.store.arenas.cap_blocks * srv.store.block_size
                if srv.journal
                else 0,
                journal_name=srv.journal.name if srv.journal else "",
                journal_size=srv.journal.size if srv.journal else 0,
                max_key_length=srv.store.max_key_length,
                max_entry_bytes=srv.store.max_entry_bytes,
                residency_name=srv.residency.name if srv.residency else "",
                residency_size=srv.residency.size if srv.residency else 0,
                segment_fds=labels,
            ),
            fds,
        )

    def greet(self, reply: HelloReply, fds: list[int]) -> None:
        """Send the handshake's reply with the segments' descriptors (SCM_RIGHTS): the
        only way a client gets them, so admission gates the data (docs/design.md
        "Shared memory"). Nothing was written to this connection before, so the
        frame goes first on the wire; if it cannot go now, it goes without them."""
        t = self.transport
        frame = self.server.encode_frame(reply)
        if fds and t is not None and not t.is_closing() and not t.get_write_buffer_size():
            sock = socket.socket(fileno=os.dup(self.fd))
            try:
                sent = sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            except OSError:
                sent = 0
            finally:
                sock.close()
            if sent:
                if sent < len(frame):
                    t.write(frame[sent:])
                return
        self.send(msgspec.structs.replace(reply, segment_fds=[]))
