"""What each client process and each uid may hold at once: the books behind the
broker's fairness limits (docs/reliability.md "Limits").

Per-connection caps alone do not hold a neighbour back: a process opens as many
connections as it likes, and a uid starts as many processes. So every client
connection is charged, as it is admitted, to two *principals* the kernel names
(``SO_PEERCRED``, never the peer's own words): its **process** (pid) and its
**uid**; and everything it holds is counted against both:

- connections;
- open reservations, as entries (zero-byte ones included) and as blocks;
- get pins and has/lookup leases, as counts;
- *held blocks*: what the principal keeps from eviction -- its open reservations,
  its put arenas, and every entry it pins or leases (each entry once per principal,
  however often it is pinned). Held blocks are what a neighbour would starve the
  others with, so one budget covers them all.

When all vLLM instances of a node run as one uid (the common case) the per-process
limits are the ones that keep one process from starving the others; the per-uid
limits, larger, keep one uid from starving another. A peer whose pid the kernel
cannot show (0: it lives in another pid namespace, e.g. a sidecar without a shared
pid namespace) is charged as a process of its own per connection: its uid's limits
still hold.

``QuotaBooks`` owns this state and nothing else: the store tells it what a
connection took or gave back (``charge_*``/``refund_*``) and asks it before granting
(``admit_*``, ``arena_room``). Connections it was never told of (the broker's own,
negative ids; unit tests that open plain connections) are charged to nobody.

Invariants (``check`` recomputes them from the store's own records):
- each principal's counters equal the sum over its open connections of what they
  hold (reservations, lapsed ones included, arena blocks, pins, leases), and its
  held blocks count each entry it pins or leases once;
- an admission never lets a principal past a limit: a request that would is
  refused whole, with the setting to raise named, and changes nothing. One
  exception, so that any entry the slab holds can be read: a principal that holds
  nothing may pin or lease what one request asks, whatever its size (reservations
  have no such exception: a first reservation is bounded too).
  (Promotions from a lower tier are charged when their entry lands, so one request
  may overshoot by what it promoted; the next is refused.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..protocol import ErrorCode, ErrorReply
from ..sizes import format_size

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from .entries import Entry


@dataclass(slots=True, frozen=True)
class PrincipalLimits:
    """One principal kind's limits (blocks for bytes)."""

    connections: int
    held_blocks: int
    reservations: int
    pins: int
    leases: int


