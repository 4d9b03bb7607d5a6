"""What one client may hold or do: pins and leases per connection, and per process
over all its connections, are capped; zero-byte reservations are counted like any
other. Real broker processes, raw protocol clients that misbehave on purpose."""

from __future__ import annotations

import torch
from conftest import broker_stats
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import (
    ErrorReply,
    GetReply,
    Has,
    HasReply,
    Lookup,
    LookupReply,
    Release,
    Reserve,
    ReserveReply,
    Unlease,
)
from lmcache_ec_broker.protocol import Get as GetMsg

CAP = 64


def _store(path: str, keys: list[str]) -> None:
    with BrokerClient(path) as c:
        for k in keys:
            assert c.put(k, torch.ones(256))


def test_a_client_that_never_releases_is_refused_at_its_pin_cap(make_broker) -> None:
    b = make_broker("--shm-size", "16MiB", "--max-pins-per-connection", str(CAP))
    _store(b.socket_path, ["k"])
    raw = RawConn(b.socket_path)
    pins = []
    for _ in range(CAP):  # each get pins once more; this client never releases
        reply = raw.call(GetMsg(["k"]))
        assert isinstance(reply, GetReply) and reply.items[0] is not None
        pins.append(reply.items[0].pin)
    refused = raw.call(GetMsg(["k"]))
    assert isinstance(refused, ErrorReply) and refused.code == "too_many_pins", refused
    assert f"the limit is {CAP} (max_pins_per_connection)" in refused.message
    st = broker_stats(b.socket_path)
    assert st["pins"] == CAP and st["pin_limit_refusals"] == 1
    assert st["max_pins_per_connection"] == CAP
    # A batch that would cross the cap is refused whole; releasing makes room again.
    assert raw.call(Release(pins[:2])).__class__.__name__ == "OkReply"
    assert isinstance(raw.call(GetMsg(["k", "k", "k"])), ErrorReply)
    again = raw.call(GetMsg(["k", "k"]))
    assert isinstance(again, GetReply) and all(again.items)
    # Another connection has its own budget; closing this one releases all of it.
    with BrokerClient(b.socket_path) as c:
        assert torch.equal(c.get("k"), torch.ones(256))
    raw.close()
    st = broker_stats(b.socket_path)
    assert st["pins"] == 0 and st["pin_limit_refusals"] == 2


def test_a_client_that_never_ends_its_leases_is_refused_at_its_lease_cap(make_broker) -> None:
    b = make_broker("--shm-size", "16MiB", "--max-leases-per-connection", "16")
    keys = [f"k{i}" for i in range(30)]
    _store(b.socket_path, keys)
    raw = RawConn(b.socket_path)
    assert raw.call(Has(keys[:10], lease_ms=60_000)) == HasReply([True] * 10)
    assert raw.call(Has(keys[:10], lease_ms=60_000)) == HasReply([True] * 10)  # extended, not new
    refused = raw.call(Has(keys[10:20], lease_ms=60_000))
    assert isinstance(refused, ErrorReply) and refused.code == "too_many_leases", refused
    refused = raw.call(Lookup(keys[10:20], lease_ms=60_000))
    assert isinstance(refused, ErrorReply) and refused.code == "too_many_leases"
    # Without a lease nothing is held: never refused.
    assert raw.call(Has(keys, lease_ms=0)) == HasReply([True] * 30)
    st = broker_stats(b.socket_path)
    assert st["pins"] == 10 and st["lease_limit_refusals"] == 2
    raw.call(Unlease(keys[:10]))
    ok = raw.call(Lookup(keys[10:26], lease_ms=60_000))
    assert isinstance(ok, LookupReply) and len(ok.items) == 16
    raw.close()


def test_pins_and_leases_are_capped_per_process_over_its_connections(make_broker) -> None:
    # Seen failing on the old code: each connection had its own budget and nothing
    # else, so one process with two connections held twice its share (issue 40).
    b = make_broker(
        "--shm-size", "16MiB", "--max-pins-per-connection", "64",
        env={"LMCACHE_EC_MAX_PINS_PER_PROCESS": "8", "LMCACHE_EC_MAX_LEASES_PER_PROCESS": "8"},
    )  # fmt: skip
    keys = [f"k{i}" for i in range(8)]
    _store(b.socket_path, keys)
    one, two = RawConn(b.socket_path), RawConn(b.socket_path)
    try:
        assert isinstance(one.call(GetMsg(keys[:4])), GetReply)
        assert isinstance(two.call(GetMsg(keys[4:])), GetReply)
        refused = two.call(GetMsg(["k0"]))
        assert isinstance(refused, ErrorReply) and refused.code == "too_many_pins", refused
        assert "the limit is 8 (max_pins_per_process)" in refused.message, refused.message
        assert one.call(Has(keys[:6], lease_ms=60_000)) == HasReply([True] * 6)
        refused = two.call(Has(keys[5:], lease_ms=60_000))
        assert isinstance(refused, ErrorReply) and refused.code == "too_many_leases", refused
        assert "max_leases_per_process" in refused.message
        assert two.call(Has(keys[5:], lease_ms=0)) == HasReply([True] * 3)  # no lease: fine
    finally:
        one.close()
        two.close()
    st = broker_stats(b.socket_path)
    assert st["pins"] == 0 and st["reserved_bytes"] == 0, st


def test_zero_byte_reservations_are_counted_and_capped(make_broker) -> None:
    # Seen failing on the old code: zero-byte reservations cost no bytes and were
    # never refused (issue 40: 60,000 accepted); each is an index entry, a filter
    # key and a key held in_progress for everyone else.
    b = make_broker("--shm-size", "16MiB", env={"LMCACHE_EC_MAX_RESERVATIONS_PER_PROCESS": "100"})
    raw = RawConn(b.socket_path)
    try:
        for i in range(150):  # pipelined: the replies are read after
            raw.send(Reserve(f"zero{i}", 0, "uint8", [0]))
        replies = [raw.recv() for _ in range(150)]
        granted = [r for r in replies if isinstance(r, ReserveReply) and r.status == "reserved"]
        refused = [r for r in replies if isinstance(r, ErrorReply)]
        assert len(granted) == 100 and len(refused) == 50, (len(granted), refused[:1])
        assert refused[0].code == "too_many_reservations"
        assert "zero-byte ones included" in refused[0].message
        assert "the limit is 100 (max_reservations_per_process)" in refused[0].message
        st = broker_stats(b.socket_path)
        assert st["reserved_entries"] == 100 and st["reserve_limit_refusals"] == 50, st
    finally:
        raw.close()
