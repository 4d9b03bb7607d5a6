"""In-flight deduplication with real ``vllm serve`` (issue 41, deliverable 3): encoder
runs per distinct item when N instances meet the same new images at the same moment,
with encode claims (the default) and without (``claim_wait_ms=0``), on one node and on
two nodes joined by Redis; and what the waiting costs a request.

    .venv/bin/python benchmarks/dedup_vllm.py                    # 2 instances, ~10 min
    .venv/bin/python benchmarks/dedup_vllm.py --instances 2,4 --rounds 4 --items 2

Setups (each a fresh deployment per claims mode: the mode is a connector setting):

- ``node``: one broker, N ``vllm serve`` of the tiny offline Qwen2-VL (``ec_both``);
- ``fleet``: two brokers ("nodes"), each with a remote tier on one redis-server (Unix
  socket), the N instances split between them (instance i on node i % 2): claims
  across nodes are fleet claims in the store.

Per round every instance gets the same ``--items`` new images, one request each, all
sent at the same instant (N x items concurrent cold requests). Then (``node`` only,
``--hit-items``) each of a few more new images goes to instance 0 alone and, once
answered, to each other instance: "encoded alone" against "hit (staged)".

What counts as an encoder run: vLLM's model runner calls the connector's
``save_caches`` once for every item its encoder has just computed and never for an
item it loaded; every instance runs ``tests/e2e/counting_ec_connector.py``'s subclass,
which logs ``EC encoder ran: mm_hash=...`` there, and ``EC item: request=...
mm_hash=...`` from the scheduler's ``update_state_after_alloc`` (which item each
request got). Runs per distinct item = the round's requests' items' run lines on all
instances / distinct items (1.00: each encoded once). The connectors' own counters
(vLLM's ``EC Transfer metrics`` log line: ``ec_misses``, ``puts_stored``, ``loads``,
``claim_waits``: steps a request was held on a claim; ``claim_reasks``: lookups of
such an item after the first, spaced out by connector/vllm/reask.py; ``claim_timeouts``;
``broker_timeouts``: lookups past the scheduler's budget, each opening a circuit)
are summed beside them as a cross-check.

TTFT (streamed, first chunk) per request, by what its instance did for its item:
``encoded here`` (it ran the encoder), ``waited, loaded`` (held on another encoder's
claim, then loaded its put), ``loaded`` (the put was there at its first lookup),
``waited, encoded`` (the wait timed out). Ratios against the same setup's claims-off
bursts (every request's p50), measured in the same run; a hit's against "encoded
alone".
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks._common import Broker, MiB, exit_on_sigterm, percentile, table  # noqa: E402

E2E = REPO / "tests" / "e2e"
SETUPS = ("node", "fleet")
# Log lines (tests/e2e/counting_ec_connector.py, connector/vllm/connector.py, worker.py).
ENCODER_RAN = re.compile(r"EC encoder ran: mm_hash=(\S+)")
# vLLM's internal request id: "chatcmpl-" + the X-Request-Id header + "-" + 8 hex.
ITEM = re.compile(r"EC item: request=chatcmpl-(\S+)-[0-9a-f]{8} mm_hash=(\S+)")
LOADED = re.compile(r"EC load: loaded \d+ bytes for mm_hash=(\S+)")
WAITS = re.compile(r"EC claim: request chatcmpl-(\S+)-[0-9a-f]{8} waits for")
TIMED_OUT = re.compile(r"EC claim: \d+ item\(s\) of request chatcmpl-(\S+)-[0-9a-f]{8} not encoded")
METRICS = re.compile(r"EC Transfer metrics: (.*)")
COUNTERS = (
    "ec_misses", "puts_stored", "loads", "claim_waits", "claim_reasks", "claim_timeouts",
    "broker_timeouts",
)  # fmt: skip
RUN_HEADERS = [
    "setup", "instances", "claims", "requests/items", "encoder runs", "runs/item", "vs off",
    "misses/puts/loads", "claim waits/re-asks/timeouts", "broker timeouts",
    "TTFT p50 ms", "p99 ms", "p50 vs off", "errors",
]  # fmt: skip
TTFT_HEADERS = [
    "setup",
    "instances",
    "claims",
    "request",
    "n",
    "TTFT p50 ms",
    "max ms",
    "vs baseline",
]
ROLES = ("encoded here", "waited, loaded", "loaded", "waited, encoded", "other")


def image_url(seed: int, side: int) -> str:
    """A new image per seed (random pixels: no two seeds alike), as a PNG data URL."""
    from PIL import Image

    img = Image.frombytes("RGB", (side, side), random.Random(seed).randbytes(side * side * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Sent:
    rid: str  # the X-Request-Id header
    server: int
    image: int
    phase: str  # "burst", "alone", "hit"
    ttft: float = float("nan")
    error: str = ""
    # from the logs
    mm_hash: str = ""
    role: str = ""


@dataclass
class Run:
    setup: str
    instances: int
    claims: bool
    sent: list[Sent] = field(default_factory=list)
    runs: int = 0  # encoder runs of the burst requests' items, all instances
    distinct: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def chat_body(model: str, url: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "describe the image"},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


async def send_together(
    urls: list[str], model: str, sends: list[Sent], images: dict[int, str], max_tokens: int
) -> None:
    """Every request of ``sends`` leaves at the same instant; TTFT = first chunk."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter() + 0.2

        async def one(s: Sent) -> None:
            body = chat_body(model, images[s.image], max_tokens)
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            t0 = time.perf_counter()
            try:
                url = urls[s.server] + "/v1/chat/completions"
                async with session.post(url, json=body, headers={"X-Request-Id": s.rid}) as r:
                    if r.status != 200:
                        s.error = f"{r.status}: {(await r.text())[:200]}"
                        return
                    async for chunk in r.content.iter_any():
                        if chunk.strip() and math.isnan(s.ttft):  # the first chunk
                            s.ttft = time.perf_counter() - t0
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                s.error = repr(exc)

        await asyncio.gather(*(one(s) for s in sends))


