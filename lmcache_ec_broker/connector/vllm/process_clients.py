"""A connector's broker clients in this process: each made on first use, and made
again after a fork (a client is a socket and a slab mapping: never shared between
processes).

A worker has two. The step's client serves the model runner thread: its puts,
publishes and deletes. The staging thread (stage_link.py) reads through a client of
its own. A client's lock is held through each copy into or out of the slab, so a
staging copy of a large entry (tens of MiB: milliseconds on a CPU, and a device copy
on a GPU) on a shared client would stall the step's put behind it, and the engine's
step with it. Two connections cost the broker one more connection per worker (no put
arena: the staging client never puts) and this process one more slab mapping.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

from vllm.logger import init_logger

from lmcache_ec_broker.connector.client import BrokerClient

logger = init_logger("vllm.lmcache_ec_broker.connector")

_T = TypeVar("_T")


class ProcessClient:
    """One lazily made BrokerClient per process, and whether the broker answered it
    (each transition logged once)."""

    def __init__(self, make: Callable[[], BrokerClient], role: str = "") -> None:
        """``role``: named in the health log lines (two clients, two lines)."""
        self._make = make
        self._role = f" ({role})" if role else ""
        self._client: BrokerClient | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._up = True

    def get(self) -> BrokerClient:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = self._make()
                self._pid = os.getpid()
                self._up = True
                self.note_health(self._client)
            return self._client

    def live(self) -> BrokerClient | None:
        """This process's client if it made one (nothing is connected to end a lease)."""
        client = self._client
        return client if client is not None and self._pid == os.getpid() else None

    def timeouts(self) -> int:
        """Outages that cost this process's client a wait (BrokerClient.timeouts)."""
        client = self.live()
        return client.timeouts if client is not None else 0

    def note_health(self, client: BrokerClient) -> None:
        """Log each transition between reachable and unreachable broker once."""
        up = client.connected
        if up == self._up:
            return
        self._up = up
        if up:
            logger.info("EC broker at %s is reachable again%s", client.socket_path, self._role)
        else:
            logger.warning(
                "EC broker not reachable at %s%s; serving without it (misses) "
                "and reconnecting in the background",
                client.socket_path,
                self._role,
            )

    def on_live_connection(self, call: Callable[[BrokerClient], _T]) -> _T:
        """``call(client)``, once more if the connection died under it. A connection
        idle across a broker restart is found dead only when used; the retry connects
        to the new broker at once (no backoff is pending), so the first load after a
        restart does not fail its request. Only for reads: they are safe to repeat."""
        client = self.get()
        result = call(client)
        if not client.connected:
            result = call(client)
        self.note_health(client)
        return result

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None
