"""Neighbours cannot read or rewrite the broker's files and segments, nor keep it from
starting (issue 40, items 1-3; docs/reliability.md "Access control").

Run as root: the attacker is a real process of another uid (``nobody``), refused by
the broker's ``allowed_uids``, or a child that an admitted client starts under it.
Real brokers (the CLI), real client processes.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import run_cli, wait_until

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.broker.lifecycle import segment_prefix
from lmcache_ec_broker.shm.segment import Segment, unlink_segment

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

NOBODY = pwd.getpwnam("nobody")
KEY = "m@1@0@trust-files@uint8"


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# Where a script says ``#DROP`` (after its imports: nobody may not read this host's
# Python library), it becomes uid nobody, with no groups, for the rest of its run.
DROP = f"os.setgroups([]); os.setgid({NOBODY.pw_gid}); os.setuid({NOBODY.pw_uid})"


def _as_nobody(script: str, *args: str, **kw) -> subprocess.Popen[str]:
    """``script`` in a process of uid nobody: a neighbour the broker refuses."""
    return subprocess.Popen(
        [sys.executable, "-c", script.replace("#DROP", DROP), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
    )  # fmt: skip


def _run_as_nobody(script: str, *args: str) -> dict:
    p = _as_nobody(script, *args)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- item 1: disk files

# Reads every entry file it can reach and rewrites each it can open for writing with
# its own bytes (0x55) under a checksum it recomputes: a checksum is no defence
# against a writer.
DISK_ATTACKER = textwrap.dedent(
    """
    import json, os, sys
    from lmcache_ec_broker.broker.tiers.disk import file as F
    #DROP
    d = sys.argv[1]
    out = {"listed": None, "read": [], "rewrote": []}
    try:
        names = sorted(os.listdir(d))
        out["listed"] = names
    except OSError as exc:
        names = []
    for n in names:
        p = os.path.join(d, n)
        try:
            with open(p, "rb") as f:
                f.read()
            out["read"].append(n)
        except OSError:
            pass
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError:
            continue
        meta = F.read_meta(fd)
        data = b"\\x55" * meta.nbytes
        h = F._hasher()
        h.update(data)
        header = F.build_header(meta.key, meta.dtype, meta.shape, F._checksum(h))
        os.pwrite(fd, header + data, 0)
        os.close(fd)
        out["rewrote"].append(n)
    print(json.dumps(out))
    """
)


def _start_disk_broker(make_broker, disk: str, socket_path: str | None = None):
    # allowed_uids needs a socket others can open; the umask lets every mode through.
    old = os.umask(0)
    try:
        return make_broker(
            "--shm-size", "8MiB", "--local-disk", disk, "--max-local-disk-size", "64MiB",
            "--socket-mode", "0666", "--allowed-uids", "0", socket_path=socket_path,
        )  # fmt: skip
    finally:
        os.umask(old)


def test_a_refused_uid_can_neither_read_nor_rewrite_disk_entries(make_broker, sock_dir) -> None:
    # Fails on the old code: entry files took socket_mode (0666 here, umask 000) and the
    # existing directory (0755) was used as it was: the refused uid read the entry and
    # rewrote it with a valid checksum, and after a restart an admitted client's get
    # returned its bytes (promoted from disk). Now the directory is set to 0700 (the
    # log says so) and files are 0600: it reaches nothing.
    os.chmod(sock_dir, 0o755)  # the neighbour can reach the socket and the disk directory
    disk = os.path.join(sock_dir, "disk")
    os.mkdir(disk, 0o755)  # an existing directory others may enter (not write)
    b = _start_disk_broker(make_broker, disk)
    honest = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    with BrokerClient(b.socket_path) as c:
        assert c.put(KEY, honest) and c.flush()
        wait_until(
            lambda: (s := c.stats())["disk_writes"] >= 1 and not s["disk_pending_writes"],
            "the entry written to disk",
        )
    attack = _run_as_nobody(DISK_ATTACKER, disk)
    assert b.stop() == 0
    b2 = _start_disk_broker(make_broker, disk, socket_path=b.socket_path)
    with BrokerClient(b2.socket_path) as c:
        got = c.get(KEY)
        assert got is not None and torch.equal(got, honest), f"served their bytes: {attack}"
        assert c.stats()["promotions"] == 1  # it came from the disk file
    assert attack == {"listed": None, "read": [], "rewrote": []}, attack
    assert _mode(disk) == 0o700
    assert "had mode 0755: other users could read its entries; set it to 0700" in b.read_log()
    entries = [n for n in os.listdir(disk) if n.endswith(".safetensors")]
    assert entries and all(_mode(os.path.join(disk, n)) == 0o600 for n in entries)


def test_a_disk_directory_another_uid_can_write_or_owns_is_refused_with_the_fix(
    sock_dir,
) -> None:
    # Fails on the old code: both started and served from the directory (files there,
    # planted by the other uid, would be served after a checksum the planter computed).
    sock = os.path.join(sock_dir, "d.sock")
    writable = os.path.join(sock_dir, "open")
    os.mkdir(writable)
    os.chmod(writable, 0o777)
    theirs = os.path.join(sock_dir, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, NOBODY.pw_uid, NOBODY.pw_gid)
    for disk, needle in (
        (writable, f"has mode 0777: other users can write entries there that the broker "
                   f"would serve. Run chmod 700 {writable}"),
        (theirs, f"belongs to uid {NOBODY.pw_uid}, not to the broker's uid 0"),
    ):  # fmt: skip
        out = run_cli(
            "start", "--socket", sock, "--shm-size", "8MiB", "--local-disk", disk,
            "--max-local-disk-size", "64MiB",
        )  # fmt: skip
        assert out.returncode != 0 and needle in out.stderr, out.stderr
        assert "--local-disk" in out.stderr and not os.path.exists(sock)
        assert os.listdir(disk) == []  # nothing written into it


# ---------------------------------------------------------------- item 2: inherited fds

# An admitted client (root) that asked has() only, then starts a program under uid
# nobody the way os.system or a fork+exec without close_fds does: every inheritable
# descriptor goes along. The program maps whatever segment it was given writable and
# fills it with 0x55. Then the client gets the entry (mapping the slab) and starts it
# again. Prints what the programs found and the client's own descriptors.
PARENT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from lmcache_ec_broker import BrokerClient
    sock, child, key = sys.argv[1], sys.argv[2], sys.argv[3]

    def inheritable_segment_fds():
        out = []
        for n in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{n}")
            except OSError:
                continue
            if link.startswith(("/dev/shm/", "/memfd:")) and os.get_inheritable(int(n)):
                out.append(link)
        return sorted(out)

    c = BrokerClient(sock)
    res = {"has": c.has([key])}
    res["held_after_has"] = inheritable_segment_fds()
    run = lambda: json.loads(subprocess.run(
        [sys.executable, "-c", child], close_fds=False, capture_output=True, text=True,
        check=True,
    ).stdout)
    res["child_after_has"] = run()
    got = c.get(key)
    res["got"] = None if got is None else got.tolist()
    res["held_after_get"] = inheritable_segment_fds()
    res["child_after_get"] = run()
    c.close()
    print(json.dumps(res))
    """
)

