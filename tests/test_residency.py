"""The residency index (shm/residency.py, connector/client/index_path.py): has() hits and
gets answered with no round trip, exact under churn, counted and LRU-touched by the
broker, withdrawn before blocks are reused, and cleaned up like the other segments.

Real brokers through the CLI, real client processes; the index-level corruption
test scribbles on a real shared-memory index (the broker's writer) in-process.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import BrokerProcess, shm_segments, wait_until
from counting_socket import CountingSocket

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.shm import residency as R

HERE = Path(__file__).resolve().parent
KIB = 1024
BS = 64 * KIB

pytestmark = pytest.mark.skipif(not R.usable_here(), reason="the index is read on x86-64 only")


def _count(c: BrokerClient) -> CountingSocket:
    wrapped: list[CountingSocket] = []
    c.instrument_socket(lambda sock: wrapped.append(CountingSocket(sock)) or wrapped[-1])
    return wrapped[0]


def test_a_has_hit_and_a_get_make_no_round_trip_and_are_counted(broker) -> None:
    # Fails on the old client: has() and get() each waited one round trip.
    t = torch.arange(4096, dtype=torch.float32)
    with BrokerClient(broker.socket_path) as w, BrokerClient(broker.socket_path) as c:
        assert w.put("k", t) and w.flush()
        before = c.stats()
        c.slab()
        counting = _count(c)
        assert c.has(["k"]) == [True]
        got = c.get("k")
        out = torch.empty_like(t)
        assert c.get_into("k", out)
        many = c.get_many(["k", "k"])
        assert counting.waits == 0, "an index hit waited for the broker"
        assert counting.sends <= 1  # at most a reply-less Served frame (batched), nothing else
        assert got is not None and torch.equal(got, t) and torch.equal(out, t)
        assert all(m is not None and torch.equal(m, t) for m in many)
        assert c.index_hits == 5 and c.index_retries == 0
        # Another client's has() with a lease still asks (a lease needs the broker).
        assert c.has(["k"], lease_ms=1000) == [True]
        assert counting.waits == 1
        after = c.stats()
    assert after["has_hits"] - before["has_hits"] == 2  # the index's and the leased one
    assert after["hits"] - before["hits"] == 4
    assert after["bytes_loaded"] - before["bytes_loaded"] == 4 * t.nbytes
    assert after["residency_entries"] == 1


def test_a_get_of_the_clients_own_unhandled_placement_waits_for_nothing(broker) -> None:
    # put then get of the same key from one client: the Place is posted, so the broker
    # may not have indexed it yet; the client copies from its own arena blocks while the
    # journal shows the Place unhandled. Fails on the previous client (one wait: the
    # key was asked, the broker settling the placement first).
    t = torch.arange(16384, dtype=torch.float32)
    with BrokerClient(broker.socket_path, timeout_s=2, filter_trust_s=30) as c:
        assert c.put("warm", t) and c.flush()  # the connection now holds an arena
        c.slab()
        counting = _count(c)
        for i in range(5):
            os.kill(broker.pid, signal.SIGSTOP)  # the Place stays unhandled meanwhile
            try:
                assert c.put(f"own{i}", t + i)
                got = c.get(f"own{i}")
                out = torch.empty_like(t)
                assert c.get_into(f"own{i}", out)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            assert got is not None and torch.equal(got, t + i) and torch.equal(out, t + i)
        assert counting.waits == 0
        # Handled during the copy (here: the client reads the broker's replies inside
        # it): the own copy is discarded and the index, or the broker, answers.
        assert c.put("raced", t - 1)
        slab = c.slab()
        real = slab.read
        raced: list[bool] = []

        def racing(*a, **kw):
            if not raced:
                raced.append(c.flush())
            return real(*a, **kw)

        slab.read = racing
        got = c.get("raced")
        assert raced == [True] and got is not None and torch.equal(got, t - 1)
        st = c.stats()
    assert st["hits"] >= 11 and st["puts"] >= 7


def test_index_hits_reach_the_broker_by_flush_and_close(broker) -> None:
    # Served frames are batched ahead of the client's next request; an idle client's
    # counts go with flush() or close(). Fails on the old client (no index_hits).
    t = torch.arange(256, dtype=torch.float32)
    with BrokerClient(broker.socket_path) as w:
        assert w.put("k", t) and w.flush()
        before = w.stats()
        c = BrokerClient(broker.socket_path)
        assert c.has(["k"]) == [True] and c.get("k") is not None
        assert c.flush()
        mid = w.stats()
        assert c.has(["k"]) == [True] and c.index_hits == 3
        c.close()
        after = wait_until(
            lambda: (s := w.stats())["has_hits"] - before["has_hits"] == 2 and s or None,
            "the closing client's counts",
        )
    assert (mid["has_hits"] - before["has_hits"], mid["hits"] - before["hits"]) == (1, 1)
    assert after["bytes_loaded"] - before["bytes_loaded"] == t.nbytes


def test_many_served_keys_are_told_in_frames_the_broker_accepts(make_broker) -> None:
    # 300 index hits in one get_many against the smallest frame limit: the Served
    # report is split, never a frame the broker would refuse (seen failing: one
    # 30 KiB Served frame raised BrokerRefused from get_many).
    b = make_broker("--shm-size", "64MiB", "--max-frame-size", "4KiB")
    keys = [f"{i:03d}-" + "k" * 100 for i in range(300)]
    with BrokerClient(b.socket_path) as w, BrokerClient(b.socket_path) as c:
        for i in range(0, 300, 20):
            assert w.put_many([(k, torch.full((64,), j % 251, dtype=torch.uint8))
                               for j, k in enumerate(keys[i : i + 20], start=i)]) == [True] * 20  # fmt: skip
        assert w.flush()
        before = w.stats()
        got = c.get_many(keys)
        assert all(g is not None and int(g[0]) == j % 251 for j, g in enumerate(got))
        assert c.index_hits == 300 and c.flush()
        after = w.stats()
    assert after["hits"] - before["hits"] == 300
    assert after["bytes_loaded"] - before["bytes_loaded"] == 300 * 64


def test_an_entry_read_only_through_the_index_survives_eviction(make_broker) -> None:
    # The broker touches the LRU for every Served key: a hot entry read locally must not
    # be evicted as if unread. Fails on the old client at the waits assertion.
    b = make_broker("--shm-size", "4MiB", "--put-arena-size", "0")
    item = torch.zeros(4 * BS, dtype=torch.uint8)  # 4 blocks: 16 fit in the slab
    with BrokerClient(b.socket_path) as c:
        assert c.put("hot", item + 7) and c.flush()
        c.slab()
        counting = _count(c)
        for i in range(60):  # ~4x the slab: every cold entry is evicted in turn
            got = c.get("hot")
            assert got is not None and int(got[0]) == 7
            before = counting.waits
            assert c.put(f"cold-{i}", item + (i % 200))
            assert counting.waits - before <= 1  # the put's reserve, nothing for the get
        assert counting.waits <= 60
        st = c.stats()
        assert st["evictions"] >= 40
        assert c.has(["hot"]) == [True]
        assert c.index_hits >= 60


def test_a_slot_rewritten_during_the_copy_falls_back_to_the_pinned_get(broker) -> None:
    # Fails on the old client (no index_retries; the get waited a round trip anyway).
    t = torch.arange(8192, dtype=torch.float32)
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as other:
        assert other.put("k", t) and other.flush()
        slab = c.slab()
        # The race is injected into the Python copy (SlabView.read_into), so get_into takes
        # that path here: the compiled one copies inside one C call, where nothing can be
        # injected; tests/test_residency_copy.py races it with a real concurrent writer.
        c.mappings.index._view = None
        real_read, real_read_into = slab.read, slab.read_into
        script: list = []

        def racing_read(*a, **kw):
            if script:
                script.pop(0)()  # another process changes the entry under the copy
            return real_read(*a, **kw)

        def racing_read_into(*a, **kw):
            if script:
                script.pop(0)()
            return real_read_into(*a, **kw)

        slab.read, slab.read_into = racing_read, racing_read_into
        # Deleted and stored again (maybe in other blocks): the copy is discarded and the
        # broker's pinned get returns the entry.
        script.append(lambda: (other.delete("k"), other.put("k", t), other.flush()))
        counting = _count(c)
        got = c.get("k")
        assert got is not None and torch.equal(got, t)
        assert c.index_retries == 1 and counting.waits == 1
        # Deleted for good: get_into answers False and leaves no bytes in ``out``.
        script.append(lambda: other.delete("k"))
        out = torch.full_like(t, -1.0)
        assert c.get_into("k", out) is False
        assert c.index_retries == 2 and not out.any()


def test_delete_clear_and_eviction_withdraw_keys_before_their_blocks_are_reused(
    make_broker,
) -> None:
    b = make_broker("--shm-size", "2MiB", "--put-arena-size", "0")
    with BrokerClient(b.socket_path) as c:
        def put(key: str, fill: int) -> None:
            assert c.put(key, torch.full((2 * BS,), fill, dtype=torch.uint8))
            c.flush()

        put("a", 1)
        index = c.mappings.index
        assert index is not None and index.find("a") is not None
        assert c.delete("a")
        assert index.find("a") is None  # withdrawn before the Delete reply was sent
        put("b", 2)
        put("c", 3)
        c.clear()
        assert index.find("b") is None and index.find("c") is None
        # Eviction: 16 two-block entries through a 32-block slab, twice over.
        for i in range(32):
            put(f"e{i}", i + 10)
            for j in range(i + 1):
                found = index.find(f"e{j}")
                if found is None:
                    continue  # evicted (or not indexed): the broker is asked
                (off, n) = found.extents[0]
                data = bytes(c.slab().u8[off : off + 16].numpy())
                assert index.unchanged(found)
                assert data == bytes([j + 10]) * 16, f"e{j} points at another entry's bytes"
        assert c.stats()["evictions"] > 0
        assert sum(index.find(f"e{j}") is not None for j in range(32)) < 32


CHURN_WRITER = """
import random, select, sys, torch
from lmcache_ec_broker import BrokerClient
BS = 64 * 1024
def value(i):
    n = (i % 3 + 1) * BS - 8 * (i % 5)
    return (torch.arange(n, dtype=torch.int64) * 31 + i * 1000003).to(torch.uint8)
