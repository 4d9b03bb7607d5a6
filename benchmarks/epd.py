"""Encoder disaggregation (EPD) against aggregated serving, with real ``vllm serve``.

    .venv/bin/python benchmarks/epd.py                      # ~15 min on 2 busy cores
    .venv/bin/python benchmarks/epd.py --requests 4 --rates 2 --images 3 --side 112

Two ``vllm serve`` of the tiny offline Qwen2-VL on the same CPUs (one bound to each
core, or both to core 0 on one core), one node:

- ``agg``: two aggregated instances (``ec_both``, one broker), requests round-robin;
  the baseline every ratio is taken against, measured in the same run;
- ``epd``: E (``--mm-encoder-only``, ``ec_producer``) + PD (``ec_consumer``) on the
  broker, behind ``examples/epd/proxy.py`` (vLLM's protocol: each item to E, then PD);
- ``epd-lookup``: the same instances, the proxy with ``--lookup`` (the aggregator,
  following the broker's residency events): items the broker holds skip E;
- ``example``: E + PD with vLLM's ``ECExampleConnector`` over a shared local directory
  (vLLM's own recipe; a local directory is its best case), behind the same proxy.

Workloads: ``unique`` (every request a new image) and ``zipf`` (``--images`` images,
Zipf(``--zipf``) popularity), ``--multi`` of the requests with two images; Poisson
arrivals at each of ``--rates`` (requests/s), open loop. Every (config, workload, rate)
run starts cold: broker cleared, vLLM's encoder and multimodal-processor caches reset,
the shared directory emptied.

Figures: TTFT p50/p99 (streamed, first chunk, as the client sees it: through the
proxy for the EPD configs), throughput (completed requests / wall time from the first
send to the last answer), encoder runs per distinct item (every instance's connector
is a subclass that logs each encoder run, ``tests/e2e/counting_ec_connector.py``;
1.0 = each item encoded once in the fleet), errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import die_with_parent, exit_on_sigterm, percentile, table  # noqa: E402
from lmcache_ec_broker.testing.broker_process import BrokerProcess, stop_process  # noqa: E402
from lmcache_ec_broker.testing.ports import free_ports  # noqa: E402

E2E = REPO / "tests" / "e2e"
PROXY = REPO / "examples" / "epd" / "proxy.py"
ENCODER_RAN = re.compile(r"EC encoder ran: mm_hash=(\S+)")
CONFIGS = ("agg", "epd", "epd-lookup", "example")
WORKLOADS = ("unique", "zipf")
PROMPTS = ["describe the image", "what colours are in it?", "write a caption"]


def wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


class Helper:
    """A process of ours (aggregator, proxy), its output in a log file."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=die_with_parent,
                start_new_session=True,  # its own session and CPU group, as a service's (cpu_group.py)
            )

    def stop(self) -> None:
        stop_process(self.proc)


def start_broker(work: Path, events_port: int) -> tuple[BrokerProcess, str]:
    sock = str(work / "broker.sock")
    env = {
        "LMCACHE_EC_EVENTS_PORT": str(events_port),
        "LMCACHE_EC_EVENTS_NODE": "node-1",
        "LMCACHE_EC_EVENTS_HEARTBEAT_S": "0.5",
    }
    b = BrokerProcess(
        sock, ["--shm-size", "512MiB"], env, log_path=work / "broker.log", die_with_parent=True
    )
    return b.start(timeout=60), sock


# ---------------------------------------------------------------- workload


