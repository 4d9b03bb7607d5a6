"""The store's index of entries and every view published of it: the LRU order, the
membership filter (shm/filter.py), the residency index (shm/residency.py) and the
observer (events/). The index owns them and keeps them in agreement; the store
(store.py) decides when an entry is added, turns READY or leaves, and owns its blocks.

Invariants (kept here, by the only code that changes the index):
- a key is in the membership filter from the moment its entry is indexed (``add``:
  the filter first, before any reply can make the entry visible) until after it
  left the index (``drop``, ``unindex``);
- a key is in the residency index only while its entry is READY with the published
  extents: ``ready`` after the entry turns READY, ``withdraw`` first thing in
  ``drop``, before the store can free or reuse its blocks;
- the LRU holds exactly the READY keys; readers are handed READY entries only
  (``ready``: never a partial entry, store.py invariant 3);
- the observer is told of every entry that turned READY and every READY entry that
  left the index.
"""

from __future__ import annotations

from .entries import Entry, MembershipFilter, ResidencyIndex, State, StoreObserver
from .eviction import LRUPolicy


class EntryIndex:
    """Key -> entry (RESERVED or READY), and the views published of it (module doc)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.lru = LRUPolicy()
        # The published membership filter; None when not published. The index adds a
        # key before it becomes READY and removes it after it stopped being READY,
        # keeping the filter's invariant for the memory tier's keys.
        self.membership: MembershipFilter | None = None
        # The published residency index; None when not published.
        self.residency: ResidencyIndex | None = None
        # Residency events: told of every entry that became READY (commit, place) and
        # every READY entry that left the index (evict, delete, clear).
        self.observer: StoreObserver | None = None

    def __len__(self) -> int:
        """The READY entries."""
        return len(self.lru)

    def ready(self, key: str) -> Entry | None:
        """``key``'s entry if it is READY (what a reader may see), else None."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.state is State.READY else None

    def ready_entries(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state is State.READY]

    def touch(self, key: str) -> None:
        self.lru.touch(key)

    def add(self, entry: Entry) -> None:
        """Index a new entry, its key in the membership filter first."""
        if self.membership is not None:
            self.membership.add(entry.key)
        self.entries[entry.key] = entry

    def became_ready(self, entry: Entry) -> None:
        """``entry`` (indexed) is READY: its bytes are final. Into the LRU, published."""
        self.lru.insert(entry.key)
        if self.residency is not None:
            self.residency.publish(entry.key, entry.nbytes, entry.dtype, entry.shape, entry.extents)
        if self.observer is not None:
            self.observer.slab_stored(entry.key, entry.nbytes)

    def unindex(self, entry: Entry) -> None:
        """Remove a RESERVED entry (aborted or lapsed): it was never published."""
        del self.entries[entry.key]
        if self.membership is not None:
            self.membership.remove(entry.key)

    def drop(self, entry: Entry) -> None:
        """Remove a READY entry; its blocks are the store's to free afterwards."""
        if self.residency is not None:
            # First: clients stop copying from these blocks before they can be freed
            # (by the store, now or at the last release) and granted to a writer.
            self.residency.withdraw(entry.key)
        del self.entries[entry.key]
        if self.membership is not None:
            self.membership.remove(entry.key)
        if self.observer is not None:
            self.observer.slab_removed(entry.key)
        self.lru.remove(entry.key)

    def victims(self, need: int) -> list[Entry] | None:
        """The least recently used unpinned READY entries holding at least ``need``
        blocks, oldest first; None if all of them together hold fewer."""
        victims: list[Entry] = []
        for key in self.lru.candidates():
            entry = self.entries[key]
            if entry.pins:
                continue
            victims.append(entry)
            need -= sum(length for _, length in entry.runs)
            if need <= 0:
                return victims
        return None
