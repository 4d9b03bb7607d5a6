"""Leases on lower-tier copies: which connection leased which key on which tier.

A leased lookup that hits a lower tier holds that tier's copy (``LowerTier.hold``)
until the lease ends (``unlease``, expiry, delete, clear, the connection closing)
or the promotion it protects fails. The slab's own leases are the store's.

Invariant: every ``hold`` is matched by exactly one ``unhold`` (``TierLease.held``
says whether it is still outstanding).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from .tiers.base import LowerTier


@dataclass(slots=True, eq=False)
class TierLease:
    tier: LowerTier
    expires_at: float
    held: bool = True  # tier.hold(key) outstanding
    failed: bool = False  # the promotion failed: answer MISS until the lease ends


class TierLeases:
    def __init__(self) -> None:
        self._by_conn: dict[int, dict[str, TierLease]] = {}
        # (expires_at, conn, key); stale items (the lease ended or was extended) stay
        # until popped.
        self._heap: list[tuple[float, int, str]] = []

    def lease(self, conn: int, key: str, tier: LowerTier, expires_at: float) -> None:
        """Lease ``key`` on ``tier`` to ``conn`` (holding the copy), or extend its lease."""
        leases = self._by_conn.setdefault(conn, {})
        lease = leases.get(key)
        if lease is not None:
            if expires_at > lease.expires_at:
                lease.expires_at = expires_at
                heapq.heappush(self._heap, (expires_at, conn, key))
            return
        tier.hold(key)
        leases[key] = TierLease(tier, expires_at)
        heapq.heappush(self._heap, (expires_at, conn, key))

    def get(self, conn: int, key: str) -> TierLease | None:
        return self._by_conn.get(conn, {}).get(key)

    def on(self, key: str) -> list[tuple[int, TierLease]]:
        """Every connection's lease on ``key``."""
        return [(c, ls[key]) for c, ls in self._by_conn.items() if key in ls]

    def end(self, conn: int, key: str) -> None:
        leases = self._by_conn.get(conn)
        if not leases:
            return
        lease = leases.pop(key, None)
        if not leases:
            del self._by_conn[conn]
        if lease is not None and lease.held:
            lease.held = False
            lease.tier.unhold(key)

    def end_many(self, conn: int, keys: Iterable[str]) -> None:
        if conn in self._by_conn:
            for key in keys:
                self.end(conn, key)

    def drop(self, conn: int) -> None:
        """End every lease ``conn`` holds."""
        for key in list(self._by_conn.get(conn, ())):
            self.end(conn, key)

    def drop_all(self) -> None:
        for conn in list(self._by_conn):
            self.drop(conn)

    def end_keys(self, keys: set[str]) -> None:
        """End every connection's leases on ``keys`` (deleted)."""
        for conn in list(self._by_conn):
            for key in keys & self._by_conn[conn].keys():
                self.end(conn, key)

    def fail(self, key: str) -> None:
        """``key``'s promotion failed: release the tier copies, answer MISS until the
        leases end."""
        for _conn, lease in self.on(key):
            lease.failed = True
            if lease.held:
                lease.held = False
                lease.tier.unhold(key)

    def expire(self, now: float) -> int:
        """End the leases expired by ``now``; how many."""
        expired = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, conn, key = heapq.heappop(heap)
            lease = self.get(conn, key)
            # A lease extended after this heap item was pushed has a later expiry.
            if lease is not None and lease.expires_at <= now:
                self.end(conn, key)
                expired += 1
        return expired

    def held_by(self, conn: int) -> int:
        return len(self._by_conn.get(conn, ()))

    def __len__(self) -> int:
        return sum(len(ls) for ls in self._by_conn.values())
