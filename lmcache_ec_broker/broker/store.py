"""Entry index and lifecycle: reserve -> commit (ready) | abort; get -> pin -> release.

Pure state, no I/O: the server loop calls it, tests drive it directly.

Invariants (``check()`` asserts them; tests call it after every step):
1. ``free + used + reserved == capacity`` (all in block-granular bytes), where
   *reserved* is the blocks of RESERVED entries and *used* the blocks of READY
   entries plus doomed entries still pinned by a reader.
2. No block belongs to two entries; a block is reused only after its entry is
   gone from the index and no pin refers to it.
3. Readers never see a partial entry: only READY entries are returned by
   ``get``/``has``.
4. Pinned (by a get or a lease) and reserved entries are never evicted; one
   connection's open reservations hold at most ``max_reserved_blocks_per_conn``
   blocks, except that a connection holding none may reserve one entry past it; and
   what one client process or uid keeps from eviction (reservations, arenas, pinned
   and leased entries) stays within its ``quotas`` (quotas.py), that first
   reservation included (so one neighbour cannot evict or hold the whole slab).
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

import heapq
import itertools
import time
from collections.abc import Callable, Collection

from ..protocol import (
    ArenaReply,
    ErrorCode,
    ErrorReply,
    Extent,
    Hit,
    PlaceReply,
    ReserveReply,
    ReserveStatus,
    expected_nbytes,
)
from ..shm.allocator import BlockAllocator, Run
from ..sizes import format_size
from .arenas import ArenaBooks
from .entries import (  # re-exported: coordinator, server and tests import them from here
    ConnState,
    Entry,
    MembershipFilter,
    Pin,
    ResidencyIndex,
    State,
    StoreObserver,
)
from .eviction import LRUPolicy
from .quotas import QuotaBooks, QuotaLimits

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
    "pin_limit_refusals",  # requests refused: the connection held max_pins_per_connection
    "lease_limit_refusals",  # requests refused: the connection held max_leases_per_connection
    "reserve_limit_refusals",  # reserves refused: a reservation limit (quotas.py) reached
    "reservations_expired",  # client reservations that lapsed (reservation_ttl_s) uncommitted
)
# has() hits a client answered from the residency index name no key, so the broker
# cannot verify them: one Served frame counts at most this many (BrokerClient sends
# one every 64 served items; connector/index_path.py).
SERVED_HAS_HITS_MAX = 1024
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
        self.max_entry_bytes = min(max_entry_bytes or self.capacity_bytes, self.capacity_bytes)
        self.max_key_length = max_key_length
        # What one client connection may hold at once (see admit_pins/admit_leases):
        # every pin and lease costs broker memory until released.
        self.max_pins_per_conn = max_pins_per_conn
        self.max_leases_per_conn = max_leases_per_conn
        # Open reservations per connection, in blocks (0: a quarter of the slab).
        self.max_reserved_blocks_per_conn = max(
            1, self._blocks_for(max_reserved_bytes_per_conn) or self.nblocks // 4
        )
        self.allocator = BlockAllocator(self.nblocks)
        self.lru = LRUPolicy()
        self.entries: dict[str, Entry] = {}
        self.reservations: dict[int, Entry] = {}
        self.pins: dict[int, Pin] = {}
        self.conns: dict[int, ConnState] = {}
        # The published membership filter (shm/filter.py); None when not published.
        # This memory tier adds a key before it becomes READY and removes it after
        # it stopped being READY, keeping the filter's invariant for its own keys.
        self.membership: MembershipFilter | None = None
        # The published residency index (shm/residency.py); None when not published.
        # Invariant: a key is in it only while its entry is READY with the published
        # extents: ``publish`` after the entry turns READY (commit, place), ``withdraw``
        # first thing in _drop_ready, before the blocks can be freed or reused.
        self.residency: ResidencyIndex | None = None
        # Residency events (events/ package): told of every entry that became READY
        # (commit) and every READY entry that left the index (evict, delete, clear).
        self.observer: StoreObserver | None = None
        # Told the key of every reservation that ends without a commit (abort, its
        # connection closed): the Publish requests waiting for it (publish.py).
        self.on_abort: Callable[[str], None] | None = None
        self._clock = clock
        self._ids = itertools.count(1)
        self._lease_heap: list[tuple[float, int]] = []
        self.reserved_blocks = 0
        self.used_blocks = 0
        self.pinned_entries = 0
        # Put arenas (invariants 7, 8, 10): the books own which blocks and journal slot
        # each connection holds; the store allocates and frees their blocks.
        self.arenas = ArenaBooks(self.nblocks, block_size, arena_bytes, arena_slots)
        # What each client process and uid holds (quotas.py; invariant 4).
        self.quotas = QuotaBooks(
            quotas or QuotaLimits.resolve(self.nblocks, block_size),
            block_size,
        )
        # Client reservations lapse this long after they were granted (invariant 11).
        self.reservation_ttl = reservation_ttl_s
        self._reservation_heap: list[tuple[float, int]] = []  # (expires_at, token)
        self.counters = dict.fromkeys(STORE_COUNTERS, 0)

    # ------------------------------------------------------------ connections

    def open_connection(self, conn: int) -> None:
        self.conns[conn] = ConnState()

    def admit_peer(self, conn: int, pid: int, uid: int) -> ErrorReply | None:
        """Charge the open client connection ``conn`` to its process and uid (from
        SO_PEERCRED), or refuse it: past max_connections_per_process/uid."""
        return self.quotas.open(conn, pid, uid)

    def close_connection(self, conn: int) -> None:
        state = self.conns.pop(conn, None)
        if state is None:
            return
        for token in list(state.reservations):
            self._abort(token)
        for pin_id in list(state.pins):
            self._unpin(pin_id)
        runs = self.arenas.release(conn)
        self.quotas.charge_arena(conn, -sum(length for _, length in runs))
        self.allocator.free(runs)
        self.quotas.close(conn)

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

    def _pin(self, entry: Entry, conn: int, expires_at: float = 0.0) -> int:
        pin_id = next(self._ids)
        self.pins[pin_id] = Pin(entry, conn, expires_at)
        if entry.pins == 0:
            self.pinned_entries += 1
        entry.pins += 1
        self.quotas.charge_pin(conn, entry, bool(expires_at))
        self.conns[conn].pins.add(pin_id)
        if expires_at:
            heapq.heappush(self._lease_heap, (expires_at, pin_id))
        return pin_id

    def _unpin(self, pin_id: int) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        state = self.conns.get(pin.conn)
        if state is not None:
            state.pins.discard(pin_id)
            if pin.expires_at and state.leases.get(pin.entry.key) == pin_id:
                del state.leases[pin.entry.key]
        entry = pin.entry
        self.quotas.refund_pin(pin.conn, entry, bool(pin.expires_at))  # before any free
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned_entries -= 1
            if entry.doomed:
                self._free_blocks(entry)
        return True

    def _free_blocks(self, entry: Entry) -> None:
        n = sum(length for _, length in entry.runs)
        if entry.state is State.RESERVED:
            self.reserved_blocks -= n
        else:
            self.used_blocks -= n
        self.allocator.free(entry.runs)
        entry.runs = []
        entry.extents = []

    def _drop_ready(self, entry: Entry) -> None:
        """Remove a READY entry from the index; free now or at its last release.
        Leases on it end now: they protect a later load, which can no longer happen,
        and must not hold the blocks until they expire (a reader's pin does)."""
        if self.residency is not None:
            # First: clients stop copying from these blocks before they can be freed
            # (below, or at the last release) and granted to a writer.
            self.residency.withdraw(entry.key)
        del self.entries[entry.key]
        if self.membership is not None:
            self.membership.remove(entry.key)
        if self.observer is not None:
            self.observer.slab_removed(entry.key)
        self.lru.remove(entry.key)
        if entry.pins:
            for state in self.conns.values():
                pin_id = state.leases.get(entry.key)
                if pin_id is not None and self.pins[pin_id].entry is entry:
                    self._unpin(pin_id)
        if entry.pins:
            entry.doomed = True
        else:
            self._free_blocks(entry)

    def _make_room(self, nblocks: int) -> bool:
        """Evict LRU unpinned READY entries until ``nblocks`` are free."""
        self.expire_leases()
        if self.allocator.free_blocks >= nblocks:
            return True
        need = nblocks - self.allocator.free_blocks
        victims: list[Entry] = []
        for key in self.lru.candidates():
            entry = self.entries[key]
            if entry.pins:
                continue
            victims.append(entry)
            need -= sum(length for _, length in entry.runs)
            if need <= 0:
                break
        if need > 0:
            return False
        for entry in victims:
            self._drop_ready(entry)
            self.counters["evictions"] += 1
        return True

    def validate_key(self, key: str) -> ErrorReply | None:
        if not key:
            return ErrorReply(ErrorCode.KEY_INVALID, "key is empty")
        if len(key) > self.max_key_length:
            return ErrorReply(
                ErrorCode.KEY_INVALID,
                f"key is {len(key)} characters long; the maximum is {self.max_key_length}",
            )
        return None

    def admit_pins(self, conn: int, keys: list[str]) -> ErrorReply | None:
        """Refuse a get of ``keys`` that could take ``conn`` past what it may hold.
        Invariant: a client connection never holds more than max_pins_per_conn get
        pins (leases are counted apart), so a client that never releases cannot
        grow the broker's memory without bound; its process and uid stay within
        their pin counts and held bytes (quotas.py)."""
        state = self.conns.get(conn)
        n = len(keys)
        held = 0 if state is None else len(state.pins) - len(state.leases)
        if held + n <= self.max_pins_per_conn:
            if not self.quotas.principals(conn):
                return None
            refusal = self.quotas.admit_pins(conn, n, self._ready_entries(keys))
            if refusal is None:
                return None
            self.counters["pin_limit_refusals"] += 1
            return refusal
        self.counters["pin_limit_refusals"] += 1
        return ErrorReply(
            ErrorCode.TOO_MANY_PINS,
            f"this connection holds {held} pins and asked for {n} more; the limit is "
            f"{self.max_pins_per_conn} (max_pins_per_connection): release the pins of "
            "earlier gets (BrokerClient does after each copy) or raise the limit",
        )

    def admit_reservation(self, conn: int, nblocks: int) -> ErrorReply | None:
        """Refuse a reserve that would take ``conn``'s open reservations past
        max_reserved_blocks_per_conn (invariant 4); a connection holding none may
        reserve one entry past it, but never past its process's or uid's limits
        (quotas.py: open reservations, zero-byte ones included, and held bytes).
        The broker's own connections (negative ids: promotion.TIER_CONN) are not
        clients and are not capped."""
        state = self.conns.get(conn)
        held = 0 if state is None or conn < 0 else state.reserved_blocks
        if not held or held + nblocks <= self.max_reserved_blocks_per_conn:
            refusal = self.quotas.admit_reserve(conn, nblocks)
            if refusal is not None:
                self.counters["reserve_limit_refusals"] += 1
            return refusal
        self.counters["reserve_limit_refusals"] += 1
        bs = self.block_size
        return ErrorReply(
            ErrorCode.TOO_MANY_RESERVATIONS,
            f"this connection's {len(state.reservations) if state else 0} open reservations "
            f"hold {format_size(held * bs)} and it asked for {format_size(nblocks * bs)} more; "
            f"the limit is {format_size(self.max_reserved_blocks_per_conn * bs)} "
            "(max_reserved_bytes_per_connection): commit or abort open reservations first "
            "(BrokerClient commits each put after its copy), put fewer entries at once, or "
            "raise the limit",
        )

    def admit_leases(self, conn: int, keys: list[str], extra_held: int = 0) -> ErrorReply | None:
        """Refuse a leasing has/lookup that could take ``conn`` past max_leases_per_conn
        leases (``extra_held``: leases the caller keeps elsewhere, on lower tiers)."""
        state = self.conns.get(conn)
        leases = {} if state is None else state.leases
        held = len(leases) + extra_held
        fresh = {k for k in keys if k not in leases}
        new = len(fresh)
        if held + new <= self.max_leases_per_conn:
            if not self.quotas.principals(conn):
                return None
            refusal = self.quotas.admit_leases(conn, new, self._ready_entries(fresh))
            if refusal is None:
                return None
            self.counters["lease_limit_refusals"] += 1
            return refusal
        self.counters["lease_limit_refusals"] += 1
        return ErrorReply(
            ErrorCode.TOO_MANY_LEASES,
            f"this connection holds {held} leases and asked for up to {new} more; the limit "
            f"is {self.max_leases_per_conn} (max_leases_per_connection): end leases with "
            "unlease once loaded, use a shorter lease_ms, or raise the limit",
        )

    def _ready_entries(self, keys: Collection[str]) -> list[Entry]:
        entries = self.entries
        return [e for k in keys if (e := entries.get(k)) is not None and e.state is State.READY]

    # ------------------------------------------------------------ operations

    def reserve(
        self, conn: int, key: str, nbytes: int, dtype: str, shape: list[int]
    ) -> ReserveReply | ErrorReply:
        if (err := self.check_entry(key, nbytes, dtype, shape)) is not None:
            return err
        existing = self.entries.get(key)
        if (
            existing is not None
            and existing.state is State.RESERVED
            and 0 < existing.expires_at <= self._clock()
        ):
            self._lapse(existing)  # its holder's time is up: the key is free now
            existing = None
        if existing is not None:
            if existing.state is State.READY:
                self.lru.touch(key)
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
                f"bytes free, {self.reserved_blocks * self.block_size} reserved by writers and "
                f"{self.pinned_entries} entries pinned by readers; retry later or grow --shm-size",
            )
        runs = self.allocator.allocate(nblocks)
        assert runs is not None  # _make_room guaranteed the blocks
        token = next(self._ids)
        # In the filter from the reservation on (a "maybe" is always confirmed here):
        # a client's commit is posted, so another client must ask the broker, which
        # then reads the writer's pending commit (server.settle_reservations).
        entry = self._add_entry(key, nbytes, dtype, shape, runs, State.RESERVED, token, conn)
        self.reservations[token] = entry
        self.reserved_blocks += nblocks
        state = self.conns[conn]
        state.reservations.add(token)
        state.reserved_blocks += nblocks
        self.quotas.charge_reserve(conn, nblocks)
        if conn >= 0:  # a client's: lapses (invariant 11); the broker's own promotions do not
            entry.expires_at = self._clock() + self.reservation_ttl
            heapq.heappush(self._reservation_heap, (entry.expires_at, token))
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
        if self.membership is not None:
            self.membership.add(key)
        self.entries[key] = entry
        return entry

    def check_entry(self, key: str, nbytes: int, dtype: str, shape: list[int]) -> ErrorReply | None:
        """What reserve and place both require of a new entry's description."""
        if (err := self.validate_key(key)) is not None:
            return err
        try:
            implied = expected_nbytes(dtype, shape)
        except ValueError as exc:
            code = ErrorCode.DTYPE_INVALID if "dtype" in str(exc) else ErrorCode.SHAPE_MISMATCH
            return ErrorReply(code, str(exc))
        if nbytes != implied:
            return ErrorReply(
                ErrorCode.SHAPE_MISMATCH,
                f"nbytes={nbytes} but dtype {dtype} with shape {shape} needs {implied} bytes",
            )
        if nbytes > self.max_entry_bytes:
            return ErrorReply(
                ErrorCode.TOO_LARGE,
                f"entry of {nbytes} bytes exceeds the maximum entry size of "
                f"{self.max_entry_bytes} bytes (slab capacity {self.capacity_bytes} bytes); "
                "start the broker with a larger --shm-size or max_entry_size",
            )
        return None

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
        room = self.quotas.arena_room(conn)  # its process's and uid's share (quotas.py)
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
        self.quotas.charge_arena(conn, sum(length for _, length in runs))
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
        if (err := self.check_entry(key, nbytes, dtype, shape)) is not None:
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
        existing = self.entries.get(key)
        if existing is not None:
            # The blocks never left the arena: the client may use them again.
            if existing.state is State.READY:
                self.lru.touch(key)
                self.counters["put_present"] += 1
            else:
                self.counters["put_in_progress"] += 1
            return PlaceReply(False, list(runs))
        self.arenas.take(conn, blocks)
        self.quotas.charge_arena(conn, -len(blocks))
        self.used_blocks += len(blocks)
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

    # ------------------------------------------------------------ reservations

    def _owned_reservation(self, conn: int, token: int) -> Entry | ErrorReply:
        entry = self.reservations.get(token)
        if entry is None or entry.owner != conn:
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN,
                f"token {token} is not an open reservation of this connection "
                "(already committed or aborted, or never issued to it)",
            )
        return entry

    def commit(self, conn: int, token: int) -> ErrorReply | None:
        entry = self._owned_reservation(conn, token)
        if isinstance(entry, ErrorReply):
            return entry
        if entry.lapsed:  # invariant 11: the holder is done with the blocks; nothing stored
            self.conns[conn].reservations.discard(token)
            self._abort(token)
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN,
                f"the reservation of {entry.key!r} (token {token}) expired "
                f"{self.reservation_ttl:g} s after it was granted, before this commit "
                "(reservation_ttl_s): nothing was stored; put the entry again, and raise "
                "reservation_ttl_s if copies really take that long",
            )
        del self.reservations[token]
        state = self.conns[conn]
        state.reservations.discard(token)
        n = sum(length for _, length in entry.runs)
        self.quotas.refund_reserve(conn, n)
        state.reserved_blocks -= n
        self.reserved_blocks -= n
        self.used_blocks += n
        entry.state = State.READY
        entry.token = 0
        entry.owner = 0
        entry.expires_at = 0.0
        self.lru.insert(entry.key)
        self.counters["puts"] += 1
        self.counters["bytes_stored"] += entry.nbytes
        if self.residency is not None:  # the writer's copy is in: the bytes are final
            self.residency.publish(entry.key, entry.nbytes, entry.dtype, entry.shape, entry.extents)
        if self.observer is not None:
            self.observer.slab_stored(entry.key, entry.nbytes)
        return None

    def abort(self, conn: int, token: int) -> ErrorReply | None:
        entry = self._owned_reservation(conn, token)
        if isinstance(entry, ErrorReply):
            return entry
        self.conns[conn].reservations.discard(token)
        self._abort(token)
        return None

    def _abort(self, token: int) -> None:
        entry = self.reservations.pop(token)
        n = sum(length for _, length in entry.runs)
        owner = self.conns.get(entry.owner)  # None while close_connection aborts
        if owner is not None:
            owner.reserved_blocks -= n
        self.quotas.refund_reserve(entry.owner, n)
        if not entry.lapsed:  # a lapsed one already left the index (invariant 11)
            self._unindex_reservation(entry)
        self._free_blocks(entry)
        self.counters["aborts"] += 1
        if self.on_abort is not None:
            self.on_abort(entry.key)

    def _unindex_reservation(self, entry: Entry) -> None:
        del self.entries[entry.key]
        if self.membership is not None:
            self.membership.remove(entry.key)

    def expire_reservations(self, most: int = LAPSES_PER_SWEEP) -> int:
        """Lapse client reservations whose time is up (invariant 11), at most ``most``
        per call (the sweep runs every 0.1 s: a flood of reservations lapsing at once
        must not stall the loop): its key leaves the index now, its blocks stay with
        the holder until it commits, aborts or closes. Returns how many lapsed."""
        now = self._clock()
        heap = self._reservation_heap
        lapsed = 0
        while heap and heap[0][0] <= now and lapsed < most:
            _, token = heapq.heappop(heap)
            entry = self.reservations.get(token)
            if entry is None or entry.lapsed:
                continue  # committed or aborted since
            self._lapse(entry)
            lapsed += 1
        return lapsed

    def _lapse(self, entry: Entry) -> None:
        entry.lapsed = True
        self._unindex_reservation(entry)
        self.counters["reservations_expired"] += 1
        if self.on_abort is not None:  # a Publish waiting for this key wakes: it left the index
            self.on_abort(entry.key)

    def get(self, conn: int, keys: list[str], count_misses: bool = True) -> list[Hit | None]:
        """Pin and return each READY key. ``count_misses=False``: the caller (the tier
        coordinator, which may still promote a missing key) counts the misses itself."""
        out: list[Hit | None] = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.state is not State.READY:
                if count_misses:
                    self.counters["misses"] += 1
                out.append(None)
                continue
            self.counters["hits"] += 1
            self.counters["bytes_loaded"] += entry.nbytes
            self.lru.touch(key)
            pin_id = self._pin(entry, conn)
            out.append(Hit(pin_id, entry.nbytes, entry.dtype, entry.shape, entry.extents))
        return out

    def served(self, keys: list[str], nbytes: list[int], has_hits: int) -> None:
        """Count what a client answered from the residency index, as a Get or Has would
        have: a hit and its bytes per copied key, and touch the ones still present in
        the LRU (an entry read often must not be evicted because its reads were local).
        Nothing a client reports is counted beyond what the broker can verify: a key
        counts only while its entry is READY, with at most that entry's bytes; has()
        hits (no keys named) at most SERVED_HAS_HITS_MAX per frame."""
        counters = self.counters
        counters["has_hits"] += min(max(0, has_hits), SERVED_HAS_HITS_MAX)
        entries, touch = self.entries, self.lru.touch
        hits = loaded = 0
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None or entry.state is not State.READY:
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
        return self._pin(entry, conn)

    def ready(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.state is State.READY else None

    def lease_entry(self, conn: int, key: str, expires_at: float) -> bool:
        """Lease the READY ``key`` to ``conn`` until ``expires_at`` (clock time) without
        counting a hit: a promoted entry landing for a connection that leased it on a
        lower tier. False if the key is not READY or the connection is gone."""
        entry = self.ready(key)
        if entry is None or conn not in self.conns:
            return False
        self._lease(conn, entry, expires_at)
        return True

    def count(self, counter: str, n: int = 1) -> None:
        self.counters[counter] += n

    def now(self) -> float:
        return self._clock()

    def release(self, conn: int, pins: list[int]) -> ErrorReply | None:
        state = self.conns[conn]
        unknown = [p for p in pins if p not in state.pins]
        for pin_id in pins:
            if pin_id in state.pins:
                self._unpin(pin_id)
        if unknown:
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN,
                f"pins {unknown[:8]} are not held by this connection (released twice?)",
            )
        return None

    def has(
        self, conn: int, keys: list[str], lease_ms: int = 0, count_misses: bool = True
    ) -> list[bool]:
        hits: list[bool] = []
        now = self._clock() if lease_ms > 0 else 0.0
        for key in keys:
            entry = self.entries.get(key)
            hit = entry is not None and entry.state is State.READY
            hits.append(hit)
            if not hit:
                if count_misses:
                    self.counters["has_misses"] += 1
                continue
            self.counters["has_hits"] += 1
            if lease_ms > 0:
                self._lease(conn, entry, now + lease_ms / 1000.0)
        return hits

    def _lease(self, conn: int, entry: Entry, expires_at: float) -> None:
        state = self.conns[conn]
        pin_id = state.leases.get(entry.key)
        if pin_id is not None:
            pin = self.pins.get(pin_id)
            if pin is not None and pin.entry is entry:
                if expires_at > pin.expires_at:
                    pin.expires_at = expires_at
                    heapq.heappush(self._lease_heap, (expires_at, pin_id))
                return
            self._unpin(pin_id)
        state.leases[entry.key] = self._pin(entry, conn, expires_at)

    def unlease(self, conn: int, keys: list[str]) -> None:
        """End ``conn``'s leases on ``keys``; keys it holds no lease on are ignored."""
        state = self.conns.get(conn)
        if state is None:
            return
        for key in keys:
            pin_id = state.leases.get(key)
            if pin_id is not None:
                self._unpin(pin_id)

    def expire_leases(self) -> int:
        """End every lease whose time is up (and lapse the reservations whose time is:
        the same sweep, every 0.1 s and before any eviction). Returns the leases ended."""
        self.expire_reservations()
        now = self._clock()
        expired = 0
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, pin_id = heapq.heappop(heap)
            pin = self.pins.get(pin_id)
            # A lease extended after this heap item was pushed has a later expiry.
            if pin is not None and pin.expires_at and pin.expires_at <= now:
                self._unpin(pin_id)
                expired += 1
        return expired

    def delete(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.state is not State.READY:
                out.append(False)
                continue
            self._drop_ready(entry)
            self.counters["deletes"] += 1
            out.append(True)
        return out

    def clear(self) -> int:
        ready = [e for e in self.entries.values() if e.state is State.READY]
        for entry in ready:
            self._drop_ready(entry)
        return len(ready)

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        bs = self.block_size
        ready = len(self.lru)
        return {
            "entries": ready,
            "reserved_entries": len(self.reservations),
            "used_bytes": self.used_blocks * bs,
            "reserved_bytes": self.reserved_blocks * bs,
            "arena_bytes": self.arenas.blocks * bs,
            "arenas": len(self.arenas),
            "free_bytes": self.allocator.free_blocks * bs,
            "capacity_bytes": self.capacity_bytes,
            "block_size": bs,
            "max_entry_bytes": self.max_entry_bytes,
            "pinned_entries": self.pinned_entries,
            "pins": len(self.pins),
            "free_runs": self.allocator.free_runs,
            "lapsed_reservations": sum(1 for e in self.reservations.values() if e.lapsed),
            **self.quotas.stats(),
            # Saturating: a counter a client could drive (hits, bytes_loaded through
            # Served) must never make a Stats reply unencodable for everyone.
            **{name: min(value, COUNTER_MAX) for name, value in self.counters.items()},
        }

    def check(self) -> None:
        self.allocator.check()
        assert (
            self.allocator.free_blocks
            + self.used_blocks
            + self.reserved_blocks
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
        assert len(owned) == self.used_blocks + self.reserved_blocks, "block accounting drift"
        assert sum(c.reserved_blocks for c in self.conns.values()) == sum(
            length for e in self.reservations.values() for _, length in e.runs
        ), "per-connection reserved blocks drift"
        used_map = self.allocator._used  # noqa: SLF001 (the check reads the allocator's map)
        self.arenas.check(owned, used_map)
        for entry in self.reservations.values():  # invariant 11
            assert entry.lapsed == (self.entries.get(entry.key) is not entry), "lapse drift"
        self.quotas.check(self._holdings())
        assert sum(1 for e in entries if e.pins) == self.pinned_entries, "pinned count drift"

    def _live_entries(self) -> list[Entry]:
        """Indexed entries, lapsed reservations and doomed ones still pinned (each once)."""
        uniq = {id(e): e for e in self.entries.values()}
        uniq.update((id(e), e) for e in self.reservations.values())
        uniq.update((id(p.entry), p.entry) for p in self.pins.values())
        return list(uniq.values())

    def _holdings(self) -> dict[int, tuple[int, int, int, int, int, dict[Entry, int]]]:
        """What each connection holds, from the store's own records (for quotas.check)."""
        out: dict[int, tuple[int, int, int, int, int, dict[Entry, int]]] = {}
        for conn, state in self.conns.items():
            pinned: dict[Entry, int] = {}
            pins = leases = 0
            for pin_id in state.pins:
                pin = self.pins[pin_id]
                pinned[pin.entry] = pinned.get(pin.entry, 0) + 1
                if pin.expires_at:
                    leases += 1
                else:
                    pins += 1
            reserved = sum(
                length for t in state.reservations for _, length in self.reservations[t].runs
            )
            arena = len(self.arenas.held(conn))
            out[conn] = (len(state.reservations), reserved, arena, pins, leases, pinned)
        return out
