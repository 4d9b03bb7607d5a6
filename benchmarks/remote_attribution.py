"""Where one remote hit spends its time (issue 18, attribution of a remote hit).

    .venv/bin/python benchmarks/remote_attribution.py                    # Redis
    sudo .venv/bin/python benchmarks/remote_attribution.py --backends redis,mooncake
    .venv/bin/python benchmarks/remote_attribution.py --size 64KiB --hits 3   # smoke

Broker A (the CLI) writes entries behind into the store; broker B -- the CLI too,
started through this script with timers wrapped around its functions -- has never
seen them, and one client in this process gets each with ``get_into``: one remote
hit each. B records, with ``time.perf_counter_ns`` (CLOCK_MONOTONIC: one clock for
every process on the host), when its coordinator got the request and answered it,
when the remote lookup and the promotion's read were handed to a worker thread,
when that thread started and returned, and inside the read the time to the store's
first reply byte, the checksum and the header parse. The client's timers (the socket
and the slab copy, as ``attribution.py``) are read on the same clock, so every phase
below is a difference of two measured instants, per hit; the table shows medians:

- ``client -> broker``: the client's send until B's coordinator holds the Get;
  ``of which: client to send``: the client's work before its first send;
  ``of which: B's frame to Get``: from B's protocol receiving the Get's bytes (B
  awake) to its coordinator holding it;
- ``lookup: to I/O / store / to loop``: the remote lookup handed to whatever does
  its I/O (a worker thread, or a task on the loop), its store round trip(s), its
  result back where the policy runs (the event loop);
- ``promotion start``: lookup answered until the promotion's read was asked for
  (task start, slab reservation);
- ``read: to I/O / to loop``: the promotion's read handed to a worker thread (or
  started on the loop) and its end seen by the promotion (less the copy below);
- ``read: copy into slab``: Mooncake's fetch only -- the value, verified in a
  staging buffer, copied into the slab range reserved for it (on the loop);
- ``read: store, first byte``: from the read's start to the value's length line
  from the store (the GET's round trip: for Redis the server's time to first byte);
- ``read: store, rest``: the rest of the read that is not checksum or header
  parse: the payload's bytes landing in the slab;
- ``read: checksum`` and ``read: header``: hashing the payload, parsing the header;
- ``commit``: the read returned on the loop until the promotion committed;
- ``answer``: the promotion committed until the Get's reply was ready;
- ``broker -> client``: the reply's encode and send until the client woke with it;
- ``client copy``: the client's copy out of the slab (and its Release);
- ``total``: the client's ``get_into``.

Without root, or without Mooncake, only Redis runs (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    fmt_size,
    median,
    parse_sizes,
    table,
)

PHASES = (
    "client -> broker",
    "  of which: client to send",
    "  of which: B's frame to Get",
    "lookup: to I/O",
    "lookup: store",
    "lookup: to loop",
    "promotion start",
    "read: to I/O",
    "read: store, first byte",
    "read: store, rest",
    "read: checksum",
    "read: header",
    "read: to loop",
    "read: copy into slab",
    "commit",
    "answer",
    "broker -> client",
    "client copy",
    "client other",
    "total",
    "bare get",
)


# ====================================================================== the traced broker


def traced_broker(trace_path: str, argv: list[str]) -> int:
    """Run the broker CLI with timers around its remote-hit functions; SIGUSR1 writes
    the events recorded so far to ``trace_path`` (JSON) and forgets them."""
    from lmcache_ec_broker import cli
    from lmcache_ec_broker.broker import connection, coordinator, promotion
    from lmcache_ec_broker.broker.tiers.redis import resp
    from lmcache_ec_broker.broker.tiers.remote import tier as remote_tier
    from lmcache_ec_broker.broker.tiers.remote import value as remote_value

    try:
        from lmcache_ec_broker.broker.tiers.redis import resp_async
    except ImportError:  # before the loop path existed
        resp_async = None  # type: ignore[assignment]

    events: list[tuple[str, int, int]] = []  # (name, start ns, end ns)
    lock = threading.Lock()

    def record(name: str, t0: int, t1: int) -> None:
        with lock:
            events.append((name, t0, t1))

    def timed(owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return inner(*a, **k)
            finally:
                record(name, t0, time.perf_counter_ns())

        setattr(owner, attr, run)

    def timed_async(owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        async def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return await inner(*a, **k)
            finally:
                record(name, t0, time.perf_counter_ns())

        setattr(owner, attr, run)

    # the Get: from the coordinator's call to its answer (awaited when it promotes)
    get = coordinator.Coordinator.get

    def traced_get(self: Any, conn: int, keys: list[str]) -> Any:
        t0 = time.perf_counter_ns()
        got = get(self, conn, keys)
        if not hasattr(got, "__await__"):
            record("get", t0, time.perf_counter_ns())
            return got

        async def answer() -> Any:
            try:
                return await got
            finally:
                record("get", t0, time.perf_counter_ns())

        return answer()

    coordinator.Coordinator.get = traced_get  # type: ignore[method-assign]
    # the Get's bytes in B's hands (B awake, its loop running the protocol)
    timed(connection.Connection, "data_received", "frame")
    # a promotion from a lookup's meta, or a fetch (lookup and read in one round trip);
    # a fetch that cannot run here looks up and promotes inside: the outer one counts
    timed_async(promotion.Promoter, "_promote_from", "promote")
    timed_async(promotion.Promoter, "_fetch_from", "promote")
    timed_async(remote_tier.RemoteTier, "lookup", "lookup")
    timed_async(remote_tier.RemoteTier, "_read", "read")
    if hasattr(remote_tier.RemoteTier, "fetch"):
        timed_async(remote_tier.RemoteTier, "fetch", "read")
    # the worker threads: whatever ran there (a lookup job, a promotion's read)
    execute = remote_tier.execute

    def traced_execute(transport: Any, job: Any, slab: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return execute(transport, job, slab)
        finally:
            if type(job).__name__ == "LookupJob":
                record("io:lookup", t0, time.perf_counter_ns())

    remote_tier.execute = traced_execute  # type: ignore[assignment]
    from lmcache_ec_broker.broker.tiers.mooncake import transport as mooncake
    from lmcache_ec_broker.broker.tiers.redis import transport as redis

    for cls in (redis.RedisTransport, mooncake.MooncakeTransport):
        timed(cls, "read_into", "io:read")
        # the same calls on the event loop, where the transport has them
        if hasattr(cls, "read_on_loop"):
            timed_async(cls, "read_on_loop", "io:read")
        if hasattr(cls, "fetch_on_loop"):
            timed_async(cls, "fetch_on_loop", "io:read")
        if hasattr(cls, "lookup_on_loop"):
            timed_async(cls, "lookup_on_loop", "io:lookup")
        # Mooncake's fetch: the whole value into a staging buffer on a read thread,
        # then (on the loop, once the range is reserved) copied into the slab
        if hasattr(cls, "fetch_staged"):
            timed(cls, "fetch_staged", "io:read")
            timed(cls, "unstage", "unstage")
    timed(remote_value.Verifier, "update", "checksum")
    timed(remote_value.Verifier, "finish", "checksum")
    from lmcache_ec_broker.broker.tiers.mooncake import data_path as mooncake_io
    from lmcache_ec_broker.broker.tiers.redis import value_rules

    for mod in (value_rules, mooncake_io):
        timed(mod, "parse_header", "header")
    timed(resp.RespConnection, "read_bulk_len", "first byte")
    if hasattr(resp_async, "LoopConnection"):
        timed_async(resp_async.LoopConnection, "bulk_len", "first byte")

    def dump(*_: Any) -> None:
        with lock:
            got = list(events)
            events.clear()
        tmp = trace_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(got, f)
        os.replace(tmp, trace_path)

    signal.signal(signal.SIGUSR1, dump)
    return cli.main(argv)


class TracedBroker(Broker):
    """``Broker``, started through ``traced_broker``."""

    def __init__(self, shm_size: int, extra: list[str]) -> None:  # noqa: D107
        # The launcher needs the trace path before Broker makes its directory.
        self.trace_dir = tempfile.mkdtemp(prefix="ecb-trace-", dir="/tmp")
        self.trace = os.path.join(self.trace_dir, "trace.json")
        super().__init__(
            shm_size, extra, launcher=(os.path.abspath(__file__), "--traced-broker", self.trace)
        )

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.trace_dir, ignore_errors=True)

    def events(self) -> list[tuple[str, int, int]]:
        """The events recorded since the last call."""
        if os.path.exists(self.trace):
            os.unlink(self.trace)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.trace):
            if time.monotonic() > deadline:
                raise RuntimeError("the traced broker wrote no trace")
            time.sleep(0.01)
        return [tuple(e) for e in json.loads(Path(self.trace).read_text())]  # type: ignore[misc]


# ====================================================================== one hit


def phases(ev: list[tuple[str, int, int]], t_send: int, t_woke: int, t_end: int,
           copy_ns: int) -> dict[str, float]:  # fmt: skip
    """Per-phase microseconds of one remote hit from its events (see the docstring)."""

    def one(name: str) -> tuple[int, int]:
        # the longest: a call on the loop that answered "not here" ran before the thread's
        got = sorted(((b - a, a, b) for n, a, b in ev if n == name), reverse=True)
        if not got:
            raise RuntimeError(f"no {name!r} event in a remote hit")
        return got[0][1], got[0][2]

    def total(name: str, lo: int, hi: int) -> int:
        return sum(b - a for n, a, b in ev if n == name and lo <= a <= hi)

    def us(ns: float) -> float:
        return ns / 1000.0

    get0, get1 = one("get")
    pro0, pro1 = one("promote")
    rd0, rd1 = one("read")
    th0, th1 = one("io:read")
    frames = [a for n, a, _ in ev if n == "frame" and t_send <= a <= get0]
    out = {
        "client -> broker": us(get0 - t_send),
        "  of which: B's frame to Get": us(get0 - frames[-1]) if frames else 0.0,
        "promotion start": 0.0,
        "read: to I/O": us(th0 - rd0),
        "read: checksum": us(total("checksum", th0, th1)),
        "read: header": us(total("header", th0, th1)),
        "read: copy into slab": us(total("unstage", th1, rd1)),
        "read: to loop": us(rd1 - th1 - total("unstage", th1, rd1)),
        "commit": us(pro1 - rd1),
        "answer": us(get1 - pro1),
        "broker -> client": us(t_woke - get1),
        "client copy": us(copy_ns),
        "total": us(t_end - t_send),
    }
    store = us(th1 - th0) - out["read: checksum"] - out["read: header"]
    firsts = [b for n, a, b in ev if n == "first byte" and th0 <= a <= th1]
    out["read: store, first byte"] = us(firsts[0] - th0) if firsts else 0.0
    out["read: store, rest"] = store - out["read: store, first byte"]
    lookups = [(a, b) for n, a, b in ev if n == "lookup"]
    if lookups:  # a separate remote lookup ran before the read
        lk0, lk1 = lookups[0]
        lt0, lt1 = one("io:lookup")
        out["lookup: to I/O"] = us(lt0 - lk0)
        out["lookup: store"] = us(lt1 - lt0)
        out["lookup: to loop"] = us(lk1 - lt1)
        out["promotion start"] = us(rd0 - lk1)
    else:
        out["lookup: to I/O"] = out["lookup: store"] = out["lookup: to loop"] = 0.0
        out["promotion start"] = us(rd0 - get0)
    accounted = sum(v for k, v in out.items() if k != "total" and not k.startswith(" "))
    out["client other"] = out["total"] - accounted
    out["read: total"] = us(th1 - th0)
    out["promote: total"] = us(pro1 - pro0)
    return out


def run_backend(backend: Any, size: int, hits: int) -> list[dict[str, float]]:
    import torch

    from benchmarks.attribution import Timers, instrument
    from benchmarks.remote import _wait
    from lmcache_ec_broker import BrokerClient

    shm = max(256 * MiB, (hits + 2) * size + 64 * MiB)
    saved = {k: os.environ.get(k) for k in backend.env}
    os.environ.update(backend.env)
    rows: list[dict[str, float]] = []
    try:
        with (
            Broker(shm, ["--remote-url", backend.url]) as ba,
            TracedBroker(shm, ["--remote-url", backend.url]) as bb,
        ):
            a = BrokerClient(ba.socket_path, timeout_s=60)
            b = BrokerClient(bb.socket_path, timeout_s=60)
            _wait(lambda: a.stats()["remote_up"] and b.stats()["remote_up"], 60)
            timers = Timers()
            t = torch.randint(0, 255, (size,), dtype=torch.uint8)
            out = torch.empty_like(t)
            # warm-up (not kept): the first transfer between two nodes sets up connections
            keys = [f"attr-{size}-{i}" for i in range(hits + 1)]
            n0 = a.stats()["remote_writes"]
            for k in keys:
                a.put(k, t)
            _wait(lambda: a.stats()["remote_writes"] >= n0 + len(keys), 120)
            _wait(lambda: all(b.has(keys)), 60)
            sock = instrument(b, timers)
            woke = [0]
            recv = sock.recv_into

            def timed_recv(*args: Any) -> int:
                n = recv(*args)
                woke[0] = time.perf_counter_ns()  # the reply's last bytes in hand
                return n

            sock.recv_into = timed_recv
            sent = [0]
            sendall = sock.sendall

            def timed_sendall(data: Any) -> None:
                if not sent[0]:
                    sent[0] = time.perf_counter_ns()  # the hit's first send starts
                sendall(data)

            sock.sendall = timed_sendall
            bb.events()
            for i, k in enumerate(keys):
                timers.reset()
                sent[0] = 0
                t_send = time.perf_counter_ns()
                hit = b.get_into(k, out)
                t_end = time.perf_counter_ns()
                if not hit:
                    raise RuntimeError(f"B missed {k}: {bb.read_log()[-3000:]}")
                ev = bb.events()
                if os.environ.get("ATTR_DEBUG"):
                    t00 = min(a for _, a, _ in ev)
                    print([(n, (a - t00) // 1000, (b - t00) // 1000) for n, a, b in ev])
                if i:
                    row = phases(ev, t_send, woke[0], t_end, timers.copy)
                    row["  of which: client to send"] = (sent[0] - t_send) / 1e3 if sent[0] else 0.0
                    # the store's own client reading the same value, right after
                    row["bare get"] = backend.bare_get(k, size) * 1e6
                    rows.append(row)
            assert out.equal(t)
            a.close()
            b.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def report(results: dict[str, list[dict[str, float]]], size: int) -> str:
    names = list(results)
    rows = []
    for phase in PHASES:
        row = [phase]
        for name in names:
            vals = [r[phase] for r in results[name]]
            row += [f"{median(vals):.0f}", f"{min(vals):.0f}-{max(vals):.0f}"]
        rows.append(row)
    headers = ["phase (µs)"]
    for name in names:
        headers += [f"{name} median", "min-max"]
    return (
        f"one remote hit of {fmt_size(size)} through broker B (get_into; "
        f"{len(results[names[0]])} hits, each a key only broker A stored)\n\n"
        + table(headers, rows)
        + "\n\nbare get: the store's own client reading the same value (redis-py GET, "
        "Mooncake get_into a registered buffer), right after each hit; bare/total: "
        + ", ".join(
            f"{n} {median([r['bare get'] / r['total'] for r in results[n]]):.2f}x" for n in names
        )
        + "\n\n"
        + floor(results)
    )


def floor(results: dict[str, list[dict[str, float]]]) -> str:
    """The best ratio any hit through B could reach in this run: per hit, the store's
    own read (bare) plus the parts no hit through B can drop -- the client's copy out
    of the slab and the value's checksum (verified before it is served; Mooncake's is
    inside its staged copy, so the Redis run's median checksum stands in) -- then the
    same with the client<->B round trip as measured added."""
    checks = [r["read: checksum"] for r in results.get("Redis", []) if r["read: checksum"]]
    check = median(checks) if checks else 0.0
    parts = []
    for name, rows in results.items():
        bare, with_rt = [], []
        for r in rows:
            least = r["bare get"] + r["client copy"] + (r["read: checksum"] or check)
            bare.append(r["bare get"] / least)
            rt = r["client -> broker"] + r["broker -> client"]
            with_rt.append(r["bare get"] / (least + rt))
        parts.append(f"{name} {median(bare):.2f}x ({median(with_rt):.2f}x with the round trip)")
    return (
        "floor (bare / (bare + client copy + checksum), per hit; the round trip as "
        "measured added in brackets): " + ", ".join(parts)
    )


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--traced-broker":
        return traced_broker(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="2MiB")
    ap.add_argument("--hits", type=int, default=15)
    ap.add_argument("--backends", default="redis")
    ap.add_argument("--json", help="write the per-hit figures here too")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from redis_servers import RedisServer

    from benchmarks.remote import MooncakeBackend, RedisBackend, mooncake_unavailable

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(backends) - {"redis", "mooncake"} or not backends:
        ap.error(f"--backends: redis and/or mooncake, got {args.backends!r}")
    if "mooncake" in backends and not args.in_netns:
        why = mooncake_unavailable()
        if why is None:  # everything in a private network namespace (see remote.py)
            inner = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--in-netns"]
            return subprocess.run(["unshare", "-n", "--", *inner]).returncode
        print(f"Mooncake skipped: {why}\n", flush=True)
        backends.remove("mooncake")
    if args.in_netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ.setdefault("LMCACHE_EC_REMOTE_TIMEOUT_S", "10")
    (size,) = parse_sizes(args.size)
    results: dict[str, list[dict[str, float]]] = {}
    with RedisServer() as srv:
        for name in backends:
            backend: Any = (
                RedisBackend(srv) if name == "redis" else MooncakeBackend(size, args.hits + 1)
            )
            try:
                results[backend.name] = run_backend(backend, size, args.hits)
            finally:
                backend.close()
    print(report(results, size), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "hits": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