def workload(
    kind: str, n: int, images: int, s: float, multi: float, seed: int, first_id: int
) -> list[list[int]]:
    """Per request, the image ids it carries. ``unique``: new ids every time."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(images)]
    out: list[list[int]] = []
    next_id = first_id
    for _ in range(n):
        k = 2 if rng.random() < multi else 1
        if kind == "unique":
            out.append(list(range(next_id, next_id + k)))
            next_id += k
            continue
        ids: list[int] = []
        while len(ids) < min(k, images):
            (i,) = rng.choices(range(images), weights)
            if first_id + i not in ids:
                ids.append(first_id + i)
        out.append(ids)
    return out


def chat_body(model: str, urls: list[str], prompt: str, max_tokens: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": prompt})
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


async def send_all(
    targets: list[str], bodies: list[dict[str, Any]], rate: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate``; each request streamed; TTFT = first chunk."""
    import aiohttp

    rng = random.Random(seed)
    ttfts: list[float] = []
    errors: list[str] = []
    done_at: list[float] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int, at: float, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter()
            first = None
            try:
                url = targets[i % len(targets)] + "/v1/chat/completions"
                async with session.post(url, json=bodies[i]) as r:
                    if r.status != 200:
                        errors.append(f"{r.status}: {(await r.text())[:200]}")
                        return
                    async for chunk in r.content.iter_any():
                        if first is None and chunk.strip():
                            first = time.perf_counter()
                if first is not None:
                    ttfts.append(first - sent)
                    done_at.append(time.perf_counter())
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(repr(exc))

        arrivals, t = [], 0.0
        for _ in bodies:
            arrivals.append(t)
            t += rng.expovariate(rate)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, at, t0) for i, at in enumerate(arrivals)))
        wall = (max(done_at) if done_at else time.perf_counter()) - t0
    return {"ttfts": ttfts, "errors": errors, "wall_s": wall}


# ---------------------------------------------------------------- one deployment


