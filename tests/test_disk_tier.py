"""The disk tier against real broker processes: persistence, promotion, corruption,
hostile keys, capacity; plus the file format against the safetensors reader."""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch
from conftest import shm_segments
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.broker.tiers.disk.file import (
    NAME_MAX,
    QUARANTINE_DIR,
    key_to_filename,
    slab_views,
    write_file,
)

KiB = 1024
MiB = 1 << 20


def start(make_broker, disk: str, *extra: str, shm="8MiB", cap="64MiB", **kw):
    return make_broker(
        "--shm-size", shm, "--local-disk", disk, "--max-local-disk-size", cap, *extra, **kw
    )  # fmt: skip


# The waits below are for conditions, bounded at 30 s: a write-behind or a promotion
# needs CPU (and disk) that a loaded CI host may give late.
def wait_written(c: BrokerClient, n: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = c.stats()
        if s["disk_writes"] >= n and s["disk_pending_writes"] == 0:
            return s
        assert time.monotonic() < deadline, f"disk writes did not finish: {s}"
        time.sleep(0.02)


def put_flushed(c: BrokerClient, key: str, t: torch.Tensor) -> None:
    """Put and wait for its write-behind (a tiny slab allows only one write in flight)."""
    assert c.put(key, t), key
    deadline = time.monotonic() + 30
    while c.stats()["disk_pending_writes"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return (
        a.reshape(-1)
        .contiguous()
        .view(torch.uint8)
        .equal(b.reshape(-1).contiguous().view(torch.uint8))
    )


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(33, 257, generator=g)
    return {
        "m@1@0@aa@bfloat16": base.to(torch.bfloat16),
        "m@1@0@bb@float16": base.to(torch.float16),
        "m@1@0@cc@float32": base,
        "m@1@0@dd@float8_e4m3fn": base.to(torch.float8_e4m3fn),
        "m@1@0@ee@int64": torch.randint(-(2**62), 2**62, (17, 3), generator=g),
        "m@1@0@ff@bool": base > 0,
        "m@1@0@gg@uint8": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g),
        "m@1@0@hh@complex128": torch.randn(5, 7, dtype=torch.complex128, generator=g),
        "m@1@0@ii@float32-0d": torch.tensor(3.25),
        "m@1@0@jj@float32-empty": torch.empty(0, 16),
    }


def entry_files(disk: str) -> list[str]:
    return sorted(n for n in os.listdir(disk) if n.endswith(".safetensors"))


def published_bytes(disk: str) -> int:
    """Bytes of entry files right now (the writer may unlink one while we look)."""
    total = 0
    for name in entry_files(disk):
        try:
            total += os.path.getsize(os.path.join(disk, name))
        except FileNotFoundError:
            pass
    return total


# ---------------------------------------------------------------- file names and format


HOSTILE_KEYS = [
    "../../etc/passwd",
    "/etc/passwd",
    "a/../../b",
    "..",
    ".",
    ".lock",
    "quarantine",
    "nul\0in\0key",
    "\0",
    "k" * 10_240,
    "ü/ß/..\\x",
    "%2e%2e%2f",
    "~" * 300,
]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=range(len(HOSTILE_KEYS)))
def test_hostile_key_names_one_file_inside_the_directory(key):
    name = key_to_filename(key)
    assert "/" not in name and "\0" not in name and not name.startswith(".")
    assert len(name.encode()) <= NAME_MAX - 25  # room for a quarantine suffix too
    assert os.path.basename(name) == name and name.endswith(".safetensors")


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=400), st.text(min_size=1, max_size=400))
def test_file_names_are_safe_and_injective(a, b):
    na, nb = key_to_filename(a), key_to_filename(b)
    for n in (na, nb):
        assert "/" not in n and "\0" not in n and not n.startswith(".")
        assert len(n.encode()) <= NAME_MAX
    assert (na == nb) == (a == b)


def test_files_are_readable_by_safetensors(tmp_path):
    from safetensors import safe_open

    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        for key, t in tensors().items():
            dtype = str(t.dtype).removeprefix("torch.")
            raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            mm = mmap.mmap(-1, max(len(raw), 1) + 64)
            mm[5 : 5 + len(raw)] = raw
            half = len(raw) // 2
            with slab_views(mm, [(5, half), (5 + half, len(raw) - half)]) as views:
                write_file(str(tmp_path), dir_fd, key, dtype, list(t.shape), views)
            with safe_open(str(tmp_path / key_to_filename(key)), framework="pt") as f:
                assert f.metadata()["key"] == key and f.metadata()["dtype"] == dtype
                got = f.get_tensor("encoder_output")
            if t.dtype == torch.complex128:  # no safetensors code: stored as raw bytes
                got = got.view(torch.complex128).reshape(t.shape)
            assert same_bits(got, t), key
            mm.close()
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------- persistence


