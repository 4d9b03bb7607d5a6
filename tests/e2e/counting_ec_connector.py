"""Connectors that log every encoder run, for the EPD test and benchmark; loaded by a
real vLLM through ``ec_connector_module_path`` (PYTHONPATH points here).

vLLM's V1 model runner calls ``save_caches`` once for every item its encoder has
just computed, whatever the connector's role (``_cache_encoder_output``), and never
for an item it loaded. So one ``EC encoder ran`` line is one encoder run, on a
consumer too (which stores nothing and so logs no ``EC put``).

The scheduler's ``update_state_after_alloc`` runs once for every item a request
gets encoder-cache space for, encoded or loaded: one ``EC item`` line names the
request and the item's mm_hash (``benchmarks/dedup_vllm.py`` maps its requests to
their items with them).
"""

from __future__ import annotations

import re
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.logger import init_logger

from lmcache_ec_broker.connector.vllm import ECBrokerConnector

# Under "vllm.": the only logger tree vLLM configures (its handler, its format).
logger = init_logger("vllm.counting_ec_connector")

ENCODER_RAN = re.compile(r"EC encoder ran: mm_hash=(\S+)")
ITEM = re.compile(r"EC item: request=(\S+) mm_hash=(\S+)")


class CountingECBrokerConnector(ECBrokerConnector):
    def update_state_after_alloc(self, request: Any, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        logger.info("EC item: request=%s mm_hash=%s", request.request_id, mm_hash)
        super().update_state_after_alloc(request, index)

    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        logger.info("EC encoder ran: mm_hash=%s", mm_hash)
        super().save_caches(encoder_cache, mm_hash, **kwargs)


class CountingECExampleConnector(ECExampleConnector):
    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        logger.info("EC encoder ran: mm_hash=%s", mm_hash)
        super().save_caches(encoder_cache, mm_hash, **kwargs)
