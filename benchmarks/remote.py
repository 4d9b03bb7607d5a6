"""The remote tier on both backends side by side: Redis and Mooncake Store.

    sudo .venv/bin/python benchmarks/remote.py                  # everything (a few minutes)
    .venv/bin/python benchmarks/remote.py --sizes 1MiB --runs 1 --quick
    .venv/bin/python benchmarks/remote.py --backends redis      # no root needed

With Mooncake (root, the ``[mooncake]`` extra installed) the whole run re-executes
itself in a private network namespace with only ``lo`` (``unshare -n``): the
redis-server (Unix socket and 127.0.0.1), the ``mooncake_master`` (127.0.0.1), the
brokers and every client, so no traffic can leave loopback. Without root the
Mooncake columns are skipped with the reason printed.

Sections (every ratio compares figures measured in the same run, same store):

- ``clients`` (Redis): GET/SET of each size through redis-py (hiredis parser, and
  its pure Python parser), valkey-glide (if installed), and this project's RESP
  client (``broker/tiers/redis/resp.py``: GET streamed into a reused buffer, SET gathered
  from a memoryview), on a Unix socket and on 127.0.0.1. Why the tier uses its own
  client.
- ``the tier alone`` (both backends, one table): each tier in process, without a
  broker -- ``read_into`` reserved slab extents (header check and checksum
  included) and ``write`` from them -- against the store's own client moving the
  same bytes between ordinary buffers (redis-py GET/SET; Mooncake ``get_into`` /
  ``put_from`` by a client that contributes no memory, the object held by another
  process). Target: bare/tier >= 0.8 (the issues' promotion targets).
- ``promotion`` (both backends, one table): broker B gets a key only broker A
  stored -- a remote hit: the value streamed into B's slab, its checksum verified,
  then the client's copy out of the slab into a reused tensor -- against the
  store's own client reading the same value from the same store (redis-py ``GET``
  into bytes; Mooncake ``get_into`` an ordinary registered buffer), no checks and
  no copy anywhere. What a remote hit costs a client end to end.
- ``write-behind``: how fast A's write-behind drains puts of 34 MiB into each store.
- ``put latency``: p50/p99 of 2 MiB puts with the remote tier off, and on with each
  backend (target: unchanged -- the remote never sits on the put path), back to back
  (the write-behind and the store compete with the puts for the CPUs) and paced at
  ``--pace-ms`` (entries arrive at an encoder's rate).

``benchmarks/remote_mooncake.py`` compares the Mooncake tier's own transfers (no
broker round trip) against Mooncake's client between two ordinary buffers.
"""

# ruff: noqa: B023 - each timed closure runs in the loop iteration that made it
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import socket
import subprocess
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
    die_with_parent,
    fmt_size,
    median,
    parse_sizes,
    percentile,
    table,
)

DEFAULT_SIZES = "2MiB,34MiB,130MiB"
ROW_KEYS = ("bare_get", "tier_get1", "tier_get4", "bare_put", "tier_put")
PL_KEYS = ("b2b_p50", "b2b_p99", "paced_p50", "paced_p99")
PREFIX = "lmcache-ec:"  # the brokers' default remote_key_prefix


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

    from lmcache_ec_broker.broker.tiers.redis.resp import (
        ConnParams,
        Endpoint,
        RespConnection,
        pack_set,
    )

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
        ours = RespConnection(ep, ConnParams(timeout_s=30.0))
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


class RedisBackend:
    """redis-server on a Unix socket; the bare baseline is redis-py's ``GET`` (with the
    hiredis parser where installed -- the set-up installs it, the ``bench`` extra: the
    store's client at its fastest; its own parser was 1.3-2.8x slower here)."""

    name = "Redis"

    def __init__(self, srv: RedisServer) -> None:
        import redis

        self.url = srv.url("unix")
        self.env: dict[str, str] = {}
        self._bare = redis.Redis(unix_socket_path=srv.unix_path)

    def bare_get(self, key: str, size: int) -> float:
        t0 = time.perf_counter()
        raw = self._bare.get(PREFIX + key)
        dt = time.perf_counter() - t0
        assert raw is not None and len(raw) > size
        return dt

    def close(self) -> None:
        self._bare.close()


