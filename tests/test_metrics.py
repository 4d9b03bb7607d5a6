"""Prometheus endpoint: scrape a real broker and compare with `lmcache-ec-broker stats`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rawproto import RawConn

from lmcache_ec_broker.broker.metrics import LatencyRecorder
from lmcache_ec_broker.protocol import Get, Has

_WORK = """
import sys, torch
from lmcache_ec_broker import BrokerClient
c = BrokerClient(sys.argv[1], filter_trust_s=0)  # every has() reaches the broker
t = torch.ones(64, 1024, dtype=torch.bfloat16)   # 128 KiB
for i in range(5):
    assert c.put(f"k{i}", t)
for i in range(3):
    assert c.get(f"k{i}") is not None
assert c.get("absent") is None
assert c.has(["k0", "k1", "absent"]) == [True, True, False]
c.close()
"""


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def _cli_stats(sock: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_ec_broker.cli", "stats", "--json", "--reply-timeout", "30",
         "--socket", sock],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_scrape_matches_stats(make_broker) -> None:
    port = _free_port()
    # Puts on the reserve path (counted as op=reserve below): no put arena, which a 4 MiB
    # slab is also too small for at its default size.
    b = make_broker(
        "--shm-size", "4MiB", "--block-size", "64KiB", "--metrics-port", str(port),
        "--put-arena-size", "0",
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", _WORK, b.socket_path], check=True, timeout=60)
    # 4 MiB holds 32 entries of 128 KiB: fill past it to force evictions.
    fill = _WORK.replace("range(5)", "range(5, 45)").replace("range(3)", "range(0)")
    fill = fill.replace('assert c.has(["k0", "k1", "absent"]) == [True, True, False]', "")
    subprocess.run([sys.executable, "-c", fill, b.socket_path], check=True, timeout=60)
    # The work processes have exited; let the broker notice their connections closed.
    deadline = time.monotonic() + 30  # a condition, not a window: 30 s for a loaded host
    while (m := _scrape(port))["lmcache_ec_broker_clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = _cli_stats(b.socket_path)
    p = "lmcache_ec_broker_"
    assert m[p + "hits_total"] == stats["hits"] == 3
    assert m[p + "misses_total"] == stats["misses"] == 2
    assert m[p + "has_hits_total"] == stats["has_hits"] == 2
    assert m[p + "has_misses_total"] == stats["has_misses"] == 1
    assert m[p + "puts_total"] == stats["puts"] == 45
    assert m[p + "bytes_stored_total"] == stats["bytes_stored"] == 45 * 128 * 1024
    assert m[p + "bytes_loaded_total"] == stats["bytes_loaded"] == 3 * 128 * 1024
    assert m[p + "evictions_total"] == stats["evictions"] >= 13
    assert m[p + "entries"] == stats["entries"] <= 32
    assert m[p + "used_bytes"] == stats["used_bytes"]
    assert m[p + "capacity_bytes"] == stats["capacity_bytes"] == 4 << 20
    assert m[p + "promotions_total"] == stats["promotions"] == 0
    assert m[p + "clients"] == 0  # the scrape is not a client
    # Latency histograms by operation, and the same counts in `stats`.
    assert m[p + "request_seconds_count{op=reserve}"] == 45
    assert m[p + "request_seconds_count{op=get}"] == 5
    assert m[p + "request_seconds_bucket{le=+Inf,op=has}"] == 1
    assert m[p + "request_seconds_sum{op=has}"] > 0
    assert stats["requests_reserve"] == 45 and stats["latency_reserve_p50_us"] > 0


def test_metrics_off_by_default(broker) -> None:
    stats = _cli_stats(broker.socket_path)
    assert not any(k.startswith("latency_") for k in stats)


def test_taken_port_is_a_clear_refusal(make_broker) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match="--metrics-port"):
            make_broker("--shm-size", "4MiB", "--put-arena-size", "0", "--metrics-port", str(port))
    finally:
        blocker.close()


def test_latency_recorder_quantiles() -> None:
    rec = LatencyRecorder()
    for _ in range(98):
        rec.observe("Has", 15e-6)
    rec.observe("Has", 3e-3)
    rec.observe("Has", 30.0)
    s = rec.stats()
    assert s["requests_has"] == 100
    assert s["latency_has_p50_us"] == 20.0  # upper bound of the 10-20 us bucket
    assert s["latency_has_p99_us"] == 5000.0


def test_refusals_at_the_per_connection_caps_are_counters(make_broker) -> None:
    port = _free_port()
    b = make_broker(
        "--shm-size", "4MiB", "--put-arena-size", "0", "--metrics-port", str(port),
        "--max-pins-per-connection", "1", "--max-leases-per-connection", "1",
    )  # fmt: skip
    subprocess.run([sys.executable, "-c", _WORK, b.socket_path], check=True, timeout=60)
    raw = RawConn(b.socket_path)
    assert raw.call(Get(["k0"])).items[0] is not None
    assert raw.call(Get(["k0"])).code == "too_many_pins"
    assert raw.call(Has(["k0", "k1"], lease_ms=10_000)).code == "too_many_leases"
    raw.close()
    m = _scrape(port)
    p = "lmcache_ec_broker_"
    assert m[p + "pin_limit_refusals_total"] == 1
    assert m[p + "lease_limit_refusals_total"] == 1
    assert m[p + "max_pins_per_connection"] == 1
