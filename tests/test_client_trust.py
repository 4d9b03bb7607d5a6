"""The client checks who the broker is before it sends, maps or writes anything.

A real second uid (``nobody``) squats the socket path with tests/squatter.py: it
answers the handshake with its own segment, reserves every put and answers
every get. A client that trusted it would write its tensors into that user's
memory and load that user's bytes. The tests run as root (root may act as
another uid); the default-path tests run in a private mount namespace with
their own /tmp and /dev/shm, so they never touch the host's default socket.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import posix_ipc
import pytest
import torch

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.private_dirs import (
    check_private_dir,
    default_socket_path,
    ensure_private_dir,
    private_socket_dir,
)
from lmcache_ec_broker.protocol import LookupState

HERE = Path(__file__).resolve().parent
NOBODY = pwd.getpwnam("nobody").pw_uid
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
# Client deadlines of 30 s: waits for a peer's answer on a loaded CI host; no test here
# expects a deadline to pass (a refused peer is refused at once, without waiting).


class Squatter:
    def __init__(
        self, sock: str, uid: int | None, segment_owner: int | None = None, size: int | None = None
    ) -> None:
        self.sock = sock
        self.segment = f"/ecb-squat-{uuid.uuid4().hex[:10]}"
        cmd = [sys.executable, str(HERE / "squatter.py"), sock, self.segment]
        if size is not None:
            cmd += ["--announce-size", str(size)]
        if uid is not None:
            cmd += ["--uid", str(uid)]
        if segment_owner is not None:
            cmd += ["--segment-owner", str(segment_owner)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", self.proc.stderr.read() if self.proc.stderr else line

    def segment_bytes(self) -> bytes:
        shm = posix_ipc.SharedMemory(self.segment)
        try:
            return os.pread(shm.fd, 1 << 20, 0)
        finally:
            shm.close_fd()

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.terminate()
        out, err = self.proc.communicate(timeout=60)
        try:
            posix_ipc.unlink_shared_memory(self.segment)
        except posix_ipc.ExistentialError:
            pass
        lines = out.strip().splitlines()
        assert lines, err
        return json.loads(lines[-1])


@pytest.fixture
def squat(sock_dir: str) -> Iterator:
    os.chmod(sock_dir, 0o777)  # the squatter (another uid) binds in it
    started: list[Squatter] = []

    def factory(
        uid: int | None = NOBODY, segment_owner: int | None = None, size: int | None = None
    ) -> Squatter:
        s = Squatter(os.path.join(sock_dir, "broker.sock"), uid, segment_owner, size)
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop()


def _every_call_is_an_outage(c: BrokerClient) -> None:
    t = torch.arange(64, dtype=torch.uint8)
    assert not c.connected
    assert c.put("k", t) is False
    assert c.put_many([("k", t)]) == [False]
    assert c.get("k") is None
    assert c.get_many(["k"]) == [None]
    out = torch.zeros(64, dtype=torch.uint8)
    assert c.get_into("k", out) is False and not out.any()
    assert c.has(["k"]) == [False]
    assert [i.state for i in c.lookup(["k"])] == [LookupState.MISS]
    assert c.stats() == {} and c.ping() is False


@needs_root
def test_client_refuses_a_squatter_of_another_uid_and_names_it(squat, caplog) -> None:
    sq = squat(uid=NOBODY)
    with caplog.at_level(logging.WARNING, logger="lmcache_ec_broker.connector.client"):
        with BrokerClient(sq.sock, timeout_s=30, max_backoff_s=0.01) as c:
            _every_call_is_an_outage(c)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"uid {NOBODY}" in w and "broker_uid" in w for w in warnings), warnings
    assert sq.segment_bytes() == bytes([0xAB]) * (1 << 20)  # nothing written to it
    stats = sq.stop()
    assert stats["uid"] == NOBODY and stats["connections"] >= 1
    assert stats["frames"] == 0, "the client sent something to an untrusted peer"


@needs_root
def test_the_squatter_counts_what_it_never_ran_to_read(squat) -> None:
    """The squatter's counts (which the test above relies on: "nothing was sent") include
    the connections and frames still in the kernel's queues when it stops. Seen failing
    first: a squatter that never ran between the client's connect and its stop counted
    no connection (the CI run of 2026-12-02 05:07, beside the vllm tests)."""
    import signal
    import socket

    from lmcache_ec_broker.protocol import FRAME_HEADER, Ping

    sq = squat(uid=NOBODY)
    sq.proc.send_signal(signal.SIGSTOP)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(sq.sock)
            body = msgspec.msgpack.encode(Ping())
            raw.sendall(FRAME_HEADER.pack(len(body)) + body)
        sq.proc.send_signal(signal.SIGTERM)  # handled first thing when it runs again
    finally:
        sq.proc.send_signal(signal.SIGCONT)
    stats = sq.stop()
    assert stats["connections"] == 1 and stats["frames"] == 1, stats


@needs_root
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_an_explicitly_configured_broker_uid_is_trusted(squat, monkeypatch, how) -> None:
    sq = squat(uid=NOBODY, segment_owner=NOBODY)
    if how == "environment":
        monkeypatch.setenv("LMCACHE_EC_BROKER_UID", "nobody")
        c = BrokerClient(sq.sock, timeout_s=30)
    else:
        c = BrokerClient(sq.sock, timeout_s=30, broker_uid=NOBODY)
    with c:
        assert c.connected and NOBODY in c.trusted_uids
        assert c.put("k", torch.zeros(64, dtype=torch.uint8))
    assert sq.segment_bytes()[:64] == bytes(64)  # it did write where it was told
    assert sq.stop()["frames"] >= 3  # hello, reserve, commit


@needs_root
def test_a_trusted_peer_naming_another_users_segment_is_not_mapped(squat, caplog) -> None:
    # The peer runs as root (trusted), but the segment it names belongs to nobody.
    sq = squat(uid=None, segment_owner=NOBODY)
    with caplog.at_level(logging.WARNING, logger="lmcache_ec_broker.connector.client"):
        with BrokerClient(sq.sock, timeout_s=30) as c:
            assert c.connected
            assert c.put("k", torch.arange(64, dtype=torch.uint8)) is False
            assert c.put_many([("k", torch.arange(64, dtype=torch.uint8))]) == [False]
            assert c.get("k") is None
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert f"belongs to uid {NOBODY}" in warnings, warnings
    assert sq.segment_bytes() == bytes([0xAB]) * (1 << 20)


@needs_root
@pytest.mark.parametrize("size", [-1, 0, 1 << 62, (1 << 20) + 1])
def test_an_absurd_announced_segment_size_is_an_outage(squat, size: int) -> None:
    # A trusted uid (root) but a lying handshake: nothing it says is taken on faith.
    sq = squat(uid=None, size=size)
    with BrokerClient(sq.sock, timeout_s=30, max_backoff_s=0.0) as c:
        assert c.put("k", torch.arange(64, dtype=torch.uint8)) is False
        assert c.put_many([("k", torch.arange(64, dtype=torch.uint8))]) == [False]
        assert c.get("k") is None
        assert c.get_into("k", torch.zeros(64, dtype=torch.uint8)) is False
    assert sq.segment_bytes() == bytes([0xAB]) * (1 << 20)


def test_a_membership_filter_of_an_untrusted_owner_is_not_mapped() -> None:
    from lmcache_ec_broker.shm.filter import FilterReader, FilterWriter
    from lmcache_ec_broker.shm.segment import ShmError

    w = FilterWriter(f"/ecb-flt-{uuid.uuid4().hex[:10]}", 16)
    try:
        owner = os.getuid()
        with pytest.raises(ShmError, match=f"belongs to uid {owner}"):
            FilterReader(w.name, w.size, owners={owner + 1}, fd=w.segment.share_fd())
        FilterReader(w.name, w.size, owners={owner}, fd=w.segment.share_fd()).close()
    finally:
        w.close()


def test_bad_broker_uid_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_EC_BROKER_UID", "no-such-user-xyz")
    with pytest.raises(ValueError, match="LMCACHE_EC_BROKER_UID.*no-such-user-xyz"):
        BrokerClient("/nonexistent/broker.sock")
    with pytest.raises(ValueError, match="broker_uid"):
        BrokerClient("/nonexistent/broker.sock", broker_uid=-1)


# ------------------------------------------------------------ the default path


def test_default_socket_is_in_a_per_user_directory(monkeypatch) -> None:
    monkeypatch.delenv("LMCACHE_EC_BROKER_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = default_socket_path()
    assert path == f"/tmp/lmcache-ec-broker-{os.getuid()}/broker.sock"
    assert os.path.dirname(path) == private_socket_dir()


def test_private_dir_is_created_0700_and_a_loose_or_foreign_one_refused(tmp_path) -> None:
    d = str(tmp_path / "sockdir")
    ensure_private_dir(d)
    assert os.stat(d).st_mode & 0o777 == 0o700
    ensure_private_dir(d)  # idempotent
    os.chmod(d, 0o777)
    with pytest.raises(ValueError, match="mode 0777.*chmod 700"):
        check_private_dir(d)
    os.chmod(d, 0o700)
    link = str(tmp_path / "link")
    os.symlink(d, link)
    with pytest.raises(ValueError, match="not a directory"):
        ensure_private_dir(link)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, -1)
        with pytest.raises(ValueError, match=f"belongs to uid {NOBODY}"):
            check_private_dir(d)


# The scenario runs in a mount namespace with its own /tmp and /dev/shm.
NAMESPACE_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, subprocess, sys, time
    import torch
    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.broker.server import probe_socket

    NOBODY, HERE = int(sys.argv[1]), sys.argv[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "LMCACHE_EC_BROKER_SOCKET")}
    os.environ.clear(); os.environ.update(env)
    os.mkdir("/tmp/home", 0o700); os.environ["HOME"] = "/tmp/home"  # inside the namespace
    path = f"/tmp/lmcache-ec-broker-{os.getuid()}/broker.sock"
    out = {}
    cli = [sys.executable, "-m", "lmcache_ec_broker.cli"]

    # 1. A broker on the default path creates the private directory and serves.
    b = subprocess.Popen(cli + ["start", "--shm-size", "32MiB"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    for _ in range(400):
        if probe_socket(path, timeout=0.2) or b.poll() is not None:
            break
        time.sleep(0.05)
    st = os.stat(os.path.dirname(path))
    out["dir_mode"], out["dir_uid"] = st.st_mode & 0o777, st.st_uid
    with BrokerClient(timeout_s=30) as c:
        t = torch.arange(100, dtype=torch.float32)
        out["default_client"] = c.socket_path == path and c.put("k", t) and torch.equal(c.get("k"), t)
    b.terminate(); b.wait(30)

    # 2. Another user owns the directory first (and listens in it): the broker starts
    #    anyway, in the home fallback, and the default client finds it there; a client
    #    given the squatter's socket explicitly refuses it.
    os.rmdir(os.path.dirname(path))
    os.mkdir(os.path.dirname(path), 0o700); os.chown(os.path.dirname(path), NOBODY, -1)
    sq = subprocess.Popen([sys.executable, os.path.join(HERE, "squatter.py"), path, "/ecb-sq",
                           "--uid", str(NOBODY)], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)  # a failure here ends at once
    assert sq.stdout.readline().strip() == "ready"
    home = "/tmp/home/.lmcache-ec-broker/broker.sock"
    b = subprocess.Popen(cli + ["start", "--shm-size", "32MiB"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    for _ in range(400):
        if probe_socket(home, timeout=0.2) or b.poll() is not None:
            break
        time.sleep(0.05)
    out["start_rc"] = b.poll()
    st = os.stat(os.path.dirname(home))
    out["home_dir_mode"], out["home_dir_uid"] = st.st_mode & 0o777, st.st_uid
    records = []
    h = logging.Handler(); h.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("lmcache_ec_broker").addHandler(h)
    with BrokerClient(timeout_s=30) as c:
        t = torch.arange(100, dtype=torch.float32)
        out["fallback_client"] = c.socket_path == home and c.put("k", t) and torch.equal(c.get("k"), t)
    with BrokerClient(path, timeout_s=30) as c:
        out["squatted_put"] = c.put("k", torch.ones(64, dtype=torch.uint8))
        out["squatted_connected"] = c.connected
    out["client_warnings"] = records
    b.terminate(); out["start_err"] = b.communicate(timeout=30)[1]
    sq.terminate()
    out["squatter"] = json.loads(sq.communicate(timeout=60)[0].strip().splitlines()[-1])
    out["left_in_shm"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out))
    """
)


