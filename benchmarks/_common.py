"""Shared helpers for the benchmark scripts: a private broker, sizes, tables, a JSON-lines
worker protocol between the orchestrating process and its worker processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lmcache_ec_broker.testing.broker_process import CLI, BrokerProcess, die_with_parent

REPO = Path(__file__).resolve().parent.parent
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def exit_on_sigterm() -> None:
    """A SIGTERM ends the benchmark through its ``finally`` blocks (SystemExit), which stop
    what it started: ``vllm serve`` runs in a session of its own, outside the reach of
    ``die_with_parent``, and the default SIGTERM action would leave it running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def parse_sizes(text: str) -> list[int]:
    from lmcache_ec_broker.sizes import parse_size

    return [parse_size(s.strip(), plain_unit=1) for s in text.split(",") if s.strip()]


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(q * len(s)))]


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


class Broker:
    """A real broker process (the CLI) on a private socket; stopped on exit."""

    def __init__(
        self,
        shm_size: int,
        extra: Sequence[str] = (),
        launcher: Sequence[str] = CLI,
    ) -> None:
        """``launcher``: what runs the CLI after the interpreter (a wrapper script that
        calls ``cli.main`` may stand in for ``-m lmcache_ec_broker.cli``)."""
        self.dir = tempfile.mkdtemp(prefix="ecb-bench-", dir="/tmp")
        self.socket_path = os.path.join(self.dir, "b.sock")
        self.process = BrokerProcess(
            self.socket_path, ["--shm-size", f"{-(-shm_size // MiB)}MiB", *extra],
            log_path=os.path.join(self.dir, "broker.log"), die_with_parent=True,
            launcher=launcher,
        )  # fmt: skip
        try:
            self.process.start(timeout=60)
        except BaseException:
            self.stop()
            raise

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.process.proc is not None
        return self.process.proc

    def read_log(self) -> str:
        return self.process.read_log()

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Worker:
    """A worker process speaking JSON lines: one request line in, one reply line out."""

    def __init__(self, script: str, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, script, "--worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )

    def call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait()}) during {req.get('op')}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker failed {req.get('op')}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def serve_worker(handlers: dict[str, Any]) -> None:
    """Worker main loop: dispatch each JSON line to handlers[op](**args)."""
    import traceback

    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            reply = handlers[op](**req)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
