"""Issue 32, deliverable 2: no race between an encoder instance's hand-off and a
prefill instance's lookup on another node.

Two brokers (two nodes: separate sockets and slabs) joined by a real redis-server,
both reaching it through a delaying proxy (tests/delay_proxy.py): every SET is held
(a slow remote write) and every pub/sub announcement reaches the subscribers late (a
loaded host's subscriber thread). The producer's side does what the vLLM connector
of an ``ec_producer`` does at the end of a step -- put, then ``publish`` (wait until
the store holds the entries) -- and the consumer's side what an ``ec_consumer``'s
scheduler does right after: a ``fresh`` lookup with a wait (the connector's is 25 ms).

The guarantee test asserts a hit every time; the control shows that each half alone
(the old put-and-answer, a publish without a fresh lookup, a fresh lookup without a
publish) loses the race under these delays, so the guarantee test can fail.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
from delay_proxy import DelayProxy
from redis_servers import REDIS_SERVER, RedisServer

torch = pytest.importorskip("torch")
from rawproto import RawConn  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.protocol import (  # noqa: E402
    Abort,
    LookupState,
    OkReply,
    Publish,
    PublishReply,
    PublishState,
    Reserve,
    ReserveReply,
)

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

# The race is opened by slow steps, not by a fast host: a remote write reaches the
# store 1 s late and an announcement the other brokers 3 s late -- longer than any
# loaded host takes from a put (or a publish) to the consumer's lookup, so each
# control loses for its reason every round. (Was 50 ms and 0.5 s: a busy host's
# lookup could come after the write had landed.) The consumer's lookup waits up to
# 2 s for the store (the connector's scheduler waits 25 ms, scheduler_budget_ms / 2):
# what is tested is whether the store holds the entry and the lookup asks it, not
# whether a loaded host answers within 25 ms.
SET_HOLD_S = 1.0  # each remote write reaches the store this late
PUSH_DELAY_S = 3.0  # each announcement reaches the other brokers this late
LOOKUP_WAIT_MS = 2000  # the consumer's lookup wait
ROUNDS = 10


def tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((64, 128), generator=g)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[DelayProxy]:
    with DelayProxy(server.port) as p:
        p.hold_s["SET"] = SET_HOLD_S
        p.push_delay_s = PUSH_DELAY_S
        yield p


@pytest.fixture
def node(remote_node) -> Callable[[str], BrokerClient]:
    # 10 s: a write held 1 s on the wire ends in time on a loaded host
    return lambda url: remote_node(url, remote_timeout_s=10.0)


def _subscribed(producer: BrokerClient, consumer: BrokerClient) -> None:
    """Both brokers hear announcements before the rounds start (one warm-up key)."""
    warm = tensor(999)
    assert producer.put("warm-up", warm)
    assert producer.publish(["warm-up"], 10_000) == [PublishState.PUBLISHED]
    deadline = time.monotonic() + 20
    while consumer.lookup(["warm-up"])[0].state == LookupState.MISS:
        assert time.monotonic() < deadline, "the consumer's broker never heard the announcement"
        time.sleep(0.05)


def _round(
    producer: BrokerClient, consumer: BrokerClient, key: str, seed: int, publish: bool, fresh: bool
) -> bool:
    """Put on the producer's node (and publish), then look up on the consumer's at
    once, as the prefill instance's scheduler does: True if it found the entry."""
    assert producer.put(key, tensor(seed))
    if publish:
        assert producer.publish([key], 10_000) == [PublishState.PUBLISHED]
    info = consumer.lookup([key], wait_ms=LOOKUP_WAIT_MS, fresh=fresh)[0]
    return info.state != LookupState.MISS


def test_a_published_put_is_found_on_the_other_node_every_time(server, proxy, node) -> None:
    producer = node(proxy.url(server.password))
    consumer = node(proxy.url(server.password))
    _subscribed(producer, consumer)
    found = [
        _round(producer, consumer, f"item-{i}", i, publish=True, fresh=True) for i in range(ROUNDS)
    ]
    assert all(found), f"the consumer missed rounds {[i for i, f in enumerate(found) if not f]}"
    # and what it found is the producer's entry, byte for byte (promoted from the store)
    for i in (0, ROUNDS - 1):
        got = consumer.get(f"item-{i}")
        assert got is not None and torch.equal(got, tensor(i))
    stats = producer.stats()
    assert stats["publish_waits"] >= ROUNDS
    assert stats["publish_failures"] == 0 and stats["publish_timeouts"] == 0


@pytest.mark.parametrize(
    ("publish", "fresh"),
    [
        pytest.param(False, False, id="old-put-then-lookup"),
        pytest.param(True, False, id="publish-without-fresh-lookup"),
        pytest.param(False, True, id="fresh-lookup-without-publish"),
    ],
)
def test_control_each_half_alone_loses_the_race(server, proxy, node, publish, fresh) -> None:
    """Without both halves the consumer misses: the store does not hold the entry yet
    (no publish), or its broker has not heard the announcement and trusts its filter
    (no fresh lookup). What the guarantee test would see on the old code."""
    producer = node(proxy.url(server.password))
    consumer = node(proxy.url(server.password))
    _subscribed(producer, consumer)
    found = [
        _round(producer, consumer, f"ctl-{i}", i, publish=publish, fresh=fresh) for i in range(5)
    ]
    assert not any(found), f"found {sum(found)} of 5: the delays did not open the race"


# ---------------------------------------------------------------- Publish's edges


