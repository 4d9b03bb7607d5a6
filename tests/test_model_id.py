"""The model field of the keys agrees whatever the state of the download (issue 17).

vLLM builds a worker's connector before ``load_model`` downloads the weights and
the scheduler's after. These tests reproduce that order with real vLLM config
objects, a real broker and a real Hugging Face cache layout (``HF_HUB_CACHE`` in a
child process, offline): weights absent when the worker is built, present when
the scheduler is.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.vllm import ECBrokerConnector
from lmcache_ec_broker.connector.vllm.model_id import fingerprint
from lmcache_ec_broker.testing import hf_cache
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

REPO_ID = "local-org/tiny-qwen2vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT2 = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    return build_tiny_qwen2vl(root)


def model_ids(cache: Path, queries: list[tuple[str, str | None]]) -> tuple[list[str], str]:
    """``model_id(model, revision)`` for each query, computed in a fresh process that
    reads the HF cache at ``cache`` (as vLLM's processes do); also its stderr."""
    code = (
        "import json, sys\n"
        "from lmcache_ec_broker.connector.vllm.model_id import model_id\n"
        "print(json.dumps([model_id(m, r) for m, r in json.loads(sys.argv[1])]))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(queries)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout), out.stderr


def test_hub_model_is_keyed_by_its_commit_not_by_the_files_downloaded(model_dir, tmp_path):
    cache = tmp_path / "hub"
    snap = hf_cache.snapshot(model_dir, cache, REPO_ID, COMMIT, weights=False)
    assert not list(snap.glob("*.safetensors"))
    expected = f"{REPO_ID}#{COMMIT[:16]}"

    # Before the worker's load_model: configs only. Then the weights arrive.
    # The snapshot's path is what vLLM serves the hub id from under HF_HUB_OFFLINE.
    (before, _) = model_ids(cache, [(REPO_ID, None), (str(snap), None)])
    assert hf_cache.add_weights(model_dir, snap) == ["model.safetensors"]
    queries = [(REPO_ID, None), (str(snap), None), (REPO_ID, "main"), (REPO_ID, COMMIT)]
    (after, _) = model_ids(cache, queries)
    assert after[:2] == before, "the key moved when the weights arrived"
    assert after == [expected] * 4, "the key is not the commit, whatever the revision's spelling"

    # A new commit (refs/main moved to another snapshot) is another model; the old
    # commit, asked for by hash, keeps its key. A model not in the cache: plain id
    # and a warning.
    hf_cache.snapshot(model_dir, cache, REPO_ID, COMMIT2)
    (moved, err) = model_ids(
        cache, [(REPO_ID, None), (REPO_ID, COMMIT), ("local-org/absent", None)]
    )
    assert moved == [f"{REPO_ID}#{COMMIT2[:16]}", expected, "local-org/absent"]
    assert "cannot find the files of model 'local-org/absent' locally" in err


def make_config(model: str, socket_path: str) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=512),
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config={"socket_path": socket_path},
        ),
    )


def test_worker_built_before_the_weights_keys_with_the_schedulers_field(
    model_dir, tmp_path, broker
):
    """vLLM's order on a first start: worker connector, load_model (the weights
    arrive), scheduler connector, then steps whose metadata the worker is bound to."""
    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    weights = local / "model.safetensors"
    staged = weights.rename(tmp_path / "model.safetensors")
    config = make_config(str(local), broker.socket_path)
    worker = ECBrokerConnector(config, ECConnectorRole.WORKER)
    late_worker = ECBrokerConnector(config, ECConnectorRole.WORKER)  # never bound
    shutil.copyfile(staged, weights)  # load_model downloads the weights
    fingerprint.cache_clear()  # the scheduler runs in another process (vLLM's mp executor)
    sched = ECBrokerConnector(config, ECConnectorRole.SCHEDULER)
    try:
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output=None)))

        # The worker stores under the scheduler's key inside a step; the scheduler hits.
        h = "ab" * 32
        tensor = torch.randn(16, 128).to(torch.bfloat16)
        worker.bind_connector_metadata(meta)
        worker.save_caches({h: tensor}, h)
        worker.clear_connector_metadata()
        assert worker.puts_stored == 1
        with BrokerClient(broker.socket_path) as c:  # a hit, once staged (issue 41)
            assert c.has([sched.key(h)]) == [True], "stored under a key the scheduler never asks"
        assert worker.key(h) == sched.key(h)  # kept after the step
        assert meta.model == sched.model_id and sched.model_id.startswith(f"{local}#")

        # A worker that was never told computes it on first use, after load_model.
        assert late_worker.key(h) == sched.key(h)
    finally:
        for c in (worker, late_worker, sched):
            c.shutdown()
