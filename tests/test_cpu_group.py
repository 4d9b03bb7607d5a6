"""The broker says when it shares its session's CPU group (Linux autogroup), and a
broker in a session of its own does not: real broker processes, started both ways."""

from __future__ import annotations

import os

import pytest
from conftest import BrokerProcess

from lmcache_ec_broker.cpu_group import _in_root_cpu_cgroup, autogroup

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


def _start_log(sock_dir: str, name: str, own_session: bool) -> str:
    b = BrokerProcess(os.path.join(sock_dir, f"{name}.sock"), ["--shm-size", "32MiB"],
                      own_session=own_session).start(timeout=60)  # fmt: skip
    assert b.stop(30) == 0, b.read_log()
    return b.read_log()


# The starter's own group decides: a harness run by pid 1 without a session of its own
# (CI's runner) is in the root task group, where a broker beside it has no group to share
# and rightly says nothing (CI, 2026-12-06).
@pytest.mark.skipif(autogroup() is None, reason="this process is in no autogroup (off, a cgroup, or the root group)")
def test_a_broker_in_its_starters_session_says_so_and_one_in_its_own_does_not(sock_dir: str) -> None:
    shared = _start_log(sock_dir, "shared", own_session=False)
    assert LINE in shared and "setsid" in shared, shared
    own = _start_log(sock_dir, "own", own_session=True)
    assert LINE not in own, own
