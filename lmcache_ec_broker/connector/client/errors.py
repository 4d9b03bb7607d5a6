"""The client's exceptions (re-exported by connector/client/broker_client.py)."""

from __future__ import annotations


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached right now (internal; public calls turn it into a miss)."""


class BrokerImpostor(BrokerUnavailable):
    """The process on the socket, or a segment it names, belongs to an untrusted uid."""


class BrokerRefused(RuntimeError):
    """The broker answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