@dataclass(slots=True, frozen=True)
class QuotaLimits:
    process: PrincipalLimits
    uid: PrincipalLimits

    @staticmethod
    def resolve(
        nblocks: int,
        block_size: int,
        max_connections: int = 1024,
        connections_per_process: int = 64,
        connections_per_uid: int = 0,
        held_bytes_per_process: int = 0,
        held_bytes_per_uid: int = 0,
        reservations_per_process: int = 0,
        reservations_per_uid: int = 0,
        pins_per_process: int = 1 << 17,
        pins_per_uid: int = 1 << 19,
        leases_per_process: int = 1 << 17,
        leases_per_uid: int = 1 << 19,
        other_uids: bool = True,
    ) -> QuotaLimits:
        """The limits with their defaults filled in (0: the default share): held bytes
        half the slab per process; open reservations a quarter of the slab's block
        count per process (at least 64), the block count per uid (at least 256): each,
        zero-byte ones too, is a key in the membership filter, which is sized per
        block (shm/filter.py), so more would make every client's misses ask the
        broker; per uid three quarters of the slab and of
        ``max_connections`` when ``other_uids`` (the config admits uids besides the
        broker's own: allowed_uids, socket_group), else the whole of each (one uid
        has no other to be protected from; root aside, which can read the slab
        anyway). Put arenas are bounded by the held bytes (and, all together, by a
        quarter of the slab: ArenaBooks)."""

        def blocks(nbytes: int, default: int) -> int:
            return max(1, -(-nbytes // block_size) if nbytes else default)

        share = (lambda n: max(1, n * 3 // 4)) if other_uids else (lambda n: n)
        return QuotaLimits(
            process=PrincipalLimits(
                connections=connections_per_process,
                held_blocks=blocks(held_bytes_per_process, nblocks // 2),
                reservations=reservations_per_process or max(64, nblocks // 4),
                pins=pins_per_process,
                leases=leases_per_process,
            ),
            uid=PrincipalLimits(
                connections=connections_per_uid or share(max_connections),
                held_blocks=blocks(held_bytes_per_uid, share(nblocks)),
                reservations=reservations_per_uid or max(256, nblocks),
                pins=pins_per_uid,
                leases=leases_per_uid,
            ),
        )

    @staticmethod
    def from_config(cfg: BrokerConfig, nblocks: int) -> QuotaLimits:
        return QuotaLimits.resolve(
            nblocks,
            cfg.block_size,
            max_connections=cfg.max_connections,
            connections_per_process=cfg.max_connections_per_process,
            connections_per_uid=cfg.max_connections_per_uid,
            held_bytes_per_process=cfg.max_held_bytes_per_process,
            held_bytes_per_uid=cfg.max_held_bytes_per_uid,
            reservations_per_process=cfg.max_reservations_per_process,
            reservations_per_uid=cfg.max_reservations_per_uid,
            pins_per_process=cfg.max_pins_per_process,
            pins_per_uid=cfg.max_pins_per_uid,
            leases_per_process=cfg.max_leases_per_process,
            leases_per_uid=cfg.max_leases_per_uid,
            other_uids=bool(cfg.allowed_uids or cfg.socket_group),
        )


@dataclass(slots=True, eq=False)
class Holdings:
    """What one principal holds now."""

    kind: str  # "process" or "uid" (the settings' suffix)
    who: str  # "process (pid 12)", "uid 1000": for refusals
    limits: PrincipalLimits
    connections: int = 0
    reservations: int = 0
    reserved_blocks: int = 0
    arena_blocks: int = 0
    pins: int = 0
    leases: int = 0
    pinned_blocks: int = 0  # blocks of the distinct entries it pins or leases
    pinned: dict[Entry, int] = field(default_factory=dict)  # entry -> its pins + leases

    @property
    def held_blocks(self) -> int:
        return self.reserved_blocks + self.arena_blocks + self.pinned_blocks

    def new_blocks(self, entries: Iterable[Entry]) -> int:
        """Blocks ``entries`` would add to its held blocks if it pinned them all."""
        seen: set[Entry] = set()
        n = 0
        for e in entries:
            if e not in self.pinned and e not in seen:
                seen.add(e)
                n += _blocks(e)
        return n


def _past_held(h: Holdings, entries: list[Entry]) -> int | None:
    """The blocks pinning ``entries`` would add to ``h``'s held bytes if that takes it
    past its limit, else None (a principal holding nothing may: see the invariants).
    The cheap bound first: most requests are far from the limit."""
    held = h.held_blocks
    if not held:
        return None
    room = h.limits.held_blocks - held
    if sum(map(_blocks, entries)) <= room:
        return None
    more = h.new_blocks(entries)
    return more if more > room else None


def _blocks(entry: Entry) -> int:
    return sum(length for _, length in entry.runs)


class QuotaBooks:
    def __init__(self, limits: QuotaLimits, block_size: int) -> None:
        self.limits = limits
        self.block_size = block_size
        self._by_conn: dict[int, tuple[Holdings, Holdings]] = {}  # conn -> (process, uid)
        self._procs: dict[int, Holdings] = {}  # pid (or -conn when unknown) -> holdings
        self._uids: dict[int, Holdings] = {}

    # ------------------------------------------------------------ connections

    def open(self, conn: int, pid: int, uid: int) -> ErrorReply | None:
        """Charge a new client connection to its process and uid, or refuse it."""
        pkey = pid if pid > 0 else -conn  # pid 0: another pid namespace, unknown
        proc = self._procs.get(pkey) or Holdings(
            "process", f"process (pid {pid})" if pid > 0 else "process", self.limits.process
        )
        user = self._uids.get(uid) or Holdings("uid", f"uid {uid}", self.limits.uid)
        for h in (proc, user):
            if h.connections + 1 > h.limits.connections:
                return ErrorReply(
                    ErrorCode.TOO_MANY_CONNECTIONS,
                    f"this {h.who} already has {h.connections} connections to the broker; "
                    f"the limit is {h.limits.connections} (max_connections_per_{h.kind}): "
                    "close idle clients or raise the limit",
                )
        self._procs[pkey] = proc
        self._uids[uid] = user
        proc.connections += 1
        user.connections += 1
        self._by_conn[conn] = (proc, user)
        return None

    def close(self, conn: int) -> None:
        """``conn`` closed; the store has refunded everything it held first."""
        pair = self._by_conn.pop(conn, None)
        if pair is None:
            return
        for h, table in zip(pair, (self._procs, self._uids), strict=True):
            h.connections -= 1
            if not h.connections:
                assert not h.held_blocks and not h.pins and not h.leases, "held past close"
                for key, other in list(table.items()):
                    if other is h:
                        del table[key]

    def principals(self, conn: int) -> tuple[Holdings, ...]:
        return self._by_conn.get(conn, ())

    # ------------------------------------------------------------ admission

    def admit_reserve(self, conn: int, nblocks: int) -> ErrorReply | None:
        for h in self.principals(conn):
            if h.reservations + 1 > h.limits.reservations:
                return ErrorReply(
                    ErrorCode.TOO_MANY_RESERVATIONS,
                    f"this {h.who} holds {h.reservations} open reservations (zero-byte ones "
                    f"included); the limit is {h.limits.reservations} "
                    f"(max_reservations_per_{h.kind}): commit or abort open reservations "
                    "first (BrokerClient commits each put after its copy) or raise the limit",
                )
            if h.held_blocks + nblocks > h.limits.held_blocks:
                return self._held_refusal(h, ErrorCode.TOO_MANY_RESERVATIONS, nblocks, "reserve")
        return None

    def admit_pins(self, conn: int, n: int, entries: list[Entry]) -> ErrorReply | None:
        for h in self.principals(conn):
            if h.pins + n > h.limits.pins:
                return ErrorReply(
                    ErrorCode.TOO_MANY_PINS,
                    f"this {h.who} holds {h.pins} pins and asked for {n} more; the limit is "
                    f"{h.limits.pins} (max_pins_per_{h.kind}): release the pins of earlier "
                    "gets (BrokerClient does after each copy) or raise the limit",
                )
            if (more := _past_held(h, entries)) is not None:
                return self._held_refusal(h, ErrorCode.TOO_MANY_PINS, more, "pin")
        return None

    def admit_leases(self, conn: int, new: int, entries: list[Entry]) -> ErrorReply | None:
        for h in self.principals(conn):
            if h.leases + new > h.limits.leases:
                return ErrorReply(
                    ErrorCode.TOO_MANY_LEASES,
                    f"this {h.who} holds {h.leases} leases and asked for up to {new} more; "
                    f"the limit is {h.limits.leases} (max_leases_per_{h.kind}): end leases "
                    "with unlease once loaded, use a shorter lease_ms, or raise the limit",
                )
            if (more := _past_held(h, entries)) is not None:
                return self._held_refusal(h, ErrorCode.TOO_MANY_LEASES, more, "lease")
        return None

    def arena_room(self, conn: int) -> int | None:
        """How many more arena blocks ``conn``'s principals' held bytes allow (None:
        no limit)."""
        pair = self.principals(conn)
        if not pair:
            return None
        return max(0, min(h.limits.held_blocks - h.held_blocks for h in pair))

    def _held_refusal(self, h: Holdings, code: str, more: int, what: str) -> ErrorReply:
        bs = self.block_size
        return ErrorReply(
            code,
            f"this {h.who} keeps {format_size(h.held_blocks * bs)} of the slab from eviction "
            f"(open reservations {format_size(h.reserved_blocks * bs)}, put arenas "
            f"{format_size(h.arena_blocks * bs)}, pinned or leased entries "
            f"{format_size(h.pinned_blocks * bs)}) and this {what} would add "
            f"{format_size(more * bs)}; the limit is {format_size(h.limits.held_blocks * bs)} "
            f"(max_held_bytes_per_{h.kind}): commit, abort, release or unlease first, or "
            "raise the limit",
        )

    # ------------------------------------------------------------ charges

    def charge_reserve(self, conn: int, nblocks: int) -> None:
        for h in self.principals(conn):
            h.reservations += 1
            h.reserved_blocks += nblocks

    def refund_reserve(self, conn: int, nblocks: int) -> None:
        for h in self.principals(conn):
            h.reservations -= 1
            h.reserved_blocks -= nblocks

    def charge_arena(self, conn: int, nblocks: int) -> None:
        for h in self.principals(conn):
            h.arena_blocks += nblocks

    def charge_pin(self, conn: int, entry: Entry, lease: bool) -> None:
        for h in self.principals(conn):
            if lease:
                h.leases += 1
            else:
                h.pins += 1
            n = h.pinned.get(entry, 0)
            if not n:
                h.pinned_blocks += _blocks(entry)
            h.pinned[entry] = n + 1

    def refund_pin(self, conn: int, entry: Entry, lease: bool) -> None:
        """Before the entry's blocks can be freed (its runs are what was charged)."""
        for h in self.principals(conn):
            if lease:
                h.leases -= 1
            else:
                h.pins -= 1
            n = h.pinned[entry] - 1
            if n:
                h.pinned[entry] = n
            else:
                del h.pinned[entry]
                h.pinned_blocks -= _blocks(entry)

    # ------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        top = max((h.held_blocks for h in self._procs.values()), default=0)
        return {
            "client_processes": len(self._procs),
            "client_uids": len(self._uids),
            # what the process keeping most of the slab from eviction keeps
            "top_process_held_bytes": top * self.block_size,
        }

    def check(self, expected: dict[int, tuple[int, int, int, int, int, dict[Entry, int]]]) -> None:
        """Assert the books equal what the store's records say each connection holds:
        conn -> (reservations, reserved blocks, arena blocks, pins, leases, entry ->
        pins + leases)."""
        want: dict[int, list] = {}
        for conn, (proc, user) in self._by_conn.items():
            got = expected.get(conn, (0, 0, 0, 0, 0, {}))
            for h in (proc, user):
                acc = want.setdefault(id(h), [h, 0, 0, 0, 0, 0, {}])
                for i in range(5):
                    acc[i + 1] += got[i]
                for e, n in got[5].items():
                    acc[6][e] = acc[6].get(e, 0) + n
        for h, res, rblocks, ablocks, pins, leases, pinned in want.values():
            assert (h.reservations, h.reserved_blocks, h.arena_blocks, h.pins, h.leases) == (
                res,
                rblocks,
                ablocks,
                pins,
                leases,
            ), f"{h.who}: quota books drift"
            assert h.pinned == pinned, f"{h.who}: pinned entries drift"
            assert h.pinned_blocks == sum(map(_blocks, pinned)), f"{h.who}: pinned blocks drift"