CHILD = textwrap.dedent(
    """
    import json, mmap, os
    #DROP
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if not link.startswith(("/dev/shm/", "/memfd:")):
            continue
        try:
            mm = mmap.mmap(int(n), os.fstat(int(n)).st_size)
            mm[:] = b"\\x55" * len(mm)
            out.append([link, "rewrote"])
        except (OSError, ValueError) as exc:
            out.append([link, type(exc).__name__])
    print(json.dumps(out))
    """
)


def test_a_child_started_under_another_uid_inherits_no_segment(make_broker) -> None:
    # Fails on the old code: the slab's descriptor arrived inheritable and stayed open
    # in a client that only asked has(); a child it started as nobody mapped it
    # read-write and rewrote the slab, and the client's get returned 0x55 bytes. Now
    # every descriptor arrives close-on-exec and is closed once mapped.
    b = make_broker("--shm-size", "4MiB")
    honest = torch.full((4096,), 7, dtype=torch.uint8)
    with BrokerClient(b.socket_path) as w:
        assert w.put(KEY, honest) and w.flush()
    out = subprocess.run(
        [sys.executable, "-c", PARENT, b.socket_path, CHILD.replace("#DROP", DROP), KEY],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["has"] == [True]
    assert res["got"] == honest.tolist(), f"read the child's bytes: {res}"
    assert res["child_after_has"] == [] and res["child_after_get"] == [], res
    # Whatever segment descriptor a client holds is close-on-exec. (It holds one per
    # mapping: CPython's mmap keeps a close-on-exec dup of the mapped file before 3.13.)
    assert res["held_after_has"] == [] and res["held_after_get"] == [], res


# ---------------------------------------------------------------- item 3: names first

# Watches /dev/shm for a named slab (older brokers had one) and creates the names
# derived from it (<slab>-j, -f, -r) the moment it appears; before that it plants, under the broker's
# prefix, a FIFO (an open for reading blocks) and a file of its own (the stale-segment
# cleanup must neither wait on nor unlink them). Stops on stdin's end.
NAME_TAKER = textwrap.dedent(
    """
    import os, select, sys
    #DROP
    prefix = sys.argv[1]
    os.mkfifo(f"/dev/shm/{prefix}fifo", 0o644)
    os.close(os.open(f"/dev/shm/{prefix}planted", os.O_CREAT | os.O_WRONLY, 0o644))
    print("planted", flush=True)
    taken = set()
    while not select.select([sys.stdin], [], [], 0.0005)[0]:
        for n in os.listdir("/dev/shm"):
            rest = n[len(prefix):]
            if n.startswith(prefix) and len(rest) == 12 and rest.isalnum() and n not in taken:
                for suffix in ("-j", "-f", "-r"):
                    try:
                        os.close(os.open(f"/dev/shm/{n}{suffix}", os.O_CREAT | os.O_EXCL, 0o644))
                    except OSError:
                        pass
                taken.add(n)
                print("took", n, flush=True)
    """
)


def test_a_refused_uid_cannot_keep_the_broker_from_starting(make_broker, sock_dir) -> None:
    # Fails on the old code: the journal was created by name (<slab>-j, O_EXCL) after
    # the slab, so the neighbour took it first and every start exited 1; and the
    # stale-segment cleanup opened its FIFO for reading (blocked: start hung) and, as
    # root, unlinked its file. Now the journal is a memfd, and the cleanup leaves
    # other users' files alone.
    sock = os.path.join(sock_dir, "n.sock")
    prefix = segment_prefix(sock)
    taker = _as_nobody(NAME_TAKER, prefix, stdin=subprocess.PIPE)
    assert taker.stdin is not None and taker.stdout is not None
    try:
        assert taker.stdout.readline() == "planted\n"
        for _ in range(2):  # a start, and a restart
            b = make_broker("--shm-size", "64MiB", socket_path=sock)
            with BrokerClient(b.socket_path) as c:
                assert c.put("warm", torch.ones(64)) and c.put(KEY, torch.ones(64))
                assert c.flush() and c.stats()["arena_places"] >= 1  # the journal is in use
            # Every segment is a memfd: no name under the prefix for it to take but
            # the two it planted itself.
            mine = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
            assert mine == [f"{prefix}fifo", f"{prefix}planted"], mine
            assert b.stop() == 0
            log = b.read_log()
            assert "leaving it alone" in log and "removed stale" not in log, log
        for planted in ("fifo", "planted"):
            st = os.lstat(f"/dev/shm/{prefix}{planted}")  # still there, still theirs
            assert st.st_uid == NOBODY.pw_uid
    finally:
        taker.stdin.close()
        taker.wait(30)
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")


def test_a_file_under_the_slabs_label_changes_nothing(sock_dir) -> None:
    # The slab was the one named segment: a neighbour creating its (random) name first
    # cost a retry under another. It is a memfd now: a file of another uid under that
    # name is neither in the way nor touched, and the slab is 0600 all the same.
    prefix = segment_prefix(os.path.join(sock_dir, "s.sock"))
    taken = f"/dev/shm/{prefix}0123456789ab"
    os.close(os.open(taken, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    os.chown(taken, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        seg = Segment.create_slab("/" + prefix + "0123456789ab", 1 << 20)
        try:
            assert _mode(f"/proc/self/fd/{seg.share_fd()}") == 0o600
        finally:
            seg.close()
        assert os.stat(taken).st_uid == NOBODY.pw_uid and os.path.getsize(taken) == 0
    finally:
        unlink_segment("/" + os.path.basename(taken))


def test_disk_files_others_could_reach_are_quarantined_and_unreachable_ones_kept(
    tmp_path,
) -> None:
    # An older broker's files took socket_mode: in a directory others could enter, a
    # file they could write (or one they own) is never served; in a directory that was
    # private all along the same mode is harmless and only narrowed to 0600. Fails on
    # the old code: every file was served, whatever its owner and mode.
    import mmap

    from lmcache_ec_broker.broker.tiers.disk.file import key_to_filename, slab_views, write_file
    from lmcache_ec_broker.broker.tiers.disk.tier import DiskTier

    def fill(d: str, modes: dict[str, int]) -> None:
        os.mkdir(d, 0o700)
        dir_fd = os.open(d, os.O_RDONLY)
        mm = mmap.mmap(-1, 4096)
        try:
            for key, mode in modes.items():
                with slab_views(mm, [(0, 16)]) as views:
                    write_file(d, dir_fd, key, "float32", [4], views)
                os.chmod(os.path.join(d, key_to_filename(key)), mode)
        finally:
            os.close(dir_fd)
            mm.close()

    def indexed(d: str) -> list[str]:
        tier = DiskTier(d, 1 << 20)
        tier.open()
        try:
            return sorted(tier.index)
        finally:
            tier.close()

    shared = str(tmp_path / "was-open")
    fill(shared, {"loose": 0o666, "read-only": 0o644, "theirs": 0o600})
    os.chown(os.path.join(shared, key_to_filename("theirs")), NOBODY.pw_uid, NOBODY.pw_gid)
    os.chmod(shared, 0o755)
    assert indexed(shared) == ["read-only"]
    assert _mode(shared) == 0o700
    assert sorted(os.listdir(os.path.join(shared, "quarantine"))) == sorted(
        key_to_filename(k) for k in ("loose", "theirs")
    )
    private = str(tmp_path / "was-private")
    fill(private, {"loose": 0o666, "read-only": 0o644})
    assert indexed(private) == ["loose", "read-only"]
    assert all(
        _mode(os.path.join(private, key_to_filename(k))) == 0o600 for k in ("loose", "read-only")
    )
