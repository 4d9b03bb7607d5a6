"""Residency events and the lookup API against real brokers (started through the CLI),
a real ZMQ subscriber in the test, and the real aggregator process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import msgspec
import pytest
import torch
from conftest import run_cli, wait_until

from lmcache_ec_broker.connector.client import BrokerClient
from lmcache_ec_broker.events.publisher import ZmqPublisher
from lmcache_ec_broker.events.schema import (
    END_SEQ,
    EncoderCacheCleared,
    EncoderCacheRemoved,
    EncoderCacheStored,
    EventBatch,
    Heartbeat,
    SnapshotRequest,
    batch_decoder,
    parse_topic,
    snapshot_decoder,
)
from lmcache_ec_broker.events.tracker import ResidencyTracker
from lmcache_ec_broker.testing.ports import free_ports

zmq = pytest.importorskip("zmq")

MODEL = "tiny/model"
FP_MODEL = MODEL + "#0123456789abcdef"


def key(h: str, model: str = FP_MODEL) -> str:
    return f"{model}@1@0@{h}@bfloat16"


def port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (and p + 2 for a lookup port)."""
    return free_ports(3)


def events_env(port: int, node: str, lookup: bool = True, **extra: str) -> dict[str, str]:
    env = {
        "LMCACHE_EC_EVENTS_PORT": str(port),
        "LMCACHE_EC_EVENTS_NODE": node,
        "LMCACHE_EC_EVENTS_HEARTBEAT_S": "0.2",
    }
    if lookup:
        env["LMCACHE_EC_EVENTS_LOOKUP_PORT"] = str(port + 2)
    env.update(extra)
    return env


def cli_stats(socket_path: str) -> dict:
    """``lmcache-ec-broker stats --json``, asked again until it answers: the CLI waits 2 s
    for the broker, which a broker starved of CPU on a loaded CI host can overrun."""

    def ask() -> dict | None:
        out = run_cli("stats", "--json", "--socket", socket_path)
        return json.loads(out.stdout) if out.returncode == 0 else None

    return wait_until(ask, "an answer to lmcache-ec-broker stats", timeout=60)


def put(client: BrokerClient, h: str, kib: int = 64, model: str = FP_MODEL) -> None:
    t = torch.full((kib * 512,), 1.0, dtype=torch.bfloat16)  # kib KiB
    assert client.put(key(h, model), t)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def where(base: str, *hashes: str, model: str = MODEL) -> list[dict]:
    q = urllib.parse.urlencode([("model", model)] + [("mm_hash", h) for h in hashes])
    return [r["nodes"] for r in get_json(f"{base}/v1/lookup?{q}")["results"]]


