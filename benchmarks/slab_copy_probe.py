"""Probe: the client's slab copy against memcpy, warm and after the memory idled.

One process, a real broker. For each size it reserves an entry, waits --gaps
seconds, then times, back to back: memcpy of the source tensor into a private
buffer, the client's slab write of the same tensor into the reserved extents
(what ``put`` does between its reserve and commit), and both again. The first
pair shows the cost of touching memory that idled; the second pair the copy
itself. The source tensor and the private buffer are reused, like the slab
blocks (each entry is deleted before the next is reserved).

    .venv/bin/python benchmarks/slab_copy_probe.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import Broker, fmt_size, median, parse_sizes, table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="34MiB,130MiB")
    p.add_argument("--gaps", default="0,0.5", help="idle seconds before each measurement")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.protocol import Commit, Reserve

    sizes = parse_sizes(args.sizes)
    gaps = [float(g) for g in args.gaps.split(",")]
    rows = []
    with Broker(2 * max(sizes) + (64 << 20)) as broker:
        client = BrokerClient(broker.socket_path, timeout_s=60)
        slab = client._slab_view()  # the view put() copies through
        for size in sizes:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            for gap in gaps:
                t: dict[str, list[float]] = {k: [] for k in ("m1", "s1", "m2", "s2")}
                for i in range(args.reps):
                    key = f"probe-{size}-{gap}-{i}"
                    r = client._call(Reserve(key, size, "uint8", [size]))
                    time.sleep(gap)
                    for a, b in (("m1", "s1"), ("m2", "s2")):
                        t0 = time.perf_counter()
                        ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)
                        t1 = time.perf_counter()
                        slab.write(r.extents, src)
                        t2 = time.perf_counter()
                        t[a].append(t1 - t0)
                        t[b].append(t2 - t1)
                    client._call(Commit(r.token))
                    client.delete(key)
                g = {k: size / median(v) / 1e9 for k, v in t.items()}
                rows.append([
                    fmt_size(size), f"{gap:g}",
                    f"{g['m1']:.2f}", f"{g['s1']:.2f} ({g['s1'] / g['m1']:.2f}x)",
                    f"{g['m2']:.2f}", f"{g['s2']:.2f} ({g['s2'] / g['m2']:.2f}x)",
                ])  # fmt: skip
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


if __name__ == "__main__":
    main()
