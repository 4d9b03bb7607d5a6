"""Error replies of a real redis-server are failures of the call, not answers.

A lookup that gets an error reply other than a Cluster redirect (-CLUSTERDOWN,
-LOADING, -BUSY, -MASTERDOWN, -READONLY, -NOPERM, ...) has not learned whether the key
is there: it must count against the store's breaker (as a lost connection or a timeout
does) and leave the key's membership in the filter alone; the request is answered a
miss (the item is encoded). Was: read as "key absent" -- the key left the filter
without ``partial`` set (clients trusting the filter then missed keys the store still
held) and the breaker counted the reply as a success (a failing store was never shed).

The errors come from the real server: the broker's user loses the right to run
``GETRANGE``/``GET`` (``ACL SETUSER default -getrange -get``: every lookup and read is
answered ``-NOPERM``) and gets it back -- deterministic and reversible, unlike a
Cluster's -CLUSTERDOWN (``test_clusterdown_keeps_the_filter`` does that one too).
Each test runs over a Unix socket (lookups on the event loop, ``loop.py``) and over TLS
(the loop reads plain sockets only: lookups on the threads, ``transport.py``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from redis_servers import REDIS_SERVER, RedisServer

torch = pytest.importorskip("torch")
from lmcache_ec_broker import BrokerClient  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
PREFIX = "lmcache-ec:"
NEEDS_OPENSSL = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl makes the test certificate"
)
PATHS = ["loop", pytest.param("threads", marks=NEEDS_OPENSSL)]


def tensor(seed: int) -> torch.Tensor:
    return torch.randn((64, 64), generator=torch.Generator().manual_seed(seed))


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a, b)


def rstats(c: BrokerClient) -> dict[str, int]:
    return {k: v for k, v in c.stats().items() if k.startswith("remote_")}


class Store:
    """A real redis-server and the config that reaches it by ``path``: "loop" (a Unix
    socket: lookups run on the broker's event loop) or "threads" (TLS: on its threads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if path == "loop":
            self.server = RedisServer()
            self.url = self.server.url("unix")
            self.extra: dict[str, object] = {}
        else:
            self.server = RedisServer(tls=True, unix=False)
            self.url = self.server.url("tcp")
            self.extra = {"remote_tls_ca_file": self.server.cert}

    def refuse_reads(self) -> None:
        """From now on every GETRANGE and GET of the broker's user is answered -NOPERM."""
        self.server.cli("acl", "setuser", "default", "-getrange", "-get")

    def allow_reads(self) -> None:
        self.server.cli("acl", "setuser", "default", "+getrange", "+get")

    def check_path(self, b: BrokerClient) -> None:
        """The lookups ran where this store's path says."""
        loop = rstats(b)["remote_loop_lookups"]
        assert (loop > 0) if self.path == "loop" else (loop == 0), (self.path, loop)


@pytest.fixture(params=PATHS)
def store(request) -> Iterator[Store]:
    s = Store(request.param)
    yield s
    s.server.stop()


@pytest.fixture
def node(remote_node) -> Callable[..., BrokerClient]:
    """node(url, shm="64MiB", **extra_config) -> a client of a new broker on that store."""
    return remote_node


def shared(
    node: Callable[..., BrokerClient], url: str, n: int, **extra: object
) -> tuple[BrokerClient, dict]:
    """A writes ``n`` keys to the store; B (returned) knows them all and holds none."""
    a, b = node(url, **extra), node(url, **extra)
    tensors = {f"k{i}": tensor(i) for i in range(n)}
    for k, v in tensors.items():
        assert a.put(k, v)
    wait_until(lambda: rstats(a)["remote_writes"] == n, what="A's writes")
    wait_until(lambda: rstats(b)["remote_known_keys"] >= n, what="B learns the keys")
    return b, tensors


def asking(b: BrokerClient) -> BrokerClient:
    """A client of B's broker that never trusts the filter: each ``has`` is a lookup."""
    return BrokerClient(b.socket_path, timeout_s=30.0, filter_trust_s=-1.0)


# ---------------------------------------------------------------- 1. the filter


def test_error_replies_leave_the_filter_alone_and_hits_come_back(store, node) -> None:
    """While the store answers error replies, lookups answer misses (nothing is served)
    but every key it holds stays in B's filter; once the errors stop, every key is a hit.
    (Was: the first lookup of each key dropped it from the filter: known 6 -> 0.)"""
    b, tensors = shared(node, store.url, 6, **store.extra)
    keys = list(tensors)
    known = rstats(b)["remote_known_keys"]
    store.refuse_reads()
    with asking(b) as raw:
        for _ in range(4):
            assert raw.has(keys) == [False] * len(keys), "served a key the store did not confirm"
            st = rstats(b)
            assert st["remote_known_keys"] == known, f"an error reply read as 'absent': {st}"
        assert raw.get(keys[0]) is None  # a miss: the caller encodes
        assert rstats(b)["remote_known_keys"] == known
        store.check_path(b)
        store.allow_reads()
        wait_until(lambda: rstats(b)["remote_up"] == 1, what="the breaker closes", timeout=60)
        hits = rstats(b)["remote_hits"]
        for k in keys:
            assert same(raw.get(k), tensors[k]), f"{k} is not served again: {rstats(b)}"
        assert rstats(b)["remote_hits"] >= hits + len(keys)


# ---------------------------------------------------------------- 2. the breaker


def test_error_replies_open_the_breaker_until_they_stop(store, node) -> None:
    """Error replies are failures: a few lookups open the breaker, a probe that meets
    the same errors keeps it open (the store is shed, no lookup asks it), and once the
    errors stop a probe closes it. (Was: each error reply counted as a success; the
    breaker never opened.)"""
    b, tensors = shared(node, store.url, 3, **store.extra)
    keys = list(tensors)
    store.refuse_reads()
    with asking(b) as raw:
        for i in range(12):
            assert raw.has([keys[i % len(keys)]]) == [False]
            if rstats(b)["remote_circuit_opens"]:
                break
        st = rstats(b)
        assert st["remote_circuit_opens"] >= 1, f"error replies did not open the breaker: {st}"
        assert st["remote_up"] == 0
        store.check_path(b)
        # Shed: the breaker's probe asks what a lookup asks, meets the same error and
        # opens it again -- never closed while the store cannot answer a lookup.
        opened = st["remote_circuit_opens"]

        def probe_failed() -> bool:
            st = rstats(b)
            assert st["remote_up"] == 0, f"closed while the store still answers errors: {st}"
            return st["remote_circuit_opens"] > opened

        wait_until(probe_failed, what="a probe that meets the errors", timeout=30)
        assert raw.has(keys) == [False] * len(keys)  # open: answered a miss at once
        assert rstats(b)["remote_known_keys"] >= len(keys)
        store.allow_reads()
        wait_until(lambda: rstats(b)["remote_up"] == 1, what="a probe closes it", timeout=60)
        for k in keys:
            assert same(raw.get(k), tensors[k])


# ---------------------------------------------------------------- 3. answers stay answers


def test_absent_keys_still_read_as_absent(store, node) -> None:
    """A nil reply (the key is gone) still reads as absent: the key leaves the filter
    and the store's breaker counts it as an answer. So does an error reply that is an
    answer about the key: -WRONGTYPE (something other than a value is stored under it)
    refuses the key, never a failure of the store."""
    b, tensors = shared(node, store.url, 4, **store.extra)
    keys = list(tensors)
    for k in keys:  # gone from the store behind B's back: B's filter still has them
        assert store.server.cli("del", PREFIX + k) == "1"
    known = rstats(b)["remote_known_keys"]
    with asking(b) as raw:
        for k in keys:
            assert raw.has([k]) == [False]
        st = rstats(b)
        assert st["remote_known_keys"] == known - len(keys), f"an absent key kept: {st}"
        assert st["remote_circuit_opens"] == 0 and st["remote_up"] == 1, st
        # A list under a key of the namespace, announced as if a broker wrote it.
        store.server.cli("rpush", PREFIX + "wt", "x")
        store.server.cli("publish", PREFIX + "announce", "wt")
        wait_until(lambda: rstats(b)["remote_known_keys"] == known - len(keys) + 1, what="wt")
        assert raw.has(["wt"]) == [False]
        st = rstats(b)
        assert st["remote_refused_values"] == 1, st
        assert st["remote_circuit_opens"] == 0 and st["remote_up"] == 1, st
        assert st["remote_known_keys"] == known - len(keys), st
        store.check_path(b)


# ---------------------------------------------------------------- the audit's case


def test_clusterdown_keeps_the_filter(node) -> None:
    """What the audit saw: a Cluster that requires full coverage (Redis's default) loses
    a master; once the others mark it failed they answer -CLUSTERDOWN for every slot.
    B's lookups of the keys on the healthy masters are misses, but B keeps knowing them
    (was: 12 known -> 4) and the healthy masters' breakers open (was: counted as
    successes)."""
    from redis_servers import RedisCluster

    from lmcache_ec_broker.broker.tiers.redis.resp import key_slot

    with RedisCluster(masters=3) as cl:
        b, tensors = shared(node, cl.url(), 12)
        owner = {k: cl.owner(key_slot((PREFIX + k).encode())) for k in tensors}
        dead = owner["k0"]
        alive = [k for k in tensors if owner[k] is not dead]
        assert alive
        dead.kill()
        wait_until(lambda: cl.marked_failed(dead), what="the master marked failed", timeout=60)
        survivor = owner[alive[0]]
        wait_until(
            lambda: "CLUSTERDOWN" in survivor.cli("get", PREFIX + alive[0], check=False),
            what="-CLUSTERDOWN",
            timeout=30,
        )
        known = rstats(b)["remote_known_keys"]
        assert known == len(tensors)
        with asking(b) as raw:
            for _ in range(4):
                assert raw.has(alive) == [False] * len(alive)
                st = rstats(b)
                assert st["remote_known_keys"] == known, f"-CLUSTERDOWN read as 'absent': {st}"
            st = rstats(b)
            assert st["remote_circuit_opens"] >= 1 and st["remote_up"] == 0, st