class Sub:
    """A raw subscriber, as a router would write one."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        # A test that fails before close() leaves this to the garbage collector: with the
        # default linger, the context's term() then blocked the next test forever (seen:
        # a whole module hung inside an unrelated import).
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"encoder-cache/v1/")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay = f"tcp://127.0.0.1:{port + 1}"
        self.msgs: list[tuple[bytes, int, EventBatch]] = []

    def pump(self, timeout_ms: int = 200) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            self.msgs.append((topic, int.from_bytes(seq, "big"), batch_decoder.decode(payload)))
            timeout_ms = 50

    def events(self, kind: type) -> list:
        return [e for _, _, b in self.msgs for e in b.events if isinstance(e, kind)]

    def request(self, body: bytes) -> list[list[bytes]]:
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay)
        d.send_multipart((b"", body))
        out = []
        while True:
            assert d.poll(30_000), "no answer from the replay socket"  # a loaded host
            frames = d.recv_multipart()
            out.append(frames[1:])
            if frames[2] == END_SEQ or len(body) != 8:
                break
        d.close(linger=0)
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def test_events_are_off_by_default(broker) -> None:
    stats = cli_stats(broker.socket_path)
    assert not [k for k in stats if k.startswith("events_")]
    assert "residency events" not in broker.read_log()


def test_stream_stored_evicted_deleted_in_vllm_wire_format(make_broker) -> None:
    port = port_pair()
    b = make_broker("--shm-size", "1MiB", env=events_env(port, "node-a"))
    sub = Sub(port)
    wait_until(lambda: (sub.pump(), sub.events(Heartbeat))[1], "a heartbeat")
    client = BrokerClient(b.socket_path)
    try:
        for i in range(20):  # 64 KiB each: a 1 MiB slab evicts the oldest
            put(client, f"h{i}")
        assert client.delete(key("h19"))
        assert client.put("not-a-connector-key", torch.zeros(8, dtype=torch.bfloat16))
        wait_until(lambda: (sub.pump(), len(sub.events(EncoderCacheStored)) >= 20)[1], "stored")
        sub.pump()
    finally:
        client.close()
    seqs = [s for _, s, _ in sub.msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers +1 per message"
    stored = sub.events(EncoderCacheStored)
    assert [e.mm_hash for e in stored] == [f"h{i}" for i in range(20)]
    assert {(e.model, e.dtype, e.tier, e.medium, e.nbytes) for e in stored} == {
        (FP_MODEL, "bfloat16", "slab", "CPU", 64 << 10)
    }
    removed = [e.mm_hash for e in sub.events(EncoderCacheRemoved)]
    assert "h0" in removed and "h19" in removed  # evicted, deleted
    assert "h18" not in removed
    topics = {
        parse_topic(t)
        for t, _, b in sub.msgs
        if b.events and not isinstance(b.events[0], Heartbeat)
    }
    assert topics == {("node-a", FP_MODEL)}
    # The payload is vLLM's EventBatch layout: [ts, events]; each event a map with 'type'.
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(sub.msgs[-1][2]))
    assert isinstance(raw, list) and isinstance(raw[0], float) and isinstance(raw[1], list)
    assert all("type" in e for e in raw[1])
    stats = cli_stats(b.socket_path)
    assert stats["events_unparsed_keys"] == 1 and stats["events_dropped"] == 0
    sub.close()


def test_vllm_decoder_reads_the_stream(make_broker) -> None:
    from vllm.distributed.kv_events import EventBatch as VllmEventBatch

    port = port_pair()
    b = make_broker("--shm-size", "4MiB", env=events_env(port, "node-v", lookup=False))
    sub = Sub(port)
    wait_until(lambda: (sub.pump(), sub.msgs)[1], "a message")
    client = BrokerClient(b.socket_path)
    put(client, "v1")
    client.close()
    wait_until(lambda: (sub.pump(), sub.events(EncoderCacheStored))[1], "stored")
    payload = msgspec.msgpack.encode(
        next(b for _, _, b in sub.msgs if any(isinstance(e, EncoderCacheStored) for e in b.events))
    )
    got = msgspec.msgpack.decode(payload, type=VllmEventBatch)
    assert got.events[0]["type"] == "EncoderCacheStored" and got.events[0]["mm_hash"] == "v1"
    sub.close()


def test_late_subscriber_snapshot_then_stream_and_replay(make_broker) -> None:
    port = port_pair()
    b = make_broker("--shm-size", "4MiB", env=events_env(port, "node-s"))
    client = BrokerClient(b.socket_path)
    for i in range(3):
        put(client, f"s{i}")
    sub = Sub(port)  # joins after the puts
    # Subscribed once a heartbeat arrives (every 0.2 s): s3's event below cannot be
    # lost to a subscription still on its way (a 0.3 s sleep was a window for that).
    wait_until(lambda: (sub.pump(), sub.events(Heartbeat))[1], "a heartbeat", timeout=30)
    ((topic, seq_b, payload),) = sub.request(msgspec.msgpack.encode(SnapshotRequest()))
    snap = snapshot_decoder.decode(payload)
    assert parse_topic(topic) == ("node-s", "")
    assert snap.node == "node-s" and snap.schema_version == 1
    assert int.from_bytes(seq_b, "big") == snap.next_seq
    assert sorted(e.mm_hash for e in snap.entries) == ["s0", "s1", "s2"]
    put(client, "s3")
    client.close()
    wait_until(lambda: (sub.pump(), sub.events(EncoderCacheStored))[1], "the stream after it")
    # what the snapshot holds came before next_seq; what follows it, from next_seq on
    (seq_s3,) = {s for _, s, b in sub.msgs for e in b.events if getattr(e, "mm_hash", "") == "s3"}
    assert seq_s3 >= snap.next_seq
    # vLLM's replay request: 8 bytes, the first sequence number wanted; ends with seq -1.
    replayed = sub.request((0).to_bytes(8, "big"))
    assert replayed[-1] == [b"", END_SEQ, b""]
    seqs = [int.from_bytes(f[1], "big") for f in replayed[:-1]]
    assert seqs[0] == 0 and seqs == list(range(len(seqs)))
    hashes = [
        e.mm_hash
        for f in replayed[:-1]
        for e in batch_decoder.decode(f[2]).events
        if isinstance(e, EncoderCacheStored)
    ]
    assert hashes[:4] == ["s0", "s1", "s2", "s3"]
    sub.close()


def test_broker_lookup_api_and_bad_input(make_broker) -> None:
    port = port_pair()
    b = make_broker("--shm-size", "4MiB", env=events_env(port, "node-l"))
    base = f"http://127.0.0.1:{port + 2}"
    client = BrokerClient(b.socket_path)
    put(client, "x1")
    put(client, "x2", model="other#ffff")
    client.close()
    assert where(base, "x1", "x2", "nope") == [
        [{"node": "node-l", "tiers": {"slab": 65536}}],
        [],
        [],
    ]
    assert where(base, "x1", model=FP_MODEL)[0][0]["tiers"] == {"slab": 65536}
    req = urllib.request.Request(
        f"{base}/v1/lookup",
        data=json.dumps({"model": "other", "mm_hashes": ["x2"]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["results"][0]["nodes"][0]["node"] == "node-l"
    for bad in (
        b'{"model": "", "mm_hashes": []}',
        b'{"model": "m", "mm_hashes": "x"}',
        b"[1]",
        b"{",
    ):
        req = urllib.request.Request(f"{base}/v1/lookup", data=bad)
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 400 and "error" in json.loads(exc.value.read())
    assert get_json(f"{base}/v1/nodes")["nodes"]["node-l"]["up"] is True
    # local only by default (as the metrics endpoint): not on the host's other addresses
    other = non_loopback_ip()
    if other is not None:
        for p in (port, port + 1, port + 2):
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((other, p))


def non_loopback_ip() -> str | None:
    """An IPv4 address of this host other than 127.x (None in a namespace with only lo)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_bad_events_config_refuses_clearly(sock_dir) -> None:
    for env, words in (
        ({"LMCACHE_EC_EVENTS_NODE": "a/b"}, "events_node"),
        ({"LMCACHE_EC_EVENTS_PORT": "5000", "LMCACHE_EC_EVENTS_LOOKUP_PORT": "5001"}, "collides"),
        ({"LMCACHE_EC_EVENTS_HEARTBEAT_S": "0"}, "events_heartbeat_s"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmcache_ec_broker.cli",
                "start",
                "--socket",
                f"{sock_dir}/x.sock",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, **env),
        )
        assert out.returncode == 2 and words in out.stderr, out.stderr
    # a taken port: the start is refused before the socket exists, naming the key
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmcache_ec_broker.cli",
                "start",
                "--socket",
                f"{sock_dir}/y.sock",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, LMCACHE_EC_EVENTS_PORT=str(taken)),
        )
    assert out.returncode != 0 and "events_port" in out.stderr, out.stderr
    assert not os.path.exists(f"{sock_dir}/y.sock")


