"""What each connection holds and may hold: the store's per-connection books.

Per connection: its open reservations (and their blocks), its get pins and its
leases (key -> pin id), and the caps on each (``max_pins_per_connection``,
``max_leases_per_connection``, ``max_reserved_bytes_per_connection``); and, through
``QuotaBooks`` (quotas.py), what its process and uid hold and may hold.

The books own the pins -- a pin is a connection's hold on an entry: a get's, until
released, or a lease, until it ends or expires -- and each entry's pin count
(``Entry.pins``: the store never evicts an entry that has any). The store
(store.py) owns the entries and their blocks: it tells the books of a connection's
reservations (``reserved``/``reservation_ended``) and put-arena blocks
(``charge_arena``), asks them before granting (``admit_*``, ``arena_room``), and is
called back (``free_blocks``) when the last pin of an entry that left the index
(doomed) ends. What the books read of the store's records (its index, its open
reservations, its arenas) is handed to the call that reads it.

Invariants (``check`` recomputes them from the store's records):
- a connection's ``reserved_blocks`` is the blocks of its open reservations, lapsed
  ones included (store.py, invariant 11); its ``pins`` are the ids of every pin and
  lease it holds, and ``leases`` the lease among them per key (at most one); its
  process's and uid's books equal the sum over their connections;
- one connection's open reservations hold at most ``max_reserved_blocks`` blocks,
  except that a connection holding none may reserve one entry past it; its get pins
  (leases apart) stay within ``max_pins`` and its leases, with those its caller
  keeps on lower tiers, within ``max_leases``; its process's and uid's holdings stay
  within their quotas (quotas.py) -- a refused request changes nothing;
- the broker's own connections (negative ids: promotion.TIER_CONN) are not clients:
  their reservations are not capped, and they are charged to no principal.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ..protocol import ErrorCode, ErrorReply
from ..sizes import format_size
from .entries import Entry, Pin, State
from .quotas import QuotaBooks, QuotaLimits

# The store counters these books count (among the store's STORE_COUNTERS).
LIMIT_COUNTERS = (
    "pin_limit_refusals",  # requests refused: the connection held max_pins_per_connection
    "lease_limit_refusals",  # requests refused: the connection held max_leases_per_connection
    "reserve_limit_refusals",  # reserves refused: a reservation limit (quotas.py) reached
)


@dataclass(slots=True)
class ConnState:
    """One open connection's holdings (token and pin ids: the store's and the books')."""

    reservations: set[int] = field(default_factory=set)
    pins: set[int] = field(default_factory=set)
    leases: dict[str, int] = field(default_factory=dict)  # key -> pin id
    reserved_blocks: int = 0  # blocks of its open reservations (max_reserved_bytes cap)


