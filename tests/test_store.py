"""The entry store alone: lifecycle, pins, leases, eviction, accounting invariants."""

import pytest

from lmcache_ec_broker.broker.store import Store
from lmcache_ec_broker.protocol import ErrorCode, ErrorReply, ReserveReply, ReserveStatus

BS = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> Store:
    # No reservation cap below the slab here (its own test is below).
    s = Store(capacity_bytes=16 * BS, block_size=BS, clock=clock, max_reserved_bytes_per_conn=16 * BS)
    s.open_connection(1)
    s.open_connection(2)
    return s


def put(store: Store, conn: int, key: str, nblocks: int) -> ReserveReply:
    r = store.reserve(conn, key, nblocks * BS, "uint8", [nblocks * BS])
    assert isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED, r
    assert store.commit(conn, r.token) is None
    store.check()
    return r


def test_two_phase_put_and_readers_never_see_partial(store: Store) -> None:
    r = store.reserve(1, "k", 100, "float32", [25])
    assert isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED
    assert r.extents == [(0, 100)]
    assert store.has(2, ["k"]) == [False]
    assert store.get(2, ["k"]) == [None]
    second = store.reserve(2, "k", 100, "float32", [25])
    assert isinstance(second, ReserveReply) and second.status == ReserveStatus.IN_PROGRESS
    assert store.commit(1, r.token) is None
    third = store.reserve(2, "k", 100, "float32", [25])
    assert isinstance(third, ReserveReply) and third.status == ReserveStatus.PRESENT
    hit = store.get(2, ["k"])[0]
    assert hit is not None and hit.shape == [25] and hit.dtype == "float32"
    store.check()


def test_commit_of_foreign_or_repeated_token_is_refused(store: Store) -> None:
    r = store.reserve(1, "k", 10, "uint8", [10])
    assert isinstance(r, ReserveReply)
    err = store.commit(2, r.token)
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.UNKNOWN_TOKEN
    assert store.commit(1, r.token) is None
    again = store.commit(1, r.token)
    assert isinstance(again, ErrorReply) and "already committed" in again.message
    store.check()


def test_validation_errors_name_the_problem(store: Store) -> None:
    cases = [
        (("k", 10, "float32", [10]), ErrorCode.SHAPE_MISMATCH, "needs 40 bytes"),
        (("k", 10, "float99", [10]), ErrorCode.DTYPE_INVALID, "unknown dtype"),
        (("k", -4, "uint8", [-4]), ErrorCode.SHAPE_MISMATCH, "negative"),
        (("", 1, "uint8", [1]), ErrorCode.KEY_INVALID, "empty"),
        (("k", 17 * BS, "uint8", [17 * BS]), ErrorCode.TOO_LARGE, "--shm-size"),
    ]
    for args, code, text in cases:
        err = store.reserve(1, *args)
        assert isinstance(err, ErrorReply) and err.code == code and text in err.message, err
    store.check()
    assert store.stats()["reserved_bytes"] == 0


def test_eviction_is_lru_and_spares_pinned(store: Store) -> None:
    for i in range(4):
        put(store, 1, f"e{i}", 4)  # slab full
    pin = store.get(2, ["e0"])[0]  # e0 pinned (and most recently used)
    assert pin is not None
    store.get(2, ["e1"])  # touch e1, release it at once
    store.release(2, [store.get(2, ["e1"])[0].pin])  # type: ignore[union-attr]
    store.check()
    put(store, 1, "new", 4)
    # e0 is pinned, e1 was touched: e2 (oldest unpinned) goes first.
    assert store.has(1, ["e0", "e1", "e2", "e3", "new"]) == [True, True, False, True, True]
    assert store.stats()["evictions"] == 1


def test_no_space_when_everything_is_pinned_or_reserved(store: Store) -> None:
    put(store, 1, "a", 8)
    store.get(2, ["a"])
    r = store.reserve(1, "b", 8 * BS, "uint8", [8 * BS])
    assert isinstance(r, ReserveReply)
    err = store.reserve(1, "c", BS, "uint8", [BS])
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.NO_SPACE
    assert "pinned" in err.message
    store.check()


def test_allocation_succeeds_whenever_evictable_bytes_suffice(store: Store) -> None:
    for i in range(16):
        put(store, 1, f"s{i}", 1)
    pins = [store.get(2, [f"s{i}"])[0] for i in range(0, 16, 2)]  # pin every other block
    assert all(pins)
    store.check()
    r = store.reserve(1, "big", 8 * BS, "uint8", [8 * BS])  # fragmented: 8 single extents
    assert isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED
    assert len(r.extents) == 8
    store.check()


def test_delete_while_pinned_frees_on_release(store: Store) -> None:
    put(store, 1, "k", 4)
    hit = store.get(2, ["k"])[0]
    assert hit is not None
    assert store.delete(["k"]) == [True]
    assert store.has(1, ["k"]) == [False]
    st = store.stats()
    assert st["used_bytes"] == 4 * BS and st["entries"] == 0
    store.check()
    assert store.release(2, [hit.pin]) is None
    assert store.stats()["used_bytes"] == 0
    store.check()