class Deployment:
    """Two vLLM instances of one config, and what fronts them."""

    def __init__(self, name: str, args: argparse.Namespace, work: Path, model: str) -> None:
        from lmcache_ec_broker.testing.vllm_server import (
            SLOW_HOST_BUDGETS,
            VllmServer,
            ec_transfer_config,
        )

        self.name, self.work, self.model = name, work / name, model
        self.work.mkdir()
        self.helpers: list[Helper | BrokerProcess] = []
        self.broker_sock: str | None = None
        self.shared_dir: Path | None = None
        self.proxies: dict[str, str] = {}
        cores = os.cpu_count() or 1
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(E2E), os.environ.get("PYTHONPATH")]))
        }
        size = ["--limit-mm-per-prompt", '{"image": 2, "video": 0}']
        if name == "example":
            self.shared_dir = self.work / "shared"
            self.shared_dir.mkdir()

            def cfg(role: str) -> str:
                return json.dumps(
                    {
                        "ec_connector": "CountingECExampleConnector",
                        "ec_role": role,
                        "ec_connector_module_path": "counting_ec_connector",
                        "ec_connector_extra_config": {"shared_storage_path": str(self.shared_dir)},
                    }
                )
        else:
            events = free_ports(2)
            broker, self.broker_sock = start_broker(self.work, events)
            self.helpers.append(broker)
            agg_port = free_ports(1)
            agg = [sys.executable, "-m", "lmcache_ec_broker.events.aggregator"]
            agg += ["--port", str(agg_port), "--broker", f"tcp://127.0.0.1:{events}"]
            self.helpers.append(Helper(agg, self.work / "aggregator.log"))
            self.aggregator = f"http://127.0.0.1:{agg_port}"
            wait_http(self.aggregator + "/healthz", self.helpers[-1].proc, self.helpers[-1].log)

            def cfg(role: str) -> str:
                assert self.broker_sock is not None
                return ec_transfer_config(
                    role,
                    self.broker_sock,
                    connector="CountingECBrokerConnector",
                    module="counting_ec_connector",
                    **SLOW_HOST_BUDGETS,
                )

        if name == "agg":
            roles = [("agg-0", "ec_both", []), ("agg-1", "ec_both", [])]
        else:
            roles = [
                ("e", "ec_producer", ["--mm-encoder-only"]),
                ("pd", "ec_consumer", ["--enable-scale-out"]),
            ]
        self.servers = []
        for i, (sname, role, extra) in enumerate(roles):
            self.servers.append(
                VllmServer(
                    model,
                    self.work / f"vllm-{sname}.log",
                    ec_config=cfg(role),
                    extra_args=[*size, *extra, *args.vllm_args],
                    env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
                )
            )
        for s in self.servers:
            s.start()

    def wait_ready(self) -> None:
        """The servers answer; then the proxies in front of them start."""
        for s in self.servers:
            s.wait_ready(timeout=900)
        if self.name != "agg":
            e, pd = self.servers
            variants = {"epd": None}
            if self.name == "epd":
                variants["epd-lookup"] = self.aggregator
            else:
                variants = {"example": None}
            for variant, lookup in variants.items():
                port = free_ports(1)
                cmd = [sys.executable, str(PROXY), "--port", str(port), "--encoder", e.url]
                cmd += ["--pd", f"{pd.url}=node-1", "--log-level", "WARNING"]
                cmd += ["--lookup", lookup] if lookup else []
                h = Helper(cmd, self.work / f"proxy-{variant}.log")
                self.helpers.append(h)
                self.proxies[variant] = f"http://127.0.0.1:{port}"
                wait_http(self.proxies[variant] + "/stats", h.proc, h.log)

    def targets(self, variant: str) -> list[str]:
        return [s.url for s in self.servers] if variant == "agg" else [self.proxies[variant]]

    def reset(self) -> None:
        """Cold caches: the broker's, vLLM's encoder and processor caches, the directory."""
        if self.broker_sock is not None:
            from lmcache_ec_broker import BrokerClient

            with BrokerClient(self.broker_sock) as c:
                c.clear()
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir)
            self.shared_dir.mkdir()
        for s in self.servers:
            s.reset_encoder_cache()
            post(s.url + "/reset_mm_cache")
        if self.broker_sock is not None:  # the aggregator heard the clear
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                nodes = json.loads(urllib.request.urlopen(self.aggregator + "/v1/nodes").read())
                if all(n.get("entries", 0) == 0 for n in nodes["nodes"].values()):
                    break
                time.sleep(0.1)

    def proxy_stats(self, variant: str) -> dict[str, Any]:
        if variant not in self.proxies:
            return {}
        return json.loads(urllib.request.urlopen(self.proxies[variant] + "/stats").read())

    def encoder_runs(self) -> int:
        return sum(len(ENCODER_RAN.findall(s.log_text())) for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            s.wait_stopped()
        for h in reversed(self.helpers):
            h.stop()


def run_one(
    dep: Deployment,
    variant: str,
    kind: str,
    rate: float,
    args: argparse.Namespace,
    image: Any,
) -> dict[str, Any]:
    dep.reset()
    reqs = workload(kind, args.requests, args.images, args.zipf, args.multi, args.seed, 10_000)
    rng = random.Random(args.seed)
    bodies = [
        chat_body(dep.model, [image(i) for i in ids], rng.choice(PROMPTS), args.max_tokens)
        for ids in reqs
    ]
    before = dep.encoder_runs()
    stats0 = dep.proxy_stats(variant)
    res = asyncio.run(send_all(dep.targets(variant), bodies, rate, args.seed))
    # Each encoder run's log line is written in the step that ran it, before any token
    # of its request is answered: every run of this run's requests is counted now.
    res["encoder_runs"] = dep.encoder_runs() - before
    res["distinct"] = len({i for ids in reqs for i in ids})
    res["items"] = sum(len(ids) for ids in reqs)
    res["requests"] = len(reqs)
    if variant in dep.proxies:  # the proxy's counters count from its start: this run's share
        stats1 = dep.proxy_stats(variant)
        res["proxy"] = {
            k: v - stats0[k]
            for k, v in stats1.items()
            if isinstance(v, (int, float)) and isinstance(stats0.get(k), (int, float))
        }
    return res


def rows_for(results: list[dict[str, Any]]) -> list[list[Any]]:
    base = {(r["workload"], r["rate"]): r for r in results if r["config"] == "agg"}
    rows = []
    for r in results:
        t = r["ttfts"]
        p50, p99 = percentile(t, 0.5), percentile(t, 0.99)
        thr = len(t) / r["wall_s"] if r["wall_s"] > 0 else 0.0
        b = base.get((r["workload"], r["rate"]))
        bp50 = percentile(b["ttfts"], 0.5) if b else float("nan")
        bthr = len(b["ttfts"]) / b["wall_s"] if b and b["wall_s"] > 0 else float("nan")
        px = r.get("proxy", {})
        skipped = px.get("items_skipped", "-")
        ms = px.get("lookup_ms_total")
        lookup = f"{ms / px['lookups']:.0f}" if ms is not None and px.get("lookups") else "-"
        rows.append(
            [
                r["workload"],
                f"{r['rate']:g}",
                r["config"],
                f"{p50 * 1e3:.0f}",
                f"{p99 * 1e3:.0f}",
                f"{p50 / bp50:.2f}x" if b and t else "-",
                f"{thr:.2f}",
                f"{thr / bthr:.2f}x" if b and bthr else "-",
                f"{r['encoder_runs'] / r['distinct']:.2f}" if r["distinct"] else "-",
                f"{r['requests']}/{r['items']}/{r['distinct']}",
                skipped,
                lookup,
                len(r["errors"]),
            ]
        )
    return rows


HEADERS = [
    "workload", "req/s", "config", "TTFT p50 ms", "TTFT p99 ms", "p50 vs agg",
    "done req/s", "thr vs agg", "enc runs/item", "req/items/distinct", "items not sent to E", "lookup ms",
    "errors",
]  # fmt: skip


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), Poisson")
    p.add_argument("--requests", type=int, default=24, help="per run")
    p.add_argument("--images", type=int, default=8, help="zipf: distinct images")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--multi", type=float, default=0.2, help="share of requests with 2 images")
    p.add_argument("--side", type=int, default=224, help="image side in pixels")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[],
                   help="extra vllm serve argument (repeat)")  # fmt: skip
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    bad = set(configs) - set(CONFIGS)
    if bad:
        p.error(f"unknown configs {sorted(bad)}; choose from {','.join(CONFIGS)}")
    if "agg" not in configs:
        p.error("the ratios are against agg, measured in the same run: keep it in --configs")
    workloads = [w for w in args.workloads.split(",") if w]
    if set(workloads) - set(WORKLOADS):
        p.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    rates = [float(r) for r in args.rates.split(",") if r]

    from lmcache_ec_broker.testing.tiny_qwen2vl import build_bench_qwen2vl
    from lmcache_ec_broker.testing.vllm_server import png_data_url

    work = Path(tempfile.mkdtemp(prefix="ecbench-epd-", dir="/tmp"))
    model = build_bench_qwen2vl(work, args.side)  # an encoder a real share of prefill
    images: dict[int, str] = {}

    def image(i: int) -> str:
        if i not in images:
            images[i] = png_data_url(seed=i, size=args.side)
        return images[i]

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    results: list[dict[str, Any]] = []
    groups = [("agg", ["agg"])]
    if {"epd", "epd-lookup"} & set(configs):
        groups.append(("epd", [c for c in ("epd", "epd-lookup") if c in configs]))
    if "example" in configs:
        groups.append(("example", ["example"]))
    # Every deployment's servers start at once (their start-ups, mostly single-threaded
    # imports, overlap on the cores); each is made ready and measured in turn, while the
    # others sit idle.
    deployments: list[Deployment] = []
    try:
        for dep_name, _ in groups:
            print(f"starting {dep_name} ...", file=sys.stderr, flush=True)
            deployments.append(Deployment(dep_name, args, work, model))
        for dep, (_, variants) in zip(deployments, groups, strict=True):
            dep.wait_ready()
            for kind in workloads:
                for rate in rates:
                    for variant in variants:
                        res = run_one(dep, variant, kind, rate, args, image)
                        res.update(config=variant, workload=kind, rate=rate)
                        results.append(res)
                        print(f"  {variant} {kind} {rate:g} req/s: {len(res['ttfts'])} done, "
                              f"{res['encoder_runs']} encoder runs", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for dep in deployments:
            dep.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    order = {c: i for i, c in enumerate(CONFIGS)}
    results.sort(key=lambda r: (WORKLOADS.index(r["workload"]), r["rate"], order[r["config"]]))
    print(f"EPD benchmark, {started}, {os.cpu_count()} CPUs, load average "
          f"{load[0]:.1f} at start, {load_after[0]:.1f} at end")  # fmt: skip
    print(f"{args.requests} requests per run, {args.side}px images, {args.multi:.0%} with two, "
          f"zipf({args.zipf}) over {args.images} images; max_tokens {args.max_tokens}")  # fmt: skip
    print(table(HEADERS, rows_for(results)))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "started": started,
                    "load": [load, load_after],
                    "args": vars(args),
                    "results": results,
                },
                indent=1,
            )
        )
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