class MooncakeBackend:
    """A ``mooncake_master`` on 127.0.0.1 (the caller made a private network namespace).

    The brokers contribute the memory the objects live in (broker A holds what it
    wrote); the bare baseline is Mooncake's own client (contributing none) reading
    the same object with ``get_into`` into an ordinary registered buffer."""

    name = "Mooncake"
    port = 50051

    def __init__(self, max_size: int, runs: int) -> None:
        import mmap

        import mooncake
        from mooncake.store import MooncakeDistributedStore

        binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        self.master = subprocess.Popen(
            [binary, "-rpc_address=127.0.0.1", f"-rpc_port={self.port}",
             "-metrics_host=127.0.0.1", "-metrics_port=9003"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while (
            f"127.0.0.1:{self.port}".encode()
            not in subprocess.run(["ss", "-Hltn"], capture_output=True).stdout
        ):
            if time.monotonic() > deadline or self.master.poll() is not None:
                raise RuntimeError("mooncake_master did not start")
            time.sleep(0.05)
        self.url = f"mooncakestore://127.0.0.1:{self.port}"
        segment = (runs + 2) * max_size + 256 * MiB
        self.env = {
            "LMCACHE_EC_MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "LMCACHE_EC_MOONCAKE_GLOBAL_SEGMENT_SIZE": f"{-(-segment // MiB)}MiB",
        }
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            "127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", f"127.0.0.1:{self.port}"
        )
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed: {rc}")
        self._buf = mmap.mmap(-1, max_size + MiB)
        for off in range(0, len(self._buf), MiB):  # no first-touch faults in the timings
            self._buf[off : off + 1] = b"\1"
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        if self._store.register_buffer(self._addr, len(self._buf)) != 0:
            raise RuntimeError("register_buffer failed")

    def bare_get(self, key: str, size: int) -> float:
        n = int(self._store.get_size(PREFIX + key))
        assert n > size, n
        t0 = time.perf_counter()
        got = self._store.get_into(PREFIX + key, self._addr, n)
        dt = time.perf_counter() - t0
        assert got == n, got
        return dt

    def close(self) -> None:
        self._store.unregister_buffer(self._addr)
        self._store.close()
        self.master.kill()
        self.master.wait(10)


def bench_backend(
    backend: Any, sizes: list[int], runs: int, puts: int, wb_n: int, pace_s: float
) -> dict[str, Any]:
    """Promotion, write-behind and put latency through two real brokers on ``backend``."""
    import torch

    from lmcache_ec_broker import BrokerClient

    res: dict[str, Any] = {"promotion": [], "put_latency": {}, "write_behind": {}}
    shm = max(512 * MiB, (runs + 1) * max(sizes) + 128 * MiB)
    saved = {k: os.environ.get(k) for k in backend.env}
    os.environ.update(backend.env)  # the brokers inherit the backend's settings
    try:
        with (
            Broker(shm, ["--remote-url", backend.url]) as ba,
            Broker(shm, ["--remote-url", backend.url]) as bb,
        ):
            a = BrokerClient(ba.socket_path, timeout_s=60)
            b = BrokerClient(bb.socket_path, timeout_s=60)
            _wait(lambda: a.stats()["remote_up"] and b.stats()["remote_up"], 60)
            # Not timed: the first transfer between two nodes sets up their connections.
            warm = torch.ones(MiB, dtype=torch.uint8)
            a.put("warm-up", warm)
            _wait(lambda: a.stats()["remote_writes"] >= 1 and b.has(["warm-up"])[0], 60)
            assert b.get_into("warm-up", torch.empty_like(warm))
            backend.bare_get("warm-up", MiB)
            a.delete("warm-up")
            for size in sizes:
                t = torch.randint(0, 255, (size,), dtype=torch.uint8)
                out = torch.empty_like(t)
                keys = [f"p-{size}-{i}" for i in range(runs)]
                n0 = a.stats()["remote_writes"]
                for k in keys:
                    a.put(k, t)
                    _wait(lambda n=n0: a.stats()["remote_writes"] >= n + 1, 120)
                    n0 += 1
                # B learns of A's keys from the store (announcements / key polling) before a
                # get; until then its membership filter answers a fast local miss.
                _wait(lambda keys=keys: all(b.has(keys)), 60)
                ours, plain = [], []
                for i, k in enumerate(keys):
                    # Alternate who reads first: neither always meets the colder store.
                    if i % 2:
                        plain.append(backend.bare_get(k, size))
                    t0 = time.perf_counter()
                    if not b.get_into(k, out):
                        st = {x: v for x, v in b.stats().items() if x.startswith("remote_") and v}
                        raise RuntimeError(f"B missed {k} ({fmt_size(size)}): {st}")
                    ours.append(time.perf_counter() - t0)
                    if not i % 2:
                        plain.append(backend.bare_get(k, size))
                assert out.equal(t)
                res["promotion"].append(
                    {"size": size, "ours": median(ours), "bare_get": median(plain)}
                )
                for k in keys:  # free the slabs (and the store) for the next size
                    a.delete(k)
            wb_size = 34 * MiB if max(sizes) >= 34 * MiB else max(sizes)
            t = torch.randint(0, 255, (wb_size,), dtype=torch.uint8)
            st0 = a.stats()
            t0 = time.perf_counter()
            for i in range(wb_n):
                a.put(f"wb-{i}", t)
            put_done = time.perf_counter() - t0
            _wait(lambda: a.stats()["remote_pending_writes"] == 0, 300)
            elapsed = time.perf_counter() - t0
            st = a.stats()
            written = st["remote_writes"] - st0["remote_writes"]
            res["write_behind"] = {
                "size": wb_size,
                "entries": wb_n,
                "written": written,
                "dropped": st["remote_write_drops"] - st0["remote_write_drops"],
                "skipped": st["remote_writes_skipped"] - st0["remote_writes_skipped"],
                "errors": st["remote_write_errors"] - st0["remote_write_errors"],
                "puts_s": put_done,
                "drain_s": elapsed,
                "GBps": written * wb_size / elapsed / 1e9,
            }
            for i in range(wb_n):
                a.delete(f"wb-{i}")
            a.close()
            b.close()
        # put latency with the remote tier on (a fresh broker; 2 MiB entries)
        res["put_latency"] = put_latency(["--remote-url", backend.url], puts, backend.name, pace_s)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def put_latency(extra: list[str], puts: int, label: str, pace_s: float) -> dict[str, float]:
    """2 MiB puts into a fresh broker: back to back (the write-behind competes with the
    puts for the CPUs), then paced at ``pace_s`` (encoder outputs arrive at the encoder's
    rate: the write-behind of one entry ends before the next put)."""
    import torch

    from lmcache_ec_broker import BrokerClient

    t = torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8)
    out: dict[str, float] = {}
    with Broker(max(256 * MiB, 2 * MiB * (2 * puts + 8)), extra) as br:
        c = BrokerClient(br.socket_path, timeout_s=60)
        if extra:
            _wait(lambda: c.stats()["remote_up"], 60)
        for mode, gap in (("b2b", 0.0), ("paced", pace_s)):
            if extra:
                _wait(lambda: c.stats()["remote_pending_writes"] == 0, 120)
            lat = []
            for i in range(puts):
                t0 = time.perf_counter()
                assert c.put(f"lat-{label}-{mode}-{i}", t)
                lat.append(time.perf_counter() - t0)
                if gap:
                    time.sleep(gap)
            out[f"{mode}_p50"] = percentile(lat, 0.5)
            out[f"{mode}_p99"] = percentile(lat, 0.99)
        if extra:
            _wait(lambda: c.stats()["remote_pending_writes"] == 0, 120)
        out["written"] = c.stats().get("remote_writes", 0)
        c.close()
    return out


def _wait(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the broker")
        time.sleep(0.01)


def print_tier(results: dict[str, dict[str, Any]], off: dict[str, float]) -> str:
    names = list(results)
    sizes = [p["size"] for p in results[names[0]]["promotion"]]
    headers = ["size"]
    for name in names:
        headers += [f"{name}: B get_into GB/s", "bare GB/s", "bare/ours"]
    rows = []
    for j, size in enumerate(sizes):
        row = [fmt_size(size)]
        for name in names:
            p = results[name]["promotion"][j]
            row += [
                f"{size / p['ours'] / 1e9:.2f}",
                f"{size / p['bare_get'] / 1e9:.2f}",
                f"{p['bare_get'] / p['ours']:.2f}x",
            ]
        rows.append(row)
    bare_names = {"Redis": "redis-py GET", "Mooncake": "Mooncake get_into"}
    out = [
        "remote promotion: broker B gets a key only broker A stored (the promotion into B's "
        "slab + the client's copy out), against each store's own client reading the same "
        "value (bare: "
        + ", ".join(f"{n} = {bare_names.get(n, n)}" for n in names)
        + "; medians)\n\n"
        + table(headers, rows)
    ]
    wb_rows = []
    for name in names:
        wb = results[name]["write_behind"]
        wb_rows.append(
            [
                name,
                f"{wb['entries']} x {fmt_size(wb['size'])}",
                f"{wb['puts_s']:.2f}",
                f"{wb['drain_s']:.2f}",
                str(wb["written"]),
                str(wb["dropped"]),
                str(wb["skipped"]),
                str(wb["errors"]),
                f"{wb['GBps']:.2f}",
            ]
        )
    out.append(
        "write-behind: puts into broker A, drained into the store\n\n"
        + table(
            [
                "backend",
                "puts",
                "puts s",
                "drained s",
                "written",
                "dropped",
                "skipped",
                "errors",
                "GB/s",
            ],
            wb_rows,
        )
    )

    def ms(v: dict[str, float], k: str) -> str:
        return f"{v[k] * 1000:.2f}"

    pl_rows = [["off", *(ms(off, k) for k in PL_KEYS), "-", "-", "-"]]
    for name in names:
        v = results[name]["put_latency"]
        pl_rows.append(
            [
                f"on ({name})",
                *(ms(v, k) for k in PL_KEYS),
                f"{v['b2b_p50'] / off['b2b_p50']:.2f}x",
                f"{v['paced_p50'] / off['paced_p50']:.2f}x",
                str(v["written"]),
            ]
        )
    out.append(
        "2 MiB put latency, remote tier off/on: back to back, and paced (one put per gap)\n\n"
        + table(
            [
                "2 MiB put",
                "b2b p50 ms",
                "b2b p99 ms",
                "paced p50 ms",
                "paced p99 ms",
                "b2b p50 vs off",
                "paced p50 vs off",
                "written",
            ],
            pl_rows,
        )  # fmt: skip
    )
    return "\n\n".join(out)


async def redis_tier_rows(
    srv: RedisServer, sizes: list[int], repeat: int
) -> list[dict[str, float]]:
    """The Redis tier alone, in this process (no broker round trip, no client copy):
    ``read_into`` reserved slab extents (header check + checksum included) and
    ``write`` from them, against redis-py GET/SET of the same bytes on the same socket.
    The same rows as ``remote_mooncake.measure``."""
    import mmap

    import redis

    from benchmarks.remote_mooncake import extents
    from lmcache_ec_broker.broker.tiers import make_lower_tiers
    from lmcache_ec_broker.broker.tiers.base import EntryMeta, SlabAccess
    from lmcache_ec_broker.config import BrokerConfig

    top = max(sizes)
    slab_mm = mmap.mmap(-1, 2 * top + 8 * MiB)
    for off in range(0, len(slab_mm), MiB):  # no first-touch faults in the timings
        slab_mm[off : off + 1] = b"\1"
    slab_mm[: 2 * top] = os.urandom(MiB) * (2 * top // MiB)
    cfg = BrokerConfig(remote_url=srv.url("unix"), remote_timeout_s=30.0)
    (tier,) = make_lower_tiers(cfg, len(slab_mm))

    class Events:
        def added(self, tier: object, key: str) -> None: ...
        def removed(self, tier: object, key: str) -> None: ...

    tier.open()
    tier.start(asyncio.get_running_loop(), SlabAccess(slab_mm), Events())
    bare = redis.Redis(unix_socket_path=srv.unix_path)
    view = memoryview(slab_mm)

    rows: list[dict[str, float]] = []
    for n in sizes:
        meta = EntryMeta(n, "uint8", (n,))
        ts: dict[str, list[float]] = {k: [] for k in ROW_KEYS}
        for r in range(-1, repeat):  # run -1 warms connections and is not kept
            key = f"tier-{n}-{r}"
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            fut = tier.write(key, meta, extents(n, 4))
            assert fut is not None
            await fut
            t["tier_put"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            bare.set("bare:" + key, view[:n])
            t["bare_put"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            raw = bare.get("bare:" + key)
            t["bare_get"] = time.perf_counter() - t0
            assert raw is not None and len(raw) == n
            del raw
            for pieces in (1, 4):
                t0 = time.perf_counter()
                await tier.read_into(key, meta, extents(n, pieces, base=top + 4 * MiB))
                t[f"tier_get{pieces}"] = time.perf_counter() - t0
            assert slab_mm[top + 4 * MiB : top + 4 * MiB + n] == slab_mm[:n]
            tier.delete([key])
            bare.delete("bare:" + key)
            if r >= 0:
                for k in ROW_KEYS:
                    ts[k].append(t[k])
        rows.append({"size": n, **{k: median(v) for k, v in ts.items()}})
    await tier.shutdown(10)
    tier.close()
    bare.close()
    view.release()
    return rows


def print_tier_alone(results: dict[str, list[dict[str, float]]]) -> str:
    names = list(results)
    bare = {"Redis": ("redis-py GET", "redis-py SET"), "Mooncake": ("get_into", "put_from")}
    headers = ["size"]
    for name in names:
        headers += [f"{name}: tier read_into GB/s", f"{bare[name][0]} GB/s", "bare/tier"]
    for name in names:
        headers += [f"{name}: tier write GB/s", f"{bare[name][1]} GB/s", "bare/tier"]
    rows = []
    for j, size in enumerate(int(r["size"]) for r in results[names[0]]):
        row = [fmt_size(size)]
        for op in (("tier_get1", "bare_get"), ("tier_put", "bare_put")):
            for name in names:
                r = results[name][j]
                row += [
                    f"{size / r[op[0]] / 1e9:.2f}",
                    f"{size / r[op[1]] / 1e9:.2f}",
                    f"{r[op[1]] / r[op[0]]:.2f}x",
                ]
        rows.append(row)
    # columns are in (get: names..., put: names...) order; headers were built the same way
    return (
        "the tier alone (in process: no broker round trip, no client copy): promotion into "
        "slab extents with header check and checksum, and write-behind from them, against "
        "each store's own client moving the same bytes between ordinary buffers (medians)\n\n"
        + table(headers, rows)
    )


def mooncake_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (Mooncake runs in a private network namespace: unshare -n)"
    if shutil.which("unshare") is None or shutil.which("ss") is None:
        return "needs unshare and ss (util-linux, iproute2)"
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return "the [mooncake] extra is not installed"
    if not os.path.isfile(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")):
        return "the mooncake package ships no mooncake_master"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--puts", type=int, default=200, help="puts per put-latency run")
    ap.add_argument(
        "--pace-ms", type=float, default=20.0, help="gap between paced puts (put latency)"
    )
    ap.add_argument("--wb", type=int, default=12, help="entries in the write-behind run")
    ap.add_argument("--quick", action="store_true", help="fewer puts (smoke runs)")
    ap.add_argument("--only", choices=("clients", "tier"), help="one section")
    ap.add_argument("--backends", default="redis,mooncake", help="tier section: redis, mooncake")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(backends) - {"redis", "mooncake"} or not backends:
        ap.error(f"--backends: redis and/or mooncake, got {args.backends!r}")
    if "mooncake" in backends and args.only != "clients" and not args.in_netns:
        why = mooncake_unavailable()
        if why is None:
            # Everything (redis-server too) runs in a private network namespace with only lo,
            # so Mooncake's transfer engine cannot reach or listen on another interface.
            inner = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--in-netns"]
            return subprocess.run(["unshare", "-n", "--", *inner]).returncode
        print(f"Mooncake skipped: {why}\n", flush=True)
        backends.remove("mooncake")
    if args.in_netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
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
        if args.only in (None, "tier") and backends:
            os.environ.setdefault("LMCACHE_EC_REMOTE_TIMEOUT_S", "10")  # see below
            # The brokers inherit this: a loaded benchmark machine must not turn slow transfers
            # into timeouts (the default, 1 s, bounds a 130 MiB read at ~3 s).
            alone: dict[str, list[dict[str, float]]] = {}
            for name in backends:
                if name == "redis":
                    alone["Redis"] = asyncio.run(redis_tier_rows(srv, sizes, args.runs))
                else:
                    from benchmarks.remote_mooncake import tier_rows

                    alone["Mooncake"] = tier_rows(sizes, args.runs)
            print(print_tier_alone(alone), flush=True)
            print()
            results: dict[str, dict[str, Any]] = {}
            off = put_latency([], args.puts, "off", args.pace_ms / 1000)
            for name in backends:
                if name == "redis":
                    backend: Any = RedisBackend(srv)
                else:
                    backend = MooncakeBackend(max(sizes), args.runs)
                try:
                    results[backend.name] = bench_backend(
                        backend, sizes, args.runs, args.puts, args.wb, args.pace_ms / 1000
                    )
                finally:
                    backend.close()
            out["tier"] = {"alone": alone, "backends": results, "put_latency_off": off}
            print(print_tier(results, off), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
