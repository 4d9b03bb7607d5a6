"""Access control: file permissions of the socket and segment, and the broker's peer check.

The tests run as root; the "other user" is a real client process that drops to
``nobody`` (and, for the group case, keeps one supplementary group) before it
connects, so the kernel's SO_PEERCRED/SO_PEERGROUPS see a genuinely different
peer.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import memfd_segments, run_cli, shm_segments, slab_of

from lmcache_ec_broker import BrokerClient

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

NOBODY = pwd.getpwnam("nobody")
GROUP = grp.getgrnam("users")  # any group nobody is not a member of in /etc/group

CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from lmcache_ec_broker.connector.client import BrokerClient, BrokerRefused

    sock, uid, gid, groups, tries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(gid)
    os.setuid(uid)
    out = {"uid": os.getuid(), "refused": [], "unavailable": 0, "ok": 0}
    for i in range(tries):
        try:
            c = BrokerClient(sock, timeout_s=5)
        except BrokerRefused as exc:
            out["refused"].append([exc.code, exc.message])
            continue
        if not c.connected:
            out["unavailable"] += 1
            continue
        t = torch.arange(1000, dtype=torch.float32) + i
        stored = c.put(f"k{i}", t)
        got = c.get(f"k{i}")
        if stored and got is not None and torch.equal(got, t):
            out["ok"] += 1
        c.close()
    print(json.dumps(out))
    """
)


def as_user(sock: str, uid: int, gid: int, groups: list[int] = (), tries: int = 1) -> dict:
    # The child must be able to reach the socket's directory.
    os.chmod(os.path.dirname(sock), 0o755)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            sock,
            str(uid),
            str(gid),
            ",".join(map(str, groups)),
            str(tries),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _segment_paths(b) -> list[str]:
    """The slab of broker ``b``: a memfd, reached through the broker's descriptor (no
    name in /dev/shm to open)."""
    slab = slab_of(b.pid, b.socket_path)
    assert slab is not None and shm_segments(b.socket_path, include_filter=True) == []
    return [memfd_segments(b.pid)[slab]]


def test_a_mode_that_cannot_admit_the_group_or_uids_is_refused_at_start(sock_dir) -> None:
    sock = os.path.join(sock_dir, "m.sock")
    for args, needle in (
        (["--socket-group", GROUP.gr_name], f"socket_group '{GROUP.gr_name}' cannot use"),
        (["--allowed-uids", str(NOBODY.pw_uid)], f"allowed_uids {NOBODY.pw_uid} cannot connect"),
    ):
        out = run_cli("start", "--socket", sock, "--shm-size", "16MiB", *args)
        assert out.returncode == 2, out.stderr
        assert needle in out.stderr and "socket_mode 0600" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
        assert not os.path.exists(sock) and not shm_segments(sock)


def test_socket_and_segment_are_private_by_default(broker) -> None:
    assert _mode(broker.socket_path) == 0o600
    for seg in _segment_paths(broker):
        assert _mode(seg) == 0o600, seg
        assert os.stat(seg).st_uid == os.getuid()