c = BrokerClient(sys.argv[1])
rng = random.Random(1)
n = 0
while not select.select([sys.stdin], [], [], 0)[0]:  # until the reader closes stdin
    i = rng.randrange(64)
    if rng.random() < 0.2:
        c.delete(f"k{i}")
    else:
        c.put(f"k{i}", value(i))
    n += 1
    if n % 50 == 0:
        print(n, flush=True)
c.close()
print(n, flush=True)
"""
# What the churn test waits for (counts, not a time window: on a loaded host the
# same counts take longer, never fewer): reads through the index, under writes.
CHURN_INDEX_HITS = 100
CHURN_WRITES = 100  # 64 keys of 64-192 KiB through a 2 MiB slab: evictions from the ~16th


def test_index_positives_are_exact_under_churn(make_broker) -> None:
    # A writer process puts, deletes and (through a 2 MiB slab) evicts the same keys
    # while this process reads them through the index: every get that returns a tensor
    # returns exactly the bytes that key was put with -- no torn or foreign read.
    # Fails on the old client (nothing was read through the index: no index_hits).
    # The writer runs until the reader has its counts (before: both ran 6 s, and at
    # load 8-14 the reader managed 25 index reads where it needed 50).
    import threading

    b = make_broker("--shm-size", "2MiB")
    exec(textwrap.dedent(CHURN_WRITER).split("c = BrokerClient")[0], ns := {})
    value = ns["value"]
    expected = {f"k{i}": value(i) for i in range(64)}
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHURN_WRITER), b.socket_path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=str(HERE.parent),
    )  # fmt: skip
    assert writer.stdin is not None and writer.stdout is not None
    writes = [0]

    def follow(out=writer.stdout) -> None:
        for line in out:
            writes[0] = int(line)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    wrong: list[str] = []
    reads = 0
    # A hang guard only: the loop ends on its counts.
    deadline = time.monotonic() + 600
    try:
        with BrokerClient(b.socket_path) as c:
            i = 0
            while c.index_hits < CHURN_INDEX_HITS or writes[0] < CHURN_WRITES:
                assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
                assert time.monotonic() < deadline, (c.index_hits, reads, writes[0])
                keys = [f"k{(i + j) % 64}" for j in range(4)]
                i += 3
                for key, got in zip(keys, c.get_many(keys), strict=True):
                    if got is not None:
                        reads += 1
                        if not torch.equal(got, expected[key]):
                            wrong.append(key)
                out = torch.empty_like(expected[keys[0]])
                if c.get_into(keys[0], out):
                    reads += 1
                    if not torch.equal(out, expected[keys[0]]):
                        wrong.append(keys[0])
            hits, retries = c.index_hits, c.index_retries
    finally:
        writer.stdin.close()
        writer.wait(120)
        follower.join(30)
    werr = writer.stderr.read() if writer.stderr else ""
    assert writer.returncode == 0, werr
    assert wrong == [], f"{len(wrong)} of {reads} reads returned other bytes"
    assert hits >= CHURN_INDEX_HITS and writes[0] >= CHURN_WRITES, (hits, reads, writes[0])
    print(f"churn: {reads} reads, {hits} from the index, {retries} retried, {writes[0]} writes")


def test_the_index_segment_goes_with_the_broker_and_a_restart_is_never_confused(
    sock_dir,
) -> None:
    path = os.path.join(sock_dir, "r.sock")
    b = BrokerProcess(path, ["--shm-size", "64MiB"]).start()
    t = torch.arange(1024, dtype=torch.float32)
    c = BrokerClient(path, filter_trust_s=30, max_backoff_s=0.05)
    try:
        assert c.put("k", t) and c.flush()
        old_index = c.handshake.residency_name
        # A sealed memfd, never a name in /dev/shm: it lives while someone maps it.
        memfd = f"/memfd:{old_index.lstrip('/')} (deleted)"
        assert old_index.lstrip("/") not in shm_segments(path, include_filter=True)
        assert memfd in Path("/proc/self/maps").read_text()
        assert c.has(["k"]) == [True] and c.index_hits == 1
        b.kill9()  # no cleanup: the index still says LIVE, mapped by this client
        assert memfd in Path("/proc/self/maps").read_text()
        # Well within filter_trust_s: the socket's hang-up alone ends the index's trust
        # (and with it the dead slab's mapping), as an outage answers misses.
        assert c.has(["k"]) == [False] and c.get("k") is None
        assert c.mappings is None  # the index and the dead slab unmapped
        assert memfd not in Path("/proc/self/maps").read_text()  # gone with the mapping
        b = BrokerProcess(path, ["--shm-size", "64MiB"]).start()
        names = shm_segments(path, include_filter=True)
        assert not [n for n in names if n.endswith(("-f", "-r"))], names  # no names
        wait_until(lambda: c.ping() or None, "the client reconnected")
        assert c.handshake.residency_name != old_index
        assert c.has(["k"]) == [False] and c.get("k") is None  # the new broker is empty
        assert c.put("k", t) and c.flush() and c.has(["k"]) == [True]
        c.close()
        assert b.stop() == 0
        assert shm_segments(path, include_filter=True) == []  # nothing named left
    finally:
        c.close()
        if b.proc is not None and b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(10)


def test_a_corrupt_index_is_never_followed_outside_the_slab(tmp_path) -> None:
    slab = 1 << 20
    name = f"/ecb-test-{os.getpid()}-r"
    w = R.ResidencyWriter(name, R.MIN_LOG2_SLOTS, slab)
    try:
        assert w.publish("k", 16, "float32", [4], [(4096, 16)])
        r = R.ResidencyReader(name, w.size, slab, fd=w.segment.share_fd())
        found = r.find("k")
        assert found is not None and found.extents == [(4096, 16)] and found.shape == [4]
        at = found.at
        fixed = R._FIXED.unpack_from(w.mm, at + R._FIXED_AT)

        def scribble(**change: int) -> R.Found | None:
            f = list(fixed)
            names = ["gen", "nbytes", "keylen", "dtype", "ndim", "next"]
            for k, v in change.items():
                if k in names:
                    f[names.index(k)] = v
                else:  # off0 / len0: the first extent
                    f[6 + R.MAX_DIMS + (0 if k == "off0" else 1)] = v
            R._FIXED.pack_into(w.mm, at + R._FIXED_AT, *f)
            try:
                return r.find("k")
            finally:
                R._FIXED.pack_into(w.mm, at + R._FIXED_AT, *fixed)

        assert scribble(off0=slab - 8) is None  # would read past the slab
        assert scribble(off0=(1 << 64) - 16) is None
        assert scribble(dtype=250) is None  # no such dtype
        assert scribble(nbytes=32) is None  # shape says 16 bytes
        assert scribble(len0=8) is None  # extents do not cover nbytes
        assert scribble(next=9) is None
        assert scribble(ndim=7) is None
        struct.pack_into("@Q", w.mm, at, found.seq + 1)  # being rewritten
        assert r.find("k") is None
        struct.pack_into("@Q", w.mm, at, found.seq)
        assert r.find("k") is not None
        w.withdraw("k")
        assert r.find("k") is None and not r.unchanged(found)
        # Keys longer than a slot holds are not indexed (the broker is asked).
        assert not w.publish("x" * (R.KEY_CAP + 1), 16, "float32", [4], [(0, 16)])
        r.close()
    finally:
        w.close()
    with pytest.raises(Exception, match="cannot open residency index"):
        R.ResidencyReader(name, 4096, slab)


def test_the_writer_never_reads_back_its_seq_words() -> None:
    # Issue 29 item 3, kept at the writer's level now that nothing outside the broker
    # can write its index (a sealed memfd): were its seq words read back, a scribbled
    # word would stop every later publish (seq + 2 -> struct.error) or publish a slot
    # odd (never readable). Scribbled here through the writer's own mapping.
    slab = 1 << 20
    w = R.ResidencyWriter(f"/ecb-test-{os.getpid()}-seq-r", R.MIN_LOG2_SLOTS, slab)
    r = R.ResidencyReader(w.name, w.size, slab, fd=w.segment.share_fd())
    try:
        assert w.publish("k", 16, "float32", [4], [(0, 16)])
        at = r.find("k").at
        for value in (b"\xff" * 8, b"\xfe" + b"\xff" * 7):
            for slot in range(w.nslots):
                at_slot = R.HEADER_SIZE + slot * R.SLOT_BYTES
                w.mm[at_slot : at_slot + 8] = value
            assert w.publish("k", 16, "float32", [4], [(4096, 16)])  # no struct.error
            found = r.find("k")
            assert found is not None and found.at == at and found.extents == [(4096, 16)]
            w.withdraw("k")
            assert r.find("k") is None
            assert w.publish("k", 16, "float32", [4], [(0, 16)])
    finally:
        r.close()
        w.close()
