"""Soak / chaos run: client processes hammer one broker while clients and the broker
are killed at random; every byte read back is verified and the broker's books are
checked for leaks.

    python benchmarks/soak.py --duration 120            # prints the figures
    python benchmarks/soak.py --duration 20 --json out.json

Workers are real processes doing random put/get/has/delete on a fixed key space.
A key's dtype, shape and bytes derive from the key alone, so any reader can
verify what any writer stored: a wrong byte is a *corrupt read*. The orchestrator
kills workers with SIGKILL (and starts new ones), kills the broker with SIGKILL or
SIGTERM and restarts it on the same socket, and now and then kills every worker at
once to check that the broker holds nothing for them (reservations, pins, leases)
and that ``free + used + reserved == capacity``. Any violation is a *leak*. The run
stops by itself after ``--duration`` seconds and exits 1 if it found a leak, a
corrupt read or an unexpected error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DTYPES = ["uint8", "float16", "bfloat16", "float32", "int64"]
ITEMSIZE = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int64": 8}
# Refusals a saturated slab legitimately answers: no room, or a client past its share.
_LEGIT_REFUSALS = frozenset({"no_space", "too_many_pins", "too_many_leases", "too_many_reservations"})


def key_spec(key: str) -> tuple[str, list[int], int]:
    """dtype, shape and seed of a key's tensor (4 KiB .. 512 KiB)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)
    nbytes = 4096 * (1 + h % 128)
    dtype = DTYPES[(h >> 8) % len(DTYPES)]
    return dtype, [nbytes // (ITEMSIZE[dtype] * 64), 64], h & 0x7FFFFFFF


# ---------------------------------------------------------------- worker process


def worker(sock: str, seed: int, keyspace: int, report: str) -> None:
    import torch

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.connector.client import BrokerRefused

    cache: dict[str, torch.Tensor] = {}

    def tensor(key: str) -> torch.Tensor:
        t = cache.get(key)
        if t is None:
            dtype, shape, s = key_spec(key)
            n = shape[0] * shape[1] * ITEMSIZE[dtype]
            g = torch.Generator().manual_seed(s)
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            t = cache[key] = raw.view(getattr(torch, dtype)).reshape(shape)
        return t

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return (
            got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        )

    logging.getLogger("lmcache_ec_broker").setLevel(logging.ERROR)  # outages are expected here
    rng = random.Random(seed)
    c = BrokerClient(sock, timeout_s=2.0, connect_timeout_s=1.0, max_backoff_s=0.2)
    n = dict(ops=0, puts=0, hits=0, misses=0, has=0, deletes=0, bytes_verified=0, corrupt=0)
    n.update(refused=0, errors=0, max_call_ms=0)
    problems: list[str] = []
    last_report = 0.0
    while True:
        key = f"soak-{rng.randrange(keyspace)}"
        op = rng.random()
        t0 = time.monotonic()
        try:
            if op < 0.35:
                n["puts"] += c.put(key, tensor(key))
            elif op < 0.75:
                keys = [key] if op < 0.65 else [f"soak-{rng.randrange(keyspace)}" for _ in range(3)]
                for k, got in zip(keys, c.get_many(keys), strict=True):
                    if got is None:
                        n["misses"] += 1
                    elif same(got, tensor(k)):
                        n["hits"] += 1
                        n["bytes_verified"] += got.numel() * got.element_size()
                    else:
                        n["corrupt"] += 1
                        problems.append(f"corrupt read of {k}")
            elif op < 0.95:
                c.has([key, f"soak-{rng.randrange(keyspace)}"], lease_ms=rng.choice([0, 0, 500]))
                n["has"] += 1
            else:
                n["deletes"] += c.delete(key)
        except BrokerRefused as exc:
            # no_space under pressure is legitimate, and so is a client past its fair
            # share (per-process/uid limits; docs/reliability.md); others are counted
            n["refused"] += 1
            if exc.code not in _LEGIT_REFUSALS:
                n["errors"] += 1
                problems.append(f"refused: {exc}")
        except Exception as exc:  # the client must never raise on an outage
            n["errors"] += 1
            problems.append(f"{type(exc).__name__}: {exc}")
        n["max_call_ms"] = max(n["max_call_ms"], int((time.monotonic() - t0) * 1000))
        n["ops"] += 1
        now = time.monotonic()
        if now - last_report > 0.2:
            last_report = now
            with open(report + ".tmp", "w") as f:
                f.write(json.dumps({**n, "problems": problems[-5:]}))
            os.replace(report + ".tmp", report)  # the orchestrator never sees half a report


def zygote() -> None:
    """Import torch once, then fork a worker per request: under load a fresh
    interpreter takes seconds to import torch, a fork a few milliseconds.

    stdin: ``SOCKET SEED KEYSPACE REPORT`` per line; stdout: the worker's pid.
    """
    import torch

    import lmcache_ec_broker.connector.client  # noqa: F401
    import lmcache_ec_broker.connector.client.copy  # noqa: F401

    torch.set_num_threads(1)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed workers
    print("ready", flush=True)
    for line in sys.stdin:
        sock, seed, keyspace, report = line.split()
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                worker(sock, int(seed), int(keyspace), report)
            finally:
                os._exit(1)
        print(pid, flush=True)


# ---------------------------------------------------------------- orchestrator


@dataclass
class Worker:
    pid: int
    report: str

    def last(self) -> dict:
        try:
            return json.loads(Path(self.report).read_text())
        except (OSError, ValueError):
            return {}  # killed before its first report


@dataclass
class Figures:
    duration_s: float = 0.0
    operations: int = 0
    puts_stored: int = 0
    get_hits: int = 0
    get_misses: int = 0
    clients_killed: int = 0
    broker_restarts: int = 0
    bytes_verified: int = 0
    leak_checks: int = 0
    leaks_found: int = 0
    corrupt_reads: int = 0
    errors: int = 0
    refused: int = 0
    slowest_call_ms: int = 0
    problems: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.dir = tempfile.mkdtemp(prefix="ecsoak-", dir="/tmp")
        self.sock = os.path.join(self.dir, "b.sock")
        self.broker: subprocess.Popen | None = None
        self.workers: list[Worker] = []
        self.done: list[dict] = []  # last reports of killed workers
        self.fig = Figures()
        self.seeds = iter(range(args.seed * 1000, args.seed * 1000 + 1_000_000))

    # ------------------------------------------------------------ processes

    def start_broker(self) -> None:
        from lmcache_ec_broker.testing.broker_process import BrokerProcess

        args = ["--shm-size", self.args.shm_size, "--log-level", "WARNING"]
        log = os.path.join(self.dir, "broker.log")
        process = BrokerProcess(self.sock, args, log_path=log, cwd=REPO)
        try:
            process.start(timeout=30)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"the broker did not start:\n{self.broker_log()}") from exc
        finally:
            self.broker = process.proc

    def broker_log(self) -> str:
        return Path(self.dir, "broker.log").read_text(errors="replace")[-4000:]

    def start_zygote(self) -> None:
        self.zygote = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self.zygote.stdout is not None
        if self.zygote.stdout.readline().strip() != "ready":
            raise RuntimeError("the worker zygote did not start")

    def spawn_worker(self) -> None:
        seed = next(self.seeds)
        report = os.path.join(self.dir, f"w{seed}.json")
        assert self.zygote.stdin is not None and self.zygote.stdout is not None
        self.zygote.stdin.write(f"{self.sock} {seed} {self.args.keyspace} {report}\n")
        self.zygote.stdin.flush()
        line = self.zygote.stdout.readline()
        if not line:
            raise RuntimeError("the worker zygote died")
        self.workers.append(Worker(int(line), report))

    def kill_worker(self, w: Worker) -> None:
        os.kill(w.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(w.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.005)
        self.workers.remove(w)
        self.done.append(w.last())
        self.fig.clients_killed += 1

    # ------------------------------------------------------------ checks

    def problem(self, text: str) -> None:
        self.fig.problems.append(text)
        print(f"  ! {text}", flush=True)

    def segments(self) -> list[str]:
        from lmcache_ec_broker.broker.server import segment_prefix

        prefix = segment_prefix(self.sock)
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]

    def check_books(self, expect_idle: bool) -> None:
        """The broker balances its books; if idle, it holds nothing for dead clients."""
        from lmcache_ec_broker import BrokerClient

        self.fig.leak_checks += 1
        with BrokerClient(self.sock, timeout_s=5) as c:
            deadline = time.monotonic() + 5
            while True:
                st = c.stats()
                if not st:
                    self.fig.leaks_found += 1
                    self.problem("the broker did not answer a leak check")
                    return
                if (
                    st["free_bytes"] + st["used_bytes"] + st["reserved_bytes"] + st["arena_bytes"]
                    != st["capacity_bytes"]
                ):
                    self.fig.leaks_found += 1
                    self.problem(f"free + used + reserved + arena != capacity: {st}")
                    return
                held = (
                    st["reserved_bytes"],
                    st["reserved_entries"],
                    st["pins"],
                    st["pinned_entries"],
                )
                if not expect_idle or (held == (0, 0, 0, 0) and st["clients"] == 1):
                    return
                if time.monotonic() > deadline:
                    self.fig.leaks_found += 1
                    self.problem(
                        f"held after every client died: reserved={held[0]} B in {held[1]} "
                        f"entries, {held[2]} pins on {held[3]} entries, clients={st['clients']}"
                    )
                    return
                time.sleep(0.05)

    def restart_broker(self) -> None:
        assert self.broker is not None
        graceful = self.rng.random() < 0.3
        if graceful:
            self.broker.send_signal(signal.SIGTERM)
            rc = self.broker.wait(30)
            if rc != 0:
                self.fig.leaks_found += 1
                self.problem(f"SIGTERM: the broker exited with {rc}")
            if os.path.exists(self.sock) or self.segments():
                self.fig.leaks_found += 1
                self.problem("SIGTERM left the socket or a segment behind")
        else:
            self.broker.kill()
            self.broker.wait()
        old = set(self.segments())
        self.start_broker()
        self.fig.broker_restarts += 1
        stale = old & set(self.segments())
        if stale:
            self.fig.leaks_found += 1
            self.problem(f"the restart left stale segments: {sorted(stale)}")
        print(
            f"  broker restarted ({'SIGTERM' if graceful else 'SIGKILL'}) "
            f"t={time.monotonic() - self.t0:.1f}s",
            flush=True,
        )

    # ------------------------------------------------------------ run

    def run(self) -> Figures:
        a = self.args
        self.start_zygote()  # not timed: importing torch can take seconds on a busy host
        self.t0 = time.monotonic()
        try:
            self.start_broker()
            for _ in range(a.clients):
                self.spawn_worker()
            end = self.t0 + a.duration
            next_kill = self.t0 + self.rng.expovariate(1 / a.kill_every)
            next_restart = self.t0 + self.rng.uniform(0.5, 1.5) * a.restart_every
            next_quiesce = self.t0 + a.check_every
            while (now := time.monotonic()) < end:
                if now >= next_quiesce:
                    for w in list(self.workers):  # kill every client at once ...
                        self.kill_worker(w)
                    self.check_books(expect_idle=True)  # ... nothing may stay held
                    for _ in range(a.clients):
                        self.spawn_worker()
                    next_quiesce = now + a.check_every
                elif now >= next_restart:
                    self.restart_broker()
                    next_restart = now + self.rng.uniform(0.5, 1.5) * a.restart_every
                elif now >= next_kill and self.workers:
                    self.kill_worker(self.rng.choice(self.workers))
                    self.spawn_worker()
                    self.check_books(expect_idle=False)
                    next_kill = now + self.rng.expovariate(1 / a.kill_every)
                time.sleep(0.02)
            for w in list(self.workers):
                self.kill_worker(w)
            self.check_books(expect_idle=True)
            assert self.broker is not None
            self.broker.send_signal(signal.SIGTERM)
            if self.broker.wait(30) != 0 or os.path.exists(self.sock) or self.segments():
                self.fig.leaks_found += 1
                self.problem("the final SIGTERM did not exit 0 and clean up:\n" + self.broker_log())
        finally:
            for w in list(self.workers):
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.zygote.stdin is not None:
                self.zygote.stdin.close()
            self.zygote.wait(10)
            if self.broker is not None and self.broker.poll() is None:
                self.broker.kill()
                self.broker.wait()
            shutil.rmtree(self.dir, ignore_errors=True)
        self.fig.duration_s = round(time.monotonic() - self.t0, 1)
        for rep in self.done:
            self.fig.operations += rep.get("ops", 0)
            self.fig.puts_stored += rep.get("puts", 0)
            self.fig.get_hits += rep.get("hits", 0)
            self.fig.get_misses += rep.get("misses", 0)
            self.fig.bytes_verified += rep.get("bytes_verified", 0)
            self.fig.corrupt_reads += rep.get("corrupt", 0)
            self.fig.errors += rep.get("errors", 0)
            self.fig.refused += rep.get("refused", 0)
            self.fig.slowest_call_ms = max(self.fig.slowest_call_ms, rep.get("max_call_ms", 0))
            self.fig.problems += rep.get("problems", [])
        return self.fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds to run (default 60)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client processes")
    p.add_argument("--keyspace", type=int, default=64, help="distinct keys")
    p.add_argument("--shm-size", default="16MiB", help="slab size (small: forces eviction)")
    p.add_argument(
        "--kill-every", type=float, default=1.5, help="mean seconds between client kills"
    )
    p.add_argument(
        "--restart-every", type=float, default=10.0, help="mean seconds between broker restarts"
    )
    p.add_argument(
        "--check-every", type=float, default=8.0, help="seconds between kill-all leak checks"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zygote:
        zygote()
        return 0
    print(
        f"soak: {args.duration:.0f}s, {args.clients} clients, slab {args.shm_size}, "
        f"client kill every ~{args.kill_every}s, broker restart every ~{args.restart_every}s",
        flush=True,
    )
    fig = Soak(args).run()
    rows = [
        ("duration", f"{fig.duration_s} s"),
        ("operations done", fig.operations),
        (
            "  puts stored / get hits / get misses",
            f"{fig.puts_stored} / {fig.get_hits} / {fig.get_misses}",
        ),
        ("clients killed (SIGKILL)", fig.clients_killed),
        ("broker restarts", fig.broker_restarts),
        ("bytes verified", f"{fig.bytes_verified} ({fig.bytes_verified / (1 << 30):.2f} GiB)"),
        ("leak checks", fig.leak_checks),
        ("leaks found", fig.leaks_found),
        ("corrupt reads", fig.corrupt_reads),
        ("unexpected errors", fig.errors),
        ("refused (no_space, limits)", fig.refused),
        ("slowest client call", f"{fig.slowest_call_ms} ms"),
    ]
    for name, value in rows:
        print(f"{name:40} {value}")
    for text in fig.problems[:20]:
        print(f"problem: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig.__dict__, indent=2))
    return 0 if fig.leaks_found == fig.corrupt_reads == fig.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
