"""The broker says when it shares its session's CPU group (Linux autogroup), and a
broker in a session of its own does not: real broker processes, started both ways."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BrokerProcess, wait_until

from lmcache_ec_broker.broker.server import probe_socket
from lmcache_ec_broker.cpu_group import _in_root_cpu_cgroup, autogroup_applies

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


def _own_session_log(sock_dir: str) -> str:
    b = BrokerProcess(os.path.join(sock_dir, "own.sock"), ["--shm-size", "32MiB"])
    b.start(timeout=60)
    assert b.stop(30) == 0, b.read_log()
    return b.read_log()


def _started_inside_a_session_log(sock_dir: str) -> str:
    """A broker started the way a shell starts one: by a process that leads a session of
    its own (here ``sh``, which keeps running as the broker's parent), without a session
    for the broker. A new session has an autogroup of its own whatever group the test
    itself runs in (CI's runner: the root task group, which has none)."""
    sock = os.path.join(sock_dir, "shared.sock")
    log = sock + ".log"
    cli = shlex.join([sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", sock])
    starter = subprocess.Popen(
        ["sh", "-c", f"{cli} --shm-size 32MiB >{shlex.quote(log)} 2>&1; exit $?"],
        start_new_session=True,
    )
    try:
        wait_until(lambda: probe_socket(sock, 0.2) or starter.poll() is not None, "the broker")
        assert starter.poll() is None, Path(log).read_text()
    finally:
        os.killpg(starter.pid, signal.SIGTERM)  # its own group: sh and the broker
        starter.wait(30)
    wait_until(lambda: not os.path.exists(sock), "the broker to stop", timeout=30)
    return Path(log).read_text()


@pytest.mark.skipif(not autogroup_applies(), reason="Linux autogroup off, or not in the root CPU cgroup")
def test_a_broker_in_its_starters_session_says_so_and_one_in_its_own_does_not(sock_dir: str) -> None:
    shared = _started_inside_a_session_log(sock_dir)
    assert LINE in shared and "setsid" in shared, shared
    own = _own_session_log(sock_dir)
    assert LINE not in own, own
