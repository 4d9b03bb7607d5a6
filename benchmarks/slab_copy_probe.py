"""Probe: the client's slab copy against memcpy, warm and after the memory idled.

One process, a real broker. For each size it reserves an entry, waits --gaps
seconds, then times, back to back: memcpy of the source tensor into a private
buffer, the client's slab write of the same tensor into the reserved extents
(what ``put`` does between its reserve and commit), and both again. The first
pair shows the cost of touching memory that idled; the second pair the copy
itself. The source tensor and the private buffer are reused, like the slab
blocks (each entry is deleted before the next is reserved).

A second table asks what bounds a put's copy at the sizes of real entries
(``--rotate-sizes``): a put writes into slab blocks nobody touched recently,
not into a reused buffer, so the fair floor is memcpy into *rotating*
destinations over a region larger than the last-level cache. Per size, the
median time of ``--copies`` copies (µs) of one source tensor into:

- one reused private buffer (what "bare memcpy" in transfer.py/attribution.py
  measures: source and destination stay in cache);
- rotating offsets of a private buffer of ``--region`` bytes written just
  before (faulted in, out of cache), and the same after ``--idle`` seconds
  untouched (the VM's idle-memory penalty);
- rotating offsets of a populated POSIX shared-memory mapping of the same size
  (the slab's kind of memory: a tmpfs file, 4 KiB pages), fresh and idle;
- the slab itself, as ``put`` writes it: each copy into a newly reserved entry
  (fresh blocks, untouched since the broker prefaulted them at start), and
  ``get_into``'s read of such an entry into a reused tensor.

    .venv/bin/python benchmarks/slab_copy_probe.py
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import Broker, fmt_size, median, parse_sizes, table  # noqa: E402

_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the whole mapping in, writable


def _median_us(copy: Callable[[int], None], copies: int) -> float:
    times = []
    for i in range(copies):
        t0 = time.perf_counter()
        copy(i)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e6


def _rotating(base: int, src: int, size: int, region: int) -> Callable[[int], None]:
    slots = max(1, region // size)
    return lambda i: ctypes.memmove(base + (i % slots) * size, src, size)


def floors(client: Any, size: int, region: int, copies: int, idle: float) -> list[str]:
    """One row of the rotating-destination table (see the module docstring)."""
    import posix_ipc
    import torch

    from lmcache_ec_broker.protocol import Commit, Get, Release, Reserve

    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    sp = src.data_ptr()
    dst = torch.zeros_like(src)
    hot = _median_us(lambda i: ctypes.memmove(dst.data_ptr(), sp, size), copies)
    private = torch.ones(region, dtype=torch.uint8)  # written: faulted in, then out of cache
    priv = _rotating(private.data_ptr(), sp, size, region)
    name = f"/ecb-slab-probe-{os.getpid()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=region)
    try:
        mm = mmap.mmap(shm.fd, region)
        shm.close_fd()
        mm.madvise(_MADV_POPULATE_WRITE)
        shared = torch.frombuffer(mm, dtype=torch.uint8)
        shm_copy = _rotating(shared.data_ptr(), sp, size, region)
        ctypes.memset(private.data_ptr(), 1, region)
        ctypes.memset(shared.data_ptr(), 1, region)
        priv_fresh, shm_fresh = _median_us(priv, copies), _median_us(shm_copy, copies)
        time.sleep(idle)
        priv_idle = _median_us(priv, copies)
        time.sleep(idle)
        shm_idle = _median_us(shm_copy, copies)
        del shared
        mm.close()
    finally:
        posix_ipc.unlink_shared_memory(name)
    del private
    slab = client.slab()
    tokens, extents = [], []
    for i in range(copies):
        r = client.request(Reserve(f"floor-{size}-{i}", size, "uint8", [size]))
        tokens.append(r.token)
        extents.append(r.extents)
    put_copy = _median_us(lambda i: slab.write(extents[i], src), copies)
    for token in tokens:
        client.request(Commit(token))
    pins, reads = [], []
    for i in range(copies):  # the Get outside the timing, the copy inside
        hit = client.request(Get([f"floor-{size}-{i}"])).items[0]
        pins.append(hit.pin)
        t0 = time.perf_counter()
        slab.read_into(hit.extents, dst)
        reads.append(time.perf_counter() - t0)
    client.request(Release(pins))
    client.delete_many([f"floor-{size}-{i}" for i in range(copies)])
    return [
        fmt_size(size),
        f"{hot:.1f}",
        f"{priv_fresh:.1f}",
        f"{priv_idle:.1f}",
        f"{shm_fresh:.1f}",
        f"{shm_idle:.1f}",
        f"{put_copy:.1f}",
        f"{median(reads) * 1e6:.1f}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="34MiB,130MiB")
    p.add_argument("--gaps", default="0,0.5", help="idle seconds before each measurement")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rotate-sizes", default="64KiB,2MiB", help="'' skips the table")
    p.add_argument("--region", default="256MiB", help="bytes the rotating copies cycle over")
    p.add_argument("--copies", type=int, default=64, help="copies per rotating measurement")
    p.add_argument("--idle", type=float, default=2.0, help="seconds left idle (rotating)")
    args = p.parse_args()
    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.protocol import Commit, Reserve

    sizes = parse_sizes(args.sizes)
    rotate = parse_sizes(args.rotate_sizes)
    region = parse_sizes(args.region)[0]
    gaps = [float(g) for g in args.gaps.split(",")]
    rows, floor_rows = [], []
    slab_bytes = max(2 * max(sizes), *(args.copies * (s + (64 << 10)) for s in rotate or [0]))
    shm_mib = -(-(slab_bytes + (64 << 20)) // (1 << 20))
    # The floors hold --copies reservations open at once across most of the slab, on
    # purpose: lift the per-connection reservation cap (a quarter of the slab by default).
    cap = ("--max-reserved-per-connection", f"{shm_mib}MiB")
    with Broker(shm_mib << 20, extra=cap) as broker:
        client = BrokerClient(broker.socket_path, timeout_s=60)
        slab = client.slab()  # the view put() copies through
        for size in sizes:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            for gap in gaps:
                t: dict[str, list[float]] = {k: [] for k in ("m1", "s1", "m2", "s2")}
                for i in range(args.reps):
                    key = f"probe-{size}-{gap}-{i}"
                    r = client.request(Reserve(key, size, "uint8", [size]))
                    time.sleep(gap)
                    for a, b in (("m1", "s1"), ("m2", "s2")):
                        t0 = time.perf_counter()
                        ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)
                        t1 = time.perf_counter()
                        slab.write(r.extents, src)
                        t2 = time.perf_counter()
                        t[a].append(t1 - t0)
                        t[b].append(t2 - t1)
                    client.request(Commit(r.token))
                    client.delete(key)
                g = {k: size / median(v) / 1e9 for k, v in t.items()}
                rows.append([
                    fmt_size(size), f"{gap:g}",
                    f"{g['m1']:.2f}", f"{g['s1']:.2f} ({g['s1'] / g['m1']:.2f}x)",
                    f"{g['m2']:.2f}", f"{g['s2']:.2f} ({g['s2'] / g['m2']:.2f}x)",
                ])  # fmt: skip
        for size in rotate:
            floor_rows.append(floors(client, size, region, args.copies, args.idle))
        client.close()
    print(
        f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; GB/s, median of "
        f"{args.reps}; ratio = slab write / memcpy into a private buffer, same moment\n"
    )
    print(
        table(
            [
                "size",
                "idle s",
                "memcpy (first)",
                "slab write (first)",
                "memcpy (again)",
                "slab write (again)",
            ],
            rows,
        )
    )
    if floor_rows:
        print(
            f"\nput's copy against memcpy floors, µs (median of {args.copies}); rotating "
            f"destinations cycle over {fmt_size(region)}; idle = after {args.idle:g} s untouched\n"
        )
        print(
            table(
                [
                    "size",
                    "memcpy reused dst",
                    "rotating private",
                    "rotating private idle",
                    "rotating shm",
                    "rotating shm idle",
                    "slab write (put)",
                    "slab read (get_into)",
                ],
                floor_rows,
            )
        )


if __name__ == "__main__":
    main()
