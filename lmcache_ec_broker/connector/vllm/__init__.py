"""The vLLM connector, ``ECBrokerConnector`` (connector.py): the module vLLM imports
(``ec_connector_module_path: lmcache_ec_broker.connector.vllm``, or through the
plugin). Its parts, one concern each (docs/design.md, "The vLLM connector's parts"):

- ``connector.py``: the class vLLM instantiates per role: the configuration, the
  broker client of its process, and one part per role, to which it forwards;
- ``scheduler.py``: the scheduler side (lookups, holds, leases, claims, the step's
  loads), a part the connector holds; ``reask.py``: when an item another encoder
  claimed is asked about again, a part it holds;
- ``worker.py``: the worker side (staging, loads, puts), a part the connector holds;
- ``stage_book.py`` / ``stage_link.py``: the scheduler's stage orders, and the link
  that carries them to every encoder rank and their reports back;
- ``meta.py``: the messages between the two sides, the key format, the stats;
- ``model_id.py``, ``weights_identity.py``, ``identifiers.py``: what a key's model
  field and item part say (which weights and configuration, which content);
  ``encoder_digest.py`` / ``tp_digest.py``: the encoder weights' digest, one rank's
  part and its settling over the TP group (``weights_identity.py``: when it is taken);
- ``extra_config.py``: the ``ec_connector_extra_config`` keys and their refusals.

The names are loaded on first use, so that the identity modules (imported by the
broker's configuration without torch or vLLM) do not pull the connector in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import ECBrokerConnector, ECBrokerConnectorMetadata, make_key

__all__ = ["ECBrokerConnector", "ECBrokerConnectorMetadata", "make_key"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)
