"""Probe: the least a put+get_into across processes can cost in Python on this machine,
beside the broker's client, in the same processes and the same run (issue 42).

Issue 42 asks put+get_into across processes for >= 0.8x of two memcpys at 2 MiB. This
probe measures what any Python client moving the bytes through shared memory pays at
the least, with nothing of ours in the way:

- **bare put**: one ``memmove`` of the tensor into a shared mapping (its slots rotate,
  as slab blocks do), an offset and a sequence number written into the mapping's
  header, and a 64-byte ``send`` to a sink process (someone must be told: the sink
  stands for the broker, reads, and does ``--sink-work-us`` of work per message).
- **bare get_into**: the header read, one ``memmove`` out of the mapping into the
  reader's tensor.
- **client**: ``BrokerClient.put`` and ``get_into`` of the same tensor through a real
  broker (``--sched-batch``: the broker's threads SCHED_BATCH).
- **memcpy**: the issue's baseline, one copy between two touched buffers in the same
  process, right before its calls.
- **slab copies**: the two copies alone, nothing else -- the writer's ``memmove`` into
  the next slot of a mapping as large as the run's broker slab, the reader's
  ``memmove`` of the same slot out. What every cache that keeps entries in shared
  memory pays however its client is written: the slab side of a put is memory no
  cache line holds (a slab larger than the CPU's caches, its blocks rewritten long
  after they were last touched), unlike the memcpy baseline's two warm buffers.
  ``2 memcpys / slab copies`` is therefore the most any client can reach of the
  issue's ratio on this machine.
- **streaming**: the client's put of 4 MiB or more is copied into the slab with
  non-temporal stores (``shm/_stream_copy.c``). Two more paths show what that does, in
  the same processes: **client, memmove puts** (the writer's ``SlabView.stream_min``
  set past the size for that put: the copy as it was) and **slab copies, streamed**
  (the writer's copy of the slab-copies pair with the same non-temporal stores).

A writer and a reader worker process; each iteration runs the bare pair, the client
pair (streamed and memmove puts) and the slab copies (both ways) in rotating order, every call a request to a just-woken worker, as
``attribution.py --only across`` does. Medians of ``--iters`` iterations, µs.
``--gap-ms`` sleeps that long before each get_into (both paths): how the client's cost
in a just-woken process grows with the time it slept, against the bare path's.

    .venv/bin/python benchmarks/shm_floor_probe.py
    .venv/bin/python benchmarks/shm_floor_probe.py --sched-batch --sizes 64KiB,2MiB
    .venv/bin/python benchmarks/shm_floor_probe.py --sched-batch --gap-ms 5
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmcache_ec_broker.shm._stream_copy import stream_copy as _stream_copy  # noqa: E402

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    Worker,
    fmt_size,
    median,
    parse_sizes,
    serve_worker,
    table,
)
from lmcache_ec_broker.connector.client.copy import STREAM_MIN  # noqa: E402

HEADER = struct.Struct("<QQ")  # offset of the latest bare put's bytes, its sequence number
HIDDEN = 1024


class Side:
    """A writer or a reader: a BrokerClient, the shared mapping, a socket to the sink."""

    def setup(
        self, socket_path: str, mapping: str, slab: str, sink: str, size: int, slots: int
    ) -> dict:
        import torch

        from lmcache_ec_broker import BrokerClient

        self.torch = torch
        self.client = BrokerClient(socket_path, timeout_s=60)
        fd = os.open(mapping, os.O_RDWR)
        self.mm = mmap.mmap(fd, 4096 + slots * size)
        os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        fd = os.open(slab, os.O_RDWR)
        # populated (as the broker's slab and its clients' mappings are): no page faults
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.slab = mmap.mmap(fd, os.fstat(fd).st_size, flags=flags)
        os.close(fd)
        self.slab_base = ctypes.addressof(ctypes.c_char.from_buffer(self.slab))
        self.slab_slots = self.slab.size() // size
        self.size, self.slots, self.seq = size, slots, 0
        g = torch.Generator().manual_seed(size)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        self.tensor = raw.view(torch.bfloat16).reshape(-1, HIDDEN)
        self.out = torch.zeros_like(self.tensor)  # touched: a reused tensor
        self.scratch = torch.zeros_like(self.tensor)
        self.sink = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sink.connect(sink)
        return {}

    def memcpy(self) -> dict:
        src, dst = self.tensor.data_ptr(), self.scratch.data_ptr()
        t0 = time.perf_counter_ns()
        ctypes.memmove(dst, src, self.size)
        return {"us": (time.perf_counter_ns() - t0) / 1e3}

    def bare_put(self) -> dict:
        t0 = time.perf_counter_ns()
        self.seq += 1
        off = 4096 + (self.seq % self.slots) * self.size
        ctypes.memmove(self.base + off, self.tensor.data_ptr(), self.size)
        HEADER.pack_into(self.mm, 0, off, self.seq)
        self.sink.send(b"P" * 64)
        return {"us": (time.perf_counter_ns() - t0) / 1e3}

    def bare_get_into(self) -> dict:
        self.out.zero_()  # a stale copy cannot pass the check below
        t0 = time.perf_counter_ns()
        off, _seq = HEADER.unpack_from(self.mm, 0)
        ctypes.memmove(self.out.data_ptr(), self.base + off, self.size)
        us = (time.perf_counter_ns() - t0) / 1e3
        assert self._same(), "the bare copy moved other bytes"
        return {"us": us}

    def slab_put(self, i: int, streamed: bool = False) -> dict:
        dst = self.slab_base + (i % self.slab_slots) * self.size
        copy = _stream_copy if streamed else ctypes.memmove
        t0 = time.perf_counter_ns()
        copy(dst, self.tensor.data_ptr(), self.size)
        return {"us": (time.perf_counter_ns() - t0) / 1e3}

    def slab_get(self, i: int) -> dict:
        self.out.zero_()
        src = self.slab_base + (i % self.slab_slots) * self.size
        t0 = time.perf_counter_ns()
        ctypes.memmove(self.out.data_ptr(), src, self.size)
        us = (time.perf_counter_ns() - t0) / 1e3
        assert self._same(), "the slab copy moved other bytes"
        return {"us": us}

    def put(self, key: str, memmove: bool = False) -> dict:
        slab = self.client.slab()
        slab.stream_min = sys.maxsize if memmove else STREAM_MIN
        t0 = time.perf_counter_ns()
        ok = self.client.put(key, self.tensor)
        us = (time.perf_counter_ns() - t0) / 1e3
        slab.stream_min = STREAM_MIN
        assert ok, f"put of {key} refused"
        return {"us": us}

    def get_into(self, key: str) -> dict:
        self.out.zero_()
        t0 = time.perf_counter_ns()
        ok = self.client.get_into(key, self.out)
        us = (time.perf_counter_ns() - t0) / 1e3
        assert ok and self._same(), key
        return {"us": us}

    def _same(self) -> bool:
        # as bytes: random bf16 bits hold NaNs, which never compare equal as numbers
        u8 = self.torch.uint8
        return self.torch.equal(self.out.view(-1).view(u8), self.tensor.view(-1).view(u8))

    def delete(self, key: str) -> dict:
        self.client.delete(key)
        return {}


def _sink(srv: socket.socket, work_us: float, stop: threading.Event) -> None:
    """Reads what the writers send; ``work_us`` of work per read (a thread of this
    orchestrating process, which otherwise sleeps on its workers' replies)."""
    import select

    conns: list[socket.socket] = []
    while not stop.is_set():
        ready, _, _ = select.select([srv, *conns], [], [], 0.2)
        for s in ready:
            if s is srv:
                conns.append(srv.accept()[0])
                continue
            if not s.recv(65536):
                conns.remove(s)
                continue
            end = time.perf_counter() + work_us / 1e6
            while time.perf_counter() < end:
                pass


def run(
    size: int, iters: int, slots: int, sched_batch: bool, work_us: float, gap_s: float
) -> dict[str, Any]:
    script = os.path.abspath(__file__)
    extra = ["--sched-batch"] if sched_batch else []
    tmp = tempfile.mkdtemp(prefix="ecb-floor-", dir="/tmp")
    mapping = f"/dev/shm/ecb-floor-{os.getpid()}"
    with open(mapping, "wb") as f:
        f.truncate(4096 + slots * size)
    slab_bytes = max(256 * MiB, 8 * size + 64 * MiB)  # the broker's slab below
    slab = f"/dev/shm/ecb-floor-slab-{os.getpid()}"
    with open(slab, "wb") as f:
        f.truncate(slab_bytes)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sink_path = os.path.join(tmp, "sink.sock")
    srv.bind(sink_path)
    srv.listen(4)
    stop = threading.Event()
    sink = threading.Thread(target=_sink, args=(srv, work_us, stop), daemon=True)
    sink.start()
    workers: list[Worker] = []
    try:
        with Broker(slab_bytes, extra) as broker:
            writer, reader = Worker(script), Worker(script)
            workers += [writer, reader]
            for w in workers:
                w.call(op="setup", socket_path=broker.socket_path, mapping=mapping,
                       slab=slab, sink=sink_path, size=size, slots=slots)  # fmt: skip
            load = [os.getloadavg()[0]]
            rows: list[dict[str, float]] = []
            paths = ("bare", "client", "slab", "client mm", "slab nt")
            n = len(paths)
            for i in range(n + iters):
                row: dict[str, float] = {}
                for path in paths[i % n :] + paths[: i % n]:
                    row[f"memcpy w {path}"] = writer.call(op="memcpy")["us"]
                    if path == "bare":
                        row["bare put"] = writer.call(op="bare_put")["us"]
                    elif path.startswith("slab"):
                        nt = path == "slab nt"
                        # a slot of its own for each: the streamed copy's reader must
                        # not find the other copy's lines in the caches
                        row[f"{path} put"] = writer.call(
                            op="slab_put", i=2 * i + nt, streamed=nt
                        )["us"]
                    else:
                        mm = path == "client mm"
                        row[f"{path} put"] = writer.call(op="put", key=f"{path}{i}", memmove=mm)[
                            "us"
                        ]
                    row[f"memcpy r {path}"] = reader.call(op="memcpy")["us"]
                    if gap_s:
                        time.sleep(gap_s)
                    if path == "bare":
                        row["bare get_into"] = reader.call(op="bare_get_into")["us"]
                    elif path.startswith("slab"):
                        nt = path == "slab nt"
                        row[f"{path} get"] = reader.call(op="slab_get", i=2 * i + nt)["us"]
                    else:
                        row[f"{path} get"] = reader.call(op="get_into", key=f"{path}{i}")["us"]
                        writer.call(op="delete", key=f"{path}{i}")
                if i >= n:
                    rows.append(row)
            load.append(os.getloadavg()[0])
    finally:
        for w in workers:
            w.close()
        stop.set()
        sink.join(5)
        srv.close()
        os.unlink(mapping)
        os.unlink(slab)
        os.unlink(sink_path)
        os.rmdir(tmp)

    def med(k: str) -> float:
        return median(r[k] for r in rows)

    def ratio(pair: tuple[str, str], path: str) -> float:
        # per iteration: the two memcpys of the same path's processes, as it ran
        return median(
            (r[f"memcpy w {path}"] + r[f"memcpy r {path}"]) / (r[pair[0]] + r[pair[1]])
            for r in rows
        )

    return {
        "size": size, "iters": iters, "load": load, "sched_batch": sched_batch,
        "medians": {k: med(k) for k in rows[0]},
        "bare": ratio(("bare put", "bare get_into"), "bare"),
        **{p: ratio((f"{p} put", f"{p} get"), p) for p in ("client", "client mm", "slab", "slab nt")},
        "client_over_bare": median(
            (r["client put"] + r["client get"]) / (r["bare put"] + r["bare get_into"])
            for r in rows
        ),
    }  # fmt: skip


def main() -> None:
    if "--worker" in sys.argv:
        side = Side()
        serve_worker({n: getattr(side, n) for n in dir(side) if not n.startswith("_")})
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="64KiB,2MiB")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3, help="whole runs per size, one after another")
    p.add_argument("--slots", type=int, default=8, help="slots the bare puts rotate through")
    p.add_argument("--sched-batch", action="store_true", help="the broker's threads SCHED_BATCH")
    p.add_argument("--sink-work-us", type=float, default=0.0, help="the sink's work per message")
    p.add_argument("--gap-ms", type=float, default=0.0, help="sleep before each get_into")
    args = p.parse_args()
    if args.iters < 1 or args.rounds < 1 or args.slots < 1:
        p.error("--iters, --rounds and --slots must be >= 1")
    if args.gap_ms < 0:
        p.error("--gap-ms must be >= 0")
    out = []
    for size in parse_sizes(args.sizes):
        for rnd in range(args.rounds):
            r = run(
                size, args.iters, args.slots, args.sched_batch, args.sink_work_us,
                args.gap_ms / 1e3,
            )  # fmt: skip
            m = r["medians"]
            out.append([
                fmt_size(size), rnd, f"{min(r['load']):.1f}-{max(r['load']):.1f}",
                f"{m['memcpy w bare']:.1f} / {m['memcpy r bare']:.1f}",
                f"{m['bare put']:.1f} / {m['bare get_into']:.1f}",
                f"{m['client put']:.1f} / {m['client get']:.1f}",
                f"{m['client mm put']:.1f} / {m['client mm get']:.1f}",
                f"{m['slab put']:.1f} / {m['slab get']:.1f}",
                f"{m['slab nt put']:.1f} / {m['slab nt get']:.1f}",
                f"{r['slab']:.2f}x", f"{r['slab nt']:.2f}x", f"{r['bare']:.2f}x",
                f"{r['client mm']:.2f}x", f"{r['client']:.2f}x", f"{r['client_over_bare']:.2f}x",
            ])  # fmt: skip
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs; broker "
        f"{'SCHED_BATCH' if args.sched_batch else 'normal'}; sink work {args.sink_work_us:g} "
        f"us; {args.gap_ms:g} ms asleep before each get_into; medians of {args.iters} "
        "iterations, µs\n"
    )
    print(table(["size", "round", "load", "memcpy w / r", "bare put / get_into",
                 "client put / get_into", "client, memmove puts", "slab copies w / r",
                 "slab copies, streamed", "2 memcpys / slab copies", "2 memcpys / streamed",
                 "2 memcpys / bare", "2 memcpys / client, memmove puts", "2 memcpys / client",
                 "client / bare"], out))  # fmt: skip
    print(
        f"\nThe client streams puts of {fmt_size(STREAM_MIN)} or more (non-temporal "
        "stores); 'memmove puts' is the same client with that off, call by call."
    )


if __name__ == "__main__":
    main()
