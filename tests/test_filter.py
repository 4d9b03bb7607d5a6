"""The shared-memory membership filter: unit properties and a real broker with real clients."""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys
import time
import uuid

import pytest
import torch
import xxhash
from conftest import shm_segments
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.config import BrokerConfig
from lmcache_ec_broker.shm.filter import (
    HEADER_SIZE,
    SATURATED,
    VERSION,
    FilterReader,
    FilterWriter,
    slots_for,
)
from lmcache_ec_broker.shm.segment import ShmError


@pytest.fixture
def writer():
    w = FilterWriter(f"/lmcache-ec-test-{uuid.uuid4().hex[:12]}-f", 16)
    yield w
    w.close()


def test_add_remove_and_reader_view(writer: FilterWriter) -> None:
    reader = FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())
    try:
        assert not reader.maybe("a")
        writer.add("a")
        assert reader.maybe("a") and writer.maybe("a")
        writer.add("a")  # counted twice (e.g. memory and disk tier)
        writer.remove("a")
        assert reader.maybe("a")
        writer.remove("a")
        assert not reader.maybe("a")
    finally:
        reader.close()


def test_reader_maps_read_only(writer: FilterWriter) -> None:
    reader = FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())
    try:
        with pytest.raises(TypeError):
            reader.mm[100] = 1  # a client cannot corrupt what every other client reads
    finally:
        reader.close()


def test_closed_filter_says_maybe_for_everything(writer: FilterWriter) -> None:
    reader = FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())
    try:
        assert not reader.maybe("never-added")
        writer.mm[20:24] = b"\0\0\0\0"  # what close() does before unlinking
        assert not reader.live
        assert reader.maybe("never-added")
    finally:
        reader.close()


def test_saturated_slots_stay_maybe(writer: FilterWriter) -> None:
    for _ in range(SATURATED + 10):
        writer.add("hot")
    for _ in range(SATURATED + 10):
        writer.remove("hot")
    assert writer.maybe("hot")  # the true count is unknown once saturated: never decrement
    assert writer.saturated >= 1


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.text(max_size=40), min_size=0, max_size=80, unique=True),
    st.lists(st.text(max_size=40), min_size=0, max_size=80),
)
def test_maybe_many_answers_like_maybe(present: list[str], probe: list[str]) -> None:
    w = FilterWriter(f"/lmcache-ec-test-{uuid.uuid4().hex[:12]}-f", 16)
    reader = FilterReader(w.name, w.size, fd=w.segment.share_fd())
    try:
        for k in present:
            w.add(k)
        keys = probe + present
        got = reader.maybe_many(keys)
        assert got == [reader.maybe(k) for k in keys]
        assert all(got[len(probe) :])  # every present key is a "maybe"
        w.mm[20:24] = b"\0\0\0\0"  # dead filter: maybe for everything
        assert reader.maybe_many(keys) == [True] * len(keys)
    finally:
        reader.close()
        w.close()


def test_sizing() -> None:
    assert slots_for(1) == 16
    assert 1 << slots_for(32768) >= 16 * 32768


def test_reader_rejects_a_segment_that_is_not_a_filter() -> None:
    import posix_ipc

    from lmcache_ec_broker.shm.segment import ShmError, unlink_segment

    name = f"/lmcache-ec-test-{uuid.uuid4().hex[:12]}"
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=1 << 17).close_fd()
    try:
        with pytest.raises(ShmError, match="not a membership filter"):
            FilterReader(name, 1 << 17)
    finally:
        unlink_segment(name)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=300))
def test_never_absent_while_present(ops: list[tuple[bool, int]]) -> None:
    """The invariant: any key with a positive count reads as "maybe", whatever else
    was added or removed (collisions included: 2**16 slots, 41 keys)."""
    w = FilterWriter(f"/lmcache-ec-test-{uuid.uuid4().hex[:12]}-f", 16)
    try:
        counts: dict[str, int] = {}
        for add, i in ops:
            key = f"model@1@0@{i}@bfloat16"
            if add:
                w.add(key)
                counts[key] = counts.get(key, 0) + 1
            elif counts.get(key):
                w.remove(key)
                counts[key] -= 1
            for k, n in counts.items():
                if n:
                    assert w.maybe(k), k
    finally:
        w.close()


def _reference_slots(key: str, seed: int, log2_slots: int) -> tuple[int, int]:
    """The hash as filter.py's docstring specifies it, written out independently: xxh3-64
    of the surrogatepass UTF-8 bytes seeded with the header's u64 seed; the slots are the
    canonical digest's two little-endian u32 words, masked."""
    d = xxhash.xxh3_64_digest(key.encode("utf-8", "surrogatepass"), seed)
    mask = (1 << log2_slots) - 1
    a, b = struct.unpack("<II", d)
    return HEADER_SIZE + (a & mask), HEADER_SIZE + (b & mask)


