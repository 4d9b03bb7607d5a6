"""A hypothesis state machine for the entry store: reserve/commit/abort, get/release,
leases (has with a lease, unlease, expiry), delete, eviction under pressure, clear and
close_connection over several connections; ``Store.check()`` after every step plus a
model of what each connection holds, so a pinned or leased entry that disappears,
or a block handed to two entries, fails the run."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_ec_broker.broker.store import State, Store
from lmcache_ec_broker.protocol import ErrorReply, ReserveReply, ReserveStatus

BS = 4096
NBLOCKS = 24
CONNS = (1, 2, 3)
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
        self.store = Store(NBLOCKS * BS, BS, clock=self.clock)
        for c in CONNS:
            self.store.open_connection(c)
        self.tokens: dict[int, tuple[int, str]] = {}  # token -> (conn, key)
        self.pins: dict[int, tuple[int, str]] = {}  # pin id -> (conn, key) from get()
        self.leases: dict[tuple[int, str], float] = {}  # (conn, key) -> expiry
        self.deleted_while_pinned: set[str] = set()

    # ------------------------------------------------------------ writes

    @rule(conn=conns, key=keys, nblocks=st.integers(0, 10))
    def reserve(self, conn: int, key: str, nblocks: int) -> None:
        before = self.store.entries.get(key)
        r = self.store.reserve(conn, key, nblocks * BS, "uint8", [nblocks * BS])
        if isinstance(r, ErrorReply):
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

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 1000), commit=st.booleans())
    def finish(self, i: int, commit: bool) -> None:
        token = sorted(self.tokens)[i % len(self.tokens)]
        conn, key = self.tokens.pop(token)
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

    # ------------------------------------------------------------ reads

    @rule(conn=conns, ks=st.lists(keys, min_size=1, max_size=3))
    def get(self, conn: int, ks: list[str]) -> None:
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
        self.store.open_connection(conn)

    # ------------------------------------------------------------ invariants

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


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
