"""The client's data path: device checks, extent checks on every copy path, the
strided and batched writes, and a pre-fault that never writes to the live slab."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from counting_socket import CountingSocket

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.client import BrokerRefused
from lmcache_ec_broker.connector.client.copy import SlabView

HERE = Path(__file__).resolve().parent


def run_py(script: str, *args: str, timeout: float = 300) -> dict:
    """Run ``script`` in a fresh interpreter (a real client process); its last stdout
    line is JSON."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(HERE.parent),
    )
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ other devices


# In a child process: before the fix a meta tensor's null data pointer reached
# memmove and killed the process (SIGSEGV).
META_SCRIPT = """
import json, sys
import torch
from lmcache_ec_broker import BrokerClient

c = BrokerClient(sys.argv[1])
meta = torch.empty(64, 32, device="meta")
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "no error"
    except ValueError as exc:
        out[name] = str(exc)
attempt("put", lambda: c.put("m", meta))
attempt("put_many", lambda: c.put_many([("ok", torch.ones(4)), ("m", meta)]))
assert c.put("cpu", torch.arange(2048.0))
attempt("get", lambda: c.get("cpu", device="meta"))
attempt("get_many", lambda: c.get_many(["cpu"], device="meta"))
attempt("get_into", lambda: c.get_into("cpu", torch.empty(2048, device="meta")))
out["has"] = c.has(["m", "ok", "cpu"])
st = c.stats()
out["held"] = [st["reserved_bytes"], st["pins"]]
out["still_works"] = bool(torch.equal(c.get("cpu"), torch.arange(2048.0)))
print(json.dumps(out))
"""


def test_tensors_on_other_devices_are_refused_naming_the_device(broker) -> None:
    out = run_py(META_SCRIPT, broker.socket_path)
    for call in ("put", "put_many", "get", "get_many", "get_into"):
        assert "device meta" in out[call] and ".cpu()" in out[call], (call, out[call])
    # Refused before anything was reserved: nothing stored, nothing held.
    assert out["has"] == [False, False, True]
    assert out["held"] == [0, 0]
    assert out["still_works"] is True


# ------------------------------------------------------------ extents


@pytest.fixture
def slab() -> SlabView:
    mm = mmap.mmap(-1, 1 << 20)
    view = SlabView(mm, 1 << 20)
    yield view
    view.close()
    mm.close()


def _tail(view: SlabView) -> bytes:
    return bytes(view.u8[-(64 << 10) :].numpy())


def test_strided_write_checks_extents_like_every_path(slab: SlabView) -> None:
    src = torch.arange(2048, dtype=torch.int32).reshape(32, 64).t()  # 8 KiB, non-contiguous
    assert not src.is_contiguous()
    before = _tail(slab)
    # A negative offset would index from the end of the slab: someone else's blocks.
    with pytest.raises(ValueError, match=r"extent \(-16384, 8192\) lies outside"):
        slab.write([(-16384, 8192)], src)
    with pytest.raises(ValueError, match="lies outside"):
        slab.write([((1 << 20) - 4096, 8192)], src)
    with pytest.raises(ValueError, match="extents cover 4096 bytes, the tensor has 8192"):
        slab.write([(0, 4096)], src)
    assert _tail(slab) == before
    assert not slab.u8[:8192].any()


def test_contiguous_copies_and_reads_check_extents(slab: SlabView) -> None:
    t = torch.ones(1024, dtype=torch.float32)
    for bad in ([(-4096, 4096)], [(0, 2048)], [(0, 4096), ((1 << 20) - 10, 20)]):
        with pytest.raises(ValueError):
            slab.write(bad, t)
        with pytest.raises(ValueError):
            slab.read_into(bad, torch.empty(1024))
    slab.write([(4096, 2048), (0, 2048)], t)
    out = torch.zeros(1024)
    slab.read_into([(4096, 2048), (0, 2048)], out)
    assert torch.equal(out, t)


