"""The Mooncake Store remote tier against a real ``mooncake_master``.

Everything Mooncake runs inside a private network namespace with only ``lo``
(tests/mooncake_env.py); the test process stays outside and talks to the tier
drivers over pipes and to the brokers over their Unix sockets.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mooncake_env import (
    MooncakeMaster,
    MooncakeNetns,
    TierDriver,
    payload,
    unavailable_reason,
)

from lmcache_ec_broker.broker.tiers.remote.value import encode_value
from lmcache_ec_broker.config_mooncake import parse_mooncake_url
from lmcache_ec_broker.protocol import DTYPE_ITEMSIZE, QUANTIZED_DTYPES, expected_nbytes

REASON = unavailable_reason()
EXAMPLE_YAML = str(Path(__file__).resolve().parent.parent / "examples" / "mooncake" / "broker.yaml")
needs_mooncake = pytest.mark.skipif(REASON is not None, reason=REASON or "")


class Env:
    def __init__(self, ns: MooncakeNetns, master: MooncakeMaster, log_dir: str) -> None:
        self.ns, self.master, self.log_dir = ns, master, log_dir
        self.drivers: list[TierDriver] = []

    def driver(self, **overrides: object) -> TierDriver:
        settings: dict[str, object] = dict(
            master=self.master.address,
            local_hostname="127.0.0.1",
            global_segment_size=64 << 20,
            key_prefix="t:",
            timeout_s=1.0,
            key_poll_s=0.0,
        )
        settings.update(overrides)
        d = TierDriver(self.ns, self.log_dir, settings)
        self.drivers.append(d)
        assert d.call("wait_up")["up"], d.read_log()
        return d


@pytest.fixture
def mc(request, tmp_path) -> Iterator[Env]:
    ns = MooncakeNetns()
    try:
        # a test may ask for its own lease TTL (indirect parametrization)
        lease_ttl_ms = getattr(request, "param", 1500)
        master = MooncakeMaster(ns, str(tmp_path), lease_ttl_ms=lease_ttl_ms)
        env = Env(ns, master, str(tmp_path))
        yield env
        for d in env.drivers:
            d.stop()
    finally:
        ns.close()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.name not in out, "the test's network namespace was left behind"


def sha(nbytes: int, seed: int) -> str:
    return hashlib.sha256(payload(nbytes, seed)).hexdigest()


def until(fn, tries: int = 200, pause: float = 0.1):
    """Call ``fn`` until it returns something truthy (a bounded number of tries)."""
    for _ in range(tries):
        got = fn()
        if got:
            return got
        time.sleep(pause)
    raise AssertionError(f"condition never held: {fn}")


# ---------------------------------------------------------------- config / packaging


def test_url_parsing() -> None:
    assert parse_mooncake_url("mooncakestore://127.0.0.1:50051") == "127.0.0.1:50051"
    assert parse_mooncake_url("MooncakeStore://master.svc:7000/") == "master.svc:7000"
    for bad in (
        "mooncakestore://127.0.0.1",
        "mooncakestore://:50051",
        "mooncakestore://u:p@h:1",
        "mooncakestore://h:1/x",
        "redis://h:1",
        "mooncakestore://h:99999",
    ):
        with pytest.raises(ValueError, match="remote_url"):
            parse_mooncake_url(bad)


def test_config_layers_and_refusals(tmp_path, monkeypatch) -> None:
    from lmcache_ec_broker.config_sources import load_config

    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "remote_url: mooncakestore://10.0.0.5:50051\n"
        "mooncake_protocol: tcp\n"
        "mooncake_global_segment_size: 2GiB\n"
        "ec_mooncake_local_buffer_size: 32MiB\n"
        "mooncake_metadata_server: P2PHANDSHAKE\n"
    )
    monkeypatch.setenv("LMCACHE_EC_MOONCAKE_LOCAL_HOSTNAME", "10.0.0.7")
    cfg, sources = load_config(config_file=str(yaml))
    assert cfg.mooncake_global_segment_size == 2 << 30
    assert cfg.mooncake_local_buffer_size == 32 << 20
    assert cfg.mooncake_local_hostname == "10.0.0.7"
    assert sources["mooncake_local_hostname"] == "env LMCACHE_EC_MOONCAKE_LOCAL_HOSTNAME"

    from lmcache_ec_broker.broker.tiers.mooncake.settings import settings_from_config

    s = settings_from_config(cfg)
    assert (s.master, s.local_hostname, s.global_segment_size) == (
        "10.0.0.5:50051",
        "10.0.0.7",
        2 << 30,
    )

    monkeypatch.setenv("LMCACHE_EC_MOONCAKE_PROTOCOL", "rdma")
    with pytest.raises(ValueError, match="mooncake_device_name"):
        load_config(config_file=str(yaml))
    monkeypatch.setenv("LMCACHE_EC_MOONCAKE_PROTOCOL", "udp")
    with pytest.raises(ValueError, match="mooncake_protocol"):
        load_config(config_file=str(yaml))


def test_broker_without_the_package_refuses_the_url(tmp_path) -> None:
    """A broker without Mooncake installed refuses mooncakestore:// with one line
    naming the extra, and leaves nothing behind."""
    sock = str(tmp_path / "b.sock")
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        "from lmcache_ec_broker.cli import main\n"
        f"sys.exit(main(['start', '--socket', {sock!r}, '--shm-size', '64MiB', "
        "'--remote-url', 'mooncakestore://127.0.0.1:50051']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "lmcache-ec-broker[mooncake]" in ln]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not os.path.exists(sock)
    from conftest import shm_segments

    assert shm_segments(sock, include_filter=True) == []


# ---------------------------------------------------------------- the tier against a real master


@needs_mooncake
def test_confined_to_loopback(mc: Env) -> None:
    assert mc.ns.interfaces() == ["lo"]
    a, b = mc.driver(), mc.driver()
    assert a.call("put", key="k", dtype="uint8", shape=[1 << 16], seed=1)["started"]
    meta = b.call("lookup", keys=["k"])["metas"][0]
    assert b.call("read", key="k", meta=meta)["sha256"] == sha(1 << 16, 1)
    inside = mc.ns.listeners()
    assert "127.0.0.1:50051" in inside and "127.0.0.1:9003" in inside
    pids = {str(p.pid) for p in mc.ns.procs}
    host = mc.ns.host_listeners()
    leaked = [ln for ln in host.splitlines() if any(f"pid={p}," in ln for p in pids)]
    assert not leaked, f"Mooncake listens outside its namespace: {leaked}"
    assert ":50051 " not in host and "mooncake" not in host


@needs_mooncake
def test_every_dtype_bit_identical_between_two_tiers(mc: Env) -> None:
    a, b = mc.driver(), mc.driver()
    cases = []
    for i, dtype in enumerate(sorted(set(DTYPE_ITEMSIZE) - QUANTIZED_DTYPES)):
        cases.append((f"dtype-{dtype}", dtype, [7, 33, 5], 100 + i))
    cases.append(("big", "float32", [2, 1 << 20], 7))  # 8 MiB across 3 extents
    cases.append(("tiny", "uint8", [3], 8))  # object shorter than the header probe
    cases.append(("long-" + "k" * 900, "bfloat16", [4, 4], 9))  # header longer than the probe
    for key, dtype, shape, seed in cases:
        assert a.call("put", key=key, dtype=dtype, shape=shape, seed=seed, pieces=3)["started"]
    keys = [c[0] for c in cases]
    metas = b.call("lookup", keys=[*keys, "absent"])["metas"]
    assert metas[-1] is None
    for (key, dtype, shape, seed), meta in zip(cases, metas, strict=False):
        n = expected_nbytes(dtype, shape)
        assert meta == [n, dtype, shape], key
        got = b.call("read", key=key, meta=meta, pieces=2)
        assert got.get("sha256") == sha(n, seed), (key, got)
    st = a.call("stats")["stats"]
    assert st["remote_writes"] == len(cases)
    st = b.call("stats")["stats"]
    assert st["remote_hits"] == len(cases) and st["remote_misses"] == 1
    assert st["remote_refused_values"] == 0
    # A second write of a key the store holds is skipped, not re-sent.
    assert a.call("put", key="big", dtype="float32", shape=[2, 1 << 20], seed=7)["started"] is False


@needs_mooncake
def test_poisoned_values_are_refused_never_served(mc: Env) -> None:
    a, b = mc.driver(), mc.driver()
    good = encode_value("x", "float32", [4, 64], payload(1024, 3))
    flipped = bytearray(encode_value("flip", "float32", [4, 64], payload(1024, 3)))
    flipped[-5] ^= 0xFF
    big = encode_value("bigflip", "uint8", [3 << 20], payload(3 << 20, 4))
    big_flipped = bytearray(big)
    big_flipped[len(big) // 2] ^= 0x01  # one bit in the middle of a pipelined read
    poison = {
        "bigflip": bytes(big_flipped),
        "bigtrunc": encode_value("bigtrunc", "uint8", [3 << 20], payload(3 << 20, 4))[:-1],
        "garbage": os.urandom(3000),
        "short": b"ECRV" + b"\0" * 6,
        "moved": good,  # a valid value stored under another key
        "truncated": encode_value("truncated", "float32", [4, 64], payload(1024, 3))[:-10],
        "trailing": encode_value("trailing", "float32", [4, 64], payload(1024, 3)) + b"\0" * 8,
        "flip": bytes(flipped),
        "liar": encode_value("liar", "float32", [4, 64], payload(1024, 3)).replace(
            b"\x00\x04\x00\x00\x00\x00\x00\x00", b"\x00\x00\x10\x00\x00\x00\x00\x00", 1
        ),
    }
    for key, data in poison.items():
        assert a.call("raw_put", key=key, data=base64.b64encode(data).decode())["rc"] == 0
    metas = dict(zip(poison, b.call("lookup", keys=list(poison))["metas"], strict=True))
    served = []
    for key, meta in metas.items():
        if meta is None:
            continue
        got = b.call("read", key=key, meta=meta)
        assert "sha256" not in got, f"{key} was served: {got}"
        assert got["failed"] in ("TierCorrupt", "TierMiss"), got
        served.append(key)
    # Header-level poison never even looks like a hit.
    for key in ("garbage", "short", "moved", "liar"):
        assert metas[key] is None, key
    st = b.call("stats")["stats"]
    assert st["remote_refused_values"] == len(poison)  # each counted once, then not asked again
    # Refused values are not offered again.
    assert b.call("lookup", keys=list(poison))["metas"] == [None] * len(poison)


def _calls(st: dict) -> int:
    """Store calls the tier timed (one per transfer job: a lookup's header read, a read)."""
    return st["remote_latency_ms_le_inf"]


@needs_mooncake
def test_a_get_no_lookup_preceded_is_one_transfer_verified_before_any_reserve(mc: Env) -> None:
    """Issue 18: a get of a key no lookup preceded (``fetch``) moves the whole value in
    ONE transfer (into a staging buffer) and checks its header there -- bounds, key,
    dtype table, exact length -- before any slab range is reserved: a header that
    lies (about its size, its key, ...) is refused and never costs a reservation; a
    payload that fails its checksum (checked while it is copied into the range) is
    refused too (the caller then aborts the range). Larger than a stage: header,
    then the pipelined read into the range. A reserve that declines takes nothing."""
    a, b = mc.driver(), mc.driver()
    cases = [("one-mib", "float16", [512, 1024], 1), ("tiny", "uint8", [3], 2)]
    cases.append(("long-" + "k" * 900, "bfloat16", [33, 7], 3))  # header longer than the probe
    cases.append(("video", "bfloat16", [3, 1 << 20], 4))  # 6 MiB: larger than a stage
    for key, dtype, shape, seed in cases:
        assert a.call("put", key=key, dtype=dtype, shape=shape, seed=seed)["started"]
    for key, dtype, shape, seed in cases:
        n = expected_nbytes(dtype, shape)
        before = b.call("stats")["stats"]
        got = b.call("fetch", key=key)
        assert got.get("done") is True, (key, got)
        assert got["sha256"] == sha(n, seed), key
        assert [r[:3] for r in got["reserved"]] == [[n, dtype, shape]], key
        after = b.call("stats")["stats"]
        staged = after["remote_staged_reads"] - before["remote_staged_reads"]
        if n < 4 << 20:  # one transfer, timed once; nothing looked up first
            assert (staged, _calls(after) - _calls(before)) == (1, 1), key
        else:
            assert staged == 0, key
    st = b.call("stats")["stats"]
    assert st["remote_hits"] == len(cases) and st["remote_refused_values"] == 0

    liar = bytearray(encode_value("liar", "float32", [4, 64], payload(1024, 3)))
    liar[16:24] = (2048).to_bytes(8, "little")  # payload_len: says 2048, holds 1024
    flipped = bytearray(encode_value("flip", "float32", [4, 64], payload(1024, 3)))
    flipped[-5] ^= 0xFF
    poison = {
        "liar": bytes(liar),
        "flip": bytes(flipped),
        "truncated": encode_value("truncated", "float32", [4, 64], payload(1024, 3))[:-10],
        "trailing": encode_value("trailing", "float32", [4, 64], payload(1024, 3)) + b"\0" * 8,
        "moved": encode_value("x", "float32", [4, 64], payload(1024, 3)),
        "garbage": os.urandom(3000),
    }
    for key, data in poison.items():
        assert a.call("raw_put", key=key, data=base64.b64encode(data).decode())["rc"] == 0
    for key in poison:
        got = b.call("fetch", key=key)
        assert got.get("failed") == "TierCorrupt", (key, got)
        if key == "flip":  # a header that tells the truth: reserved, then refused
            assert [r[:3] for r in got["reserved"]] == [[1024, "float32", [4, 64]]]
        else:
            assert got["reserved"] == [], f"{key}: a slab range was reserved for a bad header"
    assert b.call("stats")["stats"]["remote_refused_values"] == len(poison)
    got = b.call("fetch", key="absent")
    assert (got["failed"], got["reserved"]) == ("TierMiss", []), got
    # A reserve that declines (no room, or a client writing the key) takes nothing.
    got = b.call("fetch", key="one-mib", decline=True)
    assert got == {"done": False, "reserved": [[1 << 20, "float16", [512, 1024]]]}, got


@needs_mooncake
def test_fetches_share_two_staging_buffers_and_a_cancelled_one_returns_its_buffer(
    mc: Env,
) -> None:
    """Two staging buffers: a third fetch started while both are taken answers "not
    here" (None: the get looks up and promotes instead) without any I/O or
    reservation. A fetch cancelled mid-transfer returns only after its transfer
    ended, and its buffer is free again for the next fetches."""
    a, b = mc.driver(), mc.driver()
    keys = [f"s{i}" for i in range(3)]
    for i, key in enumerate(keys):
        assert a.call("put", key=key, dtype="uint8", shape=[3 << 20], seed=20 + i)["started"]
    got = b.call("fetch_together", keys=keys)
    assert got == {"done": [True, True, None], "reserved": [3 << 20, 3 << 20]}, got
    got = b.call("fetch_cancel", key="s2")
    assert got["transfers_running"] == 0, got
    for _ in range(3):  # both buffers are back (a leak would make these None)
        assert b.call("fetch_together", keys=keys[:2])["done"] == [True, True]
    got = b.call("fetch", key="s2")
    assert got.get("sha256") == sha(3 << 20, 22), got


@needs_mooncake
def test_hmac_refuses_unsigned_values(mc: Env) -> None:
    key = "k" * 32
    a, b = mc.driver(), mc.driver(hmac_key=key)
    signer = mc.driver(hmac_key=key)
    assert a.call("put", key="unsigned", dtype="int16", shape=[100], seed=1)["started"]
    assert signer.call("put", key="signed", dtype="int16", shape=[100], seed=2)["started"]
    metas = b.call("lookup", keys=["unsigned", "signed"])["metas"]
    assert metas[0] is None
    assert b.call("read", key="signed", meta=metas[1])["sha256"] == sha(200, 2)
    assert b.call("stats")["stats"]["remote_refused_values"] == 1


@needs_mooncake
def test_master_killed_and_restarted(mc: Env) -> None:
    a, b = mc.driver(), mc.driver()
    assert a.call("put", key="before", dtype="float16", shape=[512], seed=1)["started"]
    assert b.call("lookup", keys=["before"])["metas"][0] is not None
    mc.master.kill()
    # Down: every answer comes back (a miss for the coordinator), the circuit opens.
    answers = [b.call("lookup", keys=["before"]) for _ in range(5)]
    assert all("unavailable" in r for r in answers), answers
    st = b.call("stats")["stats"]
    assert st["remote_up"] == 0 and st["remote_circuit_opens"] >= 1
    # A write while the store is down is dropped (counted), never blocks.
    started = a.call("put", key="during", dtype="float16", shape=[512], seed=2)
    st = a.call("stats")["stats"]
    assert not started["started"] or st["remote_write_errors"] + st["remote_write_drops"] >= 1
    mc.master.start()
    # Back: the restarted master lost everything (a miss, not an error) ...
    until(lambda: "metas" in b.call("lookup", keys=["before"]))
    assert b.call("lookup", keys=["before"])["metas"] == [None]

    # ... and new entries flow again once the clients re-registered their segments.
    def written() -> bool:
        a.call("put", key="after", dtype="float16", shape=[512], seed=3)
        return b.call("lookup", keys=["after"]).get("metas", [None])[0] is not None

    until(written)
    meta = b.call("lookup", keys=["after"])["metas"][0]
    assert b.call("read", key="after", meta=meta)["sha256"] == sha(1024, 3)
    assert b.call("stats")["stats"]["remote_up"] == 1


@needs_mooncake
def test_master_down_at_start(mc: Env) -> None:
    """A tier whose master is down at start serves misses, drops writes (counted),
    and connects by itself when the master comes up."""
    mc.master.kill()
    settings = dict(master=mc.master.address, local_hostname="127.0.0.1", key_prefix="t:")
    settings.update(global_segment_size=64 << 20, timeout_s=1.0, key_poll_s=0.0)
    a = TierDriver(mc.ns, mc.log_dir, settings)
    mc.drivers.append(a)
    assert a.call("wait_up", for_s=2)["up"] is False
    assert "unavailable" in a.call("lookup", keys=["k"])
    assert a.call("put", key="k", dtype="uint8", shape=[64], seed=1)["started"] is False
    assert a.call("stats")["stats"]["remote_write_drops"] == 1
    mc.master.start()
    assert a.call("wait_up", for_s=60, timeout=90)["up"], a.read_log()
    b = mc.driver()
    assert a.call("put", key="k", dtype="uint8", shape=[64], seed=1)["started"]
    meta = b.call("lookup", keys=["k"])["metas"][0]
    assert b.call("read", key="k", meta=meta)["sha256"] == sha(64, 1)


@needs_mooncake
@pytest.mark.parametrize("mc", [10_000], indirect=True)
def test_delete_waits_out_a_readers_lease(mc: Env) -> None:
    """Mooncake refuses to remove an object read within its lease TTL (-706): the
    tier stops answering hits at once and removes it when the lease ends.

    The lease lasts 10 s (the other tests' master: 1.5 s): A's delete must come
    while B's lease holds, and on a loaded host the two driver calls between B's read
    and A's delete may take longer than 1.5 s (the delete then meets no lease)."""
    a, b = mc.driver(), mc.driver()
    assert a.call("put", key="k", dtype="uint8", shape=[4096], seed=1)["started"]
    assert b.call("lookup", keys=["k"])["metas"][0] is not None  # B's read: a lease
    assert a.call("delete", keys=["k"])["held"] == [True]
    assert a.call("lookup", keys=["k"])["metas"] == [None]
    until(lambda: a.call("stats")["stats"]["remote_lease_conflicts"] >= 1, tries=600)
    until(lambda: "t:k" not in mc.master.keys(), tries=600)
    assert b.call("lookup", keys=["k"])["metas"] == [None]


@needs_mooncake
def test_cancelled_promotion_returns_only_after_its_transfer(mc: Env) -> None:
    """The coordinator frees the reserved extents when read_into ends; a cancelled
    read_into must therefore not end while Mooncake may still write into them."""
    a, b = mc.driver(), mc.driver()
    assert a.call("put", key="big", dtype="uint8", shape=[32 << 20], seed=1)["started"]
    meta = b.call("lookup", keys=["big"])["metas"][0]
    got = b.call("read_cancel", key="big", meta=meta)
    assert got["outcome"] == "cancelled" and got["transfers_running"] == 0, got
    assert b.call("read", key="big", meta=meta)["sha256"] == sha(32 << 20, 1)


@needs_mooncake
def test_clear_removes_the_namespace_only(mc: Env) -> None:
    a = mc.driver()
    other = mc.driver(key_prefix="other:")
    for key in ("k1", "k2"):
        assert a.call("put", key=key, dtype="uint8", shape=[128], seed=1)["started"]
    assert other.call("put", key="k1", dtype="uint8", shape=[128], seed=2)["started"]
    assert a.call("clear")["n"] == 2
    assert a.call("lookup", keys=["k1", "k2"])["metas"] == [None, None]
    until(lambda: not any(k.startswith("t:") for k in mc.master.keys()))
    assert "other:k1" in mc.master.keys()
    assert other.call("lookup", keys=["k1"])["metas"][0] is not None


@needs_mooncake
def test_key_listing_feeds_the_membership_filter(mc: Env) -> None:
    """Keys another node wrote reach this node's filter without a lookup; keys that
    leave the store leave the filter."""
    a, b = mc.driver(), mc.driver(key_poll_s=0.2)
    assert a.call("put", key="from-a", dtype="uint8", shape=[100], seed=1)["started"]
    until(lambda: ["added", "from-a"] in b.call("stats")["events"])
    assert b.call("stats")["stats"]["remote_announcements"] >= 1
    a.call("raw_remove", key="from-a")
    until(lambda: ["removed", "from-a"] in b.call("stats")["events"])


# ---------------------------------------------------------------- two real brokers


class NetnsBroker:
    """A real ``lmcache-ec-broker start`` inside the namespace, reached over its Unix socket."""

    def __init__(self, mc: Env, name: str, *args: str, **env: str) -> None:
        self.socket_path = os.path.join(mc.log_dir, f"{name}.sock")
        self.log_path = os.path.join(mc.log_dir, f"{name}.log")
        full_env = dict(
            os.environ,
            LMCACHE_EC_MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
            LMCACHE_EC_MOONCAKE_GLOBAL_SEGMENT_SIZE="128MiB",
            LMCACHE_EC_REMOTE_KEY_PREFIX="t:",
            **env,
        )
        argv = [sys.executable, "-m", "lmcache_ec_broker.cli", "start"]
        argv += ["--socket", self.socket_path, "--shm-size", "64MiB", "--remote-url", mc.master.url]
        self.proc = mc.ns.popen([*argv, *args], log_path=self.log_path, env=full_env)
        from lmcache_ec_broker.broker.server import probe_socket

        until(lambda: probe_socket(self.socket_path, timeout=0.2) or self.proc.poll() is not None)
        assert self.proc.poll() is None, self.read_log()

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        assert self.proc.returncode == 0, self.read_log()


@pytest.fixture
def two_brokers(mc: Env) -> Iterator[tuple[Env, NetnsBroker, NetnsBroker]]:
    from conftest import shm_segments

    # A runs from the documented example file (the environment and flags override
    # its cluster addresses); B from flags and environment only.
    a = NetnsBroker(mc, "a", "--config", EXAMPLE_YAML, LMCACHE_EC_MOONCAKE_KEY_POLL_S="0.2")
    b = NetnsBroker(mc, "b", LMCACHE_EC_MOONCAKE_KEY_POLL_S="0.2")
    yield mc, a, b
    for br in (a, b):
        br.stop()
        assert not os.path.exists(br.socket_path)
        assert shm_segments(br.socket_path, include_filter=True) == []


def _tensor(dtype: str, shape: list[int], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == "bool":
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _bytes(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _torch_dtypes() -> list[str]:
    import torch

    return [
        d
        for d in sorted(set(DTYPE_ITEMSIZE) - QUANTIZED_DTYPES)
        if isinstance(getattr(torch, d, None), torch.dtype)
    ]


@needs_mooncake
def test_two_brokers_put_on_a_remote_hit_on_b_every_dtype(two_brokers) -> None:
    from lmcache_ec_broker import BrokerClient

    mc, a, b = two_brokers
    dtypes = _torch_dtypes()
    tensors = {f"img-{d}": _tensor(d, [3, 257, 9], i) for i, d in enumerate(dtypes)}
    tensors["video"] = _tensor("bfloat16", [16, 2048, 96], 99)  # 6 MiB: pipelined promotion
    with BrokerClient(a.socket_path) as ca, BrokerClient(b.socket_path) as cb:
        for key, t in tensors.items():
            assert ca.put(key, t), key
        # B's filter learns A's keys from the store (no round trip needed to find them).
        until(lambda: all(cb.has(list(tensors))))
        for key, t in tensors.items():
            got = cb.get(key)
            assert got is not None, key
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert _bytes(got) == _bytes(t), key
        sb = cb.stats()
        assert sb["promotions"] >= len(tensors) and sb["promotion_failures"] == 0
        assert sb["remote_bytes_read"] == sum(len(_bytes(t)) for t in tensors.values())
        sa = ca.stats()
        assert sa["remote_writes"] == len(tensors)
        # Now local on B: a second get is a slab hit, no new remote read.
        assert _bytes(cb.get("video")) == _bytes(tensors["video"])
        assert cb.stats()["remote_bytes_read"] == sb["remote_bytes_read"]


@needs_mooncake
def test_with_key_listing_off_a_filtering_client_still_finds_a_remote_hit(mc: Env) -> None:
    """mooncake_key_poll_s 0: nothing lists the store's keys, so this node's filter
    cannot prove a key absent (shm/filter.py, "Partial"): a client that trusts the
    filter asks the broker, which asks the store (before: a local miss, never asked)."""
    from conftest import shm_segments

    from lmcache_ec_broker import BrokerClient

    a = NetnsBroker(mc, "a", LMCACHE_EC_MOONCAKE_KEY_POLL_S="0.2")
    b = NetnsBroker(mc, "b", LMCACHE_EC_MOONCAKE_KEY_POLL_S="0")
    try:
        t = _tensor("bfloat16", [64, 128], 7)
        with BrokerClient(a.socket_path) as ca, BrokerClient(b.socket_path) as cb:
            assert ca.put("unlisted", t)
            until(lambda: ca.stats()["remote_writes"] == 1)
            misses0 = cb.local_misses
            assert cb.has(["unlisted", "nowhere"]) == [True, False]
            assert cb.local_misses == misses0
            got = cb.get("unlisted")
            assert got is not None and _bytes(got) == _bytes(t)
    finally:
        for br in (a, b):
            br.stop()
            assert shm_segments(br.socket_path, include_filter=True) == []


@needs_mooncake
def test_two_brokers_a_remote_get_is_one_transfer(two_brokers) -> None:
    """Issue 18: B's get of a key only A stored is one Mooncake transfer (into a staging
    buffer, verified there, then copied into the range reserved for it) -- not a
    lookup's header read and then a second transfer of the value. A value whose
    header lies about its size, or whose payload fails its checksum, is refused with
    nothing left reserved or visible."""
    from lmcache_ec_broker import BrokerClient

    mc, a, b = two_brokers
    tensors = {f"hit-{i}": _tensor("bfloat16", [1024, 512], 10 + i) for i in range(3)}  # 1 MiB
    with BrokerClient(a.socket_path) as ca, BrokerClient(b.socket_path) as cb:
        for key, t in tensors.items():
            assert ca.put(key, t), key
        until(lambda: all(cb.has(list(tensors))))
        for key, t in tensors.items():
            before = cb.stats()
            got = cb.get(key)
            after = cb.stats()
            assert got is not None and _bytes(got) == _bytes(t), key
            assert after["remote_staged_reads"] - before["remote_staged_reads"] == 1, key
            assert _calls(after) - _calls(before) == 1, f"{key}: more than one store transfer"
            assert after["promotions"] - before["promotions"] == 1, key
        # a header consistent in itself (uint8 [8192]) on an object holding 4 KiB of it
        liar = encode_value("liar", "uint8", [8192], payload(8192, 5))[:-4096]
        poisoner = mc.driver()
        assert poisoner.call("raw_put", key="liar", data=base64.b64encode(liar).decode())["rc"] == 0
        flipped = bytearray(encode_value("flip", "uint8", [8192], payload(8192, 6)))
        flipped[-100] ^= 1  # a payload byte: its checksum fails while it is copied in
        for key, data in (("liar", liar), ("flip", bytes(flipped))):
            assert poisoner.call("raw_put", key=key, data=base64.b64encode(data).decode())["rc"] == 0
            until(lambda key=key: cb.has([key])[0])  # a lookup reads only the header: a hit
            assert cb.get(key) is None, key
        st = cb.stats()
        assert st["remote_refused_values"] == 2
        assert (st["reserved_entries"], st["reserved_bytes"], st["entries"]) == (0, 0, 3)
        assert cb.ping()


@needs_mooncake
def test_two_brokers_poisoned_value_is_a_miss(two_brokers) -> None:
    from lmcache_ec_broker import BrokerClient

    mc, a, b = two_brokers
    poisoner = mc.driver()  # a plain Mooncake client writing straight into the store
    bad = bytearray(encode_value("p", "float32", [8, 8], payload(256, 1)))
    bad[-1] ^= 1
    assert poisoner.call("raw_put", key="p", data=base64.b64encode(bytes(bad)).decode())["rc"] == 0
    with BrokerClient(b.socket_path) as cb:
        until(lambda: cb.has(["p"])[0] or cb.stats()["remote_refused_values"])
        assert cb.get("p") is None
        st = cb.stats()
        assert st["remote_refused_values"] == 1 and st["promotion_failures"] >= 1
        assert cb.ping()


@needs_mooncake
def test_two_brokers_master_killed_and_restarted(two_brokers) -> None:
    import torch

    from lmcache_ec_broker import BrokerClient

    mc, a, b = two_brokers
    t = torch.arange(4096, dtype=torch.float32)
    with BrokerClient(a.socket_path) as ca, BrokerClient(b.socket_path) as cb:
        assert ca.put("before", t)
        until(lambda: cb.has(["before"])[0])
        mc.master.kill()
        # Both brokers keep serving their slabs; remote answers are misses.
        assert ca.put("local-only", t) and torch.equal(ca.get("local-only"), t)
        assert cb.get("before") is None  # remote-only: a miss while the store is down
        until(lambda: cb.stats()["remote_up"] == 0)
        mc.master.start()

        def flows() -> bool:
            key = f"after-{time.monotonic_ns()}"
            ca.put(key, t)
            for _ in range(10):
                got = cb.get(key)
                if got is not None:
                    return torch.equal(got, t)
                time.sleep(0.1)
            return False

        until(flows, tries=60, pause=0.2)
        assert cb.stats()["remote_up"] == 1


@needs_mooncake
def test_benchmark_runs_and_prints_its_table() -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "remote_mooncake.py"
    out = subprocess.run(
        [sys.executable, str(script), "--sizes", "1MiB,9MiB", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("|") and "MiB" in ln]
    assert [r.split("|")[1].strip() for r in rows] == ["1 MiB", "9 MiB"], out.stdout
    assert "copies per byte" in out.stdout


# ---------------------------------------------------------------- issue 17: fleet defects


@needs_mooncake
def test_two_brokers_refused_value_is_replaced_by_the_next_write(two_brokers) -> None:
    """A poisoned value under a key is refused by B; B's next write of that key must
    replace it (Mooncake's put never overwrites), so A then hits the fresh value."""
    import torch

    from lmcache_ec_broker import BrokerClient

    mc, a, b = two_brokers
    poisoner = mc.driver()
    bad = bytearray(encode_value("p", "float32", [8, 8], payload(256, 1)))
    bad[-1] ^= 1
    assert poisoner.call("raw_put", key="p", data=base64.b64encode(bytes(bad)).decode())["rc"] == 0
    fresh = _tensor("float32", [8, 8], 7)
    with BrokerClient(b.socket_path) as cb, BrokerClient(a.socket_path) as ca:
        until(lambda: cb.has(["p"])[0] or cb.stats()["remote_refused_values"])
        assert cb.get("p") is None
        assert cb.stats()["remote_refused_values"] >= 1
        assert cb.put("p", fresh)
        until(lambda: cb.stats()["remote_writes"] >= 1)
        # A's first fetch from B's segment opens a transfer path; on a loaded host it can
        # outlast remote_timeout_s (a miss, by design), so A may ask more than once. A
        # poisoned value left in the store would be refused at every try.
        got = None
        for _ in range(20):
            got = ca.get("p")
            if got is not None:
                break
            time.sleep(0.25)
        sa = ca.stats()
        tries = {k: sa[k] for k in ("remote_misses", "remote_lookup_timeouts", "remote_read_errors")}
        assert got is not None and torch.equal(got, fresh), f"not replaced: A's {tries}"
        assert sa["remote_refused_values"] == 0


@needs_mooncake
def test_two_brokers_write_behind_keeps_to_its_byte_budget(two_brokers) -> None:
    """The master stops answering (SIGSTOP): write-behinds pile up. They may pin at most
    a quarter of the slab; the rest are dropped (counted) and every put succeeds --
    without a budget the pinned backlog filled the slab and puts failed (no space)."""
    import signal

    from lmcache_ec_broker import BrokerClient

    mc, a, _ = two_brokers
    with BrokerClient(a.socket_path, timeout_s=60) as ca:
        until(lambda: ca.stats()["remote_up"] == 1)
        assert mc.master.proc is not None
        os.kill(mc.master.proc.pid, signal.SIGSTOP)
        try:
            failed, pinned = [], []
            for i in range(40):  # 80 MiB through a 64 MiB slab
                try:
                    ok = ca.put(f"w{i}", _tensor("uint8", [2 << 20], i))
                except Exception as exc:  # noqa: BLE001 - what the old tier did: no space
                    ok = exc
                if ok is not True:
                    failed.append((i, ok))
                pinned.append(ca.stats().get("remote_pending_bytes", -1))
            assert not failed, f"puts failed while the store was stopped: {failed[:3]}"
            assert max(pinned) <= 16 << 20, max(pinned)
            assert ca.stats()["remote_write_drops"] >= 1
        finally:
            os.kill(mc.master.proc.pid, signal.SIGCONT)
        assert ca.ping()


@needs_mooncake
def test_two_brokers_fleet_claims_dedup_an_encode(two_brokers) -> None:
    """In-flight deduplication through Mooncake Store (issue 41): a's broker claims two
    items in the store (put-if-absent, read back); b's broker answers its client CLAIMED
    and the wait ends with a's bytes once they are written behind; the claims leave the
    store. No key announcements on Mooncake: the wait re-asks the store."""
    import threading

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.protocol import LookupState

    _, a, b = two_brokers
    keys = ["claim-x", "claim-y"]
    tensors = [_tensor("bfloat16", [64, 32], i) for i in range(2)]
    with BrokerClient(a.socket_path) as ca, BrokerClient(b.socket_path) as cb:
        assert [i.state for i in ca.lookup(keys, claim_ms=30_000)] == [LookupState.MISS] * 2
        assert [i.state for i in cb.lookup(keys, claim_ms=30_000)] == [LookupState.CLAIMED] * 2
        got: dict[str, list] = {}
        waiting = threading.Thread(
            target=lambda: got.setdefault("b", cb.wait_ready(keys, 30_000, lease_ms=10_000))
        )
        waiting.start()
        for k, t in zip(keys, tensors, strict=True):
            assert ca.put(k, t)
        ca.flush()
        waiting.join(60)
        assert not waiting.is_alive()
        loadable = (LookupState.READY, LookupState.PENDING)
        assert all(i.state in loadable for i in got["b"]), got
        for k, t in zip(keys, tensors, strict=True):
            out = cb.get(k)
            assert out is not None and _bytes(out) == _bytes(t), k
        sb = cb.stats()
        assert sb["remote_fleet_claims_lost"] >= 2 and sb["remote_writes"] == 0, sb
        assert sb["claims_held"] == 0, sb
        # a's claims leave the store after the write-behind: a third broker's client
        # (here b's, on a new item under a's released claim) is not held
        assert [i.state for i in ca.lookup(["claim-z"], claim_ms=30_000)] == [LookupState.MISS]
        ca.unclaim(["claim-z"])
        until(
            lambda: [i.state for i in cb.lookup(["claim-z"], claim_ms=30_000)] == [LookupState.MISS]
        )
