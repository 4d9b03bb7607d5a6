"""A hypothesis state machine for encode claims (broker/claims.py, broker/dedup.py)
over the real store and coordinator (no lower tiers: every answer is synchronous)
and a fake clock: claiming lookups, waits, reserve/commit/abort, placements of
another client's put, unclaim, connections closing, time passing with the broker's
sweep. It proves the claim policy's promises:

- no claim outlives its bounds: each belongs to an open connection, lives at most
  its claim_ms (<= MAX_CLAIM_MS) from its grant, ends when its key lands, and the
  per-connection and per-uid counts stay within their bounds;
- a waiter always ends: one still asleep waits only on keys another encoder is still
  on (a claim that ended or a put that committed or aborted woke it), and none sleeps
  past its deadline;
- a claim never makes an answer wrong: READY only for an entry READY in the slab,
  CLAIMED only for a key another connection claimed or is writing, and a lookup that
  answered CLAIMED for any key took no claim (all or nothing).

``FleetClaimsMachine`` adds other brokers through a fake of the remote tier's claim
side (they claim, release, write; the store goes down and back; write-behinds end):
all or nothing across brokers, and no claim of ours stays in the store past its node
claim unless the key landed and its write-behind is pending.
"""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmcache_ec_broker.broker.claims import MAX_CLAIM_MS
from lmcache_ec_broker.broker.coordinator import Coordinator
from lmcache_ec_broker.broker.dedup import FLEET_RECHECK_S, Dedup
from lmcache_ec_broker.broker.store import State, Store
from lmcache_ec_broker.protocol import EntryInfo, LookupState, ReserveReply, ReserveStatus

BS = 4096
CONNS = (1, 2, 3, 4)
UIDS = {1: 100, 2: 100, 3: 200, 4: 200}  # two instances of one user, two of another
KEYS = [f"k{i}" for i in range(5)]
PER_CONN, PER_UID = 3, 4

