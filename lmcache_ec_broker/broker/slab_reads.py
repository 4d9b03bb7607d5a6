"""What the slab answers its readers, and how their reads are counted: ``get``
(pins), ``has`` (leases), the broker-internal pins and leases, and ``served`` (the
reads a client answered from the residency index itself).

``SlabReads`` owns no records: it is handed the store's index (entry_index.py),
whose READY entries are all a reader may see (store.py invariant 3), and the
connection books (conn_books.py), which own the pins and leases it takes; it counts
hits, misses, has_hits, has_misses and bytes_loaded among the store's counters.

Invariant (``served``): nothing a client reports is counted beyond what the broker
can verify -- a key counts only while its entry is READY, with at most that entry's
bytes; has() hits (no keys named) at most ``SERVED_HAS_HITS_MAX`` per frame.
"""

from __future__ import annotations

from collections.abc import Callable

from ..protocol import Hit
from .conn_books import ConnBooks
from .entries import Entry, State
from .entry_index import EntryIndex

# has() hits a client answered from the residency index name no key, so the broker
# cannot verify them: one Served frame counts at most this many (BrokerClient sends
# one every 64 served items; connector/client/index_path.py).
SERVED_HAS_HITS_MAX = 1024


class SlabReads:
    def __init__(
        self,
        index: EntryIndex,
        books: ConnBooks,
        counters: dict[str, int],
        clock: Callable[[], float],
    ) -> None:
        self._index = index  # the store's: read and touched, never changed here
        self._books = books  # the store's: the pins and leases taken here are its
        self.counters = counters  # the store's
        self._clock = clock

    def get(self, conn: int, keys: list[str], count_misses: bool = True) -> list[Hit | None]:
        """Pin and return each READY key. ``count_misses=False``: the caller (the tier
        coordinator, which may still promote a missing key) counts the misses itself."""
        out: list[Hit | None] = []
        for key in keys:
            entry = self._index.ready(key)
            if entry is None:
                if count_misses:
                    self.counters["misses"] += 1
                out.append(None)
                continue
            self.counters["hits"] += 1
            self.counters["bytes_loaded"] += entry.nbytes
            self._index.touch(key)
            pin_id = self._books.pin(conn, entry)
            out.append(Hit(pin_id, entry.nbytes, entry.dtype, entry.shape, entry.extents))
        return out

    def has(
        self, conn: int, keys: list[str], lease_ms: int = 0, count_misses: bool = True
    ) -> list[bool]:
        """Whether each key is READY; ``lease_ms``: lease each hit to ``conn`` that long."""
        hits: list[bool] = []
        now = self._clock() if lease_ms > 0 else 0.0
        for key in keys:
            entry = self._index.ready(key)
            hits.append(entry is not None)
            if entry is None:
                if count_misses:
                    self.counters["has_misses"] += 1
                continue
            self.counters["has_hits"] += 1
            if lease_ms > 0:
                self._books.lease(conn, entry, now + lease_ms / 1000.0)
        return hits

    def served(self, keys: list[str], nbytes: list[int], has_hits: int) -> None:
        """Count what a client answered from the residency index, as a Get or Has would
        have: a hit and its bytes per copied key, and touch the ones still present in
        the LRU (an entry read often must not be evicted because its reads were local).
        Only what the broker can verify counts (module doc)."""
        counters = self.counters
        counters["has_hits"] += min(max(0, has_hits), SERVED_HAS_HITS_MAX)
        ready, touch = self._index.ready, self._index.touch
        hits = loaded = 0
        for i, key in enumerate(keys):
            entry = ready(key)
            if entry is None:
                continue
            hits += 1
            if i < len(nbytes):
                loaded += min(max(0, nbytes[i]), entry.nbytes)
            touch(key)
        counters["hits"] += hits
        counters["bytes_loaded"] += loaded

    def pin_entry(self, conn: int, entry: Entry) -> int:
        """Pin a READY entry for a broker-internal reader (a tier's write-behind)
        without counting a hit; undone by ``release(conn, [pin])`` or ``close_connection``."""
        assert entry.state is State.READY and not entry.doomed
        return self._books.pin(conn, entry)

    def lease_entry(self, conn: int, key: str, expires_at: float) -> bool:
        """Lease the READY ``key`` to ``conn`` until ``expires_at`` (clock time) without
        counting a hit: a promoted entry landing for a connection that leased it on a
        lower tier. False if the key is not READY or the connection is gone."""
        entry = self._index.ready(key)
        if entry is None or conn not in self._books.conns:
            return False
        self._books.lease(conn, entry, expires_at)
        return True
