"""Where one put, one get and one has() hit spend their time (issue 18, attribution).

    .venv/bin/python benchmarks/attribution.py                 # ~1 minute
    .venv/bin/python benchmarks/attribution.py --iters 200 --sizes 64KiB   # smoke

A real broker (the CLI, with its Prometheus endpoint) and one client in this
process. Each operation runs ``--iters`` times with timers on the client's
socket (time inside ``sendall`` = the send syscall; time blocked in
``recv_into`` = waiting for the reply) and on its slab copies, and the broker's
own per-request time (decode, dispatch, encode, the reply's write syscall) is
read from its ``request_seconds`` histogram sums before and after. Per op (means
in microseconds):

- ``copy``: the slab memcpy(s) (and for ``get`` the new tensor's allocation);
- ``send``: inside sendall (the syscall, and the peer's wake-up it triggers);
- ``wait``: blocked in recv_into for the reply(s) the call waits for;
- ``broker``: the broker's per-request work for the requests it waits for;
- ``syscalls+wake-ups`` = send + wait - broker: the broker's wake-up, its
  recv, the event loop's dispatch to the protocol, this process's send and
  wake-up (on a busy host the broker often runs inside the client's sendall,
  so only the sum of send and wait is meaningful);
- ``client py`` = total - copy - send - wait: Python in the client (framing,
  msgspec, locks, filter, bookkeeping);
- ``posted``: broker time of requests the call does not wait for (Release,
  and the posted Commit); paid by the broker, off the caller's path.

Baselines in the same run: a raw Unix-socket ping-pong against a Python echo
process (blocking recv, the same wake-ups) and a bare memcpy of each size
between two touched buffers. For has() also, as p50s: a uvloop
``asyncio.Protocol`` echo (the floor of any Python server on the broker's
loop), a pre-encoded Has frame sent on a raw connection to the broker (the
broker's part without the client's Python) and has() itself, uninstrumented. ``put (commit waited)`` replays the previous put
(Reserve, copy, Commit, wait for the Commit's reply) with the same client, for
the before/after of the posted commit; ``put (reserve path)`` is put without its
put arena (Reserve waited, Commit posted), for the before/after of the arena
(``put`` itself copies into the arena and posts a Place: no wait).

Across processes (``--across``, on by default; issue 42): a writer process puts and
a different reader process gets, each woken by this process for every call (as a
vLLM worker is), with the copy path before and after issue 42 interleaved call by
call in the same run: ``before`` (one ctypes.memmove per extent; a new tensor's pages
faulted 4 KiB at a time) and ``after`` (a get into a new tensor of 32 MiB or more:
its pages advised MADV_HUGEPAGE, filled by torch's copy_ as clone() is; the rest as
before). Per call, medians in microseconds:
``client py`` (total - frames - copy - send - wait), ``frames`` (msgspec encode and
decode of the call's frames), ``copy`` (the slab copies, a new tensor's allocation
and first-touch faults included), ``faults`` (minor page faults of the process
during the call, a count), ``send`` + ``wait`` (the syscalls and wake-ups).
Baselines from the same processes in the same iteration: a memmove between two
touched buffers (writer and reader), and ``clone()`` of the same tensor in the
reader (a get into a new tensor against torch's own copy into a new tensor).
``--busy`` repeats the section with a CPU-bound process beside it. ``py after copy``
is the part of ``client py`` after the call's last copy (caches the copy just
flushed). ``--before-tree PATH`` compares two client trees instead of two copy paths:
``main`` (the package at PATH, in its own writer and reader) and ``branch`` (this
checkout), interleaved call by call against one broker.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    die_with_parent,
    fmt_size,
    parse_sizes,
    percentile,
    table,
)
from benchmarks.timed_socket import TimedSocket, Timers  # noqa: E402

_ECHO = """
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1]); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
while data := conn.recv(65536):
    conn.sendall(data)
"""


# The floor for "a Python server on the broker's event loop": an asyncio.Protocol that
# writes back what it reads, on uvloop as the broker runs (no decoding, no dispatch).
_UV_ECHO = """
import asyncio, os, sys
try:
    import uvloop
    run = uvloop.run
