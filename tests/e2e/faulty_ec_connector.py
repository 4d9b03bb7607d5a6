"""Fault injection for the e2e tests, loaded by a real vLLM through
``ec_connector_module_path`` (PYTHONPATH points here).

The worker deletes each entry from the broker right before loading it: the
"entry vanished between the scheduler's check and the worker's load" race
(broker restart, ``clear``), made deterministic."""

from __future__ import annotations

from typing import Any

from lmcache_ec_broker.connector.vllm import ECBrokerConnector, ECBrokerConnectorMetadata


class ECBrokerConnectorDropsBeforeLoad(ECBrokerConnector):
    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECBrokerConnectorMetadata)
        for spec in metadata.loads:
            self.client.delete(self.key(spec.mm_hash))
        super().start_load_caches(encoder_cache, **kwargs)
