"""The remote tier on Redis / Valkey (standalone or Cluster): the transport.

What is written, in which order, what is known and when the store is left alone
is the remote policy's (``remote_policy.py``); this module only moves bytes over
RESP (``resp.py``) and lists keys:

- *lookup*: one pipelined round trip per server for a batch of keys
  (``GETRANGE key 0 <max header>`` + ``STRLEN``); a key is a hit only if its header
  parses and matches the value's length (``remote_value.py``).
- *read_into* (promotion): ``GET`` streamed straight into the reserved slab extents,
  hashed as it lands; served only after checksum (and HMAC) matched.
- *lookup_on_loop* / *read_on_loop*: the same two calls on the broker's event loop
  (``resp_async.py``) when an idle pooled connection is at hand and the store is not
  behind TLS: a remote hit then waits for the store only, no thread hand-offs. They
  answer None/False when they cannot run there; the runtime then uses the threads.
- *write*: skipped (PRESENT) when the store holds a *valid* value of the key --
  a refused one is overwritten; ``SET`` is one gathered send of header + slab views,
  then the key is announced on ``<prefix>announce``.

Membership: brokers announce the keys they write on a pub/sub channel; every
(re)subscription asks the policy for a key scan (announcements were missed).

Cluster: keys are routed by the slot map (``CLUSTER SLOTS``). A ``-MOVED`` reply
updates the map and the command goes to the new owner; an ``-ASK`` reply sends that
command once to the target, preceded by ``ASKING``, leaving the map as it is -- for
lookups, promotions, write-behind and deletes alike. Each master is a node of its
own for the policy's circuit breakers.

Faults: every round trip is bounded by ``remote_timeout_s`` (a value transfer by
that per socket operation and an overall deadline scaled by its size).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ...protocol import Extent
from .base import EntryMeta, SlabAccess, TierError, TierMiss
from .connect_error import ConnectTrouble
from .remote_policy import Limits
from .remote_stats import REMOTE_COUNTERS
from .remote_tier import BACKGROUND_NICE, Meter, RemoteTier
from .remote_transport import (
    Declined,
    LookupAnswer,
    Node,
    Outcome,
    StoreDown,
    WriteItem,
    owned,
)
from .remote_url import mask_url, parse_remote_url, read_hmac_key, resolve_password
from .remote_value import (
    FIXED,
    MAX_HEADER,
    BadValue,
    Header,
    Verifier,
    checksum,
    default_algo,
    encode_header,
    fixed_lengths,
    parse_header,
    stored_key,
)
from .resp import (
    MAX_REDIRECTS,
    Connection,
    ConnParams,
    Endpoint,
    Pool,
    ProtocolViolation,
    Redirect,
    RespError,
    Router,
    pack,
    pack_set,
    parse_redirect,
)
from .resp_async import LoopConnection

if TYPE_CHECKING:
    from ...config import BrokerConfig

__all__ = ["BACKGROUND_NICE", "RedisTier", "RedisTransport"]

log = logging.getLogger("lmcache_ec_broker.remote")

T = TypeVar("T")

_SCAN_COUNT = 1000
_SUB_POLL_S = 0.5
_ANNOUNCE_BATCH = 256
UNMAPPED = "cluster (slot map not loaded)"


class RedisTransport:
    write_batch = 1
    write_workers = 2
    poll_s = 0.0

    def __init__(self, config: BrokerConfig, max_entry_bytes: int, meter: Meter) -> None:
        assert config.remote_url
        try:
            self.target = parse_remote_url(config.remote_url)
            password = resolve_password(self.target, config.remote_password_file)
            self.hmac_key = (
                read_hmac_key(config.remote_hmac_key_file) if config.remote_hmac_key_file else None
            )
        except ValueError as exc:
            raise TierError(str(exc)) from None
        self.url_shown = mask_url(config.remote_url)
        self.trouble = ConnectTrouble(self.url_shown)  # why it cannot connect (stats, log once)
        self.prefix = config.remote_key_prefix.encode()
        self.channel = self.prefix + b"announce"
        self.ttl_s = config.remote_ttl_s
        self.timeout_s = config.remote_timeout_s
        self.max_entry_bytes = max_entry_bytes
        self.meter = meter
        tls = None
        if self.target.tls:
            tls = ssl.create_default_context(cafile=config.remote_tls_ca_file or None)
        self.params = ConnParams(
            username=self.target.username,
            password=password,
            db=self.target.db,
            tls=tls,
            timeout_s=self.timeout_s,
        )
        if self.target.unix_path:
            seeds = [Endpoint(unix_path=self.target.unix_path)]
        else:
            seeds = [Endpoint(h, p) for h, p in self.target.hosts]
        self.pool = Pool(self.params)
        # a get's lookup and read in one round trip, on the loop (``fetch_on_loop``):
        # not behind TLS (the loop reads plain sockets) nor on a Cluster (redirects)
        self.fetches = not self.target.cluster and tls is None
        self.router = Router(seeds, self.target.cluster, self.pool)
        self._lock = threading.Lock()
        self._active: set[Connection] = set()
        self._stop = threading.Event()
        self._sub_thread: threading.Thread | None = None
        self._sub_conn: Connection | None = None

    def describe(self) -> str:
        return (
            f"{self.url_shown} ({'cluster' if self.target.cluster else 'standalone'}), "
            f"key prefix {self.prefix.decode()!r}"
            + (", values signed (HMAC)" if self.hmac_key else "")
        )

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        return None

    def start(self, slab: SlabAccess) -> None:
        return None

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            conns = [*self._active, *([self._sub_conn] if self._sub_conn else [])]
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)

    def close(self) -> None:
        self._stop.set()
        self.pool.close()

    # ------------------------------------------------------------ routing

    def _rk(self, key: str) -> bytes:
        return self.prefix + key.encode("utf-8", "surrogatepass")

    def node_of(self, key: str) -> Node:
        return self.router.cached_node(self._rk(key)) or UNMAPPED

    def nodes(self) -> list[Node]:
        return list(self.router.masters())

    def _node_for(self, rk: bytes) -> Endpoint:
        try:
            return self.router.node_for(rk)
        except (OSError, RespError) as exc:
            raise StoreDown([UNMAPPED], str(exc)) from None

    def _call(self, ep: Endpoint, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` on a pooled connection to ``ep``. Raises StoreDown for connection
        trouble, RespError for a server error reply, BadValue/TierMiss from ``fn``."""
        t0 = time.monotonic()
        try:
            conn = self.pool.get(ep)
        except (OSError, RespError) as exc:
            self.trouble.failed(exc, ep)
            raise StoreDown([ep], f"cannot connect to {ep}: {exc}") from None
        self.trouble.ok()
        with self._lock:
            self._active.add(conn)
        try:
            result = fn(conn)
        except (RespError, TierMiss):
            self.pool.put(conn)
            raise
        except (OSError, ProtocolViolation, ValueError) as exc:
            conn.close()  # possibly mid-value: never reused
            if isinstance(exc, BadValue):
                raise
            raise StoreDown([ep], f"{ep}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        finally:
            with self._lock:
                self._active.discard(conn)
            self.meter.observe(time.monotonic() - t0)
        self.pool.put(conn)
        return result

    def _routed(self, key: bytes, fn: Callable[[Connection], T]) -> T:
        """``_call`` on the node owning ``key``, following Cluster redirects: after
        ``-MOVED`` on the new owner (slot map updated), after ``-ASK`` once on the
        migration target with ASKING before each command (slot map unchanged)."""
        ep = self._node_for(key)
        asking = False
        for hop in range(MAX_REDIRECTS + 1):
            try:
                return self._call(ep, _with_asking(fn) if asking else fn)
            except RespError as exc:
                redirect = parse_redirect(str(exc), ep) if self.target.cluster else None
                if redirect is None or hop == MAX_REDIRECTS:
                    raise
            self._redirected(redirect)
            ep, asking = redirect.ep, redirect.ask
        raise AssertionError("unreachable")

    def _note_redirect(self, redirect: Redirect) -> None:
        kind = "ask" if redirect.ask else "moved"
        self.meter.count(f"remote_{kind}_redirects")
        log.debug("remote tier: %s slot %d -> %s", kind.upper(), redirect.slot, redirect.ep)

    def _redirected(self, redirect: Redirect) -> None:
        """Bookkeeping for one redirect: ``-MOVED`` updates the slot and reloads the map."""
        self._note_redirect(redirect)
        if not redirect.ask:
            self.router.moved(redirect.slot, redirect.ep)
            with contextlib.suppress(OSError, RespError):
                self.router.refresh()

    # ------------------------------------------------------------ lookups

    def lookup(self, keys: list[str]) -> list[LookupAnswer]:
        # (node, with ASKING) -> indices of the keys asked there in one pipeline.
        todo: dict[tuple[Endpoint, bool], list[int]] = {}
        rks = [self._rk(k) for k in keys]
        for i, rk in enumerate(rks):
            todo.setdefault((self._node_for(rk), False), []).append(i)
        out: list[LookupAnswer] = [None] * len(keys)
        for hop in range(MAX_REDIRECTS + 1):
            again: dict[tuple[Endpoint, bool], list[int]] = {}
            for (ep, asking), idx in todo.items():
                cmds: list[list[Any]] = []
                for i in idx:
                    cmds.append(["GETRANGE", rks[i], 0, MAX_HEADER - 1])
                    cmds.append(["STRLEN", rks[i]])

                def ask(c: Connection, cmds: list[list[Any]] = cmds) -> list[Any]:
                    return c.pipeline(cmds)

                replies = self._call(ep, _with_asking(ask) if asking else ask)
                for j, i in enumerate(idx):
                    head, total = replies[2 * j], replies[2 * j + 1]
                    err = head if isinstance(head, RespError) else total
                    if isinstance(err, RespError):
                        # MOVED / ASK: ask again where the server says (a few hops at most);
                        # any other error reply reads as a miss.
                        redirect = parse_redirect(str(err), ep) if self.target.cluster else None
                        if redirect is not None and hop < MAX_REDIRECTS:
                            self._note_redirect(redirect)
                            if not redirect.ask:
                                self.router.moved(redirect.slot, redirect.ep)
                            again.setdefault((redirect.ep, redirect.ask), []).append(i)
                        continue
                    out[i] = self._meta(keys[i], head, total)
            if not again:
                break
            if any(not asking for _, asking in again):
                with contextlib.suppress(OSError, RespError):
                    self.router.refresh()
            todo = again
        return out

    def _meta(self, key: str, head: Any, total: Any) -> LookupAnswer:
        if not isinstance(total, int) or total == 0 or not isinstance(head, bytes):
            return None  # absent (GETRANGE of a missing key is empty)
        try:
            h = parse_header(head, key, self.max_entry_bytes, self.hmac_key, total_len=total)
        except BadValue as exc:
            return exc
        return EntryMeta(h.nbytes, h.dtype, h.shape)

    # ------------------------------------------------------------ promotion

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess) -> None:
        deadline = time.monotonic() + self.timeout_s * (1 + meta.nbytes / (64 << 20))

        def get(conn: Connection) -> None:
            conn.send(["GET", self._rk(key)])
            total = conn.read_bulk_len()
            if total is None:
                raise TierMiss(key)
            if total > MAX_HEADER + self.max_entry_bytes:
                raise BadValue(f"value of {total} bytes exceeds the entry size limit")
            fixed = conn.read_exact(min(FIXED.size, total))
            size, _ = fixed_lengths(fixed)
            if size > total:
                raise BadValue("value is truncated inside its header")
            head = parse_header(
                fixed + conn.read_exact(size - FIXED.size),
                key,
                self.max_entry_bytes,
                self.hmac_key,
                total_len=total,
            )
            if (head.nbytes, head.dtype, head.shape) != (meta.nbytes, meta.dtype, meta.shape):
                raise BadValue("value changed since the lookup (other dtype/shape)")
            verifier = Verifier(head)
            with slab.views(extents) as views:
                for view in views:
                    conn.read_into(view, verifier, deadline)
            conn.skip_crlf()
            verifier.finish()
            self.meter.count("remote_bytes_read", total)

        try:
            self._routed(self._rk(key), get)
        except RespError as exc:
            raise StoreDown([self.node_of(key)], str(exc)) from None

    # ------------------------------------------------------------ on the event loop

    def _loop_conn(self, rk: bytes) -> LoopConnection | None:
        if self.params.tls is not None or self._stop.is_set():
            return None
        ep = self.router.cached_node(rk)
        if ep is None:
            return None
        lc = LoopConnection.take(self.pool, ep, asyncio.get_running_loop())
        if lc is not None:
            with self._lock:
                self._active.add(lc.conn)  # stop() cuts it too
        return lc

    def _loop_done(self, lc: LoopConnection, t0: float) -> None:
        with self._lock:
            self._active.discard(lc.conn)
        lc.release()
        self.meter.observe(time.monotonic() - t0)

    async def lookup_on_loop(self, keys: list[str]) -> list[LookupAnswer] | None:
        """``lookup`` on the event loop: one pipelined round trip when every key lives
        on one node with an idle connection. None: not here (use ``lookup``)."""
        rks = [self._rk(k) for k in keys]
        if len({self.router.cached_node(rk) for rk in rks}) != 1:
            return None
        lc = self._loop_conn(rks[0])
        if lc is None:
            return None
        ep = lc.conn.ep
        pieces: list[bytes | memoryview] = []
        for rk in rks:
            pieces += pack(["GETRANGE", rk, 0, MAX_HEADER - 1])
            pieces += pack(["STRLEN", rk])
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await lc.pipeline(pieces, 2 * len(keys))
        except (OSError, TimeoutError, ValueError) as exc:
            lc.close()
            raise StoreDown([ep], f"{ep}: {exc or type(exc).__name__}") from None
        except BaseException:
            lc.close()
            raise
        finally:
            self._loop_done(lc, t0)
        out: list[LookupAnswer] = []
        for j, key in enumerate(keys):
            head, total = replies[2 * j], replies[2 * j + 1]
            err = head if isinstance(head, RespError) else total
            if isinstance(err, RespError):
                if self.target.cluster and parse_redirect(str(err), ep) is not None:
                    return None  # a slot moved: the threads follow redirects
                out.append(None)  # any other error reply reads as a miss (as ``lookup``)
                continue
            out.append(self._meta(key, head, total))
        self.meter.count("remote_loop_lookups")
        return out

    async def read_on_loop(
        self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess
    ) -> bool:
        """``read_into`` on the event loop (the same checks, the same bytes); False:
        not here -- nothing was written -- use ``read_into``."""
        rk = self._rk(key)
        lc = self._loop_conn(rk)
        if lc is None:
            return False
        ep = lc.conn.ep
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s * (1 + meta.nbytes / (64 << 20))):
                got = await self._loop_get_head(lc, key)
                if got is None:
                    return False  # a slot moved: the threads follow redirects
                total, head = got
                if (head.nbytes, head.dtype, head.shape) != (meta.nbytes, meta.dtype, meta.shape):
                    raise BadValue("value changed since the lookup (other dtype/shape)")
                await self._loop_stream(lc, head, extents, slab)
        except (TierMiss, BadValue, StoreDown):
            raise  # a BadValue mid-value leaves the stream out of step: release closes it
        except (OSError, TimeoutError, ValueError) as exc:
            lc.close()
            raise StoreDown([ep], f"{ep}: {exc or type(exc).__name__}") from None
        except BaseException:
            lc.close()
            raise
        finally:
            self._loop_done(lc, t0)
        self.meter.count("remote_bytes_read", total)
        self.meter.count("remote_loop_reads")
        return True

    async def _loop_stream(
        self, lc: LoopConnection, head: Header, extents: list[Extent], slab: SlabAccess
    ) -> None:
        """The payload after ``head`` streamed into ``extents`` and verified; the
        connection is back in step only once the whole value and its CRLF are read."""
        verifier = Verifier(head)
        with slab.views(extents) as views:
            await lc.stream_into(views, verifier)
        await lc.crlf()
        lc.in_step = True
        verifier.finish()

    async def _loop_get_head(self, lc: LoopConnection, key: str) -> tuple[int, Header] | None:
        """Send ``GET`` and read the value's length and header on the loop, checked as a
        lookup checks them; the payload is left in the stream. None: a Cluster slot
        moved (the threads follow redirects). Raises TierMiss, BadValue, StoreDown."""
        ep = lc.conn.ep
        await lc.send(pack(["GET", self._rk(key)]))
        try:
            total = await lc.bulk_len()
        except RespError as exc:
            if self.target.cluster and parse_redirect(str(exc), ep) is not None:
                return None
            raise StoreDown([ep], str(exc)) from None
        if total is None:
            raise TierMiss(key)
        if total > MAX_HEADER + self.max_entry_bytes:
            raise BadValue(f"value of {total} bytes exceeds the entry size limit")
        fixed = await lc.exact(min(FIXED.size, total))
        size, _ = fixed_lengths(fixed)
        if size > total:
            raise BadValue("value is truncated inside its header")
        head = parse_header(
            fixed + await lc.exact(size - FIXED.size),
            key,
            self.max_entry_bytes,
            self.hmac_key,
            total_len=total,
        )
        return total, head

    def loop_fetch_conn(self, key: str) -> LoopConnection | None:
        """A connection for ``fetch_on_loop`` (standalone stores: a Cluster redirect
        would need the threads), or None."""
        if self.target.cluster:
            return None
        return self._loop_conn(self._rk(key))

    async def fetch_on_loop(
        self,
        lc: LoopConnection,
        key: str,
        reserve: Callable[[EntryMeta], list[Extent] | None],
        slab: SlabAccess,
    ) -> EntryMeta:
        """Lookup and read in one round trip: ``GET``, the header checked as a lookup
        checks it, then ``reserve(meta)`` (on the loop, no hand-off) and the payload
        streamed into those extents and verified. Raises TierMiss, BadValue, Declined
        (``reserve`` took nothing: the connection, mid-value, is closed), StoreDown."""
        ep = lc.conn.ep
        t0 = time.monotonic()
        total = 0
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                got = await self._loop_get_head(lc, key)
                if got is None:  # standalone stores only (loop_fetch_conn): never a redirect
                    raise StoreDown([ep], f"{ep}: unexpected cluster redirect")
                total, head = got
                meta = EntryMeta(head.nbytes, head.dtype, head.shape)
                extents = reserve(meta)
                if extents is None:
                    raise Declined(f"no room for {key[:200]!r}")
                # never a byte outside what was reserved for exactly this payload
                if sum(n for _, n in extents) != head.nbytes:
                    raise ValueError("reserved extents do not match the value's size")
                deadline.reschedule(
                    asyncio.get_running_loop().time()
                    + self.timeout_s * (1 + head.nbytes / (64 << 20))
                )
                await self._loop_stream(lc, head, extents, slab)
        except (TierMiss, BadValue, StoreDown, Declined):
            raise  # mid-value the stream is out of step: release closes the connection
        except (OSError, TimeoutError, ValueError) as exc:
            lc.close()
            raise StoreDown([ep], f"{ep}: {exc or type(exc).__name__}") from None
        except BaseException:
            lc.close()
            raise
        finally:
            self._loop_done(lc, t0)
        self.meter.count("remote_bytes_read", total)
        self.meter.count("remote_loop_reads")
        return meta

    # ------------------------------------------------------------ write-behind

    def write(self, items: Sequence[WriteItem], slab: SlabAccess) -> list[Outcome]:
        out = []
        for item in items:
            try:
                out.append(self._write_one(item, slab))
            except RespError as exc:  # the store answered (e.g. OOM): alive, not stored
                log.debug("remote tier: the store refused %r: %s", item.key[:200], exc)
                out.append(Outcome.REJECTED)
            except (StoreDown, BadValue) as exc:
                log.debug("remote tier: writing %r failed: %s", item.key[:200], exc)
                out.append(Outcome.FAILED)
        return out

    def _write_one(self, item: WriteItem, slab: SlabAccess) -> Outcome:
        rk = self._rk(item.key)
        meta = item.meta

        def put(conn: Connection) -> Outcome:
            if not item.overwrite:
                head, total = conn.pipeline([["GETRANGE", rk, 0, MAX_HEADER - 1], ["STRLEN", rk]])
                for reply in (head, total):
                    if isinstance(reply, RespError):
                        raise reply  # a redirect: _routed follows it
                if isinstance(self._meta(item.key, head, total), EntryMeta):
                    return Outcome.PRESENT  # a valid value is there; a refused one is replaced
            algo = default_algo(self.hmac_key)
            with slab.views(item.extents) as views:
                header = encode_header(
                    item.key,
                    meta.dtype,
                    meta.shape,
                    checksum(views, algo),
                    meta.nbytes,
                    algo,
                    self.hmac_key,
                )
                conn.send_pieces(pack_set(rk, [header, *views], self.ttl_s))
            reply = conn.read_reply()
            if reply != "OK":
                raise ProtocolViolation(f"SET answered {reply!r}")
            conn.command("PUBLISH", self.channel, item.key)
            self.meter.count("remote_bytes_written", len(header) + meta.nbytes)
            return Outcome.STORED

        return self._routed(rk, put)

    # ------------------------------------------------------------ delete / clear / list

    def delete(self, key: str) -> None:
        rk = self._rk(key)
        try:
            self._routed(rk, lambda c: c.command("DEL", rk))
        except RespError as exc:
            raise StoreDown([self.node_of(key)], str(exc)) from None

    def clear(self) -> int:
        """DEL every value of the namespace whose header names the key it is stored
        under: a nested prefix's values (``a:b:x`` under ``a:``) stay."""
        names = self._scan(1 << 62)
        removed = 0
        for lo in range(0, len(names), 100):
            chunk = names[lo : lo + 100]
            for name in chunk:
                rk = self._rk(name)
                try:
                    head = self._routed(
                        rk, lambda c, rk=rk: c.command("GETRANGE", rk, 0, MAX_HEADER - 1)
                    )
                    if not isinstance(head, bytes) or not head:
                        continue
                    if not owned(stored_key(head), name):
                        continue  # another namespace nested inside ours
                    removed += int(self._routed(rk, lambda c, rk=rk: c.command("DEL", rk)) or 0)
                except RespError as exc:
                    raise StoreDown([self.node_of(name)], str(exc)) from None
        return removed

    def list_keys(self, limit: int) -> list[str]:
        return self._scan(limit)

    def _scan(self, limit: int) -> list[str]:
        if self.target.cluster:
            try:
                self.router.refresh()
            except (OSError, RespError) as exc:
                raise StoreDown([UNMAPPED], str(exc)) from None
        found: list[str] = []
        n = len(self.prefix)
        pattern = _glob_escape(self.prefix) + b"*"
        for ep in self.router.masters():

            def scan(conn: Connection) -> None:
                cursor: bytes | int = b"0"
                while True:
                    reply = conn.command("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
                    if not (isinstance(reply, list) and len(reply) == 2):
                        raise ProtocolViolation("SCAN answered a malformed reply")
                    cursor, keys = reply
                    if not isinstance(keys, list) or not isinstance(cursor, bytes):
                        raise ProtocolViolation("SCAN answered a malformed reply")
                    for k in keys:
                        if isinstance(k, bytes) and k != self.channel:
                            found.append(k[n:].decode("utf-8", "surrogateescape"))
                    if cursor == b"0" or len(found) >= limit or self._stop.is_set():
                        return

            try:
                self._call(ep, scan)
            except RespError as exc:
                raise StoreDown([ep], str(exc)) from None
        return found[:limit]

    def probe(self, node: Node) -> None:
        ep = node if isinstance(node, Endpoint) else self.router.seeds[0]
        try:
            self._call(ep, lambda c: c.command("PING"))
        except RespError as exc:
            raise StoreDown([node], str(exc)) from None

    # ------------------------------------------------------------ announcements

    def start_announcements(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None] | None = None,
    ) -> None:
        self._sub_thread = threading.Thread(
            target=self._subscriber,
            args=(on_keys, on_resync, on_health),
            name="ec-remote-announce",
            daemon=True,
        )
        # The first key scan runs once the subscription is confirmed: a key written
        # before it is found by the scan, one written after is announced.
        self._sub_thread.start()

    def _subscriber(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None] | None,
    ) -> None:
        """Fold keys other brokers announce; reconnect with backoff. Every confirmed
        (re)subscription asks for a key scan (the announcements before it were missed)."""
        backoff = 0.2
        while not self._stop.is_set():
            ep = (self.router.masters() or self.router.seeds)[0]
            node = self.node_of("") if not self.target.cluster else ep
            try:
                conn = Connection(ep, dataclasses.replace(self.params, timeout_s=_SUB_POLL_S))
            except (OSError, RespError) as exc:
                self.trouble.failed(exc, ep)
                if on_health is not None:
                    on_health(node, False)  # no traffic needed to notice a store that is down
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            with self._lock:
                self._sub_conn = conn
            try:
                conn.command("SUBSCRIBE", self.channel)
                if on_health is not None:
                    on_health(node, True)  # ... nor to notice it is back
                on_resync()
                backoff = 0.2
                batch: list[str] = []
                while not self._stop.is_set():
                    try:
                        msg = conn.read_reply()
                    except TimeoutError:
                        if conn._buf or conn.partial:
                            # a reply cut by the timeout: the stream is out of step
                            raise ProtocolViolation("half a message, then silence") from None
                        if batch:
                            on_keys(batch)
                            batch = []
                        continue
                    if (
                        isinstance(msg, list)
                        and len(msg) == 3
                        and msg[0] == b"message"
                        and isinstance(msg[2], bytes)
                        and 0 < len(msg[2]) <= 64 * 1024
                    ):
                        batch.append(msg[2].decode("utf-8", "surrogateescape"))
                        if len(batch) >= _ANNOUNCE_BATCH or not conn._buf:
                            on_keys(batch)
                            batch = []
            except (OSError, RespError, ProtocolViolation):
                pass
            finally:
                conn.close()
                with self._lock:
                    self._sub_conn = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)


