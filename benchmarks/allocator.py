"""Benchmark: block allocation time on a large, fragmented slab (issue 10 item 13).

The allocator runs on the broker's event loop for every put and promotion, so
its worst case matters more than its average. The default models an 8 GiB slab
of 64 KiB blocks (131072 blocks): it is filled with entries of mixed sizes
(64 KiB .. 128 MiB, most small), a random half is freed,
then a steady churn of allocate/free runs while every allocate and free is timed.
The slab is filled with small entries (1-4 blocks) before a random half is freed,
which leaves tens of thousands of free runs; the churn then asks for the mixed
sizes, many of which no single run holds.

    .venv/bin/python benchmarks/allocator.py
    .venv/bin/python benchmarks/allocator.py --impl-path /path/to/old/checkout  # compare

``--impl-path`` imports ``lmcache_ec_broker`` from another checkout (e.g. an
older commit unpacked with ``git archive``) to compare implementations on the
same workload and seed. Times are the calling thread's CPU time per call
(``time.thread_time``), so other load on the machine does not inflate them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CPU time of this thread: on a shared machine wall-clock percentiles measure the
# scheduler (a preempted call looks 30 ms slow), not the allocator.
_now = time.thread_time


def sizes(rng: random.Random, n: int) -> list[int]:
    """Entry sizes in blocks: 70% small (1-16), 25% medium (17-256), 5% large (257-2048)."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.70:
            out.append(rng.randint(1, 16))
        elif r < 0.95:
            out.append(rng.randint(17, 256))
        else:
            out.append(rng.randint(257, 2048))
    return out


def run(nblocks: int, ops: int, seed: int) -> dict[str, float]:
    from lmcache_ec_broker.shm.allocator import BlockAllocator

    rng = random.Random(seed)
    alloc = BlockAllocator(nblocks)
    held: list[list[tuple[int, int]]] = []
    while True:  # fill with small entries (1-4 blocks): the worst fragmentation
        runs = alloc.allocate(rng.randint(1, 4))
        if runs is None:
            break
        held.append(runs)
    rng.shuffle(held)
    for runs in held[: len(held) // 2]:  # fragment: free a random half
        alloc.free(runs)
    held = held[len(held) // 2 :]
    fragmented_runs = alloc.free_runs
    t_alloc: list[float] = []
    t_free: list[float] = []
    multi = 0
    for n in sizes(rng, ops):
        n = min(n, nblocks // 2)  # a tiny slab (smoke runs) still churns
        while alloc.free_blocks < n:  # make room (untimed): the store evicts first
            i = rng.randrange(len(held))
            held[i], held[-1] = held[-1], held[i]
            alloc.free(held.pop())
        t0 = _now()
        runs = alloc.allocate(n)
        t_alloc.append(_now() - t0)
        assert runs is not None
        multi += len(runs) > 1
        held.append(runs)
        i = rng.randrange(len(held))
        held[i], held[-1] = held[-1], held[i]
        victim = held.pop()
        t0 = _now()
        alloc.free(victim)
        t_free.append(_now() - t0)
    t_alloc.sort()
    t_free.sort()

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6

    return {
        "free_runs_after_fragmenting": fragmented_runs,
        "free_runs_at_end": alloc.free_runs,
        "alloc_p50_us": pct(t_alloc, 0.50),
        "alloc_p99_us": pct(t_alloc, 0.99),
        "alloc_max_us": t_alloc[-1] * 1e6,
        "free_p50_us": pct(t_free, 0.50),
        "free_p99_us": pct(t_free, 0.99),
        "multi_run_allocations": multi,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slab", default="8GiB", help="slab size (default 8GiB)")
    ap.add_argument("--block", default="64KiB", help="block size (default 64KiB)")
    ap.add_argument("--ops", type=int, default=20000, help="timed allocate+free pairs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--impl-path", help="import lmcache_ec_broker from this checkout instead")
    args = ap.parse_args()
    sys.path.insert(0, args.impl_path or REPO)
    import lmcache_ec_broker
    from lmcache_ec_broker.sizes import parse_size

    nblocks = parse_size(args.slab, 1) // parse_size(args.block, 1)
    res = run(nblocks, args.ops, args.seed)
    print(f"allocator from {os.path.dirname(lmcache_ec_broker.__file__)}")
    print(f"slab {args.slab} / blocks {args.block} = {nblocks} blocks, {args.ops} timed ops")
    for k, v in res.items():
        print(f"  {k:30s} {v:12.1f}" if isinstance(v, float) else f"  {k:30s} {v:12d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
