"""Shared fixtures: real broker processes started through the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from lmcache_ec_broker.broker.server import segment_prefix
from lmcache_ec_broker.testing.broker_process import BrokerProcess

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``lmcache-ec-broker ARGS`` in a real process; output captured as text. The
    commands that talk to a broker wait up to 30 s for its answers (``--reply-timeout``,
    unless the test passes its own): a live broker on a loaded host can take longer than
    the CLI's default 2 s."""
    if args and args[0] in ("ping", "stats", "stop", "clear") and "--reply-timeout" not in args:
        args = (*args, "--reply-timeout", "30")
    return subprocess.run(
        [sys.executable, "-m", "lmcache_ec_broker.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(pred: Callable[[], T], what: str, timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


# A test's own look at a broker (stats, a probe put/get) waits as long as a starved
# host may need: CI runs the vllm tests niced beside the rest of the suite, and
# another job may run beside that, so a live broker can take seconds to answer. The
# client's default 5 s would read such a pause as an outage (an empty ``stats``).
# Tests of the outage handling itself pass their own, short, deadlines.
PATIENT = {"timeout_s": 60.0, "connect_timeout_s": 60.0}


def broker_stats(socket_path: str) -> dict:
    """One ``stats`` call through a fresh client ({} while no broker answers)."""
    from lmcache_ec_broker import BrokerClient

    with BrokerClient(socket_path, **PATIENT) as c:
        return c.stats()


def shm_segments(socket_path: str, include_filter: bool = False) -> list[str]:
    """Named /dev/shm segments of the broker on ``socket_path``: none since every
    segment is a memfd (a leak check that must stay empty); brokers before that named
    the slab, and before the sealed memfds its -f, -j and -r too (include_filter), so a
    test of stale cleanup may meet them."""
    prefix = segment_prefix(socket_path)
    return [
        n
        for n in os.listdir("/dev/shm")
        if n.startswith(prefix) and (include_filter or not n.endswith(("-f", "-j", "-r")))
    ]


def memfd_segments(pid: int) -> dict[str, str]:
    """A live broker's segments, all memfds: label (``lmcache-ec-...``, ``-f``, ``-r``,
    ``-j``, ``-js`` for the slab's companions) -> a /proc path that reaches the file
    (stat it, open it as the broker's uid could)."""
    out: dict[str, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:lmcache-ec-"):
            out.setdefault(target.removeprefix("/memfd:").removesuffix(" (deleted)"),
                           f"/proc/{pid}/fd/{fd}")  # fmt: skip
    return out


def slab_of(pid: int, socket_path: str) -> str | None:
    """The label of the slab memfd the broker ``pid`` on ``socket_path`` holds, or None
    (not created yet, or the process is gone)."""
    prefix = segment_prefix(socket_path)
    try:
        segs = memfd_segments(pid)
    except OSError:
        return None
    for label in segs:
        if label.startswith(prefix) and not label.endswith(("-f", "-r", "-j", "-js")):
            return label
    return None


@pytest.fixture(scope="session", autouse=True)
def _remove_shm_left_by_vllm() -> Iterator[None]:
    # VllmServer.stop() removes what its own servers left (150-250 MiB each); this
    # catches the rest without touching segments other live processes still use.
    from lmcache_ec_broker.testing.shm_cleanup import removing_new_vllm_shm

    with removing_new_vllm_shm():
        yield


@pytest.fixture(scope="session")
def plain_qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The reference ``vllm serve`` of the default tiny Qwen2-VL without a connector,
    shared by every module that compares answers with one (e2e, remote, Mooncake):
    each used to start its own, one engine start each (20-30 s on the 2-core host).
    Started, not yet ready: a module calls ``wait_ready`` after starting its own
    servers, so the start-ups overlap. Its users send it requests only (no cache
    resets, no faults), so no test sees another's state through it."""
    from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl
    from lmcache_ec_broker.testing.vllm_server import VllmServer

    work = tmp_path_factory.mktemp("plain")
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or work / "models"
    server = VllmServer(
        build_tiny_qwen2vl(root, TinyQwen2VLSpec()),
        work / "plain.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": str(1 % (os.cpu_count() or 1))},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # AF_UNIX paths are limited to ~107 bytes: keep them short.
    d = tempfile.mkdtemp(prefix="ecb-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_broker(sock_dir: str) -> Iterator:
    """Factory: make_broker("--shm-size", "64MiB", ...) -> started BrokerProcess.

    Every broker is stopped at teardown and the test fails if it left its socket
    or a shared-memory segment behind.
    """
    started: list[BrokerProcess] = []

    def factory(*args: str, socket_path: str | None = None, wait: bool = True, env=None):
        path = socket_path or os.path.join(sock_dir, f"b-{uuid.uuid4().hex[:8]}.sock")
        args_list = list(args) or ["--shm-size", "64MiB"]
        b = BrokerProcess(path, args_list, env=env).start(wait=wait)
        started.append(b)
        return b

    yield factory
    for b in started:
        b.stop()
    leaks = []
    for b in started:
        if os.path.exists(b.socket_path):
            leaks.append(b.socket_path)
        leaks += shm_segments(b.socket_path, include_filter=True)
    assert not leaks, f"brokers left behind: {leaks}"


@pytest.fixture
def remote_node(make_broker, tmp_path) -> Iterator:
    """Factory: remote_node(url, shm="64MiB", **config) -> a client of a new broker whose
    remote tier is the store at ``url`` (remote_timeout_s 1.0 unless given; other
    settings as YAML)."""
    from lmcache_ec_broker import BrokerClient

    clients: list[BrokerClient] = []

    def make(url: str, shm: str = "64MiB", **extra: object) -> BrokerClient:
        cfg = tmp_path / f"node{len(clients) + 1}.yaml"
        extra = {"remote_timeout_s": 1.0, **extra}
        lines = [f"remote_url: '{url}'"]
        lines += [f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}" for k, v in extra.items()]
        cfg.write_text("\n".join(lines) + "\n")
        b = make_broker("--shm-size", shm, "--config", str(cfg))
        c = BrokerClient(b.socket_path, timeout_s=30.0)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def broker(make_broker) -> BrokerProcess:
    return make_broker("--shm-size", "64MiB")


# A failing test that started `vllm serve` processes shows what their connectors said
# (the logs live in the test's tmp_path and are gone with the CI machine): the lines
# that explain a load that did not happen (timeouts, stage bounds, field changes).
_EC_LOG_MARKERS = ("EC ", "lmcache-ec-broker", "Traceback", "Error")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or item.get_closest_marker("vllm") is None:
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp, Path):
        return
    for log in sorted(tmp.rglob("*.log"))[:8]:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        ec = [line for line in lines if any(m in line for m in _EC_LOG_MARKERS)]
        if ec:
            report.sections.append((f"connector lines of {log.name}", "\n".join(ec[-60:])))
