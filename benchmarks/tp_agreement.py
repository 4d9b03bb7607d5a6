"""What the TP agreement on failed loads costs per engine step (issue 31, item 2).

Every rank of a TP group runs the same step; in a step with loads, the worker
connector ORs the ranks' failures with one max all-reduce of an int32 per loaded item
on the TP group's CPU (gloo) group (``connector/tp_agree.py``). This runs that very
collective between ``--ranks`` real processes over gloo on loopback, ``--steps``
times per size, and prints per-step median and p99 in microseconds, and the ratio to
the 50 µs target of issue 31. The ranks enter each step together (a barrier first):
the figure is the agreement itself, not a rank's lateness.

    python benchmarks/tp_agreement.py [--ranks 2] [--steps 2000] [--loads 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, percentile, table  # noqa: E402

TARGET_US = 50.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, steps: int, loads: list[int], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    results = {}
    for n in loads:
        samples = []
        for step in range(steps + steps // 10):  # the first tenth warms up
            failed = {0} if (rank == 0 and step % 7 == 0) else set()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            flags = torch.tensor([int(i in failed) for i in range(n)], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            agreed = {i for i, f in enumerate(flags.tolist()) if f}
            t1 = time.perf_counter()
            assert agreed == ({0} if step % 7 == 0 else set())
            if step >= steps // 10:
                samples.append((t1 - t0) * 1e6)
        results[n] = samples
    if rank == 0:
        out.update({str(n): v for n, v in results.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--loads", default="1,4,16", help="items loaded per step")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    loads = [int(x) for x in args.loads.split(",")]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(
            _rank,
            args=(args.ranks, _free_port(), args.steps, loads, out),
            nprocs=args.ranks,
            join=True,
        )
        results = {int(k): list(v) for k, v in out.items()}
    rows, figures = [], {}
    for n in loads:
        med, p99 = median(results[n]), percentile(results[n], 99)
        figures[n] = {"median_us": med, "p99_us": p99, "median_vs_target": med / TARGET_US}
        rows.append([n, f"{med:.1f}", f"{p99:.1f}", f"{med / TARGET_US:.1f}x"])
    print(
        f"TP agreement (gloo all-reduce, {args.ranks} ranks, {args.steps} steps, "
        f"{os.cpu_count()} CPUs; target {TARGET_US:.0f} us)"
    )
    print(table(["loads/step", "median us", "p99 us", "median / target"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "steps": args.steps, "loads": figures}, f, indent=1)


if __name__ == "__main__":
    main()