def test_closing_a_connection_releases_everything(store: Store) -> None:
    put(store, 1, "a", 2)
    store.reserve(2, "b", 3 * BS, "uint8", [3 * BS])
    store.get(2, ["a"])
    store.has(2, ["a"], lease_ms=10_000)
    st = store.stats()
    assert st["reserved_bytes"] == 3 * BS and st["pinned_entries"] == 1 and st["pins"] == 2
    store.close_connection(2)
    st = store.stats()
    assert st["reserved_bytes"] == 0 and st["pinned_entries"] == 0 and st["pins"] == 0
    assert store.has(1, ["b"]) == [False]
    store.check()


def test_leases_protect_until_expiry(store: Store, clock: FakeClock) -> None:
    for i in range(4):
        put(store, 1, f"e{i}", 4)
    assert store.has(2, ["e0"], lease_ms=1000) == [True]
    assert store.has(2, ["e0"], lease_ms=1000) == [True]  # renews, does not stack
    assert store.stats()["pins"] == 1
    put(store, 1, "x", 4)
    assert store.has(1, ["e0"]) == [True]  # leased entry survived, e1 went
    clock.now += 2
    put(store, 1, "y", 4)
    assert store.has(1, ["e0"]) == [False]  # lease expired: evictable again
    assert store.stats()["pins"] == 0
    store.check()


def test_zero_byte_entries_are_accepted(store: Store) -> None:
    r = store.reserve(1, "empty", 0, "bfloat16", [0, 128])
    assert isinstance(r, ReserveReply) and r.extents == []
    assert store.commit(1, r.token) is None
    hit = store.get(2, ["empty"])[0]
    assert hit is not None and hit.shape == [0, 128] and hit.extents == []
    store.check()


def test_an_arena_grant_evicts_like_a_reserve_but_never_a_pinned_entry(clock: FakeClock) -> None:
    from lmcache_ec_broker.protocol import ArenaReply

    s = Store(capacity_bytes=16 * BS, block_size=BS, clock=clock, arena_bytes=4 * BS)
    for c in (1, 2):
        s.open_connection(c)
    for i in range(4):
        put(s, 1, f"k{i}", 3)  # 12 of 16 blocks used
    (pinned,) = s.get(1, ["k0"])
    assert pinned is not None
    g = s.grant(2, 4 * BS)  # a quarter of the slab: 4 blocks, 4 free: no eviction
    assert isinstance(g, ArenaReply) and sum(n for _, n in g.runs) == 4
    assert s.counters["evictions"] == 0
    s.close_connection(2)  # the arena goes back
    assert s.stats()["arena_bytes"] == 0 and s.allocator.free_blocks == 4
    s.open_connection(2)
    put(s, 1, "k4", 4)  # full now
    g = s.grant(2, 4 * BS)  # evicts the LRU unpinned entry (k1), never pinned k0
    assert sum(n for _, n in g.runs) == 4 and "k0" in s.entries and "k1" not in s.entries
    s.check()
    assert s.release(1, [pinned.pin]) is None
    # All arenas together hold at most a quarter of the slab: a third connection's
    # grant is empty (its puts reserve), not an error.
    s.open_connection(3)
    g = s.grant(3, 4 * BS)
    assert isinstance(g, ArenaReply) and g.runs == [] and g.slot >= 0
    s.check()
    # With room only behind pinned entries, a grant is what is free (here nothing).
    s.close_connection(2)
    for key in list(s.entries):
        s.get(1, [key])
    put_free = s.allocator.free_blocks
    for i in range(put_free):
        put(s, 1, f"fill{i}", 1)
        s.get(1, [f"fill{i}"])
    g = s.grant(3, 4 * BS)
    assert g.runs == [] and all(e.pins for e in s.entries.values())
    s.check()


def test_open_reservations_per_connection_are_capped(clock: FakeClock) -> None:
    s = Store(capacity_bytes=16 * BS, block_size=BS, clock=clock)  # default: a quarter
    for c in (1, 2, -1):
        s.open_connection(c)
    big = s.reserve(1, "big", 6 * BS, "uint8", [6 * BS])  # a first one may be any size
    assert isinstance(big, ReserveReply) and big.status == ReserveStatus.RESERVED
    err = s.reserve(1, "more", BS, "uint8", [BS])
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.TOO_MANY_RESERVATIONS
    assert s.stats()["reserve_limit_refusals"] == 1
    assert s.commit(1, big.token) is None
    tokens = [s.reserve(1, f"s{i}", BS, "uint8", [BS]) for i in range(4)]
    assert all(isinstance(t, ReserveReply) and t.token for t in tokens)
    assert isinstance(s.reserve(1, "s4", BS, "uint8", [BS]), ErrorReply)
    assert isinstance(s.reserve(2, "other", BS, "uint8", [BS]), ReserveReply)  # its own share
    assert isinstance(s.reserve(-1, "tier", BS, "uint8", [BS]), ReserveReply)  # not a client
    assert isinstance(s.reserve(-1, "tier2", BS, "uint8", [BS]), ReserveReply)
    s.check()
    s.close_connection(1)
    s.check()
