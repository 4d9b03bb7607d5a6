"""The tier coordinator against real broker processes: leases across tiers, unlease,
failed promotions, the per-connection queue bound, the start lock, the bounded
shutdown flush, and the disk tier without blake3 and with a full quarantine."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import torch
from conftest import shm_segments, slab_of, wait_until
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.broker.lifecycle import probe_socket
from lmcache_ec_broker.broker.tiers.base import EntryMeta, SlabAccess
from lmcache_ec_broker.broker.tiers.disk.file import (
    QUARANTINE_DIR,
    key_to_filename,
    slab_views,
    write_file,
)
from lmcache_ec_broker.broker.tiers.disk.tier import DiskTier
from lmcache_ec_broker.config import BrokerConfig
from lmcache_ec_broker.connector.client import BrokerRefused
from lmcache_ec_broker.protocol import (
    Get,
    GetReply,
    LookupState,
    Ping,
    PongReply,
    Release,
)

MiB = 1 << 20
ENTRY = (64, 1024)  # float32: 256 KiB, four blocks of 64 KiB


# These tests count entries in a tiny slab; a put arena would hold a quarter of it
# (arena puts reach the tiers as commits do: tests/test_disk_tier.py runs with them).
NO_ARENA = ("--put-arena-size", "0")


def start(make_broker, disk: str, *extra: str, shm="1MiB", cap="2MiB", **kw):
    return make_broker(
        "--shm-size", shm, "--local-disk", disk, "--max-local-disk-size", cap, *NO_ARENA,
        *extra, **kw,
    )  # fmt: skip


def put_flushed(c: BrokerClient, key: str, t: torch.Tensor) -> None:
    assert c.put(key, t), key
    wait_until(lambda: c.stats()["disk_pending_writes"] == 0, "the write-behind")


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def disk_only(c: BrokerClient, key: str, t: torch.Tensor, filler: str) -> None:
    """Store ``key`` on disk and push it out of the 1 MiB slab with four other entries."""
    put_flushed(c, key, t)
    for i in range(4):
        put_flushed(c, f"{filler}-{i}", torch.full(ENTRY, -1.0 - i))
    s = c.stats()
    assert s["evictions"] >= 1 and s["disk_entries"] >= 1
    # Lookup without a lease neither promotes nor leases: the key is on disk only.
    assert c.lookup([key])[0].state == LookupState.PENDING
    assert c.stats()["promotions"] == 0


# ---------------------------------------------------------------- issue 10 item 9


def test_leased_disk_hit_survives_slab_and_disk_pressure(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk)
    key = "m@1@0@leased@float32"
    want = torch.randn(ENTRY)
    with BrokerClient(b.socket_path) as c, BrokerClient(b.socket_path) as other:
        disk_only(c, key, want, "warm")
        first = c.lookup([key], lease_ms=600_000)[0]
        assert first.state in (LookupState.PENDING, LookupState.READY)
        assert (first.dtype, first.shape) == ("float32", list(ENTRY))
        # PENDING until the promotion (started by the leased lookup) lands, then READY.
        wait_until(lambda: c.lookup([key])[0].state == LookupState.READY, "the promotion to land")
        assert c.stats()["disk_held"] == 1
        # Another client fills slab and disk several times over.
        for i in range(24):  # each write lands before the next put
            put_flushed(other, f"m@1@0@flood-{i}@float32", torch.full(ENTRY, float(i)))
        s = other.stats()
        assert s["disk_evictions"] > 0 and s["evictions"] > 0
        assert os.path.exists(os.path.join(disk, key_to_filename(key)))  # held: not unlinked
        assert same(c.get(key), want)  # the load succeeds
        s = c.stats()
        assert s["promotions"] == 1 and s["promotion_failures"] == 0
        c.unlease([key])
        wait_until(lambda: c.stats()["tier_leases"] == 0, "the unlease")
        assert c.stats()["disk_held"] == 0


def test_failed_promotion_is_counted_and_answers_miss(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    # One process may keep the whole slab from eviction here (the default: half).
    b = start(make_broker, disk, env={"LMCACHE_EC_MAX_HELD_BYTES_PER_PROCESS": "1MiB"})
    key = "m@1@0@nospace@float32"
    with BrokerClient(b.socket_path) as c:
        disk_only(c, key, torch.randn(ENTRY), "pin")
        # The slab holds four entries: lease them all, so the promotion finds no room.
        fillers = [f"pin-{i}" for i in range(4)]
        assert [i.state for i in c.lookup(fillers, lease_ms=600_000)] == [LookupState.READY] * 4
        first = c.lookup([key], lease_ms=600_000)[0]
        assert first.state == LookupState.PENDING
        wait_until(lambda: c.stats()["promotion_failures"] == 1, "the failed promotion")
        assert c.lookup([key], lease_ms=600_000)[0].state == LookupState.MISS
        assert c.has([key], lease_ms=600_000) == [False]
        s = c.stats()
        assert s["disk_held"] == 0  # the failed lease no longer holds the disk copy
        assert s["promotions"] == 0 and s["promotion_failures"] == 1
        # Once the lease ends the key is offered again (and now fits).
        c.unlease([key, *fillers])
        wait_until(
            lambda: c.lookup([key], lease_ms=600_000)[0].state == LookupState.READY,
            "a promotion after the unlease",
        )


# ---------------------------------------------------------------- issue 10 item 10


def _cycles(c: BrokerClient, n: int, unlease: bool) -> int:
    """put -> leased lookup -> get (load and release) [-> unlease]; puts refused."""
    refused = 0
    for i in range(n):
        key = f"m@1@0@cycle-{i}@float32"
        t = torch.full((32, 1024), float(i))  # 128 KiB: eight fit the 1 MiB slab
        try:
            stored = c.put(key, t)
        except BrokerRefused as exc:
            assert exc.code in ("no_space", "too_many_reservations"), exc
            stored = False
        if not stored:
            refused += 1
            continue
        assert c.lookup([key], lease_ms=600_000)[0].state == LookupState.READY
        assert same(c.get(key), t)
        if unlease:
            c.unlease([key])
    return refused


def test_unlease_ends_leases_so_no_put_is_refused(make_broker):
    b = make_broker("--shm-size", "1MiB", *NO_ARENA)
    with BrokerClient(b.socket_path) as c:
        assert _cycles(c, 40, unlease=True) == 0
        s = c.stats()
        assert s["no_space"] == 0 and s["pins"] == 0


def test_without_unlease_leases_fill_the_slab(make_broker):
    # The control for the test above: the same stream without unlease is refused
    # (no_space, or first the process's share of the slab: max_held_bytes_per_process).
    b = make_broker("--shm-size", "1MiB", *NO_ARENA)
    with BrokerClient(b.socket_path) as c:
        assert _cycles(c, 40, unlease=False) > 0
        s = c.stats()
        assert s["no_space"] + s["reserve_limit_refusals"] > 0


def test_unlease_ends_lower_tier_leases(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, cap="8MiB")
    keys = [f"m@1@0@low-{i}@float32" for i in range(3)]
    with BrokerClient(b.socket_path) as c:
        for i, key in enumerate(keys):
            put_flushed(c, key, torch.full(ENTRY, float(i)))
        for i in range(4):
            put_flushed(c, f"evict-{i}", torch.zeros(ENTRY))
        assert all(i.state == LookupState.PENDING for i in c.lookup(keys))
        c.lookup(keys, lease_ms=600_000)
        wait_until(lambda: c.stats()["promotions_in_flight"] == 0, "the promotions")
        s = c.stats()
        assert s["tier_leases"] == 3 and s["disk_held"] == 3
        c.unlease(keys)
        wait_until(lambda: c.stats()["tier_leases"] == 0, "the unlease")
        assert c.stats()["disk_held"] == 0


# ---------------------------------------------------------------- issue 10 item 13


def test_pipelined_requests_behind_a_promotion_pause_reading(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk)
    key = "m@1@0@slow@float32"
    with BrokerClient(b.socket_path) as c:
        disk_only(c, key, torch.randn(ENTRY), "q")
    raw = RawConn(b.socket_path)
    enc = msgspec.msgpack.Encoder()
    from lmcache_ec_broker.protocol import encode_frame

    n = 3000
    # One write: a get that promotes from disk (async), then n pings queued behind it.
    raw.send_raw(encode_frame(enc, Get([key])) + encode_frame(enc, Ping()) * n)
    got = raw.recv()
    assert isinstance(got, GetReply) and got.items[0] is not None
    for _ in range(n):
        assert isinstance(raw.recv(), PongReply)  # every one answered, in order
    raw.call(Release([got.items[0].pin]))
    raw.sock.close()
    with BrokerClient(b.socket_path) as c:
        assert c.stats()["queue_pauses"] >= 1


# ---------------------------------------------------------------- start lock


def test_a_start_that_finds_the_lock_held_touches_nothing(sock_dir):
    path = os.path.join(sock_dir, "locked.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on: looks like a dead broker's
    stale.close()
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another start is in progress on this path
        out = subprocess.run(
            [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", path],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)
        os.unlink(path + ".lock")
    assert out.returncode == 1, out.stderr
    assert "already running" in out.stderr and "stop it first" in out.stderr
    assert os.path.exists(path)  # the other start's socket was not unlinked
    assert shm_segments(path) == []
    os.unlink(path)


def test_racing_starts_one_wins_and_stays_intact(sock_dir):
    path = os.path.join(sock_dir, "race.sock")
    cmd = [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", path]
    cmd += ["--shm-size", "8MiB"]
    procs = [
        subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for _ in range(4)
    ]
    try:
        wait_until(lambda: probe_socket(path), "a broker answering", timeout=60)
        deadline = time.monotonic() + 60
        while sum(p.poll() is not None for p in procs) < 3:
            assert time.monotonic() < deadline, "the losing starts did not exit"
            time.sleep(0.05)
        losers = [p for p in procs if p.poll() is not None]
        (winner,) = [p for p in procs if p.poll() is None]
        for p in losers:
            assert p.returncode == 1, p.stderr.read()
            assert "already running" in p.stderr.read()
        with BrokerClient(path) as c:  # the winner's socket and slab are intact
            assert c.put("k", torch.ones(8)) and same(c.get("k"), torch.ones(8))
            assert c.stats()["pid"] == winner.pid
        assert slab_of(winner.pid, path) is not None  # the winner's slab, one only
        assert shm_segments(path, include_filter=True) == []
        winner.terminate()
        assert winner.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    assert shm_segments(path, include_filter=True) == []


# ---------------------------------------------------------------- bounded shutdown flush


def test_shutdown_flush_is_bounded_and_configurable(tmp_path, caplog):
    async def run() -> int:
        tier = DiskTier(str(tmp_path), 256 * MiB, max_pending_bytes=256 * MiB)
        mm = mmap.mmap(-1, 32 * MiB)
        tier.open()
        try:
            tier.start(asyncio.get_running_loop(), SlabAccess(mm), _NoEvents())
            meta = EntryMeta(MiB, "uint8", (MiB,))
            started = [tier.write(f"k{i}", meta, [(i * MiB, MiB)]) for i in range(32)]
            assert all(w is not None for w in started)
            await tier.shutdown(0.0)  # shutdown_flush_s = 0: abandon what is queued
            return sum(n.endswith(".safetensors") for n in os.listdir(tmp_path))
        finally:
            tier.close()
            mm.close()

    with caplog.at_level(logging.INFO, logger="lmcache_ec_broker.disk"):
        written = asyncio.run(run())
    assert written < 32
    assert "shutdown_flush_s=0 passed" in caplog.text and "abandoning" in caplog.text
    with pytest.raises(ValueError, match="shutdown_flush_s"):
        BrokerConfig(shutdown_flush_s=-1).validate()
    assert BrokerConfig().shutdown_flush_s == 20.0


def test_shutdown_flush_s_reaches_the_broker(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(
        make_broker, disk, env={"LMCACHE_EC_SHUTDOWN_FLUSH_S": "0"}, shm="64MiB", cap="256MiB"
    )
    with BrokerClient(b.socket_path) as c:
        for i in range(40):
            assert c.put(f"m@1@0@f{i}@uint8", torch.full((2 * MiB,), i, dtype=torch.uint8))
    assert b.stop() == 0
    log = b.read_log()
    assert "flushing the lower tiers for up to 0s (shutdown_flush_s)" in log, log[-2000:]


class _NoEvents:
    def added(self, tier, key):  # noqa: ANN001
        pass

    def removed(self, tier, key):  # noqa: ANN001
        pass


# ---------------------------------------------------------------- blake3 and quarantine


_HIDE_BLAKE3 = """
import sys
sys.modules["blake3"] = None  # as if the optional package were not installed
import asyncio, mmap, os
from lmcache_ec_broker.broker.tiers.disk.file import slab_views, write_file, key_to_filename
from lmcache_ec_broker.broker.tiers.disk.tier import DiskTier
d = sys.argv[1]
dir_fd = os.open(d, os.O_RDONLY)
mm = mmap.mmap(-1, 4096)
mm[0:16] = bytes(range(16))
with slab_views(mm, [(0, 16)]) as views:
    write_file(d, dir_fd, "written-without-blake3", "uint8", [16], views)
