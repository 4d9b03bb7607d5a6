"""Real vLLM across two "nodes" with Mooncake Store as the remote tier.

Two ``vllm serve`` instances, each with its own broker; the brokers share one real
``mooncake_master`` and run, with it, inside a private network namespace (only ``lo``).
vLLM stays in the host namespace and reaches its broker over the broker's Unix socket.
The image goes to A, then to B: B's broker reports a remote hit, B loads instead of
encoding, and B's output tokens equal those of an instance without any connector."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import broker_stats, wait_until
from mooncake_env import MooncakeMaster, MooncakeNetns, unavailable_reason

pytest.importorskip("vllm")

from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl  # noqa: E402
from lmcache_ec_broker.testing.vllm_server import (  # noqa: E402
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    png_data_url,
)

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]



def _start_broker(ns: MooncakeNetns, workdir: Path, name: str, master: MooncakeMaster):
    sock = str(workdir / f"{name}.sock")
    env = dict(
        os.environ,
        LMCACHE_EC_MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
        LMCACHE_EC_MOONCAKE_GLOBAL_SEGMENT_SIZE="256MiB",
        LMCACHE_EC_MOONCAKE_KEY_POLL_S="0.5",
        LMCACHE_EC_REMOTE_TIMEOUT_S="5",
    )
    argv = [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", sock]
    argv += ["--shm-size", "256MiB", "--remote-url", master.url]
    proc = ns.popen(argv, log_path=str(workdir / f"broker-{name}.log"), env=env)

    def ready() -> bool:
        assert proc.poll() is None, (workdir / f"broker-{name}.log").read_text()
        try:
            return bool(broker_stats(sock))
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    wait_until(ready, f"broker {name}", timeout=60)
    return sock, proc


@pytest.fixture(scope="module")
def fleet(plain_qwen2vl: VllmServer) -> Iterator[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="ecmv-", dir="/tmp"))
    ns = MooncakeNetns()
    brokers: dict[str, str] = {}
    procs = []
    servers: dict[str, VllmServer] = {}
    try:
        master = MooncakeMaster(ns, str(workdir))
        root = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
        model = str(build_tiny_qwen2vl(root, TinyQwen2VLSpec()))
        for name in ("a", "b"):
            brokers[name], proc = _start_broker(ns, workdir, name, master)
            procs.append(proc)
        cores = os.cpu_count() or 1
        for i, name in enumerate(("a", "b")):  # "plain": the session's (conftest.py)
            cfg = (
                ec_transfer_config("ec_both", brokers[name], **SLOW_HOST_BUDGETS)
                if name in brokers
                else None
            )
            servers[name] = VllmServer(
                model,
                workdir / f"vllm-{name}.log",
                ec_config=cfg,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
            )
        for s in servers.values():
            s.start()
        for s in [*servers.values(), plain_qwen2vl]:
            s.wait_ready(timeout=1200)
        yield {"brokers": brokers, "servers": {**servers, "plain": plain_qwen2vl}}
    finally:
        for s in servers.values():
            s.terminate()
        for s in servers.values():
            s.wait_stopped()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        ns.close()
        if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


def test_node_b_hits_what_node_a_encoded_through_mooncake(fleet) -> None:
    a, b, plain = (fleet["servers"][n] for n in ("a", "b", "plain"))
    sock_a, sock_b = fleet["brokers"]["a"], fleet["brokers"]["b"]
    image = png_data_url(seed=23)
    tokens_a = a.chat_token_ids(image)
    stored = a.ec_puts()
    assert len(stored) == 1, a.log_tail()
    (mm_hash,) = stored
    wait_until(lambda: broker_stats(sock_a)["remote_writes"] >= 1, "A's write-behind", timeout=60)
    wait_until(lambda: broker_stats(sock_b)["remote_known_keys"] >= 1, "B learns the key", timeout=60)
    before = broker_stats(sock_b)
    tokens_b = b.chat_token_ids(image)
    after = broker_stats(sock_b)
    assert after["remote_hits"] > before["remote_hits"], "B's broker did not hit the store"
    assert after["remote_bytes_read"] >= stored[mm_hash]
    assert mm_hash not in b.ec_puts(), "B encoded it itself"
    assert b.ec_loads() == [mm_hash]
    assert tokens_b == plain.chat_token_ids(image) == tokens_a
