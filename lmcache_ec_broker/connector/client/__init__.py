"""The broker client: ``BrokerClient`` (broker_client.py) and the parts it composes
(the module docstring of broker_client.py lists them). No vLLM, and torch only once a
tensor is copied (``reads.copy_module``)."""

from .broker_client import BrokerClient
from .errors import BrokerImpostor, BrokerRefused, BrokerUnavailable
from .trust import BROKER_UID_ENV

__all__ = [
    "BROKER_UID_ENV",
    "BrokerClient",
    "BrokerImpostor",
    "BrokerRefused",
    "BrokerUnavailable",
]
