"""In-flight deduplication across nodes (issue 41, deliverable 2, fleet part): brokers
sharing a real redis-server (Valkey and a real 3-node Cluster too) keep encode claims
in the store with a lease (SET NX PX), so a client of another broker waits for an item
instead of encoding it again; a dead broker's claim expires; a slow store never stalls
a claiming lookup (tests/delay_proxy.py holds its SETs). No fixed sleeps."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import broker_stats, shm_segments, wait_until
from delay_proxy import DelayProxy
from redis_servers import REDIS_SERVER, VALKEY_SERVER, RedisCluster, RedisServer

torch = pytest.importorskip("torch")
from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.protocol import LookupState  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
NEEDS_VALKEY = pytest.mark.skipif(VALKEY_SERVER is None, reason="no valkey-server binary")
PREFIX = "lmcache-ec:"
MISS, READY, PENDING, CLAIMED = (
    LookupState.MISS,
    LookupState.READY,
    LookupState.PENDING,
    LookupState.CLAIMED,
)


def tensor(seed: int) -> torch.Tensor:
    return torch.randn((64, 32), generator=torch.Generator().manual_seed(seed))


def states(items) -> list[int]:
    return [i.state for i in items]


@pytest.fixture
def node(make_broker, tmp_path) -> Iterator[Callable[..., tuple[BrokerClient, object]]]:
    clients: list[BrokerClient] = []
    n = [0]

    def make(url: str) -> tuple[BrokerClient, object]:
        n[0] += 1
        cfg = tmp_path / f"node{n[0]}.yaml"
        cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 1.0\n")
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        c = BrokerClient(b.socket_path, timeout_s=60.0, connect_timeout_s=60.0)
        clients.append(c)
        return c, b

    yield make
    for c in clients:
        c.close()


@pytest.mark.parametrize("kind", ["redis", pytest.param("valkey", marks=NEEDS_VALKEY)])
def test_a_client_of_another_node_waits_for_the_encode(node, kind) -> None:
    """a (node A) claims two items; b (node B) is answered CLAIMED for both and waits;
    a's puts are written behind, B learns them and wakes b, who loads a's bytes. The
    claims leave the store once the values are in it."""
    server = RedisServer(kind=kind)
    try:
        a, _ = node(server.url("unix"))
        b, broker_b = node(server.url("unix"))
        keys = ["fleet-x", "fleet-y"]
        assert states(a.lookup(keys, claim_ms=30_000)) == [MISS, MISS]
        assert states(b.lookup(keys, claim_ms=30_000)) == [CLAIMED, CLAIMED]
        claim_keys = [f"lmcache-ec-claim:{PREFIX}{k}" for k in keys]
        assert all(server.cli("exists", ck) == "1" for ck in claim_keys)
        got: dict[str, list] = {}
        waiting = threading.Thread(
            target=lambda: got.setdefault("b", b.wait_ready(keys, 30_000, lease_ms=10_000))
        )
        waiting.start()
        sock_b = broker_b.socket_path  # type: ignore[attr-defined]
        wait_until(lambda: broker_stats(sock_b).get("claim_waiters") == 1, "b waits on B")
        for i, k in enumerate(keys):
            assert a.put(k, tensor(i))
        a.flush()
        waiting.join(60)
        assert not waiting.is_alive()
        assert all(s in (READY, PENDING) for s in states(got["b"])), got
        for i, k in enumerate(keys):
            t = b.get(k)
            assert t is not None and torch.equal(t, tensor(i))
        assert b.stats()["remote_fleet_claims_lost"] == 2
        wait_until(
            lambda: all(server.cli("exists", ck) == "0" for ck in claim_keys),
            "the claims deleted after the write-behind",
        )
        assert (
            b.stats()["remote_writes"] == 0 and a.stats()["remote_writes"] == 2
        )  # one encode each
    finally:
        server.stop()


def test_a_value_that_lands_while_a_waiter_reads_the_claim_is_not_a_miss(
    node, make_broker, tmp_path
) -> None:
    """The race a CI run beside a CPU-bound process met (2026-12-06): b's broker, waiting
    for an item a's broker claimed, reads the value (absent), then the claim -- and in
    between a's write-behind stores the value and deletes a's claim. The claim read finds
    nothing; answering MISS ("encode it") would encode the item twice. The proxy holds
    b's claim read (GET) until a's value and claim are settled in the store, so the race
    is taken every time: b's wait goes on and loads a's bytes."""
    server = RedisServer()
    proxy = DelayProxy(server.port)
    try:
        a, _ = node(server.url("unix"))
        cfg = tmp_path / "slow-b.yaml"  # a timeout well above the hold below
        cfg.write_text(f"remote_url: '{proxy.url(server.password)}'\nremote_timeout_s: 10.0\n")
        b = BrokerClient(make_broker("--shm-size", "64MiB", "--config", str(cfg)).socket_path,
                         timeout_s=60.0, connect_timeout_s=60.0)  # fmt: skip
        key = "landing"
        value_key, claim_key = f"{PREFIX}{key}", f"lmcache-ec-claim:{PREFIX}{key}"
        assert states(a.lookup([key], claim_ms=30_000)) == [MISS]
        assert server.cli("exists", claim_key) == "1"
        proxy.hold_s["GET"] = 3.0  # b's claim read (values are looked up with GETRANGE)
        got: dict[str, list] = {}
        waiting = threading.Thread(
            target=lambda: got.setdefault("b", b.wait_ready([key], 30_000, lease_ms=10_000))
        )
        waiting.start()
        assert proxy.holding.wait(30), "b's broker never read the claim"
        assert a.put(key, tensor(5)) and a.flush()
        wait_until(
            lambda: server.cli("exists", value_key) == "1" and server.cli("exists", claim_key) == "0",
            "a's value stored and its claim deleted while b's claim read is held",
        )
        assert proxy.holding.is_set(), "the hold ended before a's write: the race was not taken"
        proxy.hold_s.clear()
        waiting.join(60)
        assert not waiting.is_alive()
        assert states(got["b"])[0] in (READY, PENDING), got  # MISS: b would encode it again
        wait_until(lambda: b.lookup([key])[0].state == READY, "b's promotion of a's value")
        t = b.get(key)
        assert t is not None and torch.equal(t, tensor(5))
        assert b.stats()["remote_writes"] == 0  # b encoded (and wrote) nothing
        b.close()
    finally:
        proxy.close()
        server.stop()


def test_a_dead_brokers_claim_expires_and_a_waiter_takes_over(node) -> None:
    """Broker A is killed (-9) while it holds a fleet claim: the claim's lease (PX)
    ends it; b's wait on node B ends then, claimed for b, long before its deadline."""
    server = RedisServer()
    try:
        a, broker_a = node(server.url("unix"))
        b, _ = node(server.url("unix"))
        assert states(a.lookup(["orphan"], claim_ms=1500)) == [MISS]
        assert states(b.lookup(["orphan"], claim_ms=30_000)) == [CLAIMED]
        broker_a.kill9()  # type: ignore[attr-defined]
        t0 = time.monotonic()
        assert states(b.wait_ready(["orphan"], 60_000, claim_ms=30_000)) == [MISS]
        assert time.monotonic() - t0 < 30
        assert server.cli("exists", f"lmcache-ec-claim:{PREFIX}orphan") == "1"  # b's now
    finally:
        server.stop()
        # kill -9 leaves the socket and segments behind: remove them as a restart would
        path = broker_a.socket_path  # type: ignore[attr-defined]
        if os.path.exists(path):
            os.unlink(path)
        for name in shm_segments(path, include_filter=True):
            os.unlink("/dev/shm/" + name)


