"""A real broker process started through the CLI: the one launcher of the tests and
benchmarks.

It starts the broker in a session -- and so a CPU scheduling group -- of its own, as
a service manager does (systemd, a container runtime): a broker that shares the
starter's group waits for that group's turn behind any CPU-bound process of the same
session, and its clients' lookups time out on a busy host (cpu_group.py,
docs/performance.md "The broker's CPU group").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLI = ("-m", "lmcache_ec_broker.cli")


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when its starter dies, even by SIGKILL, so a killed
    benchmark leaves no broker (and so no slab), redis-server or worker behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM ``proc`` (a broker flushes, unlinks its socket, closes its segments),
    SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class BrokerProcess:
    """``lmcache-ec-broker start --socket SOCKET ARGS`` in a process of its own, its
    output appended to ``log_path`` (``SOCKET.log`` unless given)."""

    def __init__(
        self,
        socket_path: str,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        *,
        log_path: str | os.PathLike[str] | None = None,
        die_with_parent: bool = False,
        launcher: Sequence[str] = CLI,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        """``env``: added to this process's environment. ``launcher``: what runs the CLI
        after the interpreter (a wrapper script calling ``cli.main`` may stand in)."""
        self.socket_path = socket_path
        self.args = list(args)
        self.env = env
        self.log_path = str(log_path) if log_path is not None else socket_path + ".log"
        self.die_with_parent = die_with_parent
        self.launcher = tuple(launcher)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True, timeout: float = 60.0) -> BrokerProcess:
        cmd = [sys.executable, *self.launcher, "start", "--socket", self.socket_path, *self.args]
        with open(self.log_path, "ab") as log:  # the broker keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, **(self.env or {})),
                cwd=self.cwd,
                start_new_session=True,  # its own session and CPU group (above)
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the broker accepts connections (it listens once its start-up checks
        passed; what is sent before its loop runs is answered then); raises with its log
        if it exits or takes longer than ``timeout``."""
        from lmcache_ec_broker.broker.server import probe_socket

        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while not probe_socket(self.socket_path, timeout=0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.read_log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker not ready after {timeout}s:\n{self.read_log()}")
            time.sleep(0.02)

    def read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the broker flushes, unlinks its socket, closes its segments), SIGKILL
        after ``timeout``; the exit code (negative: the signal that ended it)."""
        if self.proc is None:
            return 0
        stop_process(self.proc, timeout)
        return self.proc.returncode