def test_publish_without_a_remote_tier_answers_from_the_slab(broker) -> None:
    """One node, no fleet tier: a committed entry is published (every instance asks
    this broker), an unknown key is absent -- counted as a failure."""
    with BrokerClient(broker.socket_path, timeout_s=10.0) as c:
        assert c.put("here", tensor(1))
        assert c.publish(["here", "nowhere"], 1000) == [PublishState.PUBLISHED, PublishState.ABSENT]
        s = c.stats()
        assert s["publish_waits"] == 1 and s["publish_failures"] == 1


def test_publish_is_bounded_by_its_wait(server, node) -> None:
    """A write still on the wire at wait_ms is TIMEOUT, answered by then (the
    instance answers; its PD instance would encode the item), and counted."""
    with DelayProxy(server.port) as slow:
        slow.hold_s["SET"] = 30.0
        c = node(slow.url(server.password))
        assert c.put("slow", tensor(2))
        t0 = time.monotonic()
        assert c.publish(["slow"], 200) == [PublishState.TIMEOUT]
        # Answered before the write could land: a publish that waited for the write
        # would take the 30 s hold (or the 10 s remote_timeout_s that fails it: then
        # it is not TIMEOUT either). 5 s leaves a loaded host ample room over the
        # 200 ms (was: a 3 s hold and a 3 s bound, which a busy host's second or two
        # could reach).
        assert time.monotonic() - t0 < 5.0
        assert c.stats()["publish_timeouts"] == 1


def test_publish_writes_an_entry_whose_write_behind_was_dropped(
    server, make_broker, tmp_path
) -> None:
    """A write-behind dropped (its queue full) is not lost for a publisher: the entry,
    still in the slab, is written when it is published."""
    with DelayProxy(server.port) as slow:
        slow.hold_s["SET"] = 0.3
        cfg = tmp_path / "q1.yaml"
        cfg.write_text(
            f"remote_url: '{slow.url(server.password)}'\nremote_timeout_s: 10.0\n"
            "remote_write_queue: 1\n"
        )
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        with BrokerClient(b.socket_path, timeout_s=10.0) as c:
            assert c.put("first", tensor(3)) and c.put("second", tensor(4))
            assert c.publish(["first"], 30_000) == [PublishState.PUBLISHED]
            assert c.stats()["remote_write_drops"] == 1  # "second" found the queue full
            assert server.cli("exists", "lmcache-ec:second") == "0"
            assert c.publish(["second"], 30_000) == [PublishState.PUBLISHED]
            assert server.cli("exists", "lmcache-ec:second") == "1"


# Zero-byte reservations within today's limits (none caps their count yet; the
# per-uid entry cap of issue 40 item 7 is another branch's): the polling showed at
# this count already (each key's task woke every 20 ms: 150,000 wake-ups a second).
MANY_RESERVED = 3000
PUBLISH_WAIT_MS = 1500


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_publish_waiting_for_many_reservations_does_not_poll(make_broker) -> None:
    # Issue 40 item 7. Fails on the old code: the broker burned a CPU for the whole
    # wait (each waiting key polled every 20 ms) and an honest client's ping+has
    # waited behind it. Now the request sleeps until a reservation ends: the broker
    # uses almost no CPU while it waits, and an abort wakes it at once. The per-process
    # reservation cap (issue 40 item 7's other half) is lifted: the load is what this
    # test is about, not the cap.
    lifted = str(MANY_RESERVED + 64)
    broker = make_broker(
        "--shm-size",
        "64MiB",
        env={
            "LMCACHE_EC_MAX_RESERVATIONS_PER_PROCESS": lifted,
            "LMCACHE_EC_MAX_RESERVATIONS_PER_UID": lifted,
        }
    )
    hostile = RawConn(broker.socket_path, timeout=30.0)
    waiter = RawConn(broker.socket_path, timeout=30.0)
    try:
        keys = [f"zero-{i}" for i in range(MANY_RESERVED)]
        for k in keys:  # pipelined: all sent, then all replies read
            hostile.send(Reserve(k, 0, "uint8", [0]))
        tokens = []
        for k in keys:
            got = hostile.recv()
            assert isinstance(got, ReserveReply) and got.status == "reserved", (k, got)
            tokens.append(got.token)
        with BrokerClient(broker.socket_path, timeout_s=10.0) as honest:
            assert honest.ping()
            cpu0, t0 = _cpu_s(broker.pid), time.monotonic()
            waiter.send(Publish(keys, PUBLISH_WAIT_MS))
            lat = []
            for _ in range(100):
                t = time.perf_counter()
                assert honest.ping() and honest.has(["zero-absent"]) == [False]
                lat.append(time.perf_counter() - t)
            reply = waiter.recv()
            wall, cpu = time.monotonic() - t0, _cpu_s(broker.pid) - cpu0
        assert reply == PublishReply([PublishState.TIMEOUT] * MANY_RESERVED)
        assert wall >= PUBLISH_WAIT_MS / 1000 * 0.9
        lat.sort()
        print(f"broker cpu {cpu:.2f} s over {wall:.2f} s; honest ping+has p50 "
              f"{lat[50] * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms")  # fmt: skip
        # The polling took ~a whole CPU for the wait; sleeping takes a few ms (10 ms ticks).
        assert cpu < 0.1 * wall, (cpu, wall)
        # An abort wakes a waiting publish at once (no 20 ms tick, no wait_ms).
        waiter.send(Publish([keys[0]], 30_000))
        t1 = time.monotonic()
        assert hostile.call(Abort(tokens[0])) == OkReply()
        assert waiter.recv() == PublishReply([PublishState.ABSENT])
        assert time.monotonic() - t1 < 10.0
    finally:
        hostile.close()
        waiter.close()
