"""Routing on encoder-cache residency, with real ``vllm serve``.

    .venv/bin/python benchmarks/routing.py                      # ~12 min on 2 cores (45 runs)
    .venv/bin/python benchmarks/routing.py --requests 8 --seeds 2 --scenarios local --policies rr,residency

Two "nodes", each a broker (residency events on, docs/events.md) with its own
``vllm serve`` of the tiny offline Qwen2-VL (ECBrokerConnector, ec_both,
``--enable-scale-out`` for the render endpoint). One ``lmcache-ec-aggregator``
process follows both brokers. A reference router sends each request to a node:

- ``rr``: round-robin;
- ``history``: llm-d-style affinity: a per-node LRU of the mm hashes the router sent
  there (sized from the slab: what the router *thinks* the node holds), plus the
  load term;
- ``residency``: what the brokers say they hold (aggregator ``/v1/lookup``: slab
  1.0, disk 0.7 per item), plus the load term.

Load term (both affinity policies): score = resident share of the request's items
- ``--load-weight`` x requests in flight on the node. ``history`` and ``residency``
get the request's mm hashes from vLLM's ``/v1/chat/completions/render``
(``mm_payload: none``), as llm-d's scorer does; ``rr`` needs none.

Workload: ``--images`` distinct images with Zipf(``--zipf``) popularity, one of
``--prompts`` prompts per request, ``--multi`` of the requests carry two images;
``--concurrency`` requests in flight. ``--seeds`` workloads (seeds ``--seed``,
``--seed``+1, ...); every policy runs each seed's same sequence, so policies compare
pair-wise per seed. Within a seed the (scenario, policy) runs go in an order shuffled
by that seed (recorded in the JSON), so no policy always runs first on a fresh host or
last on a warm one.

Scenarios: ``local`` (brokers with slab only), ``remote`` (both brokers share one
redis-server as their remote tier), ``evict`` (slab only; the first half is
routed round-robin for every policy -- both nodes get the popular images, the
history policy records where each went -- then node 0's broker is cleared and its
vLLM encoder cache reset, a server-side eviction the router did not cause; only the
second half, routed by the policy, is measured). Every
(scenario, policy, seed) run starts from empty caches: brokers restarted (vLLM
reconnects), Redis restarted, and on both vLLM servers ``/reset_mm_cache`` (the
multimodal processor cache: a run must not reuse the previous run's processed images)
then ``/reset_encoder_cache``.

Figures: encoder runs (the connector's stored puts: each is an encoder run; the
items the request carried minus those is what caching avoided: vLLM's own encoder
cache or the broker), broker hit rate (loads / (loads + encoder runs)), TTFT
p50/p90 (``max_tokens=1`` chat completion, routing time excluded and reported as
``route ms``), throughput (requests / wall time, routing included). Printed per run as it
goes, then per (scenario, policy) as mean ± sample standard deviation [min, max] over the
seeds, then per scenario the paired per-seed differences in encoder runs between policies
(how many seeds each policy ran fewer, as many, more). Encoder runs depend on timing too:
with requests in flight together, two nodes (or one node's two requests) may both encode
an item before either has stored it, and vLLM's own encoder cache keeps what the
scheduling order left in it; rerun a seed to see that share of the spread.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from redis_servers import REDIS_SERVER, RedisServer  # noqa: E402

from benchmarks._common import die_with_parent, exit_on_sigterm, percentile, table  # noqa: E402
from lmcache_ec_broker.testing.broker_process import BrokerProcess  # noqa: E402
from lmcache_ec_broker.testing.ports import free_ports

PROMPTS = [
    "describe the image",
    "what colours are in it?",
    "is there text in the picture?",
    "count the objects",
    "write a caption",
]
POLICIES = ("rr", "history", "residency")
SCENARIOS = ("local", "remote", "evict")
TIER_WEIGHT = {"slab": 1.0, "disk": 0.7, "remote": 0.4}
EC_PUT = re.compile(r"EC put: stored \d+ bytes for mm_hash=(\S+)")
EC_LOAD = re.compile(r"EC load: loaded \d+ bytes for mm_hash=(\S+)")


class NodeBroker:
    """One node's broker (the CLI) on a fixed socket and events port; restartable."""

    def __init__(self, work: Path, name: str, shm_mib: int) -> None:
        self.name = name
        self.socket_path = str(work / f"{name}.sock")
        self.port = free_ports(3)
        self.shm_mib = shm_mib
        self.log_path = work / f"broker-{name}.log"
        self.process: BrokerProcess | None = None

    def start(self, remote_url: str | None) -> None:
        env = {
            "LMCACHE_EC_EVENTS_PORT": str(self.port),
            "LMCACHE_EC_EVENTS_NODE": self.name,
            "LMCACHE_EC_EVENTS_HEARTBEAT_S": "0.5",
        }
        args = ["--shm-size", f"{self.shm_mib}MiB"]
        if remote_url:
            args += ["--remote-url", remote_url]
        self.process = BrokerProcess(
            self.socket_path, args, env, log_path=self.log_path, die_with_parent=True
        ).start(timeout=60)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = None


