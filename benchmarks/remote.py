"""The remote tier against a real redis-server: client libraries, promotion, write-behind.

    .venv/bin/python benchmarks/remote.py                       # everything (a few minutes)
    .venv/bin/python benchmarks/remote.py --sizes 1MiB --runs 1 --quick

Sections (every ratio compares figures measured in the same run, same server):

- ``clients``: GET/SET of each size through redis-py (hiredis parser, and its pure
  Python parser), valkey-glide (if installed), and this project's RESP client
  (``broker/tiers/resp.py``: GET streamed into a reused buffer, SET gathered from a
  memoryview), on a Unix socket and on 127.0.0.1. Why the tier uses its own client.
- ``promotion``: broker B gets a key only broker A stored (remote hit: GET streamed
  into B's slab, checksum verified, then the client's copy out of the slab into a
  reused tensor) against a bare redis-py ``GET`` of the same value from the same
  server (bytes, no copy anywhere). Target: bare/ours >= 0.8.
- ``write-behind``: how fast A's write-behind drains puts of 34 MiB into the store.
- ``put latency``: p50/p99 of 2 MiB puts with the remote tier on vs off (target:
  unchanged -- the remote never sits on the put path).
"""

# ruff: noqa: B023 - each timed closure runs in the loop iteration that made it
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from redis_servers import RedisServer  # noqa: E402

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    fmt_size,
    median,
    parse_sizes,
    percentile,
    table,
)

DEFAULT_SIZES = "2MiB,34MiB,130MiB"


