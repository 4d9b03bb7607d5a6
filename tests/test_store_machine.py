"""A hypothesis state machine for the entry store: reserve/commit/abort, get/release,
leases (has with a lease, unlease, expiry), delete, eviction under pressure, clear and
close_connection over several connections, and put arenas (grant, place from one's own
arena or from blocks it does not hold, close); ``Store.check()`` after every step plus
a model of what each connection holds, so a pinned or leased entry that disappears, a
block handed to two entries or arenas, or a placement of blocks the connection does not
hold, fails the run.

The limits of issue 40 (deliverable 7) are part of the model: connections 1 and 2
belong to one client process, 3 to another of the same uid, and the store's quotas
(broker/quotas.py) are small enough to be reached: after every step no process or uid
holds more than its limits (held blocks, open reservations with zero-byte ones,
pins, leases, connections), every refusal is one the books justify, and a client
reservation lapses after its TTL (its key leaves the index, its commit is refused,
its blocks are not reused before the holder is done)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_ec_broker.broker.quotas import PrincipalLimits, QuotaLimits
from lmcache_ec_broker.broker.store import Entry, State, Store
from lmcache_ec_broker.protocol import (
    ArenaReply,
    ErrorReply,
    PlaceReply,
    ReserveReply,
    ReserveStatus,
)

BS = 4096
NBLOCKS = 24
CONNS = (1, 2, 3)
PEERS = {1: (10, 1000), 2: (10, 1000), 3: (20, 1000)}  # conn -> (pid, uid)
TTL = 2.0
LIMITS = QuotaLimits(
    process=PrincipalLimits(connections=2, held_blocks=12, reservations=3, pins=6, leases=6),
    uid=PrincipalLimits(connections=3, held_blocks=18, reservations=5, pins=10, leases=10),
)
KEYS = [f"k{i}" for i in range(8)]

conns = st.sampled_from(CONNS)
keys = st.sampled_from(KEYS)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        # Arenas: 4 blocks per connection, 6 (a quarter) in all, 2 journal slots for 3
        # connections (the third gets no arena while two hold one).
        self.store = Store(
            NBLOCKS * BS,
            BS,
            clock=self.clock,
            arena_bytes=4 * BS,
            arena_slots=2,
            quotas=LIMITS,
            reservation_ttl_s=TTL,
        )
        for c in CONNS:
            self._open(c)
        self.arenas: dict[int, set[int]] = {c: set() for c in CONNS}  # what each was granted
        self.tokens: dict[int, tuple[int, str]] = {}  # token -> (conn, key)
        self.blocks: dict[int, int] = {}  # token -> its blocks
        self.pins: dict[int, tuple[int, str]] = {}  # pin id -> (conn, key) from get()
        self.leases: dict[tuple[int, str], float] = {}  # (conn, key) -> expiry
        self.deleted_while_pinned: set[str] = set()
        self.lapse_at: dict[int, float] = {}  # token -> when it lapses
        # Principals past their held bytes by the one allowed way: a pin or lease
        # asked while holding nothing (quotas.py), until they are back under it.
        self.excused: set[str] = set()

    def _empty_handed(self, conn: int) -> set[str]:
        return {h.who for h in self.store.quotas.principals(conn) if not h.held_blocks}

    def _open(self, conn: int) -> None:
        self.store.open_connection(conn)
        assert self.store.admit_peer(conn, *PEERS[conn]) is None

    def _over(self, conn: int, reservations: int, blocks: int) -> bool:
        """Whether a principal of ``conn`` would pass a limit (the only excuse for a
        reservation refused by the quotas)."""
        return any(
            h.reservations + reservations > h.limits.reservations
            or h.held_blocks + blocks > h.limits.held_blocks
            for h in self.store.quotas.principals(conn)
        )

    # ------------------------------------------------------------ writes

    @rule(conn=conns, key=keys, nblocks=st.integers(0, 10))
    def reserve(self, conn: int, key: str, nblocks: int) -> None:
        self.store.expire_reservations()  # as the broker's sweep would have by now
        before = self.store.entries.get(key)
        over = self._over(conn, 1, nblocks)
        r = self.store.reserve(conn, key, nblocks * BS, "uint8", [nblocks * BS])
        if isinstance(r, ErrorReply):
            if r.code == "too_many_reservations":  # per connection (invariant 4) or quotas
                held = sum(self.blocks[t] for t, (c, _) in self.tokens.items() if c == conn)
                per_conn = held and held + nblocks > self.store.max_reserved_blocks_per_conn
                assert per_conn or over, r
                return
            assert r.code == "no_space", r
            return
        assert isinstance(r, ReserveReply)
        if before is not None:
            want = (
                ReserveStatus.PRESENT if before.state is State.READY else ReserveStatus.IN_PROGRESS
            )
            assert r.status == want
            return
        assert r.status == ReserveStatus.RESERVED
        assert sum(n for _, n in r.extents) == nblocks * BS
        self.tokens[r.token] = (conn, key)
        self.blocks[r.token] = nblocks
        self.lapse_at[r.token] = self.clock.now + TTL

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000), commit=st.booleans())
    def finish(self, i: int, commit: bool) -> None:
        token = sorted(self.tokens)[i % len(self.tokens)]
        conn, key = self.tokens.pop(token)
        entry = self.store.reservations[token]
        if self.lapse_at.pop(token) <= self.clock.now:  # lapsed (invariant 11)
            assert entry.lapsed and self.store.entries.get(key) is not entry
            if commit:
                r = self.store.commit(conn, token)
                assert isinstance(r, ErrorReply) and "reservation_ttl_s" in r.message, r
            else:
                assert self.store.abort(conn, token) is None
            assert token not in self.store.reservations
            assert self.store.entries.get(key) is not entry
            return
        if commit:
            assert self.store.commit(conn, token) is None
            assert self.store.entries[key].state is State.READY
        else:
            assert self.store.abort(conn, token) is None
            assert key not in self.store.entries

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000), other=conns)
    def foreign_commit_refused(self, i: int, other: int) -> None:
        token = sorted(self.tokens)[i % len(self.tokens)]
        conn, _key = self.tokens[token]
        if other != conn:
            assert isinstance(self.store.commit(other, token), ErrorReply)

    # ------------------------------------------------------------ put arenas

    @rule(conn=conns, nblocks=st.integers(0, 6))
    def grant(self, conn: int, nblocks: int) -> None:
        r = self.store.grant(conn, nblocks * BS)  # may evict unpinned entries
        assert isinstance(r, ArenaReply)
        new = {b for s, n in r.runs for b in range(s, s + n)}
        owned = {b for e in self.store._live_entries() for s, n in e.runs for b in range(s, s + n)}
        assert not (new & owned), "granted blocks of an entry"
        assert not (new & set().union(*self.arenas.values())), "granted blocks of an arena"
        assert len(new) <= nblocks
        self.arenas[conn] |= new
        assert len(self.arenas[conn]) <= 4
        if r.slot < 0:
            assert not new and self.store.arena_slot(conn) == -1

    @rule(
        conn=conns,
        key=st.sampled_from([*KEYS, ""]),
        nblocks=st.integers(0, 4),
        partial=st.booleans(),
        how=st.sampled_from(["own", "own", "foreign", "twice", "count"]),
        start=st.integers(0, NBLOCKS - 1),
        reverse=st.booleans(),
    )
    def place(
        self,
        conn: int,
        key: str,
        nblocks: int,
        partial: bool,
        how: str,
        start: int,
        reverse: bool,
    ) -> None:
        nbytes = max(nblocks * BS - (1 if partial else 0), 0)
        need = -(-nbytes // BS)
        mine = sorted(self.arenas[conn])
        if how == "own":  # valid when the arena holds enough
            blocks = mine[:need]
        elif how == "foreign":  # the right count, anywhere (others' arenas, entries, free)
            blocks = [(start + 5 * i) % NBLOCKS for i in range(need)]
        elif how == "twice":  # one block named twice
            blocks = mine[: max(need - 1, 0)] + mine[:1]
        else:  # one block too many
            blocks = mine[: need + 1]
        if reverse:
            blocks = blocks[::-1]
        runs = [(b, 1) for b in blocks]
        arena_before = set(self.arenas[conn])
        before = self.store.entries.get(key)
        r = self.store.place(conn, key, nbytes, "uint8", [nbytes], runs)
        valid = (
            key != ""
            and self.store.arena_slot(conn) >= 0
            and len(set(blocks)) == len(blocks) == -(-nbytes // BS)
            and set(blocks) <= arena_before
        )
        if not valid:
            assert isinstance(r, ErrorReply), (r, blocks, arena_before)
            assert self.store.entries.get(key) is before
            return
        if before is not None:  # present or reserved: kept; the blocks stay in the arena
            assert r == PlaceReply(False, runs)
            assert self.store.entries[key] is before
            return
        assert isinstance(r, Entry) and r.state is State.READY
        assert self.store.entries[key] is r and r.runs == runs and r.nbytes == nbytes
        self.arenas[conn] -= set(blocks)

    # ------------------------------------------------------------ reads

    @rule(conn=conns, ks=st.lists(keys, min_size=1, max_size=3))
    def get(self, conn: int, ks: list[str]) -> None:
        if (refusal := self.store.admit_pins(conn, ks)) is not None:  # as the server does
            assert refusal.code == "too_many_pins", refusal
            return
        self.excused |= self._empty_handed(conn)
        for key, hit in zip(ks, self.store.get(conn, ks), strict=True):
            entry = self.store.entries.get(key)
            assert (hit is not None) == (entry is not None and entry.state is State.READY)
            if hit is not None:
                assert hit.extents == entry.extents
                self.pins[hit.pin] = (conn, key)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        pin = sorted(self.pins)[i % len(self.pins)]
        conn, _key = self.pins.pop(pin)
        assert self.store.release(conn, [pin]) is None
        assert isinstance(self.store.release(conn, [pin]), ErrorReply)  # twice: refused

    @rule(
        conn=conns,
        ks=st.lists(keys, min_size=1, max_size=3),
        lease_ms=st.sampled_from([0, 500, 5000]),
    )
    def has(self, conn: int, ks: list[str], lease_ms: int) -> None:
        if lease_ms and (refusal := self.store.admit_leases(conn, ks)) is not None:
            assert refusal.code == "too_many_leases", refusal
            return
        if lease_ms:
            self.excused |= self._empty_handed(conn)
        hits = self.store.has(conn, ks, lease_ms)
        for key, hit in zip(ks, hits, strict=True):
            entry = self.store.entries.get(key)
            assert hit == (entry is not None and entry.state is State.READY)
            if hit and lease_ms:
                expiry = self.clock.now + lease_ms / 1000
                self.leases[(conn, key)] = max(self.leases.get((conn, key), 0.0), expiry)

    @rule(conn=conns, ks=st.lists(keys, min_size=1, max_size=3))
    def unlease(self, conn: int, ks: list[str]) -> None:
        self.store.unlease(conn, ks)
        for key in ks:
            self.leases.pop((conn, key), None)

    @rule(dt=st.sampled_from([0.1, 0.6, 3.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt
        self.store.expire_leases()
        self.leases = {k: t for k, t in self.leases.items() if t > self.clock.now}

    # ------------------------------------------------------------ removal

    @rule(ks=st.lists(keys, min_size=1, max_size=3))
    def delete(self, ks: list[str]) -> None:
        ready = {k for k in ks if (e := self.store.entries.get(k)) and e.state is State.READY}
        want = [k in ready and k not in ks[:i] for i, k in enumerate(ks)]  # once per key
        assert self.store.delete(ks) == want
        self._forget(ready)

    @rule()
    def clear(self) -> None:
        ready = {k for k, e in self.store.entries.items() if e.state is State.READY}
        assert self.store.clear() == len(ready)
        self._forget(ready)

    def _forget(self, gone: set[str]) -> None:
        self.leases = {(c, k): t for (c, k), t in self.leases.items() if k not in gone}
        # Pins on deleted entries stay valid (blocks freed at the last release).
        self.deleted_while_pinned |= {k for _c, k in self.pins.values() if k in gone}

    @rule(conn=conns)
    def close_connection(self, conn: int) -> None:
        self.store.close_connection(conn)
        self.tokens = {t: v for t, v in self.tokens.items() if v[0] != conn}
        self.pins = {p: v for p, v in self.pins.items() if v[0] != conn}
        self.leases = {k: t for k, t in self.leases.items() if k[0] != conn}
        self.lapse_at = {t: at for t, at in self.lapse_at.items() if t in self.tokens}
        self.arenas[conn] = set()  # back to the allocator
        self._open(conn)
        assert self.store.arena_slot(conn) == -1

    @rule(pid=st.sampled_from([10, 20, 30]), uid=st.sampled_from([1000, 2000]))
    def another_connection(self, pid: int, uid: int) -> None:
        """A fourth connection: refused past a process's or uid's connection limit."""
        conn = 99
        self.store.open_connection(conn)
        refusal = self.store.admit_peer(conn, pid, uid)
        procs = {10: 2, 20: 1, 30: 0}[pid]  # a process is its pid, whatever its uid
        if procs + 1 > 2 or (uid == 1000 and 3 + 1 > 3):
            assert refusal is not None and refusal.code == "too_many_connections", refusal
            assert "max_connections_per_" in refusal.message
        else:
            assert refusal is None
        self.store.close_connection(conn)

    # ------------------------------------------------------------ invariants

    @invariant()
    def within_limits(self) -> None:
        """No process or uid holds more than its limits (deliverable 7)."""
        for c in CONNS:
            for h in self.store.quotas.principals(c):
                lim = h.limits
                assert h.connections <= lim.connections, h.who
                if h.held_blocks <= lim.held_blocks:
                    self.excused.discard(h.who)
                assert h.held_blocks <= lim.held_blocks or h.who in self.excused, h.who
                assert h.reserved_blocks + h.arena_blocks <= lim.held_blocks, h.who
                assert h.reservations <= lim.reservations, h.who
                assert h.pins <= lim.pins and h.leases <= lim.leases, h.who

    @invariant()
    def consistent(self) -> None:
        store = self.store
        store.check()
        # Everything pinned by a get or covered by a live lease is still READY (never
        # evicted), unless it was explicitly deleted.
        protected = {k for _c, k in self.pins.values()} | {k for (_c, k) in self.leases}
        for key in protected - self.deleted_while_pinned:
            entry = store.entries.get(key)
            assert entry is not None and entry.state is State.READY, f"{key} lost while pinned"
        # The store's pins are exactly the model's gets plus live leases.
        leased = {(p.conn, p.entry.key) for p in store.pins.values() if p.expires_at}
        assert leased == set(self.leases), (leased, set(self.leases))
        got = {pid for pid, p in store.pins.items() if not p.expires_at}
        assert got == set(self.pins)
        assert set(store.reservations) == set(self.tokens)
        # Each arena is exactly what was granted to it and not yet placed.
        for c in CONNS:
            assert store.arenas.held(c) == self.arenas[c]


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
