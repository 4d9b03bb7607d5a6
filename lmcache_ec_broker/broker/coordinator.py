"""The tier coordinator: one owner for how the slab and the lower tiers combine.

Order: slab (``store.py``, pure state) -> lower tiers nearest first (local disk,
then remote). The coordinator alone

- answers lookups across tiers (``lookup``/``has``) and gets (``get``), starting
  a promotion at a leased lower-tier hit or a get's miss (here);
- promotes upward: reserves slab blocks, lets the source tier fill them off the
  loop, commits only a verified copy, otherwise aborts (``promotion.py``);
- writes behind downward: every committed client entry, and every promoted one
  to the tiers other than its source, is offered to each lower tier while the
  coordinator pins it (``writebehind.py``);
- keeps leases across tiers: a leased hit on a lower tier holds that tier's copy
  (``LowerTier.hold``) and the promoted slab entry is leased to every connection
  that leased the key, until ``unlease``, expiry or the connection closing
  (``tier_leases.py``);
- asks the remote tiers, dropping answers a delete or shared clear made stale
  (``remote_asks.py``);
- keeps the membership filter: the slab reports its keys through
  ``store.index.membership``, the lower tiers through ``TierEvents`` (``added``/``removed``).

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
import logging
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol import (
    EntryInfo,
    ErrorReply,
    GetReply,
    Hit,
    LookupState,
    ReserveReply,
    ReserveStatus,
)
from .claims import CLAIM_COUNTERS
from .dedup import Dedup, fleet_tier
from .entries import MembershipFilter
from .promotion import TIER_CONN, Promoter, Promotion
from .remote_asks import RemoteAsks
from .store import Entry, Store
from .tier_leases import TierLeases
from .tiers import all_empty_stats
from .tiers.base import EntryMeta, LowerTier, OwnTierEvents, SlabAccess, TierEvents
from .writebehind import WriteBehind

__all__ = ["COORDINATOR_COUNTERS", "TIER_CONN", "Coordinator", "ResidencyObserver"]

log = logging.getLogger("lmcache_ec_broker")

COORDINATOR_COUNTERS = (
    "promotions",
    "promotion_failures",
    "tier_unavailable",
    "remote_lookups_cut_short",
    *CLAIM_COUNTERS,
)


class ResidencyObserver(TierEvents, OwnTierEvents, Protocol):
    """The residency events' tracker, as the coordinator feeds it."""