def test_full_queue_drops_counts_and_leaves_a_sequence_gap() -> None:
    port = port_pair()
    pub = ZmqPublisher("127.0.0.1", port, "node-q", queue_size=1, replay=0, heartbeat_s=1.0)
    try:
        tracker = ResidencyTracker(
            "node-q", "epoch", pub.offer
        )  # thread not started: nothing drains
        for i in range(3):
            tracker.slab_stored(key(f"q{i}"), 10)
        st = tracker.stats()
        assert st["events_batches"] == 3 and st["events_seq"] == 3
        assert st["events_dropped_batches"] == 2 and st["events_dropped"] == 2
        assert pub._queue.get_nowait()[1] == 0  # the one queued is seq 0; 1 and 2 are a gap
        assert sorted(tracker.residency.lookup(MODEL, "q2")) == ["slab"]  # state stays right
    finally:
        pub.close_now()


# A broker is down for the aggregator after 6 s without a heartbeat (one every 0.2 s):
# 30 missed beats, so a live broker starved of CPU on a loaded CI host is not taken for
# dead (2 s was within reach of scheduling delays there); a killed one still is.
DOWN_AFTER_S = 6.0


def start_aggregator(
    log_dir: str | os.PathLike[str], *ports: int, down_after: float = DOWN_AFTER_S
) -> tuple[subprocess.Popen, str]:
    """An aggregator process following the brokers on ``ports``; its log goes to
    ``log_dir`` (the test's own directory: these logs piled up in /tmp before)."""
    http_port = port_pair()
    args = [sys.executable, "-m", "lmcache_ec_broker.events.aggregator", "--port", str(http_port)]
    args += ["--down-after", str(down_after)]
    for p in ports:
        args += ["--broker", f"tcp://127.0.0.1:{p}"]
    log = open(os.path.join(log_dir, f"ec-aggregator-{http_port}.log"), "w")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return proc, f"http://127.0.0.1:{http_port}"


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


