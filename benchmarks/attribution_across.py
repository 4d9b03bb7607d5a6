"""attribution.py's across-process section: where a put in one process and a get in
another spend their time, for two copy paths interleaved call by call (issue 42).

Run through ``benchmarks/attribution.py --only across`` (its docstring says what each
column is). This module holds the worker side (the writer and the reader are
``attribution.py --worker`` processes) and the orchestration and report.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import (
    Broker,
    MiB,
    Worker,
    die_with_parent,
    fmt_size,
    median,
    serve_worker,
    table,
)

# The two copy paths compared in one run: "before" is the client's CPU copy before
# issue 42 (one ctypes.memmove per extent, a new tensor faulted 4 KiB at a time),
# "after" the copy after it (a new tensor of copy.NEW_TENSOR_MIN bytes or more is
# advised MADV_HUGEPAGE and filled by torch's copy_; everything else unchanged).
# With ``--before-tree PATH`` the two paths are instead two client trees, each in its
# own writer and reader processes on the same broker: "main" (the package at PATH, e.g.
# a ``git worktree`` of main) and "branch" (this checkout), both with the default copy.
MODES = ("before", "after")
TREE_MODES = ("main", "branch")
# With ``--sched-compare``: one client tree, two brokers -- "normal" and "sched_batch"
# (the broker's threads SCHED_BATCH: a broker woken by a posted Place does not preempt
# the writer that woke it; docs/performance.md).
SCHED_MODES = ("normal", "sched_batch")
HIDDEN = 1024
PHASES = ("total", "client py", "py after copy", "frames", "copy", "faults", "send", "wait")


class _Timers:
    __slots__ = ("send", "wait", "copy", "frames", "copy_end", "io_at_copy_end")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.send = self.wait = self.copy = self.frames = 0
        self.copy_end = self.io_at_copy_end = 0


def _timed_fn(fn: Callable[..., Any], timers: _Timers, field: str) -> Callable[..., Any]:
    def timed(*a: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*a)
        finally:
            setattr(timers, field, getattr(timers, field) + time.perf_counter_ns() - t0)

    return timed


class Side:
    """A writer or a reader: one BrokerClient with timers on its socket, its frames
    (msgspec encode/decode) and its slab copies."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.client: Any = None
        self.timers = _Timers()
        self.tensors: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}
        self.echo: socket.socket | None = None

    def setup(self, socket_path: str) -> dict[str, Any]:
        from benchmarks.timed_socket import TimedSocket
        from lmcache_ec_broker import BrokerClient

        c = self.client = BrokerClient(socket_path, timeout_s=60)
        warm = f"warm-{os.getpid()}"
        c.put(warm, self.torch.zeros(8))  # maps the slab
        c.get(warm)
        c.delete(warm)
        c.flush()
        t = self.timers
        c.instrument_socket(lambda s: s if isinstance(s, TimedSocket) else TimedSocket(s, t))
        session = c._link.session  # the benchmark's view inside the client: frames
        session.framer._encode = _timed_fn(session.framer._encode, t, "frames")
        session.wire._decode = _timed_fn(session.wire._decode, t, "frames")
        slab = c.slab()
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
                        t.copy_end = time.perf_counter_ns()
                        t.copy += t.copy_end - t0
                        t.io_at_copy_end = t.send + t.wait + t.frames

            setattr(slab, name, timed)
        return {"torch_threads": self.torch.get_num_threads()}

    def _mode(self, copy: str) -> None:
        from lmcache_ec_broker.connector.client import copy as cp

        after = getattr(cp, "NEW_TENSOR_MIN", sys.maxsize)  # main's copy.py: no such path
        self.client.slab().new_tensor_min = sys.maxsize if copy == "before" else after

    def make(self, size: int) -> dict[str, Any]:
        torch = self.torch
        g = torch.Generator().manual_seed(size)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        self.tensors[size] = raw.view(torch.bfloat16).reshape(-1, HIDDEN)
        self.outs[size] = torch.zeros_like(self.tensors[size])  # touched: a reused tensor
        return {}

    def _phases(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        t = self.timers
        t.reset()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter_ns()
        r = fn()
        t1 = time.perf_counter_ns()
        total = t1 - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        ph = {
            "total": total / 1e3,
            "frames": t.frames / 1e3,
            "copy": t.copy / 1e3,
            "send": t.send / 1e3,
            "wait": t.wait / 1e3,
            "faults": float(faults),
        }
        ph["client py"] = ph["total"] - ph["frames"] - ph["copy"] - ph["send"] - ph["wait"]
        # Python between the last copy's end and the return (its syscalls and frames
        # taken out): the part that runs with caches the copy just flushed.
        after = 0.0
        if t.copy_end:
            io_after = t.send + t.wait + t.frames - t.io_at_copy_end
            after = (t1 - t.copy_end - io_after) / 1e3
        ph["py after copy"] = after
        return r, ph

    def put(self, key: str, size: int, copy: str) -> dict[str, Any]:
        self._mode(copy)
        t = self.tensors[size]
        ok, ph = self._phases(lambda: self.client.put(key, t))
        assert ok, f"put of {key} refused"
        return ph

    def get_into(self, key: str, size: int, copy: str) -> dict[str, Any]:
        self._mode(copy)
        out = self.outs[size]
        out.zero_()  # a stale copy cannot pass the check below
        ok, ph = self._phases(lambda: self.client.get_into(key, out))
        assert ok and self.torch.equal(_u8(out), _u8(self.tensors[size])), key
        return ph

    def get(self, key: str, size: int, copy: str) -> dict[str, Any]:
        self._mode(copy)
        got, ph = self._phases(lambda: self.client.get(key))
        assert got is not None and self.torch.equal(_u8(got), _u8(self.tensors[size])), key
        del got
        return ph

    def clone(self, size: int) -> dict[str, Any]:
        src = self.tensors[size]
        t0 = time.perf_counter_ns()
        c = src.clone()
        dt = time.perf_counter_ns() - t0
        del c
        return {"us": dt / 1e3}

    def memcpy(self, size: int) -> dict[str, Any]:
        src, dst = self.tensors[size], self.outs[size]
        t0 = time.perf_counter_ns()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)
        return {"us": (time.perf_counter_ns() - t0) / 1e3}

    def has_p50(self, key: str, n: int) -> dict[str, Any]:
        """p50 of ``n`` back-to-back has() calls for a present and an absent key (the
        figures docs/performance.md keeps for has(): answered from the index and the
        membership filter, no request)."""
        c, out = self.client, {}
        for name, k in (("hit", key), ("miss", key + "-absent")):
            lat = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                c.has([k])
                lat.append((time.perf_counter_ns() - t0) / 1e3)
            out[name] = median(lat)
        return out

    def delete(self, key: str) -> dict[str, Any]:
        self.client.delete(key)
        return {}

    def flush(self) -> dict[str, Any]:
        self.client.flush()
        return {}

    def echo_start(self, path: str) -> dict[str, Any]:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)

        def serve() -> None:
            conn, _ = srv.accept()
            while data := conn.recv(65536):
                conn.sendall(data)

        threading.Thread(target=serve, daemon=True).start()
        self.echo = srv
        return {}

    def rtt(self, path: str, iters: int) -> dict[str, Any]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        lat = []
        try:
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                s.sendall(b"x" * 40)
                s.recv(100)
                lat.append((time.perf_counter_ns() - t0) / 1e3)
        finally:
            s.close()
        return {"p50": median(lat), "min": min(lat)}