class RedisTier(RemoteTier):
    """The remote policy over Redis/Valkey."""

    def __init__(self, config: BrokerConfig, max_entry_bytes: int, max_pending_bytes: int) -> None:
        meter = Meter(REMOTE_COUNTERS)
        transport = RedisTransport(config, max_entry_bytes, meter)
        limits = Limits(
            timeout_s=config.remote_timeout_s,
            write_queue=config.remote_write_queue,
            max_pending_bytes=max(max_pending_bytes, 1),
            max_entry_bytes=max_entry_bytes,
            filter_cap=config.remote_filter_keys,
            write_workers=RedisTransport.write_workers,
            write_batch=RedisTransport.write_batch,
            breaker_backoff_s=min(0.5, config.remote_timeout_s),
        )
        super().__init__(transport, limits, meter, transport.describe())


def _with_asking(fn: Callable[[Connection], T]) -> Callable[[Connection], T]:
    """``fn`` with every command it sends preceded by ASKING (following an -ASK)."""

    def run(conn: Connection) -> T:
        conn.asking = True  # the pool clears it when the connection comes back
        return fn(conn)

    return run


def _glob_escape(b: bytes) -> bytes:
    out = bytearray()
    for c in b:
        if c in b"*?[]\\":
            out.append(0x5C)
        out.append(c)
    return bytes(out)
