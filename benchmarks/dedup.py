"""In-flight deduplication at the broker level: N client processes race on the same
cold items; encoder runs per distinct item with and without encode claims, on one
broker and on two brokers sharing a real redis-server.

    .venv/bin/python benchmarks/dedup.py                       # 4 clients, 5 rounds
    .venv/bin/python benchmarks/dedup.py --clients 4 --rounds 2 --items 4 --quick

Each client process plays a vLLM scheduler + encoder meeting a burst of requests:
per round every client gets the same ``--items`` new items, one request each, in the
same order, all starting at the same instant. Per item:

- without claims (today): ``lookup`` -> MISS -> "encode" -> ``put``; READY -> ``get``;
- with claims: ``lookup(claim_ms=...)`` -> MISS -> encode -> put; CLAIMED ->
  ``wait_ready`` (deadline ``--wait-ms``) -> READY/PENDING -> ``get``, or encode what
  it answers MISS/CLAIMED.

"Encode" is ``--encode-ms`` of wall time (a stand-in for the encoder's GPU time: the
client sleeps, so the 2 CPUs stay with the broker and the store) and then the item's
tensor (``--size``) is made and put. Reported per setup and mode: encoder runs per
distinct item (1.00 = each encoded once), and the p50/p99 time from a client's
lookup to holding the item (a waiter's time includes the wait for the claimant's
encode). With two brokers the clients are split evenly; each broker has a remote tier
on the same redis-server (Unix socket), so cross-node waits go through fleet claims
and write-behind + announcement + promotion.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from benchmarks._common import Broker, MiB, Worker, median, percentile, serve_worker, table  # noqa: E402

# ---------------------------------------------------------------- worker


def worker_main(sock: str) -> None:
    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.protocol import LookupState

    c = BrokerClient(sock, timeout_s=60, connect_timeout_s=60)
    loadable = (LookupState.READY, LookupState.PENDING)

    def race(
        keys: list[str], claims: bool, start_at: float, encode_ms: float, nbytes: int,
        claim_ms: int, wait_ms: int,
    ) -> dict[str, Any]:  # fmt: skip
        encodes, waits, times, why = 0, 0, [], {}
        n = nbytes // 2
        while time.time() < start_at:
            pass
        for i, key in enumerate(keys):
            t0 = time.perf_counter()

            def encode(key: str = key, i: int = i) -> None:
                time.sleep(encode_ms / 1000.0)
                c.put(key, torch.full((n,), float(i), dtype=torch.bfloat16))
                c.flush()

            if claims:
                state = c.lookup([key], lease_ms=10_000, wait_ms=50, claim_ms=claim_ms)[0].state
                if state == LookupState.CLAIMED:
                    waits += 1
                    state = c.wait_ready([key], wait_ms, lease_ms=10_000, claim_ms=claim_ms)[
                        0
                    ].state
            else:
                state = c.lookup([key], lease_ms=10_000, wait_ms=50)[0].state
            got = c.get(key) if state in loadable else None
            if got is None:
                encode()
                encodes += 1
                # why it was encoded: the answer's state, or "lost" (a hit whose get missed)
                reason = "lost" if state in loadable else str(state)
                why[reason] = why.get(reason, 0) + 1
            times.append(time.perf_counter() - t0)
        return {"encodes": encodes, "waits": waits, "times": times, "why": why}

    serve_worker({"race": race, "ready": lambda: {"ok": c.ping()}})
    c.close()


# ---------------------------------------------------------------- orchestration


def run_setup(
    sockets: list[str], args: argparse.Namespace, claims: bool, tag: str
) -> dict[str, Any]:
    workers = [
        Worker(os.path.abspath(__file__), sockets[i % len(sockets)]) for i in range(args.clients)
    ]
    try:
        for w in workers:  # imported and connected before any round starts
            w.call(op="ready")
        encodes = waits = 0
        times: list[float] = []
        why: dict[str, int] = {}
        distinct = 0
        for r in range(args.rounds):
            keys = [f"{tag}-{'c' if claims else 'n'}-r{r}-i{i}" for i in range(args.items)]
            distinct += len(keys)
            start_at = time.time() + 0.5
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
                replies = list(
                    pool.map(
                        lambda w, keys=keys, start_at=start_at: w.call(
                            op="race",
                            keys=keys,
                            claims=claims,
                            start_at=start_at,
                            encode_ms=args.encode_ms,
                            nbytes=args.size,
                            claim_ms=args.claim_ms,
                            wait_ms=args.wait_ms,
                        ),  # fmt: skip
                        workers,
                    )
                )
            for rep in replies:
                for reason, n in rep["why"].items():
                    why[reason] = why.get(reason, 0) + n
                encodes += rep["encodes"]
                waits += rep["waits"]
                times += rep["times"]
        from lmcache_ec_broker import BrokerClient

        unknown = cut = 0
        for sock in sockets:  # why a client may have encoded a key another broker claimed
            with BrokerClient(sock, timeout_s=60) as c:
                st = c.stats()
            unknown += int(st.get("remote_fleet_claims_unknown", 0))
            cut += int(st.get("remote_lookups_cut_short", 0))
        return {
            "fleet_claims_unknown": unknown,
            "lookups_cut_short": cut,
            "encodes_per_item": encodes / distinct,
            "waits": waits,
            "p50_ms": median(times) * 1000,
            "p99_ms": percentile(times, 0.99) * 1000,
            "why": why,
        }
    finally:
        for w in workers:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--encode-ms", type=float, default=100.0)
    ap.add_argument("--size", type=int, default=1 * MiB, help="bytes per item")
    ap.add_argument("--claim-ms", type=int, default=30_000)
    ap.add_argument("--wait-ms", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="one broker only (no redis-server)")
    ap.add_argument("--json", help="write the results here too")
    args, rest = ap.parse_known_args()
    if args.worker:
        worker_main(rest[0])
        return
    results: list[dict[str, Any]] = []
    with Broker(256 * MiB) as b:
        for claims in (False, True):
            res = run_setup([b.socket_path], args, claims, "one")
            results.append({"setup": "1 broker", "claims": claims, **res})
    if not args.quick:
        from redis_servers import RedisServer

        with RedisServer() as srv, tempfile.TemporaryDirectory(prefix="ecb-dedup-") as d:
            cfg = os.path.join(d, "remote.yaml")
            with open(cfg, "w") as f:
                f.write(f"remote_url: '{srv.url('unix')}'\nremote_timeout_s: 1.0\n")
            with (
                Broker(256 * MiB, ["--config", cfg]) as b1,
                Broker(256 * MiB, ["--config", cfg]) as b2,
            ):
                for claims in (False, True):
                    res = run_setup([b1.socket_path, b2.socket_path], args, claims, "two")
                    results.append({"setup": "2 brokers + redis", "claims": claims, **res})
    rows = [
        [
            r["setup"],
            "on" if r["claims"] else "off",
            f"{r['encodes_per_item']:.2f}",
            r["waits"],
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['fleet_claims_unknown']} / {r['lookups_cut_short']}",
        ]
        for r in results
    ]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{when}, {platform.node()} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}); "
        f"{args.clients} clients x {args.items} items x {args.rounds} rounds, "
        f"encode {args.encode_ms:g} ms, {args.size // 1024} KiB per item"
    )
    headers = ["setup", "claims", "encodes / item", "waits", "p50 to item ms", "p99 ms"]
    print(table([*headers, "fleet claims unknown / lookups cut short"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": when, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
