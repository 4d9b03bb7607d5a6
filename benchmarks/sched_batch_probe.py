"""Probe: does the broker, woken by a posted Place, run inside the writer's send?

A put through the put arena waits for nothing, yet attribution.py shows its ``send``
(the time inside ``sendall`` of the Place frame) at 100+ µs for 2 MiB entries: the
kernel wakes the broker on the writer's CPU and the broker preempts the writer for
its whole handling of the Place. A task whose policy is SCHED_BATCH is never woken
into preempting another (Linux: wakeup preemption applies to SCHED_NORMAL only), so
the same broker with its threads SCHED_BATCH (``chrt -a -b -p 0``, no privilege
needed) separates the two: if ``send`` drops, the broker was running inside it.

One client process (this one) against two brokers alternately, normal and
SCHED_BATCH: puts (arena path, key deleted after each, 1 ms apart) and a leased
has() (a round trip the broker must answer: a policy that delayed the broker would
show there). p50s per round, µs, and the has()'s p99: the tail a policy that delays
the broker would lengthen. ``--hogs N`` runs N CPU-bound processes beside it (each in a
session of its own, so autogroup weighs each as the broker: every CPU busy at N = CPUs).

    .venv/bin/python benchmarks/sched_batch_probe.py
    .venv/bin/python benchmarks/sched_batch_probe.py --hogs 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    die_with_parent,
    median,
    parse_sizes,
    table,
)


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="64KiB,2MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside the probe")
    args = p.parse_args()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent,
                         start_new_session=True)
        for _ in range(args.hogs)
    ]  # fmt: skip
    try:
        _probe(args)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def _probe(args: argparse.Namespace) -> None:
    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.connector.client import frames

    sends: list[float] = []
    inner = frames.Wire.send_posted

    def timed(self: frames.Wire, data: bytes, n: int) -> None:
        t0 = time.perf_counter_ns()
        try:
            inner(self, data, n)
        finally:
            sends.append((time.perf_counter_ns() - t0) / 1e3)

    frames.Wire.send_posted = timed  # type: ignore[method-assign]
    rows = []
    load = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        for size in parse_sizes(args.sizes):
            got = {}
            for policy in ("normal", "SCHED_BATCH") if rnd % 2 == 0 else ("SCHED_BATCH", "normal"):
                with Broker(256 * MiB) as b:
                    if policy == "SCHED_BATCH":
                        cmd = ["chrt", "-a", "-b", "-p", "0", str(b.proc.pid)]
                        subprocess.run(cmd, check=True)
                    c = BrokerClient(b.socket_path, timeout_s=60)
                    r = BrokerClient(b.socket_path, timeout_s=60)
                    g = torch.Generator().manual_seed(size)
                    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
                    t = raw.view(torch.bfloat16).reshape(-1, 1024)
                    assert c.put("warm", torch.zeros(8)) and c.delete("warm") and c.flush()
                    sends.clear()
                    puts, has = [], []
                    for i in range(args.iters):
                        k = f"k{i}"
                        t0 = time.perf_counter_ns()
                        assert c.put(k, t)
                        puts.append((time.perf_counter_ns() - t0) / 1e3)
                        time.sleep(0.001)
                        t0 = time.perf_counter_ns()
                        assert r.has([k], lease_ms=1000) == [True]
                        has.append((time.perf_counter_ns() - t0) / 1e3)
                        c.delete(k)
                    skip = args.iters // 10
                    got[policy] = (
                        median(puts[skip:]), median(sends[skip:]), median(has[skip:]),
                        _p99(has[skip:]),
                    )  # fmt: skip
                    c.close()
                    r.close()
                load.append(os.getloadavg()[0])
            n, bt = got["normal"], got["SCHED_BATCH"]
            rows.append([rnd, f"{size >> 10} KiB", f"{n[0]:.1f}", f"{bt[0]:.1f}", f"{n[1]:.1f}",
                         f"{bt[1]:.1f}", f"{n[2]:.1f}", f"{bt[2]:.1f}", f"{n[3]:.0f}", f"{bt[3]:.0f}",
                         f"{n[0] / bt[0]:.2f}x"])  # fmt: skip
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load (1 min) "
        f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs, {args.hogs} CPU-bound "
        "processes beside it; p50s (and has()'s p99), µs\n"
    )
    print(table(["round", "size", "put normal", "put batch", "send normal", "send batch",
                 "has(lease) normal", "has(lease) batch", "has p99 normal", "has p99 batch",
                 "put normal / batch"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
