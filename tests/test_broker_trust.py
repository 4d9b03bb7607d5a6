"""What one client can do to the broker and to the others (issue 29, items 3, 5, 7),
with real brokers from the CLI and real clients:

- a client scribbling on the residency index cannot make the broker fail: the broker
  keeps every slot's seq in its own memory and only publishes it, and a placement's
  journal slot is settled whatever happens to the placement;
- counters a client reports (Served) are clamped to what the broker can verify, so
  no client can make ``stats`` fail for everyone;
- one connection's open reservations are capped (max_reserved_bytes_per_connection),
  so a client holding reservations cannot evict the whole slab.
"""

from __future__ import annotations

import posix_ipc
import pytest
import torch
from conftest import run_cli, wait_until
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import (
    Abort,
    Commit,
    ErrorReply,
    OkReply,
    Reserve,
    ReserveReply,
    Served,
    Stats,
    StatsReply,
)

MiB = 1 << 20
TOO_MANY_RESERVATIONS = "too_many_reservations"  # protocol.ErrorCode
SERVED_HAS_HITS_MAX = 1024  # broker/slab_reads.py: has() hits counted per Served frame, at most


def test_a_client_scribbling_on_the_residency_index_cannot_break_the_broker(broker) -> None:
    # Seen failing on the old code: the broker read the seq words back (seq + 2 ->
    # struct.error), so after the scribble every Commit answered `internal`, every
    # Place failed before its journal slot was settled (other clients lost their local
    # misses for good) and the placing client kept serving its key from blocks that
    # had been freed and reused by someone else (foreign bytes).
    path = broker.socket_path
    with BrokerClient(path) as w, BrokerClient(path) as r, BrokerClient(path) as filler:
        for i in range(8):
            assert w.put(f"before{i}", torch.full((1024,), float(i)))
        assert w.flush()
        raw = RawConn(path)
        try:
            hello = raw.hello
            assert hello is not None and hello.residency_name
            # The index is a sealed memfd now: no name to open for scribbling (and no
            # writable reopen: test_shm_trust.py's forge test). The broker's never
            # reading its seq words back: test_residency.py's scribble unit test.
            with pytest.raises(posix_ipc.ExistentialError):
                posix_ipc.SharedMemory(hello.residency_name)

            # A commit (reserve path) is answered OK, not `internal`.
            got = raw.call(Reserve("raw-after", 16, "uint8", [16]))
            assert isinstance(got, ReserveReply) and got.status == "reserved", got
            assert raw.call(Commit(got.token)) == OkReply()
        finally:
            raw.close()
        assert r.get("raw-after") is not None

        # Places (the arena path) are handled and settled: the others' local misses come back.
        placed = torch.arange(16 * 1024, dtype=torch.float32)  # 64 KiB: one block
        assert w.put("placed-after", placed)
        for i in range(8):
            assert w.put(f"after{i}", torch.full((1024,), 100.0 + i))
        assert w.flush()
        for i in range(8):
            got_t = r.get(f"after{i}")
            assert got_t is not None and torch.equal(got_t, torch.full((1024,), 100.0 + i)), i
        before = r.local_misses
        wait_until(
            lambda: r.has(["never-put"]) == [False] and r.local_misses > before,
            what="another client's miss answered locally again (the journal settled)",
        )

        # Withdrawals work too: the old entries are deleted, and once their blocks are
        # reused by someone else the placing client must not serve its key from them.
        assert r.delete_many([f"before{i}" for i in range(8)]) == [True] * 8
        assert r.delete("placed-after")
        for i in range(60):  # more than the slab holds: every free block is reused
            filler.put(f"filler{i}", torch.full((MiB // 4,), -1.0))
        assert filler.flush()
        seen = w.get("placed-after")
        assert seen is None or torch.equal(seen, placed), "foreign bytes served"
        assert w.has(["placed-after"]) == [False]
        assert r.stats()["deletes"] >= 9
    assert "internal error" not in broker.read_log()


def test_counters_a_client_reports_are_clamped_and_stats_keeps_answering(broker) -> None:
    # Seen failing on the old code: has_hits was not clamped (only nbytes was), two
    # frames pushed it past 2**64-1 and every Stats then failed (OverflowError while
    # encoding the reply: the client saw the connection drop, the CLI "no broker").
    path = broker.socket_path
    value = torch.ones(256)  # 1 KiB
    with BrokerClient(path) as c:
        assert c.put("present", value)
        assert c.flush()
        base = c.stats()
    raw = RawConn(path)
    try:
        raw.send(Served(has_hits=2**64 - 1))
        raw.send(Served(has_hits=2**64 - 1))
        raw.send(Served(keys=["present"] * 1000, nbytes=[2**63] * 1000))
        raw.send(Served(keys=["absent"] * 1000, nbytes=[2**63] * 1000))  # nothing to verify
        raw.send(Served(keys=["present"] * 10, nbytes=[-5] * 10, has_hits=-(2**40)))
        reply = raw.call(Stats())
        assert isinstance(reply, StatsReply), reply
        st = reply.stats
    finally:
        raw.close()
    assert 0 <= st["has_hits"] - base["has_hits"] <= 2 * SERVED_HAS_HITS_MAX
    # Only the present key's hits count, each with at most its entry's bytes, and a
    # key once per frame (issue 40 item 8): one hit per frame naming it.
    assert st["hits"] - base["hits"] == 2
    assert st["bytes_loaded"] - base["bytes_loaded"] == value.nbytes
    shown = run_cli("stats", "--json", "--socket", path)
    assert shown.returncode == 0, shown.stderr


def _fill(path: str, n: int) -> None:
    with BrokerClient(path) as c:
        for i in range(n):
            assert c.put(f"cached{i}", torch.full((MiB // 4,), float(i)))  # 1 MiB each
        assert c.flush()


def _cached(path: str, n: int) -> int:
    with BrokerClient(path) as c:
        return sum(c.has([f"cached{i}"]) == [True] for i in range(n))


def test_one_connections_open_reservations_cannot_evict_the_slab(broker) -> None:
    # Seen failing on the old code: one client holding 60 open 1 MiB reservations
    # evicted every entry of the 64 MiB slab. Now its reservations stop at the default
    # cap, a quarter of the slab (16 MiB), refused `too_many_reservations` and counted.
    path = broker.socket_path
    _fill(path, 40)
    assert _cached(path, 40) == 40
    raw = RawConn(path)
    try:
        granted, refused = 0, []
        for i in range(60):
            got = raw.call(Reserve(f"held{i}", MiB, "uint8", [MiB]))
            if isinstance(got, ReserveReply) and got.status == "reserved":
                granted += 1
            else:
                refused.append(got)
        assert granted == 16, granted
        assert all(isinstance(r, ErrorReply) for r in refused), refused[:2]
        assert {r.code for r in refused} == {TOO_MANY_RESERVATIONS}
        msg = refused[0].message
        assert "max_reserved_bytes_per_connection" in msg and "16.00 MiB" in msg, msg
        st = raw.call(Stats())
        assert isinstance(st, StatsReply)
        assert st.stats["reserve_limit_refusals"] == 44
        assert st.stats["max_reserved_bytes_per_connection"] == 16 * MiB
        # Others still find what the slab has room for besides the held 16 MiB.
        assert _cached(path, 40) >= 40 - 16 - 8  # (the filler's own arena took up to 8)
    finally:
        raw.close()


def test_the_reservation_cap_is_configurable_and_a_first_reservation_may_be_any_size(
    make_broker,
) -> None:
    b = make_broker("--shm-size", "64MiB", "--max-reserved-per-connection", "4MiB")
    raw = RawConn(b.socket_path)
    try:
        # A connection holding no open reservation may reserve any entry the slab takes.
        big = raw.call(Reserve("big", 8 * MiB, "uint8", [8 * MiB]))
        assert isinstance(big, ReserveReply) and big.status == "reserved", big
        small = raw.call(Reserve("small", MiB, "uint8", [MiB]))
        assert isinstance(small, ErrorReply) and small.code == TOO_MANY_RESERVATIONS
        assert raw.call(Commit(big.token)) == OkReply()
        tokens = []
        for i in range(4):
            got = raw.call(Reserve(f"s{i}", MiB, "uint8", [MiB]))
            assert isinstance(got, ReserveReply) and got.status == "reserved", (i, got)
            tokens.append(got.token)
        over = raw.call(Reserve("s4", MiB, "uint8", [MiB]))
        assert isinstance(over, ErrorReply) and over.code == TOO_MANY_RESERVATIONS
        assert raw.call(Abort(tokens[0])) == OkReply()  # an abort gives the room back
        again = raw.call(Reserve("s4", MiB, "uint8", [MiB]))
        assert isinstance(again, ReserveReply) and again.status == "reserved", again
    finally:
        raw.close()
    # Another connection has its own share.
    other = RawConn(b.socket_path)
    try:
        got = other.call(Reserve("o0", 2 * MiB, "uint8", [2 * MiB]))
        assert isinstance(got, ReserveReply) and got.status == "reserved", got
    finally:
        other.close()
    shown = run_cli("start", "--shm-size", "64MiB", "--max-reserved-per-connection", "1KiB",
                    "--print-config")  # fmt: skip
    assert shown.returncode != 0 and "max_reserved_bytes_per_connection" in shown.stderr
