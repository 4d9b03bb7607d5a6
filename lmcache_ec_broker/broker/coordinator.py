"""The tier coordinator: one owner for how the slab and the lower tiers combine.

Order: slab (``store.py``, pure state) -> lower tiers nearest first (local disk,
then remote). The coordinator alone

- answers lookups across tiers (``lookup``/``has``), starting a promotion at a
  leased lower-tier hit;
- promotes upward: reserves slab blocks, lets the source tier fill them off the
  loop, commits only a verified copy (otherwise aborts);
- writes behind downward: every committed client entry, and every promoted one
  to the tiers other than its source, is offered to each lower tier while the
  coordinator pins it;
- keeps leases across tiers: a leased hit on a lower tier holds that tier's copy
  (``LowerTier.hold``) and the promoted slab entry is leased to every connection
  that leased the key, until ``unlease``, expiry or the connection closing;
- keeps the membership filter: the slab reports its keys through
  ``store.membership``, the lower tiers through ``TierEvents`` (``added``/``removed``).

Invariants:
1. Every ``hold`` on a tier is matched by exactly one ``unhold`` (lease ended,
   expired, failed, or the connection closed).
2. A slab entry is pinned by ``TIER_CONN`` while any tier's write-behind may read
   its extents, and while a finished promotion still has ``get``s waiting to pin it.
3. A promotion commits only after its source tier verified every byte; a deleted
   or cleared key is never resurrected by a promotion that was in flight.
4. A failed promotion is counted (``promotion_failures``); connections that leased
   the key see MISS for it until their lease ends, so no caller waits on it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import EntryInfo, ErrorReply, Extent, GetReply, Hit, LookupState, ReserveStatus
from .store import Entry, Membership, Store
from .tiers import all_empty_stats
from .tiers.base import (
    EntryMeta,
    LowerTier,
    SlabAccess,
    TierCorrupt,
    TierEvents,
    TierMiss,
    TierUnavailable,
)
from .tiers.remote_tier import OwnTierEvents

log = logging.getLogger("lmcache_ec_broker")

TIER_CONN = -1  # the store connection promotions reserve and write-behinds pin with
COORDINATOR_COUNTERS = ("promotions", "promotion_failures", "tier_unavailable")


@dataclass(slots=True, eq=False)
class _Promotion:
    key: str
    future: asyncio.Future[bool]
    pin: int = 0
    waiters: int = 0
    cancelled: bool = False  # deleted or cleared meanwhile: do not resurrect it
    missed: bool = False  # a fetch found no value: a miss, not a failed promotion


@dataclass(slots=True, eq=False)
class _Asking:
    """A remote lookup in flight: what was deleted or cleared meanwhile."""

    gone: set[str] = field(default_factory=set)
    cleared: bool = False


@dataclass(slots=True, eq=False)
class _TierLease:
    tier: LowerTier
    expires_at: float
    held: bool = True  # tier.hold(key) outstanding
    failed: bool = False  # the promotion failed: answer MISS until the lease ends


@dataclass(slots=True)
class _Candidates:
    """Lower tiers holding a key, nearest first."""

    sources: list[tuple[LowerTier, EntryMeta]] = field(default_factory=list)


class ResidencyObserver(TierEvents, OwnTierEvents, Protocol):
    """The residency events' tracker, as the coordinator feeds it."""


