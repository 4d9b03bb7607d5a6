"""Connectors that log every encoder run, for the EPD test and benchmark; loaded by a
real vLLM through ``ec_connector_module_path`` (PYTHONPATH points here).

vLLM's V1 model runner calls ``save_caches`` once for every item its encoder has
just computed, whatever the connector's role (``_cache_encoder_output``), and never
for an item it loaded. So one ``EC encoder ran`` line is one encoder run, on a
consumer too (which stores nothing and so logs no ``EC put``).
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


class CountingECBrokerConnector(ECBrokerConnector):
    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        logger.info("EC encoder ran: mm_hash=%s", mm_hash)
        super().save_caches(encoder_cache, mm_hash, **kwargs)


class CountingECExampleConnector(ECExampleConnector):
    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        logger.info("EC encoder ran: mm_hash=%s", mm_hash)
        super().save_caches(encoder_cache, mm_hash, **kwargs)
