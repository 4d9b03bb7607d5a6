"""The broker says when it shares its session's CPU group (Linux autogroup), and a
broker in a session of its own does not: real broker processes, started both ways."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_ec_broker.broker.server import probe_socket
from lmcache_ec_broker.cpu_group import _in_root_cpu_cgroup, _read

LINE = "shares the CPU scheduling group of session"


@pytest.mark.parametrize(
    ("text", "root"),
    [
        ("4:memory:/x\n2:cpu,cpuacct:/\n0::/\n", True),  # v1 cpu controller at the root
        ("2:cpu,cpuacct:/system.slice/b.service\n0::/\n", False),  # v1, a service's cgroup
        ("0::/\n", True),  # v2 only, the root
        ("0::/system.slice/lmcache-ec-broker.service\n", False),  # v2, a service
        ("1:cpu:/\n", True),
    ],
)
def test_the_cpu_cgroup_is_read_from_the_cpu_controller_or_the_v2_path(text: str, root: bool) -> None:
    assert _in_root_cpu_cgroup(text) is root


def _autogroup_applies() -> bool:
    cgroup = _read("/proc/self/cgroup")
    return (
        (_read("/proc/sys/kernel/sched_autogroup_enabled") or "").strip() == "1"
        and cgroup is not None
        and _in_root_cpu_cgroup(cgroup)
        and _read("/proc/self/autogroup") is not None
    )


def _start_log(sock_dir: str, name: str, new_session: bool) -> str:
    sock = os.path.join(sock_dir, f"{name}.sock")
    log = Path(sock_dir, f"{name}.log")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", sock,
             "--shm-size", "32MiB"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=new_session,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not probe_socket(sock, 0.2):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()
    return log.read_text()


@pytest.mark.skipif(not _autogroup_applies(), reason="Linux autogroup off, or not in the root CPU cgroup")
def test_a_broker_in_its_starters_session_says_so_and_one_in_its_own_does_not(sock_dir: str) -> None:
    shared = _start_log(sock_dir, "shared", new_session=False)
    assert LINE in shared and "setsid" in shared, shared
    own = _start_log(sock_dir, "own", new_session=True)
    assert LINE not in own, own
