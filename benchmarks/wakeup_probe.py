"""Probe: what one request/reply round trip between two processes costs on this host.

No broker: a plain Unix-socket ping-pong (16-byte messages) between two
processes, in five arrangements, to separate the machine's part of the
broker's round-trip latency (``has()`` on a hit, each step of a put or get)
from the broker's own work:

- both sides block in ``recv`` (what the broker and its client do);
- one side busy-polls (``MSG_DONTWAIT`` in a loop) for up to --spin-us before
  blocking, so its CPU never goes idle during the exchange; then the other;
- both busy-poll: no CPU ever idles, the pure cost of the syscalls and copies;
- both block, pinned to the same CPU: a hand-off on one CPU, no cross-CPU wake-up.

If the blocking figure is far above the "both spin" one, the difference is the
cost of waking an idle CPU (on a VM: an idle vCPU is halted, and waking it is
an exit to the hypervisor). See docs/performance.md.

    .venv/bin/python benchmarks/wakeup_probe.py
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import median, percentile, table  # noqa: E402


def _recv(sock: socket.socket, buf: bytearray, spin_s: float) -> int:
    if spin_s:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            try:
                return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
    return sock.recv_into(buf)


def _echo(sock: socket.socket, spin_s: float) -> None:
    buf = bytearray(64)
    while n := _recv(sock, buf, spin_s):
        sock.sendall(buf[:n])


def measure(
    iters: int, client_spin_s: float, server_spin_s: float, same_cpu: bool
) -> tuple[float, float]:
    a, b = socket.socketpair()
    cpus = sorted(os.sched_getaffinity(0))
    pid = os.fork()
    if pid == 0:
        a.close()
        if same_cpu:
            os.sched_setaffinity(0, cpus[:1])
        _echo(b, server_spin_s)
        os._exit(0)
    b.close()
    saved = os.sched_getaffinity(0)
    if same_cpu:
        os.sched_setaffinity(0, cpus[:1])
    buf, msg, lat = bytearray(64), b"x" * 16, []
    try:
        for i in range(iters):
            if i % 100 == 0:
                time.sleep(0.002)  # let the scheduler place the two processes afresh
            t0 = time.perf_counter()
            a.sendall(msg)
            _recv(a, buf, client_spin_s)
            lat.append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, saved)
        a.close()
        os.waitpid(pid, 0)
    return percentile(lat, 0.5), percentile(lat, 0.99)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--spin-us", type=float, default=200.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    spin = args.spin_us * 1e-6
    cases = [
        ("both block (as broker and client do)", 0.0, 0.0, False),
        ("client busy-polls, server blocks", spin, 0.0, False),
        ("client blocks, server busy-polls", 0.0, spin, False),
        ("both busy-poll (no CPU idles)", spin, spin, False),
        ("both block, pinned to one CPU", 0.0, 0.0, True),
    ]
    rows = []
    for name, cs, ss, same in cases:
        if same and len(os.sched_getaffinity(0)) < 2:
            continue
        runs = [measure(args.iters, cs, ss, same) for _ in range(args.runs)]
        p50, p99 = median(r[0] for r in runs), median(r[1] for r in runs)
        rows.append([name, f"{p50 * 1e6:.1f}", f"{p99 * 1e6:.1f}"])
    print(
        f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; Unix-socket round trip "
        f"between two processes, median of {args.runs} runs of {args.iters} (microseconds)\n"
    )
    print(table(["arrangement", "p50 us", "p99 us"], rows))


if __name__ == "__main__":
    main()