tier = DiskTier(d, 1 << 20)
tier.open()
print(sorted(tier.index), tier.counters["disk_quarantined"])
tier.close()
"""


def test_blake3_files_are_not_quarantined_where_blake3_is_missing(tmp_path):
    d = str(tmp_path)
    dir_fd = os.open(d, os.O_RDONLY)
    mm = mmap.mmap(-1, 4096)
    try:
        mm[0:16] = bytes(range(16, 32))
        with slab_views(mm, [(0, 16)]) as views:
            write_file(d, dir_fd, "written-with-blake3", "uint8", [16], views)
    finally:
        os.close(dir_fd)
        mm.close()
    name = key_to_filename("written-with-blake3")
    with open(os.path.join(d, name), "rb") as f:
        assert b'"checksum":"blake3:' in f.read(4096)
    out = subprocess.run(
        [sys.executable, "-c", _HIDE_BLAKE3, d], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    # Without blake3: its own blake2b file is served, the blake3 one left alone.
    assert out.stdout.split() == ["['written-without-blake3']", "0"], out.stdout
    assert "pip install blake3" in out.stderr
    assert os.path.exists(os.path.join(d, name))
    assert not os.path.exists(os.path.join(d, QUARANTINE_DIR))
    # With blake3 both files are served again.
    tier = DiskTier(d, 1 << 20)
    tier.open()
    try:
        assert sorted(tier.index) == ["written-with-blake3", "written-without-blake3"]
    finally:
        tier.close()


def test_quarantine_is_capped_and_counted(tmp_path):
    d = str(tmp_path)
    for i in range(5):  # five corrupt 4 KiB "entries"
        with open(os.path.join(d, key_to_filename(f"bad-{i}")), "wb") as f:
            f.write(b"\xff" * 4096)
        os.utime(os.path.join(d, key_to_filename(f"bad-{i}")), (1000 + i, 1000 + i))
    tier = DiskTier(d, 1 << 20, quarantine_cap=3 * 4096)
    tier.open()
    try:
        s = tier.stats()
        assert s["disk_quarantined"] == 5
        assert s["disk_quarantine_dropped"] == 2
        assert s["disk_quarantine_bytes"] == 3 * 4096
        assert len(os.listdir(os.path.join(d, QUARANTINE_DIR))) == 3
    finally:
        tier.close()
    # The cap also holds across restarts (the quarantine is rescanned at start).
    tier = DiskTier(d, 1 << 20, quarantine_cap=2 * 4096)
    tier.open()
    try:
        assert len(os.listdir(os.path.join(d, QUARANTINE_DIR))) == 2
        assert tier.stats()["disk_quarantine_bytes"] == 2 * 4096
    finally:
        tier.close()
