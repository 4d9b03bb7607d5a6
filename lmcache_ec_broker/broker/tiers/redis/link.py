"""The Redis transport's way to its servers: a pooled connection per round trip, to
the server owning a key of the namespace (``prefix`` + key).

Standalone: the one server. Cluster: the slot map (``CLUSTER SLOTS``); a ``-MOVED``
reply updates the map and the command goes to the new owner, an ``-ASK`` reply sends
it once to the target, preceded by ``ASKING``, leaving the map as it is.

Every connection in use is known here so that ``stop`` can cut it: a worker blocked
on a silent store returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..base import TierMiss
from ..remote.connect_error import ConnectTrouble
from ..remote.tier import Meter
from ..remote.transport import Node, StoreDown
from ..remote.value import BadValue
from .resp import (
    MAX_REDIRECTS,
    Endpoint,
    Pool,
    ProtocolViolation,
    Redirect,
    RespConnection,
    RespError,
    Router,
    parse_redirect,
)

log = logging.getLogger("lmcache_ec_broker.remote")

T = TypeVar("T")

UNMAPPED = "cluster (slot map not loaded)"


class Link:
    """Pooled, routed, metered round trips to a Redis/Valkey store."""

    def __init__(
        self,
        pool: Pool,
        router: Router,
        prefix: bytes,
        meter: Meter,
        trouble: ConnectTrouble,
    ) -> None:
        self.pool = pool
        self.router = router
        self.cluster = router.cluster
        self.prefix = prefix
        self.meter = meter
        self.trouble = trouble  # why it cannot connect (stats, log once)
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._active: set[RespConnection] = set()  # invariant: every connection in use

    # ------------------------------------------------------------ connections in use

    def track(self, conn: RespConnection) -> None:
        with self._lock:
            self._active.add(conn)

    def untrack(self, conn: RespConnection) -> None:
        with self._lock:
            self._active.discard(conn)

    def stop(self) -> None:
        """Cut every connection in use (idempotent); the pool keeps the idle ones."""
        self.stopped.set()
        with self._lock:
            conns = list(self._active)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)

    # ------------------------------------------------------------ routing

    def rk(self, key: str) -> bytes:
        """The store's name of ``key``."""
        return self.prefix + key.encode("utf-8", "surrogatepass")

    def node_of(self, key: str) -> Node:
        return self.router.cached_node(self.rk(key)) or UNMAPPED

    def node_for(self, rk: bytes) -> Endpoint:
        try:
            return self.router.node_for(rk)
        except (OSError, RespError) as exc:
            raise StoreDown([UNMAPPED], str(exc)) from None

    def redirect_of(self, err: RespError, ep: Endpoint) -> Redirect | None:
        """The Cluster redirect ``err`` is, or None (any other error; standalone)."""
        return parse_redirect(str(err), ep) if self.cluster else None

    @staticmethod
    def not_an_answer(err: RespError, ep: Node) -> StoreDown | BadValue:
        """What an error reply to a read of a key (``GETRANGE``/``STRLEN``/``GET``) that
        is not a redirect means. Invariant: never "absent" -- only a nil (or empty)
        reply says a key is absent. ``-WRONGTYPE`` is an answer about the key (something
        other than a value is stored under it): BadValue, the key refused. Any other
        (``-CLUSTERDOWN``, ``-LOADING``, ``-BUSY``, ``-MASTERDOWN``, ``-NOPERM``, an unknown
        command...) is a failure of the call, as a lost connection is: StoreDown, so the
        policy feeds ``ep``'s breaker and leaves the key's membership in the filter alone."""
        why = str(err)
        if why.startswith("WRONGTYPE"):
            return BadValue(f"not a value (a key of another type): {why[:200]}")
        return StoreDown([ep], f"{ep}: {why[:200]}")

    def note_redirect(self, redirect: Redirect) -> None:
        kind = "ask" if redirect.ask else "moved"
        self.meter.count(f"remote_{kind}_redirects")
        log.debug("remote tier: %s slot %d -> %s", kind.upper(), redirect.slot, redirect.ep)

    def redirected(self, redirect: Redirect) -> None:
        """Bookkeeping for one redirect: ``-MOVED`` updates the slot and reloads the map."""
        self.note_redirect(redirect)
        if not redirect.ask:
            self.router.moved(redirect.slot, redirect.ep)
            with contextlib.suppress(OSError, RespError):
                self.router.refresh()

    # ------------------------------------------------------------ round trips

    def call(self, ep: Endpoint, fn: Callable[[RespConnection], T]) -> T:
        """Run ``fn`` on a pooled connection to ``ep``. Raises StoreDown for connection
        trouble, RespError for a server error reply, BadValue/TierMiss from ``fn``."""
        t0 = time.monotonic()
        try:
            conn = self.pool.get(ep)
        except (OSError, RespError) as exc:
            self.trouble.failed(exc, ep)
            raise StoreDown([ep], f"cannot connect to {ep}: {exc}") from None
        self.trouble.ok()
        self.track(conn)
        try:
            result = fn(conn)
        except (RespError, TierMiss):
            self.pool.put(conn)
            raise
        except (OSError, ProtocolViolation, ValueError) as exc:
            conn.close()  # possibly mid-value: never reused
            if isinstance(exc, BadValue):
                raise
            raise StoreDown([ep], f"{ep}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        finally:
            self.untrack(conn)
            self.meter.observe(time.monotonic() - t0)
        self.pool.put(conn)
        return result

    def routed(self, rk: bytes, fn: Callable[[RespConnection], T]) -> T:
        """``call`` on the node owning ``rk``, following Cluster redirects: after
        ``-MOVED`` on the new owner (slot map updated), after ``-ASK`` once on the
        migration target with ASKING before each command (slot map unchanged)."""
        ep = self.node_for(rk)
        asking = False
        for hop in range(MAX_REDIRECTS + 1):
            try:
                return self.call(ep, with_asking(fn) if asking else fn)
            except RespError as exc:
                redirect = self.redirect_of(exc, ep)
                if redirect is None or hop == MAX_REDIRECTS:
                    raise
            self.redirected(redirect)
            ep, asking = redirect.ep, redirect.ask
        raise AssertionError("unreachable")


def with_asking(fn: Callable[[RespConnection], T]) -> Callable[[RespConnection], T]:
    """``fn`` with every command it sends preceded by ASKING (following an -ASK)."""

    def run(conn: RespConnection) -> T:
        conn.asking = True  # the pool clears it when the connection comes back
        return fn(conn)

    return run