_ASCII = "az09@/-_."  # as in model@...@mm_hash keys
_VALID = _ASCII + "\u00e9\u00df\u20ac\u4e2d\U0001f600"  # 1- to 4-byte UTF-8
_SURROGATES = _VALID + "\ud800\udfff"  # lone surrogates: not UTF-8, encoded surrogatepass


def _random_key(rng: random.Random, length: int) -> str:
    chars = (_ASCII, _VALID, _SURROGATES)[length % 3]  # every shape at every length range
    return "".join(rng.choice(chars) for _ in range(length))


def test_broker_and_client_agree_on_every_key_shape(writer: FilterWriter) -> None:
    """Every key length up to the broker's max_key_length, non-ASCII and surrogate
    keys included: the writer (broker) sets exactly the specified slots and the reader
    (client) -- per key and batched, surrogate batch or not -- reads the same ones."""
    max_len = BrokerConfig().max_key_length
    rng = random.Random(18)
    present = [_random_key(rng, n) for n in range(max_len + 1)]
    absent = [_random_key(rng, n) for n in range(max_len + 1)]
    (_magic, version, log2_slots, nhashes, _flags, seed) = struct.unpack_from(
        "<8sIIIIQ", writer.mm, 0
    )
    assert (version, nhashes) == (VERSION, 2)
    for k in present:
        writer.add(k)
    count: dict[int, int] = {}
    for k in present:
        for s in _reference_slots(k, seed, log2_slots):
            count[s] = count.get(s, 0) + 1
    # The writer touched exactly the specified slots, as often as specified.
    assert {s: writer.mm[s] for s in count} == count
    assert sum(writer.mm[HEADER_SIZE:]) == 2 * len(present)
    reader = FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())
    try:
        expect = [
            all(writer.mm[s] for s in _reference_slots(k, seed, log2_slots))
            for k in present + absent
        ]
        assert expect[: len(present)] == [True] * len(present)
        keys = present + absent
        assert [reader.maybe(k) for k in keys] == expect
        assert reader.maybe_many(keys) == expect
        valid = [k for k in keys if not any("\ud800" <= c <= "\udfff" for c in k)]
        assert len(valid) > 600 and not all(k.isascii() for k in valid)
        # The batched path without the surrogate fallback, non-ASCII keys included.
        assert reader.maybe_many(valid) == [reader.maybe(k) for k in valid]
        for n in (1, 7, 15, 16, 17, 64):  # both sides of the per-key/numpy switch
            assert reader.maybe_many(keys[-n:]) == expect[-n:]
    finally:
        reader.close()


@pytest.mark.parametrize("other", [1, VERSION + 1])
def test_reader_refuses_a_filter_of_another_version(writer: FilterWriter, other: int) -> None:
    """Version 1 hashed with blake2b: reading its counters with this hash would report
    present keys absent, so a mismatched reader must refuse, naming the fix."""
    writer.mm[8:12] = struct.pack("<I", other)
    with pytest.raises(ShmError, match=f"version {other}, this client reads version {VERSION}"):
        FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())


def test_close_with_batched_reads_done(writer: FilterWriter) -> None:
    reader = FilterReader(writer.name, writer.size, fd=writer.segment.share_fd())
    assert reader.maybe_many([f"k{i}" for i in range(64)]) == [False] * 64
    reader.close()  # the numpy view of the counters must not keep the mapping exported
    assert reader.mm.closed


# ------------------------------------------------------------------ real broker

_PUT = """
import sys, torch
from lmcache_ec_broker import BrokerClient
c = BrokerClient(sys.argv[1])
for key in sys.argv[2:]:
    assert c.put(key, torch.arange(1024, dtype=torch.float32)), key
c.close()
"""


def _put_in_other_process(sock: str, *keys: str) -> None:
    subprocess.run([sys.executable, "-c", _PUT, sock, *keys], check=True, timeout=60)


def test_broker_publishes_filter_and_client_answers_misses_locally(broker) -> None:
    # A sealed memfd handed over the socket: no name in /dev/shm to open (or forge).
    segs = shm_segments(broker.socket_path, include_filter=True)
    assert not any(s.endswith("-f") for s in segs), segs
    _put_in_other_process(broker.socket_path, "present-1", "present-2")
    with BrokerClient(broker.socket_path) as c:
        assert c.mappings.filter is not None
        before = c.stats()
        misses = [f"absent-{i}" for i in range(200)]
        assert c.has(misses) == [False] * 200
        assert c.has(["present-1", "absent-x", "present-2"]) == [True, False, True]
        assert c.get("absent-y") is None
        after = c.stats()
        # The broker saw (almost) none of the misses: a false "maybe" is rare, not zero.
        assert after["has_misses"] - before["has_misses"] <= 5
        assert c.local_misses >= 195
        # A deleted key: the filter may still say maybe; the broker must answer False.
        assert c.delete("present-1")
        assert c.has(["present-1", "present-2"]) == [False, True]