class Deployment:
    """N instances of one claims mode on one or two brokers (+ the run's redis-server)."""

    def __init__(
        self,
        setup: str,
        n: int,
        claims: bool,
        args: argparse.Namespace,
        work: Path,
        model: str,
        redis_url: str | None,
    ) -> None:
        from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config

        self.setup, self.n, self.claims, self.model = setup, n, claims, model
        self.work = work / f"{setup}-{n}-{'on' if claims else 'off'}"
        self.work.mkdir()
        self.brokers: list[Broker] = []
        if setup == "node":
            self.brokers.append(Broker(256 * MiB))
        else:
            assert redis_url is not None
            cfg = self.work / "remote.yaml"
            cfg.write_text(f"remote_url: '{redis_url}'\nremote_timeout_s: 5.0\n")
            for _ in range(2):
                self.brokers.append(Broker(256 * MiB, ["--config", str(cfg)]))
        extra = json.loads(args.connector_extra)
        if not claims:
            extra["claim_wait_ms"] = 0
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(E2E), os.environ.get("PYTHONPATH")])),
            "VLLM_LOG_STATS_INTERVAL": "1",
        }
        cores = os.cpu_count() or 1
        self.servers = [
            VllmServer(
                model,
                self.work / f"vllm-{i}.log",
                ec_config=ec_transfer_config(
                    "ec_both",
                    self.brokers[i % len(self.brokers)].socket_path,
                    connector="CountingECBrokerConnector",
                    module="counting_ec_connector",
                    **extra,
                ),
                extra_args=list(args.vllm_args),
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
            )
            for i in range(n)
        ]
        for s in self.servers:
            s.start()
        self.marks = [0] * n

    def wait_ready(self) -> None:
        for s in self.servers:
            s.wait_ready(timeout=900)

    def mark(self) -> None:
        """What the logs hold from now on is the measured part's."""
        self.marks = [len(s.log_text()) for s in self.servers]

    def logs(self) -> list[str]:
        return [s.log_text()[m:] for s, m in zip(self.servers, self.marks, strict=True)]

    def stop(self) -> None:
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            s.wait_stopped()
        for b in self.brokers:
            b.stop()


