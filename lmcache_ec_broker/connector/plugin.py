"""vLLM plugin: registers ``ECBrokerConnector`` with vLLM's EC connector factory.

Declared in the ``vllm.general_plugins`` entry-point group, so every vLLM process
(API server, engine core, workers) runs :func:`register` at start-up and
``--ec-transfer-config '{"ec_connector": "ECBrokerConnector", "ec_role": "ec_both"}'``
needs no ``ec_connector_module_path``. Only the name is registered: the connector
module (torch, the broker client) is imported when vLLM creates a connector.
``VLLM_PLUGINS`` can switch plugins off; the long form with
``ec_connector_module_path`` then still works.
"""

from __future__ import annotations

CONNECTOR_NAME = "ECBrokerConnector"
CONNECTOR_MODULE = "lmcache_ec_broker.connector.vllm"


def register() -> None:
    """Register the connector; a no-op if the name is already registered (vLLM loads
    plugins once per process, but a test or a second caller may call this again)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    registry = getattr(ECConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        pass  # registered meanwhile under the same name: nothing left to do
