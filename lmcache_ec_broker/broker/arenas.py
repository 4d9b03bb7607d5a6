"""Put arenas: the blocks a connection is granted ahead of its puts, and the
placements that turn some of them into entries (the rules are in store.py's module
doc, "Put arenas"). A mixin of ``Store``: it works on the store's own allocator,
entries, counters and connections, so its invariants stay the store's.
"""

from __future__ import annotations

import heapq

from ..protocol import ArenaReply, ErrorCode, ErrorReply, PlaceReply
from ..shm.allocator import Run
from .entries import Arena, Entry, State


class ArenaPlacement:
    """``Store.grant``, ``Store.place`` and the arena's release (see the module doc)."""

    def _free_arena(self, conn: int, arena: Arena) -> None:
        self.allocator.free(_runs_of(arena.free))
        self.arena_blocks -= len(arena.free)
        arena.free.clear()
        del self.arena_conns[conn]
        heapq.heappush(self._free_slots, arena.slot)

    def arena_slot(self, conn: int) -> int:
        """The journal slot of ``conn``'s arena, -1 if it holds none."""
        state = self.conns.get(conn)
        return -1 if state is None or state.arena is None else state.arena.slot

    def grant(self, conn: int, nbytes: int) -> ArenaReply | ErrorReply:
        """Add up to ``nbytes`` of blocks to ``conn``'s arena (created on first use).
        May evict like a reserve; with no room the grant is smaller or empty (the
        client's puts then take the reserve path)."""
        self.counters["arena_grants"] += 1
        if self.arena_cap_blocks <= 0:
            return ErrorReply(
                ErrorCode.BAD_REQUEST,
                "this broker grants no put arenas (put_arena_bytes = 0); use reserve",
            )
        if nbytes < 0:
            return ErrorReply(ErrorCode.BAD_REQUEST, f"arena grant of {nbytes} bytes")
        state = self.conns[conn]
        arena = state.arena
        if arena is None:
            if not self._free_slots:
                return ArenaReply(slot=-1)  # no journal slot: no arena for this connection
            arena = state.arena = Arena(heapq.heappop(self._free_slots))
            self.arena_conns[conn] = arena.slot
        want = min(
            self._blocks_for(nbytes),
            self.arena_cap_blocks - len(arena.free),
            self.arena_total_cap - self.arena_blocks,
        )
        if want <= 0:
            return ArenaReply(arena.slot)
        if not self._make_room(want):
            want = self.allocator.free_blocks
            if want <= 0:
                return ArenaReply(arena.slot)
        runs = self.allocator.allocate(want)
        assert runs is not None  # _make_room or the free count guaranteed the blocks
        for start, length in runs:
            arena.free.update(range(start, start + length))
        self.arena_blocks += want
        return ArenaReply(arena.slot, runs)

    def place(
        self,
        conn: int,
        key: str,
        nbytes: int,
        dtype: str,
        shape: list[int],
        runs: list[tuple[int, int]],
    ) -> Entry | PlaceReply | ErrorReply:
        """Turn blocks of ``conn``'s arena, already written by the client, into the
        READY entry ``key`` (the entry is returned). Invariant 8: nothing the client
        says is trusted; a refusal leaves the arena and the index unchanged."""
        state = self.conns[conn]
        arena = state.arena
        if arena is None:
            self.counters["arena_place_refused"] += 1
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN, "place without a put arena: ask for a grant first"
            )
        if (err := self.check_entry(key, nbytes, dtype, shape)) is not None:
            self.counters["arena_place_refused"] += 1
            return err
        need = self._blocks_for(nbytes)
        blocks: set[int] = set()
        total = 0
        for start, length in runs:
            total += length
            # Checked before expanding: the work stays O(need + len(runs)), whatever is sent.
            if length <= 0 or start < 0 or start + length > self.nblocks or total > need:
                total = -1
                break
            blocks.update(range(start, start + length))
        if total != need or len(blocks) != total or not blocks <= arena.free:
            self.counters["arena_place_refused"] += 1
            return ErrorReply(
                ErrorCode.BAD_REQUEST,
                f"placement of {key!r} names blocks {runs[:8]} that are not "
                f"{need} distinct free blocks of this connection's arena",
            )
        existing = self.entries.get(key)
        if existing is not None:
            # The blocks never left the arena: the client may use them again.
            if existing.state is State.READY:
                self.lru.touch(key)
                self.counters["put_present"] += 1
            else:
                self.counters["put_in_progress"] += 1
            return PlaceReply(False, list(runs))
        arena.free -= blocks
        self.arena_blocks -= total
        self.used_blocks += total
        runs = [(start, length) for start, length in runs]
        entry = self._add_entry(key, nbytes, dtype, shape, runs, State.READY)  # invariant 9
        self.lru.insert(key)
        self.counters["puts"] += 1
        self.counters["arena_places"] += 1
        self.counters["bytes_stored"] += nbytes
        if self.residency is not None:  # the client's copy is in: the bytes are final
            self.residency.publish(key, nbytes, entry.dtype, entry.shape, entry.extents)
        if self.observer is not None:
            self.observer.slab_stored(key, nbytes)
        return entry


def _runs_of(blocks: set[int]) -> list[Run]:
    """The sorted, coalesced runs covering ``blocks``."""
    runs: list[Run] = []
    for b in sorted(blocks):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