class Coordinator:
    def __init__(self, store: Store, tiers: Sequence[LowerTier]) -> None:
        self.store = store
        self.tiers = list(tiers)
        self.sync_tiers = [t for t in self.tiers if not t.remote]
        self.remote_tiers = [t for t in self.tiers if t.remote]
        self.membership: Membership | None = None
        # Residency events (events/ package): sees every lower tier's added/removed,
        # and what this broker itself wrote to or deleted from a shared tier.
        self.observer: ResidencyObserver | None = None
        self.counters = dict.fromkeys(COORDINATOR_COUNTERS, 0)
        self._promoting: dict[str, _Promotion] = {}
        self._leases: dict[int, dict[str, _TierLease]] = {}
        self._lease_heap: list[tuple[float, int, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._asking: set[_Asking] = set()  # remote lookups in flight
        self._tasks: set[asyncio.Future[Any]] = set()

    # ---------------------------------------------------------------- TierEvents

    def added(self, tier: LowerTier, key: str) -> None:
        if self.membership is not None:
            self.membership.add(key)
        if self.observer is not None:
            self.observer.added(tier, key)

    def removed(self, tier: LowerTier, key: str) -> None:
        if self.membership is not None:
            self.membership.remove(key)
        if self.observer is not None:
            self.observer.removed(tier, key)

    # ------------------------------------------------ OwnTierEvents (shared tiers)

    def own_stored(self, tier: LowerTier, key: str, nbytes: int) -> None:
        if self.observer is not None:
            self.observer.own_stored(tier, key, nbytes)

    def own_deleted(self, tier: LowerTier, key: str) -> None:
        if self.observer is not None:
            self.observer.own_deleted(tier, key)

    def own_cleared(self, tier: LowerTier) -> None:
        if self.observer is not None:
            self.observer.own_cleared(tier)

    # ---------------------------------------------------------------- lifecycle

    def attach_filter(self, membership: Membership | None) -> None:
        """Publish (or, with None, stop publishing) every tier's keys in ``membership``."""
        self.membership = membership
        self.store.membership = membership

    def expected_keys(self) -> int:
        """Keys the membership filter must have room for (slab blocks + lower tiers)."""
        bs = self.store.block_size
        return self.store.nblocks + sum(t.expected_keys(bs) for t in self.tiers)

    def open(self) -> None:
        """Open every lower tier (before serving); on failure close those already open."""
        opened: list[LowerTier] = []
        try:
            for tier in self.tiers:
                opened.append(tier)
                tier.open()
        except BaseException:
            for tier in opened:
                tier.close()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, mm: Any) -> None:
        self._loop = loop
        self.store.open_connection(TIER_CONN)
        slab = SlabAccess(mm)
        for tier in self.tiers:
            tier.start(loop, slab, self)

    async def shutdown(self, deadline_s: float) -> None:
        """Finish promotions and flush write-behinds, all within ``deadline_s``."""
        self._closing = True
        loop = asyncio.get_running_loop()
        end = loop.time() + max(deadline_s, 0.0)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(end - loop.time(), 0.0))
        if self.tiers:
            await asyncio.gather(
                *(t.shutdown(max(end - loop.time(), 0.0)) for t in self.tiers),
                return_exceptions=True,
            )
        for conn in list(self._leases):
            self._drop_leases(conn)
        self.store.close_connection(TIER_CONN)

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("closing the %s tier failed", tier.name)

    # ---------------------------------------------------------------- connections

    def open_connection(self, conn: int) -> None:
        self.store.open_connection(conn)

    def close_connection(self, conn: int) -> None:
        self.store.close_connection(conn)
        self._drop_leases(conn)

    # ---------------------------------------------------------------- leases

    def _lease_lower(self, conn: int, key: str, tier: LowerTier, expires_at: float) -> None:
        leases = self._leases.setdefault(conn, {})
        lease = leases.get(key)
        if lease is not None:
            if expires_at > lease.expires_at:
                lease.expires_at = expires_at
                heapq.heappush(self._lease_heap, (expires_at, conn, key))
            return
        tier.hold(key)
        leases[key] = _TierLease(tier, expires_at)
        heapq.heappush(self._lease_heap, (expires_at, conn, key))

    def _end_lease(self, conn: int, key: str) -> None:
        leases = self._leases.get(conn)
        if not leases:
            return
        lease = leases.pop(key, None)
        if not leases:
            del self._leases[conn]
        if lease is not None and lease.held:
            lease.held = False
            lease.tier.unhold(key)

    def _drop_leases(self, conn: int) -> None:
        for key in list(self._leases.get(conn, ())):
            self._end_lease(conn, key)

    def unlease(self, conn: int, keys: list[str]) -> None:
        """End ``conn``'s leases on ``keys`` on every tier (the load they protected is done)."""
        self.store.unlease(conn, keys)
        if conn in self._leases:
            for key in keys:
                self._end_lease(conn, key)

    def expire_leases(self) -> int:
        expired = self.store.expire_leases()
        now = self.store.now()
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, conn, key = heapq.heappop(heap)
            lease = self._leases.get(conn, {}).get(key)
            # A lease extended after this heap item was pushed has a later expiry.
            if lease is not None and lease.expires_at <= now:
                self._end_lease(conn, key)
                expired += 1
        return expired

    def _leases_on(self, key: str) -> list[tuple[int, _TierLease]]:
        return [(c, ls[key]) for c, ls in self._leases.items() if key in ls]

    # ---------------------------------------------------------------- lookups

    def has(self, conn: int, keys: list[str], lease_ms: int) -> list[bool] | Awaitable[list[bool]]:
        if not self.tiers:  # the hot path of a slab-only broker: no per-key objects
            return self.store.has(conn, keys, lease_ms)
        got = self.lookup(conn, keys, lease_ms)
        if isinstance(got, list):
            return [i.state != LookupState.MISS for i in got]
        return _as_bools(got)

    def lookup(
        self, conn: int, keys: list[str], lease_ms: int
    ) -> list[EntryInfo] | Awaitable[list[EntryInfo]]:
        """Per key: READY (in the slab; leased if ``lease_ms``), PENDING (on a lower
        tier; with a lease its promotion has started and the promoted entry will be
        leased to ``conn``) or MISS. Awaitable only when a remote tier must be asked."""
        store = self.store
        hits = store.has(conn, keys, lease_ms, count_misses=False)
        out: list[EntryInfo] = [_MISS] * len(keys)
        missing: list[int] = []
        for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
            if hit:
                e = store.entries[key]
                out[i] = EntryInfo(LookupState.READY, e.dtype, list(e.shape))
                self._touch(key)
            else:
                missing.append(i)
        if not missing:
            return out
        expires_at = store.now() + lease_ms / 1000.0 if lease_ms > 0 else 0.0
        still: list[int] = []
        for i in missing:
            info = self._lower_lookup_sync(conn, keys[i], expires_at)
            if info is None:
                still.append(i)
            else:
                out[i] = info
        if still and self.remote_tiers and not self._closing:
            sync_hits = len(missing) - len(still)
            return self._lookup_remote(conn, keys, still, out, expires_at, sync_hits)
        self._count_lookup(len(missing) - len(still), len(still))
        return out

    def _count_lookup(self, lower_hits: int, misses: int) -> None:
        self.store.count("has_hits", lower_hits)
        self.store.count("has_misses", misses)

    def _lower_lookup_sync(self, conn: int, key: str, expires_at: float) -> EntryInfo | None:
        """PENDING/MISS info for a key missing from the slab, from in-memory tiers;
        None: no sync tier knows it (ask the remote ones)."""
        lease = self._leases.get(conn, {}).get(key)
        if lease is not None and lease.failed:
            return _MISS
        for tier in self.sync_tiers:
            meta = tier.peek([key])
            if meta is not None and meta[0] is not None:
                return self._lower_hit(conn, key, tier, meta[0], expires_at)
        return None

    def _lower_hit(
        self, conn: int, key: str, tier: LowerTier, meta: EntryMeta, expires_at: float
    ) -> EntryInfo:
        tier.touch(key)
        if expires_at and conn in self.store.conns and not self._closing:
            self._lease_lower(conn, key, tier, expires_at)
            self._promotion(key, [(tier, meta)])
        return EntryInfo(LookupState.PENDING, meta.dtype, list(meta.shape))

    async def _lookup_remote(
        self,
        conn: int,
        keys: list[str],
        idx: list[int],
        out: list[EntryInfo],
        expires_at: float,
        found: int,
    ) -> list[EntryInfo]:
        for tier in self.remote_tiers:
            if not idx:
                break
            metas = await self._remote_lookup(tier, [keys[i] for i in idx])
            rest: list[int] = []
            for i, meta in zip(idx, metas, strict=True):
                if meta is None:
                    rest.append(i)
                    continue
                ready = self.store.ready(keys[i])
                if ready is not None:  # landed meanwhile (another client's promotion or put)
                    out[i] = EntryInfo(LookupState.READY, ready.dtype, list(ready.shape))
                    if expires_at and conn in self.store.conns:
                        self.store.lease_entry(conn, keys[i], expires_at)
                else:
                    out[i] = self._lower_hit(conn, keys[i], tier, meta, expires_at)
                found += 1
            idx = rest
        self._count_lookup(found, len(idx))
        return out

    async def _remote_lookup(self, tier: LowerTier, keys: list[str]) -> list[EntryMeta | None]:
        # Invariant 3 for promotions not started yet: a key deleted (or a clear) while
        # the tier was being asked is a miss -- its answer predates the delete.
        asking = _Asking()
        self._asking.add(asking)
        try:
            metas = await tier.lookup(keys)
        except TierUnavailable:
            self.counters["tier_unavailable"] += 1
            return [None] * len(keys)
        except Exception:
            log.exception("the %s tier failed a lookup", tier.name)
            return [None] * len(keys)
        finally:
            self._asking.discard(asking)
        if len(metas) != len(keys):
            log.error("the %s tier answered %d of %d keys", tier.name, len(metas), len(keys))
            return [None] * len(keys)
        if asking.cleared:
            return [None] * len(keys)
        return [None if k in asking.gone else m for k, m in zip(keys, metas, strict=True)]

    def _touch(self, key: str) -> None:
        for tier in self.tiers:
            tier.touch(key)

    # ---------------------------------------------------------------- get

    def get(self, conn: int, keys: list[str]) -> GetReply | Awaitable[GetReply]:
        store = self.store
        items = store.get(conn, keys, count_misses=False)
        missing: list[int] = []
        waits: dict[str, _Promotion] = {}
        remote: list[int] = []
        for i, key in enumerate(keys):
            if items[i] is not None:
                self._touch(key)
                continue
            missing.append(i)
            if key in waits:
                continue
            prom = self._promoting.get(key)
            if prom is None and not self._closing:
                sources = self._sync_sources(key)
                if sources:
                    prom = self._promotion(key, sources)
            if prom is not None:
                waits[key] = prom
            elif self.remote_tiers and not self._closing:
                remote.append(i)
        if not waits and not remote:
            store.count("misses", len(missing))
            return GetReply(items)
        for prom in waits.values():
            prom.waiters += 1
        return self._get_promoted(conn, keys, items, missing, waits, remote)

    def _sync_sources(self, key: str) -> list[tuple[LowerTier, EntryMeta]]:
        sources: list[tuple[LowerTier, EntryMeta]] = []
        for tier in self.sync_tiers:
            meta = tier.peek([key])
            if meta is not None and meta[0] is not None:
                tier.touch(key)
                sources.append((tier, meta[0]))
        return sources

    async def _get_promoted(
        self,
        conn: int,
        keys: list[str],
        items: list[Hit | None],
        missing: list[int],
        waits: dict[str, _Promotion],
        remote: list[int],
    ) -> GetReply:
        try:
            if remote:
                want = list(dict.fromkeys(keys[i] for i in remote))
                fetcher = self.remote_tiers[0]
                if len(want) == 1 and getattr(fetcher, "can_fetch", False):
                    # No lookup first: the promotion reads the value and its header says
                    # what it is -- one store round trip. (Several keys keep one batched
                    # lookup: a fetch each could outrun the tier's lookup limits.)
                    for key in want:
                        if key not in waits:
                            prom = self._promotion(key, [(fetcher, None)])
                            prom.waiters += 1
                            waits[key] = prom
                    want = []
                for tier in self.remote_tiers:
                    if not want:
                        break
                    metas = await self._remote_lookup(tier, want)
                    rest = []
                    for key, meta in zip(want, metas, strict=True):
                        if meta is None:
                            rest.append(key)
                        elif key not in waits:
                            prom = self._promotion(key, [(tier, meta)])
                            prom.waiters += 1
                            waits[key] = prom
                    want = rest
            if waits:
                await asyncio.wait([p.future for p in waits.values()])
            ok = [i for i in missing if keys[i] in waits and _succeeded(waits[keys[i]].future)]
            if conn not in self.store.conns:
                ok = []  # the client left meanwhile: nothing to pin for it
            self.store.count("misses", len(missing) - len(ok))
            if ok:
                hits = self.store.get(conn, [keys[i] for i in ok])  # counts hits (or misses)
                for i, hit in zip(ok, hits, strict=True):
                    items[i] = hit
        finally:
            for prom in waits.values():
                prom.waiters -= 1
                self._release_promotion(prom)
        return GetReply(items)

    # ---------------------------------------------------------------- promotion

    def _promotion(
        self, key: str, sources: list[tuple[LowerTier, EntryMeta | None]]
    ) -> _Promotion:
        prom = self._promoting.get(key)
        if prom is None:
            assert self._loop is not None, "start() first"
            prom = _Promotion(key, self._loop.create_future())
            self._promoting[key] = prom
            task = self._loop.create_task(self._promote(prom, sources))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return prom

    def _release_promotion(self, prom: _Promotion) -> None:
        """Drop the promotion's pin once it is done and every waiting get has pinned."""
        if prom.pin and prom.waiters == 0 and prom.future.done():
            if TIER_CONN in self.store.conns:
                self.store.release(TIER_CONN, [prom.pin])
            prom.pin = 0

    async def _promote(
        self, prom: _Promotion, sources: list[tuple[LowerTier, EntryMeta | None]]
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
            del self._promoting[prom.key]
            if ok is False and not prom.cancelled and not prom.missed:
                self.counters["promotion_failures"] += 1
                for _conn, lease in self._leases_on(prom.key):
                    lease.failed = True
                    if lease.held:
                        lease.held = False
                        lease.tier.unhold(prom.key)
            prom.future.set_result(bool(ok))
            self._release_promotion(prom)

    async def _fetch_from(self, prom: _Promotion, tier: Any) -> bool | None:
        """``_promote_from`` for a remote get no lookup preceded: the tier's ``fetch``
        reads the value's header, this reserves the slab range for it (on the loop, in
        the same store round trip) and the payload lands there. Then as a promotion;
        without ``fetch`` here (None), a lookup and then ``_promote_from``."""
        store = self.store
        key = prom.key
        took: dict[str, Any] = {}

        def reserve(meta: EntryMeta) -> list[Extent] | None:
            if prom.cancelled or self._closing or TIER_CONN not in store.conns:
                return None
            reply = store.reserve(TIER_CONN, key, meta.nbytes, meta.dtype, list(meta.shape))
            if isinstance(reply, ErrorReply):
                log.warning("cannot promote %r from the %s tier: %s", key[:200], tier.name,
                            reply.message)  # fmt: skip
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
            (meta,) = await self._remote_lookup(tier, [key])
            if meta is None or prom.cancelled:
                prom.missed = True
                return False
            return await self._promote_from(prom, tier, meta)
        status = took.get("status")
        if status == ReserveStatus.IN_PROGRESS:
            return None
        if status == ReserveStatus.PRESENT:
            return self._promoted(prom, tier, fresh=False)
        if not done:
            return False
        reply = took["reply"]
        if prom.cancelled or self._closing:
            store.abort(TIER_CONN, reply.token)
            return False
        if store.commit(TIER_CONN, reply.token) is not None:
            return False
        self.counters["promotions"] += 1
        return self._promoted(prom, tier, fresh=True)

    def _promoted(self, prom: _Promotion, tier: LowerTier, fresh: bool) -> bool:
        """The promoted entry is READY: pin it for the waiting gets, lease it to every
        connection that leased it, and (``fresh``: this promotion wrote it) offer it to
        the other tiers."""
        store = self.store
        entry = store.ready(prom.key)
        if entry is None:
            return False
        prom.pin = store.pin_entry(TIER_CONN, entry)
        for conn, lease in self._leases_on(prom.key):
            store.lease_entry(conn, prom.key, lease.expires_at)
        if fresh:
            self._write_down(entry, skip=tier)
        return True

    async def _promote_from(
        self, prom: _Promotion, tier: LowerTier, meta: EntryMeta
    ) -> bool | None:
        """True: the entry is in the slab (pinned by the promotion and leased to every
        connection that leased it); False: failed; None: a client is writing it now."""
        store = self.store
        key = prom.key
        reply = store.reserve(TIER_CONN, key, meta.nbytes, meta.dtype, list(meta.shape))
        if isinstance(reply, ErrorReply):
            log.warning(
                "cannot promote %r from the %s tier: %s", key[:200], tier.name, reply.message
            )
            return False
        if reply.status == ReserveStatus.IN_PROGRESS:
            return None
        if reply.status == ReserveStatus.RESERVED:
            try:
                await tier.read_into(key, meta, list(reply.extents))
            except BaseException as exc:
                if not self._read_failed(exc, reply.token):
                    raise
                return False
            if prom.cancelled or self._closing:
                store.abort(TIER_CONN, reply.token)
                return False
            if store.commit(TIER_CONN, reply.token) is not None:
                return False
            self.counters["promotions"] += 1
        entry = store.ready(key)
        if entry is None:
            return False
        prom.pin = store.pin_entry(TIER_CONN, entry)
        for conn, lease in self._leases_on(key):
            store.lease_entry(conn, key, lease.expires_at)
        if reply.status == ReserveStatus.RESERVED:
            self._write_down(entry, skip=tier)
        return True

    # ---------------------------------------------------------------- writes

    def commit(self, conn: int, token: int) -> ErrorReply | None:
        entry = self.store.reservations.get(token)
        err = self.store.commit(conn, token)
        if err is None and entry is not None:
            self._write_down(entry, skip=None)
        return err

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

    def placed(self, entry: Entry) -> None:
        """An entry stored from a put arena (Store.place): offered down as a commit's is."""
        self._write_down(entry, skip=None)

    def _write_down(self, entry: Entry, skip: LowerTier | None) -> None:
        """Offer a READY slab entry to every lower tier but ``skip`` (its source)."""
        if not self.tiers or self._closing:
            return
        meta = EntryMeta(entry.nbytes, entry.dtype, tuple(entry.shape))
        for tier in self.tiers:
            if tier is skip:
                continue
            try:
                pending = tier.write(entry.key, meta, list(entry.extents))
            except Exception:
                log.exception("the %s tier failed to queue a write", tier.name)
                continue
            if pending is None:
                continue
            pin = self.store.pin_entry(TIER_CONN, entry)
            fut = asyncio.ensure_future(pending)
            self._tasks.add(fut)
            fut.add_done_callback(lambda f, pin=pin, tier=tier: self._write_done(f, pin, tier))

    def _write_done(self, fut: asyncio.Future[Any], pin: int, tier: LowerTier) -> None:
        self._tasks.discard(fut)
        if TIER_CONN in self.store.conns:
            self.store.release(TIER_CONN, [pin])
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("the %s tier's write failed: %s", tier.name, fut.exception())

    def delete(self, keys: list[str]) -> list[bool]:
        deleted = self.store.delete(keys)
        for tier in self.tiers:
            deleted = [a or b for a, b in zip(deleted, tier.delete(keys), strict=True)]
        gone = set(keys)
        for asking in self._asking:
            asking.gone |= gone
        for key in gone:
            prom = self._promoting.get(key)
            if prom is not None:
                prom.cancelled = True
        for conn in list(self._leases):  # the store ended its leases on them too
            for key in gone & self._leases[conn].keys():
                self._end_lease(conn, key)
        return deleted

    def clear(self, shared: bool = False) -> None:
        """Empty the slab and the local tiers; remote tiers (a store other brokers
        share) only when ``shared``."""
        self.store.clear()
        for tier in self.tiers:
            if shared or not tier.remote:
                tier.clear()
        if shared:  # the store's copies are gone: answers asked for before are stale
            for asking in self._asking:
                asking.cleared = True
        for prom in self._promoting.values():
            prom.cancelled = True
        for conn in list(self._leases):
            self._drop_leases(conn)

    def leases_held(self, conn: int) -> int:
        """Leases ``conn`` holds on lower-tier copies (the store counts its own)."""
        return len(self._leases.get(conn, ()))

    # ---------------------------------------------------------------- inspection

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        out.update(all_empty_stats())
        out["tier_leases"] = sum(len(ls) for ls in self._leases.values())
        out["promotions_in_flight"] = len(self._promoting)
        for tier in self.tiers:
            out.update(tier.stats())
        return out


_MISS = EntryInfo(LookupState.MISS)


async def _as_bools(pending: Awaitable[list[EntryInfo]]) -> list[bool]:
    return [i.state != LookupState.MISS for i in await pending]


def _succeeded(fut: asyncio.Future[bool]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None and fut.result()
