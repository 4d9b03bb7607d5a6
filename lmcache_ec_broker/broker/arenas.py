"""Put arenas' books: which slab blocks each connection was granted ahead of its puts,
and which placement-journal slot each arena writes (docs/design.md "Put arenas").

``ArenaBooks`` owns this state and nothing else. It never allocates, frees or
evicts: the store hands it the runs it allocated (``add``) and frees the runs it
gives back (``release``), so the allocator and the entry index stay the store's.

Invariants (``check`` asserts them; the store's invariants 7, 8 and 10):
- every arena block is a block some arena holds exactly once, and ``blocks`` is
  their count;
- one arena per connection, one journal slot per arena, a slot is either held or
  in ``_free_slots``, never both;
- one arena holds at most ``cap_blocks`` blocks and all together at most
  ``total_cap`` (a quarter of the slab), so arenas can never starve the cache;
- ``claim`` changes nothing: a placement it refuses leaves the arena as it was.
"""

from __future__ import annotations

import heapq

from ..shm.allocator import Run
from .entries import Arena


class ArenaBooks:
    def __init__(self, nblocks: int, block_size: int, arena_bytes: int, slots: int) -> None:
        self.nblocks = nblocks
        self.total_cap = nblocks // 4
        self.cap_blocks = min(arena_bytes // block_size, self.total_cap)  # 0: no arenas
        self.blocks = 0  # blocks held by all arenas together
        self._free_slots = list(range(slots))  # a heap: lowest slot first
        self._arenas: dict[int, Arena] = {}  # connection -> its arena

    def __len__(self) -> int:
        return len(self._arenas)

    def slot(self, conn: int) -> int:
        """The journal slot of ``conn``'s arena, -1 if it holds none."""
        arena = self._arenas.get(conn)
        return -1 if arena is None else arena.slot

    def holders(self) -> dict[int, int]:
        """Connection -> journal slot, for every connection holding an arena (a copy)."""
        return {conn: arena.slot for conn, arena in self._arenas.items()}

    def held(self, conn: int) -> set[int]:
        """The blocks ``conn``'s arena holds (a copy; empty with no arena)."""
        arena = self._arenas.get(conn)
        return set() if arena is None else set(arena.free)

    def open(self, conn: int) -> int:
        """``conn``'s journal slot, its arena created on first use; -1 with no slot left."""
        arena = self._arenas.get(conn)
        if arena is None:
            if not self._free_slots:
                return -1
            arena = self._arenas[conn] = Arena(heapq.heappop(self._free_slots))
        return arena.slot

    def room(self, conn: int) -> int:
        """How many more blocks ``conn``'s (open) arena may be granted."""
        return min(self.cap_blocks - len(self._arenas[conn].free), self.total_cap - self.blocks)

    def add(self, conn: int, runs: list[Run]) -> None:
        """Blocks the store allocated for ``conn``'s arena (at most ``room(conn)``)."""
        free = self._arenas[conn].free
        for start, length in runs:
            free.update(range(start, start + length))
            self.blocks += length

    def claim(self, conn: int, runs: list[tuple[int, int]], need: int) -> set[int] | None:
        """The blocks ``runs`` names if they are exactly ``need`` distinct free blocks of
        ``conn``'s arena; None otherwise. Nothing changes either way (the client's
        words are checked, not trusted; store invariant 8)."""
        arena = self._arenas[conn]
        blocks: set[int] = set()
        total = 0
        for start, length in runs:
            total += length
            # Checked before expanding: the work stays O(need + len(runs)), whatever is sent.
            if length <= 0 or start < 0 or start + length > self.nblocks or total > need:
                return None
            blocks.update(range(start, start + length))
        if total != need or len(blocks) != total or not blocks <= arena.free:
            return None
        return blocks

    def take(self, conn: int, blocks: set[int]) -> None:
        """``blocks`` (a ``claim``'s answer) leave ``conn``'s arena: they became an entry."""
        self._arenas[conn].free -= blocks
        self.blocks -= len(blocks)

    def release(self, conn: int) -> list[Run]:
        """``conn``'s arena closed; its blocks, as runs, for the store to free."""
        arena = self._arenas.pop(conn, None)
        if arena is None:
            return []
        self.blocks -= len(arena.free)
        heapq.heappush(self._free_slots, arena.slot)
        return runs_of(arena.free)

    def check(self, owned: set[int], is_used: list[bool] | bytearray) -> set[int]:
        """Assert the invariants above given the blocks entries own and the allocator's
        used map; returns every arena block."""
        held: set[int] = set()
        slots: set[int] = set()
        for arena in self._arenas.values():
            assert arena.slot not in slots and arena.slot not in self._free_slots, "slot twice"
            slots.add(arena.slot)
            assert len(arena.free) <= self.cap_blocks, "arena over its cap"
            assert not (arena.free & owned), "arena block shared with an entry"
            assert not (arena.free & held), "arena block shared by two arenas"
            assert all(is_used[b] for b in arena.free), "arena block is also free"
            held |= arena.free
        assert len(held) == self.blocks, "arena accounting drift"
        assert self.blocks <= max(self.total_cap, 0), "arenas over a quarter"
        return held


def runs_of(blocks: set[int]) -> list[Run]:
    """The sorted, coalesced runs covering ``blocks``."""
    runs: list[Run] = []
    for b in sorted(blocks):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
