"""In-flight deduplication: claiming lookups and waits (the coordinator's part that
owns the claim book, ``claims.py``).

A claiming lookup (``Lookup.claim_ms``) is a lookup whose MISS keys are then either
claimed for the caller (answered MISS: "encode it") or, when another encoder is on
them, answered CLAIMED. "Another encoder" is, per key: a claim of another
connection, a reservation of another connection (a put in progress: the two-phase
put's "in progress by another writer"), or -- with a remote tier that keeps fleet
claims -- a claim of another broker in the shared store.

Rules (the promises; tests/test_claims_machine.py and tests/test_dedup.py):
- **All or nothing per lookup**: if any of its MISS keys is claimed elsewhere, the
  lookup claims none of them (those answer MISS, the claimed ones CLAIMED). So a
  caller that holds claims never waits on someone else's, and no two callers wait
  on each other (a request holding x and waiting on y, while another holds y and
  waits on x, cannot happen); a wait would otherwise only end at its deadline.
- **Own writes never wait**: a key reserved by another connection while the caller
  holds its claim answers MISS to the caller (its TP ranks' puts are its own).
- **Bounded**: a claim lives at most ``claim_ms`` (<= MAX_CLAIM_MS); a wait at most
  its ``wait_ms`` (<= MAX_WAIT_MS), then answers the keys still claimed CLAIMED and
  the caller encodes them. Waits wake on events (a claim or a reservation ending),
  never by polling the node; a key claimed through the fleet is re-asked at most
  every ``FLEET_RECHECK_S`` (no event crosses brokers except the store's
  announcement that the value arrived, which wakes it at once).
- **Never wrong**: claims only turn MISS into CLAIMED (claims.py invariant 4).
- **MISS means "encode it"**: a key that landed in the slab while the lookup waited
  for a remote tier (another encoder's put) is answered READY, leased like any hit,
  not MISS (``_landed_since``); a key whose value reached the store between the
  lookup's value read and its claim read is answered CLAIMED, so a wait asks again
  (the tier's ``claimed_fleet``; a claiming lookup's ``claim_fleet`` checks the same).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..protocol import EntryInfo, LookupState
from .claims import MAX_CLAIM_MS, MAX_WAIT_MS, Claim, ClaimBook, Grant, Waiters
from .promotion import TIER_CONN
from .store import State, Store

if TYPE_CHECKING:
    from .tiers.base import LowerTier

__all__ = ["FLEET_RECHECK_S", "Dedup", "fleet_tier"]

log = logging.getLogger("lmcache_ec_broker")

# How often a wait on a key claimed by another broker asks the store again.
FLEET_RECHECK_S = 0.25

_CLAIMED = EntryInfo(LookupState.CLAIMED)
_MISS = EntryInfo(LookupState.MISS)

Lookup = Callable[[int, list[str], int, int, bool], "list[EntryInfo] | Awaitable[list[EntryInfo]]"]


def fleet_tier(tiers: Sequence[LowerTier]) -> Any | None:
    """The first lower tier that keeps claims fleet-wide (``keeps_fleet_claims``; it then
    has ``claim_fleet(keys, ttl_ms, budget_s) -> Awaitable[list[bool | None]]`` -- True:
    ours, False: another broker's, None: unknown (store down or slow) --,
    ``claimed_fleet(keys, budget_s) -> Awaitable[list[bool]]`` (held by another broker;
    unknown reads False) and ``unclaim_fleet(keys)``, which never waits)."""
    for tier in tiers:
        if getattr(tier, "keeps_fleet_claims", False):
            return tier
    return None


class Dedup:
    def __init__(self, store: Store, lookup: Lookup, fleet: Any | None = None) -> None:
        self.store = store
        self._lookup = lookup
        # the remote tier keeping fleet claims (claim_fleet / unclaim_fleet), or None
        self.fleet = fleet
        self.book = ClaimBook(store.now, on_end=self._ended)
        self.waiters = Waiters()
        # each connection's waits asleep: woken when it closes (nobody reads the answer)
        self._conn_waits: dict[int, set[asyncio.Future[str]]] = {}

    # ------------------------------------------------------------ the key's fate

    def _ended(self, claim: Claim, landed: bool) -> None:
        self.waiters.wake(claim.key)
        if self.fleet is not None and not landed:
            # landed: the fleet claim goes when the write-behind stored the value
            # (the tier's business); otherwise it goes now
            self.fleet.unclaim_fleet([claim.key])

    def landed(self, key: str, written: bool = True) -> None:
        """``key`` is READY in the slab: committed or placed here (``written``: its
        write-behind follows, after which the tier deletes the fleet claim), or found
        present at a reserve (nothing of ours will be written: the fleet claim goes now)."""
        self.book.landed(key)
        self.waiters.wake(key)  # also waiters on a reservation without a claim
        if not written and self.fleet is not None:
            self.fleet.unclaim_fleet([key])

    def failed(self, key: str) -> None:
        """A put of ``key`` aborted (its reservation is gone)."""
        self.book.failed(key)
        self.waiters.wake(key)

    def closed(self, conn: int, reserved: Sequence[str]) -> None:
        """``conn`` closed; ``reserved``: the keys its open reservations held."""
        self.book.drop(conn)
        for key in reserved:
            self.waiters.wake(key)
        for fut in self._conn_waits.pop(conn, ()):
            if not fut.done():
                fut.set_result("")

    def unclaim(self, conn: int, keys: Sequence[str]) -> None:
        self.book.release(conn, keys)

    def expire(self) -> int:
        return self.book.expire()

    # ------------------------------------------------------------ lookups

    def elsewhere(self, conn: int, key: str) -> bool:
        """Is another encoder on ``key`` on this node (its claim, or a put of another
        connection while ``conn`` holds no claim on it)?"""
        claim = self.book.holder(key)
        if claim is not None:
            return claim.conn != conn
        entry = self.store.entries.get(key)
        return entry is not None and entry.state is State.RESERVED and entry.owner != conn

    def _wakes_us(self, conn: int, key: str) -> bool:
        """Will the end of what holds ``key`` wake a wait on it? Yes for a claim of this
        node and a client's put (commit, abort, close are hooked); not for a promotion's
        reservation (``TIER_CONN``: the promoter commits on its own) nor another broker's
        claim -- those waits look again every FLEET_RECHECK_S."""
        claim = self.book.holder(key)
        if claim is not None:
            return claim.conn != conn
        entry = self.store.entries.get(key)
        return (
            entry is not None
            and entry.state is State.RESERVED
            and entry.owner not in (conn, TIER_CONN)
        )

    def lookup(
        self,
        conn: int,
        uid: int,
        keys: list[str],
        lease_ms: int,
        wait_ms: int,
        fresh: bool,
        claim_ms: int,
    ) -> list[EntryInfo] | Awaitable[list[EntryInfo]]:
        started = time.monotonic()
        # With fleet claims a key is asked of the store even before its announcement
        # arrived: another broker's claim may have ended just now with the value written
        # (claiming it again would encode it twice; not waiting would too). Only misses
        # pay it, on the way to an encode or a wait, within the lookup's budget.
        fresh = fresh or self.fleet is not None
        got = self._lookup(conn, keys, lease_ms, wait_ms, fresh)
        if isinstance(got, list):
            return self._claim(conn, uid, keys, got, claim_ms, lease_ms, started, wait_ms)
        return self._claim_after(conn, uid, keys, got, claim_ms, lease_ms, started, wait_ms)

    async def _claim_after(
        self,
        conn: int,
        uid: int,
        keys: list[str],
        pending: Awaitable[list[EntryInfo]],
        claim_ms: int,
        lease_ms: int,
        started: float,
        wait_ms: int,
    ) -> list[EntryInfo]:
        items = await pending
        got = self._claim(conn, uid, keys, items, claim_ms, lease_ms, started, wait_ms)
        return await got if not isinstance(got, list) else got

    def _claim(
        self,
        conn: int,
        uid: int,
        keys: list[str],
        items: list[EntryInfo],
        claim_ms: int,
        lease_ms: int = 0,
        started: float = 0.0,
        wait_ms: int = 0,
    ) -> list[EntryInfo] | Awaitable[list[EntryInfo]]:
        out = list(items)
        if conn not in self.store.conns:
            return out
        self._landed_since(conn, keys, out, lease_ms)
        misses = [i for i, info in enumerate(out) if info.state == LookupState.MISS]
        if not misses:
            return out
        busy = [i for i in misses if self.elsewhere(conn, keys[i])]
        if busy:  # all or nothing: a caller that waits holds no new claims
            for i in busy:
                out[i] = _CLAIMED
            self.book.counters["claims_answered"] += len(busy)
            return out
        if claim_ms <= 0:  # a wait without claim_ms: answers CLAIMED, claims nothing
            if self.fleet is None:
                return out
            return self._fleet_busy(keys, out, misses, started, wait_ms)
        granted: list[str] = []
        for i in misses:
            key = keys[i]
            if self.book.claim(conn, uid, key, claim_ms) is Grant.GRANTED:
                granted.append(key)
        if not granted or self.fleet is None:
            return out
        return self._claim_fleet(conn, keys, out, misses, granted, claim_ms, started, wait_ms)

    def _landed_since(self, conn: int, keys: list[str], out: list[EntryInfo], lease_ms: int) -> None:
        """A MISS whose key is READY in the slab now landed while the lookup waited for
        a remote tier (another encoder's put): answer READY, leased like any hit, not
        MISS -- MISS means "encode it", and nothing would be claimed for it either."""
        landed = [
            i
            for i, info in enumerate(out)
            if info.state == LookupState.MISS and self.store.ready(keys[i]) is not None
        ]
        if not landed:
            return
        again = self._lookup(conn, [keys[i] for i in landed], lease_ms, 0, False)
        # READY in the slab: the coordinator answers at once (no tier is asked)
        if isinstance(again, list):
            for i, info in zip(landed, again, strict=True):
                out[i] = info
        elif inspect.iscoroutine(again):  # evicted meanwhile: MISS stands (ours to encode)
            again.close()

    async def _claim_fleet(
        self,
        conn: int,
        keys: list[str],
        out: list[EntryInfo],
        misses: list[int],
        granted: list[str],
        claim_ms: int,
        started: float,
        wait_ms: int,
    ) -> list[EntryInfo]:
        """Claim ``granted`` in the shared store too, within what is left of the
        lookup's ``wait_ms`` (else the tier's own timeout). A key another broker claimed first
        is answered CLAIMED and, all or nothing, every claim this lookup took is
        released. An answer the store could not give (down, slow: the tier's own
        budget) leaves the node claim alone: the key is encoded here, maybe twice."""
        assert self.fleet is not None
        budget = self._budget_s(started, wait_ms)
        won = await self.fleet.claim_fleet(granted, min(claim_ms, MAX_CLAIM_MS), budget)
        lost = {key for key, ok in zip(granted, won, strict=True) if ok is False}
        if not lost:
            return out
        self.book.release(conn, granted)  # ends the fleet claims we won too (_ended)
        for i in misses:
            if keys[i] in lost:
                out[i] = _CLAIMED
        self.book.counters["claims_answered"] += len(lost)
        return out

    async def _fleet_busy(
        self, keys: list[str], out: list[EntryInfo], misses: list[int], started: float, wait_ms: int
    ) -> list[EntryInfo]:
        """Without claiming: which MISS keys another broker claimed, or whose value
        landed in the store since the lookup read it (CLAIMED: a wait asks again and
        finds it; MISS would mean "encode it")."""
        assert self.fleet is not None
        asked = [keys[i] for i in misses]
        held = await self.fleet.claimed_fleet(asked, self._budget_s(started, wait_ms))
        busy = [i for i, h in zip(misses, held, strict=True) if h]
        for i in busy:
            out[i] = _CLAIMED
        self.book.counters["claims_answered"] += len(busy)
        return out

    @staticmethod
    def _budget_s(started: float, wait_ms: int) -> float:
        """What is left of a lookup's ``wait_ms`` (0: no bound of the caller's own)."""
        if wait_ms <= 0:
            return 0.0
        return max(wait_ms / 1000.0 - (time.monotonic() - started), 0.001)

    # ------------------------------------------------------------ waits

    async def wait_ready(
        self,
        conn: int,
        uid: int,
        keys: list[str],
        wait_ms: int,
        lease_ms: int,
        claim_ms: int,
        fresh: bool,
    ) -> list[EntryInfo]:
        """A claiming lookup (claim_ms may be 0: then no claim is taken) repeated each
        time a claim it found ends, until no key answers CLAIMED or ``wait_ms`` passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait_ms, 0), MAX_WAIT_MS) / 1000.0
        waited = False
        while True:
            if conn not in self.store.conns:  # closed while waiting: nobody reads this
                return [_MISS] * len(keys)
            left_ms = max(int((deadline - loop.time()) * 1000), 1)
            got = self.lookup(conn, uid, keys, lease_ms, left_ms, fresh, claim_ms)
            items = got if isinstance(got, list) else await got
            claimed = [
                k for k, info in zip(keys, items, strict=True) if info.state == _CLAIMED.state
            ]
            left = deadline - loop.time()
            if not claimed or left <= 0 or conn not in self.store.conns:
                if claimed and waited:
                    self.book.counters["claim_waits_timed_out"] += 1
                return items
            if not waited:
                waited = True
                self.book.counters["claim_waits"] += 1
            # a key not claimed on this node is claimed through the fleet: ask again soon,
            # and ask the store itself (fresh): the value may land before its announcement
            local = all(self._wakes_us(conn, k) for k in claimed)
            fresh = fresh or not local
            fut: asyncio.Future[str] = loop.create_future()
            self.waiters.add(claimed, fut)
            mine = self._conn_waits.setdefault(conn, set())
            mine.add(fut)
            try:
                await asyncio.wait({fut}, timeout=left if local else min(left, FLEET_RECHECK_S))
            finally:
                self.waiters.forget(claimed, fut)
                mine.discard(fut)
                if not mine and self._conn_waits.get(conn) is mine:
                    del self._conn_waits[conn]

    def stats(self) -> dict[str, int]:
        out = dict(self.book.counters)
        out["claims_held"] = len(self.book)
        out["claim_waiters"] = len(self.waiters)
        return out
