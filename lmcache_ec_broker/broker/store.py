"""Entry index and lifecycle: reserve -> commit (ready) | abort; get -> pin -> release.

Pure state, no I/O: the server loop calls it, tests drive it directly. Its parts,
each owning its state: ``EntryIndex`` (entry_index.py: key -> entry, and the views
published of it), ``ReservationBooks`` (reservations.py: open reservations and when
they lapse), ``ConnBooks`` (conn_books.py: what each connection holds and may hold)
and ``ArenaBooks`` (arenas.py); the store owns the blocks and every state change.

Invariants (``check()`` asserts them; tests call it after every step):
1. ``free + used + reserved == capacity`` (all in block-granular bytes), where
   *reserved* is the blocks of RESERVED entries and *used* the blocks of READY
   entries plus doomed entries still pinned by a reader.
2. No block belongs to two entries; a block is reused only after its entry is
   gone from the index and no pin refers to it.
3. Readers never see a partial entry: only READY entries are returned by
   ``get``/``has``.
4. Pinned (by a get or a lease) and reserved entries are never evicted; what one
   connection, client process or uid holds (open reservations, arenas, pinned and
   leased entries) stays within its limits (the books': conn_books.py, quotas.py),
   so one neighbour cannot evict or hold the whole slab.
5. Allocation fails only if the free blocks plus the blocks of unpinned READY
   entries are not enough.
6. Everything a connection holds (reservations, pins, leases, its put arena) is
   released by ``close_connection``.
11. A client's reservation lapses ``reservation_ttl`` seconds after it was granted:
   its key leaves the index at once (others may put it; readers miss it), and its
   blocks stay reserved, charged to the holder, until the holder commits (refused:
   nothing is stored), aborts or closes -- a holder that was only slow may still be
   copying into them, so they are never handed to anyone else before it says it is
   done. A lapsed reservation is never committed.

Put arenas (``grant``/``place``; docs/design.md "Put arenas"): a connection may hold
slab blocks granted ahead of time, copy an entry into them and post a Place that
turns them into a READY entry without a round trip. Invariants, also in ``check()``:
7. ``free + used + reserved + arena == capacity``: arena blocks are neither free nor
   evictable; they belong to exactly one connection and to no entry.
8. A placement is accepted only if every block it names is a free block of *this*
   connection's arena, no block twice, exactly ``ceil(nbytes / block_size)`` blocks,
   and key/dtype/shape/nbytes pass the same checks as a reserve; otherwise it is
   refused and the arena is unchanged. A key that is already present or reserved
   keeps its entry; the placed blocks stay in the arena (PlaceReply.stored False).
9. The filter has the key before the entry becomes visible (as for commit).
10. One connection holds at most ``arenas.cap_blocks`` arena blocks and all arenas
    together at most a quarter of the slab, so arenas can never starve the cache.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping

from ..protocol import (
    ArenaReply,
    ErrorCode,
    ErrorReply,
    Extent,
    Hit,
    PlaceReply,
    ReserveReply,
    ReserveStatus,
)
from ..shm.allocator import BlockAllocator, Run
from .arenas import ArenaBooks
from .conn_books import LIMIT_COUNTERS, ConnBooks, ConnState
from .entries import Entry, EntryRules, Pin, State  # Entry, State: imported from here too
from .entry_index import EntryIndex
from .quotas import QuotaBooks, QuotaLimits
from .reservations import ReservationBooks
from .slab_reads import SlabReads

# Monotonic counters the store keeps (the metrics endpoint exports them as counters).
STORE_COUNTERS = (
    "hits",
    "misses",
    "has_hits",
    "has_misses",
    "puts",
    "put_present",
    "put_in_progress",
    "aborts",
    "evictions",
    "deletes",
    "bytes_stored",
    "bytes_loaded",
    "no_space",
    "arena_grants",  # grant requests answered (possibly with no blocks)
    "arena_places",  # entries stored by a placement from a put arena
    "arena_place_refused",  # placements refused (bad blocks/key/shape) or of a present key
    *LIMIT_COUNTERS,  # requests refused by a per-connection, process or uid limit
    "reservations_expired",  # client reservations that lapsed (reservation_ttl_s) uncommitted
)
# What any counter shows (stats, metrics) at most: msgpack's and Prometheus' u64.
COUNTER_MAX = (1 << 64) - 1
# Reservations one sweep lapses at most (a few microseconds each).
LAPSES_PER_SWEEP = 256


class Store:
    def __init__(
        self,
        capacity_bytes: int,
        block_size: int,
        max_entry_bytes: int | None = None,
        max_key_length: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        max_pins_per_conn: int = 1 << 16,
        max_leases_per_conn: int = 1 << 16,
        arena_bytes: int = 0,
        arena_slots: int = 1024,
        max_reserved_bytes_per_conn: int = 0,
        quotas: QuotaLimits | None = None,
        reservation_ttl_s: float = 60.0,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block size must be positive")
        self.block_size = block_size
        self.nblocks = capacity_bytes // block_size
        self.capacity_bytes = self.nblocks * block_size
        # What a new entry's key and description must be (reserve and place).
        self.rules = EntryRules(
            max_key_length,
            min(max_entry_bytes or self.capacity_bytes, self.capacity_bytes),
            self.capacity_bytes,
        )
        self.allocator = BlockAllocator(self.nblocks)
        # The entries and the views published of them (filter, residency index,
        # observer, LRU order; invariants 3 and 9; entry_index.py).
        self.index = EntryIndex()
        # Open reservations, their blocks, when each lapses (invariant 11; reservations.py).
        self.reserved = ReservationBooks(reservation_ttl_s)
        self.counters = dict.fromkeys(STORE_COUNTERS, 0)
        self._ids = itertools.count(1)  # pin ids and reservation tokens
        # What each connection holds (reservations, pins, leases) and may hold, and
        # its process and uid (invariants 4 and 6; conn_books.py, quotas.py). Open
        # reservations per connection are capped in blocks (0: a quarter of the slab).
        self.books = ConnBooks(
            block_size,
            quotas or QuotaLimits.resolve(self.nblocks, block_size),
            self.counters,
            self._ids,
            self._free_blocks,
            max_pins=max_pins_per_conn,
            max_leases=max_leases_per_conn,
            max_reserved_blocks=max(
                1, self._blocks_for(max_reserved_bytes_per_conn) or self.nblocks // 4
            ),
        )
        # Gets, has, and the reads clients answered themselves (slab_reads.py).
        self.reads = SlabReads(self.index, self.books, self.counters, clock)
        # Told the key of every reservation that ends without a commit (abort, its
        # connection closed): the Publish requests waiting for it (publish.py).
        self.on_abort: Callable[[str], None] | None = None
        self._clock = clock
        self.used_blocks = 0  # blocks of READY entries and doomed ones still pinned
        # Put arenas (invariants 7, 8, 10): the books own which blocks and journal slot
        # each connection holds; the store allocates and frees their blocks.
        self.arenas = ArenaBooks(self.nblocks, block_size, arena_bytes, arena_slots)

    # What the server, the tiers and the tests read of the parts.

    @property
    def max_key_length(self) -> int:
        return self.rules.max_key_length

    @property
    def max_entry_bytes(self) -> int:
        return self.rules.max_entry_bytes

    @property
    def entries(self) -> Mapping[str, Entry]:
        """Key -> entry, RESERVED or READY (the index's)."""
        return self.index.entries

    @property
    def reservations(self) -> Mapping[int, Entry]:
        """Token -> open reservation, lapsed ones included (the reservation books')."""
        return self.reserved.by_token

    @property
    def reservation_ttl(self) -> float:
        return self.reserved.ttl

    @property
    def conns(self) -> Mapping[int, ConnState]:
        """The open connections (``conn in store.conns``); their state is the books'."""
        return self.books.conns

    @property
    def pins(self) -> Mapping[int, Pin]:
        return self.books.pins

    @property
    def quotas(self) -> QuotaBooks:
        return self.books.quotas

    @property
    def max_pins_per_conn(self) -> int:
        return self.books.max_pins

    @property
    def max_leases_per_conn(self) -> int:
        return self.books.max_leases

    @property
    def max_reserved_blocks_per_conn(self) -> int:
        return self.books.max_reserved_blocks

    # ------------------------------------------------------------ connections

    def open_connection(self, conn: int) -> None:
        self.books.open(conn)

    def admit_peer(self, conn: int, pid: int, uid: int) -> ErrorReply | None:
        """Charge the open client connection ``conn`` to its process and uid (from
        SO_PEERCRED), or refuse it: past max_connections_per_process/uid."""
        return self.books.admit_peer(conn, pid, uid)

    def close_connection(self, conn: int) -> None:
        state = self.books.closing(conn)
        if state is None:
            return
        for token in list(state.reservations):
            self._abort(token)
        for pin_id in list(state.pins):
            self.books.unpin(pin_id)
        runs = self.arenas.release(conn)
        self.books.charge_arena(conn, -sum(length for _, length in runs))
        self.allocator.free(runs)
        self.books.closed(conn)

    # ------------------------------------------------------------ helpers

    def _blocks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.block_size)

    def _extents(self, runs: list[Run], nbytes: int) -> list[Extent]:
        extents: list[Extent] = []
        left = nbytes
        for start, length in runs:
            n = min(length * self.block_size, left)
            extents.append((start * self.block_size, n))
            left -= n
        return extents

    def _free_blocks(self, entry: Entry) -> None:
        """Free a READY (or doomed) entry's blocks; a reservation's are counted off by
        the reservation books when it closes (``_abort``)."""
        if entry.state is not State.RESERVED:
            self.used_blocks -= sum(length for _, length in entry.runs)
        self.allocator.free(entry.runs)
        entry.runs = []
        entry.extents = []

    def _drop_ready(self, entry: Entry) -> None:
        """Remove a READY entry from the index (withdrawn from the residency index
        first: entry_index.py); free now or at its last release. Leases on it end
        now: they protect a later load, which can no longer happen, and must not hold
        the blocks until they expire (a reader's pin does)."""
        self.index.drop(entry)
        if entry.pins:
            self.books.end_leases(entry)
        if entry.pins:
            entry.doomed = True
        else:
            self._free_blocks(entry)

    def _make_room(self, nblocks: int) -> bool:
        """Evict LRU unpinned READY entries until ``nblocks`` are free."""
        self.expire_leases()
        if self.allocator.free_blocks >= nblocks:
            return True
        victims = self.index.victims(nblocks - self.allocator.free_blocks)
        if victims is None:
            return False
        for entry in victims:
            self._drop_ready(entry)
            self.counters["evictions"] += 1
        return True

    # Admission (invariant 4; the rules are the books', conn_books.py).

    def admit_pins(self, conn: int, keys: list[str]) -> ErrorReply | None:
        """Refuse a get of ``keys`` that could take ``conn`` past what it may hold."""
        return self.books.admit_pins(conn, keys, self.index.entries)

    def admit_reservation(self, conn: int, nblocks: int) -> ErrorReply | None:
        """Refuse a reserve that would take ``conn`` past its reservation limits."""
        return self.books.admit_reservation(conn, nblocks)

    def admit_leases(self, conn: int, keys: list[str], extra_held: int = 0) -> ErrorReply | None:
        """Refuse a leasing has/lookup that could take ``conn`` past its lease limits
        (``extra_held``: leases the caller keeps elsewhere, on lower tiers)."""
        return self.books.admit_leases(conn, keys, self.index.entries, extra_held)

    # ------------------------------------------------------------ operations

    def reserve(
        self, conn: int, key: str, nbytes: int, dtype: str, shape: list[int]
    ) -> ReserveReply | ErrorReply:
        if (err := self.rules.check(key, nbytes, dtype, shape)) is not None:
            return err
        existing = self.index.entries.get(key)
        if (
            existing is not None
            and existing.state is State.RESERVED
            and 0 < existing.expires_at <= self._clock()
        ):
            self._lapse(existing)  # its holder's time is up: the key is free now
            existing = None
        if existing is not None:
            if existing.state is State.READY:
                self.index.touch(key)
                self.counters["put_present"] += 1
                return ReserveReply(ReserveStatus.PRESENT)
            self.counters["put_in_progress"] += 1
            return ReserveReply(ReserveStatus.IN_PROGRESS)
        nblocks = self._blocks_for(nbytes)
        if (refusal := self.admit_reservation(conn, nblocks)) is not None:
            return refusal
        if not self._make_room(nblocks):
            self.counters["no_space"] += 1
            return ErrorReply(
                ErrorCode.NO_SPACE,
                f"no room for {nbytes} bytes: {self.allocator.free_blocks * self.block_size} "
                f"bytes free, {self.reserved.blocks * self.block_size} reserved by writers and "
                f"{self.books.pinned_entries} entries pinned by readers; retry later or grow --shm-size",
            )
        runs = self.allocator.allocate(nblocks)
        assert runs is not None  # _make_room guaranteed the blocks
        token = next(self._ids)
        # In the filter from the reservation on (a "maybe" is always confirmed here):
        # a client's commit is posted, so another client must ask the broker, which
        # then reads the writer's pending commit (server.settle_reservations).
        entry = self._add_entry(key, nbytes, dtype, shape, runs, State.RESERVED, token, conn)
        self.books.reserved(conn, token, nblocks)
        # A client's lapses (invariant 11); the broker's own promotions do not.
        self.reserved.open(token, entry, nblocks, self._clock() if conn >= 0 else None)
        return ReserveReply(ReserveStatus.RESERVED, token, entry.extents)

    def _add_entry(
        self,
        key: str,
        nbytes: int,
        dtype: str,
        shape: list[int],
        runs: list[Run],
        state: State,
        token: int = 0,
        owner: int = 0,
    ) -> Entry:
        """A new entry over ``runs`` in the index, its key added to the membership filter
        first (before any reply can make it visible: the filter's invariant)."""
        entry = Entry(
            key=key,
            nbytes=nbytes,
            dtype=dtype,
            shape=list(shape),
            runs=runs,
            extents=self._extents(runs, nbytes),
            state=state,
            token=token,
            owner=owner,
        )
        self.index.add(entry)
        return entry

    # ------------------------------------------------------------ put arenas

    def arena_slot(self, conn: int) -> int:
        """The journal slot of ``conn``'s arena, -1 if it holds none."""
        return self.arenas.slot(conn)

    def grant(self, conn: int, nbytes: int) -> ArenaReply | ErrorReply:
        """Add up to ``nbytes`` of blocks to ``conn``'s arena (created on first use).
        May evict like a reserve; with no room the grant is smaller or empty (the
        client's puts then take the reserve path)."""
        self.counters["arena_grants"] += 1
        if self.arenas.cap_blocks <= 0:
            return ErrorReply(
                ErrorCode.BAD_REQUEST,
                "this broker grants no put arenas (put_arena_bytes = 0); use reserve",
            )
        if nbytes < 0:
            return ErrorReply(ErrorCode.BAD_REQUEST, f"arena grant of {nbytes} bytes")
        slot = self.arenas.open(conn)
        if slot < 0:
            return ArenaReply(slot=-1)  # no journal slot: no arena for this connection
        want = min(self._blocks_for(nbytes), self.arenas.room(conn))
        room = self.books.arena_room(conn)  # its process's and uid's share (quotas.py)
        if room is not None:
            want = min(want, room)
        if want <= 0:
            return ArenaReply(slot)
        if not self._make_room(want):
            want = self.allocator.free_blocks
            if want <= 0:
                return ArenaReply(slot)
        runs = self.allocator.allocate(want)
        assert runs is not None  # _make_room or the free count guaranteed the blocks
        self.arenas.add(conn, runs)
        self.books.charge_arena(conn, sum(length for _, length in runs))
        return ArenaReply(slot, runs)

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
        if self.arenas.slot(conn) < 0:
            self.counters["arena_place_refused"] += 1
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN, "place without a put arena: ask for a grant first"
            )
        if (err := self.rules.check(key, nbytes, dtype, shape)) is not None:
            self.counters["arena_place_refused"] += 1
            return err
        blocks = self.arenas.claim(conn, runs, self._blocks_for(nbytes))
        if blocks is None:
            self.counters["arena_place_refused"] += 1
            return ErrorReply(
                ErrorCode.BAD_REQUEST,
                f"placement of {key!r} names blocks {runs[:8]} that are not "
                f"{self._blocks_for(nbytes)} distinct free blocks of this connection's arena",
            )
        existing = self.index.entries.get(key)
        if existing is not None:
            # The blocks never left the arena: the client may use them again.
            if existing.state is State.READY:
                self.index.touch(key)
                self.counters["put_present"] += 1
            else:
                self.counters["put_in_progress"] += 1
            return PlaceReply(False, list(runs))
        self.arenas.take(conn, blocks)
        self.books.charge_arena(conn, -len(blocks))
        self.used_blocks += len(blocks)
        runs = [(start, length) for start, length in runs]
        entry = self._add_entry(key, nbytes, dtype, shape, runs, State.READY)  # invariant 9
        self.counters["puts"] += 1
        self.counters["arena_places"] += 1
        self.counters["bytes_stored"] += nbytes
        self.index.became_ready(entry)  # the client's copy is in: the bytes are final
        return entry

    # ------------------------------------------------------------ reservations

    def commit(self, conn: int, token: int) -> ErrorReply | None:
        entry = self.reserved.owned(conn, token)
        if isinstance(entry, ErrorReply):
            return entry
        if entry.lapsed:  # invariant 11: the holder is done with the blocks; nothing stored
            self._abort(token)
            return self.reserved.lapsed_refusal(entry, token)
        self.reserved.close(token)
        n = sum(length for _, length in entry.runs)
        self.books.reservation_ended(conn, token, n)
        self.used_blocks += n
        entry.state = State.READY
        entry.token = 0
        entry.owner = 0
        entry.expires_at = 0.0
        self.counters["puts"] += 1
        self.counters["bytes_stored"] += entry.nbytes
        self.index.became_ready(entry)  # the writer's copy is in: the bytes are final
        return None

    def abort(self, conn: int, token: int) -> ErrorReply | None:
        entry = self.reserved.owned(conn, token)
        if isinstance(entry, ErrorReply):
            return entry
        self._abort(token)
        return None

    def _abort(self, token: int) -> None:
        entry = self.reserved.close(token)
        n = sum(length for _, length in entry.runs)
        self.books.reservation_ended(entry.owner, token, n)  # its owner may be closing
        if not entry.lapsed:  # a lapsed one already left the index (invariant 11)
            self.index.unindex(entry)
        self._free_blocks(entry)
        self.counters["aborts"] += 1
        if self.on_abort is not None:
            self.on_abort(entry.key)

    def expire_reservations(self, most: int = LAPSES_PER_SWEEP) -> int:
        """Lapse client reservations whose time is up (invariant 11), at most ``most``
        per call (the sweep runs every 0.1 s: a flood of reservations lapsing at once
        must not stall the loop): its key leaves the index now, its blocks stay with
        the holder until it commits, aborts or closes. Returns how many lapsed."""
        due = self.reserved.due(self._clock(), most)
        for entry in due:
            self._lapse(entry)
        return len(due)

    def _lapse(self, entry: Entry) -> None:
        entry.lapsed = True
        self.index.unindex(entry)
        self.counters["reservations_expired"] += 1
        if self.on_abort is not None:  # a Publish waiting for this key wakes: it left the index
            self.on_abort(entry.key)

    # Reads (slab_reads.py).

    def get(self, conn: int, keys: list[str], count_misses: bool = True) -> list[Hit | None]:
        return self.reads.get(conn, keys, count_misses)

    def has(
        self, conn: int, keys: list[str], lease_ms: int = 0, count_misses: bool = True
    ) -> list[bool]:
        return self.reads.has(conn, keys, lease_ms, count_misses)

    def served(self, keys: list[str], nbytes: list[int], has_hits: int) -> None:
        self.reads.served(keys, nbytes, has_hits)

    def pin_entry(self, conn: int, entry: Entry) -> int:
        return self.reads.pin_entry(conn, entry)

    def lease_entry(self, conn: int, key: str, expires_at: float) -> bool:
        return self.reads.lease_entry(conn, key, expires_at)

    def ready(self, key: str) -> Entry | None:
        return self.index.ready(key)

    def count(self, counter: str, n: int = 1) -> None:
        self.counters[counter] += n

    def now(self) -> float:
        return self._clock()

    def release(self, conn: int, pins: list[int]) -> ErrorReply | None:
        return self.books.release(conn, pins)

    def unlease(self, conn: int, keys: list[str]) -> None:
        """End ``conn``'s leases on ``keys``; keys it holds no lease on are ignored."""
        self.books.unlease(conn, keys)

    def expire_leases(self) -> int:
        """End every lease whose time is up (and lapse the reservations whose time is:
        the same sweep, every 0.1 s and before any eviction). Returns the leases ended."""
        self.expire_reservations()
        return self.books.expire_leases(self._clock())

    def delete(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            entry = self.index.ready(key)
            if entry is None:
                out.append(False)
                continue
            self._drop_ready(entry)
            self.counters["deletes"] += 1
            out.append(True)
        return out

    def clear(self) -> int:
        ready = self.index.ready_entries()
        for entry in ready:
            self._drop_ready(entry)
        return len(ready)

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        bs = self.block_size
        return {
            "entries": len(self.index),
            "reserved_entries": len(self.reserved),
            "used_bytes": self.used_blocks * bs,
            "reserved_bytes": self.reserved.blocks * bs,
            "arena_bytes": self.arenas.blocks * bs,
            "arenas": len(self.arenas),
            "free_bytes": self.allocator.free_blocks * bs,
            "capacity_bytes": self.capacity_bytes,
            "block_size": bs,
            "max_entry_bytes": self.max_entry_bytes,
            "pinned_entries": self.books.pinned_entries,
            "pins": len(self.pins),
            "free_runs": self.allocator.free_runs,
            "lapsed_reservations": self.reserved.lapsed(),
            **self.books.stats(),
            # Saturating: a counter a client could drive (hits, bytes_loaded through
            # Served) must never make a Stats reply unencodable for everyone.
            **{name: min(value, COUNTER_MAX) for name, value in self.counters.items()},
        }

    def check(self) -> None:
        self.allocator.check()
        assert (
            self.allocator.free_blocks
            + self.used_blocks
            + self.reserved.blocks
            + self.arenas.blocks
            == self.nblocks
        ), "free + used + reserved + arena != capacity"
        owned: set[int] = set()
        entries = self._live_entries()
        for entry in entries:
            for start, length in entry.runs:
                blocks = set(range(start, start + length))
                assert not (blocks & owned), f"block shared by two entries ({entry.key!r})"
                owned |= blocks
        assert len(owned) == self.used_blocks + self.reserved.blocks, "block accounting drift"
        used_map = self.allocator._used  # noqa: SLF001 (the check reads the allocator's map)
        self.arenas.check(owned, used_map)
        self.reserved.check(self.index.entries)  # invariant 11
        self.books.check(self.reserved.by_token, lambda c: len(self.arenas.held(c)))
        assert sum(1 for e in entries if e.pins) == self.books.pinned_entries, "pinned count drift"

    def _live_entries(self) -> list[Entry]:
        """Indexed entries, lapsed reservations and doomed ones still pinned (each once)."""
        uniq = {id(e): e for e in self.index.entries.values()}
        uniq.update((id(e), e) for e in self.reserved.by_token.values())
        uniq.update((id(p.entry), p.entry) for p in self.pins.values())
        return list(uniq.values())
