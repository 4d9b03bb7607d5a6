"""Promotion: copying an entry from a lower tier up into the slab.

A promotion reserves slab blocks on ``TIER_CONN``, lets the source tier fill them
(``read_into``, or ``fetch`` for a remote get no lookup preceded), commits only a
verified copy (otherwise aborts and tries the next tier holding the key), pins
the entry for the gets waiting on it, leases it to every connection that leased
the key and offers it down to the other tiers.

Invariants:
- A promotion commits only after its source tier verified every byte; a deleted
  or cleared key (``Promotion.cancelled``) is never resurrected by a promotion
  that was in flight.
- The promotion's pin is held while a finished promotion still has ``get``s
  waiting to pin the entry themselves (``Promotion.waiters``).
- A failed promotion is counted (``promotion_failures``) and fails the key's
  lower-tier leases (MISS until they end); a fetch that found no value is a miss,
  not a failure.

``Promoter`` owns the promotions in flight; the coordinator hands it the store, the
tier leases, the remote asks, the write-behind, the task set it shares with the
write-behinds, and its counters (``promotions``, ``promotion_failures``,
``tier_unavailable``). ``benchmarks/remote_attribution.py`` times
``Promoter._promote_from`` and ``Promoter._fetch_from`` by patching them on the class.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ..protocol import ErrorReply, Extent, ReserveReply, ReserveStatus
from .remote_asks import RemoteAsks
from .store import Store
from .tier_leases import TierLeases
from .tiers.base import EntryMeta, LowerTier, TierCorrupt, TierMiss, TierUnavailable
from .writebehind import WriteBehind

log = logging.getLogger("lmcache_ec_broker")

TIER_CONN = -1  # the store connection promotions reserve and write-behinds pin with


@dataclass(slots=True, eq=False)
class Promotion:
    key: str
    future: asyncio.Future[bool]
    pin: int = 0
    waiters: int = 0
    cancelled: bool = False  # deleted or cleared meanwhile: do not resurrect it
    missed: bool = False  # a fetch found no value: a miss, not a failed promotion
    # the gets waiting for the end (``Promoter.ended``): one future each, resolved
    # with ``future`` -- awaiting one wakes its get in the next loop iteration, where
    # asyncio.wait on ``future`` takes two; a get cancelled cancels only its own
    listeners: list[asyncio.Future[None]] = field(default_factory=list)


class Promoter:
    def __init__(
        self,
        store: Store,
        leases: TierLeases,
        asks: RemoteAsks,
        writes: WriteBehind,
        tasks: set[asyncio.Future[Any]],
        counters: dict[str, int],
    ) -> None:
        self.store = store
        self.leases = leases
        self.asks = asks
        self.writes = writes
        self.counters = counters  # the coordinator's: the three named in the module doc
        self._tasks = tasks  # shared with the write-behinds: shutdown waits for both
        self.in_flight: dict[str, Promotion] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False  # set at shutdown: nothing more is committed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def promotion(self, key: str, sources: list[tuple[LowerTier, EntryMeta | None]]) -> Promotion:
        """``key``'s promotion in flight, or a new one from ``sources`` (nearest first;
        meta None: a remote get no lookup preceded, fetched)."""
        prom = self.in_flight.get(key)
        if prom is None:
            assert self._loop is not None, "start() first"
            prom = Promotion(key, self._loop.create_future())
            self.in_flight[key] = prom
            task = self._loop.create_task(self._promote(prom, sources))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return prom

    def ended(self, prom: Promotion) -> asyncio.Future[None]:
        """A future of the caller's own, resolved when ``prom`` ends (then
        ``prom.future`` holds its result)."""
        assert self._loop is not None, "start() first"
        waiting: asyncio.Future[None] = self._loop.create_future()
        if prom.future.done():
            waiting.set_result(None)
        else:
            prom.listeners.append(waiting)
        return waiting

    def release(self, prom: Promotion) -> None:
        """Drop the promotion's pin once it is done and every waiting get has pinned."""
        if prom.pin and prom.waiters == 0 and prom.future.done():
            if TIER_CONN in self.store.conns:
                self.store.release(TIER_CONN, [prom.pin])
            prom.pin = 0

    def cancel(self, keys: set[str] | None) -> None:
        """Deleted (``keys``) or cleared (None): promotions in flight must not commit."""
        if keys is None:
            for prom in self.in_flight.values():
                prom.cancelled = True
            return
        for key in keys:
            prom = self.in_flight.get(key)
            if prom is not None:
                prom.cancelled = True

    async def _promote(
        self, prom: Promotion, sources: list[tuple[LowerTier, EntryMeta | None]]
    ) -> None:
        ok: bool | None = False
        try:
            for tier, meta in sources:
                if meta is None:  # a remote get no lookup preceded
                    ok = await self._fetch_from(prom, tier)
                else:
                    ok = await self._promote_from(prom, tier, meta)
                if ok is not False or prom.cancelled:
                    break
        except Exception:
            log.exception("promoting %r failed", prom.key[:200])
            ok = False
        finally:
            del self.in_flight[prom.key]
            if ok is False and not prom.cancelled and not prom.missed:
                self.counters["promotion_failures"] += 1
                self.leases.fail(prom.key)
            prom.future.set_result(bool(ok))
            for waiting in prom.listeners:
                if not waiting.done():
                    waiting.set_result(None)
            prom.listeners.clear()
            self.release(prom)

    def _reserve_for(self, key: str, tier: LowerTier, meta: EntryMeta) -> ReserveReply | None:
        """Reserve the slab range for ``key``'s copy on ``tier``; None: refused (logged)."""
        reply = self.store.reserve(TIER_CONN, key, meta.nbytes, meta.dtype, list(meta.shape))
        if isinstance(reply, ErrorReply):
            log.warning(
                "cannot promote %r from the %s tier: %s", key[:200], tier.name, reply.message
            )
            return None
        return reply

    async def _fetch_from(self, prom: Promotion, tier: Any) -> bool | None:
        """``_promote_from`` for a remote get no lookup preceded: the tier's ``fetch``
        reads the value's header, this reserves the slab range for it (on the loop, in
        the same store round trip) and the payload lands there. Then as a promotion;
        without ``fetch`` here (None), a lookup and then ``_promote_from``."""
        store = self.store
        key = prom.key
        took: dict[str, Any] = {}

        def reserve(meta: EntryMeta) -> list[Extent] | None:
            if prom.cancelled or self.closing or TIER_CONN not in store.conns:
                return None
            reply = self._reserve_for(key, tier, meta)
            if reply is None:
                return None
            took["status"] = reply.status
            if reply.status != ReserveStatus.RESERVED:
                return None  # in the slab already, or a client is writing it
            took["reply"] = reply
            took["meta"] = meta
            return list(reply.extents)

        try:
            done = await tier.fetch(key, reserve)
        except BaseException as exc:
            prom.missed = isinstance(exc, TierMiss)
            if not self._read_failed(exc, took["reply"].token if "reply" in took else None):
                raise
            return False
        if done is None:  # not here: look up, then promote from what the lookup found
            (meta,) = await self.asks.ask(tier, [key])
            if meta is None or prom.cancelled:
                prom.missed = True
                return False
            return await self._promote_from(prom, tier, meta)
        status = took.get("status")
        if status == ReserveStatus.IN_PROGRESS:
            return None
        if status == ReserveStatus.PRESENT:
            return self._promoted(prom, tier, fresh=False)
        if not done or not self._commit_promotion(prom, took["reply"].token):
            return False
        return self._promoted(prom, tier, fresh=True)

    async def _promote_from(self, prom: Promotion, tier: LowerTier, meta: EntryMeta) -> bool | None:
        """True: the entry is in the slab (pinned by the promotion and leased to every
        connection that leased it); False: failed; None: a client is writing it now."""
        reply = self._reserve_for(prom.key, tier, meta)
        if reply is None:
            return False
        if reply.status == ReserveStatus.IN_PROGRESS:
            return None
        fresh = reply.status == ReserveStatus.RESERVED
        if fresh:
            try:
                await tier.read_into(prom.key, meta, list(reply.extents))
            except BaseException as exc:
                if not self._read_failed(exc, reply.token):
                    raise
                return False
            if not self._commit_promotion(prom, reply.token):
                return False
        return self._promoted(prom, tier, fresh=fresh)

    def _read_failed(self, exc: BaseException, token: int | None) -> bool:
        """A promotion's read into its reserved range raised: free the reservation (if
        any). True: an answer the tier may give (not there, corrupt, unavailable), the
        promotion simply fails; False: anything else, for the caller to re-raise."""
        if token is not None and TIER_CONN in self.store.conns:
            self.store.abort(TIER_CONN, token)
        if isinstance(exc, TierUnavailable):
            self.counters["tier_unavailable"] += 1
            return True
        return isinstance(exc, TierMiss | TierCorrupt)

    def _commit_promotion(self, prom: Promotion, token: int) -> bool:
        """Commit the verified copy in reservation ``token``, unless the key was deleted
        or cleared meanwhile or the broker is closing (then abort it)."""
        if prom.cancelled or self.closing:
            self.store.abort(TIER_CONN, token)
            return False
        if self.store.commit(TIER_CONN, token) is not None:
            return False
        self.counters["promotions"] += 1
        return True

    def _promoted(self, prom: Promotion, tier: LowerTier, fresh: bool) -> bool:
        """The promoted entry is READY: pin it for the waiting gets, lease it to every
        connection that leased it, and (``fresh``: this promotion wrote it) offer it to
        the other tiers."""
        store = self.store
        entry = store.ready(prom.key)
        if entry is None:
            return False
        prom.pin = store.pin_entry(TIER_CONN, entry)
        for conn, lease in self.leases.on(prom.key):
            store.lease_entry(conn, prom.key, lease.expires_at)
        if fresh:
            self.writes.offer(entry, skip=tier)
        return True
