"""What the TP agreement on failed loads costs per engine step (issue 31, item 2).

Every rank of a TP group runs the same step; in a step with loads, the worker
connector ORs the ranks' failures (``connector/tp_agree.py``). Two ways, both run
here between ``--ranks`` real processes, ``--steps`` times per size, in the same run:

- ``collective``: one max all-reduce of an int32 per loaded item on a gloo group over
  loopback (the old path; still the path of a TP group spread over several hosts);
- ``shared-memory``: the per-step slots of ``connector/tp_shm.py`` (every rank on
  one host: the path vLLM's TP groups take now), set up by ``setup_agreement``.

A step's cost is what the agreement adds to the step: from the last rank's arrival
to the last rank's return (all ranks read the same monotonic clock). The ranks enter
each step together (a gloo barrier first), but a barrier releases them some
microseconds apart, and a rank that arrives early waits for the others whatever the
agreement: that skew is the model's, not the agreement's, so it is left out (each
rank's own time in the call, skew included, is in the JSON as ``in_call``). It prints
per path the median and p99 in microseconds, the ratio old/new, and the
shared-memory median against the 50 µs target of issue 31. Rank 0 fails item 0
every 7th step, so the union is checked every step.

    python benchmarks/tp_agreement.py [--ranks 2] [--steps 2000] [--loads 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, percentile, table  # noqa: E402

TARGET_US = 50.0
PATHS = ("collective", "shared-memory")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for every process


def _costs(
    per_rank: list[list[tuple[int, int]]],
) -> tuple[list[float], list[float], list[float]]:
    """Per step (us): last arrival -> last return; the last arriver's own time in the
    call (the protocol's work, no waiting); every rank's time in the call."""
    cost, last, in_call = [], [], []
    for step in zip(*per_rank, strict=True):
        cost.append((max(t1 for _, t1 in step) - max(t0 for t0, _ in step)) / 1e3)
        t0, t1 = max(step)
        last.append((t1 - t0) / 1e3)
        in_call += [(t1 - t0) / 1e3 for t0, t1 in step]
    return cost, last, in_call


def _rank(rank: int, world: int, port: str, steps: int, loads: list[int], out: dict) -> None:
    from lmcache_ec_broker.connector.tp_agree import CollectiveAgreement, setup_agreement

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    local = setup_agreement(group, rank, world, 0, wait_s=30.0)
    assert local.kind == "shared-memory", local.kind
    agreements = {"collective": CollectiveAgreement(group), "shared-memory": local}
    for n in loads:
        hashes = [f"{i:064x}" for i in range(n)]
        for path in PATHS:
            agreement = agreements[path]
            samples = []
            for step in range(steps + steps // 10):  # the first tenth warms up
                failed = {hashes[0]} if (rank == 0 and step % 7 == 0) else set()
                dist.barrier(group=group)
                t0 = _now_ns()
                agreed = agreement.union(hashes, failed)
                t1 = _now_ns()
                assert agreed == ({hashes[0]} if step % 7 == 0 else set()), (path, step, agreed)
                if step >= steps // 10:
                    samples.append((t0, t1))
            out[f"{path}/{n}/{rank}"] = samples
    if rank == 0:
        out["aborts"] = local.shared.aborts
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
        results = dict(out)
    rows, figures = [], {}
    for n in loads:
        per: dict[str, dict[str, float]] = {}
        for path in PATHS:
            xs, last, in_call = _costs(
                [list(results[f"{path}/{n}/{r}"]) for r in range(args.ranks)]
            )
            med = median(xs)
            per[path] = {
                "median_us": med,
                "p99_us": percentile(xs, 99),
                "median_vs_target": med / TARGET_US,
                "last_arriver_median_us": median(last),
                "in_call": {"median_us": median(in_call), "p99_us": percentile(in_call, 99)},
            }
        old, new = per["collective"], per["shared-memory"]
        ratio = old["median_us"] / new["median_us"]
        figures[n] = {**per, "old_over_new": ratio}
        rows.append(
            [
                n,
                f"{old['median_us']:.1f}",
                f"{old['p99_us']:.1f}",
                f"{new['median_us']:.1f}",
                f"{new['p99_us']:.1f}",
                f"{new['last_arriver_median_us']:.1f}",
                f"{ratio:.1f}x",
                f"{new['median_vs_target']:.2f}x",
            ]
        )
    print(
        "TP agreement: cost per step with loads, last arrival -> last return "
        f"({args.ranks} ranks, {args.steps} steps, "
        f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}; target {TARGET_US:.0f} us; "
        f"shared-memory timeouts: {results['aborts']})"
    )
    print(
        table(
            [
                "loads/step",
                "collective median us",
                "collective p99 us",
                "shm median us",
                "shm p99 us",
                "shm last arriver us",
                "collective / shm",
                "shm median / target",
            ],
            rows,
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": args.ranks,
                    "steps": args.steps,
                    "load_avg": os.getloadavg()[0],
                    "shared_memory_timeouts": results["aborts"],
                    "loads": figures,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