conns = st.sampled_from(CONNS)
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ClaimsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = Store(64 * BS, BS, clock=self.clock)
        self.tiers = Coordinator(self.store, [])
        self.dedup = self.tiers.dedup
        self.dedup.book.max_per_conn = PER_CONN
        self.dedup.book.max_per_uid = PER_UID
        self.open: set[int] = set()
        for c in CONNS:
            self.tiers.open_connection(c)
            self.open.add(c)
        self.tokens: dict[int, int] = {}  # token -> conn
        self.bound: dict[str, float] = {}  # key -> the latest its claim may live to
        self.loop = asyncio.new_event_loop()
        # waits asleep: (future, conn, keys it sleeps on, deadline, woken by events only)
        self.waits: list[tuple[asyncio.Future[str], int, list[str], float, bool]] = []

    def teardown(self) -> None:
        self.loop.close()

    # ------------------------------------------------------------ helpers

    def _claimed_elsewhere(self, conn: int, key: str) -> bool:
        claim = self.dedup.book.claims.get(key)
        if claim is not None and claim.expires_at > self.clock.now:
            return claim.conn != conn
        entry = self.store.entries.get(key)
        return entry is not None and entry.state is State.RESERVED and entry.owner != conn

    def _fleet_other(self, key: str) -> bool:
        """Does another broker hold a live claim on ``key`` (FleetClaimsMachine)?"""
        return False

    def _sleep(self, conn: int, keys: list[str], deadline: float) -> None:
        fut: asyncio.Future[str] = self.loop.create_future()
        self.dedup.waiters.add(keys, fut)
        # the real wait sleeps until woken only if every key's end wakes it; else it
        # looks again after FLEET_RECHECK_S (time_passes)
        local = all(self.dedup._wakes_us(conn, k) for k in keys)
        self.waits.append((fut, conn, keys, deadline, local))

    def _lookup(self, conn: int, keys: list[str], claim_ms: int) -> list[int]:
        before = {k for k, c in self.dedup.book.claims.items() if c.conn == conn}
        expected_busy = {k for k in keys if self._claimed_elsewhere(conn, k)}
        expected_busy |= {k for k in keys if self._fleet_other(k)}
        got = self.dedup.lookup(conn, UIDS[conn], keys, 0, 0, False, claim_ms)
        if not isinstance(got, list):  # asked the fleet (FleetClaimsMachine)
            got = self.loop.run_until_complete(got)
        out = [i.state for i in got]
        for key, state in zip(keys, out, strict=True):
            entry = self.store.entries.get(key)
            if state == LookupState.READY:
                assert entry is not None and entry.state is State.READY
            elif state == LookupState.CLAIMED:
                assert key in expected_busy, (key, "CLAIMED but nobody else is on it")
            else:
                assert state == LookupState.MISS
                assert entry is None or entry.state is State.RESERVED
        after = {k for k, c in self.dedup.book.claims.items() if c.conn == conn}
        if LookupState.CLAIMED in out:
            assert after <= before, "a lookup that answered CLAIMED took a claim"
        now = self.clock.now
        for key in after - before:
            self.bound[key] = now + min(claim_ms, MAX_CLAIM_MS) / 1000.0
        if claim_ms > 0 and LookupState.CLAIMED not in out:
            for key in after & before & set(keys):  # renewed, never shortened
                self.bound[key] = max(self.bound[key], now + min(claim_ms, MAX_CLAIM_MS) / 1000.0)
        return out

    # ------------------------------------------------------------ rules

    @rule(conn=conns, keys=key_lists, claim_ms=st.integers(1, 3000))
    def claiming_lookup(self, conn: int, keys: list[str], claim_ms: int) -> None:
        if conn in self.open:
            self._lookup(conn, keys, claim_ms)

    @rule(conn=conns, keys=key_lists, claim_ms=st.integers(0, 3000), wait_ms=st.integers(1, 3000))
    def wait(self, conn: int, keys: list[str], claim_ms: int, wait_ms: int) -> None:
        """WaitReady's first turn: answer now, or sleep on the keys still claimed."""
        if conn not in self.open:
            return
        out = self._lookup(conn, keys, claim_ms)
        claimed = [k for k, s in zip(keys, out, strict=True) if s == LookupState.CLAIMED]
        if claimed:
            self._sleep(conn, claimed, self.clock.now + wait_ms / 1000.0)

    @rule(conn=conns, key=st.sampled_from(KEYS))
    def reserve(self, conn: int, key: str) -> None:
        if conn in self.open:
            r = self.tiers.reserve(conn, key, BS, "uint8", [BS])
            if isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED:
                self.tokens[r.token] = conn
            if isinstance(r, ReserveReply) and r.status == ReserveStatus.PRESENT:
                assert key not in self.dedup.book.claims

    @rule(data=st.data(), commit=st.booleans())
    def finish_put(self, data: st.DataObject, commit: bool) -> None:
        live = sorted(t for t in self.tokens if t in self.store.reservations)
        if not live:
            return
        token = data.draw(st.sampled_from(live))
        conn = self.tokens.pop(token)
        key = self.store.reservations[token].key
        if commit:
            assert self.tiers.commit(conn, token) is None
            assert key not in self.dedup.book.claims  # landed: its claim is fulfilled
        else:
            assert self.tiers.abort(conn, token) is None
            assert key not in self.dedup.book.claims

    @rule(conn=conns, keys=key_lists)
    def unclaim(self, conn: int, keys: list[str]) -> None:
        if conn in self.open:
            others = {k: c.conn for k, c in self.dedup.book.claims.items() if c.conn != conn}
            self.dedup.unclaim(conn, keys)
            assert not any(c.conn == conn for k, c in self.dedup.book.claims.items() if k in keys)
            for k, c in others.items():  # another's claim is untouched
                assert self.dedup.book.claims[k].conn == c

    @rule(conn=conns)
    def close(self, conn: int) -> None:
        if conn in self.open:
            self.tiers.close_connection(conn)
            self.open.discard(conn)
            self.waits = [w for w in self.waits if w[1] != conn or self._forget(w)]
            assert conn not in self.dedup.book.by_conn

    @rule(conn=conns)
    def reopen(self, conn: int) -> None:
        if conn not in self.open:
            self.tiers.open_connection(conn)
            self.open.add(conn)

    @rule(ms=st.integers(1, 2000))
    def time_passes(self, ms: int) -> None:
        """Time passes; the broker's sweep runs (every 0.1 s: once per step here)."""
        self.clock.now += ms / 1000.0
        self.tiers.expire_leases()
        # a wait past its deadline answers (asyncio.wait's timeout) and stops sleeping
        keep = []
        for w in self.waits:
            if w[3] <= self.clock.now:
                self._forget(w)
            else:
                if not w[4] and ms >= FLEET_RECHECK_S * 1000 and not w[0].done():
                    w[0].set_result("recheck")  # the real wait looks again by then
                keep.append(w)
        self.waits = keep

    @rule()
    def woken_waits_look_again(self) -> None:
        """A woken wait re-runs its lookup (WaitReady's loop) and sleeps again if needed."""
        woken = [w for w in self.waits if w[0].done()]
        self.waits = [w for w in self.waits if not w[0].done()]
        for fut, conn, keys, deadline, _ in woken:
            self.dedup.waiters.forget(keys, fut)
            if conn not in self.open:
                continue
            out = self._lookup(conn, keys, 0)
            claimed = [k for k, s in zip(keys, out, strict=True) if s == LookupState.CLAIMED]
            if claimed:
                self._sleep(conn, claimed, deadline)

    def _forget(self, w: tuple[asyncio.Future[str], int, list[str], float, bool]) -> bool:
        self.dedup.waiters.forget(w[2], w[0])
        return False

    # ------------------------------------------------------------ invariants

    @invariant()
    def claims_within_bounds(self) -> None:
        book = self.dedup.book
        book.check()
        now = self.clock.now
        for key, claim in book.claims.items():
            assert claim.conn in self.open, "a claim outlived its connection"
            assert claim.expires_at > now, "a claim outlived its TTL past the sweep"
            assert claim.expires_at <= self.bound[key] + 1e-9, "a claim outlived its claim_ms"
            entry = self.store.entries.get(key)
            assert entry is None or entry.state is not State.READY, "a claim on a landed key"
        for keys in book.by_conn.values():
            assert len(keys) <= PER_CONN
        for n in book.per_uid.values():
            assert n <= PER_UID

    @invariant()
    def no_wait_sleeps_for_nothing(self) -> None:
        for fut, conn, keys, deadline, local in self.waits:
            assert deadline > self.clock.now
            if local and not fut.done():
                for key in keys:
                    assert self._claimed_elsewhere(conn, key), (
                        f"a wait sleeps on {key} although nobody else is on it (missed wake)"
                    )

    @invariant()
    def store_consistent(self) -> None:
        self.store.check()


ClaimsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestClaimsMachine = ClaimsMachine.TestCase


# ---------------------------------------------------------------- across brokers


class FakeFleet:
    """The remote tier's fleet-claim side (tiers/remote/tier.py) over an in-memory store:
    claims of this broker ("me") and of others with deadlines, values written, and a
    store that may be down (no answer: None). Answers at once (the machine drives time)."""

    keeps_fleet_claims = True

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.claims: dict[str, tuple[str, float]] = {}  # key -> (owner, deadline)
        self.values: set[str] = set()
        self.held: set[str] = set()  # the tier's _fleet_held
        self.down = False

    def live(self, key: str) -> tuple[str, float] | None:
        c = self.claims.get(key)
        return c if c is not None and c[1] > self.clock.now else None

    async def claim_fleet(
        self, keys: list[str], ttl_ms: int, budget_s: float = 0.0
    ) -> list[bool | None]:
        if self.down:
            return [None] * len(keys)
        out: list[bool | None] = []
        for key in keys:
            c = self.live(key)
            if c is None:
                self.claims[key] = ("me", self.clock.now + ttl_ms / 1000.0)
            won = c is None or c[0] == "me"
            if won and key in self.values:  # given back: the value is there already
                del self.claims[key]
                won = False
            if won:
                self.held.add(key)
            out.append(won)
        return out

    async def claimed_fleet(self, keys: list[str], budget_s: float = 0.0) -> list[bool]:
        if self.down:
            return [False] * len(keys)
        return [(c := self.live(k)) is not None and c[0] != "me" for k in keys]

    def unclaim_fleet(self, keys: list[str]) -> None:
        for key in keys:
            if key in self.held:
                self.held.discard(key)
                if not self.down and self.claims.get(key, ("",))[0] == "me":
                    del self.claims[key]


