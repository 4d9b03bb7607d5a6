"""Two brokers that cannot see each other's socket but share /dev/shm.

Two containers with their own /tmp (or any private mount of the socket's
directory) and one shared /dev/shm run brokers on the same socket path: their
segment names derive from the same path. Every segment is a memfd now (no name at
all); a start-up still removes the named segments an older, dead broker left under
that prefix -- never one a live owner holds, whose clients would then fail to attach.
Here each broker
runs in its own mount namespace (``unshare --mount``) with a private tmpfs over the
socket's directory; /dev/shm is the host's, shared by both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import shm_segments

HERE = Path(__file__).resolve().parent

# Runs inside a mount namespace: a private tmpfs over the socket's directory, a broker
# on the shared path, then commands from stdin ("check": a new client attaches and
# round-trips a tensor; "stop": the broker ends, its log is printed).
RUNNER = textwrap.dedent(
    """
    import subprocess, sys, time
    import torch
    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.broker.server import probe_socket

    path = sys.argv[1]
    b = subprocess.Popen([sys.executable, "-m", "lmcache_ec_broker.cli", "start",
                          "--socket", path, "--shm-size", "16MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(600):
        if probe_socket(path, timeout=0.2) or b.poll() is not None:
            break
        time.sleep(0.05)
    print("ready" if b.poll() is None else "died", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() == "check":
            t = torch.arange(256, dtype=torch.float32) + n
            with BrokerClient(path, timeout_s=30) as c:  # a loaded host: a wait, not a window
                ok = c.put(f"k{n}", t) and torch.equal(c.get(f"k{n}"), t)
            print("ok" if ok else "failed", flush=True)
        elif line.strip() == "stop":
            b.terminate()
            out = b.communicate(timeout=60)[0]
            print(out.replace("\\n", " | "), flush=True)
            print("rc", b.returncode, flush=True)
            break
    """
)


class NamespacedBroker:
    def __init__(self, socket_dir: str) -> None:
        ns = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", ns, "sh",
             socket_dir, sys.executable, "-c", RUNNER, os.path.join(socket_dir, "s.sock")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=str(HERE.parent), start_new_session=True,  # kill() reaches the broker too
        )  # fmt: skip

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        if not got:
            raise AssertionError(f"namespaced broker ended: {self.proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        return got

    def send(self, cmd: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> str:
        log = self.send("stop")
        assert self.line() == "rc 0", log
        self.proc.wait(30)
        return log

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Signal the runner and the broker it started (one process group): SIGTERM lets
        the broker clean up (a failed test leaves nothing), SIGKILL plays a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        time.sleep(0.5 if sig == signal.SIGTERM else 0)  # the broker's own cleanup
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def _can_unshare_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a mount namespace"
    if shutil.which("unshare") is None:
        return "needs unshare(1)"
    d = tempfile.mkdtemp(prefix="ecb-ns-probe-", dir="/var/tmp")
    try:
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "t", d],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.rmdir(d)
    return None if r.returncode == 0 else f"cannot make a mount namespace here: {r.stderr}"


@pytest.fixture
def twin() -> Iterator[Callable[[], NamespacedBroker]]:
    """Factory of namespaced brokers on one shared socket path (``twin.path``); all are
    stopped at teardown."""
    why = _can_unshare_mount()
    if why:
        pytest.skip(why)
    socket_dir = tempfile.mkdtemp(prefix="ecb-twin-", dir="/var/tmp")
    started: list[NamespacedBroker] = []

    def make() -> NamespacedBroker:
        started.append(NamespacedBroker(socket_dir))
        return started[-1]

    make.path = os.path.join(socket_dir, "s.sock")  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for x in started:
            x.kill()
        os.rmdir(socket_dir)


def test_twins_in_two_mount_namespaces_share_no_name_and_each_keeps_serving(twin) -> None:
    # Every segment is a memfd: the twins derive the same prefix, but neither puts a
    # name in the shared /dev/shm, so neither start-up can take the other's for stale.
    path = twin.path
    a = twin()
    assert a.line() == "ready"
    assert a.send("check") == "ok"
    assert shm_segments(path, include_filter=True) == []

    b = twin()  # same path, its own private directory
    assert b.line() == "ready"
    assert shm_segments(path, include_filter=True) == []
    assert a.send("check") == "ok"  # a new client of A still attaches to A's slab
    assert b.send("check") == "ok"

    log_b = b.stop()
    assert "removed stale" not in log_b
    assert a.send("check") == "ok"
    a.stop()
    assert shm_segments(path, include_filter=True) == []


def test_an_older_brokers_named_segments_are_removed_unless_a_live_owner_holds_them(
    twin,
) -> None:
    """Brokers before the memfd slab named it in /dev/shm and held a flock on it for
    their life: a start removes such a segment a dead broker left (its lock is free),
    never one a live owner -- a twin in another mount namespace -- still holds."""
    import fcntl

    from lmcache_ec_broker.broker.lifecycle import segment_prefix

    path = twin.path
    prefix = "/dev/shm/" + segment_prefix(path)
    dead, live = prefix + "0000000000de", prefix + "00000000011e"
    for name in (dead, live):
        with open(name, "wb") as f:
            f.truncate(1 << 20)
    held = os.open(live, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as its live owner does
        b = twin()
        assert b.line() == "ready"
        assert not os.path.exists(dead) and os.path.exists(live)
        log_b = b.stop()
        assert "removed stale shared-memory segment" in log_b
        assert "live owner" in log_b and "Give each broker its own socket path" in log_b
    finally:
        os.close(held)
        for name in (dead, live):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