def test_local_miss_is_fast(broker) -> None:
    """A miss the filter answers costs no round trip: counted on both sides (the
    broker heard none of the 2000), not timed -- a per-call bound of 50 us measured
    this process's share of a loaded host as much as the client's path."""
    with BrokerClient(broker.socket_path) as c:
        c.ping()
        before = c.stats()
        t0 = time.perf_counter()
        for i in range(2000):
            c.has([f"k{i}"])
        per_call = (time.perf_counter() - t0) / 2000
        after = c.stats()
        assert c.local_misses == 2000
        asked = (after["has_misses"] + after["has_hits"]) - (before["has_misses"] + before["has_hits"])
        assert asked == 0, f"the broker was asked {asked} times ({per_call * 1e6:.1f} us a call)"


def test_filter_is_trusted_only_while_the_broker_is_confirmed(make_broker, sock_dir) -> None:
    """A killed broker cannot mark its filter dead; after a restart the client must not
    keep answering misses from the stale filter for longer than filter_trust_s."""
    sock = os.path.join(sock_dir, "restart.sock")
    b1 = make_broker("--shm-size", "64MiB", socket_path=sock)
    c = BrokerClient(sock, filter_trust_s=0.2)
    try:
        assert c.has(["k"]) == [False]
        b1.kill9()
        b2 = make_broker("--shm-size", "64MiB", socket_path=sock)
        _put_in_other_process(sock, "k")
        deadline = time.monotonic() + 30  # a stale filter trusted for ever never gets there
        while time.monotonic() < deadline and c.has(["k"]) != [True]:
            time.sleep(0.05)
        assert c.has(["k"]) == [True]
        assert shm_segments(sock, include_filter=True) == []  # memfds: nothing named, none left
        b2.stop()
    finally:
        c.close()


def test_clean_stop_marks_filter_dead(make_broker, sock_dir) -> None:
    sock = os.path.join(sock_dir, "stop.sock")
    b = make_broker("--shm-size", "64MiB", socket_path=sock)
    c = BrokerClient(sock, filter_trust_s=60)
    try:
        assert c.has(["k"]) == [False]
        flt = c.mappings.filter
        assert flt is not None and flt.live
        b.stop()
        assert not flt.live  # every read is now "maybe", so the client reaches the broker
        assert c.has(["k"]) == [False]  # broker away: a miss, no error
    finally:
        c.close()


def test_cross_process_put_then_has(broker) -> None:
    """Keys committed by another process are never reported absent afterwards."""
    keys = [f"x-{i}" for i in range(50)]
    with BrokerClient(broker.socket_path) as c:
        assert c.has(keys) == [False] * 50
        _put_in_other_process(broker.socket_path, *keys)
        assert c.has(keys) == [True] * 50
        out = c.get_many(keys[:3] + ["nope"])
        assert [t is not None for t in out] == [True, True, True, False]
        assert json.dumps(c.stats()["entries"]) == "50"
        torch.testing.assert_close(out[0], torch.arange(1024, dtype=torch.float32))


# Makes the broker started with this directory on PYTHONPATH publish version 1 (what
# a broker of the blake2b release publishes): the filter is the broker's sealed memfd,
# which nothing outside the broker can rewrite.
_OLD_RELEASE = """
import lmcache_ec_broker.shm.filter as f
f.VERSION = 1
"""


def test_client_refuses_a_filter_of_another_version_and_asks_the_broker(
    make_broker, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that finds another version's filter logs why and answers every lookup
    through the broker: no filter, never a wrong answer."""
    (tmp_path / "sitecustomize.py").write_text(_OLD_RELEASE)
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    broker = make_broker("--shm-size", "64MiB", env={"PYTHONPATH": pythonpath})
    _put_in_other_process(broker.socket_path, "present-1")
    with caplog.at_level(logging.WARNING), BrokerClient(broker.socket_path) as c:
        assert c.mappings.filter is None
        assert "version 1, this client reads version" in caplog.text
        before = c.stats()["has_misses"]
        assert c.has(["present-1", "absent-1"]) == [True, False]
        assert c.stats()["has_misses"] == before + 1  # the miss was the broker's answer
        assert c.local_misses == 0
