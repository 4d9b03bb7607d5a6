"""A lookup's ``wait_ms``: a caller with a budget is answered by then even when the
remote store is slow (real brokers, a real redis-server, its replies delayed on the
wire by tests/delay_proxy.py). Keys the store has not answered by then are a MISS,
and the store's late answer leases and promotes nothing; without ``wait_ms`` the
lookup still waits for the store (at most remote_timeout_s).

The vLLM scheduler's side (its lookups carry half of scheduler_budget_ms, so a slow
store never opens the connector's circuit) is in tests/test_vllm_connector_unit.py:
test_a_slow_remote_store_costs_the_scheduler_misses_not_its_circuit."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from delay_proxy import DelayProxy
from redis_servers import REDIS_SERVER, RedisServer

torch = pytest.importorskip("torch")
import test_remote_fleet as fleet  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.protocol import LookupState  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
server = fleet.server  # a redis-server, and the delaying proxy in front of it
proxy = fleet.proxy

DELAY_S = 0.6  # every reply of the store to broker B this late
# ... where a test bounds how long a lookup took: the store far slower than the
# bound, so a loaded host's own delays (a 0.36 s bound beside vLLM engines starting
# has no room for them) never reach it, and a lookup that waited for the store does
SLOW_S = 6.0
WAIT_MS = 60


def tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((64, 128), generator=g)


@pytest.fixture
def node(make_broker, tmp_path) -> Iterator[Callable[..., BrokerClient]]:
    clients: list[BrokerClient] = []

    def make(url: str, **extra: object) -> BrokerClient:
        cfg = tmp_path / f"node{len(clients)}.yaml"
        # 30 s: the store's slow answers always come within the deadline, however
        # loaded the host (no test here is about remote_timeout_s)
        lines = [f"remote_url: '{url}'", "remote_timeout_s: 30.0"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        cfg.write_text("\n".join(lines) + "\n")
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        # no client-side filter: every key is asked of the broker
        c = BrokerClient(b.socket_path, timeout_s=30.0, filter_trust_s=-1.0)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def two_nodes(
    server: RedisServer, proxy: DelayProxy, node, delay_s: float = DELAY_S
) -> tuple[BrokerClient, BrokerClient]:
    """A writes "far" into the store; B (behind the slow proxy, asking the store for
    every key: no remote key filter) holds "near" in its slab."""
    a = node(server.url("unix"))
    assert a.put("far", tensor(1))
    wait_until(lambda: a.stats()["remote_writes"] == 1, what="A's write-behind")
    b = node(proxy.url(server.password), remote_filter_keys=0)
    wait_until(lambda: b.stats()["remote_up"] == 1, what="B's store connection")
    assert b.put("near", tensor(2))
    proxy.reply_delay_s = delay_s
    return a, b


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.monotonic()
    got = fn()
    return got, time.monotonic() - t0


def test_a_lookup_with_wait_ms_is_answered_by_then_and_the_late_answer_takes_nothing(
    server, proxy, node
) -> None:
    _, b = two_nodes(server, proxy, node, SLOW_S)
    hits_before = b.stats()["remote_hits"]
    infos, took = timed(lambda: b.lookup(["near", "far"], lease_ms=30_000, wait_ms=WAIT_MS))
    assert took < SLOW_S / 3, f"the lookup waited {took:.2f}s for the slow store"
    assert [i.state for i in infos] == [LookupState.READY, LookupState.MISS]
    assert infos[0].shape == [64, 128]
    st = b.stats()
    assert st["remote_lookups_cut_short"] == 1, {k: v for k, v in st.items() if v}
    assert st["has_hits"] == 1 and st["has_misses"] == 1
    # The store's answer arrives later (counted as a remote hit when the tier hears
    # it; was: a 1.5 s sleep): it must not promote (nor lease) what the caller was
    # told is a miss. The lookup's own step that would lease and promote runs right
    # after that count, before the next request's answer (one ping).
    wait_until(
        lambda: b.stats()["remote_hits"] > hits_before, what="the store's late answer", timeout=60
    )
    assert b.ping()
    st = b.stats()
    assert st["promotions"] == 0 and st["promotions_in_flight"] == 0, st
    assert st["tier_leases"] == 0 and st["entries"] == 1, st

    # has() the same way
    hits, took = timed(lambda: b.has(["far", "near"], lease_ms=30_000, wait_ms=WAIT_MS))
    assert hits == [False, True] and took < SLOW_S / 3, (hits, took)
    assert b.stats()["remote_lookups_cut_short"] == 2


def test_without_wait_ms_a_lookup_still_waits_for_the_store(server, proxy, node) -> None:
    """The bound is the caller's choice: with none the store's answer is awaited, a
    remote hit is PENDING and, leased, promoted -- then loadable."""
    _, b = two_nodes(server, proxy, node)
    infos, took = timed(lambda: b.lookup(["far"], lease_ms=30_000))
    assert infos[0].state == LookupState.PENDING and took >= DELAY_S * 0.9, (infos, took)
    wait_until(lambda: b.stats()["promotions"] == 1, what="the leased remote hit promoted")
    got = b.get("far")
    assert got is not None and torch.equal(got, tensor(1))
    assert b.stats()["remote_lookups_cut_short"] == 0
    hits, took = timed(lambda: b.has(["elsewhere"], wait_ms=int(10 * DELAY_S * 1000)))
    assert hits == [False] and took >= DELAY_S * 0.9, took  # answered by the store, in time


def test_a_wait_longer_than_the_store_takes_changes_nothing(server, proxy, node) -> None:
    _, b = two_nodes(server, proxy, node)
    infos, _ = timed(lambda: b.lookup(["far", "near"], lease_ms=30_000, wait_ms=20_000))
    assert [i.state for i in infos] == [LookupState.PENDING, LookupState.READY]
    wait_until(lambda: b.stats()["promotions"] == 1, what="the leased remote hit promoted")
    assert b.stats()["remote_lookups_cut_short"] == 0


@pytest.mark.parametrize("wait_ms", [-5, 2**62])
def test_an_odd_wait_ms_from_a_client_is_no_bound_of_its_own(server, proxy, node, wait_ms) -> None:
    """Untrusted: negative means none; absurdly long is the broker's own bound."""
    _, b = two_nodes(server, proxy, node)
    infos, took = timed(lambda: b.lookup(["far"], wait_ms=wait_ms))
    assert infos[0].state == LookupState.PENDING and took >= DELAY_S * 0.9
    assert b.ping()