def test_aggregator_follows_brokers_through_eviction_restart_and_reconnect(
    make_broker, sock_dir
) -> None:
    pa, pb = port_pair(), port_pair()
    a_sock, b_sock = f"{sock_dir}/a.sock", f"{sock_dir}/b.sock"
    disk = f"{sock_dir}/disk-b"
    disk_args = ["--shm-size", "4MiB", "--local-disk", disk, "--max-local-disk-size", "64MiB"]
    a = make_broker("--shm-size", "1MiB", socket_path=a_sock, env=events_env(pa, "node-a", False))
    b = make_broker(*disk_args, socket_path=b_sock, env=events_env(pb, "node-b", False))
    agg, base = start_aggregator(sock_dir, pa, pb)
    try:
        ca, cb = BrokerClient(a_sock), BrokerClient(b_sock)
        put(ca, "shared")
        put(cb, "shared")
        put(cb, "only-b")
        wait_until(lambda: len(where(base, "shared")[0]) == 2, "both nodes hold 'shared'")
        got = {w["node"]: w["tiers"] for w in where(base, "shared")[0]}
        assert got["node-a"] == {"slab": 65536}
        wait_until(
            lambda: (
                {w["node"]: w["tiers"] for w in where(base, "shared")[0]}["node-b"]
                == {"slab": 65536, "disk": 65536}
            ),
            "B's disk copy",
        )
        # eviction on A: 20 more entries push 'shared' out of its 1 MiB slab
        for i in range(20):
            put(ca, f"fill{i}")
        wait_until(
            lambda: [w["node"] for w in where(base, "shared")[0]] == ["node-b"], "A evicted it"
        )
        ca.close()
        cb.close()
        # restart B with its disk: its entries leave, then come back from the disk
        b.stop()
        wait_until(lambda: where(base, "only-b") == [[]], "B's entries gone while it is down")
        b2 = make_broker(*disk_args, socket_path=b_sock, env=events_env(pb, "node-b", False))
        wait_until(
            lambda: where(base, "only-b")[0] == [{"node": "node-b", "tiers": {"disk": 65536}}],
            "B's disk entries back",
        )
        # restart A without a disk (kill -9: no farewell; the heartbeat timeout drops it)
        a.kill9()
        wait_until(
            lambda: where(base, "fill19") == [[]],
            "A's entries gone after the timeout",
            timeout=DOWN_AFTER_S + 30,
        )
        make_broker("--shm-size", "1MiB", socket_path=a_sock, env=events_env(pa, "node-a", False))
        wait_until(lambda: get_json(f"{base}/v1/nodes")["nodes"]["node-a"]["up"], "A back (empty)")
        assert where(base, "fill19") == [[]]
        # a subscriber reconnecting: a new aggregator learns the state from snapshots
        stop(agg)
        cb2 = BrokerClient(b_sock)
        put(cb2, "while-away")
        cb2.close()
        agg, base = start_aggregator(sock_dir, pa, pb)
        wait_until(
            lambda: (
                where(base, "only-b", "while-away")
                == [
                    [{"node": "node-b", "tiers": {"disk": 65536}}],
                    [{"node": "node-b", "tiers": {"slab": 65536, "disk": 65536}}],
                ]
            ),
            "state after reconnecting",
        )
        nodes = get_json(f"{base}/v1/nodes")["nodes"]
        assert nodes["node-b"]["snapshots"] >= 1 and nodes["node-b"]["up"]
        b2.stop()
    finally:
        stop(agg)


