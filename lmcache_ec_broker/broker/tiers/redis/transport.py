"""The remote tier on Redis / Valkey (standalone or Cluster): the transport.

What is written, in which order, what is known and when the store is left alone
is the remote policy's (``../remote/policy.py``); the transport only moves bytes over
RESP (``resp.py``) and lists keys. This module wires it and holds the threads' calls;
the rest is one module each:

- ``value_rules.py``: the rules a value read back must meet (threads and loop alike).
- ``link.py``: pooled round trips to the server owning a key; Cluster routing
  (slot map, ``-MOVED``/``-ASK``); ``stop`` cuts every connection in use.
- ``loop.py``: the same calls on the broker's event loop.
- ``keys.py``: listing (``SCAN``) and clearing the namespace.
- ``announce.py``: announcements of written keys between brokers.

The calls:

- *lookup*: one pipelined round trip per server for a batch of keys
  (``GETRANGE key 0 <max header>`` + ``STRLEN``); a key is a hit only if its header
  parses and matches the value's length (``../remote/value.py``).
- *read_into* (promotion): ``GET`` streamed straight into the reserved slab extents,
  hashed as it lands; served only after checksum (and HMAC) matched.
- *lookup_on_loop* / *read_on_loop* / *fetch_on_loop*: on the broker's event loop
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

import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ....protocol import Extent
from ....remote_url import mask_url, parse_remote_url, read_hmac_key, resolve_password
from ..base import EntryMeta, SlabAccess, TierError
from ..remote.connect_error import ConnectTrouble
from ..remote.policy import Limits
from ..remote.stats import REMOTE_COUNTERS
from ..remote.tier import BACKGROUND_NICE, Meter, RemoteTier
from ..remote.transport import LookupAnswer, Node, Outcome, StoreDown, WriteItem
from ..remote.value import (
    MAX_HEADER,
    BadValue,
    Verifier,
    checksum,
    default_algo,
    encode_header,
)
from . import claims as fleet_claims
from .announce import Announcements
from .keys import clear, scan
from .link import UNMAPPED, Link, with_asking
from .loop import LoopCalls
from .resp import (
    MAX_REDIRECTS,
    ConnParams,
    Endpoint,
    Pool,
    ProtocolViolation,
    RespConnection,
    RespError,
    Router,
    pack_set,
)
from .resp_async import LoopConnection
from .value_rules import ValueRules

if TYPE_CHECKING:
    from ....config import BrokerConfig

__all__ = ["BACKGROUND_NICE", "UNMAPPED", "RedisTier", "RedisTransport", "ValueRules"]

log = logging.getLogger("lmcache_ec_broker.remote")


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
        self.link = Link(self.pool, self.router, self.prefix, meter, self.trouble)
        self.rules = ValueRules(max_entry_bytes, self.hmac_key)
        self.loop = LoopCalls(self.link, self.rules, self.timeout_s)
        self.announcements = Announcements(self.link, self.params, self.channel)

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
        self.link.stop()

    def close(self) -> None:
        self.link.stopped.set()
        self.pool.close()

    # ------------------------------------------------------------ routing

    def node_of(self, key: str) -> Node:
        return self.link.node_of(key)

    def nodes(self) -> list[Node]:
        return list(self.router.masters())

    # ------------------------------------------------------------ lookups

    def lookup(self, keys: list[str]) -> list[LookupAnswer]:
        link = self.link
        # (node, with ASKING) -> indices of the keys asked there in one pipeline.
        todo: dict[tuple[Endpoint, bool], list[int]] = {}
        rks = [link.rk(k) for k in keys]
        for i, rk in enumerate(rks):
            todo.setdefault((link.node_for(rk), False), []).append(i)
        out: list[LookupAnswer] = [None] * len(keys)
        for hop in range(MAX_REDIRECTS + 1):
            again: dict[tuple[Endpoint, bool], list[int]] = {}
            failed: dict[Endpoint, str] = {}  # nodes whose error replies answered nothing
            for (ep, asking), idx in todo.items():
                cmds: list[list[Any]] = []
                for i in idx:
                    cmds.append(["GETRANGE", rks[i], 0, MAX_HEADER - 1])
                    cmds.append(["STRLEN", rks[i]])

                def ask(c: RespConnection, cmds: list[list[Any]] = cmds) -> list[Any]:
                    return c.pipeline(cmds)

                replies = link.call(ep, with_asking(ask) if asking else ask)
                for j, i in enumerate(idx):
                    head, total = replies[2 * j], replies[2 * j + 1]
                    err = head if isinstance(head, RespError) else total
                    if isinstance(err, RespError):
                        # MOVED / ASK: ask again where the server says (a few hops at most).
                        # Any other error reply (or one redirect too many) is no answer:
                        # the lookup fails (StoreDown: the node's breaker counts it, the
                        # filter is left alone) -- never "absent" (``Link.not_an_answer``;
                        # ``loop.py`` reads it the same). WRONGTYPE refuses the key.
                        redirect = link.redirect_of(err, ep)
                        if redirect is not None and hop < MAX_REDIRECTS:
                            link.note_redirect(redirect)
                            if not redirect.ask:
                                self.router.moved(redirect.slot, redirect.ep)
                            again.setdefault((redirect.ep, redirect.ask), []).append(i)
                            continue
                        verdict = link.not_an_answer(err, ep)
                        if isinstance(verdict, StoreDown):
                            failed.setdefault(ep, str(verdict))
                        else:
                            out[i] = verdict
                        continue
                    out[i] = self.rules.meta(keys[i], head, total)
            if failed:
                raise StoreDown(list(failed), "; ".join(failed.values()))
            if not again:
                break
            if any(not asking for _, asking in again):
                with contextlib.suppress(OSError, RespError):
                    self.router.refresh()
            todo = again
        return out

    # ------------------------------------------------------------ promotion

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess) -> None:
        deadline = time.monotonic() + self.timeout_s * (1 + meta.nbytes / (64 << 20))
        rk = self.link.rk(key)
        rules = self.rules

        def get(conn: RespConnection) -> None:
            conn.send(["GET", rk])
            total = rules.total(key, conn.read_bulk_len())
            fixed = conn.read_exact(rules.fixed_size(total))
            head = rules.header(key, fixed + conn.read_exact(rules.head_rest(fixed, total)), total)
            rules.unchanged(head, meta)
            verifier = Verifier(head)
            with slab.views(extents) as views:
                for view in views:
                    conn.read_into(view, verifier, deadline)
            conn.skip_crlf()
            verifier.finish()
            self.meter.count("remote_bytes_read", total)

        try:
            self.link.routed(rk, get)
        except RespError as exc:  # not a redirect (routed follows those): no answer
            raise self.link.not_an_answer(exc, self.node_of(key)) from None

    # ------------------------------------------------------------ on the event loop

    async def lookup_on_loop(self, keys: list[str]) -> list[LookupAnswer] | None:
        """``lookup`` in one round trip on the loop; None: use ``lookup``."""
        return await self.loop.lookup(keys)

    async def read_on_loop(
        self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess
    ) -> bool:
        """``read_into`` on the loop; False (nothing written): use ``read_into``."""
        return await self.loop.read(key, meta, extents, slab)

    def loop_fetch_conn(self, key: str) -> LoopConnection | None:
        """A connection for ``fetch_on_loop``, or None."""
        return self.loop.fetch_conn(key)

    async def fetch_on_loop(
        self,
        lc: LoopConnection,
        key: str,
        reserve: Callable[[EntryMeta], list[Extent] | None],
        slab: SlabAccess,
    ) -> EntryMeta:
        """Lookup and read of ``key`` in one round trip (``LoopCalls.fetch``)."""
        return await self.loop.fetch(lc, key, reserve, slab)

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
        rk = self.link.rk(item.key)
        meta = item.meta

        def put(conn: RespConnection) -> Outcome:
            if not item.overwrite:
                head, total = conn.pipeline([["GETRANGE", rk, 0, MAX_HEADER - 1], ["STRLEN", rk]])
                for reply in (head, total):
                    if isinstance(reply, RespError):
                        raise reply  # a redirect: routed() follows it
                if isinstance(self.rules.meta(item.key, head, total), EntryMeta):
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

        return self.link.routed(rk, put)

    # ------------------------------------------------------------ delete / clear / list

    def delete(self, key: str) -> None:
        rk = self.link.rk(key)
        try:
            self.link.routed(rk, lambda c: c.command("DEL", rk))
        except RespError as exc:
            raise StoreDown([self.node_of(key)], str(exc)) from None

    def clear(self) -> int:
        """DEL every value of the namespace whose header names the key it is stored
        under: a nested prefix's values (``a:b:x`` under ``a:``) stay."""
        return clear(self.link, self.channel)

    def list_keys(self, limit: int) -> list[str]:
        return scan(self.link, self.channel, limit)

    def probe(self, node: Node) -> None:
        """Ask ``node`` what a lookup asks (``GETRANGE``/``STRLEN`` of a key of the
        namespace): a server that answers PING but not lookups (-CLUSTERDOWN, -LOADING,
        -NOPERM, ...) stays shed. A redirect is an answer: the key's slot is elsewhere."""
        ep = node if isinstance(node, Endpoint) else self.router.seeds[0]
        rk = self.link.rk("")
        cmds: list[list[Any]] = [["GETRANGE", rk, 0, 0], ["STRLEN", rk]]
        try:
            replies = self.link.call(ep, lambda c: c.pipeline(cmds))
        except RespError as exc:
            raise StoreDown([node], str(exc)) from None
        for reply in replies:
            if isinstance(reply, RespError) and self.link.redirect_of(reply, ep) is None:
                verdict = self.link.not_an_answer(reply, node)
                if isinstance(verdict, StoreDown):
                    raise verdict

    # ------------------------------------------------------------ fleet claims

    def claim_keys(self, owner: bytes, keys: list[str], ttl_ms: int) -> list[bool]:
        """In-flight deduplication across brokers (redis/claims.py). Raises StoreDown."""
        return fleet_claims.claim(self.link, owner, keys, ttl_ms)

    def claimed_by_others(self, owner: bytes, keys: list[str]) -> list[bool]:
        return fleet_claims.held_by_others(self.link, owner, keys)

    def unclaim_keys(self, owner: bytes, keys: list[str]) -> None:
        fleet_claims.unclaim(self.link, owner, keys)

    # ------------------------------------------------------------ announcements

    def start_announcements(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None] | None = None,
    ) -> None:
        self.announcements.start(on_keys, on_resync, on_health)


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