def test_socket_mode_and_group_open_the_socket_to_the_group_and_no_segment(make_broker) -> None:
    # The group reaches the socket; the segments stay private and go to admitted
    # clients as descriptors over it (docs/design.md "Shared memory"; issue 29).
    b = make_broker("--shm-size", "64MiB", "--socket-mode", "0660", "--socket-group", GROUP.gr_name)
    st = os.stat(b.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP.gr_gid
    for path in _segment_paths(b):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid(), path


def test_unknown_socket_group_is_a_clear_start_error(sock_dir) -> None:
    out = run_cli(
        "start",
        "--socket",
        os.path.join(sock_dir, "g.sock"),
        "--shm-size",
        "64MiB",
        "--socket-mode",
        "0660",
        "--socket-group",
        "no-such-group-xyz",
    )
    assert out.returncode == 1
    assert "socket_group 'no-such-group-xyz' does not exist" in out.stderr


def test_other_uid_is_refused_with_a_clear_message_every_time(make_broker) -> None:
    # World-writable socket: the file system lets nobody in, so only the broker's
    # SO_PEERCRED check stands between them. The refusal must reach the client
    # every time, not only when it wins the race against the broker's close.
    b = make_broker("--shm-size", "64MiB", "--socket-mode", "0666")
    out = as_user(b.socket_path, NOBODY.pw_uid, NOBODY.pw_gid, tries=40)
    assert out["uid"] == NOBODY.pw_uid
    assert out["ok"] == 0 and out["unavailable"] == 0, out
    assert len(out["refused"]) == 40
    code, message = out["refused"][0]
    assert code == "permission_denied"
    assert f"uid {NOBODY.pw_uid} may not use this broker" in message
    assert "allowed_uids" in message and "socket_group" in message
    with BrokerClient(b.socket_path) as c:
        st = c.stats()
        assert st["clients"] == 1 and st["entries"] == 0


def test_allowed_uid_is_admitted(make_broker) -> None:
    b = make_broker(
        "--shm-size", "64MiB", "--socket-mode", "0666", "--allowed-uids", str(NOBODY.pw_uid)
    )
    out = as_user(b.socket_path, NOBODY.pw_uid, NOBODY.pw_gid, tries=3)
    assert out == {"uid": NOBODY.pw_uid, "refused": [], "unavailable": 0, "ok": 3}


def test_member_of_the_socket_group_is_admitted_via_a_supplementary_group(make_broker) -> None:
    # The usual multi-user setup: the user's primary group is their own, the
    # shared group is a supplementary one. The file system admits them, so the
    # broker must too.
    b = make_broker("--shm-size", "64MiB", "--socket-mode", "0660", "--socket-group", GROUP.gr_name)
    out = as_user(b.socket_path, NOBODY.pw_uid, NOBODY.pw_gid, groups=[GROUP.gr_gid], tries=3)
    assert out == {"uid": NOBODY.pw_uid, "refused": [], "unavailable": 0, "ok": 3}


def test_non_member_cannot_even_open_a_group_socket(make_broker) -> None:
    b = make_broker("--shm-size", "64MiB", "--socket-mode", "0660", "--socket-group", GROUP.gr_name)
    out = as_user(b.socket_path, NOBODY.pw_uid, NOBODY.pw_gid, tries=2)
    # The kernel refuses the connect (EACCES); the client serves misses, no exception.
    assert out == {"uid": NOBODY.pw_uid, "refused": [], "unavailable": 2, "ok": 0}


def test_root_is_admitted_by_a_broker_of_another_user(sock_dir) -> None:
    # Root bypasses file permissions and can read any process's memory anyway;
    # refusing it would add no protection and would break `sudo lmcache-ec-broker
    # stats` (see docs/reliability.md).
    os.chmod(sock_dir, 0o777)
    path = os.path.join(sock_dir, "nobody.sock")

    # The interpreter lives under /root here, so the child imports everything it
    # needs as root and only then becomes nobody, before the broker starts.
    script = textwrap.dedent(
        f"""
        import argparse, asyncio, gettext, grp, json, logging, os, shutil, stat, sys, uuid
        import uvloop
        import lmcache_ec_broker.run, lmcache_ec_broker.cli as cli
        os.setgroups([]); os.setgid({NOBODY.pw_gid}); os.setuid({NOBODY.pw_uid})
        sys.exit(cli.main(["start", "--socket", {path!r}, "--shm-size", "64MiB"]))
        """
    )
    broker = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # a condition, not a window: a loaded host's start
        while not os.path.exists(path):
            assert broker.poll() is None, broker.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert os.stat(path).st_uid == NOBODY.pw_uid
        assert _mode(path) == 0o600
        with BrokerClient(path) as c:  # another uid's broker is trusted only when named
            assert not c.connected and c.put("k", torch.ones(10)) is False
        with BrokerClient(path, broker_uid=NOBODY.pw_uid) as c:
            assert c.put("k", torch.ones(10))
            assert torch.equal(c.get("k"), torch.ones(10))
    finally:
        broker.terminate()
        assert broker.wait(20) == 0
    assert not os.path.exists(path) and shm_segments(path) == []
