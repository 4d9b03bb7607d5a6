"""Prometheus endpoint (``--metrics-port``, off by default; bound to ``--metrics-host``,
127.0.0.1 unless set) and request latency histograms.

Hot-path cost: one ``bisect`` and three integer updates per request, on the
broker's loop (``BrokerServer.observers``). Everything else -- counters, gauges,
hit-ratio inputs -- is read from ``BrokerServer.stats()`` at scrape time, so a
scrape shows exactly what ``lmcache-ec-broker stats`` shows. The snapshot is
taken on the broker's loop thread (the HTTP server runs in its own thread and
must not read the store while the loop mutates it).

Note: misses a client answers from the shared-memory membership filter never
reach the broker, so ``has_misses`` counts only the misses the broker saw.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from .coordinator import COORDINATOR_COUNTERS
from .lifecycle import BrokerError
from .server import SERVER_COUNTERS
from .store import STORE_COUNTERS
from .tiers import tier_counter_names

if TYPE_CHECKING:
    from .server import BrokerServer

log = logging.getLogger(__name__)

PREFIX = "lmcache_ec_broker"

# Seconds. Control requests take tens of microseconds; disk promotions milliseconds.
BUCKETS: tuple[float, ...] = (
    5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 100e-3, 500e-3, 1.0, 5.0,
)  # fmt: skip

# Monotonic counters among the stats keys (the rest are gauges or labels).
COUNTERS = frozenset(STORE_COUNTERS + COORDINATOR_COUNTERS + SERVER_COUNTERS + tier_counter_names())

_HELP = {
    "hits": "get() keys served from the broker (hit-ratio numerator)",
    "misses": "get() keys not found",
    "has_hits": "has() keys found (what the scheduler saw as hits)",
    "has_misses": "has() keys not found by the broker (client-local filter misses excluded)",
    "bytes_stored": "bytes committed into the slab",
    "bytes_loaded": "bytes handed out to readers by get()",
    "evictions": "entries evicted from the slab by LRU",
    "reserve_limit_refusals": "reserves refused at a reservation limit (per connection, "
    "process or uid: max_reserved_bytes_per_connection, max_held_bytes_per_*, "
    "max_reservations_per_*)",
    "reservations_expired": "client reservations that lapsed uncommitted (reservation_ttl_s)",
    "promotions": "entries promoted from a lower tier (disk, remote) into the slab",
    "promotion_failures": "promotions that failed (no space, corrupt or vanished copy, tier down)",
    "entries": "ready entries in the slab",
    "used_bytes": "slab bytes held by ready entries",
    "capacity_bytes": "slab capacity",
    "clients": "open client connections",
}


class LatencyRecorder:
    """Per-operation histograms with fixed buckets; ``observe`` is the hot path."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.bounds = list(buckets)
        # op -> [bucket counts..., +Inf count]; sums and totals kept apart for speed.
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(self.bounds) + 1)
            self.sums[op] = 0.0
        counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sums[op] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        return {op: (list(c), self.sums[op]) for op, c in list(self.counts.items())}

    def quantile(self, counts: list[int], q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (inf past the last bucket)."""
        total = sum(counts)
        if not total:
            return 0.0
        rank, seen = q * total, 0
        for i, c in enumerate(counts):
            seen += c
            if seen >= rank:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def stats(self) -> dict[str, int | float]:
        """Per op: request count and p50/p99 upper bounds in microseconds."""
        out: dict[str, int | float] = {}
        for op, (counts, _) in sorted(self.snapshot().items()):
            name = op.lower()
            out[f"requests_{name}"] = sum(counts)
            out[f"latency_{name}_p50_us"] = round(self.quantile(counts, 0.5) * 1e6, 1)
            out[f"latency_{name}_p99_us"] = round(self.quantile(counts, 0.99) * 1e6, 1)
        return out


def _metric_name(key: str) -> str:
    return f"{PREFIX}_{key}"


class BrokerCollector(Collector):
    def __init__(
        self, stats: Callable[[], dict[str, int | float | str]], latency: LatencyRecorder
    ) -> None:
        self._stats = stats
        self._latency = latency

    def collect(self) -> Iterator:
        stats = self._stats()
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if key.startswith(("latency_", "requests_", "remote_latency_")):
                continue  # exported as histograms below
            doc = _HELP.get(key, key.replace("_", " "))
            if key in COUNTERS:
                yield CounterMetricFamily(_metric_name(key), doc, value=value)
            else:
                yield GaugeMetricFamily(_metric_name(key), doc, value=value)
        info = GaugeMetricFamily(
            _metric_name("info"), "broker identity", labels=["epoch", "segment", "socket"]
        )
        info.add_metric(
            [
                str(stats.get("epoch", "")),
                str(stats.get("segment", "")),
                str(stats.get("socket", "")),
            ],
            1,
        )
        yield info
        hist = HistogramMetricFamily(
            _metric_name("request_seconds"),
            "broker-side request latency (decode to reply queued), by operation",
            labels=["op"],
        )
        bounds = self._latency.bounds
        for op, (counts, total) in sorted(self._latency.snapshot().items()):
            cumulative, running = [], 0
            for bound, c in zip([*bounds, float("inf")], counts, strict=True):
                running += c
                cumulative.append((_le(bound), running))
            hist.add_metric([op.lower()], cumulative, total)
        yield hist
        remote = _remote_latency(stats)
        if remote is not None:
            yield remote


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class MetricsEndpoint:
    """The HTTP endpoint bound to one broker; ``close`` stops it."""

    def __init__(self, server: BrokerServer, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        self.server = server
        self.latency = LatencyRecorder()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BrokerCollector(self._snapshot, self.latency))
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        self._thread: threading.Thread = thread
        self.port = httpd.server_address[1]

    def _snapshot(self) -> dict[str, int | float | str]:
        loop = self.server.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return self.server.stats()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                fut.set_result(self.server.stats())
            except BaseException as exc:
                fut.set_exception(exc)

        loop.call_soon_threadsafe(take)
        return fut.result(timeout=5)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start(server: BrokerServer) -> MetricsEndpoint:
    """The add-on (``run.py``): ``install`` on ``metrics_host:metrics_port``, or
    BrokerError naming the fix."""
    host, port = server.config.metrics_host, server.config.metrics_port
    try:
        return install(server, port, host)
    except OSError as exc:
        raise BrokerError(
            f"cannot serve metrics on {host}:{port}: {exc}; choose another "
            "--metrics-port (0 turns metrics off) or --metrics-host (an address of this host)"
        ) from exc


def install(server: BrokerServer, port: int, host: str = "127.0.0.1") -> MetricsEndpoint:
    """Start the endpoint and hook it into the server; OSError if the port is taken."""
    endpoint = MetricsEndpoint(server, port, host)
    server.observers.append(endpoint.latency.observe)
    server.stats_providers.append(endpoint.latency.stats)
    server.shutdown_hooks.append(endpoint.close)
    log.info("Prometheus metrics on http://%s:%d/metrics", host, endpoint.port)
    return endpoint


def _remote_latency(stats: dict[str, int | float | str]) -> HistogramMetricFamily | None:
    """The remote tier's round-trip histogram from its cumulative ``remote_latency_ms_le_<B>``
    counters (B in ms, then ``inf``) and ``remote_latency_seconds_sum``."""
    buckets: list[tuple[float, int]] = []
    for key, value in stats.items():
        if key.startswith("remote_latency_ms_le_") and isinstance(value, int):
            bound = key.removeprefix("remote_latency_ms_le_")
            buckets.append((float("inf") if bound == "inf" else float(bound) / 1000.0, value))
    if not buckets:
        return None
    buckets.sort()
    hist = HistogramMetricFamily(
        _metric_name("remote_latency_seconds"),
        "remote tier round trips (lookups, reads, writes), by duration",
    )
    total = stats.get("remote_latency_seconds_sum", 0.0)
    hist.add_metric(
        [],
        [(_le(b), c) for b, c in buckets],
        float(total) if isinstance(total, int | float) else 0.0,
    )
    return hist