class Coordinator:
    def __init__(self, store: Store, lower_tiers: Sequence[LowerTier]) -> None:
        self.store = store
        self.lower_tiers = list(lower_tiers)
        self.sync_tiers = [t for t in self.lower_tiers if not t.remote]
        self.remote_tiers = [t for t in self.lower_tiers if t.remote]
        self.membership: MembershipFilter | None = None
        # Residency events (events/ package): sees every lower tier's added/removed,
        # and what this broker itself wrote to or deleted from a shared tier.
        self.observer: ResidencyObserver | None = None
        self.counters = dict.fromkeys(COORDINATOR_COUNTERS, 0)
        self.leases = TierLeases()
        self.asks = RemoteAsks(self.counters)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._tasks: set[asyncio.Future[Any]] = set()  # promotions and write-behinds
        self.writes = WriteBehind(store, self.lower_tiers, TIER_CONN, self._tasks)
        self.promoter = Promoter(
            store, self.leases, self.asks, self.writes, self._tasks, self.counters
        )
        # Encode claims and the waits on them (in-flight deduplication, dedup.py)
        self.dedup = Dedup(store, self.lookup, fleet_tier(self.remote_tiers))

    # ---------------------------------------------------------------- TierEvents

    def added(self, tier: LowerTier, key: str) -> None:
        self.dedup.waiters.wake(key)  # a wait on another broker's encode: it arrived
        if self.membership is not None:
            self.membership.add(key)
            self._sync_partial()
        if self.observer is not None:
            self.observer.added(tier, key)

    def removed(self, tier: LowerTier, key: str) -> None:
        if self.membership is not None:
            # first: a tier forgetting a key it may still hold has just turned partial
            self._sync_partial()
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

    def attach_filter(self, membership: MembershipFilter | None) -> None:
        """Publish (or, with None, stop publishing) every tier's keys in ``membership``."""
        self.membership = membership
        self.store.index.membership = membership
        if membership is not None:
            self._sync_partial()

    def _sync_partial(self) -> None:
        """Invariant (shm/filter.py, "Partial"): while any tier may hold keys it has not
        reported, the filter says so, so that clients ask instead of trusting an
        absence. Kept by checking before every removal (a tier turns partial just
        before it forgets a key it may still hold) and after additions."""
        assert self.membership is not None
        self.membership.set_partial(any(t.filter_partial for t in self.lower_tiers))

    def expected_keys(self) -> int:
        """Keys the membership filter must have room for (slab blocks + lower tiers)."""
        bs = self.store.block_size
        return self.store.nblocks + sum(t.expected_keys(bs) for t in self.lower_tiers)

    def open(self) -> None:
        """Open every lower tier (before serving); on failure close those already open."""
        opened: list[LowerTier] = []
        try:
            for tier in self.lower_tiers:
                opened.append(tier)
                tier.open()
        except BaseException:
            for tier in opened:
                tier.close()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, mm: Any) -> None:
        self._loop = loop
        self.promoter.start(loop)
        self.store.open_connection(TIER_CONN)
        slab = SlabAccess(mm)
        for tier in self.lower_tiers:
            tier.start(loop, slab, self)

    async def shutdown(self, deadline_s: float) -> None:
        """Finish promotions and flush write-behinds, all within ``deadline_s``."""
        self._closing = True
        self.promoter.closing = True
        self.writes.closing = True
        loop = asyncio.get_running_loop()
        end = loop.time() + max(deadline_s, 0.0)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(end - loop.time(), 0.0))
        if self.lower_tiers:
            await asyncio.gather(
                *(t.shutdown(max(end - loop.time(), 0.0)) for t in self.lower_tiers),
                return_exceptions=True,
            )
        self.leases.drop_all()
        self.store.close_connection(TIER_CONN)

    def close(self) -> None:
        for tier in self.lower_tiers:
            try:
                tier.close()
            except Exception:
                log.exception("closing the %s tier failed", tier.name)

    # ---------------------------------------------------------------- connections

    def open_connection(self, conn: int) -> None:
        self.store.open_connection(conn)

    def close_connection(self, conn: int) -> None:
        state = self.store.conns.get(conn)
        reservations = self.store.reservations
        reserved = [reservations[t].key for t in state.reservations] if state else []
        self.store.close_connection(conn)
        self.leases.drop(conn)
        self.dedup.closed(conn, reserved)

    # ---------------------------------------------------------------- leases

    def unlease(self, conn: int, keys: list[str]) -> None:
        """End ``conn``'s leases on ``keys`` on every tier (the load they protected is done)."""
        self.store.unlease(conn, keys)
        self.leases.end_many(conn, keys)

    def expire_leases(self) -> int:
        self.dedup.expire()
        expired = self.store.expire_leases()
        return expired + self.leases.expire(self.store.now())

    def leases_held(self, conn: int) -> int:
        """Leases ``conn`` holds on lower-tier copies (the store counts its own)."""
        return self.leases.held_by(conn)

    # ---------------------------------------------------------------- lookups

    def has(
        self, conn: int, keys: list[str], lease_ms: int, wait_ms: int = 0
    ) -> list[bool] | Awaitable[list[bool]]:
        if not self.lower_tiers:  # the hot path of a slab-only broker: no per-key objects
            return self.store.has(conn, keys, lease_ms)
        got = self.lookup(conn, keys, lease_ms, wait_ms)
        if isinstance(got, list):
            return [i.state != LookupState.MISS for i in got]
        return _as_bools(got)

    def lookup(
        self, conn: int, keys: list[str], lease_ms: int, wait_ms: int = 0, fresh: bool = False
    ) -> list[EntryInfo] | Awaitable[list[EntryInfo]]:
        """Per key: READY (in the slab; leased if ``lease_ms``), PENDING (on a lower
        tier; with a lease its promotion has started and the promoted entry will be
        leased to ``conn``) or MISS. Awaitable only when a remote tier must be asked;
        ``wait_ms > 0`` bounds that wait (``_cut_short``); ``fresh``: the remote tiers
        ask their store also for keys their filters do not know (protocol.Lookup)."""
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
            late = _Late()
            asking = self._lookup_remote(conn, keys, still, out, expires_at, sync_hits, late, fresh)
            if wait_ms <= 0:
                return asking
            return self._cut_short(asking, out, wait_ms / 1000.0, late, sync_hits, len(still))
        self._count_lookup(len(missing) - len(still), len(still))
        return out

    def _count_lookup(self, lower_hits: int, misses: int) -> None:
        self.store.count("has_hits", lower_hits)
        self.store.count("has_misses", misses)

    def _lower_lookup_sync(self, conn: int, key: str, expires_at: float) -> EntryInfo | None:
        """PENDING/MISS info for a key missing from the slab, from in-memory tiers;
        None: no sync tier knows it (ask the remote ones)."""
        lease = self.leases.get(conn, key)
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
            self.leases.lease(conn, key, tier, expires_at)
            self.promoter.promotion(key, [(tier, meta)])
        return EntryInfo(LookupState.PENDING, meta.dtype, list(meta.shape))

    async def _cut_short(
        self,
        asking: Coroutine[Any, Any, list[EntryInfo]],
        out: list[EntryInfo],
        wait_s: float,
        late: _Late,
        sync_hits: int,
        asked: int,
    ) -> list[EntryInfo]:
        """The lookup's answer by ``wait_s``: a caller with a budget (the vLLM scheduler,
        50 ms) must not be held by a slow remote store, or its circuit opens and its
        local hits turn into encodes too. Keys the store has not answered by then are
        answered MISS; their lookup ends in the background, leasing and promoting
        nothing (``late``), so the caller holds nothing it was not told of."""
        assert self._loop is not None
        task = self._loop.create_task(asking)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if done:
            return task.result()
        late.late = True
        self.counters["remote_lookups_cut_short"] += 1
        self._count_lookup(sync_hits, asked)
        # entries still MISS in ``out`` were not answered; those a remote tier answered
        # already were leased (and their promotion started) before the cut
        return list(out)

    async def _lookup_remote(
        self,
        conn: int,
        keys: list[str],
        idx: list[int],
        out: list[EntryInfo],
        expires_at: float,
        found: int,
        late: _Late,
        fresh: bool = False,
    ) -> list[EntryInfo]:
        for tier in self.remote_tiers:
            if not idx:
                break
            metas = await self.asks.ask(tier, [keys[i] for i in idx], fresh)
            if late.late:  # the caller was answered without these keys: no lease, no promotion
                return out
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

    def _touch(self, key: str) -> None:
        for tier in self.lower_tiers:
            tier.touch(key)

    # ---------------------------------------------------------------- get

    def get(self, conn: int, keys: list[str]) -> GetReply | Awaitable[GetReply]:
        store = self.store
        items = store.get(conn, keys, count_misses=False)
        missing: list[int] = []
        waits: dict[str, Promotion] = {}
        remote: list[int] = []
        for i, key in enumerate(keys):
            if items[i] is not None:
                self._touch(key)
                continue
            missing.append(i)
            if key in waits:
                continue
            prom = self.promoter.in_flight.get(key)
            if prom is None and not self._closing:
                sources = self._sync_sources(key)
                if sources:
                    prom = self.promoter.promotion(key, sources)
            if prom is not None:
                waits[key] = prom
            elif self.remote_tiers and not self._closing:
                remote.append(i)
        if not waits and not remote:
            store.count("misses", len(missing))
            return GetReply(items)
        for prom in waits.values():
            prom.waiters += 1
        want = {keys[i] for i in remote}
        if len(want) == 1 and getattr(self.remote_tiers[0], "can_fetch", False):
            # No lookup first: the promotion reads the value and its header says what
            # it is -- one store round trip. Started here, not in _get_promoted's first
            # step: its task runs one loop iteration sooner. (Several keys keep one
            # batched lookup: a fetch each could outrun the tier's lookup limits.)
            (key,) = want
            prom = self.promoter.promotion(key, [(self.remote_tiers[0], None)])
            prom.waiters += 1
            waits[key] = prom
            remote = []
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
        waits: dict[str, Promotion],
        remote: list[int],
    ) -> GetReply:
        try:
            if remote:
                want = list(dict.fromkeys(keys[i] for i in remote))
                for tier in self.remote_tiers:
                    if not want:
                        break
                    metas = await self.asks.ask(tier, want)
                    rest = []
                    for key, meta in zip(want, metas, strict=True):
                        if meta is None:
                            rest.append(key)
                        elif key not in waits:
                            prom = self.promoter.promotion(key, [(tier, meta)])
                            prom.waiters += 1
                            waits[key] = prom
                    want = rest
            for prom in waits.values():
                if not prom.future.done():
                    await self.promoter.ended(prom)
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
                self.promoter.release(prom)
        return GetReply(items)

    # ---------------------------------------------------------------- writes

    def commit(self, conn: int, token: int) -> ErrorReply | None:
        entry = self.store.reservations.get(token)
        err = self.store.commit(conn, token)
        if err is None and entry is not None:
            self.dedup.landed(entry.key)
            self.writes.offer(entry, skip=None)
        return err

    def placed(self, entry: Entry) -> None:
        """An entry stored from a put arena (Store.place): offered down as a commit's is."""
        self.dedup.landed(entry.key)
        self.writes.offer(entry, skip=None)

    def reserve(
        self, conn: int, key: str, nbytes: int, dtype: str, shape: list[int]
    ) -> ReserveReply | ErrorReply:
        """Store.reserve; a key found present fulfils its claim (the claimant's put of an
        entry that landed another way -- a promotion -- commits nothing)."""
        reply = self.store.reserve(conn, key, nbytes, dtype, shape)
        if isinstance(reply, ReserveReply) and reply.status == ReserveStatus.PRESENT:
            self.dedup.landed(key, written=False)
        return reply

    def abort(self, conn: int, token: int) -> ErrorReply | None:
        """Store.abort; the key's claim ends (its encoder gave up) and its waiters wake."""
        entry = self.store.reservations.get(token)
        err = self.store.abort(conn, token)
        if err is None and entry is not None:
            self.dedup.failed(entry.key)
        return err

    def delete(self, keys: list[str]) -> list[bool]:
        deleted = self.store.delete(keys)
        for tier in self.lower_tiers:
            deleted = [a or b for a, b in zip(deleted, tier.delete(keys), strict=True)]
        gone = set(keys)
        self.asks.deleted(gone)
        self.promoter.cancel(gone)
        self.leases.end_keys(gone)  # the store ended its leases on them too
        return deleted

    def clear(self, shared: bool = False) -> None:
        """Empty the slab and the local tiers; remote tiers (a store other brokers
        share) only when ``shared``."""
        self.store.clear()
        for tier in self.lower_tiers:
            if shared or not tier.remote:
                tier.clear()
        if shared:  # the store's copies are gone: answers asked for before are stale
            self.asks.cleared()
        self.promoter.cancel(None)
        self.leases.drop_all()

    # ---------------------------------------------------------------- inspection

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        out.update(all_empty_stats())
        out["tier_leases"] = len(self.leases)
        out["promotions_in_flight"] = len(self.promoter.in_flight)
        out.update(self.dedup.stats())
        for tier in self.lower_tiers:
            out.update(tier.stats())
        return out


_MISS = EntryInfo(LookupState.MISS)


@dataclass(slots=True)
class _Late:
    """Set when a lookup was answered before its remote tier did (``_cut_short``)."""

    late: bool = False


async def _as_bools(pending: Awaitable[list[EntryInfo]]) -> list[bool]:
    return [i.state != LookupState.MISS for i in await pending]


def _succeeded(fut: asyncio.Future[bool]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None and fut.result()