def test_single_extent_strided_write_round_trips(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        base = torch.randn(300, 40, dtype=torch.float32)
        for key, src in (
            ("t", base.t()),  # transposed
            ("s", base[::3, 5:]),  # sliced with a step
            ("e", base.t()[:, :0]),  # empty
            ("b", base.to(torch.bfloat16).t()),
        ):
            assert not src.is_contiguous() or src.numel() == 0
            assert c.put(key, src), key
            got = c.get(key)
            assert got is not None and got.shape == src.shape and got.dtype == src.dtype
            assert torch.equal(got, src), key


# ------------------------------------------------------------ put_many


def test_put_many_stores_batches_and_reports_each_item(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        items = [(f"k{i}", torch.randn(100 + i, 64).to(torch.bfloat16)) for i in range(20)]
        items.append(("nc", torch.randn(64, 128).t()))  # a strided item in the batch
        assert c.put_many(items) == [True] * len(items)
        assert c.put_many(items[:3]) == [False, False, False]  # already present
        for key, t in items:
            got = c.get(key)
            assert got is not None and torch.equal(got, t), key
        assert c.put_many([]) == []
        # A refused item: the others are stored, then the refusal is raised.
        st = c.stats()
        too_big = torch.empty(int(st["capacity_bytes"]) + 1, dtype=torch.uint8)
        with pytest.raises(BrokerRefused) as exc:
            c.put_many([("a", torch.ones(10)), ("big", too_big), ("b", torch.zeros(10))])
        assert exc.value.code == "too_large"
        assert c.has(["a", "big", "b"]) == [True, False, True]


# ------------------------------------------------------------ pre-fault


# The writer owns one reservation and rewrites it over and over with a new byte
# value, checking after each pass that every byte holds what it wrote: nobody
# else may write to blocks it owns. Then it commits a final pattern.
WRITER = """
import json, os, sys
import numpy as np
import torch
from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import Commit, Reserve, ReserveStatus

sock, stop, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = BrokerClient(sock, timeout_s=30)
r = c.request(Reserve("w", nbytes, "uint8", [nbytes]))
assert r.status == ReserveStatus.RESERVED, r
slab = c.slab()
regions = [slab.u8[start : start + n].numpy() for start, n in r.extents]
print(json.dumps({"ready": True}), flush=True)
passes = mismatched = 0
while not os.path.exists(stop):
    v = passes % 251 + 1
    for reg in regions:
        reg.fill(v)
    mismatched += sum(int(np.count_nonzero(reg != v)) for reg in regions)
    passes += 1
final = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(7))
slab.write(r.extents, final)
c.request(Commit(r.token))
print(json.dumps({"passes": passes, "mismatched": mismatched}), flush=True)
"""

# The client's attach, over and over, with the madvise pre-fault unavailable (as
# on kernels before 5.14), so the page-touching fallback runs over the live slab.
ATTACHER = """
import json, os, sys
import lmcache_ec_broker.shm.segment as segment
segment._POPULATE_ADVICE = ()
from lmcache_ec_broker import BrokerClient

sock, rounds = sys.argv[1], int(sys.argv[2])
with BrokerClient(sock, timeout_s=30) as c:
    hs = c.handshake
    name, size, pid = hs.segment_name, hs.segment_size, hs.broker_pid
# The slab is a memfd: reach the broker's own descriptor (this uid may), as a client's
# handed-over one would be mapped.
label = "/memfd:" + name.lstrip("/") + " (deleted)"
fds = []
for f in os.listdir(f"/proc/{pid}/fd"):
    try:  # a connection's descriptor may close meanwhile
        if os.readlink(f"/proc/{pid}/fd/{f}") == label:
            fds.append(f)
    except FileNotFoundError:
        pass
for _ in range(rounds):
    fd = os.open(f"/proc/{pid}/fd/{fds[0]}", os.O_RDWR)
    try:
        segment.Segment.attach_fd(fd, name, size, True).close()
    finally:
        os.close(fd)
print(json.dumps({"attached": rounds}))
"""


def test_client_prefault_fallback_never_corrupts_concurrent_writes(make_broker, sock_dir) -> None:
    # One 6 MiB entry in an 8 MiB slab: past a process's default share (half the
    # slab, max_held_bytes_per_process), which this test is not about.
    env = {"LMCACHE_EC_MAX_HELD_BYTES_PER_PROCESS": "8MiB"}
    b = make_broker("--shm-size", "8MiB", env=env)
    stop = os.path.join(sock_dir, "stop")
    nbytes = 6 << 20  # most pages an attacher touches are being written
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), b.socket_path, stop, str(nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(HERE.parent),
    )
    try:
        assert writer.stdout is not None
        assert json.loads(writer.stdout.readline())["ready"], writer.stderr
        attachers = [
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(ATTACHER), b.socket_path, "2000"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=str(HERE.parent),
            )
            for _ in range(2)
        ]
        for a in attachers:
            out, err = a.communicate(timeout=600)
            assert a.returncode == 0, err
    finally:
        Path(stop).touch()
        out, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["passes"] > 0
    assert res["mismatched"] == 0, f"bytes the writer owns were overwritten: {res}"
    want = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    with BrokerClient(b.socket_path) as c:  # the committed entry, bit for bit
        got = c.get("w")
        assert got is not None and torch.equal(got, want)


def test_client_prefault_fallback_only_reads(tmp_path) -> None:
    """The fallback itself, deterministically: on a read-only mapping any write raises."""
    import lmcache_ec_broker.shm.segment as segment

    path = tmp_path / "seg"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 1 << 20, prot=mmap.PROT_READ)
    saved = segment._POPULATE_ADVICE
    segment._POPULATE_ADVICE = ()
    try:
        segment._populate_shared(mm, 1 << 20)
    finally:
        segment._POPULATE_ADVICE = saved
        mm.close()
    assert path.read_bytes() == data


