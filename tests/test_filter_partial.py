"""The membership filter's absences are trusted only while every tier folds in every
key it may hold (shm/filter.py, "Partial"). A remote tier that folds none
(``remote_filter_keys: 0``) or forgot its oldest keys past the cap marks the filter
partial, so a client asks the broker -- which asks the store -- instead of answering
a remote hit as a local miss. Real brokers, a real redis-server; the reader side
directly on a real segment."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from redis_servers import REDIS_SERVER, RedisServer

torch = pytest.importorskip("torch")
from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.shm.filter import FilterReader, FilterWriter  # noqa: E402

NEEDS_REDIS = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


def tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((32, 64), generator=g)


def test_a_partial_filter_says_maybe_for_every_key_and_clears_again() -> None:
    name = f"/lmcache-ec-test-{uuid.uuid4().hex[:8]}-f"
    w = FilterWriter(name, 16)
    try:
        r = FilterReader(name, w.size, fd=w.segment.share_fd())
        try:
            w.add("here")
            assert r.maybe_many(["here", "absent"]) == [True, False]
            assert not r.maybe("absent")
            w.set_partial(True)
            assert r.maybe_many(["here", "absent"]) == [True, True]
            assert r.maybe_many([f"k{i}" for i in range(64)]) == [True] * 64  # batched read
            assert r.maybe("absent") and r.live
            w.set_partial(False)
            assert r.maybe_many(["here", "absent"]) == [True, False]
        finally:
            r.close()
    finally:
        w.close()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.fixture
def node(make_broker, tmp_path, redis) -> Iterator[Callable[..., BrokerClient]]:
    clients: list[BrokerClient] = []

    def make(**extra: object) -> BrokerClient:
        cfg = tmp_path / f"node{len(clients)}.yaml"
        lines = [f"remote_url: '{redis.url('unix')}'"] + [f"{k}: {v}" for k, v in extra.items()]
        cfg.write_text("\n".join(lines) + "\n")
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        c = BrokerClient(b.socket_path, timeout_s=30.0)  # trusts the filter (the default)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def written(a: BrokerClient, keys: list[str]) -> None:
    for i, k in enumerate(keys):
        assert a.put(k, tensor(i))
    wait_until(lambda: a.stats()["remote_writes"] == len(keys), what="A's write-behinds")


@NEEDS_REDIS
def test_with_no_remote_keys_folded_a_client_still_finds_a_remote_hit(node) -> None:
    """remote_filter_keys: 0 -- "then every local miss asks the store": a filtering
    client must ask the broker (before: it answered the remote hit as a local miss)."""
    a = node()
    b = node(remote_filter_keys=0)
    written(a, ["far"])
    misses0 = b.local_misses
    assert b.has(["far", "nowhere"]) == [True, False]
    assert b.local_misses == misses0  # both asked: the filter proves nothing here
    got = b.get("far")
    assert got is not None and torch.equal(got, tensor(0))


@NEEDS_REDIS
def test_keys_forgotten_past_the_cap_are_still_found(node) -> None:
    """remote_filter_keys: 2 and three keys announced: the oldest is forgotten (it may
    still be in the store, and is); a filtering client still finds it."""
    a = node()
    b = node(remote_filter_keys=2)
    keys = ["k0", "k1", "k2"]
    written(a, keys)
    wait_until(
        lambda: b.stats()["remote_known_keys"] == 2 and b.stats()["remote_announcements"] >= 3,
        what="B heard of all three and kept two",
    )
    assert b.has(keys) == [True, True, True]
    got = b.get("k0")
    assert got is not None and torch.equal(got, tensor(0))


@NEEDS_REDIS
def test_a_filter_that_folds_every_key_still_answers_misses_locally(node) -> None:
    """The default cap and a store it fits in: absences stay proof (no round trip)."""
    a = node()
    b = node()
    written(a, ["far"])
    wait_until(lambda: b.stats()["remote_known_keys"] == 1, what="B heard of far")
    misses0 = b.local_misses
    assert b.has(["far", "nowhere"]) == [True, False]
    assert b.local_misses == misses0 + 1  # "nowhere" answered here