class ConnBooks:
    """Every open connection's holdings and limits, and every pin (the module doc)."""

    def __init__(
        self,
        block_size: int,
        quotas: QuotaLimits,
        counters: dict[str, int],
        ids: Iterator[int],
        free_blocks: Callable[[Entry], None],
        max_pins: int,
        max_leases: int,
        max_reserved_blocks: int,
    ) -> None:
        self.block_size = block_size
        self.counters = counters  # the store's: LIMIT_COUNTERS are among them
        self._ids = ids  # the store's: pin ids and reservation tokens are one sequence
        self._free_blocks = free_blocks  # the store's: a doomed entry's last pin ended
        # Every pin and lease by id; ``Entry.pins`` counts an entry's (the store never
        # evicts an entry that has any, and frees a doomed one's blocks at the last).
        self.pins: dict[int, Pin] = {}
        self.pinned_entries = 0  # entries with at least one pin
        self._lease_heap: list[tuple[float, int]] = []  # (expires_at, pin id)
        # What one client connection may hold at once (admit_*): every pin and lease
        # costs broker memory until released; open reservations are in blocks.
        self.max_pins = max_pins
        self.max_leases = max_leases
        self.max_reserved_blocks = max_reserved_blocks
        self.conns: dict[int, ConnState] = {}
        # What each client process and uid holds (quotas.py).
        self.quotas = QuotaBooks(quotas, block_size)

    # ------------------------------------------------------------ connections

    def open(self, conn: int) -> None:
        self.conns[conn] = ConnState()

    def admit_peer(self, conn: int, pid: int, uid: int) -> ErrorReply | None:
        """Charge the open client connection ``conn`` to its process and uid (from
        SO_PEERCRED), or refuse it: past max_connections_per_process/uid."""
        return self.quotas.open(conn, pid, uid)

    def closing(self, conn: int) -> ConnState | None:
        """``conn`` is closing: its state, out of the books (None if it was not open).
        The store gives back what it held, then calls ``closed``."""
        return self.conns.pop(conn, None)

    def closed(self, conn: int) -> None:
        """``conn``'s holdings are all given back: its principals let it go."""
        self.quotas.close(conn)

    # ------------------------------------------------------------ admission

    def admit_pins(
        self, conn: int, keys: list[str], entries: Mapping[str, Entry]
    ) -> ErrorReply | None:
        """Refuse a get of ``keys`` (``entries``: the store's index) that could take
        ``conn`` past what it may hold. A client connection never holds more than
        ``max_pins`` get pins (leases are counted apart), so a client that never
        releases cannot grow the broker's memory without bound; its process and uid
        stay within their pin counts and held bytes (quotas.py)."""
        state = self.conns.get(conn)
        n = len(keys)
        held = 0 if state is None else len(state.pins) - len(state.leases)
        if held + n <= self.max_pins:
            if not self.quotas.principals(conn):
                return None
            refusal = self.quotas.admit_pins(conn, n, _ready(entries, keys))
            if refusal is None:
                return None
            self.counters["pin_limit_refusals"] += 1
            return refusal
        self.counters["pin_limit_refusals"] += 1
        return ErrorReply(
            ErrorCode.TOO_MANY_PINS,
            f"this connection holds {held} pins and asked for {n} more; the limit is "
            f"{self.max_pins} (max_pins_per_connection): release the pins of "
            "earlier gets (BrokerClient does after each copy) or raise the limit",
        )

    def admit_reservation(self, conn: int, nblocks: int) -> ErrorReply | None:
        """Refuse a reserve that would take ``conn``'s open reservations past
        ``max_reserved_blocks``; a connection holding none may reserve one entry past
        it, but never past its process's or uid's limits (quotas.py: open
        reservations, zero-byte ones included, and held bytes). The broker's own
        connections (negative ids: promotion.TIER_CONN) are not clients and are not
        capped."""
        state = self.conns.get(conn)
        held = 0 if state is None or conn < 0 else state.reserved_blocks
        if not held or held + nblocks <= self.max_reserved_blocks:
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
            f"the limit is {format_size(self.max_reserved_blocks * bs)} "
            "(max_reserved_bytes_per_connection): commit or abort open reservations first "
            "(BrokerClient commits each put after its copy), put fewer entries at once, or "
            "raise the limit",
        )

    def admit_leases(
        self, conn: int, keys: list[str], entries: Mapping[str, Entry], extra_held: int = 0
    ) -> ErrorReply | None:
        """Refuse a leasing has/lookup of ``keys`` (``entries``: the store's index) that
        could take ``conn`` past ``max_leases`` leases (``extra_held``: leases the
        caller keeps elsewhere, on lower tiers)."""
        state = self.conns.get(conn)
        leases = {} if state is None else state.leases
        held = len(leases) + extra_held
        fresh = {k for k in keys if k not in leases}
        new = len(fresh)
        if held + new <= self.max_leases:
            if not self.quotas.principals(conn):
                return None
            refusal = self.quotas.admit_leases(conn, new, _ready(entries, fresh))
            if refusal is None:
                return None
            self.counters["lease_limit_refusals"] += 1
            return refusal
        self.counters["lease_limit_refusals"] += 1
        return ErrorReply(
            ErrorCode.TOO_MANY_LEASES,
            f"this connection holds {held} leases and asked for up to {new} more; the limit "
            f"is {self.max_leases} (max_leases_per_connection): end leases with "
            "unlease once loaded, use a shorter lease_ms, or raise the limit",
        )

    def arena_room(self, conn: int) -> int | None:
        """How many more arena blocks ``conn``'s principals' held bytes allow (None:
        no limit)."""
        return self.quotas.arena_room(conn)

    # ------------------------------------------------------------ charges

    def reserved(self, conn: int, token: int, nblocks: int) -> None:
        """``conn`` (open) holds the new reservation ``token`` of ``nblocks``."""
        state = self.conns[conn]
        state.reservations.add(token)
        state.reserved_blocks += nblocks
        self.quotas.charge_reserve(conn, nblocks)

    def reservation_ended(self, conn: int, token: int, nblocks: int) -> None:
        """``conn``'s reservation ``token`` was committed or aborted (also while
        ``conn`` is closing: its principals are refunded all the same)."""
        state = self.conns.get(conn)
        if state is not None:
            state.reservations.discard(token)
            state.reserved_blocks -= nblocks
        self.quotas.refund_reserve(conn, nblocks)

    def charge_arena(self, conn: int, nblocks: int) -> None:
        """``conn``'s put arena grew by ``nblocks`` (shrank: negative)."""
        self.quotas.charge_arena(conn, nblocks)

    # ------------------------------------------------------------ pins and leases

    def pin(self, conn: int, entry: Entry, expires_at: float = 0.0) -> int:
        """A new pin of ``entry`` held by ``conn`` (open): a lease until ``expires_at``
        (clock time) if given, else until released. Returns its id."""
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

    def unpin(self, pin_id: int) -> bool:
        """End a pin or lease (False: no such pin). A doomed entry's last pin ending
        frees its blocks (``free_blocks``); its principals are refunded first."""
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

    def lease(self, conn: int, entry: Entry, expires_at: float) -> None:
        """Lease ``entry`` to ``conn`` (open) until ``expires_at`` at least: one lease
        per key, extended, or replaced if it was of an earlier entry of the key."""
        state = self.conns[conn]
        pin_id = state.leases.get(entry.key)
        if pin_id is not None:
            pin = self.pins.get(pin_id)
            if pin is not None and pin.entry is entry:
                if expires_at > pin.expires_at:
                    pin.expires_at = expires_at
                    heapq.heappush(self._lease_heap, (expires_at, pin_id))
                return
            self.unpin(pin_id)
        state.leases[entry.key] = self.pin(conn, entry, expires_at)

    def unlease(self, conn: int, keys: list[str]) -> None:
        """End ``conn``'s leases on ``keys``; keys it holds no lease on are ignored."""
        state = self.conns.get(conn)
        if state is None:
            return
        for key in keys:
            pin_id = state.leases.get(key)
            if pin_id is not None:
                self.unpin(pin_id)

    def release(self, conn: int, pins: list[int]) -> ErrorReply | None:
        """End ``conn``'s get pins ``pins``; refused in part if it holds some of them not."""
        state = self.conns[conn]
        unknown = [p for p in pins if p not in state.pins]
        for pin_id in pins:
            if pin_id in state.pins:
                self.unpin(pin_id)
        if unknown:
            return ErrorReply(
                ErrorCode.UNKNOWN_TOKEN,
                f"pins {unknown[:8]} are not held by this connection (released twice?)",
            )
        return None

    def end_leases(self, entry: Entry) -> None:
        """Every lease of ``entry`` ends (it left the index: no load can follow)."""
        for state in self.conns.values():
            pin_id = state.leases.get(entry.key)
            if pin_id is not None and self.pins[pin_id].entry is entry:
                self.unpin(pin_id)

    def expire_leases(self, now: float) -> int:
        """End every lease whose time is up by ``now``. Returns how many ended."""
        expired = 0
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, pin_id = heapq.heappop(heap)
            pin = self.pins.get(pin_id)
            # A lease extended after this heap item was pushed has a later expiry.
            if pin is not None and pin.expires_at and pin.expires_at <= now:
                self.unpin(pin_id)
                expired += 1
        return expired

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        return self.quotas.stats()

    def check(self, reservations: Mapping[int, Entry], arena_blocks: Callable[[int], int]) -> None:
        """Assert the books agree with the store's records (its open ``reservations`` by
        token, and each connection's arena blocks) and with each other."""
        assert sum(c.reserved_blocks for c in self.conns.values()) == sum(
            _blocks(e) for e in reservations.values()
        ), "per-connection reserved blocks drift"
        out: dict[int, tuple[int, int, int, int, int, dict[Entry, int]]] = {}
        for conn, state in self.conns.items():
            pinned: dict[Entry, int] = {}
            n_pins = n_leases = 0
            for pin_id in state.pins:
                pin = self.pins[pin_id]
                pinned[pin.entry] = pinned.get(pin.entry, 0) + 1
                if pin.expires_at:
                    n_leases += 1
                else:
                    n_pins += 1
            reserved = sum(_blocks(reservations[t]) for t in state.reservations)
            held = (len(state.reservations), reserved, arena_blocks(conn), n_pins, n_leases)
            out[conn] = (*held, pinned)
        self.quotas.check(out)


def _ready(entries: Mapping[str, Entry], keys: Iterable[str]) -> list[Entry]:
    return [e for k in keys if (e := entries.get(k)) is not None and e.state is State.READY]


def _blocks(entry: Entry) -> int:
    return sum(length for _, length in entry.runs)
