"""Probe: how this host's copy bandwidth depends on idleness and on where bytes go.

Copies 34 MiB with memcpy (``ctypes.memmove``, the routine the client uses)
between private buffers and into a POSIX shared-memory segment (same offset;
rotating offsets over 1 GiB), then again after 3 s of idleness. It separates
the broker's own costs from the machine's (on the Firecracker VMs this project
is built on, memory left alone for about a second is much slower to touch
again): see docs/performance.md,
"What this VM does to copies and round trips".

    .venv/bin/python benchmarks/idle_memcpy_probe.py
    .venv/bin/python benchmarks/idle_memcpy_probe.py --region 64MiB --nbytes 4MiB --idle 0.2  # smoke
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable

import posix_ipc
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_size, parse_sizes  # noqa: E402

_MADV_POPULATE_WRITE = 23


def gbps(copy: Callable[[], None], nbytes: int, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def rotating(base: int, src: int, nbytes: int, region: int) -> Callable[[], None]:
    offset = [0]

    def copy() -> None:
        ctypes.memmove(base + offset[0], src, nbytes)
        offset[0] = (offset[0] + nbytes) % (region - nbytes)

    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nbytes", default="34MiB", help="size of each copy")
    ap.add_argument("--region", default="1GiB", help="the rotating copies' region")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idleness")
    args = ap.parse_args()
    (nbytes,) = parse_sizes(args.nbytes)
    (region,) = parse_sizes(args.region)
    if region < 2 * nbytes:
        raise SystemExit("--region must hold at least two copies")
    name = f"/ecb-idle-probe-{os.getpid()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=region)
    try:
        mm = mmap.mmap(shm.fd, region)
        shm.close_fd()
        mm.madvise(_MADV_POPULATE_WRITE)
        slab = torch.frombuffer(mm, dtype=torch.uint8)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.ones(nbytes, dtype=torch.uint8)
        private = torch.ones(region, dtype=torch.uint8)
        s, d, b, p = src.data_ptr(), dst.data_ptr(), slab.data_ptr(), private.data_ptr()
        copy_d = lambda: ctypes.memmove(d, s, nbytes)  # noqa: E731
        over = f"{region >> 30} GiB" if region % (1 << 30) == 0 else fmt_size(region)
        rows = [
            ("private -> private, same buffer", gbps(copy_d, nbytes)),
            ("private -> shm, same offset", gbps(lambda: ctypes.memmove(b, s, nbytes), nbytes)),
            (f"private -> shm, rotating over {over}", gbps(rotating(b, s, nbytes, region), nbytes, 25)),
            (f"private -> private, rotating over {over}", gbps(rotating(p, s, nbytes, region), nbytes, 25)),
        ]
        idle = f"{args.idle:g} s idle"
        time.sleep(args.idle)
        rows.append(
            (f"shm same offset, after {idle}", gbps(lambda: ctypes.memmove(b, s, nbytes), nbytes, 1))
        )
        rows.append((f"private same buffer, after {idle}", gbps(copy_d, nbytes, 1)))
        time.sleep(args.idle / 3)
        rows.append(
            (f"private same buffer, first copy after {args.idle / 3:.2g} s idle", gbps(copy_d, nbytes, 1))
        )
        rows.append(("the same copy again, back to back", gbps(copy_d, nbytes, 1)))
        fresh = mmap.mmap(-1, nbytes)  # never touched: every page faults in
        f = torch.frombuffer(fresh, dtype=torch.uint8).data_ptr()
        rows.append(
            ("private -> never-touched memory", gbps(lambda: ctypes.memmove(f, s, nbytes), nbytes, 1))
        )
        print(f"| copy of {fmt_size(nbytes)} | GB/s |\n|---|---|")
        for label, rate in rows:
            print(f"| {label} | {rate:.2f} |")
        del slab
        mm.close()
    finally:
        posix_ipc.unlink_shared_memory(name)


if __name__ == "__main__":
    main()
