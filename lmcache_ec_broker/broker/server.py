"""The broker process: one asyncio loop serving many clients on a Unix socket.

Each connection is an ``asyncio.Protocol`` (no coroutine per message: the
control plane is latency-bound). Requests on one connection are answered in
order. The store is synchronous and never blocks; slow work (disk reads for
promotion) runs off the loop and the connection's later frames wait for it,
while other connections keep being served.

A client that stops reading its replies cannot stall anyone: when its transport
buffer passes the high-water mark we stop reading from it, and past a hard cap
it is disconnected (which releases everything it held).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import os
import signal
import socket
import struct
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec

from ..config import BrokerConfig, format_size
from ..protocol import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    Abort,
    Clear,
    Commit,
    Delete,
    DeleteReply,
    EntryInfo,
    ErrorCode,
    ErrorReply,
    Get,
    GetReply,
    Has,
    HasReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    LookupState,
    OkReply,
    Ping,
    PongReply,
    Release,
    Request,
    Reserve,
    Shutdown,
    Stats,
    StatsReply,
    Unlease,
)
from ..shm.filter import FilterWriter, slots_for
from ..shm.segment import Segment, remove_stale
from .disk import EMPTY_STATS, DiskError, DiskTier
from .store import Store

log = logging.getLogger("lmcache_ec_broker")

_PEERCRED = struct.Struct("3i")
_WRITE_HIGH_WATER = 1 << 20
_WRITE_HARD_CAP = 16 << 20
MAX_LEASE_MS = 600_000


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


class Connection(asyncio.Protocol):
    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.conn_id = next(server.conn_ids)
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.greeted = False
        self.closed = False
        self.busy = False  # an async request is in flight; later frames wait
        self.queued: collections.deque[bytes] = collections.deque()
        self.peer_uid = -1  # from SO_PEERCRED at admission

    # ---------------------------------------------------------------- asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        srv = self.server
        refusal = srv.admit(transport, self)
        srv.store.open_connection(self.conn_id)
        srv.connections[self.conn_id] = self
        if refusal is not None:
            self.send(refusal)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.pop(self.conn_id, None)
        self.server.store.close_connection(self.conn_id)

    def pause_writing(self) -> None:
        # The peer is not reading its replies: stop reading its requests.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        max_frame = self.server.config.max_frame_bytes
        while not self.closed:
            if len(self.buf) < 4:
                return
            (length,) = FRAME_HEADER.unpack_from(self.buf)
            if length > max_frame:
                self.send(
                    ErrorReply(
                        ErrorCode.BAD_REQUEST,
                        f"frame of {length} bytes exceeds the maximum of {max_frame} bytes",
                    )
                )
                self.close()
                return
            if len(self.buf) < 4 + length:
                return
            body = bytes(self.buf[4 : 4 + length])
            del self.buf[: 4 + length]
            if self.busy:
                self.queued.append(body)
            else:
                self.handle_frame(body)

    # ---------------------------------------------------------------- helpers

    def send(self, reply: msgspec.Struct) -> None:
        t = self.transport
        if t is None or self.closed or t.is_closing():
            return
        t.write(self.server.encode_frame(reply))
        if t.get_write_buffer_size() > _WRITE_HARD_CAP:
            log.warning("client %d does not read its replies; disconnecting it", self.conn_id)
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def handle_frame(self, body: bytes) -> None:
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
        try:
            reply = srv.dispatch(self.conn_id, msg, self.peer_uid)
        except Exception as exc:  # a bug must not take the broker down for everyone
            log.exception("internal error handling %s", type(msg).__name__)
            reply = ErrorReply(ErrorCode.INTERNAL, f"internal broker error: {exc!r}")
        if isinstance(reply, Awaitable):
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
        self.server.observe(op, started)
        self.busy = False
        while self.queued and not self.busy and not self.closed:
            self.handle_frame(self.queued.popleft())

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
        self.send(
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
            )
        )


class BrokerServer:
    def __init__(self, config: BrokerConfig) -> None:
        config.validate()
        self.config = config
        self.epoch = uuid.uuid4().hex
        self.started_at = time.time()
        self.store = Store(
            capacity_bytes=config.shm_size,
            block_size=config.block_size,
            max_entry_bytes=config.max_entry_size or None,
            max_key_length=config.max_key_length,
        )
        self.segment: Segment | None = None
        self.filter: FilterWriter | None = None
        self.conn_ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        self.decoder = msgspec.msgpack.Decoder(Request)
        self._encoder = msgspec.msgpack.Encoder()
        self._server: asyncio.AbstractServer | None = None
        self._sock: socket.socket | None = None
        self._stopping: asyncio.Event | None = None
        self._uid = os.getuid()
        self._group_gid: int | None = None
        # Called with (op name, seconds) after every request; metrics plug in here.
        self.observers: list[Callable[[str, float], None]] = []
        # Called with the server after the loop stops, before the segment goes (disk flush).
        self.shutdown_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self.disk: DiskTier | None = None
        if config.local_disk:
            self.disk = DiskTier(
                config.local_disk, config.max_local_disk_size, self.store, config.socket_mode
            )
            self.shutdown_hooks.append(self.disk.shutdown)
        # Each adds keys to stats() (metrics latency summaries).
        self.stats_providers: list[Callable[[], dict[str, int | float]]] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # set while serving

    # ---------------------------------------------------------------- wiring

    def encode_frame(self, msg: msgspec.Struct) -> bytes:
        body = self._encoder.encode(msg)
        return FRAME_HEADER.pack(len(body)) + body

    def observe(self, op: str, started: float) -> None:
        if self.observers:
            elapsed = time.perf_counter() - started
            for obs in self.observers:
                obs(op, elapsed)

    def admit(self, transport: asyncio.Transport, conn: Connection) -> ErrorReply | None:
        cfg = self.config
        if len(self.connections) >= cfg.max_connections:
            return ErrorReply(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the broker already serves {cfg.max_connections} connections "
                "(max_connections); close idle clients or raise the limit",
            )
        sock = transport.get_extra_info("socket")
        try:
            # Fail closed: a peer whose credentials cannot be read is not admitted.
            if sock is None:
                raise OSError("the event loop does not expose the connection's socket")
            _pid, uid, gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
        except OSError as exc:
            return ErrorReply(
                ErrorCode.PERMISSION_DENIED, f"cannot read the peer's credentials: {exc}"
            )
        conn.peer_uid = uid
        # Root is admitted: it bypasses file permissions and can read any process's
        # memory anyway, so refusing it protects nothing.
        if uid in (self._uid, 0) or uid in cfg.allowed_uids:
            return None
        if self._group_gid is not None and self._group_gid in _peer_groups(sock, gid):
            return None
        return ErrorReply(
            ErrorCode.PERMISSION_DENIED,
            f"uid {uid} may not use this broker (owner uid {self._uid}); "
            "add it to allowed_uids or use socket_group",
        )

    def dispatch(
        self, conn: int, msg: object, peer_uid: int = -1
    ) -> msgspec.Struct | Awaitable[msgspec.Struct]:
        store = self.store
        match msg:
            case Lookup(keys=keys, lease_ms=lease_ms):
                lease_ms = min(max(lease_ms, 0), MAX_LEASE_MS)
                return LookupReply(self.lookup(conn, keys, lease_ms))
            case Unlease(keys=keys):
                store.unlease(conn, keys)
                return OkReply()
            case Shutdown():
                if peer_uid not in (self._uid, 0):
                    return ErrorReply(
                        ErrorCode.PERMISSION_DENIED,
                        f"only the broker's owner (uid {self._uid}) or root may stop it; "
                        f"you are uid {peer_uid}",
                    )
                log.info("shutdown requested by a client (uid %d)", peer_uid)
                if self.loop is not None:
                    self.loop.call_soon(self.request_stop)
                return OkReply()
            case Has(keys=keys, lease_ms=lease_ms):
                lease_ms = min(max(lease_ms, 0), MAX_LEASE_MS)
                hits = store.has(conn, keys, lease_ms)
                if self.disk is not None:
                    hits = self.disk.has(keys, hits, lease_ms)
                return HasReply(hits)
            case Reserve(key=key, nbytes=nbytes, dtype=dtype, shape=shape):
                return store.reserve(conn, key, nbytes, dtype, shape)
            case Commit(token=token):
                return store.commit(conn, token) or OkReply()
            case Abort(token=token):
                return store.abort(conn, token) or OkReply()
            case Get(keys=keys):
                if self.disk is not None:
                    return self.disk.get(conn, keys)  # awaitable when promoting from disk
                return GetReply(store.get(conn, keys))
            case Release(pins=pins):
                return store.release(conn, pins) or OkReply()
            case Delete(keys=keys):
                deleted = store.delete(keys)
                if self.disk is not None:
                    deleted = self.disk.delete(keys, deleted)
                return DeleteReply(deleted)
            case Clear():
                store.clear()
                if self.disk is not None:
                    self.disk.clear()
                return OkReply()
            case Stats():
                return StatsReply(self.stats())
            case Ping():
                return PongReply(self.epoch)
            case Hello():
                return ErrorReply(ErrorCode.BAD_REQUEST, "hello was already received")
        return ErrorReply(ErrorCode.BAD_REQUEST, f"unsupported request {type(msg).__name__}")

    def lookup(self, conn: int, keys: list[str], lease_ms: int) -> list[EntryInfo]:
        store = self.store
        hits = store.has(conn, keys, lease_ms)
        out: list[EntryInfo] = []
        for key, hit in zip(keys, hits, strict=True):
            if hit:
                e = store.entries[key]
                out.append(EntryInfo(LookupState.READY, e.dtype, list(e.shape)))
            else:
                out.append(EntryInfo(LookupState.MISS))
        if self.disk is not None:
            disk_hits = self.disk.has(keys, hits, lease_ms)
            for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
                if disk_hits[i] and not hit:
                    d = self.disk.index.get(key)
                    if d is not None:
                        out[i] = EntryInfo(LookupState.PENDING, d.dtype, list(d.shape))
        return out

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self.store.stats())
        out.update(
            clients=len(self.connections),
            epoch=self.epoch,
            pid=os.getpid(),
            uptime_s=round(time.time() - self.started_at, 3),
            segment=self.segment.name if self.segment else "",
            socket=self.config.socket_path,
        )
        out.update(self.disk.stats() if self.disk is not None else EMPTY_STATS)
        if self.filter is not None:
            out.update(filter_slots=self.filter.nslots, filter_saturated=self.filter.saturated)
        for provide in self.stats_providers:
            out.update(provide())
        return out

    # ---------------------------------------------------------------- lifecycle

    def prepare(self) -> None:
        """Everything that can fail at start, before serving: refuse clearly or succeed."""
        cfg = self.config
        path = cfg.socket_path
        if os.path.lexists(path):
            if probe_socket(path):
                raise BrokerError(
                    f"a broker is already running on {path}; stop it first "
                    f"(lmcache-ec-broker stop --socket {path}) or choose another --socket"
                )
            if not _is_socket(path):
                raise BrokerError(f"{path} exists and is not a socket; refusing to replace it")
            log.warning("removing stale socket %s of a dead broker", path)
            os.unlink(path)
        for name in remove_stale(segment_prefix(path)):
            log.warning("removed stale shared-memory segment /dev/shm/%s of a dead broker", name)
        if cfg.socket_group is not None:
            import grp

            try:
                self._group_gid = grp.getgrnam(cfg.socket_group).gr_gid
            except KeyError as exc:
                raise BrokerError(f"socket_group {cfg.socket_group!r} does not exist") from exc
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BrokerError(f"the socket's directory {parent} does not exist")
        name = "/" + segment_prefix(path) + self.epoch[:12]
        t0 = time.perf_counter()
        self.segment = Segment.create(name, self.store.capacity_bytes, mode=cfg.socket_mode)
        try:
            if self._group_gid is not None:
                os.chown("/dev/shm" + name, -1, self._group_gid)
            log.info(
                "created shared-memory slab %s (%s, %s blocks, prefaulted in %.2fs)",
                name,
                format_size(self.segment.size),
                format_size(self.store.block_size),
                time.perf_counter() - t0,
            )
            self._publish_filter(name)
            if cfg.metrics_port:  # before the socket exists: a refusal must precede readiness
                self._start_metrics(cfg.metrics_port)
            if self.disk is not None:
                try:
                    self.disk.open()
                except DiskError as exc:
                    raise BrokerError(str(exc)) from exc
                self.disk.attach(self.segment.mm)
            self._sock = self._bind(path)
        except BaseException:
            self.cleanup()
            raise

    def _start_metrics(self, port: int) -> None:
        from .metrics import install

        try:
            install(self, port)
        except OSError as exc:
            raise BrokerError(
                f"cannot serve metrics on 127.0.0.1:{port}: {exc}; "
                "choose another --metrics-port (0 turns metrics off)"
            ) from exc

    def _publish_filter(self, slab_name: str) -> None:
        # Both tiers count their keys in it (the disk tier from its start-up scan on),
        # so it is sized for the entries of both.
        keys = self.store.nblocks
        if self.disk is not None:
            keys += self.config.max_local_disk_size // self.store.block_size
        self.filter = FilterWriter(slab_name + "-f", slots_for(keys), mode=self.config.socket_mode)
        if self._group_gid is not None:
            os.chown("/dev/shm" + self.filter.name, -1, self._group_gid)
        self.store.membership = self.filter

    def _bind(self, path: str) -> socket.socket:
        cfg = self.config
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # never exists with looser permissions, not even briefly
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            raise BrokerError(f"cannot bind socket {path}: {exc}") from exc
        finally:
            os.umask(old)
        os.chmod(path, cfg.socket_mode)
        if self._group_gid is not None:
            os.chown(path, -1, self._group_gid)
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    async def serve(self) -> None:
        assert self._sock is not None, "prepare() first"
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        if self.disk is not None:
            self.disk.start(loop)
        self._server = await loop.create_unix_server(lambda: Connection(self), sock=self._sock)
        log.info(
            "serving on %s (epoch %s, pid %d); %s",
            self.config.socket_path,
            self.epoch[:12],
            os.getpid(),
            "disk tier at " + self.config.local_disk
            if self.config.local_disk
            else "no disk tier: entries live in memory only and a restart starts empty",
        )
        sweeper = asyncio.ensure_future(self._sweep_leases())
        try:
            await self._stopping.wait()
        finally:
            sweeper.cancel()
            await self._shutdown()

    def request_stop(self, sig: int | None = None) -> None:
        if sig is not None:
            log.info("received %s, shutting down", signal.Signals(sig).name)
        if self._stopping is not None:
            self._stopping.set()

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.store.expire_leases()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting
        for conn in list(self.connections.values()):
            conn.close()
        await asyncio.sleep(0)  # let connection_lost run: releases pins and reservations
        for hook in self.shutdown_hooks:
            try:
                res = hook()
                if isinstance(res, Awaitable):
                    await res
            except Exception:
                log.exception("shutdown hook failed")
        self.cleanup()
        log.info("stopped; socket and shared-memory segment removed")

    def cleanup(self) -> None:
        """Unlink socket and segment; safe to call more than once and on any exit path."""
        path = self.config.socket_path
        if self._sock is not None:
            try:
                if _is_socket(path):
                    os.unlink(path)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self.filter is not None:
            self.store.membership = None
            self.filter.close()
            self.filter = None
        if self.disk is not None:
            self.disk.close()
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
            self.segment = None


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def _peer_groups(sock: socket.socket, gid: int) -> set[int]:
    """The peer's primary and supplementary groups, as the kernel saw them at connect.

    The file system admits a group member through any of its groups (usually a
    supplementary one), so the primary gid from SO_PEERCRED alone is not enough.
    """
    groups = {gid}
    try:
        # 1024 bytes (256 groups) is the most Python's getsockopt accepts.
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
    except OSError:
        return groups  # old kernel, or more than 256 groups: primary group only
    groups.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return groups


def _is_socket(path: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def run_broker(config: BrokerConfig) -> int:
    """Start, serve until SIGTERM/SIGINT, clean up. Returns the process exit code."""

    def stop_during_startup(signum: int, frame: object) -> None:
        raise SystemExit(0)  # prepare() and Segment.create unlink what they made

    # Until the loop installs its own handlers: the default SIGTERM action would
    # leave a half-made (and pre-faulting) segment in /dev/shm.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    server = BrokerServer(config)
    server.prepare()
    try:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        runner(server.serve())
    finally:
        server.cleanup()
    return 0
