"""How long a process's threads wait on the run queue: runnable, not running.

Reads ``/proc/<pid>/task/*/schedstat`` (time on the CPU, time runnable but waiting,
time slices) every ``--interval`` seconds for every process whose command line holds
``--match`` (default: brokers), and prints, at the end, the wait per time slice and
the wait per interval (p50 / p90 / max). A broker that waits long per slice while it
runs little is starved, not busy (docs/performance.md, "The broker's CPU group").

    chrt -f 50 .venv/bin/python benchmarks/runqueue_wait.py --seconds 300 &
    .venv/bin/python benchmarks/dedup_vllm.py --setups node --instances 4

``chrt -f 50`` (root) keeps the sampler itself on time on a loaded host.
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path


def matching(pattern: bytes) -> list[int]:
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if pattern in Path(path).read_bytes():
                pids.append(int(path.split("/")[2]))
        except OSError:
            continue
    return pids


def schedstat(pid: int) -> dict[int, tuple[int, int, int]]:
    """Per thread: (ns on the CPU, ns runnable and waiting, time slices)."""
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            run, wait, slices = map(int, Path(path).read_text().split())
        except (OSError, ValueError):
            continue
        out[int(path.split("/")[4])] = (run, wait, slices)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default="lmcache_ec_broker.cli\0start", help="command-line bytes to match")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--interval", type=float, default=0.1)
    args = ap.parse_args()
    pattern = args.match.encode().replace(b"\\0", b"\0")
    last: dict[tuple[int, int], tuple[int, int, int]] = {}
    run_ms = wait_ms = 0.0
    slices = 0
    per_interval: list[float] = []  # ms waited per interval, per process, where it ran or waited
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for pid in matching(pattern):
            waited = 0.0
            active = False
            for tid, now in schedstat(pid).items():
                before = last.get((pid, tid))
                last[(pid, tid)] = now
                if before is None:
                    continue
                d_run, d_wait, d_slices = (a - b for a, b in zip(now, before, strict=True))
                run_ms += d_run / 1e6
                wait_ms += d_wait / 1e6
                slices += d_slices
                waited += d_wait / 1e6
                active = active or d_run > 0 or d_wait > 0
            if active:
                per_interval.append(waited)
        time.sleep(args.interval)
    print(
        f"processes matching {args.match!r}: {run_ms:.0f} ms on the CPU, {wait_ms:.0f} ms waiting "
        f"runnable, {slices} time slices; wait per slice {wait_ms / max(slices, 1):.2f} ms; "
        f"wait per {args.interval * 1000:.0f} ms interval (intervals with activity: "
        f"{len(per_interval)}) p50 {pct(per_interval, 0.5):.1f} p90 {pct(per_interval, 0.9):.1f} "
        f"max {max(per_interval, default=0.0):.1f} ms"
    )


if __name__ == "__main__":
    main()