def test_subscriber_recovers_from_a_dropped_batch_with_a_snapshot() -> None:
    """A batch the broker dropped (full queue) leaves a sequence gap; the subscriber
    notices it and takes a snapshot, so the entry of the lost batch is not missed."""
    import asyncio
    import threading

    from lmcache_ec_broker.events.subscriber import Subscriber

    port = port_pair()
    pub = ZmqPublisher("127.0.0.1", port, "node-g", queue_size=64, replay=100, heartbeat_s=0.1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    full = threading.Event()

    def sink(topic: bytes, seq: int, payload: bytes) -> bool:
        if full.is_set():  # the queue is full for this one batch
            full.clear()
            return False
        return pub.offer(topic, seq, payload)

    tracker = ResidencyTracker("node-g", "epoch-1", sink)
    pub.start(lambda: loop, tracker.snapshot, tracker.heartbeat)
    sub = Subscriber([f"tcp://127.0.0.1:{port}"], down_after_s=5.0)
    sub.start()
    try:

        def store(h: str) -> None:
            loop.call_soon_threadsafe(tracker.slab_stored, key(h), 100)

        store("g0")
        wait_until(lambda: sub.lookup(MODEL, ["g0"]) != [[]], "g0 seen")
        full.set()
        store("g1")  # dropped
        wait_until(lambda: not full.is_set(), "the drop")
        store("g2")
        wait_until(
            lambda: all(sub.lookup(MODEL, ["g1", "g2"])), "g1 (lost batch) and g2 after resync"
        )
        status = sub.nodes()["node-g"]
        assert status["gaps"] >= 1 and status["snapshots"] >= 2, status
        assert tracker.stats()["events_dropped_batches"] == 1
    finally:
        sub.close()
        asyncio.run_coroutine_threadsafe(_stop(tracker, pub), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _stop(tracker: ResidencyTracker, pub: ZmqPublisher) -> None:
    tracker.close()
    await pub.stop()


# ---------------------------------------------------------------- the shared remote tier


def test_remote_tier_published_only_for_what_this_broker_wrote_or_deleted(make_broker) -> None:
    """A put is published for the slab and, once written behind, for the remote tier;
    a delete publishes the remote removal; a second broker that only learns the key
    from the store (announcement, then a promotion) publishes nothing for the remote
    tier; a shared clear publishes a clear of the remote tier. A real redis-server on a
    Unix socket."""
    from redis_servers import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    srv = RedisServer()
    try:
        remote = {"LMCACHE_EC_REMOTE_URL": srv.url("unix"), "LMCACHE_EC_REMOTE_TIMEOUT_S": "1.0"}
        pa, pb = port_pair(), port_pair()
        a = make_broker("--shm-size", "4MiB", env=events_env(pa, "node-a", **remote))
        b = make_broker("--shm-size", "4MiB", env=events_env(pb, "node-b", **remote))
        sa, sb = Sub(pa), Sub(pb)
        wait_until(lambda: (sa.pump(), sa.events(Heartbeat))[1], "a heartbeat from A")
        wait_until(lambda: (sb.pump(), sb.events(Heartbeat))[1], "a heartbeat from B")
        ca = BrokerClient(a.socket_path, timeout_s=5.0)
        cb = BrokerClient(b.socket_path, timeout_s=5.0)

        def tiers(sub: Sub, kind: type) -> list[tuple[str, str, str | None]]:
            sub.pump()
            return [(e.mm_hash, e.tier, e.medium) for e in sub.events(kind)]

        put(ca, "r1")
        wait_until(lambda: ("r1", "remote", "REMOTE") in tiers(sa, EncoderCacheStored), "remote")
        assert tiers(sa, EncoderCacheStored) == [("r1", "slab", "CPU"), ("r1", "remote", "REMOTE")]
        assert {e.nbytes for e in sa.events(EncoderCacheStored)} == {64 << 10}
        assert where(f"http://127.0.0.1:{pa + 2}", "r1") == [
            [{"node": "node-a", "tiers": {"slab": 65536, "remote": 65536}}]
        ]
        ((_, _, payload),) = sa.request(msgspec.msgpack.encode(SnapshotRequest()))
        assert sorted(
            (e.mm_hash, e.tier) for e in snapshot_decoder.decode(payload).entries
        ) == [("r1", "remote"), ("r1", "slab")]

        # B learns r1 from the store only, and promotes it into its slab: only the slab.
        wait_until(lambda: cb.stats()["remote_known_keys"] >= 1, "B learns r1")
        got = cb.get(key("r1"))
        assert got is not None and got.numel() == 64 * 512
        wait_until(lambda: ("r1", "slab", "CPU") in tiers(sb, EncoderCacheStored), "B's slab")
        # Two heartbeats more (in order with B's other events): nothing else may follow.
        beats = len(sb.events(Heartbeat))
        wait_until(
            lambda: (sb.pump(), len(sb.events(Heartbeat)) >= beats + 2)[1], "two more heartbeats"
        )
        assert tiers(sb, EncoderCacheStored) == [("r1", "slab", "CPU")]
        assert where(f"http://127.0.0.1:{pb + 2}", "r1")[0][0]["tiers"] == {"slab": 65536}

        # A deletes r1: the slab and, once the store's delete ran, the remote copy.
        assert ca.delete(key("r1"))
        wait_until(lambda: ("r1", "remote", "REMOTE") in tiers(sa, EncoderCacheRemoved), "removed")
        assert sorted(tiers(sa, EncoderCacheRemoved)) == [
            ("r1", "remote", "REMOTE"),
            ("r1", "slab", "CPU"),
        ]
        assert where(f"http://127.0.0.1:{pa + 2}", "r1") == [[]]
        assert not [t for t in tiers(sb, EncoderCacheRemoved) if t[1] == "remote"]

        # A shared clear (this broker clears the store's namespace): a tier-wide clear.
        put(ca, "r2")
        wait_until(lambda: ("r2", "remote", "REMOTE") in tiers(sa, EncoderCacheStored), "r2")
        assert ca.clear(shared=True)
        wait_until(
            lambda: (sa.pump(), EncoderCacheCleared("remote") in sa.events(EncoderCacheCleared))[1],
            "the remote tier's clear",
        )
        assert where(f"http://127.0.0.1:{pa + 2}", "r2") == [[]]
        ca.close()
        cb.close()
        sa.close()
        sb.close()
    finally:
        srv.stop()


# ---------------------------------------------------------------- issue 30, item 8


def test_heartbeats_carry_schema_version_on_the_wire(make_broker) -> None:
    # docs/events.md lists schema_version in every Heartbeat; omit_defaults dropped it.
    port = port_pair()
    make_broker("--shm-size", "4MiB", env=events_env(port, "node-h", lookup=False))
    sub = Sub(port)
    raw: list[bytes] = []

    def a_heartbeat() -> bool:
        while sub.sub.poll(100):
            _, _, payload = sub.sub.recv_multipart()
            raw.append(payload)
        return any(b"Heartbeat" in p for p in raw)

    wait_until(a_heartbeat, "a heartbeat")
    beats = [
        e
        for p in raw
        for e in msgspec.msgpack.decode(p)[1]  # the plain map, as any msgpack reader sees it
        if e["type"] == "Heartbeat"
    ]
    assert beats and all(e["schema_version"] == 1 and e["epoch"] for e in beats), beats
    sub.close()


def _raw_http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is; (status, headers, body) of the answer, read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data, f"no answer at all to {request[:60]!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def _deep_json(depth: int) -> bytes:
    return b'{"model": ' + b"[" * depth + b"]" * depth + b"}"


def _bad_http_inputs() -> list[bytes]:
    deep = _deep_json(200_000)  # RecursionError in json.loads, well under MAX_BODY
    return [
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(deep) + deep,
        b"GARBAGE\r\n\r\n",  # malformed request line
        b"GET /v1/lookup HTTP/9.9\r\n\r\n",  # unsupported version
        b"FETCH /v1/lookup HTTP/1.1\r\nHost: x\r\n\r\n",  # unsupported method
    ]


def _assert_json_errors(port: int) -> None:
    for request in _bad_http_inputs():
        status, headers, body = _raw_http(port, request)
        assert 400 <= status < 600, (request[:40], status)
        assert headers.get("content-type") == "application/json", (request[:40], headers, body)
        assert "error" in json.loads(body), body
    # and it still answers afterwards
    assert _raw_http(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200


def test_broker_lookup_answers_a_deep_body_and_bad_request_lines_with_json(make_broker) -> None:
    port = port_pair()
    make_broker("--shm-size", "4MiB", env=events_env(port, "node-j"))
    status, _, body = _raw_http(port + 2, _bad_http_inputs()[0])
    assert status == 400 and "nested" in json.loads(body)["error"], body
    _assert_json_errors(port + 2)


def test_aggregator_answers_a_deep_body_and_bad_request_lines_with_json(tmp_path) -> None:
    proc, base = start_aggregator(tmp_path, port_pair())
    try:
        _assert_json_errors(int(base.rsplit(":", 1)[1]))
    finally:
        stop(proc)
