"""Issue 32, deliverable 1 with a real ``vllm serve --mm-encoder-only`` (ec_producer)
on CPU and a real broker: a repeat of an image after the encoder instance's own
vLLM encoder cache dropped it is not encoded again (before: ``put_present`` +1 on the
broker, the symptom the issue reports), the request still answers, and nothing is
loaded into the encoder instance. The two-node EPD tests (E, PD, proxy, Redis) are
tests/e2e/test_vllm_epd.py."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
from conftest import PATIENT

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl
from lmcache_ec_broker.testing.vllm_server import (
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    png_data_url,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
PUT_COUNTERS = ("puts", "put_present", "put_in_progress")


def encode_on(server: VllmServer, image_url: str) -> int:
    """What the EPD proxy sends an encoder instance for one item: the item alone,
    ``max_tokens`` 1. The HTTP status."""
    body = {
        "model": server.model,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}}]}
        ],
        "max_tokens": 1,
        "stream": False,
    }
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
        return r.status


def test_encoder_instance_does_not_encode_an_item_its_broker_holds(make_broker, tmp_path) -> None:
    broker = make_broker("--shm-size", "256MiB")
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path / "models"
    model = build_tiny_qwen2vl(root)
    e = VllmServer(
        model,
        Path(tmp_path) / "encoder.log",
        ec_transfer_config("ec_producer", broker.socket_path, **SLOW_HOST_BUDGETS),
        extra_args=["--mm-encoder-only"],
    )
    image = png_data_url(32)
    with e, BrokerClient(broker.socket_path, **PATIENT) as c:
        assert encode_on(e, image) == 200
        assert len(e.ec_put_hashes()) == 1, e.log_tail()
        first = c.stats()
        assert first["entries"] == 1
        # vLLM's own encoder cache forgets the item: the next request reaches the
        # connector's has_cache_item, which finds it in the broker
        e.reset_encoder_cache()
        assert encode_on(e, image) == 200
        again = c.stats()
        for name in PUT_COUNTERS:
            assert again[name] == first[name], f"the item was encoded and put again ({name})"
        assert len(e.ec_put_hashes()) == 1
        assert e.ec_loads() == [], "an encoder instance loaded an item"
        # both steps published (the first its put, the second the skipped item)
        assert first["publish_waits"] >= 1 and again["publish_waits"] > first["publish_waits"]
        assert again["publish_failures"] == 0
        assert "Traceback" not in e.log_text()
        # vLLM's IPC sockets are in the server's own directory, not loose in /tmp
        rpc_dir = e.rpc_dir
        assert rpc_dir is not None and os.listdir(rpc_dir), "vLLM made no IPC socket there"
    assert not os.path.exists(rpc_dir), "the server's IPC sockets outlived it"