@needs_root
def test_default_path_broker_makes_a_private_dir_and_moves_out_of_a_squatted_one() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/tmp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace with a private /tmp here: {probe.stderr}")
    # A private /tmp hides everything under the real one, and the checkout (with its
    # .venv) may live there (CI clones anywhere): keep the real /tmp reachable through a
    # bind mount outside it and bind the checkout and the interpreter's prefix back.
    keep = [str(HERE.parent)]
    if not sys.prefix.startswith(str(HERE.parent) + "/"):
        keep.append(sys.prefix)
    ns = (
        'mount --bind /tmp "$ORIG" && mount -t tmpfs tmpfs /tmp '
        "&& mount -t tmpfs tmpfs /dev/shm "
        '&& for p in $KEEP; do case "$p" in /tmp/*) mkdir -p "$p" '
        '&& mount --bind "$ORIG${p#/tmp}" "$p";; esac; done && exec "$@"'
    )
    orig = tempfile.mkdtemp(dir="/var/tmp")
    try:
        r = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                ns,
                "sh",
                sys.executable,
                "-c",
                NAMESPACE_SCRIPT,
                str(NOBODY),
                str(HERE),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(HERE.parent),
            env=dict(os.environ, ORIG=orig, KEEP=" ".join(keep)),
        )
    finally:
        os.rmdir(orig)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["dir_mode"] == 0o700 and out["dir_uid"] == 0
    assert out["default_client"] is True
    # Fails on the old code: a directory another uid took first kept the broker from
    # starting (issue 40, item 3); now both sides move to $HOME/.lmcache-ec-broker.
    assert out["start_rc"] is None, out
    assert f"belongs to uid {NOBODY} (another user took the name first)" in out["start_err"]
    assert out["home_dir_mode"] == 0o700 and out["home_dir_uid"] == 0
    assert out["fallback_client"] is True
    assert out["squatted_put"] is False and out["squatted_connected"] is False
    assert any(f"uid {NOBODY}" in w for w in out["client_warnings"]), out["client_warnings"]
    assert out["squatter"]["frames"] == 0
    assert out["left_in_shm"] == ["ecb-sq"]  # the squatter's own, untouched; the broker's gone
