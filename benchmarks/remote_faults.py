"""What a slow, full or dead remote store costs one node (docs/scaling.md).

A real redis-server, a real broker (the CLI) that reaches it through a delaying TCP
proxy (tests/delay_proxy.py), and a second broker that seeds a stored entry. For each
condition of the store, the node's costs: a put (2 MiB), a local hit, a lookup of an
input nobody has seen (``remote_filter_keys: 0`` so that every lookup asks the
store), a get of the entry the store holds (a promotion), and what became of the
write-behinds. Conditions:

- healthy; slow (every reply 50 ms / 300 ms late, ``remote_timeout_s`` 0.5);
  slower than the timeout (800 ms);
- full (``maxmemory`` 1 MB, ``noeviction``: every SET is refused);
- dead (the server killed).

Run: ``python benchmarks/remote_faults.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from delay_proxy import DelayProxy  # noqa: E402
from redis_servers import RedisServer  # noqa: E402

from benchmarks._common import Broker, MiB, percentile, table  # noqa: E402

TIMEOUT_S = 0.5


def _config(url: str, path: str, **extra: object) -> list[str]:
    lines = [f"remote_url: '{url}'", f"remote_timeout_s: {TIMEOUT_S}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return ["--config", path]


def _ms(xs: list[float], q: float) -> float:
    return percentile(xs, q) * 1000 if xs else float("nan")


def measure(label: str, setup: Any, puts: int, lookups: int) -> dict[str, Any]:
    import torch

    from lmcache_ec_broker import BrokerClient

    srv = RedisServer()
    proxy = DelayProxy(srv.port)
    t = torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8)
    try:
        with Broker(
            64 * MiB, _config(srv.url("unix"), f"/tmp/ecb-faults-w-{os.getpid()}.yaml")
        ) as w:
            cw = BrokerClient(w.socket_path, timeout_s=30)
            assert cw.put("seeded", t)
            deadline = time.monotonic() + 30
            while cw.stats()["remote_writes"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            cw.close()
        cfg = _config(proxy.url(), f"/tmp/ecb-faults-n-{os.getpid()}.yaml", remote_filter_keys=0)
        with Broker(256 * MiB, cfg) as node:
            c = BrokerClient(node.socket_path, timeout_s=60, filter_trust_s=-1.0)
            deadline = time.monotonic() + 30
            while not c.stats()["remote_up"] and time.monotonic() < deadline:
                time.sleep(0.02)
            setup(srv, proxy)
            time.sleep(0.2)
            put_lat, local, look = [], [], []
            for i in range(puts):
                t0 = time.perf_counter()
                assert c.put(f"{label}-{i}", t)
                put_lat.append(time.perf_counter() - t0)
            for _ in range(20):
                t0 = time.perf_counter()
                assert c.get(f"{label}-0") is not None
                local.append(time.perf_counter() - t0)
            for i in range(lookups):
                t0 = time.perf_counter()
                c.has([f"{label}-new-{i}"])
                look.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hit = c.get("seeded") is not None
            promo = time.perf_counter() - t0
            deadline = time.monotonic() + 15
            while c.stats()["remote_pending_writes"] and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c.stats()
            c.close()
        return {
            "store": label,
            "put p50": f"{_ms(put_lat, 0.5):.2f} ms",
            "put p99": f"{_ms(put_lat, 0.99):.2f} ms",
            "local hit p50": f"{_ms(local, 0.5):.2f} ms",
            "new-input lookup p50 / max": f"{_ms(look, 0.5):.0f} / {max(look) * 1000:.0f} ms",
            "stored entry": f"{'hit' if hit else 'miss'}, {promo * 1000:.0f} ms",
            "write-behind stored/dropped/failed/pending": (
                f"{st['remote_writes']}/{st['remote_write_drops']}/{st['remote_write_errors']}"
                f"/{st['remote_pending_writes']}"
            ),
            "breaker opened": st["remote_circuit_opens"],
        }
    finally:
        proxy.close()
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--puts", type=int, default=20)
    ap.add_argument("--lookups", type=int, default=20)
    args = ap.parse_args()

    def delay(s: float) -> Any:
        def setup(srv: RedisServer, proxy: DelayProxy) -> None:
            proxy.reply_delay_s = s

        return setup

    def full(srv: RedisServer, proxy: DelayProxy) -> None:
        srv.cli("config", "set", "maxmemory-policy", "noeviction")
        srv.cli("config", "set", "maxmemory", "1mb")

    def dead(srv: RedisServer, proxy: DelayProxy) -> None:
        srv.kill()

    rows = [
        measure("healthy", delay(0.0), args.puts, args.lookups),
        measure("slow 50 ms", delay(0.05), args.puts, args.lookups),
        measure("slow 300 ms", delay(0.3), args.puts, args.lookups),
        measure("slower than timeout (800 ms)", delay(0.8), args.puts, args.lookups),
        measure("full (noeviction)", full, args.puts, args.lookups),
        measure("dead", dead, args.puts, args.lookups),
    ]
    print(f"remote_timeout_s {TIMEOUT_S}; 2 MiB entries; every lookup asks the store\n")
    print(table(list(rows[0]), [[str(r[k]) for k in rows[0]] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