def _u8(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def worker_main() -> None:
    if "--lib" in sys.argv:  # the client tree this worker runs (--before-tree)
        sys.path.insert(0, sys.argv[sys.argv.index("--lib") + 1])
    side = Side()
    serve_worker({n: getattr(side, n) for n in dir(side) if not n.startswith("_")})


# ====================================================================== orchestrator


def _pin(pid: int, cpus: str | None) -> None:
    """Every thread of ``pid`` onto ``cpus`` (taskset's list form), or nothing."""
    if cpus:
        cmd = ["taskset", "-a", "-p", "-c", cpus, str(pid)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _one(
    sizes: list[int], iters: int, hog: bool, before_tree: str | None, sched: bool = False,
    pin: tuple[str, str, str] | None = None, gap_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attribution.py")
    shm = max(256 * MiB, 4 * max(sizes) + 64 * MiB)
    spinner = None
    workers: list[Worker] = []
    modes = TREE_MODES if before_tree else SCHED_MODES if sched else MODES
    res: dict[str, Any] = {"busy": hog, "sizes": sizes, "iters": iters, "modes": list(modes)}
    if before_tree:
        res["before_tree"] = before_tree
    on_broker, on_writers, on_readers = pin or (None, None, None)
    res["pin"] = list(pin) if pin else None
    res["gap_ms"] = gap_s * 1e3
    with Broker(shm) as broker, contextlib.ExitStack() as stack:
        _pin(broker.proc.pid, on_broker)
        socket_of = {m: broker.socket_path for m in modes}
        if sched:  # a second broker, its threads SCHED_BATCH (chrt: no privilege needed)
            batch = stack.enter_context(Broker(shm))
            subprocess.run(["chrt", "-a", "-b", "-p", "0", str(batch.proc.pid)], check=True)
            _pin(batch.proc.pid, on_broker)
            socket_of["sched_batch"] = batch.socket_path
        try:
            if hog:  # a CPU-bound process beside the benchmark, for the run's length
                spinner = subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent
                )
            writer, reader = Worker(script), Worker(script)
            workers += [writer, reader]
            # mode -> (writer, reader, copy path): the copy paths share one pair; the
            # trees each have their own pair (the "main" pair imports the other tree)
            pairs: dict[str, tuple[Worker, Worker, str]] = {}
            if before_tree or sched:
                lib = ("--lib", before_tree) if before_tree else ()
                w0, r0 = Worker(script, *lib), Worker(script, *lib)
                workers += [w0, r0]
                pairs = {modes[0]: (w0, r0, "after"), modes[1]: (writer, reader, "after")}
            else:
                pairs = {m: (writer, reader, m) for m in MODES}
            for w, r, _ in pairs.values():
                _pin(w.proc.pid, on_writers)
                _pin(r.proc.pid, on_readers)
            ready: list[Worker] = []
            for m, (w, r, _) in pairs.items():
                for x in (w, r):
                    if x not in ready:
                        ready.append(x)
                        got = x.call(op="setup", socket_path=socket_of[m])
                        res["torch_threads"] = got["torch_threads"]
            echo = os.path.join(broker.dir, "echo.sock")
            writer.call(op="echo_start", path=echo)
            res["rtt"] = reader.call(op="rtt", path=echo, iters=max(200, iters * 4))
            res["load_start"] = os.getloadavg()[0]
            res["samples"] = {}
            for size in sizes:
                for w in workers:
                    w.call(op="make", size=size)
                sm: dict[str, Any] = {}
                warm = 3
                for i in range(warm + iters):
                    order = modes if i % 2 == 0 else modes[::-1]  # interleaved, alternating
                    row: dict[str, Any] = {}
                    for mode in order:
                        # Each process runs its baseline right before its own call, so
                        # both paths' calls find their process equally just woken.
                        w, r, copy = pairs[mode]
                        key = f"x-{size}-{i}-{mode}"
                        row[f"memcpy (writer) {mode}"] = w.call(op="memcpy", size=size)["us"]
                        row[f"put {mode}"] = w.call(op="put", key=key, size=size, copy=copy)
                        row[f"memcpy (reader) {mode}"] = r.call(op="memcpy", size=size)["us"]
                        if gap_s:  # the reader idles, as a vLLM worker between steps
                            time.sleep(gap_s)
                        row[f"get_into {mode}"] = r.call(
                            op="get_into", key=key, size=size, copy=copy
                        )
                        row[f"get {mode}"] = r.call(op="get", key=key, size=size, copy=copy)
                        row[f"clone {mode}"] = r.call(op="clone", size=size)["us"]
                        w.call(op="delete", key=key)
                    for name in ("memcpy (writer)", "memcpy (reader)", "clone"):
                        row[name] = median(row[f"{name} {m}"] for m in modes)
                    if i >= warm:
                        for k, v in row.items():
                            sm.setdefault(k, []).append(v)
                for w in workers:
                    w.call(op="flush")
                res["samples"][str(size)] = sm
            # has(): p50s of back-to-back calls in each path's reader, alternating
            has: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for m in modes:
                w, r, _ = pairs[m]
                w.call(op="make", size=64 * 1024)
                w.call(op="put", key=f"has-{m}", size=64 * 1024, copy=pairs[m][2])
                w.call(op="flush")
            for i in range(6):
                for m in modes if i % 2 == 0 else modes[::-1]:
                    has[m].append(pairs[m][1].call(op="has_p50", key=f"has-{m}", n=400))
            res["has"] = {
                m: {k: median(h[k] for h in has[m]) for k in ("hit", "miss")} for m in modes
            }
            res["load_end"] = os.getloadavg()[0]
        finally:
            for w in workers:
                w.close()
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    return res


def run(
    sizes: list[int], iters: int, busy: bool = False, before_tree: str | None = None,
    sched: bool = False, pin: tuple[str, str, str] | None = None, gap_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    runs = [_one(sizes, iters, False, before_tree, sched, pin, gap_s)]
    if busy:
        runs.append(_one(sizes, iters, True, before_tree, sched, pin, gap_s))
    return {"cpus": os.cpu_count(), "runs": runs, "summary": [summarize(r) for r in runs]}


def _med(samples: list[dict[str, float]], phase: str) -> float:
    return median(s[phase] for s in samples)


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Per size and copy path: the ratios the issue's targets are stated in, from the
    medians of the interleaved calls (and their min over calls)."""
    out: dict[str, Any] = {}
    rtt = r["rtt"]["p50"]
    for size in r["sizes"]:
        sm = r["samples"][str(size)]
        mw, mr = median(sm["memcpy (writer)"]), median(sm["memcpy (reader)"])
        clone = median(sm["clone"])
        per: dict[str, Any] = {"memcpy_writer_us": mw, "memcpy_reader_us": mr, "clone_us": clone}
        for mode in r.get("modes", MODES):
            if f"clone {mode}" in sm:  # this path's own processes' baselines
                mw = median(sm[f"memcpy (writer) {mode}"])
                mr = median(sm[f"memcpy (reader) {mode}"])
                clone = median(sm[f"clone {mode}"])
            put = _med(sm[f"put {mode}"], "total")
            gin = _med(sm[f"get_into {mode}"], "total")
            get = _med(sm[f"get {mode}"], "total")
            per[mode] = {
                "memcpy_writer_us": mw,
                "memcpy_reader_us": mr,
                "clone_us": clone,
                "put_us": put,
                "get_into_us": gin,
                "get_us": get,
                "vs_2_memcpys": (mw + mr) / (put + gin),
                "vs_floor": (put + gin) / (mw + mr + rtt),
                "get_new_vs_clone": clone / get,
                "min_put_us": min(s["total"] for s in sm[f"put {mode}"]),
                "min_get_into_us": min(s["total"] for s in sm[f"get_into {mode}"]),
                "min_get_us": min(s["total"] for s in sm[f"get {mode}"]),
            }
        out[str(size)] = per
    return out


def report(res: dict[str, Any]) -> str:
    parts = []
    for r, summ in zip(res["runs"], res["summary"], strict=True):
        head = (
            f"Across processes ({'busy: a CPU-bound process beside it' if r['busy'] else 'quiet'});"
            f" load (1 min) {r['load_start']:.1f} at start, {r['load_end']:.1f} at end on "
            f"{res['cpus']} CPUs; torch threads {r['torch_threads']}; medians of "
            f"{r['iters']} interleaved calls per path, µs (faults: a count)"
            + (f"; pinned: broker on CPUs {r['pin'][0]}, writers {r['pin'][1]}, readers "
               f"{r['pin'][2]}" if r.get("pin") else "")
            + (f"; the reader asleep {r['gap_ms']:g} ms before each get_into"
               if r.get("gap_ms") else "")
        )  # fmt: skip
        body = []
        for size in r["sizes"]:
            sm = r["samples"][str(size)]
            for op in ("put", "get_into", "get"):
                for mode in r.get("modes", MODES):
                    s = sm[f"{op} {mode}"]
                    body.append(
                        [f"{op} {fmt_size(size)}", mode]
                        + [f"{_med(s, p):.0f}" if p == "faults" else f"{_med(s, p):.1f}"
                           for p in PHASES]
                    )  # fmt: skip
        lines = [head, table(["op", "path", *PHASES], body), ""]
        lines.append(f"raw Unix-socket ping-pong reader -> writer: p50 {r['rtt']['p50']:.1f} µs")
        if "has" in r:
            lines.append(
                "has() p50, µs (400 back-to-back calls, median of 6 alternating rounds): "
                + "; ".join(
                    f"{m}: hit {h['hit']:.1f}, miss {h['miss']:.1f}" for m, h in r["has"].items()
                )
            )
        rows = []
        for size in r["sizes"]:
            per = summ[str(size)]
            for mode in r.get("modes", MODES):
                m = per[mode]
                rows.append([
                    fmt_size(size), mode,
                    f"{m['memcpy_writer_us']:.1f} / {m['memcpy_reader_us']:.1f}",
                    f"{m['put_us']:.1f} ({m['min_put_us']:.1f})",
                    f"{m['get_into_us']:.1f} ({m['min_get_into_us']:.1f})",
                    f"{m['vs_2_memcpys']:.2f}x", f"{m['vs_floor']:.2f}x",
                    f"{m['clone_us']:.1f}", f"{m['get_us']:.1f} ({m['min_get_us']:.1f})",
                    f"{m['get_new_vs_clone']:.2f}x",
                ])  # fmt: skip
        lines.append(
            table(
                [
                    "size", "path", "memcpy w / r", "put (min)", "get_into (min)",
                    "2 memcpys / put+get_into", "put+get_into / floor",
                    "clone()", "get new (min)", "clone / get new",
                ],
                rows,
            )
        )  # fmt: skip
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
