"""End to end with real ``vllm serve`` processes (vLLM on CPU) and a real broker.

All servers of the module start at once, in parallel, and are shared by the
tests; each test uses its own image so the tests do not see each other's entries.
Expect ~2-3 minutes on a 2-core machine, almost all of it server start-up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Unguarded on purpose: CI installs vLLM, so these tests must fail without it, never skip.
import vllm  # noqa: F401

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl
from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config, png_data_url

pytestmark = pytest.mark.vllm

SPEC = TinyQwen2VLSpec()
ENTRY_BYTES = 16 * SPEC.hidden_size * 2  # a 112x112 image: 16 rows of bf16
PUT_LINE = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")


def puts(server: VllmServer) -> dict[str, int]:
    return {h: int(n) for n, h in PUT_LINE.findall(server.log_text())}


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ece2e-", dir="/tmp"))  # short: AF_UNIX path limit
    yield d
    if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
        import shutil

        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
    return str(build_tiny_qwen2vl(root, SPEC))


@pytest.fixture(scope="module")
def broker_socket(workdir: Path) -> Iterator[str]:
    path = str(workdir / "broker.sock")
    log = open(workdir / "broker.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", path]
        + ["--shm-size", "256MiB"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while subprocess.call(
            [sys.executable, "-m", "lmcache_ec_broker.cli", "ping", "--socket", path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ):
            assert proc.poll() is None, (workdir / "broker.log").read_text()
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.2)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def servers(model: str, broker_socket: str, workdir: Path) -> Iterator[dict[str, VllmServer]]:
    cores = os.cpu_count() or 1

    def server(name: str, role: str | None) -> VllmServer:
        cfg = ec_transfer_config(role, broker_socket) if role else None
        # vLLM binds every instance's OpenMP thread to core 0 by default: spread them.
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(len(fleet) % cores)}
        return VllmServer(model, workdir / f"{name}.log", ec_config=cfg, env=env)

    fleet: dict[str, VllmServer] = {}

    for name, role in [
        ("a", "ec_both"),
        ("b", "ec_both"),
        ("plain", None),
        ("producer", "ec_producer"),
        ("consumer", "ec_consumer"),
    ]:
        fleet[name] = server(name, role)
    try:
        for s in fleet.values():
            s.start()
        for s in fleet.values():
            s.wait_ready(timeout=480)
        yield fleet
    finally:
        for s in fleet.values():
            s.terminate()
        for s in fleet.values():
            s.wait_stopped()


def broker_stats(socket_path: str) -> dict:
    with BrokerClient(socket_path) as c:
        stats = c.stats()
    assert stats, "broker did not answer stats"
    return stats


def test_one_instance_reloads_from_broker_after_encoder_cache_reset(servers, broker_socket):
    a = servers["a"]
    image = png_data_url(seed=1)
    before = broker_stats(broker_socket)
    cold = a.chat_token_ids(image)
    stored = puts(a)
    assert list(stored.values()) == [ENTRY_BYTES], a.log_tail()
    after_put = broker_stats(broker_socket)
    assert after_put["entries"] == before["entries"] + 1

    a.reset_encoder_cache()
    warm = a.chat_token_ids(image)
    after_load = broker_stats(broker_socket)
    assert after_load["hits"] == after_put["hits"] + 1, "second request did not load from broker"
    assert puts(a) == stored, "the encoder ran again instead of loading"
    assert warm == cold


def test_two_instances_share_one_broker(servers, broker_socket):
    a, b, plain = servers["a"], servers["b"], servers["plain"]
    image = png_data_url(seed=2)
    stored_before = puts(a)
    tokens_a = a.chat_token_ids(image)
    new = {h: n for h, n in puts(a).items() if h not in stored_before}
    assert list(new.values()) == [ENTRY_BYTES]
    (mm_hash,) = new

    hits = broker_stats(broker_socket)["hits"]
    tokens_b = b.chat_token_ids(image)
    assert broker_stats(broker_socket)["hits"] == hits + 1, "B did not load A's entry"
    assert mm_hash not in puts(b), "B encoded the image itself"
    assert tokens_b == plain.chat_token_ids(image) == tokens_a


def test_disaggregated_producer_and_consumer(servers, broker_socket):
    producer, consumer, plain = servers["producer"], servers["consumer"], servers["plain"]
    image = png_data_url(seed=3)
    producer.chat_token_ids(image, max_tokens=1)  # the encode step
    (mm_hash,) = [h for h in puts(producer)]
    assert puts(producer)[mm_hash] == ENTRY_BYTES

    hits = broker_stats(broker_socket)["hits"]
    tokens = consumer.chat_token_ids(image)
    assert broker_stats(broker_socket)["hits"] == hits + 1, "consumer did not load"
    assert puts(consumer) == {}
    assert tokens == plain.chat_token_ids(image)
