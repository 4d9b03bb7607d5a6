"""A small blocking RESP2 client for the remote tier's threads: Redis and Valkey, standalone
or Cluster, over TCP, TLS or a Unix socket.

Why not redis-py: measured against a real redis-server (docs/scaling.md), redis-py's
GET returns a new ``bytes`` (130 MiB: 0.37 GB/s on a Unix socket, then one more copy
into the slab) while reading the bulk reply straight into the slab with
``recv_into`` runs at 1.16 GB/s, and a gathered ``sendmsg`` of header + slab views
avoids building the value in memory. Reading the length first also lets the tier
refuse an oversized or malformed value before it allocates or copies anything.

Every length the server sends is bounded before it is used (``resp_wire.py``: the
grammar this client and the loop's reader share). A connection that saw an error in
the middle of a reply is closed, never reused (it may be out of step).

Cluster redirects (the Redis Cluster specification): ``-MOVED <slot> <host:port>``
means the slot lives elsewhere now (the caller updates its slot map and retries
there); ``-ASK <slot> <host:port>`` means the slot is being migrated and this key
is already on the target: the caller retries *once* on the target, each command
preceded by ``ASKING`` (``RespConnection.asking``), without touching the slot map.
"""

from __future__ import annotations

import binascii
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

# The grammar (packing, bounded parsing) is resp_wire's; its names are importable
# from here too.
from .resp_wire import (
    ASKING,
    MAX_ARRAY,
    MAX_LINE,
    MAX_REPLY,
    MAX_SMALL_BULK,
    Arg,
    ProtocolViolation,
    Reply,
    RespError,
    bulk_length,
    check_crlf,
    pack,
    pack_set,
    reply_head,
    take_buffered,
    take_line,
)

__all__ = [
    "CLUSTER_SLOTS",
    "MAX_ARRAY",
    "MAX_LINE",
    "MAX_REDIRECTS",
    "MAX_REPLY",
    "MAX_SMALL_BULK",
    "Arg",
    "ConnParams",
    "RespConnection",
    "Endpoint",
    "Pool",
    "ProtocolViolation",
    "Redirect",
    "Reply",
    "RespError",
    "Router",
    "key_slot",
    "pack",
    "pack_set",
    "parse_redirect",
]

MAX_REDIRECTS = 3  # MOVED/ASK hops followed for one command before giving up
_RECV_CHUNK = 4 << 20
CLUSTER_SLOTS = 16384

@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str = ""
    port: int = 0
    unix_path: str = ""

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ConnParams:
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: ssl.SSLContext | None = None
    timeout_s: float = 1.0


