"""Open reservations' books: each reservation by token, the blocks they hold
together, and when each client reservation lapses (``reservation_ttl_s``).

``ReservationBooks`` owns this state and nothing else: the store (store.py) indexes
and unindexes the entries, allocates and frees their blocks and charges their
connections (conn_books.py); it opens a reservation here when it grants one and
closes it at the commit or abort.

Invariants (the store's invariant 11; ``check`` asserts the first):
- a reservation is lapsed exactly when it has left the index: ``due`` hands the
  store the reservations whose time is up, and the store unindexes each one it
  marks lapsed; a lapsed reservation stays open here, its blocks counted, until
  its holder commits (refused: ``lapsed_refusal``), aborts or closes;
- ``blocks`` is the blocks of every open reservation, lapsed ones included;
- the broker's own reservations (``expires_at`` 0) never lapse.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from ..protocol import ErrorCode, ErrorReply
from .entries import Entry


class ReservationBooks:
    def __init__(self, ttl_s: float) -> None:
        self.ttl = ttl_s  # a client's reservation lapses this long after it was granted
        self.by_token: dict[int, Entry] = {}
        self.blocks = 0  # blocks of the open reservations (the store's "reserved")
        self._heap: list[tuple[float, int]] = []  # (expires_at, token)

    def __len__(self) -> int:
        return len(self.by_token)

    def open(self, token: int, entry: Entry, nblocks: int, now: float | None) -> None:
        """A reservation granted; ``now``: the clock for a client's (lapses after
        ``ttl``), None for the broker's own (never lapses)."""
        self.by_token[token] = entry
        self.blocks += nblocks
        if now is not None:
            entry.expires_at = now + self.ttl
            heapq.heappush(self._heap, (entry.expires_at, token))

    def close(self, token: int) -> Entry:
        """The reservation ends (committed or aborted): no longer open, its blocks no
        longer counted here."""
        entry = self.by_token.pop(token)
        self.blocks -= sum(length for _, length in entry.runs)
        return entry

    def owned(self, conn: int, token: int) -> Entry | ErrorReply:
        """``conn``'s open reservation ``token``, or the refusal naming why not."""
        entry = self.by_token.get(token)
        if entry is None or entry.owner != conn:
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN,
                f"token {token} is not an open reservation of this connection "
                "(already committed or aborted, or never issued to it)",
            )
        return entry

    def lapsed_refusal(self, entry: Entry, token: int) -> ErrorReply:
        """The answer to the commit of a lapsed reservation (nothing is stored)."""
        return ErrorReply(
            ErrorCode.UNKNOWN_TOKEN,
            f"the reservation of {entry.key!r} (token {token}) expired "
            f"{self.ttl:g} s after it was granted, before this commit "
            "(reservation_ttl_s): nothing was stored; put the entry again, and raise "
            "reservation_ttl_s if copies really take that long",
        )

    def due(self, now: float, most: int) -> list[Entry]:
        """At most ``most`` open, not yet lapsed reservations whose time is up (the
        store lapses each)."""
        heap = self._heap
        out: list[Entry] = []
        while heap and heap[0][0] <= now and len(out) < most:
            _, token = heapq.heappop(heap)
            entry = self.by_token.get(token)
            if entry is None or entry.lapsed:
                continue  # committed or aborted since
            out.append(entry)
        return out

    def lapsed(self) -> int:
        return sum(1 for e in self.by_token.values() if e.lapsed)

    def check(self, index: Mapping[str, Entry]) -> None:
        for entry in self.by_token.values():  # invariant 11
            assert entry.lapsed == (index.get(entry.key) is not entry), "lapse drift"
