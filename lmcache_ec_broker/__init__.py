"""lmcache-ec-broker: a node-local, multi-process encoder cache for vLLM.

``BrokerClient`` is imported lazily so that ``import lmcache_ec_broker`` (and the
broker process) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .connector.client import BrokerClient, BrokerRefused

__all__ = ["BrokerClient", "BrokerRefused", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("BrokerClient", "BrokerRefused"):
        from .connector import client

        return getattr(client, name)
    raise AttributeError(name)