def test_restart_after_kill9_returns_bit_identical_tensors(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk)
    data = tensors()
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            assert c.put(key, t), key
        wait_written(c, len(data))
    b.kill9()
    b2 = start(make_broker, disk, socket_path=b.socket_path)
    with BrokerClient(b2.socket_path) as c:
        s = c.stats()
        assert s["disk_entries"] == len(data) and s["entries"] == 0
        assert c.has(list(data)) == [True] * len(data)
        got = c.get_many(list(data))
        for (key, t), g in zip(data.items(), got, strict=True):
            assert same_bits(g, t), key
        s = c.stats()
        assert s["promotions"] == len(data) and s["disk_errors"] == 0
        assert s["misses"] == 0 and s["hits"] == len(data)
    assert "indexed" in b2.read_log()


def test_sigterm_flushes_pending_writes(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, shm="32MiB")
    data = {f"m@1@0@{i:04d}@float32": torch.full((256, 256), float(i)) for i in range(24)}
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            assert c.put(key, t)
    assert b.stop() == 0  # right away: writes may still be queued
    assert len(entry_files(disk)) == len(data)
    b2 = start(make_broker, disk, socket_path=b.socket_path)
    with BrokerClient(b2.socket_path) as c:
        assert all(
            same_bits(g, t) for g, t in zip(c.get_many(list(data)), data.values(), strict=True)
        )


def test_memory_eviction_keeps_the_disk_copy(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, shm="1MiB")
    data = {f"m@1@0@{i:04d}@float32": torch.randn(64, 1024) for i in range(12)}  # 256 KiB each
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            put_flushed(c, key, t)
        s = wait_written(c, len(data))
        assert s["evictions"] >= 8 and s["entries"] <= 4
        first = next(iter(data))
        assert c.has([first]) == [True]  # disk-only still counts as a hit
        assert same_bits(c.get(first), data[first])
        s = c.stats()
        assert s["promotions"] == 1 and s["has_hits"] == 1 and s["has_misses"] == 0
        assert s["hits"] == 1 and s["misses"] == 0
        # Everything comes back, one by one, through a slab that holds four.
        for key, t in data.items():
            assert same_bits(c.get(key), t), key
        assert c.stats()["disk_writes"] == len(data)  # promotions are not written again


def test_has_with_lease_prefetches_from_disk(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, shm="1MiB")
    data = {f"m@1@0@{i:04d}@float32": torch.randn(64, 1024) for i in range(8)}
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            put_flushed(c, key, t)
        first = next(iter(data))
        assert c.has([first], lease_ms=5000) == [True]
        deadline = time.monotonic() + 30
        while c.stats()["promotions"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert same_bits(c.get(first), data[first])
        assert c.stats()["promotions"] == 1  # the get found it in memory


# ---------------------------------------------------------------- bad files


def test_corrupt_truncated_and_foreign_files_are_not_served(make_broker, sock_dir):
    from safetensors.torch import save_file

    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk)
    data = {f"m@1@0@{n}@float32": torch.randn(128, 128) for n in ("good", "flip", "cut", "late")}
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            assert c.put(key, t)
        wait_written(c, len(data))
    b.kill9()
    path = {k: os.path.join(disk, key_to_filename(k)) for k in data}
    with open(path["m@1@0@flip@float32"], "r+b") as f:  # one bit in the data
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    os.truncate(path["m@1@0@cut@float32"], os.path.getsize(path["m@1@0@cut@float32"]) - 7)
    save_file({"w": torch.ones(4)}, os.path.join(disk, "someone-elses.safetensors"))
    with open(os.path.join(disk, key_to_filename("m@1@0@renamed@float32")), "wb") as f:
        f.write(open(path["m@1@0@good@float32"], "rb").read())  # right content, wrong name
    with open(os.path.join(disk, "README.txt"), "w") as f:
        f.write("not an entry: left alone")

    b2 = start(make_broker, disk, socket_path=b.socket_path)
    with BrokerClient(b2.socket_path) as c:
        s = c.stats()
        assert s["disk_entries"] == 3 and s["disk_quarantined"] == 3  # cut, foreign, renamed
        assert c.has(["m@1@0@cut@float32", "m@1@0@renamed@float32"]) == [False, False]
        assert c.get("m@1@0@flip@float32") is None  # checksum caught at promotion
        s = c.stats()
        assert s["disk_errors"] == 1 and s["promotions"] == 0
        assert same_bits(c.get("m@1@0@good@float32"), data["m@1@0@good@float32"])
        # Corrupted while the broker runs (entry only on disk): caught the same way.
        with open(path["m@1@0@late@float32"], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x80]))
        assert c.get("m@1@0@late@float32") is None
        assert c.stats()["disk_errors"] == 2
        deadline = time.monotonic() + 30
        while len(os.listdir(os.path.join(disk, QUARANTINE_DIR))) < 4:
            assert time.monotonic() < deadline, os.listdir(os.path.join(disk, QUARANTINE_DIR))
            time.sleep(0.02)
        assert c.has(["m@1@0@flip@float32"]) == [False]  # dropped from the index
    assert os.path.exists(os.path.join(disk, "README.txt"))
    quarantined = os.listdir(os.path.join(disk, QUARANTINE_DIR))
    assert key_to_filename("m@1@0@flip@float32") in quarantined
    assert "someone-elses.safetensors" in quarantined
    assert "checksum mismatch" in b2.read_log() and "truncated" in b2.read_log()


