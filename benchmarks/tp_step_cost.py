"""What the connector costs a step at tensor parallelism 2, with loads against without
(issue 41, deliverable 3), and the TTFT of a hit against a miss, with a real ``vllm
serve --tensor-parallel-size 2`` on CPU.

    .venv/bin/python benchmarks/tp_step_cost.py                       # ~3 min
    .venv/bin/python benchmarks/tp_step_cost.py --tree ../wt-old      # an older connector

Two servers of the tiny offline Qwen2-VL (``benchmarks/epd.py``'s model), ``ec_both``,
one broker, the connector of ``--tree`` (default: this checkout): A (TP 1) encodes
and stores the images B will hit; B (``--tp``, measured) runs
``benchmarks/timing_ec_connector.py``'s subclass: each worker rank logs, per step,
the loads the step carried and the time spent in the connector's hooks of the step
(bind .. clear: ``start_load_caches``, ``build_connector_worker_meta``, ...; the
put of a miss's encoder output, ``save_caches``, apart); the scheduler logs its
hooks' time per step. Per round: a new image to B (a miss: encoded, stored), and
an image A has just encoded to B (a hit: looked up, staged on every rank, loaded;
B's encoder cache never held it, so no reset of it is involved), then that image
again (``again``: vLLM's own encoder cache holds it now, so neither an encode nor a
load: the TTFT of the same prefill without a load). Steps "with
loads" are those whose metadata carried a load; "without" are all others of the
same run: the misses' prefills (``miss prefill``: their encoder ran) and every
other step (decodes). Ratios against the same rank's steps without loads, same
run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks._common import Broker, MiB, exit_on_sigterm, percentile, table  # noqa: E402
from benchmarks.dedup_vllm import Sent, image_url, send_together  # noqa: E402

LINE = re.compile(
    r"EC step hooks: role=(\w+) rank=(\S+) loads=(\d+) hooks_us=([\d.]+) load_us=([\d.]+) "
    r"save_us=([\d.]+)"
)
LOADED = re.compile(r"EC load: loaded \d+ bytes for mm_hash=(\S+)")


def p50(xs: list[float]) -> float:
    return percentile(sorted(xs), 0.5) if xs else float("nan")


def p90(xs: list[float]) -> float:
    return percentile(sorted(xs), 0.9) if xs else float("nan")


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(REPO), help="checkout whose connector is measured")
    p.add_argument("--label", default="", help="name of the tree in the output")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--connector-extra", default='{"scheduler_budget_ms": 2000, '
                   '"worker_budget_ms": 2000}', help="JSON: ec_connector_extra_config")  # fmt: skip
    p.add_argument("--json", help="write the raw samples here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args()

    from lmcache_ec_broker.testing.tiny_qwen2vl import build_bench_qwen2vl
    from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config

    tree = Path(args.tree).resolve()
    label = args.label or tree.name
    work = Path(tempfile.mkdtemp(prefix="ecbench-tpstep-", dir="/tmp"))
    model = build_bench_qwen2vl(work, args.side)  # an encoder a real share of prefill
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    broker = Broker(256 * MiB)
    cores = os.cpu_count() or 1
    env = {
        # the measured tree first, then this directory (the timing subclass)
        "PYTHONPATH": os.pathsep.join([str(tree), str(REPO / "benchmarks")]),
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(args.tp)),
    }
    producer = VllmServer(
        model,
        work / "vllm-a.log",
        ec_config=ec_transfer_config(
            "ec_both", broker.socket_path, **json.loads(args.connector_extra)
        ),
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    server = VllmServer(
        model,
        work / "vllm.log",
        ec_config=ec_transfer_config(
            "ec_both",
            broker.socket_path,
            connector="TimingECBrokerConnector",
            module="timing_ec_connector",
            **json.loads(args.connector_extra),
        ),
        extra_args=["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else [],
        env=env,
    )
    seed = random.Random().randrange(1 << 40)
    images: dict[int, str] = {}
    ttft: dict[str, list[float]] = {"miss": [], "hit": []}
    errors: list[str] = []

    def send(image: int, phase: str, to: VllmServer | None = None) -> None:
        s = Sent(f"{phase}-{image}-{len(ttft.get(phase, []))}", 0, image, phase)
        url = (to or server).url
        asyncio.run(send_together([url], model, [s], images, args.max_tokens))
        if s.error:
            errors.append(f"{phase} {image}: {s.error}")
        else:
            ttft.setdefault(phase, []).append(s.ttft)

    try:
        producer.start()
        server.start()
        producer.wait_ready(timeout=900)
        server.wait_ready(timeout=900)
        for i in range(2 * args.images + 2):
            images[seed + i] = image_url(seed + i, args.side)
        send(seed, "miss")  # warm-up: the first requests' one-off costs
        send(seed + 1, "stored", producer)
        send(seed + 1, "hit")
        ttft = {"miss": [], "hit": [], "again": []}
        mark = len(server.log_text())
        for i in range(2, 2 * args.images + 2, 2):
            send(seed + i, "miss")
            send(seed + i + 1, "stored", producer)
            send(seed + i + 1, "hit")
            send(seed + i + 1, "again")
        time.sleep(1.0)  # the last step's lines reach the log
        log = server.log_text()[mark:]
    finally:
        producer.terminate()
        server.stop()
        producer.wait_stopped()
        if args.keep:  # the broker's side of any timeout the servers logged
            from lmcache_ec_broker import BrokerClient

            with BrokerClient(broker.socket_path) as c:
                (work / "broker-stats.json").write_text(json.dumps(c.stats(), indent=1))
            (work / "broker.log").write_text(broker.read_log())
        broker.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}", file=sys.stderr)
    load_after = os.getloadavg()

    samples: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
    prefills: dict[str, list[float]] = {}  # rank -> hooks of the misses' prefill steps
    for role, rank, loads, hooks, load_us, save_us in LINE.findall(log):
        key = (role, rank, int(loads) > 0)
        samples.setdefault(key, []).append((float(hooks), float(load_us)))
        if float(save_us) > 0 and not int(loads):
            prefills.setdefault(rank, []).append(float(hooks))
    loaded = len(LOADED.findall(log))
    print(f"Connector hooks per step, TP={args.tp}, tree {label}, {started}, {cores} CPUs, "
          f"load average {load[0]:.1f} at start, {load_after[0]:.1f} at end")  # fmt: skip
    print(f"{args.images} rounds: a miss, then a hit (an image A stored); max_tokens "
          f"{args.max_tokens}; {loaded} 'EC load' lines; {len(errors)} errors")  # fmt: skip
    rows = []
    for role, rank in sorted({(r, k) for r, k, _ in samples}):
        with_ = samples.get((role, rank, True), [])
        without = samples.get((role, rank, False), [])
        w = [h for h, _ in with_]
        wo = [h for h, _ in without]
        ratio = p50(w) / p50(wo) if w and wo and p50(wo) > 0 else float("nan")
        rows.append(
            [label, role, rank, len(w), f"{p50(w):.0f}", f"{p90(w):.0f}",
             f"{p50([x for _, x in with_]):.0f}" if role == "worker" else "-",
             len(wo), f"{p50(wo):.0f}", f"{p90(wo):.0f}", f"{ratio:.2f}x",
             f"{p50(w) - p50(wo):+.0f}"]
        )  # fmt: skip
        pre = prefills.get(rank, [])
        if pre:
            rows.append(
                [label, role, rank, "", "", "", "", f"miss prefill: {len(pre)}",
                 f"{p50(pre):.0f}", f"{p90(pre):.0f}", f"{p50(w) / p50(pre):.2f}x" if w else "-",
                 f"{p50(w) - p50(pre):+.0f}" if w else "-"]
            )  # fmt: skip
    print(
        table(
            ["tree", "role", "rank", "steps with loads", "hooks p50 us", "p90 us",
             "start_load_caches p50 us", "steps without", "hooks p50 us", "p90 us",
             "p50 with/without", "difference us"],
            rows,
        )
    )  # fmt: skip
    a = ttft["again"]
    rows = []
    for phase, name in (("miss", "miss (encoded, stored)"), ("hit", "hit (looked up, loaded)"),
                        ("again", "again (vLLM's encoder cache)")):  # fmt: skip
        t = ttft[phase]
        rows.append(
            [label, name, len(t), f"{p50(t) * 1e3:.1f}", f"{p90(t) * 1e3:.1f}",
             f"{p50(t) / p50(a):.2f}x" if t and a else "-",
             f"{(p50(t) - p50(a)) * 1e3:+.1f}" if t and a else "-"]
        )  # fmt: skip
    print(
        table(["tree", "TTFT", "requests", "p50 ms", "p90 ms", "p50 vs again", "difference ms"], rows)
    )
    for e in errors[:5]:
        print("error:", e)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "started": started,
                    "load": [load, load_after],
                    "args": vars(args),
                    "ttft": ttft,
                    "samples": {"/".join(map(str, k)): v for k, v in samples.items()},
                    "errors": errors,
                },
                indent=1,
            )
        )
    return 1 if errors or not loaded else 0


if __name__ == "__main__":
    sys.exit(main())
