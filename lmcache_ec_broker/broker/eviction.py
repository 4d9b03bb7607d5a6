"""LRU order of ready entries; the store asks it for eviction candidates."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LRUPolicy:
    """Least-recently-used first. Holds keys only; the store decides what is evictable."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[str]:
        """Oldest first, lazily: collect victims, then remove them after iterating."""
        return iter(self._order)
