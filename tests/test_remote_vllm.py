"""Real vLLM across two "nodes": two ``vllm serve`` instances, each with its own broker
(own socket, slab), the brokers sharing one redis-server. The image goes to A, then to
B: B's broker reports a remote hit, B loads instead of encoding, and B's output tokens
equal those of an instance without any connector."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import broker_stats, wait_until
from redis_servers import REDIS_SERVER, RedisServer

pytest.importorskip("vllm")

from lmcache_ec_broker.testing.broker_process import BrokerProcess  # noqa: E402
from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl  # noqa: E402
from lmcache_ec_broker.testing.vllm_server import (  # noqa: E402
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    png_data_url,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed"),
]



class NodeBroker:
    def __init__(self, workdir: Path, name: str, url: str) -> None:
        self.socket_path = str(workdir / f"{name}.sock")
        cfg = workdir / f"{name}.yaml"
        cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 5.0\n")
        args = ["--shm-size", "256MiB", "--config", str(cfg)]
        log = workdir / f"broker-{name}.log"
        self.process = BrokerProcess(self.socket_path, args, log_path=log).start(timeout=60)
        wait_until(lambda: bool(broker_stats(self.socket_path)), name, timeout=60)

    def stop(self) -> None:
        self.process.stop(60)


@pytest.fixture(scope="module")
def fleet(plain_qwen2vl: VllmServer) -> Iterator[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="ecrv-", dir="/tmp"))
    srv = RedisServer()
    brokers: dict[str, NodeBroker] = {}
    servers: dict[str, VllmServer] = {}
    try:
        root = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
        model = str(build_tiny_qwen2vl(root, TinyQwen2VLSpec()))
        for name in ("a", "b"):
            brokers[name] = NodeBroker(workdir, name, srv.url("unix"))
        cores = os.cpu_count() or 1
        for i, name in enumerate(("a", "b")):  # "plain": the session's (conftest.py)
            cfg = (
                ec_transfer_config("ec_both", brokers[name].socket_path, **SLOW_HOST_BUDGETS)
                if name in brokers
                else None
            )
            servers[name] = VllmServer(
                model,
                workdir / f"vllm-{name}.log",
                ec_config=cfg,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
            )
        # All at once: a start is mostly single-threaded imports, so starts overlap on the
        # cores (each server runs its worker inside its EngineCore: two processes each).
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(timeout=900)
        plain_qwen2vl.wait_ready(timeout=900)
        yield {"redis": srv, "brokers": brokers, "servers": {**servers, "plain": plain_qwen2vl}}
    finally:
        for s in servers.values():
            s.terminate()
        for s in servers.values():
            s.wait_stopped()
        for b in brokers.values():
            b.stop()
        srv.stop()
        if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


def test_node_b_hits_what_node_a_encoded(fleet) -> None:
    a, b, plain = (fleet["servers"][n] for n in ("a", "b", "plain"))
    ba, bb = fleet["brokers"]["a"], fleet["brokers"]["b"]
    image = png_data_url(seed=21)
    tokens_a = a.chat_token_ids(image)
    stored = a.ec_puts()
    assert len(stored) == 1, a.log_tail()
    (mm_hash,) = stored
    wait_until(lambda: broker_stats(ba.socket_path)["remote_writes"] >= 1, "A's write-behind", timeout=60)
    wait_until(lambda: broker_stats(bb.socket_path)["remote_known_keys"] >= 1, "B learns the key", timeout=60)
    before = broker_stats(bb.socket_path)
    tokens_b = b.chat_token_ids(image)
    after = broker_stats(bb.socket_path)
    assert after["remote_hits"] > before["remote_hits"], "B's broker did not hit the store"
    assert after["remote_bytes_read"] >= stored[mm_hash]
    assert mm_hash not in b.ec_puts(), "B encoded it itself"
    assert b.ec_loads() == [mm_hash]
    assert tokens_b == plain.chat_token_ids(image) == tokens_a
