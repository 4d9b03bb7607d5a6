"""A first start on a cold Hugging Face cache, for test_vllm_first_start.py: loaded by
a real vLLM through ``ec_connector_module_path`` (PYTHONPATH points here).

vLLM imports the connector's module in a worker while it builds the worker's
connector (``init_worker_distributed_environment``), before ``load_model``.
Importing this module makes that ``load_model`` download the weights, as it does on
a fresh node: the weight files of ``$LMCACHE_EC_TEST_WEIGHTS_FROM`` appear in the
model's HF cache snapshot when vLLM's default loader prepares the weights (its
``_prepare_weights``, where it downloads them when online), and not before.
With ``HF_HUB_OFFLINE`` set vLLM serves the hub id from the snapshot's path, so the
loader is handed that path. The connector itself is the real one, unchanged.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from huggingface_hub import try_to_load_from_cache
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from lmcache_ec_broker.connector.vllm import ECBrokerConnector
from lmcache_ec_broker.testing import hf_cache

# The real connector under a name the plugin does not register, so that vLLM imports
# this module (a registered name never reaches ec_connector_module_path).
ColdCacheECBrokerConnector = ECBrokerConnector

_SOURCE = os.environ["LMCACHE_EC_TEST_WEIGHTS_FROM"]
_HUB_MODEL = os.environ["LMCACHE_EC_TEST_HUB_MODEL"]
_prepare = DefaultModelLoader._prepare_weights


def _say(line: str) -> None:
    print(f"cold-hf-cache[{os.getpid()}]: {line}", file=sys.stderr, flush=True)


def _snapshot() -> str:
    config = try_to_load_from_cache(_HUB_MODEL, "config.json")
    assert isinstance(config, str), f"{_HUB_MODEL} has no snapshot in the HF cache"
    return os.path.dirname(config)


def _download_then_prepare(self: DefaultModelLoader, *args: Any, **kwargs: Any) -> Any:
    copied = hf_cache.add_weights(_SOURCE, _snapshot())
    _say(f"load_model downloaded {copied}")
    return _prepare(self, *args, **kwargs)


DefaultModelLoader._prepare_weights = _download_then_prepare  # type: ignore[method-assign]
_weights = [n for n in os.listdir(_snapshot()) if n.endswith(".safetensors")]
_say(f"connector module imported; weights in the cache: {bool(_weights)}")
