"""The remote tier on Redis / Valkey (standalone or Cluster): one store shared by many hosts.

Only the broker talks to the store (one small connection pool per host); clients and
the vLLM connector are unchanged. All I/O runs on the tier's threads:

- *lookup*: one pipelined round trip per server for a batch of keys
  (``GETRANGE key 0 <max header>`` + ``STRLEN``); a key is a hit only if its header
  parses and matches the value's length (``remote_value.py``).
- *read_into* (promotion): ``GET`` streamed straight into the reserved slab extents,
  hashed as it lands; served only after checksum (and HMAC) matched.
- *write* (write-behind from a pinned slab entry): skipped when the store already has
  the key; a bounded queue (``remote_write_queue`` and a byte budget), drops counted,
  never blocks a put; ``SET`` is one gathered send of header + slab views.

Membership filter: brokers announce the keys they write on a pub/sub channel
(``<prefix>announce``); every broker folds announced keys -- and, at start and after
the store comes back, the keys a ``SCAN`` finds -- into its filter (at most
``remote_filter_keys``, oldest forgotten first). A key the filter does not know can
still be a remote hit for a broker that asks; a client whose local filter says "absent"
just does not ask, so a missed announcement costs a hit, never a wrong answer.

Cluster: keys are routed by the slot map (``CLUSTER SLOTS``). A ``-MOVED`` reply
updates the map and the command goes to the new owner; an ``-ASK`` reply (the slot is
being migrated and this key already moved) sends that command once to the target,
preceded by ``ASKING``, leaving the map as it is -- for lookups, promotions,
write-behind and deletes alike, so a slot migration costs no hit and no write.

Faults: every round trip is bounded by ``remote_timeout_s`` (a value transfer by
that per socket operation and an overall deadline scaled by its size); a circuit
breaker stops calling a failing store and probes it with backoff. A store that lost
its data (restart) answers misses; the next SCAN drops the stale keys from the filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ...protocol import Extent
from .base import (
    EntryMeta,
    LowerTier,
    SlabAccess,
    TierCorrupt,
    TierError,
    TierEvents,
    TierMiss,
    TierUnavailable,
)
from .circuit import CircuitBreaker, State
from .remote_stats import REMOTE_COUNTERS, REMOTE_GAUGES, record_latency
from .remote_url import mask_url, parse_remote_url, read_hmac_key, resolve_password
from .remote_value import (
    FIXED,
    MAX_HEADER,
    BadValue,
    Verifier,
    checksum,
    default_algo,
    encode_header,
    fixed_lengths,
    parse_header,
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
    pack_set,
    parse_redirect,
)

if TYPE_CHECKING:
    from ...config import BrokerConfig

log = logging.getLogger("lmcache_ec_broker.remote")

T = TypeVar("T")

_SCAN_COUNT = 1000
_SUB_POLL_S = 0.5


class _Unavailable(Exception):
    """A thread-side failure that means 'store unreachable or misbehaving'."""


@dataclass(slots=True, eq=False)
class _Write:
    key: str
    nbytes: int
    cancelled: bool = False


class RedisTier(LowerTier):
    name = "remote"
    counter_names = REMOTE_COUNTERS
    remote = True

    def __init__(self, config: BrokerConfig, max_entry_bytes: int, max_pending_bytes: int) -> None:
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
        self.prefix = config.remote_key_prefix.encode()
        self.channel = self.prefix + b"announce"
        self.ttl_s = config.remote_ttl_s
        self.timeout_s = config.remote_timeout_s
        self.queue_limit = config.remote_write_queue
        self.filter_cap = config.remote_filter_keys
        self.max_entry_bytes = max_entry_bytes
        self.max_pending_bytes = max(max_pending_bytes, 1)
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
        self.router = Router(seeds, self.target.cluster, self.pool)
        self.circuit = CircuitBreaker(
            backoff_s=min(0.5, self.timeout_s), on_change=self._circuit_changed
        )
        self.counters: dict[str, int | float] = dict.fromkeys(REMOTE_COUNTERS, 0)
        self._lock = threading.Lock()
        # Keys reported to the filter -> when last learned (a sequence number, so that a
        # SCAN that started earlier does not drop a key announced while it ran).
        self.known: OrderedDict[str, int] = OrderedDict()
        self._seq = 0
        # True while ``known`` holds every key this broker learned of (nothing dropped for
        # the cap): lookups then skip the round trip for keys outside it.
        self._complete = self.filter_cap > 0
        self.pending: dict[str, _Write] = {}
        self.pending_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slab: SlabAccess | None = None
        self._events: TierEvents | None = None
        self._lookups: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        self._control: ThreadPoolExecutor | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._active: set[Connection] = set()
        self._stop = threading.Event()
        self._sub_thread: threading.Thread | None = None
        self._sub_conn: Connection | None = None
        self._closing = False
        self._warned: dict[str, float] = {}

    # ------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop, slab: SlabAccess, events: TierEvents) -> None:
        self._loop = loop
        self._slab = slab
        self._events = events
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="ec-remote-lookup")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="ec-remote-read")
        # Write-behind and maintenance yield the CPU to the event loop and the readers:
        # on a busy host they must not slow down puts (they run at nice +10).
        self._writers = ThreadPoolExecutor(
            2, thread_name_prefix="ec-remote-write", initializer=_background_priority
        )
        self._control = ThreadPoolExecutor(
            1, thread_name_prefix="ec-remote-control", initializer=_background_priority
        )
        log.info(
            "remote tier: %s (%s), key prefix %r, timeout %.2fs%s",
            self.url_shown,
            "cluster" if self.target.cluster else "standalone",
            self.prefix.decode(),
            self.timeout_s,
            ", values signed (HMAC)" if self.hmac_key else "",
        )
        self._sub_thread = threading.Thread(
            target=self._subscriber, name="ec-remote-announce", daemon=True
        )
        # The first key scan runs once the subscription is confirmed (see _subscriber):
        # a key written before it is found by the scan, one written after is announced.
        self._sub_thread.start()

    async def shutdown(self, deadline_s: float) -> None:
        self._closing = True
        self._stop.set()
        end = time.monotonic() + max(deadline_s, 0.0)
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=max(end - time.monotonic(), 0.0))
        if self._inflight:
            # Past the deadline: cut the sockets under the threads so they leave the slab now.
            log.warning("remote tier: abandoning %d transfers at shutdown", len(self._inflight))
            with self._lock:
                active = list(self._active)
            for conn in active:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(2)
            await asyncio.wait(set(self._inflight), timeout=max(self.timeout_s, 1.0))
        for pool in (self._lookups, self._readers, self._writers, self._control):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        sub = self._sub_conn
        if sub is not None:
            with contextlib.suppress(OSError):
                sub.sock.shutdown(2)
        self._slab = None

    def close(self) -> None:
        self._stop.set()
        self.pool.close()

    def expected_keys(self, block_size: int) -> int:
        return self.filter_cap

    # ------------------------------------------------------------ helpers

    def _rk(self, key: str) -> bytes:
        return self.prefix + key.encode("utf-8", "surrogatepass")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _observe(self, seconds: float) -> None:
        with self._lock:
            record_latency(self.counters, seconds)

    def _warn(self, what: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 10.0:
            self._warned[what] = now
            log.warning(msg, *args)

    def _submit(self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> Any:
        assert pool is not None and self._loop is not None
        fut = self._loop.run_in_executor(pool, fn, *args)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _call(self, ep: Endpoint, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` on a pooled connection to ``ep``; failures feed the circuit breaker.
        Raises _Unavailable for connection trouble, RespError for a server error reply."""
        t0 = time.monotonic()
        try:
            conn = self.pool.get(ep)
        except (OSError, RespError) as exc:
            self.circuit.failure()
            raise _Unavailable(f"cannot connect to {ep}: {exc}") from None
        with self._lock:
            self._active.add(conn)
        try:
            result = fn(conn)
        except (RespError, TierMiss):
            self.pool.put(conn)
            self.circuit.success()
            raise
        except (OSError, ProtocolViolation, ValueError) as exc:
            conn.close()  # possibly mid-value: never reused
            if not isinstance(exc, BadValue):
                self.circuit.failure()
                raise _Unavailable(f"{ep}: {exc}") from None
            self.circuit.success()  # the store answered; the value is what is bad
            raise
        except BaseException:
            conn.close()
            raise
        finally:
            with self._lock:
                self._active.discard(conn)
            self._observe(time.monotonic() - t0)
        self.pool.put(conn)
        self.circuit.success()
        return result

    def _routed(self, key: bytes, fn: Callable[[Connection], T]) -> T:
        """``_call`` on the node owning ``key``, following Cluster redirects: after
        ``-MOVED`` on the new owner (slot map updated), after ``-ASK`` once on the
        migration target with ASKING before each command (slot map unchanged)."""
        try:
            ep = self.router.node_for(key)
        except (OSError, RespError) as exc:
            self.circuit.failure()
            raise _Unavailable(str(exc)) from None
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
        self._count(f"remote_{kind}_redirects")
        log.debug("remote tier: %s slot %d -> %s", kind.upper(), redirect.slot, redirect.ep)

    def _redirected(self, redirect: Redirect) -> None:
        """Bookkeeping for one redirect: ``-MOVED`` updates the slot and reloads the map."""
        self._note_redirect(redirect)
        if not redirect.ask:
            self.router.moved(redirect.slot, redirect.ep)
            with contextlib.suppress(OSError, RespError):
                self.router.refresh()

    # ------------------------------------------------------------ filter bookkeeping

    def _learn(self, key: str) -> None:
        """Fold a key the store holds into the filter (loop thread)."""
        if self._events is None or self.filter_cap == 0:
            return
        self._seq += 1
        if key in self.known:
            self.known.move_to_end(key)
            self.known[key] = self._seq
            return
        if len(self.known) >= self.filter_cap:
            old, _ = self.known.popitem(last=False)
            self._events.removed(self, old)
            self._complete = False  # forgotten keys may still be in the store: ask for all
        self._events.added(self, key)
        self.known[key] = self._seq

    def _forget(self, key: str) -> bool:
        if key in self.known:
            del self.known[key]
            assert self._events is not None
            self._events.removed(self, key)
            return True
        return False

    def _reconcile(self, found: list[str] | None, since: int) -> None:
        """After a SCAN: the filter holds what the store holds (loop thread). Keys learned
        after the scan started (``since``) stay: the scan may have passed them by."""
        if found is None:
            return
        present = set(found)
        for key in [k for k, seq in self.known.items() if seq <= since and k not in present]:
            self._forget(key)
        self._complete = self.filter_cap > 0 and len(found) < self.filter_cap
        for key in found:
            self._learn(key)

    def _rescan(self) -> None:
        if self._closing or self._control is None or self.filter_cap == 0:
            return
        since = self._seq
        fut = self._submit(self._control, self._scan_job)
        fut.add_done_callback(lambda f: None if f.cancelled() else self._scan_done(f, since))

    def _scan_done(self, fut: asyncio.Future[list[str] | None], since: int) -> None:
        exc = fut.exception()
        if exc is not None:
            log.info("remote tier: key scan failed (%s); the filter learns keys as they come", exc)
            return
        self._reconcile(fut.result(), since)

    def _scan_job(self) -> list[str] | None:
        if not self.circuit.allow():
            return None  # the breaker's recovery triggers the next scan
        if self.target.cluster:
            self.router.refresh()
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
                    if cursor == b"0" or len(found) >= self.filter_cap or self._stop.is_set():
                        return

            self._call(ep, scan)
        return found[: self.filter_cap]

    def _circuit_changed(self, state: State) -> None:
        if state is State.OPEN:
            self._count("remote_circuit_opens")
            self._warn(
                "down", "remote tier: %s is unavailable; serving local tiers", self.url_shown
            )
        elif state is State.CLOSED and self.circuit.opened and self._loop is not None:
            log.info("remote tier: %s is reachable again", self.url_shown)
            # It may have restarted empty: re-learn what it holds.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._rescan)

    # ------------------------------------------------------------ announcements

    def _subscriber(self) -> None:
        """Fold keys other brokers announce; reconnect with backoff. Every confirmed
        (re)subscription is followed by a key scan: the announcements before it were
        missed (at start: the keys written before this broker came up)."""
        backoff = 0.2
        while not self._stop.is_set():
            ep = (self.router.masters() or self.router.seeds)[0]
            try:
                conn = Connection(ep, dataclasses.replace(self.params, timeout_s=_SUB_POLL_S))
            except (OSError, RespError):
                self.circuit.failure()  # no traffic needed to notice a store that is down
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            self._sub_conn = conn
            try:
                conn.command("SUBSCRIBE", self.channel)
                self.circuit.success()  # ... nor to notice it is back
                if self._loop is not None:
                    with contextlib.suppress(RuntimeError):  # the loop is closing
                        self._loop.call_soon_threadsafe(self._rescan)
                backoff = 0.2
                while not self._stop.is_set():
                    try:
                        msg = conn.read_reply()
                    except TimeoutError:
                        if conn._buf:
                            raise ProtocolViolation("half a message, then silence") from None
                        continue
                    if (
                        isinstance(msg, list)
                        and len(msg) == 3
                        and msg[0] == b"message"
                        and isinstance(msg[2], bytes)
                        and 0 < len(msg[2]) <= 64 * 1024
                    ):
                        key = msg[2].decode("utf-8", "surrogateescape")
                        self._count("remote_announcements")
                        if self._loop is not None:
                            self._loop.call_soon_threadsafe(self._announced, key)
            except (OSError, RespError, ProtocolViolation):
                pass
            finally:
                conn.close()
                self._sub_conn = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _announced(self, key: str) -> None:
        if not self._closing:
            self._learn(key)

    # ------------------------------------------------------------ lookups

    async def lookup(self, keys: Sequence[str]) -> list[EntryMeta | None]:
        # Only keys this broker knows the store holds (written, announced or scanned) are
        # worth a round trip -- unless the known set overflowed remote_filter_keys, in which
        # case every key is asked. An unknown key is answered as a miss at once: exactly
        # what a client's local filter check would have answered (it costs a hit only
        # when an announcement was missed; the next SCAN repairs that).
        ask = list(keys) if not self._complete else [k for k in keys if k in self.known]
        got: list[EntryMeta | None] = []
        if ask:
            if self._closing or not self.circuit.allow():
                raise TierUnavailable("remote store unavailable (circuit open)")
            fut = self._submit(self._lookups, self._lookup_job, ask)
            try:
                got = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except asyncio.TimeoutError:
                raise TierUnavailable(f"remote lookup took longer than {self.timeout_s}s") from None
            except _Unavailable as exc:
                raise TierUnavailable(str(exc)) from None
        answers = dict(zip(ask, got, strict=True))
        out: list[EntryMeta | None] = []
        hits = 0
        for key in keys:
            res = answers.get(key)
            if isinstance(res, EntryMeta):
                self._learn(key)  # before the coordinator can answer a hit for it
                out.append(res)
                hits += 1
            else:
                if key in self.known:
                    self._forget(key)
                out.append(None)
        self._count("remote_hits", hits)
        self._count("remote_misses", len(keys) - hits)
        return out

    def _lookup_job(self, keys: list[str]) -> list[EntryMeta | None]:
        # (node, with ASKING) -> indices of the keys asked there in one pipeline.
        todo: dict[tuple[Endpoint, bool], list[int]] = {}
        rks = [self._rk(k) for k in keys]
        for i, rk in enumerate(rks):
            try:
                ep = self.router.node_for(rk)
            except (OSError, RespError) as exc:
                self.circuit.failure()
                raise _Unavailable(str(exc)) from None
            todo.setdefault((ep, False), []).append(i)
        out: list[EntryMeta | None] = [None] * len(keys)
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
                    if not isinstance(total, int) or total == 0 or not isinstance(head, bytes):
                        continue  # absent (GETRANGE of a missing key is empty)
                    try:
                        h = parse_header(
                            head, keys[i], self.max_entry_bytes, self.hmac_key, total_len=total
                        )
                    except BadValue as exc:
                        self._refused(keys[i], exc)
                        continue
                    out[i] = EntryMeta(h.nbytes, h.dtype, h.shape)
            if not again:
                break
            if any(not asking for _, asking in again):
                with contextlib.suppress(OSError, RespError):
                    self.router.refresh()
            todo = again
        return out

    def _refused(self, key: str, exc: BaseException) -> None:
        self._count("remote_refused_values")
        self._warn("refused", "remote tier: refusing the value of %r: %s", key[:200], exc)

    # ------------------------------------------------------------ promotion

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None]:
        return self._read(key, meta, extents)

    async def _read(self, key: str, meta: EntryMeta, extents: list[Extent]) -> None:
        if self._closing or self._slab is None or not self.circuit.allow():
            raise TierUnavailable("remote store unavailable")
        try:
            await self._submit(self._readers, self._read_job, key, meta, extents)
        except _Unavailable as exc:
            self._count("remote_read_errors")
            raise TierUnavailable(str(exc)) from None
        except BadValue as exc:
            self._refused(key, exc)
            self._forget(key)
            raise TierCorrupt(str(exc)) from None
        except RespError as exc:
            self._count("remote_read_errors")
            raise TierUnavailable(str(exc)) from None

    def _read_job(self, key: str, meta: EntryMeta, extents: list[Extent]) -> None:
        slab = self._slab
        if slab is None:
            raise _Unavailable("shutting down")
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
            self._count("remote_bytes_read", total)

        try:
            self._routed(self._rk(key), get)
        except TierMiss:
            raise
        except RespError as exc:
            raise _Unavailable(str(exc)) from None

    # ------------------------------------------------------------ write-behind

    def write(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None] | None:
        if self._closing or self._slab is None or self._writers is None:
            return None
        if key in self.known or key in self.pending:
            self._count("remote_writes_skipped")
            return None
        if meta.nbytes > self.max_entry_bytes:
            return None
        if (
            len(self.pending) >= self.queue_limit
            or (self.pending_bytes and self.pending_bytes + meta.nbytes > self.max_pending_bytes)
            or not self.circuit.up
        ):
            self._count("remote_write_drops")
            return None
        job = _Write(key, meta.nbytes)
        self.pending[key] = job
        self.pending_bytes += meta.nbytes
        fut = self._submit(self._writers, self._write_job, job, meta, list(extents))
        fut.add_done_callback(lambda f: self._write_done(job, f))
        return fut

    def _write_job(self, job: _Write, meta: EntryMeta, extents: list[Extent]) -> bool:
        """True when this broker stored the value (False: skipped, it was there)."""
        slab = self._slab
        if job.cancelled or slab is None:
            return False
        rk = self._rk(job.key)

        def put(conn: Connection) -> bool:
            if conn.command("EXISTS", rk) == 1:
                return False
            if job.cancelled:
                return False
            algo = default_algo(self.hmac_key)
            with slab.views(extents) as views:
                header = encode_header(
                    job.key,
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
            conn.command("PUBLISH", self.channel, job.key)
            self._count("remote_bytes_written", len(header) + meta.nbytes)
            return True

        try:
            return self._routed(rk, put)
        except (_Unavailable, RespError) as exc:
            self._count("remote_write_errors")
            self._warn("write", "remote tier: writing %r failed: %s", job.key[:200], exc)
            return False

    def _write_done(self, job: _Write, fut: asyncio.Future[bool]) -> None:
        if self.pending.get(job.key) is job:
            del self.pending[job.key]
        self.pending_bytes -= job.nbytes
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                self._count("remote_write_errors")
            return
        stored = fut.result()
        if stored:
            self._count("remote_writes")
        elif not job.cancelled:
            self._count("remote_writes_skipped")
        if not job.cancelled and not self._closing:
            self._learn(job.key)

    # ------------------------------------------------------------ delete / clear

    def delete(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for key in keys:
            job = self.pending.pop(key, None)
            if job is not None:
                job.cancelled = True
            out.append(self._forget(key) or job is not None)
        if not self._closing and self._control is not None:
            fut = self._submit(self._control, self._delete_job, list(keys))
            fut.add_done_callback(_ignore)
        return out

    def _delete_job(self, keys: list[str]) -> None:
        for key in keys:
            rk = self._rk(key)
            with contextlib.suppress(_Unavailable, RespError):
                self._routed(rk, lambda c, rk=rk: c.command("DEL", rk))

    def clear(self) -> int:
        """Forget every key of this key prefix -- in the shared store too: every broker
        configured with the same ``remote_key_prefix`` loses them."""
        n = len(self.known)
        for job in self.pending.values():
            job.cancelled = True
        self.pending.clear()
        for key in list(self.known):
            self._forget(key)
        if not self._closing and self._control is not None:
            fut = self._submit(self._control, self._clear_job)
            fut.add_done_callback(_ignore)
        return n

    def _clear_job(self) -> None:
        found = self._scan_job() or []
        for key in found:
            rk = self._rk(key)
            with contextlib.suppress(_Unavailable, RespError):
                self._routed(rk, lambda c, rk=rk: c.command("DEL", rk))

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self.counters)
        out["remote_up"] = int(self.circuit.up)
        out["remote_known_keys"] = len(self.known)
        out["remote_pending_writes"] = len(self.pending)
        return out

    @classmethod
    def empty_stats(cls) -> dict[str, int | float]:
        return dict.fromkeys((*REMOTE_COUNTERS, *REMOTE_GAUGES), 0)


BACKGROUND_NICE = 10


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: setpriority on the thread id)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE)
        )
    except (OSError, AttributeError):
        pass


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


def _ignore(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
