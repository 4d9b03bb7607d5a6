"""Shared memory between processes that do not trust each other (issue 29, items 2,
4 and 6; docs/design.md "Shared memory"): what one client writes never makes
another read foreign bytes, a client stopped mid-placement bounds only itself, and
the segments reach admitted clients only (over the socket, as descriptors).

Real brokers (the CLI), real client processes; the misbehaving parties are real
processes too: one that rewinds every journal word it can write, one stopped with
SIGSTOP inside the journal window, one of another uid.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import memfd_segments, shm_segments, slab_of, wait_until

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.shm import residency as R

HERE = Path(__file__).resolve().parent
BS = 64 * 1024

# Snapshots every journal segment of the broker it can open for writing ("snap"),
# and writes the snapshot back ("restore"): a same-uid client rewinding the words
# other clients read (the journal's settled words, before issue 29). By name in
# /dev/shm (before issue 40) or through the broker's descriptors (a memfd since).
REWINDER = textwrap.dedent(
    """
    import mmap, os, sys
    prefix, pid = sys.argv[1], sys.argv[2]
    segs = {}
    for line in sys.stdin:
        if line.strip() == "snap":
            paths = ["/dev/shm/" + n for n in os.listdir("/dev/shm")]
            for fdn in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fdn}").removesuffix(" (deleted)")
                except OSError:
                    continue
                if link.startswith("/memfd:"):
                    paths.append(f"/proc/{pid}/fd/{fdn}")
            for p in paths:
                n = os.path.basename(os.path.realpath(p)).removesuffix(" (deleted)")
                if prefix in n and n.endswith("-j") and n not in segs:
                    try:
                        fd = os.open(p, os.O_RDWR)
                    except OSError:
                        continue
                    size = os.fstat(fd).st_size
                    mm = mmap.mmap(fd, size)
                    os.close(fd)
                    segs[n] = (mm, bytes(mm))
            print("snapped", sorted(segs), flush=True)
        elif line.strip() == "restore":
            for mm, data in segs.values():
                mm[:] = data
            print("restored", flush=True)
    """
)


@pytest.mark.skipif(not R.usable_here(), reason="the index path is used on x86-64 only")
def test_a_client_rewinding_the_journal_never_makes_another_read_foreign_bytes(
    make_broker,
) -> None:
    # Fails on the old code: the victim trusted the journal's settled word, which any
    # same-uid process can rewrite; rewound, its get(K) copied K's old blocks, which
    # another client's entry had reused (foreign bytes).
    from lmcache_ec_broker.broker.server import segment_prefix

    b = make_broker("--shm-size", "4MiB", "--put-arena-size", "256KiB")
    rewinder = subprocess.Popen(
        [sys.executable, "-c", REWINDER, segment_prefix(b.socket_path), str(b.pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert rewinder.stdin is not None and rewinder.stdout is not None

    def tell(cmd: str) -> str:
        rewinder.stdin.write(cmd + "\n")
        rewinder.stdin.flush()
        return rewinder.stdout.readline()

    try:
        with BrokerClient(b.socket_path, filter_trust_s=60) as v, BrokerClient(
            b.socket_path
        ) as other:
            assert v.put("warm", torch.ones(16)) and v.flush()  # v holds an arena now
            assert tell("snap").startswith("snapped ['"), "found no journal to rewind"
            mine = torch.full((BS,), 7, dtype=torch.uint8)
            assert v.put("K", mine) and v.flush()  # placed in v's arena, handled
            assert v.stats()["arena_places"] >= 1
            assert other.delete("K")
            theirs = torch.full((BS,), 9, dtype=torch.uint8)
            for i in range(80):  # through the whole slab: K's blocks are reused
                other.put(f"L{i}", theirs)
            assert other.flush()
            assert tell("restore").startswith("restored")
            got = v.get("K")
            assert got is None or torch.equal(got, mine), "read another entry's bytes"
            out = torch.empty_like(mine)
            if v.get_into("K", out):
                assert torch.equal(out, mine), "get_into copied another entry's bytes"
    finally:
        rewinder.stdin.close()
        rewinder.wait(30)


STALLER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.shm import journal
    c = BrokerClient(sys.argv[1])
    assert c.put("warm", torch.ones(16)) and c.flush()
    mark = journal.Journal.mark_placed

    def mark_then_stop(self, slot, seq):
        mark(self, slot, seq)
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped inside the journal window

    journal.Journal.mark_placed = mark_then_stop
    print("placing", flush=True)
    ok = c.put("stalled", torch.full((1024,), 5.0))
    print("returned", ok, flush=True)
    sys.stdin.readline()
    c.close()
    """
)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_client_stopped_inside_the_journal_window_costs_others_a_short_bound(
    broker,
) -> None:
    # Fails on the old code: while the stopped client's slot showed a placement, every
    # other process asked the broker for every miss (0 local misses) for as long as it
    # stayed stopped. Now its window is excused after a short bound, and its put, once
    # it resumes and returns, is still seen by everyone (read-after-put).
    staller = subprocess.Popen(
        [sys.executable, "-c", STALLER, broker.socket_path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(HERE.parent),
    )  # fmt: skip
    assert staller.stdin is not None and staller.stdout is not None
    try:
        assert staller.stdout.readline().strip() == "placing"
        wait_until(lambda: _stopped(staller.pid) or None, "the client stopped mid-placement")
        with BrokerClient(broker.socket_path) as a:
            misses = [f"absent-{i}" for i in range(300)]
            t0 = time.monotonic()

            def local() -> bool:
                before = a.local_misses
                a.has(misses)
                return a.local_misses > before

            # 15 s: 300 times the product's bound (journal.STALL_BOUND_S, 50 ms), room for
            # a loaded host (was 5 s); a window never excused (the client stays stopped
            # until SIGCONT below) fails it all the same
            wait_until(lambda: local() or None, "local misses came back", timeout=15)
            took = time.monotonic() - t0
            assert a.has(misses) == [False] * 300 and a.local_misses >= 600 - 10
            print(f"local misses back after {took * 1e3:.0f} ms")
            # Its arena puts are back too: copied and posted, nothing waited for.
            assert a.put("a-first", torch.ones(8)) and a.flush()
            before = a.stats()["arena_places"]
            assert a.put("a-placed", torch.ones(8)) and a.flush()
            assert a.stats()["arena_places"] == before + 1
            os.kill(staller.pid, signal.SIGCONT)
            line = staller.stdout.readline().split()
            assert line == ["returned", "True"], line
            # Returned: every process sees it now, the excused window notwithstanding.
            assert a.has(["stalled"]) == [True]
            got = a.get("stalled")
            assert got is not None and torch.equal(got, torch.full((1024,), 5.0))
    finally:
        if staller.poll() is None:
            os.kill(staller.pid, signal.SIGCONT)
            staller.stdin.close()
            staller.wait(30)


NOBODY = pwd.getpwnam("nobody")

OPENER = textwrap.dedent(
    """
    import json, os, sys
    paths = sys.argv[3:]
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
    opened = []
    for p in paths:
        for flags in (os.O_RDONLY, os.O_RDWR):
            try:
                os.close(os.open(p, flags))
                opened.append([p, flags])
            except OSError:
                pass
    print(json.dumps(opened))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_allowed_uids_gate_the_segments_not_only_the_socket(make_broker) -> None:
    # Fails on the old code: allowed_uids needs a 0666 socket, and every segment was
    # created with the socket's mode, so a uid the broker refuses opened them all.
    b = make_broker("--shm-size", "64MiB", "--socket-mode", "0666", "--allowed-uids", "0")
    with BrokerClient(b.socket_path) as c:
        assert c.put("k", torch.ones(8)) and c.flush()
    # Every segment is a memfd: the only paths that reach one are the broker's own
    # descriptors under /proc (its uid's, or root's).
    paths = list(memfd_segments(b.pid).values())
    assert paths and shm_segments(b.socket_path, include_filter=True) == []
    out = subprocess.run(
        [sys.executable, "-c", OPENER, str(NOBODY.pw_uid), str(NOBODY.pw_gid), *paths],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [], "a refused uid opened the broker's shared memory"


# A process of the broker's own uid that is not a client at all: it looks for the
# membership filter (-f) and the residency index (-r) by name in /dev/shm and through
# the broker's open descriptors (/proc/<pid>/fd/N reopened O_RDWR), maps what it can
# writable, and forges them: key A's index slot takes B's extents (same-length keys,
# same shape: every bound the reader checks still holds), C's slot is cleared and
# every filter counter zeroed (C then looks absent). It prints, as JSON, what it
# could open and map writable, and the errno of every refusal.
FORGER = textwrap.dedent(
    """
    import errno, json, mmap, os, struct, sys
    prefix, pid = sys.argv[1], sys.argv[2]
    out = {"by_name": [], "proc": {}, "forged": []}
    maps = {}  # "-f"/"-r" -> writable mapping
    for n in sorted(os.listdir("/dev/shm")):
        if n.startswith(prefix) and n.endswith(("-f", "-r")):
            fd = os.open("/dev/shm/" + n, os.O_RDWR)
            maps[n[-2:]] = mmap.mmap(fd, os.fstat(fd).st_size)
            os.close(fd)
            out["by_name"].append(n)
    fd_dir = f"/proc/{pid}/fd"
    for fdn in sorted(os.listdir(fd_dir), key=int):
        try:
            link = os.readlink(f"{fd_dir}/{fdn}").removesuffix(" (deleted)")
        except OSError:
            continue
        if prefix not in link or not link.endswith(("-f", "-r")):
            continue
        try:
            fd = os.open(f"{fd_dir}/{fdn}", os.O_RDWR)
        except OSError as exc:
            out["proc"][link] = "open " + errno.errorcode[exc.errno]
            continue
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)  # MAP_SHARED, PROT_READ|PROT_WRITE
        except OSError as exc:
            out["proc"][link] = "mmap " + errno.errorcode[exc.errno]
            continue
        finally:
            os.close(fd)
        out["proc"][link] = "mapped"
        maps.setdefault(link[-2:], mm)
    index = maps.get("-r")
    if index is not None:
        slot_of = {}
        for at in range(64, len(index), 256):
            n = struct.unpack_from("<H", index, at + 24)[0]
            if n:
                slot_of[bytes(index[at + 144 : at + 144 + n])] = at
        a, b, c = slot_of[b"A1"], slot_of[b"B1"], slot_of[b"C1"]
        index[a + 8 : a + 144] = index[b + 8 : b + 144]  # A's key, B's bytes; seq even
        index[c + 24 : c + 26] = bytes(2)  # C unindexed
        out["forged"].append("index")
    filt = maps.get("-f")
    if filt is not None:
        filt[64:] = bytes(len(filt) - 64)
        out["forged"].append("filter")
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.skipif(not R.usable_here(), reason="the index path is used on x86-64 only")
def test_a_same_uid_process_cannot_forge_the_index_or_the_filter(make_broker) -> None:
    # Fails on the old code: the filter and the index were named 0600 segments, so a
    # process of the broker's uid opened them by name (or through /proc/<broker>/fd)
    # for writing; with A's slot forged an honest client's get("A1") returned B1's
    # bytes, and with the filter zeroed its has("C1") answered a present key absent.
    # Now they are sealed memfds: no name, and no mapping but the broker's writes them.
    from lmcache_ec_broker.broker.server import segment_prefix

    b = make_broker("--shm-size", "4MiB")
    assert b.proc is not None
    a_bytes = torch.full((BS,), 7, dtype=torch.uint8)
    b_bytes = torch.full((BS,), 9, dtype=torch.uint8)
    with BrokerClient(b.socket_path) as writer:
        for key, value in (("A1", a_bytes), ("B1", b_bytes), ("C1", a_bytes)):
            assert writer.put(key, value)
        assert writer.flush()
    out = subprocess.run(
        [sys.executable, "-c", FORGER, segment_prefix(b.socket_path), str(b.proc.pid)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    with BrokerClient(b.socket_path, filter_trust_s=60) as victim:
        assert victim.has(["C1"]) == [True], f"a forged filter hid a present key: {got}"
        a = victim.get("A1")
        assert a is not None and torch.equal(a, a_bytes), f"read another entry's bytes: {got}"
        out_t = torch.empty_like(a_bytes)
        assert victim.get_into("A1", out_t) and torch.equal(out_t, a_bytes)
        assert victim.index_hits >= 1  # the index was read (not only the broker asked)
    assert got["forged"] == [] and got["by_name"] == [], got
    # No name to open: the broker holds them as memfds, and a writable mapping of its
    # descriptors is refused by the seal (EPERM), not by a mode a root could bypass.
    assert sorted(link[-2:] for link in got["proc"]) == ["-f", "-r"], got
    assert all(link.startswith("/memfd:") for link in got["proc"]), got
    assert set(got["proc"].values()) == {"mmap EPERM"}, got


def test_no_descriptor_of_the_slab_can_resize_it(make_broker) -> None:
    # An admitted client gets the slab read-write. When it was a named /dev/shm file
    # (which cannot be sealed), one ftruncate on that descriptor made every other
    # process's next access past the new end -- other clients' copies, the broker's --
    # die of SIGBUS. It is a memfd sealed against resizing now: any descriptor of it,
    # the one a client is handed or a reopen of the broker's own through /proc (what a
    # process of the broker's uid can do), is refused with EPERM; writes still work.
    import fcntl

    b = make_broker("--shm-size", "64MiB")
    t = torch.arange(1 << 16, dtype=torch.float32)
    with BrokerClient(b.socket_path) as w, BrokerClient(b.socket_path) as r:
        assert w.put("before", t) and w.flush()
        slab = memfd_segments(b.pid)[slab_of(b.pid, b.socket_path)]
        fd = os.open(slab, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for new in (0, size // 2, size + (1 << 20)):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, new)
            with pytest.raises(PermissionError):
                os.posix_fallocate(fd, size, 1 << 20)
            with pytest.raises(PermissionError):  # nor seal it against others' writes
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x0008)  # F_SEAL_WRITE
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
        assert w.put("after", t + 1) and w.flush()  # clients still write it
        assert torch.equal(r.get("before"), t) and torch.equal(r.get("after"), t + 1)