class FleetClaimsMachine(ClaimsMachine):
    """The same promises with a fleet: other brokers claim, release and write keys, the
    store goes down and comes back, write-behinds end. Also: a claim of ours in the
    store belongs to a live node claim or a landed key whose write-behind is pending;
    CLAIMED for a key only another broker claims needs that claim to be live."""

    def __init__(self) -> None:
        super().__init__()
        self.fleet = FakeFleet(self.clock)
        self.dedup.fleet = self.fleet

    def _fleet_other(self, key: str) -> bool:
        """Another broker claims it -- or wrote it already (a claim won on a key whose
        value is in the store is given back and answered CLAIMED: the lookup had missed
        the value, and the wait that follows finds it)."""
        if self.fleet.down:
            return False
        c = self.fleet.live(key)
        return (c is not None and c[0] != "me") or key in self.fleet.values

    @rule(key=st.sampled_from(KEYS), ttl_ms=st.integers(1, 3000))
    def other_broker_claims(self, key: str, ttl_ms: int) -> None:
        if self.fleet.live(key) is None:
            self.fleet.claims[key] = ("other", self.clock.now + ttl_ms / 1000.0)

    @rule(key=st.sampled_from(KEYS), write=st.booleans())
    def other_broker_ends(self, key: str, write: bool) -> None:
        c = self.fleet.claims.get(key)
        if c is not None and c[0] == "other":
            del self.fleet.claims[key]
            if write:
                self.fleet.values.add(key)

    @rule()
    def store_flips(self) -> None:
        self.fleet.down = not self.fleet.down

    @rule(key=st.sampled_from(KEYS))
    def write_behind_ends(self, key: str) -> None:
        entry = self.store.entries.get(key)
        if entry is not None and entry.state is State.READY and not self.fleet.down:
            self.fleet.values.add(key)
            self.fleet.unclaim_fleet([key])  # RemoteTier.write_ended

    @invariant()
    def our_fleet_claims_are_accounted_for(self) -> None:
        for key, (owner, _) in self.fleet.claims.items():
            if owner != "me":
                continue
            node = self.dedup.book.claims.get(key)
            entry = self.store.entries.get(key)
            landed = entry is not None and entry.state is State.READY
            if key in self.fleet.held:
                assert node is not None or landed, (
                    f"our fleet claim on {key} outlived its node claim"
                )
            # (one not held any more was deleted while the store was down: left to its deadline)


FleetClaimsMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestFleetClaimsMachine = FleetClaimsMachine.TestCase


def test_a_put_that_lands_while_a_claiming_lookup_waits_for_the_store_answers_ready():
    """A claiming lookup waiting for a remote tier (with fleet claims every miss is
    asked of the store) while another connection's put lands: the answer is READY,
    leased like any hit -- not MISS, which means "encode it" while nothing could be
    claimed any more (two instances on one node each encoded an item:
    benchmarks/dedup_vllm.py, fleet of 4, 2026-12-06)."""
    store = Store(64 * BS, BS, clock=Clock())
    tiers = Coordinator(store, [])
    for conn in (1, 2):
        tiers.open_connection(conn)
    loop = asyncio.new_event_loop()
    remote: asyncio.Future[list[EntryInfo]] = loop.create_future()
    asked: list[list[str]] = []

    def lookup(conn, keys, lease_ms, wait_ms=0, fresh=False):
        asked.append(keys)  # the first: still asking the store; later: the coordinator
        return remote if len(asked) == 1 else tiers.lookup(conn, keys, lease_ms, wait_ms, fresh)

    dedup = Dedup(store, lookup)
    try:
        pending = dedup.lookup(1, 100, ["k"], 5000, 25, True, 5000)
        assert not isinstance(pending, list)
        r = tiers.reserve(2, "k", BS, "uint8", [BS])  # another encoder's put ...
        assert isinstance(r, ReserveReply) and tiers.commit(2, r.token) is None  # ... lands
        remote.set_result([EntryInfo(LookupState.MISS)])  # the store had nothing
        (info,) = loop.run_until_complete(pending)
    finally:
        loop.close()
    assert info.state == LookupState.READY and info.shape == [BS]
    assert "k" not in dedup.book.claims
    assert store.entries["k"].pins == 1, "a READY answer is leased like any hit"