def test_a_slow_store_never_stalls_a_claiming_lookup(node) -> None:
    """The store holds every SET for 3 s: a claiming lookup with a 200 ms budget is
    answered MISS (encode here) within its budget's order, counted unknown; nothing
    waits on a store that does not answer."""
    server = RedisServer(tcp=True)
    try:
        with DelayProxy(server.port) as proxy:
            a, _ = node(proxy.url(server.password))
            proxy.hold_s["SET"] = 3.0
            t0 = time.monotonic()
            assert states(a.lookup(["slow"], wait_ms=200, claim_ms=30_000)) == [MISS]
            took = time.monotonic() - t0
            assert took < 1.5, took  # the 200 ms budget (plus a loaded host), not 3 s
            assert a.stats()["remote_fleet_claims_unknown"] == 1
    finally:
        server.stop()


def test_fleet_claims_on_a_cluster(node) -> None:
    """On a 3-master Cluster each claim key is routed to its own slot's master."""
    with RedisCluster(3) as cluster:
        a, _ = node(cluster.url())
        b, _ = node(cluster.url())
        keys = [f"cl-{i}" for i in range(6)]
        assert states(a.lookup(keys, claim_ms=30_000)) == [MISS] * 6
        assert states(b.lookup(keys, claim_ms=30_000)) == [CLAIMED] * 6
        a.unclaim(keys)
        a.flush()
        wait_until(
            lambda: states(b.lookup(keys, claim_ms=30_000)) == [MISS] * 6,
            "a's claims deleted from every master",
        )


def test_a_claimant_whose_item_arrived_another_way_lets_its_claim_go(node) -> None:
    """a claims an item, but another node's unclaimed encode reaches a's broker first
    (promoted from the store): a's put finds it present, writes nothing -- and its fleet
    claim goes at once (it used to stay to its TTL, holding other nodes' waiters)."""
    server = RedisServer()
    try:
        a, _ = node(server.url("unix"))
        b, _ = node(server.url("unix"))
        assert states(a.lookup(["twice"], claim_ms=60_000)) == [MISS]
        ck = f"lmcache-ec-claim:{PREFIX}twice"
        assert server.cli("exists", ck) == "1"
        assert b.put("twice", tensor(5))  # b encoded it without a claim
        b.flush()
        wait_until(lambda: a.get("twice") is not None, "b's value promoted into a's broker")
        assert not a.put("twice", tensor(5))  # a's own encode: present, nothing written
        a.flush()
        wait_until(lambda: server.cli("exists", ck) == "0", "a's fleet claim deleted")
        assert a.stats()["claims_held"] == 0
    finally:
        server.stop()