class Aggregator:
    def __init__(self, work: Path, ports: list[int]) -> None:
        self.port = free_ports(1)
        cmd = [sys.executable, "-m", "lmcache_ec_broker.events.aggregator", "--port"]
        cmd += [str(self.port), "--down-after", "3"]
        for p in ports:
            cmd += ["--broker", f"tcp://127.0.0.1:{p}"]
        self.log = open(work / "aggregator.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, preexec_fn=die_with_parent
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"aggregator did not start: {line}")
        self.url = f"http://127.0.0.1:{self.port}"

    def lookup(self, model: str, hashes: list[str]) -> list[list[dict[str, Any]]]:
        body = json.dumps({"model": model, "mm_hashes": hashes}).encode()
        req = urllib.request.Request(self.url + "/v1/lookup", data=body)
        with urllib.request.urlopen(req, timeout=10) as r:
            return [x["nodes"] for x in json.loads(r.read())["results"]]

    def nodes(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/v1/nodes", timeout=10) as r:
            return json.loads(r.read())["nodes"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        self.log.close()


# ---------------------------------------------------------------- workload


def zipf_workload(
    n_images: int, n_requests: int, s: float, prompts: int, multi: float, seed: int
) -> list[tuple[list[int], str]]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n_images)]
    out = []
    for _ in range(n_requests):
        n = 2 if rng.random() < multi else 1
        imgs: list[int] = []
        while len(imgs) < n:
            (k,) = rng.choices(range(n_images), weights)
            if k not in imgs:
                imgs.append(k)
        out.append((imgs, PROMPTS[rng.randrange(min(prompts, len(PROMPTS)))]))
    return out


def chat_body(model: str, urls: list[str], prompt: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": prompt})
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 1,
        "temperature": 0.0,
    }


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def render_hashes(server_url: str, body: dict[str, Any]) -> list[str]:
    """The request's mm hashes from vLLM's render endpoint (``--enable-scale-out``)."""
    reply = post(server_url + "/v1/chat/completions/render", {**body, "mm_payload": "none"})
    features = reply.get("features") or {}
    hashes = features.get("mm_hashes") or {}
    return [h for modality in sorted(hashes) for h in hashes[modality]]


# ---------------------------------------------------------------- router


class Router:
    def __init__(
        self,
        policy: str,
        nodes: list[str],
        urls: list[str],
        model: str,
        aggregator: Aggregator,
        lru_entries: int,
        load_weight: float,
    ) -> None:
        self.policy = policy
        self.nodes = nodes
        self.urls = urls
        self.model = model
        self.aggregator = aggregator
        self.load_weight = load_weight
        self.inflight = [0] * len(nodes)
        self.lock = threading.Lock()
        self.rr = 0
        self.history = [collections.OrderedDict[str, None]() for _ in nodes]
        self.lru_entries = lru_entries
        # Render and record history also while routing round-robin (the evict scenario's
        # warm phase: every policy then starts from the same placement and history).
        self.record = False

    def route(self, body: dict[str, Any]) -> int:
        if self.policy == "rr" and not self.record:
            with self.lock:
                i = self.rr % len(self.nodes)
                self.rr += 1
                self.inflight[i] += 1
                return i
        hashes = render_hashes(self.urls[self.rr % len(self.urls)], body)
        if self.policy == "rr":
            with self.lock:
                i = self.rr % len(self.nodes)
                self.rr += 1
                self.inflight[i] += 1
                self._remember(i, hashes)
                return i
        if self.policy == "residency":
            found = self.aggregator.lookup(self.model, hashes)
            held = [0.0] * len(self.nodes)
            for where in found:
                for w in where:
                    if w["node"] in self.nodes:
                        best = max(TIER_WEIGHT.get(t, 0.0) for t in w["tiers"])
                        held[self.nodes.index(w["node"])] += best
        with self.lock:
            if self.policy == "history":
                held = [sum(h in lru for h in hashes) for lru in self.history]
            n = max(len(hashes), 1)
            scores = [
                held[i] / n - self.load_weight * self.inflight[i] for i in range(len(self.nodes))
            ]
            top = max(scores)
            ties = [i for i, s in enumerate(scores) if s == top]
            i = ties[self.rr % len(ties)]
            self.rr += 1
            self.inflight[i] += 1
            self._remember(i, hashes)
            return i

    def _remember(self, i: int, hashes: list[str]) -> None:
        """The history policy's view: node ``i`` now holds ``hashes`` (an LRU sized
        from the node's cache size, as llm-d's scorer keeps one per pod)."""
        lru = self.history[i]
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.lru_entries:
            lru.popitem(last=False)

    def done(self, i: int) -> None:
        with self.lock:
            self.inflight[i] -= 1


