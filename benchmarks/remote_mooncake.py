"""The Mooncake remote tier against Mooncake's own client moving the same bytes.

    sudo python benchmarks/remote_mooncake.py [--sizes 2MiB,34MiB,130MiB] [--repeat 5]

Everything runs in a private network namespace with only ``lo`` (``unshare -n``;
root needed): a ``mooncake_master``, a *holder* process that contributes the memory
the objects live in (the other node), and the measuring process, which contributes
none -- so every byte crosses the transfer engine (TCP on loopback here).

Rows, per size (medians of --repeat runs):
- promotion: ``MooncakeTier.read_into`` of an entry into reserved slab extents
  (1 and 4 extents; header parse + checksum check included) against a bare
  ``get_into`` of an object of the same size into an ordinary registered buffer,
  called directly and (like the tier, which must not block the broker's event
  loop) on a worker thread that the caller awaits;
- write-behind: ``MooncakeTier.write`` of a pinned slab entry (checksum + header +
  gathered ``batch_put_from_multi_buffers``) against a bare ``put_from`` from an
  ordinary registered buffer.
Copies per byte: promotion and write-behind each move a byte once (the transfer
engine, between the slab and the holder's segment) and read it once more for the
checksum; the tier makes no copy of its own. Target: tier >= 0.8x the bare client.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import MiB, die_with_parent, fmt_size, median, parse_sizes, table  # noqa: E402

MASTER = "127.0.0.1:50051"
COPIES = (
    "copies per byte: promotion 1 (transfer engine into the slab) + 1 checksum read; "
    "write-behind 1 (transfer engine from the slab) + 1 checksum read; no copy by the tier"
)


def _master_binary() -> str:
    import mooncake

    return str(Path(mooncake.__file__).parent / "mooncake_master")


def _client(segment: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed: {rc}")
    return s


def holder(segment: int) -> None:
    """The other node: contributes ``segment`` bytes, lives until stdin closes."""
    s = _client(segment)
    print("ready", flush=True)
    sys.stdin.read()
    s.close()


def extents(n: int, pieces: int, base: int = 0) -> list[tuple[int, int]]:
    """``n`` bytes at ``base`` as ``pieces`` adjacent extents (start, length)."""
    step = -(-n // pieces)
    return [(base + i * step, min(step, n - i * step)) for i in range(pieces) if i * step < n]


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


async def measure(sizes: list[int], repeat: int) -> list[dict[str, float]]:
    """Per size, the medians in seconds: bare_get, tier_get1, tier_get4, bare_put, tier_put."""
    from lmcache_ec_broker.broker.tiers.base import EntryMeta, SlabAccess
    from lmcache_ec_broker.broker.tiers.mooncake.settings import MooncakeSettings
    from lmcache_ec_broker.broker.tiers.mooncake.transport import MooncakeTier

    top = max(sizes)
    slab_mm = mmap.mmap(-1, 2 * top + 8 * MiB)
    plain = mmap.mmap(-1, top)
    for m in (slab_mm, plain):  # touch every page once: no first-touch faults in the timings
        for off in range(0, len(m), 1 << 20):
            m[off : off + 1] = b"\1"
    slab_mm[: 2 * top] = os.urandom(1 << 20) * (2 * top // (1 << 20))
    bare = _client(0)
    if bare.register_buffer(_addr(plain), len(plain)) != 0:
        raise RuntimeError("register_buffer failed")

    class Events:
        def added(self, tier: object, key: str) -> None: ...
        def removed(self, tier: object, key: str) -> None: ...

    tier = MooncakeTier(
        MooncakeSettings(master=MASTER, global_segment_size=0, key_poll_s=0.0, timeout_s=5.0)
    )
    tier.open()
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(1)  # like the tier's own read threads: started once
    await loop.run_in_executor(worker, time.sleep, 0)
    tier.start(loop, SlabAccess(slab_mm), Events())
    while not tier.stats()["remote_up"]:
        await asyncio.sleep(0.05)

    rows: list[dict[str, float]] = []
    for n in sizes:
        meta = EntryMeta(n, "uint8", (n,))
        t_bare_put, t_tier_put, t_bare_get, t_tier_get1, t_tier_get4 = [], [], [], [], []
        t_bare_get_thread: list[float] = []
        for r in range(-1, repeat):  # run -1 warms the holder's segment and is not kept
            key = f"bench-{n}-{r}"
            timed: dict[str, float] = {}

            async def tier_put(key: str = key, n: int = n, meta=meta, timed=timed) -> None:
                t0 = time.perf_counter()
                fut = tier.write(key, meta, extents(n, 4))
                assert fut is not None
                await fut
                timed["tier_put"] = time.perf_counter() - t0

            def bare_put(key: str = key, n: int = n, timed=timed) -> None:
                t0 = time.perf_counter()
                rc = bare.put_from("bare:" + key, _addr(plain), n)
                timed["bare_put"] = time.perf_counter() - t0
                assert rc == 0, rc

            if r % 2:  # alternate who goes first: neither always meets a colder store
                await tier_put()
                bare_put()
            else:
                bare_put()
                await tier_put()
            assert tier.stats()["remote_write_errors"] == 0, tier.stats()
            t0 = time.perf_counter()
            got = bare.get_into("bare:" + key, _addr(plain), n)
            timed["bare_get"] = time.perf_counter() - t0
            assert got == n, got
            # The same call handed to a worker thread and awaited, as the tier must (it
            # cannot block the broker's event loop): what the hand-off alone costs.
            t0 = time.perf_counter()
            got = await loop.run_in_executor(worker, bare.get_into, "bare:" + key, _addr(plain), n)
            timed["bare_get_thread"] = time.perf_counter() - t0
            assert got == n, got
            for pieces in (1, 4):
                t0 = time.perf_counter()
                await tier.read_into(key, meta, extents(n, pieces, base=top + 4 * MiB))
                timed[f"tier_get{pieces}"] = time.perf_counter() - t0
            assert slab_mm[top + 4 * MiB : top + 4 * MiB + n] == slab_mm[:n]
            for k in ("bare:" + key, tier.s.key_prefix + key):  # room for the next run
                assert bare.remove(k, True) == 0
            tier.delete([key])
            if r >= 0:
                t_bare_put.append(timed["bare_put"])
                t_tier_put.append(timed["tier_put"])
                t_bare_get.append(timed["bare_get"])
                t_bare_get_thread.append(timed["bare_get_thread"])
                t_tier_get1.append(timed["tier_get1"])
                t_tier_get4.append(timed["tier_get4"])

        rows.append(
            {
                "size": n,
                "bare_get": median(t_bare_get),
                "bare_get_thread": median(t_bare_get_thread),
                "tier_get1": median(t_tier_get1),
                "tier_get4": median(t_tier_get4),
                "bare_put": median(t_bare_put),
                "tier_put": median(t_tier_put),
            }
        )
    await tier.shutdown(10)
    tier.close()
    bare.close()
    worker.shutdown()
    return rows


def tier_rows(sizes: list[int], repeat: int) -> list[dict[str, float]]:
    """Start a master and a holder on 127.0.0.1 (the caller is in a private network
    namespace with only lo), measure, stop them."""
    master = subprocess.Popen(
        [
            _master_binary(),
            "-rpc_address=127.0.0.1",
            "-rpc_port=50051",
            "-metrics_host=127.0.0.1",
            "-metrics_port=9003",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    hold = None
    try:
        segment = 4 * max(sizes) + 64 * MiB  # each run's objects are removed after it
        deadline = time.monotonic() + 30
        while b"127.0.0.1:50051" not in subprocess.run(["ss", "-Hltn"], capture_output=True).stdout:
            if time.monotonic() > deadline or master.poll() is not None:
                raise RuntimeError("mooncake_master did not start")
            time.sleep(0.05)
        hold = subprocess.Popen(
            [sys.executable, __file__, "--holder", str(segment)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        assert hold.stdout is not None and hold.stdout.readline().strip() == b"ready"
        return asyncio.run(measure(sizes, repeat))
    finally:
        if hold is not None:
            hold.communicate(timeout=30)
        master.kill()
        master.wait(10)


def inner(args: argparse.Namespace) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    rows = tier_rows(parse_sizes(args.sizes), args.repeat)

    def gbs(n: float, t: float) -> str:
        return f"{n / t / 1e9:.2f}"

    print(
        table(
            [
                "size",
                "bare get_into GB/s",
                "on a thread",
                "tier promote 1 ext",
                "4 ext",
                "promote/bare",
                "promote/bare on a thread",
                "bare put_from GB/s",
                "tier write-behind",
                "write/bare",
            ],
            [
                [
                    fmt_size(int(r["size"])),
                    gbs(r["size"], r["bare_get"]),
                    gbs(r["size"], r["bare_get_thread"]),
                    gbs(r["size"], r["tier_get1"]),
                    gbs(r["size"], r["tier_get4"]),
                    f"{r['bare_get'] / r['tier_get1']:.2f}x",
                    f"{r['bare_get_thread'] / r['tier_get1']:.2f}x",
                    gbs(r["size"], r["bare_put"]),
                    gbs(r["size"], r["tier_put"]),
                    f"{r['bare_put'] / r['tier_put']:.2f}x",
                ]
                for r in rows
            ],
        )
    )
    print(COPIES)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2MiB,34MiB,130MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--holder", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.holder:
        holder(args.holder)
    elif args.inner:
        inner(args)
    else:
        if os.geteuid() != 0:
            sys.exit(
                "remote_mooncake.py needs root: it runs Mooncake in a private network namespace"
            )
        argv = [
            sys.executable,
            __file__,
            "--inner",
            "--sizes",
            args.sizes,
            "--repeat",
            str(args.repeat),
        ]
        sys.exit(subprocess.run(["unshare", "-n", "--", *argv]).returncode)


if __name__ == "__main__":
    main()