except ImportError:
    run = asyncio.run
class Echo(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
    def data_received(self, data):
        self.t.write(data)
async def main():
    srv = await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()
run(main())
"""


def instrument(client: Any, timers: Timers) -> TimedSocket:
    """Time the client's socket and slab copies (benchmark-side only); the timed socket."""
    got: list[TimedSocket] = []

    def wrap(sock: Any) -> TimedSocket:
        got.append(sock if isinstance(sock, TimedSocket) else TimedSocket(sock, timers))
        return got[-1]

    client.instrument_socket(wrap)
    slab = client.slab()
    if getattr(slab, "_timed", False):
        return got[0]
    depth = [0]  # read() calls read_into(): time the outermost call only
    for name in ("write", "read", "read_into"):
        inner = getattr(slab, name)

        def timed(*a: Any, _inner: Callable[..., Any] = inner) -> Any:
            depth[0] += 1
            t0 = time.perf_counter_ns()
            try:
                return _inner(*a)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    timers.copy += time.perf_counter_ns() - t0

        setattr(slab, name, timed)
    slab._timed = True
    return got[0]


def broker_seconds(port: int) -> dict[str, tuple[float, int]]:
    """op -> (sum of seconds, count) from the broker's request_seconds histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[float]] = {}
    pat = r'^lmcache_ec_broker_request_seconds_(sum|count)\{op="(\w+)"\} (\S+)$'
    for kind, op, value in re.findall(pat, text, re.M):
        out.setdefault(op, [0.0, 0.0])[0 if kind == "sum" else 1] = float(value)
    return {op: (s, int(c)) for op, (s, c) in out.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(
    name: str,
    call: Callable[[int], Any],
    iters: int,
    timers: Timers,
    port: int,
    waited: tuple[str, ...],
    posted: tuple[str, ...],
    settle: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Run ``call(i)`` iters times; phases as means in microseconds. ``settle`` (the
    client's flush) returns once the broker has handled every request the calls posted,
    so their broker time is in the histogram read after them (on a loaded host the
    broker may not have run yet when the last call returns)."""
    for i in range(min(200, iters)):  # warm-up (page faults, caches, the broker idle again)
        call(i)
    before = broker_seconds(port)
    total = send = wait = copy = 0
    for i in range(iters):
        timers.reset()
        t0 = time.perf_counter_ns()
        call(i)
        total += time.perf_counter_ns() - t0
        send += timers.send
        wait += timers.wait
        copy += timers.copy
    if settle is not None:
        settle()
    after = broker_seconds(port)

    def spent(ops: tuple[str, ...]) -> float:
        s = sum(after.get(op, (0.0, 0))[0] - before.get(op, (0.0, 0))[0] for op in ops)
        return s * 1e6 / iters

    us = 1e-3 / iters
    row = {
        "op": name,
        "total": total * us,
        "copy": copy * us,
        "send": send * us,
        "wait": wait * us,
        "broker": spent(waited),
        "posted": spent(posted),
    }
    # On a busy host the broker often runs inside the client's sendall (the wake-up
    # of the peer preempts the sender), so send and wait are split by the scheduler;
    # their sum minus the broker's own time is what the syscalls and wake-ups cost.
    row["syscalls+wake-ups"] = row["send"] + row["wait"] - row["broker"]
    row["client py"] = row["total"] - row["copy"] - row["send"] - row["wait"]
    return row


def raw_rtt(path: str, iters: int, msg: bytes = b"x" * 40) -> float:
    """Mean microseconds of a ping-pong of ``msg`` (one reply per message) on ``path``."""
    return ping_pong(path, iters, msg)[0]


def ping_pong(path: str, iters: int, msg: bytes) -> tuple[float, float]:
    """(mean, p50) microseconds of ``msg`` sent and one reply read back, ``iters`` times."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    buf = bytearray(4096)
    lat = []
    try:
        for _ in range(min(200, iters)):
            s.sendall(msg)
            s.recv_into(buf)
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            s.sendall(msg)
            s.recv_into(buf)
            lat.append(time.perf_counter_ns() - t0)
        return sum(lat) / iters / 1e3, percentile(lat, 0.5) / 1e3
    finally:
        s.close()


def p50_us(call: Callable[[], Any], iters: int) -> float:
    """p50 microseconds of ``call()`` (uninstrumented), after a warm-up."""
    for _ in range(min(200, iters)):
        call()
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        call()
        lat.append(time.perf_counter_ns() - t0)
    return percentile(lat, 0.5) / 1e3


def raw_has_rtt(socket_path: str, iters: int) -> tuple[float, float]:
    """(mean, p50) µs of a pre-encoded Has frame on a greeted connection: the broker's
    part of a has() hit without the client's Python (a second client, its socket used raw)."""
    import msgspec

    from lmcache_ec_broker.connector.client import BrokerClient
    from lmcache_ec_broker.protocol import Has, encode_frame

    c = BrokerClient(socket_path, timeout_s=30)
    try:
        c.flush()
        socks: list[Any] = []
        c.instrument_socket(lambda s: socks.append(s) or s)  # the greeted socket, used raw
        sock, buf = socks[0], bytearray(4096)
        frame = encode_frame(msgspec.msgpack.Encoder(), Has(["has-key"], 0))
        lat = []
        for _ in range(min(200, iters) + iters):
            t0 = time.perf_counter_ns()
            sock.sendall(frame)
            sock.recv_into(buf)  # the 4-byte header and a 1-bool body arrive together
            lat.append(time.perf_counter_ns() - t0)
        lat = lat[-iters:]
        return sum(lat) / iters / 1e3, percentile(lat, 0.5) / 1e3
    finally:
        c.close()


def bare_memcpy(nbytes: int, iters: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(5):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    return (time.perf_counter_ns() - t0) / iters / 1e3


def put_reserved(client: Any, key: str, tensor: Any) -> bool:
    """put without the arena: Reserve (waited), copy, Commit posted."""
    from lmcache_ec_broker.connector.client.copy import dtype_name
    from lmcache_ec_broker.protocol import Commit, Reserve, ReserveStatus, expected_nbytes

    dtype, shape = dtype_name(tensor.dtype), list(tensor.shape)
    reply = client.request(Reserve(key, expected_nbytes(dtype, shape), dtype, shape))
    if reply.status != ReserveStatus.RESERVED:
        return False
    client.slab().write(reply.extents, tensor)
    client.post(Commit(reply.token), keys=(key,))
    return True


def put_commit_waited(client: Any, key: str, tensor: Any) -> bool:
    """The previous put: Reserve, copy, Commit and wait for its reply."""
    from lmcache_ec_broker.connector.client.copy import dtype_name
    from lmcache_ec_broker.protocol import Commit, Reserve, ReserveStatus, expected_nbytes

    dtype, shape = dtype_name(tensor.dtype), list(tensor.shape)
    reply = client.request(Reserve(key, expected_nbytes(dtype, shape), dtype, shape))
    if reply.status != ReserveStatus.RESERVED:
        return False
    client.slab().write(reply.extents, tensor)
    client.request(Commit(reply.token))
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lmcache_ec_broker.connector.client import BrokerClient

    sizes = parse_sizes(args.sizes)
    iters = args.iters
    port = free_port()
    # Room for every put of every size (keys are unique so puts never find PRESENT).
    shm = sum(3 * iters * (s + 4096) for s in sizes) + 256 * MiB
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"load_1min": os.getloadavg()[0], "cpus": os.cpu_count()}
    tmp = tempfile.mkdtemp(prefix="ecb-attr-", dir="/tmp")
    echo_path = os.path.join(tmp, "echo.sock")
    uv_path = os.path.join(tmp, "uv-echo.sock")
    echos = [
        subprocess.Popen(
            [sys.executable, "-c", script, path],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        for script, path in ((_ECHO, echo_path), (_UV_ECHO, uv_path))
    ]
    try:
        for echo in echos:
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        with Broker(shm, ["--metrics-port", str(port)]) as broker:
            timers = Timers()
            client = BrokerClient(broker.socket_path, timeout_s=30)
            client.put("has-key", torch.ones(8, dtype=torch.uint8))
            client.flush()
            # Floors, p50 of each in the same run, one after the other: a blocking Python
            # echo (the raw round trip), a uvloop Protocol echo (a Python server on the
            # broker's loop), a pre-encoded Has frame on a raw connection to the broker
            # (no client Python), and has() itself, uninstrumented.
            results["raw_rtt_us"], results["raw_p50_us"] = ping_pong(
                echo_path, iters * 2, b"x" * 40
            )
            results["uv_echo_us"], results["uv_echo_p50_us"] = ping_pong(
                uv_path, iters * 2, b"x" * 40
            )
            results["raw_has_us"], results["raw_has_p50_us"] = raw_has_rtt(
                broker.socket_path, iters * 2
            )
            results["has_p50_us"] = p50_us(lambda: client.has(["has-key"]), iters * 2)
            # With a lease has() must ask the broker: the round trip the index saves.
            results["has_asked_p50_us"] = p50_us(
                lambda: client.has(["has-key"], lease_ms=1), iters * 2
            )
            instrument(client, timers)
            rows.append(
                measure(
                    "has() hit, 1 key",
                    lambda i: client.has(["has-key"]),
                    iters * 2,
                    timers,
                    port,
                    ("has",),
                    ("served",),
                )
            )
            rows.append(
                measure(
                    "has() hit, leased (asked)",
                    lambda i: client.has(["has-key"], lease_ms=1),
                    iters * 2,
                    timers,
                    port,
                    ("has",),
                    (),
                )
            )
            for size in sizes:
                label = fmt_size(size)
                tensor = torch.ones(size // (2 * 1024), 1024, dtype=torch.bfloat16)
                out = torch.empty_like(tensor)
                results[f"memcpy_us {label}"] = bare_memcpy(size, max(20, iters // 4))
                # put: into the connection's put arena (a Place posted, no wait);
                # reserve path: what put does without an arena (Reserve waited, Commit
                # posted); commit waited: the put before issue 18.
                for mode, fn, waited, posted in (
                    ("put", client.put, (), ("place", "arenagrant", "reserve", "commit")),
                    (
                        "put (reserve path)",
                        lambda k, t: put_reserved(client, k, t),
                        ("reserve",),
                        ("commit",),
                    ),
                    (
                        "put (commit waited)",
                        lambda k, t: put_commit_waited(client, k, t),
                        ("reserve", "commit"),
                        (),
                    ),
                ):
                    tag = mode.replace(" ", "_")
                    rows.append(
                        measure(
                            f"{mode} {label}",
                            lambda i, fn=fn, tag=tag, label=label, t=tensor: fn(
                                f"{tag}-{label}-{i}", t
                            ),
                            iters,
                            timers,
                            port,
                            waited,
                            posted,
                            settle=client.flush,
                        )
                    )
                key = f"put-{label}-0"
                # The puts' posted work (Places, Commits) is the broker's backlog, not the
                # gets': let it finish before the gets are timed.
                client.flush()
                time.sleep(0.2)
                rows.append(
                    measure(
                        f"get_into {label}",
                        lambda i, key=key, out=out: client.get_into(key, out),
                        iters,
                        timers,
                        port,
                        ("get",),
                        ("release", "served"),
                    )
                )
                rows.append(
                    measure(
                        f"get {label}",
                        lambda i, key=key: client.get(key),
                        iters,
                        timers,
                        port,
                        ("get",),
                        ("release", "served"),
                    )
                )
            client.close()
    finally:
        for echo in echos:
            echo.kill()
            echo.wait()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    results["rows"] = rows
    return results


def report(res: dict[str, Any]) -> str:
    cols = ["total", "client py", "copy", "send", "wait", "broker", "syscalls+wake-ups", "posted"]
    body = [[r["op"], *(f"{r[c]:.1f}" for c in cols)] for r in res["rows"]]
    lines = [
        f"load (1 min) {res['load_1min']:.1f} on {res['cpus']} CPUs; means in µs per call",
        table(["op", *cols], body),
        "",
        f"raw Unix-socket ping-pong (Python echo process): {res['raw_rtt_us']:.1f} µs",
        "",
        "has() hit against its floors, p50 in µs (mean), one after the other in this run:",
        f"  raw ping-pong, blocking Python echo      {res['raw_p50_us']:6.1f} "
        f"({res['raw_rtt_us']:.1f})",
        f"  ping-pong, uvloop Protocol echo          {res['uv_echo_p50_us']:6.1f} "
        f"({res['uv_echo_us']:.1f})",
        f"  pre-encoded Has frame to the broker      {res['raw_has_p50_us']:6.1f} "
        f"({res['raw_has_us']:.1f})",
        f"  has() through BrokerClient               {res['has_p50_us']:6.1f}"
        "  (answered from the residency index)",
        f"  has() with a lease (asks the broker)     {res['has_asked_p50_us']:6.1f}",
    ]
    for k, v in res.items():
        if k.startswith("memcpy_us"):
            lines.append(f"bare memcpy {k.split(' ', 1)[1]}: {v:.1f} µs")
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        from benchmarks.attribution_across import worker_main

        worker_main()
        return
    from benchmarks import attribution_across as across

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="64KiB,2MiB")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument(
        "--only", choices=("all", "inproc", "across"), default="all",
        help="inproc: one client in this process; across: writer and reader processes",
    )  # fmt: skip
    p.add_argument(
        "--across-sizes", default="64KiB,2MiB,34MiB",
        help="sizes of the across-process section (its gets into new tensors vs clone())",
    )  # fmt: skip
    p.add_argument("--across-iters", type=int, default=60, help="calls per size and copy path")
    p.add_argument("--busy", action="store_true", help="also run it beside a CPU-bound process")
    p.add_argument(
        "--before-tree",
        help="across: compare the client at this tree (e.g. a git worktree of main) with this "
        "checkout's, each in its own writer and reader, interleaved call by call",
    )  # fmt: skip
    p.add_argument(
        "--sched-compare", action="store_true",
        help="across: two brokers, one with its threads SCHED_BATCH, this checkout's client",
    )  # fmt: skip
    p.add_argument(
        "--pin", metavar="BROKER,WRITERS,READERS",
        help="across: pin the broker, the writer and the reader processes to these CPUs "
        "(taskset lists joined by '/', e.g. 0/0/1): where the kernel runs the broker "
        "woken by a posted Place decides the put's send (docs/performance.md)",
    )  # fmt: skip
    p.add_argument(
        "--gap-ms", type=float, default=0.0,
        help="across: the reader sleeps this long before each get_into (a worker between "
        "steps; a client's batch of served hits is then older than 5 ms at every call)",
    )  # fmt: skip
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args()
    pin: tuple[str, str, str] | None = None
    if args.pin:
        cpus = args.pin.split("/")
        if len(cpus) != 3:
            p.error("--pin takes three CPU lists joined by '/', e.g. 0/0/1")
        pin = (cpus[0], cpus[1], cpus[2])
    if args.iters < 1 or args.across_iters < 1:
        p.error("--iters and --across-iters must be >= 1")
    if args.gap_ms < 0:
        p.error("--gap-ms must be >= 0")
    res: dict[str, Any] = {}
    if args.only != "across":
        res = run(args)
        print(report(res))
    if args.only != "inproc":
        res["across"] = across.run(
            parse_sizes(args.across_sizes), args.across_iters, busy=args.busy,
            before_tree=args.before_tree, sched=args.sched_compare, pin=pin,
            gap_s=args.gap_ms / 1e3,
        )  # fmt: skip
        print(("\n\n" if args.only == "all" else "") + across.report(res["across"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