# ------------------------------------------------------------ waits per call (issue 18)


@pytest.mark.parametrize("arena", ["8MiB", "0"])
def test_put_waits_one_round_trip_and_is_read_by_the_next_request(make_broker, arena) -> None:
    # Fails on the old client: put waited for the Commit's reply too (2 waits); with a
    # put arena (8MiB) put_many waited for its reservations (1 wait, now 0).
    broker = make_broker("--shm-size", "64MiB", "--put-arena-size", arena)
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as other:
        c.slab()  # map the slab first so the put below measures only its waits
        wrapped: list[CountingSocket] = []
        c.instrument_socket(lambda s: wrapped.append(CountingSocket(s)) or wrapped[-1])
        counting = wrapped[0]
        t = torch.arange(4096, dtype=torch.float32)
        assert c.put("posted", t)
        assert counting.waits == 1
        # The posted commit orders before this client's next request (no filter race:
        # the key is never ruled out locally while its commit is in flight).
        got = c.get("posted")
        assert got is not None and torch.equal(got, t)
        assert other.has(["posted"]) == [True]
        # put_many: one wait for all reservations, none for the commits; none at all
        # with an arena (the first put asked for it, its reserve read the grant).
        before = counting.waits
        assert c.put_many([(f"pm{i}", t + i) for i in range(8)]) == [True] * 8
        assert counting.waits - before == (0 if arena != "0" else 1)
        before = counting.waits
        assert c.put("one-more", t)
        assert counting.waits - before == (0 if arena != "0" else 1)
        assert c.flush()  # another connection looks next: wait for the posted commits
        assert all(torch.equal(other.get(f"pm{i}"), t + i) for i in range(8))
        assert c.stats()["reserved_entries"] == 0


def test_a_client_that_exits_right_after_put_leaves_its_entry(broker) -> None:
    # The posted commit is in the broker's socket before put returns, so a process that
    # exits (os._exit, no close) at once still leaves a loadable entry.
    assert run_py(
        """
        import json, os, sys, torch
        from lmcache_ec_broker import BrokerClient
        c = BrokerClient(sys.argv[1])
        ok = c.put("exit-after-put", torch.full((1024,), 7.0))
        print(json.dumps({"ok": ok}), flush=True)
        os._exit(0)
        """,
        broker.socket_path,
    ) == {"ok": True}
    with BrokerClient(broker.socket_path) as c:
        # The dead client's frames and its EOF reach the broker on another connection
        # than ours: wait until its reservation is gone (committed, or freed if lost).
        deadline = time.monotonic() + 30  # a condition, not a window: room for a loaded host
        while c.stats()["reserved_entries"] and time.monotonic() < deadline:
            time.sleep(0.01)
        got = c.get("exit-after-put")
        assert got is not None and torch.equal(got, torch.full((1024,), 7.0))


def test_flush_makes_posted_puts_visible_to_other_processes(broker) -> None:
    # Fails on the old client (no flush). After flush the broker has every posted commit,
    # so another connection (and its membership filter) sees the entries.
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as other:
        assert c.flush()  # nothing owed: no wait
        for i in range(20):
            t = torch.full((256,), float(i))
            assert c.put(f"fl{i}", t)
            assert c.flush()
            got = other.get(f"fl{i}")
            assert got is not None and torch.equal(got, t), i
    c.close()
    assert not c.flush()  # closed: nothing to wait for, and no broker


def test_a_put_that_returned_is_seen_by_every_other_client_at_once(broker) -> None:
    # Read-after-put across connections with the posted commit: the reader's filter says
    # "maybe" from the reservation on, and the broker handles the writer's pending commit
    # before answering. Fails with the commit posted but not settled (misses here).
    with BrokerClient(broker.socket_path) as w, BrokerClient(broker.socket_path) as r:
        for i in range(300):
            t = torch.full((64,), float(i))
            assert w.put(f"rap{i}", t)
            op = i % 3
            if op == 0:
                got = r.get(f"rap{i}")
                assert got is not None and torch.equal(got, t), i
            elif op == 1:
                assert r.has([f"rap{i}"]) == [True], i
            else:
                assert [e.state for e in r.lookup([f"rap{i}"])] == [1], i  # READY
        assert w.put_many([(f"rapm{i}", torch.ones(8)) for i in range(16)]) == [True] * 16
        assert r.has([f"rapm{i}" for i in range(16)]) == [True] * 16
        # A second writer of a key whose commit is in flight is told it is present.
        assert w.put("rap-dup", torch.ones(4))
        assert r.put("rap-dup", torch.ones(4)) is False
        assert r.stats()["put_present"] >= 1