# ---------------------------------------------------------------- one run


def counts(servers: list[Any]) -> tuple[int, int]:
    puts = loads = 0
    for s in servers:
        text = s.log_text()
        puts += len(EC_PUT.findall(text))
        loads += len(EC_LOAD.findall(text))
    return puts, loads


def run_requests(
    router: Router,
    servers: list[Any],
    model: str,
    workload: list[tuple[list[int], str]],
    image: Any,
    concurrency: int,
) -> dict[str, Any]:
    ttfts: list[float] = []
    route_ms: list[float] = []
    errors: list[str] = []
    per_node = [0] * len(servers)
    it = iter(list(workload))
    it_lock = threading.Lock()

    def worker() -> None:
        while True:
            with it_lock:
                job = next(it, None)
            if job is None:
                return
            imgs, prompt = job
            body = chat_body(model, [image(k) for k in imgs], prompt)
            t0 = time.perf_counter()
            try:
                i = router.route(body)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                errors.append(f"route: {exc}")
                continue
            t1 = time.perf_counter()
            try:
                post(servers[i].url + "/v1/chat/completions", body)
                ttfts.append(time.perf_counter() - t1)
                route_ms.append((t1 - t0) * 1e3)
                per_node[i] += 1
            except Exception as exc:  # noqa: BLE001
                errors.append(f"node {i}: {exc}")
            finally:
                router.done(i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "ttfts": ttfts,
        "route_ms": route_ms,
        "errors": errors,
        "per_node": per_node,
        "wall_s": wall,
        "items": sum(len(imgs) for imgs, _ in workload),
        "requests": len(workload),
    }


def wait_connected(brokers: list[NodeBroker], servers: list[Any], model: str, image: Any) -> None:
    """After a broker restart: one unmeasured request per node (image id -1), until
    each broker serves vLLM's connector again."""
    from lmcache_ec_broker import BrokerClient

    for b, s in zip(brokers, servers, strict=True):
        deadline = time.monotonic() + 60
        while True:
            post(s.url + "/v1/chat/completions", chat_body(model, [image(-1)], "warm up"))
            with BrokerClient(b.socket_path) as c:
                if int(c.stats().get("clients", 0)) >= 2:  # vLLM's + ours
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not reconnect to broker {b.name}")
            time.sleep(0.5)


