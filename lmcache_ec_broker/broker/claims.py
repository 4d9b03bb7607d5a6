"""Encode claims: "this connection is encoding key K" (in-flight deduplication).

A client that misses on an item may claim it (``Lookup.claim_ms``): while the
claim lives, another connection's claiming lookup of the same key answers
CLAIMED instead of MISS, and that client waits for the key (``WaitReady``)
instead of encoding it again. The coordinator asks this book and keeps it told
of the key's fate; the book itself is pure state (no I/O, no loop, an injected
clock), so a state machine drives it directly (tests/test_claims_machine.py).

Invariants (``check()`` asserts 1-3):
1. A key has at most one claim, held by one connection; the books ``by_conn`` and
   ``per_uid`` count exactly the claims in ``claims``.
2. A claim ends at the first of: the key lands in the slab (a commit, a placement,
   a reserve that finds it present), a put of it aborts, its holder unclaims it,
   its holder's connection closes (``kill -9`` included), or its deadline -- never
   granted for longer than ``MAX_CLAIM_MS``; ``expire`` ends every claim past it
   and ``holder`` never answers one past it, whether the sweep ran or not.
3. One connection holds at most ``max_per_conn`` claims and one uid at most
   ``max_per_uid``; past either a claim is refused (counted) and the caller
   encodes: a claim is only ever an optimisation, never a condition for an answer.
4. Claims decide only between MISS and CLAIMED; READY and PENDING are the
   store's and the tiers' answers alone, so a claim never makes an answer claim
   data that is absent.
5. Every waiter ends: woken (``Waiters.wake``) when a claim it waits on ends, or
   at its own deadline (``Coordinator.wait_ready``); no loop polls.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CLAIM_COUNTERS", "MAX_CLAIM_MS", "Claim", "ClaimBook", "Grant", "Waiters"]

# The longest a claim lives without its holder's put landing: an encode that takes
# longer than this is duplicated by the waiters (they fall back at their deadline).
MAX_CLAIM_MS = 120_000
# The longest one WaitReady may hold its connection.
MAX_WAIT_MS = 120_000
MAX_CLAIMS_PER_CONN = 1024
MAX_CLAIMS_PER_UID = 8192

CLAIM_COUNTERS = (
    "claims_granted",  # a claiming lookup made this connection the key's encoder
    "claims_refused",  # over a connection's or uid's bound: the caller encodes unclaimed
    "claims_answered",  # a claiming lookup answered CLAIMED (someone else is encoding it)
    "claims_landed",  # ended because the key landed in the slab
    "claims_dropped",  # ended without the key: abort, unclaim, connection closed
    "claims_expired",  # ended at their deadline
    "claim_waits",  # WaitReady requests that waited on at least one claim
    "claim_waits_timed_out",  # ... and answered at their deadline, still CLAIMED
)


class Grant(enum.IntEnum):
    GRANTED = 0  # the caller holds the claim now (a new one, or its own renewed)
    OTHER = 1  # another connection holds it: wait for it
    REFUSED = 2  # over a bound: no claim; the caller encodes


@dataclass(slots=True, eq=False)
class Claim:
    key: str
    conn: int
    uid: int
    expires_at: float


class ClaimBook:
    def __init__(
        self,
        clock: Callable[[], float],
        max_per_conn: int = MAX_CLAIMS_PER_CONN,
        max_per_uid: int = MAX_CLAIMS_PER_UID,
        on_end: Callable[[Claim, bool], None] | None = None,
    ) -> None:
        self.clock = clock
        self.max_per_conn = max_per_conn
        self.max_per_uid = max_per_uid
        # Told of every claim that ends (the claim, whether its key landed), after the
        # book forgot it: the coordinator wakes the key's waiters there.
        self.on_end = on_end
        self.claims: dict[str, Claim] = {}
        self.by_conn: dict[int, set[str]] = {}
        self.per_uid: dict[int, int] = {}
        self._deadlines: list[tuple[float, int, Claim]] = []  # lazy: stale rows skipped
        self._seq = itertools.count()
        self.counters = dict.fromkeys(CLAIM_COUNTERS, 0)

    def __len__(self) -> int:
        return len(self.claims)

    # ------------------------------------------------------------ questions

    def holder(self, key: str) -> Claim | None:
        """The live claim on ``key`` (one past its deadline is ended here)."""
        claim = self.claims.get(key)
        if claim is not None and claim.expires_at <= self.clock():
            self._end(claim, landed=False, counter="claims_expired")
            return None
        return claim

    def held_by(self, conn: int) -> int:
        return len(self.by_conn.get(conn, ()))

    # ------------------------------------------------------------ changes

    def claim(self, conn: int, uid: int, key: str, ttl_ms: int) -> Grant:
        """Claim ``key`` for ``conn`` for ``ttl_ms`` (at most MAX_CLAIM_MS). A claim the
        connection already holds is renewed, never shortened."""
        now = self.clock()
        expires_at = now + min(max(ttl_ms, 1), MAX_CLAIM_MS) / 1000.0
        held = self.holder(key)
        if held is not None:
            if held.conn != conn:
                self.counters["claims_answered"] += 1
                return Grant.OTHER
            if expires_at > held.expires_at:
                held.expires_at = expires_at
                heapq.heappush(self._deadlines, (expires_at, next(self._seq), held))
            return Grant.GRANTED
        if self.held_by(conn) >= self.max_per_conn or self.per_uid.get(uid, 0) >= self.max_per_uid:
            self.counters["claims_refused"] += 1
            return Grant.REFUSED
        claim = Claim(key, conn, uid, expires_at)
        self.claims[key] = claim
        self.by_conn.setdefault(conn, set()).add(key)
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
        heapq.heappush(self._deadlines, (expires_at, next(self._seq), claim))
        self.counters["claims_granted"] += 1
        return Grant.GRANTED

    def landed(self, key: str) -> None:
        """``key`` is READY in the slab: its claim (whoever holds it) is fulfilled."""
        claim = self.claims.get(key)
        if claim is not None:
            self._end(claim, landed=True, counter="claims_landed")

    def failed(self, key: str) -> None:
        """A put of ``key`` aborted: its encoder gave up, so its waiters should not wait."""
        claim = self.claims.get(key)
        if claim is not None:
            self._end(claim, landed=False, counter="claims_dropped")

    def release(self, conn: int, keys: Iterable[str]) -> None:
        """End ``conn``'s own claims on ``keys`` (others' claims are left alone)."""
        for key in keys:
            claim = self.claims.get(key)
            if claim is not None and claim.conn == conn:
                self._end(claim, landed=False, counter="claims_dropped")

    def drop(self, conn: int) -> None:
        """``conn`` closed: every claim it held ends."""
        for key in list(self.by_conn.get(conn, ())):
            self._end(self.claims[key], landed=False, counter="claims_dropped")

    def expire(self) -> int:
        """End every claim past its deadline; returns how many ended."""
        now = self.clock()
        heap = self._deadlines
        n = 0
        while heap and heap[0][0] <= now:
            expires_at, _, claim = heapq.heappop(heap)
            if self.claims.get(claim.key) is claim and claim.expires_at == expires_at:
                self._end(claim, landed=False, counter="claims_expired")
                n += 1
        return n

    def _end(self, claim: Claim, landed: bool, counter: str) -> None:
        del self.claims[claim.key]
        keys = self.by_conn[claim.conn]
        keys.discard(claim.key)
        if not keys:
            del self.by_conn[claim.conn]
        left = self.per_uid[claim.uid] - 1
        if left:
            self.per_uid[claim.uid] = left
        else:
            del self.per_uid[claim.uid]
        self.counters[counter] += 1
        if self.on_end is not None:
            self.on_end(claim, landed)

    # ------------------------------------------------------------ checks

    def check(self) -> None:
        """Assert invariants 1 and 3 (tests call it after every step)."""
        by_conn: dict[int, set[str]] = {}
        per_uid: dict[int, int] = {}
        for key, claim in self.claims.items():
            assert claim.key == key
            by_conn.setdefault(claim.conn, set()).add(key)
            per_uid[claim.uid] = per_uid.get(claim.uid, 0) + 1
        assert by_conn == self.by_conn, (by_conn, self.by_conn)
        assert per_uid == self.per_uid, (per_uid, self.per_uid)
        assert all(len(k) <= self.max_per_conn for k in by_conn.values())
        assert all(n <= self.max_per_uid for n in per_uid.values())
        live = {id(c) for _, _, c in self._deadlines}
        assert all(id(c) in live for c in self.claims.values()), "a claim without a deadline"


class Waiters:
    """Futures waiting for claims on keys to end, woken by ``wake(key)``.

    A future is registered under every key it waits on and resolved (result: the key)
    by the first wake of any of them; its owner ``forget``s it when it stops waiting,
    woken or not, so the book holds no future that nobody awaits."""

    def __init__(self) -> None:
        self.by_key: dict[str, set[asyncio.Future[str]]] = {}

    def __len__(self) -> int:
        """Waiting futures (one per wait, whatever number of keys it waits on)."""
        return len(set().union(*self.by_key.values())) if self.by_key else 0

    def add(self, keys: Iterable[str], fut: asyncio.Future[str]) -> None:
        for key in keys:
            self.by_key.setdefault(key, set()).add(fut)

    def forget(self, keys: Iterable[str], fut: asyncio.Future[str]) -> None:
        for key in keys:
            futs = self.by_key.get(key)
            if futs is not None:
                futs.discard(fut)
                if not futs:
                    del self.by_key[key]

    def wake(self, key: str) -> None:
        for fut in self.by_key.pop(key, ()):
            if not fut.done():
                fut.set_result(key)

    def wake_all(self) -> None:
        for key in list(self.by_key):
            self.wake(key)