def key_slot(key: bytes) -> int:
    """Redis Cluster hash slot: CRC16 (XMODEM) of the key or of its {hash tag}."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % CLUSTER_SLOTS


@dataclass(frozen=True, slots=True)
class Redirect:
    """A Cluster ``-MOVED`` or ``-ASK`` error reply, parsed."""

    ask: bool  # True: -ASK (one-shot, with ASKING); False: -MOVED (update the slot map)
    slot: int
    ep: Endpoint


def parse_redirect(message: str, current: Endpoint | None = None) -> Redirect | None:
    """``MOVED 3999 127.0.0.1:6381`` / ``ASK 3999 127.0.0.1:6381`` -> Redirect; None for
    any other error. An empty host (``:6381``) means the host of ``current``."""
    parts = message.split()
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, sep, port_text = parts[2].rpartition(":")
    try:
        slot, port = int(parts[1]), int(port_text)
    except ValueError:
        return None
    if not sep or not 0 <= slot < CLUSTER_SLOTS or not 0 < port < 65536:
        return None
    host = host.removeprefix("[").removesuffix("]")
    if not host or host == "?":
        if current is None or not current.host:
            return None
        host = current.host
    return Redirect(parts[0] == "ASK", slot, Endpoint(host, port))


class RespConnection:
    """One socket to one server. Not thread-safe: a thread takes it from a Pool."""

    def __init__(self, ep: Endpoint, params: ConnParams) -> None:
        self.ep = ep
        self.params = params
        self._buf = bytearray()
        self.closed = False
        # While True (an -ASK redirect is being followed), every command sent is
        # preceded by ASKING, whose +OK reply the reading side consumes unseen.
        self.asking = False
        self._asking_replies = 0
        # True from the first line of a reply until all of it is read: a timeout in
        # between leaves the stream out of step (the caller must not read on).
        self.partial = False
        self._reply_bytes = 0
        if ep.unix_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in ep.host else socket.AF_INET)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(params.timeout_s)
        try:
            sock.connect(ep.unix_path or (ep.host, ep.port))
            if params.tls is not None:
                sock = params.tls.wrap_socket(sock, server_hostname=ep.host or None)
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket = sock
        try:
            if params.password:
                auth = [params.username, params.password] if params.username else [params.password]
                self.command("AUTH", *auth)
            if params.db:
                self.command("SELECT", params.db)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    # ------------------------------------------------------------ writing

    @property
    def buffered(self) -> bool:
        """Bytes past the last reply read are already here (more is coming at once)."""
        return bool(self._buf)

    @property
    def idle(self) -> bool:
        """Nothing unread: the connection can go back to the pool."""
        return not (self.closed or self._buf or self._asking_replies or self.partial)

    def send(self, args: Sequence[Arg]) -> None:
        self.send_pieces(pack(args))

    def send_pieces(self, pieces: list[bytes | memoryview]) -> None:
        """Send one command given as RESP pieces (``pack``, ``pack_set``)."""
        if self.asking:
            self._asking_replies += 1
            pieces = [ASKING, *pieces]
        self._sendall(pieces)

    def _sendall(self, pieces: list[bytes | memoryview]) -> None:
        try:
            if isinstance(self.sock, ssl.SSLSocket):
                for p in pieces:
                    self.sock.sendall(p)
                return
            pending = [memoryview(p) for p in pieces if len(p)]
            while pending:
                sent = self.sock.sendmsg(pending[:512])
                while sent:
                    if sent >= len(pending[0]):
                        sent -= len(pending[0])
                        pending.pop(0)
                    else:
                        pending[0] = pending[0][sent:]
                        sent = 0
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ reading

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"{self.ep} closed the connection")
        self._buf += chunk

    def _line(self) -> bytes:
        while (line := take_line(self._buf, self.ep)) is None:
            self._fill()
        return line

    def read_exact(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def read_into(self, view: memoryview, hasher: object = None, deadline: float = 0.0) -> None:
        """Fill ``view`` from the stream (buffered bytes first, then recv_into directly);
        ``hasher.update`` sees each piece right after it lands. Past ``deadline``
        (time.monotonic, 0 = none) raises TimeoutError: a trickling server cannot hold
        a reader longer than that, even though each recv makes progress."""
        got = take_buffered(self._buf, view, hasher)
        n = len(view)
        while got < n:
            if deadline and time.monotonic() > deadline:
                raise TimeoutError(f"{self.ep} is sending a value too slowly")
            r = self.sock.recv_into(view[got:], min(n - got, _RECV_CHUNK))
            if r == 0:
                raise ConnectionError(f"{self.ep} closed the connection mid-value")
            if hasher is not None:
                hasher.update(view[got : got + r])  # type: ignore[attr-defined]
            got += r

    def skip_crlf(self) -> None:
        check_crlf(self.read_exact(2), self.ep)

    def _skip_asking(self) -> None:
        """Consume the +OK of the ASKING sent just before the reply about to be read."""
        if self._asking_replies:
            line = self._line()
            self._asking_replies -= 1
            if line != b"+OK":
                raise ProtocolViolation(f"{self.ep} answered ASKING with {line[:60]!r}")

    def read_bulk_len(self) -> int | None:
        """The length line of a bulk reply (None for nil); an error reply raises RespError."""
        self._skip_asking()
        return bulk_length(self._line(), self.ep)

    def read_reply(self, max_bulk: int = MAX_SMALL_BULK, depth: int = 0) -> Reply:
        if depth == 0:
            self._skip_asking()
            self._reply_bytes = 0
        line = self._line()
        if depth == 0:
            self.partial = True
        try:
            reply = self._parse(line, max_bulk, depth)
        except RespError:
            if depth == 0 and line[:1] == b"-":
                self.partial = False  # a top-level error reply is a whole reply
            raise
        if depth == 0:
            self.partial = False
        return reply

    def _parse(self, line: bytes, max_bulk: int, depth: int) -> Reply:
        kind, value = reply_head(line, self.ep, max_bulk)
        if isinstance(value, RespError):
            raise value
        if kind == b"$" and isinstance(value, int):
            self._reply_bytes += value
            if self._reply_bytes > MAX_REPLY:
                raise ProtocolViolation(f"{self.ep} sent a reply over {MAX_REPLY} bytes")
            data = self.read_exact(value)
            self.skip_crlf()
            return data
        if kind == b"*" and isinstance(value, int):
            if depth > 4:
                raise ProtocolViolation(f"{self.ep} sent an array of {value} items")
            return [self.read_reply(max_bulk, depth + 1) for _ in range(value)]
        return value

    def command(self, *args: Arg, max_bulk: int = MAX_SMALL_BULK) -> Reply:
        self.send(args)
        try:
            return self.read_reply(max_bulk)
        except RespError:
            raise
        except BaseException:
            self.close()
            raise

    def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply | RespError]:
        """Send all, then read all replies in order (one round trip)."""
        pieces: list[bytes | memoryview] = []
        for c in commands:
            if self.asking:
                pieces.append(ASKING)
            pieces += pack(c)
        if self.asking:
            self._asking_replies += len(commands)
        self._sendall(pieces)
        out: list[Reply | RespError] = []
        try:
            for _ in commands:
                try:
                    out.append(self.read_reply())
                except RespError as exc:
                    out.append(exc)
        except BaseException:
            self.close()
            raise
        return out


class Pool:
    """Idle connections per endpoint, shared by the tier's threads."""

    def __init__(self, params: ConnParams, max_idle: int = 8) -> None:
        self.params = params
        self.max_idle = max_idle
        self._idle: dict[Endpoint, list[RespConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, ep: Endpoint) -> RespConnection:
        with self._lock:
            idle = self._idle.get(ep)
            if idle:
                return idle.pop()
        return RespConnection(ep, self.params)

    def take_idle(self, ep: Endpoint) -> RespConnection | None:
        """An idle connection to ``ep``, never a new one (no blocking connect)."""
        with self._lock:
            idle = self._idle.get(ep)
            return idle.pop() if idle else None

    def put(self, conn: RespConnection) -> None:
        conn.asking = False
        if not conn.idle:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.ep, [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()


class Router:
    """Which server owns a key: one endpoint (standalone) or the Cluster's slot map."""

    def __init__(self, seeds: list[Endpoint], cluster: bool, pool: Pool) -> None:
        self.seeds = seeds
        self.cluster = cluster
        self.pool = pool
        self._slots: list[Endpoint] = []
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Load the slot map from the first seed (or known node) that answers."""
        if not self.cluster:
            return
        last: Exception | None = None
        for ep in dict.fromkeys([*self.masters(), *self.seeds]):
            try:
                conn = self.pool.get(ep)
                reply = conn.command("CLUSTER", "SLOTS")
                self.pool.put(conn)
            except (OSError, RespError) as exc:
                last = exc
                continue
            table: list[Endpoint] = [Endpoint()] * CLUSTER_SLOTS
            if not isinstance(reply, list):
                raise ProtocolViolation("CLUSTER SLOTS did not answer an array")
            for item in reply:
                if not (isinstance(item, list) and len(item) >= 3 and isinstance(item[2], list)):
                    raise ProtocolViolation("CLUSTER SLOTS answered a malformed entry")
                lo, hi, master = item[0], item[1], item[2]
                if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi < 16384):
                    raise ProtocolViolation("CLUSTER SLOTS answered a bad slot range")
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                port = master[1]
                if not isinstance(port, int):
                    raise ProtocolViolation("CLUSTER SLOTS answered a bad port")
                node = Endpoint(host or ep.host, port)
                for s in range(lo, hi + 1):
                    table[s] = node
            with self._lock:
                self._slots = table
            return
        raise ConnectionError(f"no cluster seed answered CLUSTER SLOTS: {last}")

    def moved(self, slot: int, ep: Endpoint) -> None:
        """A ``-MOVED`` reply: ``slot`` is served by ``ep`` now."""
        with self._lock:
            if self._slots:
                self._slots[slot] = ep

    def node_for(self, key: bytes) -> Endpoint:
        if not self.cluster:
            return self.seeds[0]
        with self._lock:
            slots = self._slots
        if not slots:
            self.refresh()
            with self._lock:
                slots = self._slots
        ep = slots[key_slot(key)]
        if not ep.host and not ep.unix_path:
            raise ConnectionError("the cluster has no node for this key's slot")
        return ep

    def cached_node(self, key: bytes) -> Endpoint | None:
        """The node owning ``key`` from the slot map in memory (no I/O); None before
        the map is loaded."""
        if not self.cluster:
            return self.seeds[0]
        with self._lock:
            slots = self._slots
        if not slots:
            return None
        ep = slots[key_slot(key)]
        return ep if (ep.host or ep.unix_path) else None

    def masters(self) -> list[Endpoint]:
        if not self.cluster:
            return list(self.seeds)
        with self._lock:
            return [ep for ep in dict.fromkeys(self._slots) if ep.host or ep.unix_path]
