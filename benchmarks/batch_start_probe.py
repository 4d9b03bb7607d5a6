"""Probe: what a read costs when it starts a Served batch (issue 42).

A client that serves a hit from the residency index notes it in a Served batch; the
first hit of a batch arms the client's flusher (connector/client/served_flush.py). Before
issue 42 every arm was an ``Event.set()`` -- a futex wake of the sleeping flusher
thread, then that thread's turn on the GIL -- on the caller's path; now the thread
lingers after a batch and an arm meanwhile wakes nothing.

One broker, one writer, then reader processes of two client trees alternating
(``--before-tree``: e.g. a ``git worktree`` of main; ``--tree``: this checkout). Each
reader times ``get_into`` (64 KiB) and ``has()`` calls that each start a new batch:
the batch before is sent with ``flush()`` and the reader idles ``--gap-ms`` between
calls, as a vLLM worker between requests. p50 per reader process, then the median
over the ``--rounds`` processes of each tree, and the ratio before/after.

    .venv/bin/python benchmarks/batch_start_probe.py --before-tree ../wt-main
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Broker, MiB, median, table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# One reader process: p50 of get_into and of has(), each call starting a batch.
_READER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from lmcache_ec_broker import BrokerClient
c = BrokerClient(sys.argv[2], timeout_s=60, filter_trust_s=600)
out = torch.zeros(32768, dtype=torch.bfloat16)
key, iters, gap = sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
g, h = [], []
for i in range(iters):
    t0 = time.perf_counter_ns()
    assert c.get_into(key, out)
    g.append((time.perf_counter_ns() - t0) / 1e3)
    c.flush()  # the batch goes: the next hit starts a new one (an arm)
    time.sleep(gap)
    t0 = time.perf_counter_ns()
    assert c.has([key]) == [True]
    h.append((time.perf_counter_ns() - t0) / 1e3)
    c.flush()
    time.sleep(gap)
skip = iters // 10
g, h = sorted(g[skip:]), sorted(h[skip:])
print(g[len(g) // 2], h[len(h) // 2])
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before-tree", required=True, help="the client tree to compare against")
    p.add_argument("--tree", default=str(REPO), help="the client tree measured (default: here)")
    p.add_argument("--rounds", type=int, default=4, help="reader processes per tree")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=2.0)
    args = p.parse_args()
    import torch

    from lmcache_ec_broker import BrokerClient

    trees = {"before": args.before_tree, "after": args.tree}
    got: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    load = [os.getloadavg()[0]]
    with Broker(64 * MiB) as b:
        with BrokerClient(b.socket_path) as w:
            assert w.put("k", torch.ones(32768, dtype=torch.bfloat16)) and w.flush()
            for rnd in range(args.rounds):
                order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
                for name in order:
                    out = subprocess.run(
                        [sys.executable, "-c", _READER, trees[name], b.socket_path, "k",
                         str(args.iters), str(args.gap_ms / 1e3)],
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=trees[name]),
                    )  # fmt: skip
                    if out.returncode:
                        raise SystemExit(f"reader of {trees[name]} failed:\n{out.stderr}")
                    g, h = map(float, out.stdout.split())
                    got[name].append((g, h))
                    load.append(os.getloadavg()[0])
    rows = []
    for i, op in enumerate(("get_into 64 KiB", "has() hit")):
        before = median(x[i] for x in got["before"])
        after = median(x[i] for x in got["after"])
        spread = {n: f"{min(x[i] for x in v):.1f}-{max(x[i] for x in v):.1f}" for n, v in got.items()}
        rows.append([op, f"{before:.1f} [{spread['before']}]", f"{after:.1f} [{spread['after']}]",
                     f"{before / after:.2f}x"])  # fmt: skip
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load (1 min) "
        f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs; a call that starts a "
        f"Served batch, {args.gap_ms:g} ms after the last; p50 per reader process, median "
        f"[min-max] of {args.rounds} processes per tree, µs\n"
    )
    print(table(["op", "before", "after", "before / after"], rows))


if __name__ == "__main__":
    main()