def analyse(run: Run, logs: list[str]) -> None:
    """Each request's item and role; the bursts' encoder runs; the connectors' counters."""
    items = [dict(ITEM.findall(text)) for text in logs]  # rid -> mm_hash, per server
    ran = [ENCODER_RAN.findall(text) for text in logs]
    loaded = [set(LOADED.findall(text)) for text in logs]
    waited = [set(WAITS.findall(text)) for text in logs]
    timed_out = [set(TIMED_OUT.findall(text)) for text in logs]
    for s in run.sent:
        s.mm_hash = items[s.server].get(s.rid, "")
        if not s.mm_hash:
            s.role = "other"
            continue
        here = s.mm_hash in ran[s.server]
        w = s.rid in waited[s.server] or s.rid in timed_out[s.server]
        if here:
            s.role = "waited, encoded" if w else "encoded here"
        elif s.mm_hash in loaded[s.server]:
            s.role = "waited, loaded" if w else "loaded"
        else:
            s.role = "other"
    burst = {s.mm_hash for s in run.sent if s.phase == "burst" and s.mm_hash}
    run.distinct = len({s.image for s in run.sent if s.phase == "burst"})
    run.runs = sum(1 for r in ran for h in r if h in burst)
    unmapped = [s.rid for s in run.sent if s.phase == "burst" and not s.mm_hash]
    if unmapped:
        run.errors.append(f"no EC item line for {unmapped}")
    counters = dict.fromkeys(COUNTERS, 0)
    for text in logs:
        for line in METRICS.findall(text):
            for part in line.split(","):
                name, _, value = part.strip().partition("=")
                if name in counters:
                    counters[name] += int(float(value))
    run.counters = counters


def measure(dep: Deployment, args: argparse.Namespace, next_image: list[int]) -> Run:
    run = Run(dep.setup, dep.n, dep.claims)
    urls = [s.url for s in dep.servers]
    images: dict[int, str] = {}
    tag = f"{dep.setup}{dep.n}{'c' if dep.claims else 'n'}"

    def new_image() -> int:
        next_image[0] += 1
        images[next_image[0]] = image_url(next_image[0], args.side)
        return next_image[0]

    # Warm-up: one request per instance, each its own image (first-request costs out).
    warm = [Sent(f"{tag}-warm-s{i}", i, new_image(), "warm") for i in range(dep.n)]
    asyncio.run(send_together(urls, dep.model, warm, images, args.max_tokens))
    time.sleep(1.5)  # the warm-up's EC metrics line is logged before the mark
    dep.mark()
    for r in range(args.rounds):
        ids = [new_image() for _ in range(args.items)]
        sends = [
            Sent(f"{tag}-r{r}-i{k}-s{i}", i, img, "burst")
            for k, img in enumerate(ids)
            for i in range(dep.n)
        ]
        random.Random(r).shuffle(sends)  # no instance always first in line
        asyncio.run(send_together(urls, dep.model, sends, images, args.max_tokens))
        run.sent += sends
    if dep.setup == "node" and dep.n > 1:
        for k in range(args.hit_items):
            img = new_image()
            alone = Sent(f"{tag}-alone{k}-s0", 0, img, "alone")
            asyncio.run(send_together(urls, dep.model, [alone], images, args.max_tokens))
            hits = [Sent(f"{tag}-hit{k}-s{i}", i, img, "hit") for i in range(1, dep.n)]
            for h in hits:  # one at a time: a hit's own TTFT
                asyncio.run(send_together(urls, dep.model, [h], images, args.max_tokens))
            run.sent += [alone, *hits]
    time.sleep(2.5)  # the last interval's EC metrics line (VLLM_LOG_STATS_INTERVAL=1)
    analyse(run, dep.logs())
    run.errors += [f"{s.rid}: {s.error}" for s in run.sent if s.error]
    return run


def p50(xs: list[float]) -> float:
    return percentile(xs, 0.5)


def ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.0f}"


def ratio(a: float, b: float) -> str:
    return "-" if a != a or b != b or b == 0 else f"{a / b:.2f}x"


