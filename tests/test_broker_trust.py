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

import mmap

import posix_ipc
import pytest
import torch
from conftest import wait_until
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import (
    Commit,
    OkReply,
    Reserve,
    ReserveReply,
)
from lmcache_ec_broker.shm.residency import HEADER_SIZE, SLOT_BYTES

MiB = 1 << 20


def _scribble_seq_words(name: str, size: int, value: bytes) -> int:
    """Write ``value`` over the seq word of every slot of the residency index, as a
    same-uid process that opens the segment read-write can (issue 29, item 2/4: the
    segment's mode lets it). Returns the slot count."""
    shm = posix_ipc.SharedMemory(name)
    try:
        mm = mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()
    try:
        nslots = (size - HEADER_SIZE) // SLOT_BYTES
        for slot in range(nslots):
            at = HEADER_SIZE + slot * SLOT_BYTES
            mm[at : at + 8] = value
        return nslots
    finally:
        mm.close()


@pytest.mark.parametrize("value", [b"\xff" * 8, b"\xfe" + b"\xff" * 7], ids=["odd", "even"])
def test_a_client_scribbling_on_the_residency_index_cannot_break_the_broker(
    broker, value: bytes
) -> None:
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
            assert _scribble_seq_words(hello.residency_name, hello.residency_size, value) > 0

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
