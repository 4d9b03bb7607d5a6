"""Whether the broker shares a CPU scheduling group with the processes that started it.

With Linux autogroup on (``kernel.sched_autogroup_enabled``, the default of most
distributions), the CPU is shared among *sessions* first and among a session's
tasks second, for every task in the root CPU cgroup. A broker started from a shell
or by a program (``subprocess.Popen`` without a new session) is one task of that
session's group: a CPU-bound process of the same session keeps the group busy, so
the broker's wake-ups wait for the group's turn among all the others. Measured
(docs/performance.md, "The broker's CPU group"): beside one CPU-bound process of its
own session and four ``vllm serve`` (each a session of its own), the broker waited
14-20 ms on the run queue per time slice and up to 6.5 s in one 100 ms sample, and
clients' 50 ms lookups timed out; with that process in a session of its own, 2-6 ms.

A service manager gives the broker a group of its own (systemd: a cgroup; a
container runtime: a cgroup; both a session), and so does ``setsid``. The broker does
not move itself: leaving the session would cut it off from the terminal's Ctrl-C and
from a supervisor that stops its process group.
"""

from __future__ import annotations

import os


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _in_root_cpu_cgroup(cgroup: str) -> bool:
    """Whether /proc/self/cgroup's text puts this process in the root of the cgroup
    that holds the CPU controller (cgroup v1 ``cpu``; otherwise the v2 path)."""
    v2 = None
    for line in cgroup.splitlines():
        _id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" in controllers.split(","):
            return path == "/"
        if controllers == "":
            v2 = path
    return v2 == "/"


def autogroup_applies() -> bool:
    """Whether Linux autogroup schedules this process: on, and in the root CPU cgroup."""
    if (_read("/proc/sys/kernel/sched_autogroup_enabled") or "").strip() != "1":
        return False
    cgroup = _read("/proc/self/cgroup")
    return cgroup is not None and _in_root_cpu_cgroup(cgroup)


def autogroup() -> str | None:
    """The autogroup this process is scheduled in (as ``/proc/self/autogroup`` names it,
    e.g. ``/autogroup-12 nice 0``), or None: autogroup off, a cgroup of its own, or the
    root task group -- a process whose session began before autogroup existed (pid 1's,
    as a container's init) or never left it prints nothing there, and competes with the
    other tasks one by one, not as a group."""
    if not autogroup_applies():
        return None
    group = (_read("/proc/self/autogroup") or "").strip()
    return group or None


def shared_cpu_group() -> str | None:
    """The autogroup this process shares with the rest of its session, or None: no
    autogroup (see ``autogroup``), or a session, and so an autogroup, of its own."""
    if os.getsid(0) == os.getpid():
        return None
    return autogroup()