def reset_vllm_caches(servers: list[Any]) -> list[str]:
    """Empty both vLLM servers' multimodal processor cache (``/reset_mm_cache``) and then
    their encoder cache (``/reset_encoder_cache``), so a run reuses nothing of the previous
    one (both endpoints need ``VLLM_SERVER_DEV_MODE=1``, set by ``VllmServer``). The
    caches reset, in order."""
    for s in servers:
        req = urllib.request.Request(s.url + "/reset_mm_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"{s.url}/reset_mm_cache answered {r.status}")
        s.reset_encoder_cache()
    return ["mm", "encoder"]


def one_run(
    scenario: str,
    policy: str,
    env: dict[str, Any],
    workload: list[tuple[list[int], str]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    brokers: list[NodeBroker] = env["brokers"]
    servers = env["servers"]
    redis = env["redis"]
    remote_url = None
    if scenario == "remote":
        redis.restart()
        remote_url = redis.url("unix")
    for b in brokers:
        b.stop()
        b.start(remote_url)
    wait_connected(brokers, servers, env["model"], env["image"])
    caches_reset = reset_vllm_caches(servers)
    agg: Aggregator = env["aggregator"]
    deadline = time.monotonic() + 30
    while not all(n.get("live") for n in agg.nodes().values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"aggregator did not follow the restarted brokers: {agg.nodes()}")
        time.sleep(0.2)
    router = Router(
        policy,
        [b.name for b in brokers],
        [s.url for s in servers],
        env["model"],
        agg,
        env["lru_entries"],
        args.load_weight,
    )
    measured = workload
    if scenario == "evict":
        # The first half is routed round-robin for every policy (both nodes end up with
        # the popular images; the history policy records where each went), then node 0
        # loses everything it held; only the second half, routed by the policy, counts.
        half = len(workload) // 2
        router.policy, router.record = "rr", True
        run_requests(router, servers, env["model"], workload[:half], env["image"], args.concurrency)
        router.policy, router.record = policy, False
        from lmcache_ec_broker import BrokerClient

        with BrokerClient(brokers[0].socket_path) as c:
            c.clear()
        servers[0].reset_encoder_cache()
        # The removals reach the aggregator (tens of ms): until it no longer places on
        # node 0 anything the warm phase sent there, the residency policy would route on
        # stale data.
        sent = list(router.history[0])
        deadline = time.monotonic() + 30
        while sent and any(
            w["node"] == brokers[0].name for where in agg.lookup(env["model"], sent) for w in where
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the aggregator still places cleared entries on node 0")
            time.sleep(0.05)
        measured = workload[half:]
    before = counts(servers)
    res = run_requests(router, servers, env["model"], measured, env["image"], args.concurrency)
    after = counts(servers)
    res["encoder_runs"] = after[0] - before[0]
    res["loads"] = after[1] - before[1]
    res["caches_reset"] = caches_reset
    return res


def summarize(scenario: str, policy: str, seed: int, res: dict[str, Any]) -> list[Any]:
    """One run's row (printed as the runs go)."""
    runs, items = res["encoder_runs"], res["items"]
    t = res["ttfts"]
    return [
        scenario,
        policy,
        seed,
        f"{res['requests']}/{items}",
        runs,
        f"{items - runs} ({(items - runs) / items:.0%})" if items else "-",
        f"{hit_rate(res):.0%}",
        f"{percentile(t, 0.5) * 1e3:.0f}" if t else "-",
        f"{percentile(t, 0.9) * 1e3:.0f}" if t else "-",
        f"{len(t) / res['wall_s']:.2f}",
        f"{percentile(res['route_ms'], 0.5):.1f}" if res["route_ms"] else "-",
        "/".join(map(str, res["per_node"])),
        len(res["errors"]),
    ]


RUN_HEADERS = [
    "scenario", "policy", "seed", "req/items", "encoder runs", "runs avoided", "broker hit",
    "TTFT p50 ms", "TTFT p90 ms", "req/s", "route ms", "per node", "errors",
]  # fmt: skip


def hit_rate(res: dict[str, Any]) -> float:
    runs, loads = res["encoder_runs"], res["loads"]
    return loads / (loads + runs) if loads + runs else 0.0


def spread(xs: list[float], fmt: str = ".1f", scale: float = 1.0) -> str:
    """``mean ± sample sd [min, max]`` of ``xs`` (each times ``scale``)."""
    xs = [x * scale for x in xs if x == x]  # NaN (a run with no TTFT) left out
    if not xs:
        return "-"
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


SPREAD_HEADERS = [
    "scenario", "policy", "seeds", "items", "encoder runs", "runs / item", "broker hit %",
    "TTFT p50 ms", "TTFT p90 ms", "req/s", "errors",
]  # fmt: skip


def spread_rows(
    runs: list[dict[str, Any]], scenarios: list[str], policies: list[str]
) -> list[list[Any]]:
    """Per (scenario, policy): each figure as mean ± sd [min, max] over the seeds."""
    rows = []
    for sc in scenarios:
        for po in policies:
            rs = [r for r in runs if r["scenario"] == sc and r["policy"] == po]
            if not rs:
                continue
            rows.append(
                [
                    sc,
                    po,
                    len(rs),
                    spread([r["items"] for r in rs]),
                    spread([r["encoder_runs"] for r in rs]),
                    spread([r["encoder_runs"] / r["items"] for r in rs], ".2f"),
                    spread([hit_rate(r) for r in rs], ".0f", 100),
                    spread([percentile(r["ttfts"], 0.5) for r in rs], ".0f", 1e3),
                    spread([percentile(r["ttfts"], 0.9) for r in rs], ".0f", 1e3),
                    spread([len(r["ttfts"]) / r["wall_s"] for r in rs], ".2f"),
                    sum(len(r["errors"]) for r in rs),
                ]
            )
    return rows


PAIR_HEADERS = [
    "scenario", "comparison", "encoder runs saved per seed", "mean ± sd [min, max]",
    "fewer / as many / more runs (seeds)",
]  # fmt: skip
PAIRS = (("residency", "rr"), ("residency", "history"), ("history", "rr"))


def pair_rows(
    runs: list[dict[str, Any]], scenarios: list[str], seeds: list[int]
) -> list[list[Any]]:
    """Per scenario and policy pair (a, b): b's encoder runs minus a's on each seed's
    same workload (positive: a ran the encoder fewer times), and in how many seeds a ran
    fewer, as many, more."""
    by = {(r["scenario"], r["policy"], r["seed"]): r["encoder_runs"] for r in runs}
    rows = []
    for sc in scenarios:
        for a, b in PAIRS:
            d = [
                by[sc, b, s] - by[sc, a, s] for s in seeds if (sc, a, s) in by and (sc, b, s) in by
            ]
            if not d:
                continue
            rows.append(
                [
                    sc,
                    f"{a} vs {b}",
                    " ".join(f"{x:+d}" for x in d),
                    spread(d),
                    f"{sum(x > 0 for x in d)} / {sum(x == 0 for x in d)} / {sum(x < 0 for x in d)}",
                ]
            )
    return rows


def check_render_matches(env: dict[str, Any]) -> str:
    """Do the render endpoint's mm hashes name the brokers' keys? (one request)"""
    servers, agg = env["servers"], env["aggregator"]
    body = chat_body(env["model"], [env["image"](-2)], "check")
    hashes = render_hashes(servers[0].url, body)
    post(servers[0].url + "/v1/chat/completions", body)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = agg.lookup(env["model"], hashes)
        if hashes and all(found):
            return f"yes ({hashes[0][:16]}... found on {found[0][0]['node']})"
        time.sleep(0.2)
    return f"NO: render gave {hashes}, the brokers hold none of them under model {env['model']}"


def routing_spec(side: int) -> Any:
    """The tiny Qwen2-VL with images kept at ``side`` pixels (``side``/28 squared tokens)
    and a vision tower heavy enough to be a visible share of prefill."""
    from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec

    return TinyQwen2VLSpec(
        hidden_size=512,
        intermediate_size=1024,
        num_heads=4,
        num_kv_heads=4,
        vision_depth=4,
        vision_embed_dim=256,
        vision_heads=4,
        vision_mlp_ratio=4,
        min_pixels=56 * 56,
        max_pixels=side * side,
    )


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=24, help="distinct images")
    p.add_argument("--requests", type=int, default=48, help="requests per run")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of image popularity")
    p.add_argument("--prompts", type=int, default=3, help="prompts per image")
    p.add_argument("--multi", type=float, default=0.2, help="share of two-image requests")
    p.add_argument(
        "--side",
        type=int,
        default=448,
        help="image side in pixels (448: 256 tokens each; vLLM's own encoder cache, 512 tokens, then holds 2)",
    )
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--load-weight", type=float, default=0.5)
    p.add_argument("--shm-mib", type=int, default=64, help="each broker's slab")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--seed", type=int, default=1, help="first workload seed")
    p.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="workloads (seeds --seed, --seed+1, ...); every policy runs each; >= 2 for a spread",
    )
    p.add_argument("--models", default=None, help="model cache root (default: a temp dir)")
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args()
    policies = [x for x in args.policies.split(",") if x]
    scenarios = [x for x in args.scenarios.split(",") if x]
    for x in policies:
        if x not in POLICIES:
            p.error(f"unknown policy {x!r}; choose from {', '.join(POLICIES)}")
    for x in scenarios:
        if x not in SCENARIOS:
            p.error(f"unknown scenario {x!r}; choose from {', '.join(SCENARIOS)}")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give at least 1 (5 or more for a spread worth quoting)")
    notes = []
    if "remote" in scenarios and REDIS_SERVER is None:
        scenarios.remove("remote")
        notes.append(
            "remote: SKIPPED, redis-server is not installed (apt-get install redis-server)"
        )

    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl, image_tokens
    from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config, png_data_url

    work = Path(tempfile.mkdtemp(prefix="ecb-route-", dir="/tmp"))
    spec = routing_spec(args.side)
    model = str(build_tiny_qwen2vl(Path(args.models) if args.models else work / "models", spec))
    images: dict[int, str] = {}

    def image(k: int) -> str:
        if k not in images:
            images[k] = png_data_url(1000 + k, args.side)
        return images[k]

    seeds = list(range(args.seed, args.seed + args.seeds))
    workloads = {
        sd: zipf_workload(args.images, args.requests, args.zipf, args.prompts, args.multi, sd)
        for sd in seeds
    }
    # Each seed's runs in an order that seed shuffles (a fresh host, or one warm from the
    # last run, favours no policy on average).
    order: list[tuple[int, str, str]] = []
    for sd in seeds:
        runs_of_seed = [(sd, sc, po) for sc in scenarios for po in policies]
        random.Random(f"order-{sd}").shuffle(runs_of_seed)
        order += runs_of_seed
    rows: list[list[Any]] = []
    raw: dict[str, Any] = {"args": vars(args), "order": order, "runs": []}
    keep = bool(os.environ.get("LMCACHE_EC_KEEP_BENCH"))
    cores = os.cpu_count() or 1
    ok = False
    try:
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(RedisServer(tcp=False)) if "remote" in scenarios else None
            brokers = [NodeBroker(work, f"node{i}", args.shm_mib) for i in range(2)]
            for b in brokers:
                stack.callback(b.stop)
                b.start(None)
            servers = []
            for i, b in enumerate(brokers):
                s = VllmServer(
                    model,
                    work / f"vllm-{b.name}.log",
                    ec_config=ec_transfer_config("ec_both", b.socket_path),
                    extra_args=[
                        "--enable-scale-out",
                        "--limit-mm-per-prompt",
                        '{"image": 2, "video": 0}',
                        "--max-model-len",
                        "1024",
                        "--max-num-batched-tokens",
                        "512",
                    ],
                    env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
                )
                servers.append(s)
                stack.callback(s.stop)
                s.start()
            t0 = time.monotonic()
            for s in servers:
                s.wait_ready(timeout=900)
            print(f"  2 vllm serve ready in {time.monotonic() - t0:.0f}s", file=sys.stderr)
            agg = Aggregator(work, [b.port for b in brokers])
            stack.callback(agg.stop)
            # what the history policy assumes a node holds: the slab / one image's entry
            entry_guess = image_tokens(spec, args.side, args.side) * spec.hidden_size * 2
            env = {
                "brokers": brokers,
                "servers": servers,
                "redis": redis,
                "aggregator": agg,
                "model": model,
                "image": image,
                "lru_entries": max(1, args.shm_mib * (1 << 20) // entry_guess),
            }
            match = check_render_matches(env)
            print(f"  render hashes name the brokers' keys: {match}", file=sys.stderr)
            for index, (sd, scenario, policy) in enumerate(order):
                print(
                    f"  run {index + 1}/{len(order)}: seed {sd} {scenario}/{policy} ...",
                    file=sys.stderr,
                    flush=True,
                )
                res = one_run(scenario, policy, env, workloads[sd], args)
                rows.append(summarize(scenario, policy, sd, res))
                raw["runs"].append(
                    {"index": index, "seed": sd, "scenario": scenario, "policy": policy, **res}
                )
                print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
        ok = True
    finally:
        if keep or not ok:
            print(f"  logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"\nRouting on encoder-cache residency: 2 nodes (broker + vllm serve of the tiny "
        f"Qwen2-VL each), {args.images} images Zipf({args.zipf}), {args.requests} requests "
        f"({args.multi:.0%} with two images), concurrency {args.concurrency}, "
        f"{args.side}px, load weight {args.load_weight}; seeds {seeds[0]}-{seeds[-1]}, "
        f"{cores} CPUs, load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"render hashes name the brokers' keys: {match}")
    for n in notes:
        print(n)
    print("\nEach run (in the order run):")
    print(table(RUN_HEADERS, rows))
    print(f"\nPer scenario and policy, mean ± sd [min, max] over {len(seeds)} seeds:")
    print(table(SPREAD_HEADERS, spread_rows(raw["runs"], scenarios, policies)))
    pairs = pair_rows(raw["runs"], scenarios, seeds)
    if pairs:
        print(
            f"\nEncoder runs saved by the first policy against the second, paired by seed (over {len(seeds)} seeds):"
        )
        print(table(PAIR_HEADERS, pairs))
    if args.json:
        raw["render_match"] = match
        raw["loadavg_end"] = load
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0 if all(r[-1] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