def tables(runs: list[Run]) -> str:
    base = {(r.setup, r.instances): r for r in runs if not r.claims}

    def burst_ttfts(r: Run, role: str | None = None) -> list[float]:
        return [
            s.ttft
            for s in r.sent
            if s.phase == "burst" and not s.error and (role is None or s.role == role)
        ]

    rows = []
    for r in runs:
        b = base.get((r.setup, r.instances))
        per_item = r.runs / r.distinct if r.distinct else float("nan")
        b_item = b.runs / b.distinct if b and b.distinct else float("nan")
        t = burst_ttfts(r)
        c = r.counters
        rows.append(
            [
                r.setup, r.instances, "on" if r.claims else "off",
                f"{sum(1 for s in r.sent if s.phase == 'burst')}/{r.distinct}",
                r.runs, f"{per_item:.2f}", ratio(per_item, b_item),
                f"{c['ec_misses']}/{c['puts_stored']}/{c['loads']}",
                f"{c['claim_waits']}/{c['claim_reasks']}/{c['claim_timeouts']}",
                c["broker_timeouts"],
                ms(p50(t)), ms(percentile(t, 0.99)), ratio(p50(t), p50(burst_ttfts(b))) if b else "-",
                len(r.errors),
            ]
        )  # fmt: skip
    out = [table(RUN_HEADERS, rows)]
    rows = []
    for r in runs:
        b = base.get((r.setup, r.instances))
        b50 = p50(burst_ttfts(b)) if b else float("nan")
        for role in ROLES:
            t = burst_ttfts(r, role)
            if t:
                rows.append(
                    [r.setup, r.instances, "on" if r.claims else "off", f"burst: {role}", len(t),
                     ms(p50(t)), ms(max(t)), ratio(p50(t), b50)]
                )  # fmt: skip
        alone = [s.ttft for s in r.sent if s.phase == "alone" and not s.error]
        for phase, label in (("alone", "encoded alone"), ("hit", "hit (staged)")):
            t = [s.ttft for s in r.sent if s.phase == phase and not s.error]
            if t:
                rows.append(
                    [r.setup, r.instances, "on" if r.claims else "off", label, len(t),
                     ms(p50(t)), ms(max(t)), ratio(p50(t), p50(alone))]
                )  # fmt: skip
    out.append(table(TTFT_HEADERS, rows))
    return "\n\n".join(out)


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default="2", help="instance counts to run, e.g. 2,4")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--rounds", type=int, default=4, help="bursts per deployment")
    p.add_argument("--items", type=int, default=2, help="new images per burst")
    p.add_argument("--hit-items", type=int, default=2, help="node: images for the hit phase")
    p.add_argument("--side", type=int, default=224, help="image side in pixels")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--connector-extra", default="{}",
                   help="JSON merged into every instance's ec_connector_extra_config")  # fmt: skip
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[],
                   help="extra vllm serve argument (repeat)")  # fmt: skip
    args = p.parse_args()
    setups = [x for x in args.setups.split(",") if x]
    if set(setups) - set(SETUPS):
        p.error(f"--setups: choose from {','.join(SETUPS)}")
    counts = [int(x) for x in args.instances.split(",") if x]
    if any(n < 2 for n in counts) or ("fleet" in setups and any(n % 2 for n in counts)):
        p.error("--instances: at least 2 each, and even for the fleet setup (2 nodes)")

    from lmcache_ec_broker.testing.tiny_qwen2vl import build_bench_qwen2vl

    work = Path(tempfile.mkdtemp(prefix="ecbench-dedupvllm-", dir="/tmp"))
    model = build_bench_qwen2vl(work, args.side)  # an encoder a real share of prefill
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    runs: list[Run] = []
    redis = None
    next_image = [random.Random().randrange(1 << 40)]  # new to every broker and store
    try:
        if "fleet" in setups:
            from redis_servers import RedisServer

            redis = RedisServer(tcp=False)
        for n in counts:
            for setup in setups:
                for claims in (False, True):
                    print(f"{setup}, {n} instances, claims {'on' if claims else 'off'} ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    dep = Deployment(
                        setup, n, claims, args, work, model, redis.url("unix") if redis else None
                    )
                    try:
                        dep.wait_ready()
                        run = measure(dep, args, next_image)
                    finally:
                        dep.stop()
                    runs.append(run)
                    print(f"  {run.runs} encoder runs for {run.distinct} items, "
                          f"{len(run.errors)} errors", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if redis is not None:
            redis.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}", file=sys.stderr)
    load_after = os.getloadavg()
    print(f"In-flight deduplication with vllm serve, {started}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} at start, {load_after[0]:.1f} at end")  # fmt: skip
    print(f"{args.rounds} bursts x {args.items} new {args.side}px images, every instance "
          f"one request per image, all at once; max_tokens {args.max_tokens}")  # fmt: skip
    print(tables(runs))
    for r in runs:
        for e in r.errors[:5]:
            print(f"error ({r.setup}, {r.instances}, claims {r.claims}): {e}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "started": started,
                    "load": [load, load_after],
                    "args": vars(args),
                    "runs": [
                        {
                            "setup": r.setup,
                            "instances": r.instances,
                            "claims": r.claims,
                            "encoder_runs": r.runs,
                            "distinct": r.distinct,
                            "runs_per_item": r.runs / r.distinct if r.distinct else None,
                            "counters": r.counters,
                            "errors": r.errors,
                            "sent": [vars(s) for s in r.sent],
                        }
                        for r in runs
                    ],
                },
                indent=1,
            )
        )
    return 1 if any(r.errors for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
