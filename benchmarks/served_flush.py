"""What the Served flusher (connector/client/served_flush.py) costs on the hot path, and how
soon an idle client's index hit reaches the broker (issue 30, item 1).

    .venv/bin/python benchmarks/served_flush.py              # ~1 minute
    .venv/bin/python benchmarks/served_flush.py --iters 300 --rounds 1 --trials 3  # smoke
    .venv/bin/python benchmarks/served_flush.py --iters 300 --gap-ms 5  # calls 5 ms apart

A real broker (the CLI) and, in this process, two clients of it: one made with the
flusher disabled (``index_path.SERVED_FLUSH_S = None``: no arm, no thread; the
Served frame goes only ahead of a request or alone after 64 items / 5 ms, the
old behaviour) and one with it (50 ms). Rounds alternate off/on so both see the
same machine. Per op, ``--iters`` calls timed one by one with perf_counter_ns
after 200 of warm-up: has() hit and get()/get_into() of a 64 KiB entry, all
answered from the residency index (the path that notes Served items). Printed:
p10 / p50 / mean in us per mode, the median over rounds of each, and what the calls
cost the broker: its wake-ups (voluntary context switches) and CPU time per call.
``--gap-ms`` sleeps that long before each call (a worker between steps): a client's
batch is then older than 5 ms at every call, which the flusher-off client answers with
a send per call (and, before issue 42's change, the flusher-on client too).

Then the delay: ``--trials`` times, the flusher client confirms its connection
(a ping), serves one has() hit from the index and sends nothing more, while a
second client polls ``stats`` every 1 ms until the broker counts it. Printed:
the delays (ms). With the flusher off the count never arrives while the client
idles (tests/test_served_flush.py shows that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import Broker, MiB, percentile, table  # noqa: E402

WARMUP = 200  # untimed calls before each op's timed ones


def _time_calls(fn, iters: int, gap_s: float) -> list[float]:
    for _ in range(WARMUP):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        if gap_s:
            time.sleep(gap_s)
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


def _broker_usage(pid: int) -> tuple[int, float]:
    """The broker's voluntary context switches (its wake-ups) and CPU seconds so far."""
    with open(f"/proc/{pid}/status") as f:
        woke = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return woke, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    ap.add_argument("--trials", type=int, default=20, help="idle-delay trials")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep before each timed call")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.gap_ms < 0:
        ap.error("--gap-ms must be >= 0")
    gap_s = args.gap_ms / 1e3

    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.connector.client import index_path

    flush_s = index_path.SERVED_FLUSH_S
    t = torch.zeros(16384, dtype=torch.float32)  # 64 KiB
    out = torch.empty_like(t)
    results: dict[str, dict[str, list[list[float]]]] = {"off": {}, "on": {}}
    # per round: the broker's wake-ups and CPU us per call
    usage: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    delays: list[float] = []
    with Broker(256 * MiB) as broker:
        with BrokerClient(broker.socket_path) as w:
            assert w.put("hit", t) and w.flush()
        index_path.SERVED_FLUSH_S = None
        off = BrokerClient(broker.socket_path, filter_trust_s=3600)
        index_path.SERVED_FLUSH_S = flush_s
        on = BrokerClient(broker.socket_path, filter_trust_s=3600)
        try:
            for _ in range(args.rounds):
                for mode, c in (("off", off), ("on", on)):
                    index_path.SERVED_FLUSH_S = None if mode == "off" else flush_s
                    ops = {
                        "has() hit": lambda c=c: c.has(["hit"]),
                        "get() 64 KiB": lambda c=c: c.get("hit"),
                        "get_into() 64 KiB": lambda c=c: c.get_into("hit", out),
                    }
                    before = c.index_hits
                    woke0, cpu0 = _broker_usage(broker.proc.pid)
                    for name, fn in ops.items():
                        xs = _time_calls(fn, args.iters, gap_s)
                        stats = [percentile(xs, 0.1), percentile(xs, 0.5), statistics.fmean(xs)]
                        results[mode].setdefault(name, []).append(stats)
                    calls = len(ops) * (WARMUP + args.iters)
                    assert c.index_hits - before == calls, "not from the index"
                    c.flush()
                    woke1, cpu1 = _broker_usage(broker.proc.pid)
                    usage[mode].append(((woke1 - woke0) / calls, (cpu1 - cpu0) * 1e6 / calls))
            index_path.SERVED_FLUSH_S = flush_s
            with BrokerClient(broker.socket_path) as observer:
                for _ in range(args.trials):
                    assert on.ping()
                    seen = observer.stats()["has_hits"]
                    hits = on.index_hits
                    t0 = time.monotonic()
                    assert on.has(["hit"]) == [True] and on.index_hits == hits + 1
                    while observer.stats()["has_hits"] == seen:
                        if time.monotonic() - t0 > 10:
                            raise RuntimeError("the idle client's hit never reached the broker")
                        time.sleep(0.001)
                    delays.append((time.monotonic() - t0) * 1e3)
        finally:
            off.close()
            on.close()

    def med(mode: str, name: str, i: int) -> float:
        return statistics.median(r[i] for r in results[mode][name])

    def per_call(mode: str) -> tuple[float, float]:
        """The broker's wake-ups and CPU us per call, medians over rounds."""
        return (
            statistics.median(w for w, _ in usage[mode]),
            statistics.median(c for _, c in usage[mode]),
        )

    names = list(results["off"])
    if args.json:
        summary = {
            mode: {n: [med(mode, n, i) for i in range(3)] for n in names} for mode in results
        }
        broker = {m: dict(zip(("wakeups", "cpu_us"), per_call(m), strict=True)) for m in usage}
        print(json.dumps({"per_call_us": summary, "idle_delay_ms": delays,
                          "broker_per_call": broker, "gap_ms": args.gap_ms}))  # fmt: skip
        return
    rows = [
        [
            n,
            *(
                f"{med(m, n, 0):.1f} / {med(m, n, 1):.1f} / {med(m, n, 2):.1f}"
                for m in ("off", "on")
            ),
        ]
        for n in names
    ]
    rows.append(["broker wake-ups / CPU us per call", *(
        "{:.2f} / {:.1f}".format(*per_call(m)) for m in ("off", "on"))])  # fmt: skip
    print(
        f"per call, p10 / p50 / mean us (median of {args.rounds} rounds, {args.iters} calls"
        + (f", each {args.gap_ms:g} ms after the last)" if gap_s else ")")
    )
    print(table(["op", "flusher off", "flusher on"], rows))
    ds = sorted(delays)
    print(
        f"idle client's has() hit counted by the broker after (ms, {len(ds)} trials): "
        f"min {ds[0]:.1f}, p50 {statistics.median(ds):.1f}, max {ds[-1]:.1f}"
    )


if __name__ == "__main__":
    main()