# ---------------------------------------------------------------- hostile keys


def test_hostile_keys_cannot_escape_the_directory(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "d", "disk")
    env = {"LMCACHE_EC_MAX_KEY_LENGTH": "16384"}
    b = start(make_broker, disk, env=env)
    data = {k: torch.full((8,), float(i)) for i, k in enumerate(HOSTILE_KEYS)}
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            assert c.put(key, t), key
        wait_written(c, len(data))
    b.kill9()
    everything = []
    for root, dirs, files in os.walk(sock_dir):
        everything += [os.path.join(root, n) for n in files + dirs]
    outside = {p for p in everything if p != disk and not p.startswith(disk + os.sep)}
    # Only what the test itself made; the stale socket stays until the restart.
    lock = b.socket_path + ".lock"  # a killed broker leaves its lock file, unlocked
    assert outside == {os.path.join(sock_dir, "d"), b.socket_path, lock, b.log_path}
    assert len(entry_files(disk)) == len(data)
    assert all(os.path.dirname(p) == disk for p in everything if p.endswith(".safetensors"))
    b2 = start(make_broker, disk, socket_path=b.socket_path, env=env)
    with BrokerClient(b2.socket_path) as c:
        for (key, t), g in zip(data.items(), c.get_many(list(data)), strict=True):
            assert same_bits(g, t), key[:40]


# ---------------------------------------------------------------- capacity, delete, clear


