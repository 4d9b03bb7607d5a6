"""A worker step's put while the staging thread copies entries out of the slab: one
client shared by both threads (before b85f49b) against a client each (the connector now,
connector/vllm/process_clients.py), and the put alone, in one run.

    .venv/bin/python benchmarks/step_put_under_staging.py [--puts 200] [--put-size 2MiB]
        [--stage-size 32MiB]

A real broker (the CLI). A staging thread reads ``--stage-size`` entries into new
tensors back to back (what a worker's staging thread does for a burst of hits: the
client's ``get_many``, whose lock is held through each copy); the main thread (the
model runner's) puts a new ``--put-size`` entry every ``--gap-ms`` (a step's encoder
output) and times each put. On a shared client a put waits for the copy in progress;
on its own client it waits for nothing. Reported per case: the put's p50, p90 and
max, and p50 and p90 against the put alone (same run). Not a timed test: the figures go
to docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import Broker, MiB, fmt_size, median, parse_sizes, percentile, table  # noqa: E402


def _stage_loop(
    client, keys: list[str], stop: threading.Event, copies: list[int], failed: list[BaseException]
) -> None:
    """The staging thread: ``keys`` read into new tensors in turn until ``stop``; a
    failure lands in ``failed`` (reported by the main thread, not lost in this one)."""
    n = 0
    try:
        while not stop.is_set():
            key = keys[n % len(keys)]
            (got,) = client.get_many([key])
            if got is None:
                raise RuntimeError(f"staging read of {key} missed")
            copies[0] += 1
            n += 1
    except BaseException as exc:
        failed.append(exc)


def _puts(client, torch, tag: str, args: argparse.Namespace) -> list[float]:
    t = torch.randint(0, 255, (args.put_size,), dtype=torch.uint8)
    out = []
    for i in range(args.puts):
        time.sleep(args.gap_ms / 1000)
        t0 = time.perf_counter()
        if not client.put(f"step-{tag}-{i}", t):
            raise RuntimeError("a step's put was not stored")
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--puts", type=int, default=200)
    ap.add_argument("--put-size", default="2MiB")
    ap.add_argument("--stage-size", default="32MiB")
    ap.add_argument("--stage-entries", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    args = ap.parse_args()
    (args.put_size,) = parse_sizes(args.put_size)
    (args.stage_size,) = parse_sizes(args.stage_size)

    import torch

    from lmcache_ec_broker import BrokerClient

    slab = args.stage_size * args.stage_entries + 3 * args.put_size * args.puts + 256 * MiB
    rows: list[list[str]] = []
    alone = (1.0, 1.0)
    with Broker(slab) as broker:
        seed = BrokerClient(broker.socket_path)
        big = torch.randint(0, 255, (args.stage_size,), dtype=torch.uint8)
        keys = [f"staged-{i}" for i in range(args.stage_entries)]
        for key in keys:
            if not seed.put(key, big):
                raise RuntimeError(f"could not store {key}")
        seed.close()
        for case in ("put alone", "shared client", "a client each"):
            step = BrokerClient(broker.socket_path)
            own = [step] + ([BrokerClient(broker.socket_path)] if case == "a client each" else [])
            for c in own:  # mapped and holding a put arena before the clock runs
                warm = f"warm-{case}-{id(c)}"
                c.put(warm, torch.zeros(8))
                c.get(warm)
            stop, copies, failed = threading.Event(), [0], []
            thread = None
            if case != "put alone":
                stager = own[-1]  # the step's own client when shared
                thread = threading.Thread(
                    target=_stage_loop, args=(stager, keys, stop, copies, failed), name="staging"
                )
                thread.start()
            try:
                times = _puts(step, torch, case.replace(" ", "-"), args)
            finally:
                stop.set()
                if thread is not None:
                    thread.join(60)
            if failed:
                raise failed[0]
            us = sorted(x * 1e6 for x in times)
            p50, p90 = median(us), percentile(us, 0.9)
            if case == "put alone":
                alone = (p50, p90)
            rows.append([
                case, f"{p50:.0f}", f"{p90:.0f}", f"{us[-1]:.0f}",
                f"{p50 / alone[0]:.1f}x", f"{p90 / alone[1]:.1f}x", str(copies[0]),
            ])  # fmt: skip
            for c in own:
                c.close()
    src = torch.randint(0, 255, (args.stage_size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    gbps = 5 * args.stage_size / (time.perf_counter() - t0) / 1e9
    print(
        f"A step's {fmt_size(args.put_size)} put every {args.gap_ms:g} ms while a staging "
        f"thread reads {fmt_size(args.stage_size)} entries back to back "
        f"({args.puts} puts per case; {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; memcpy {gbps:.1f} GB/s)\n"
    )
    heads = ["case", "put p50 us", "p90 us", "max us", "p50 vs alone", "p90 vs alone"]
    print(table([*heads, "staging reads"], rows))
    print("\n(each client mapped the slab and made one put before its case's clock started)")


if __name__ == "__main__":
    main()