def _timed(fn: Any, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


# ====================================================================== clients


def bench_clients(srv: RedisServer, sizes: list[int], runs: int) -> list[dict[str, Any]]:
    import redis
    from redis.connection import _HiredisParser, _RESP2Parser

    from lmcache_ec_broker.broker.tiers.resp import Connection, ConnParams, Endpoint, pack_set

    rows: list[dict[str, Any]] = []
    for transport in ("unix", "tcp"):
        if transport == "unix":
            conn_kw: dict[str, Any] = {"path": srv.unix_path}
            conn_cls: Any = redis.UnixDomainSocketConnection
            ep = Endpoint(unix_path=srv.unix_path)
        else:
            conn_kw = {"host": "127.0.0.1", "port": srv.port}
            conn_cls = redis.Connection
            ep = Endpoint("127.0.0.1", srv.port)
        libs: dict[str, Any] = {}
        for name, parser in (("redis-py+hiredis", _HiredisParser), ("redis-py", _RESP2Parser)):
            if name.endswith("hiredis"):
                try:
                    import hiredis  # noqa: F401
                except ImportError:
                    continue
            pool = redis.ConnectionPool(connection_class=conn_cls, parser_class=parser, **conn_kw)
            libs[name] = redis.Redis(connection_pool=pool)
        glide = None
        try:
            import glide_sync as g

            addr = (
                g.NodeAddress(unix_socket_path=srv.unix_path)
                if transport == "unix"
                else g.NodeAddress("127.0.0.1", srv.port)
            )
            glide = g.GlideClient.create(g.GlideClientConfiguration([addr], request_timeout=60000))
        except Exception:  # not installed or cannot connect over this transport
            glide = None
        ours = Connection(ep, ConnParams(timeout_s=30.0))
        for size in sizes:
            src = bytearray(os.urandom(1024)) * (size // 1024)
            view = memoryview(src)
            dest = bytearray(size)
            row: dict[str, Any] = {"transport": transport, "size": size}
            for name, r in libs.items():
                row[f"{name} SET"] = _timed(lambda r=r: r.set("bench", view), runs)
                row[f"{name} GET"] = _timed(lambda r=r: r.get("bench"), runs)
            if glide is not None:
                data = bytes(src)
                row["glide SET"] = _timed(lambda: glide.set("bench", data), runs)
                row["glide GET"] = _timed(lambda: glide.get("bench"), runs)

            def our_set() -> None:
                ours.send_pieces(pack_set(b"bench", [view]))
                assert ours.read_reply() == "OK"

            def our_get() -> None:
                ours.send(["GET", b"bench"])
                n = ours.read_bulk_len()
                assert n == size
                ours.read_into(memoryview(dest))
                ours.skip_crlf()

            row["ours SET"] = _timed(our_set, runs)
            row["ours GET"] = _timed(our_get, runs)
            rows.append(row)
        ours.close()
        for r in libs.values():
            r.close()
    return rows


def print_clients(rows: list[dict[str, Any]]) -> str:
    ops = [k for k in rows[0] if k not in ("transport", "size")]
    out = []
    for transport in ("unix", "tcp"):
        sub = [r for r in rows if r["transport"] == transport]
        headers = ["size", *[f"{op} GB/s" for op in ops]]
        body = [
            [
                fmt_size(r["size"]),
                *[f"{r['size'] / r[op] / 1e9:.2f}" if op in r else "-" for op in ops],
            ]
            for r in sub
        ]
        out.append(f"clients over {transport} (median GB/s)\n\n" + table(headers, body))
    return "\n\n".join(out)


# ====================================================================== tier


def bench_tier(
    srv: RedisServer, sizes: list[int], runs: int, puts: int, wb_n: int
) -> dict[str, Any]:
    import redis
    import torch

    from lmcache_ec_broker import BrokerClient

    url = srv.url("unix")
    # The brokers inherit this: a loaded benchmark machine must not turn slow transfers
    # into timeouts (the default, 1 s, bounds a 130 MiB read at ~3 s).
    os.environ.setdefault("LMCACHE_EC_REMOTE_TIMEOUT_S", "10")
    shm = max(512 * MiB, (runs + 1) * max(sizes) + 128 * MiB)
    res: dict[str, Any] = {"promotion": [], "put_latency": {}, "write_behind": {}}
    bare = redis.Redis(unix_socket_path=srv.unix_path)
    with (
        Broker(shm, ["--remote-url", url]) as ba,
        Broker(shm, ["--remote-url", url]) as bb,
    ):
        a = BrokerClient(ba.socket_path, timeout_s=60)
        b = BrokerClient(bb.socket_path, timeout_s=60)
        for size in sizes:
            t = torch.randint(0, 255, (size,), dtype=torch.uint8)
            out = torch.empty_like(t)
            keys = [f"p-{size}-{i}" for i in range(runs)]
            n0 = a.stats()["remote_writes"]
            for k in keys:
                a.put(k, t)
                _wait(lambda n=n0: a.stats()["remote_writes"] >= n + 1, 120)
                n0 += 1
            _wait(lambda keys=keys: b.stats()["remote_known_keys"] >= len(keys), 30)
            ours, plain = [], []
            for k in keys:
                t0 = time.perf_counter()
                if not b.get_into(k, out):
                    st = {x: v for x, v in b.stats().items() if x.startswith("remote_") and v}
                    raise RuntimeError(f"B missed {k} ({fmt_size(size)}): {st}")
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                raw = bare.get("lmcache-ec:" + k)
                plain.append(time.perf_counter() - t0)
                assert raw is not None and len(raw) > size
                del raw
            assert out.equal(t)
            res["promotion"].append({"size": size, "ours": median(ours), "bare_get": median(plain)})
            for k in keys:  # free the slabs for the next size
                a.delete(k)
        # write-behind throughput
        wb_size = 34 * MiB if max(sizes) >= 34 * MiB else max(sizes)
        t = torch.randint(0, 255, (wb_size,), dtype=torch.uint8)
        n0 = a.stats()["remote_writes"]
        d0 = a.stats()["remote_write_drops"]
        t0 = time.perf_counter()
        for i in range(wb_n):
            a.put(f"wb-{i}", t)
        put_done = time.perf_counter() - t0
        _wait(lambda: a.stats()["remote_pending_writes"] == 0, 300)
        elapsed = time.perf_counter() - t0
        st = a.stats()
        written = st["remote_writes"] - n0
        res["write_behind"] = {
            "size": wb_size,
            "entries": wb_n,
            "written": written,
            "dropped": st["remote_write_drops"] - d0,
            "puts_s": put_done,
            "drain_s": elapsed,
            "GBps": written * wb_size / elapsed / 1e9,
        }
        for i in range(wb_n):
            a.delete(f"wb-{i}")
        a.close()
        b.close()
    # put latency, remote on vs off (fresh brokers; 2 MiB entries)
    t = torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8)
    for label, extra in (("off", []), ("on", ["--remote-url", url])):
        with Broker(max(256 * MiB, 2 * MiB * (puts + 8)), extra) as br:
            c = BrokerClient(br.socket_path, timeout_s=60)
            lat = []
            for i in range(puts):
                t0 = time.perf_counter()
                assert c.put(f"lat-{label}-{i}", t)
                lat.append(time.perf_counter() - t0)
            res["put_latency"][label] = {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}
            c.close()
    bare.close()
    return res


def _wait(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the broker")
        time.sleep(0.01)


def print_tier(res: dict[str, Any]) -> str:
    rows = [
        [
            fmt_size(p["size"]),
            f"{p['ours'] * 1000:.1f}",
            f"{p['size'] / p['ours'] / 1e9:.2f}",
            f"{p['bare_get'] * 1000:.1f}",
            f"{p['size'] / p['bare_get'] / 1e9:.2f}",
            f"{p['bare_get'] / p['ours']:.2f}",
        ]
        for p in res["promotion"]
    ]
    out = [
        "remote promotion (B gets what only A stored; Unix socket; median ms)\n\n"
        + table(
            ["size", "B get_into ms", "GB/s", "bare redis-py GET ms", "GB/s", "bare/ours"], rows
        )
    ]
    wb = res["write_behind"]
    out.append(
        f"write-behind: {wb['entries']} puts of {fmt_size(wb['size'])} took {wb['puts_s']:.2f}s; "
        f"{wb['written']} written, {wb['dropped']} dropped (queue budget), drained after "
        f"{wb['drain_s']:.2f}s: {wb['GBps']:.2f} GB/s into the store"
    )
    pl = res["put_latency"]
    out.append(
        table(
            ["2 MiB put", "p50 ms", "p99 ms"],
            [[k, f"{v['p50'] * 1000:.2f}", f"{v['p99'] * 1000:.2f}"] for k, v in pl.items()],
        )
    )
    return "\n\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--puts", type=int, default=200, help="puts per put-latency run")
    ap.add_argument("--wb", type=int, default=12, help="entries in the write-behind run")
    ap.add_argument("--quick", action="store_true", help="fewer puts (smoke runs)")
    ap.add_argument("--only", choices=("clients", "tier"), help="one section")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    if args.quick:
        args.puts, args.wb = 20, 3
    sizes = parse_sizes(args.sizes)
    out: dict[str, Any] = {"host": socket.gethostname(), "cpus": os.cpu_count()}
    with RedisServer() as srv:
        if args.only in (None, "clients"):
            out["clients"] = bench_clients(srv, sizes, args.runs)
            print(print_clients(out["clients"]), flush=True)
            print()
            srv.cli("flushall")
        if args.only in (None, "tier"):
            out["tier"] = bench_tier(srv, sizes, args.runs, args.puts, args.wb)
            print(print_tier(out["tier"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