def test_disk_capacity_is_respected_under_a_stream_of_puts(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    cap = 2 * MiB
    b = start(make_broker, disk, shm="4MiB", cap="2MiB")
    keys = [f"m@1@0@{i:04d}@float32" for i in range(40)]
    with BrokerClient(b.socket_path) as c:
        for i, key in enumerate(keys):  # no waiting: writes queue up behind the puts
            assert c.put(key, torch.full((64, 1024), float(i)))  # 256 KiB + header
            on_disk = published_bytes(disk)
            assert on_disk <= cap, f"after put {i}: {on_disk} bytes on disk"
            assert c.stats()["disk_used_bytes"] <= cap
        s = wait_written(c, 1)
        # Past the write-behind backlog bound (a quarter of the slab) writes are skipped.
        assert s["disk_writes"] + s["disk_writes_skipped"] == len(keys)
        assert s["disk_writes"] >= 7 and s["disk_entries"] == 7
        assert s["disk_evictions"] == s["disk_writes"] - 7
        assert published_bytes(disk) <= cap
        for i, key in enumerate(keys):  # one at a time: every write lands
            put_flushed(c, key + "-again", torch.full((64, 1024), float(i)))
            on_disk = published_bytes(disk)
            assert on_disk <= cap, f"after put {i}: {on_disk} bytes on disk"
        again = [k + "-again" for k in keys]
        assert c.stats()["disk_entries"] == 7
        assert entry_files(disk) == sorted(key_to_filename(k) for k in again[-7:])
        assert c.has(again[:20]) == [False] * 20  # gone from memory and from disk
        assert same_bits(c.get(again[-7]), torch.full((64, 1024), float(len(keys) - 7)))


def test_delete_and_clear_remove_disk_copies(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, shm="1MiB")
    keys = [f"m@1@0@{i:04d}@float32" for i in range(8)]
    with BrokerClient(b.socket_path) as c:
        for key in keys:
            put_flushed(c, key, torch.randn(64, 1024))
        assert c.delete_many([keys[0], keys[-1], "never-stored"]) == [True, True, False]
        assert c.has([keys[0], keys[-1]]) == [False, False]
        assert c.get(keys[0]) is None
        assert c.clear()
        assert c.has(keys) == [False] * len(keys)
        deadline = time.monotonic() + 30
        while entry_files(disk):
            assert time.monotonic() < deadline, entry_files(disk)
            time.sleep(0.02)
        assert c.put(keys[1], torch.ones(4))  # usable after clear
        wait_written(c, len(keys) + 1)
    b.stop()
    assert entry_files(disk) == [key_to_filename(keys[1])]


def test_one_directory_serves_one_broker(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    start(make_broker, disk)
    second = os.path.join(sock_dir, "second.sock")
    with pytest.raises(RuntimeError, match="in use by another broker"):
        start(make_broker, disk, socket_path=second)
    assert not os.path.exists(second) and not shm_segments(second)


def test_start_up_scan_logs_progress_and_rebuilds_lru_order(tmp_path, monkeypatch, caplog):
    import logging

    from lmcache_ec_broker.broker.tiers.disk import tier as disk_mod

    d = str(tmp_path)
    dir_fd = os.open(d, os.O_RDONLY)
    mm = mmap.mmap(-1, 4096)
    try:
        for i in range(5):
            with slab_views(mm, [(0, 16)]) as views:
                write_file(d, dir_fd, f"k{i}", "float32", [4], views)
            os.utime(os.path.join(d, key_to_filename(f"k{i}")), (1000 + i, 1000 + i))
    finally:
        os.close(dir_fd)
        mm.close()
    open(os.path.join(d, ".tmp-123-abc"), "wb").close()  # a write cut short by a crash
    monkeypatch.setattr(disk_mod, "_PROGRESS_EVERY_S", 0.0)
    size = os.path.getsize(os.path.join(d, key_to_filename("k0")))
    tier = disk_mod.DiskTier(d, 4 * size)
    with caplog.at_level(logging.INFO, logger="lmcache_ec_broker.disk"):
        tier.open()
    try:
        text = caplog.text
        assert "scanned 1 files" in text and "scanned 5 files" in text
        assert "removed 1 oldest entries" in text and "unfinished temp files" in text
        assert list(tier.index) == ["k1", "k2", "k3", "k4"]  # oldest mtime first
        assert [m is not None for m in tier.peek(["k0", "k1", "k4"])] == [False, True, True]
        assert not os.path.exists(os.path.join(d, ".tmp-123-abc"))
        assert tier.used_bytes == 4 * size
    finally:
        tier.close()


def test_kill9_during_writes_leaves_only_whole_entries(make_broker, sock_dir):
    disk = os.path.join(sock_dir, "disk")
    b = start(make_broker, disk, shm="64MiB")
    data = {f"m@1@0@{i:04d}@bfloat16": torch.randn(512, 1024).to(torch.bfloat16) for i in range(40)}
    with BrokerClient(b.socket_path) as c:
        for key, t in data.items():
            assert c.put(key, t)
        pending = c.stats()["disk_pending_writes"]
    b.kill9()  # most likely with writes still queued or half-written
    b2 = start(make_broker, disk, shm="64MiB", socket_path=b.socket_path)
    assert not [n for n in os.listdir(disk) if n.startswith(".tmp-")]
    with BrokerClient(b2.socket_path) as c:
        s = c.stats()
        assert s["disk_quarantined"] == 0 and s["disk_entries"] == len(entry_files(disk))
        present = c.has(list(data))
        got = c.get_many([k for k, p in zip(data, present, strict=True) if p])
        for g, key in zip(got, [k for k, p in zip(data, present, strict=True) if p], strict=True):
            assert same_bits(g, data[key]), key
        assert c.stats()["disk_errors"] == 0
    print(f"{pending} writes pending at kill -9; {sum(present)} of {len(data)} entries survived")
