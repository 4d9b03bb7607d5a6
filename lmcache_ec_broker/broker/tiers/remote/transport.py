"""What a remote store's transport does for the remote policy (``policy.py``):
move bytes and list keys, nothing else.

A transport knows how to reach one kind of store (Redis/Valkey over RESP, Mooncake
through its client) and answers each call on the calling thread (the policy's
workers; never the event loop). It keeps no queues, no sets of known keys and no
counters of outcomes: what a result *means* (stored, learned, refused, a breaker
failure) is the policy's business.

Errors a transport raises:

- ``StoreDown(nodes, why)``: the store (those nodes) did not answer or misbehaved;
  the policy feeds each node's circuit breaker;
- ``BadValue`` (``value.py``): the value is there but not servable;
- ``TierMiss``: the value is gone.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from ....protocol import Extent
from ..base import EntryMeta, SlabAccess
from .value import BadValue

Node = Hashable


class StoreDown(Exception):
    """The store did not answer (connection lost, timed out, error reply)."""

    def __init__(self, nodes: Sequence[Node], why: str) -> None:
        super().__init__(why)
        self.nodes = list(nodes)


class Retry(Exception):
    """The store cannot do it now but will later (a Mooncake reader's lease): try
    again after ``after_s``."""

    def __init__(self, after_s: float, why: str) -> None:
        super().__init__(why)
        self.after_s = after_s


class Declined(Exception):
    """A fetch's caller took nothing after reading the value's header (no room in the
    slab, or a client is writing the key): not the store's fault, not the value's."""


class Outcome(enum.Enum):
    """How one write-behind ended. Exactly one per accepted write."""

    STORED = "stored"  # this broker wrote the value
    PRESENT = "present"  # a valid value was already there: not written
    FAILED = "failed"  # not stored (timeout, lost connection): the key is NOT known
    REJECTED = "rejected"  # the store answered no (full: OOM / no space): alive, not stored
    CANCELLED = "cancelled"  # a delete or clear of the key came first: never written
    ABANDONED = "abandoned"  # shutdown ended it before it ran


class WriteItem(Protocol):
    key: str
    meta: EntryMeta
    extents: list[Extent]
    overwrite: bool  # the stored value was refused: replace it, whatever the store holds


LookupAnswer = EntryMeta | None | BadValue


class Transport(Protocol):
    """Everything the policy asks of a store. Calls run on worker threads."""

    #: how many writes one ``write`` call takes (Mooncake batches; Redis goes one by one)
    write_batch: int
    #: how many threads write (Mooncake: one; order within a batch is the store's)
    write_workers: int

    def open(self) -> None:
        """Sync, before serving: import the client, check settings (raise TierError).
        A store that cannot be reached must not refuse: the tier starts down."""
        ...

    def start(self, slab: SlabAccess) -> None:
        """Start connecting (in the background) and register the slab if needed."""
        ...

    def ready(self) -> bool:
        """Connected (a client set up); breakers say the rest."""
        ...

    def node_of(self, key: str) -> Node:
        """Which node serves ``key``, from memory (no I/O): the breaker it feeds."""
        ...

    def nodes(self) -> list[Node]:
        """Every node known now (probes and stats)."""
        ...

    def lookup(self, keys: list[str]) -> list[LookupAnswer]:
        """Per key: the meta of a valid header, None (absent), or the BadValue that
        refuses it. Raises StoreDown."""
        ...

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess) -> None:
        """Copy and verify the value into ``extents``. Raises TierMiss, BadValue, StoreDown."""
        ...

    def write(self, items: Sequence[WriteItem], slab: SlabAccess) -> list[Outcome]:
        """Per item STORED, PRESENT (a *valid* value is there and ``overwrite`` is
        False), REJECTED (the store refused it: full) or FAILED. A refused value under the key must never answer PRESENT.
        Raises StoreDown only when nothing was attempted."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` (absent is fine). Raises StoreDown or Retry."""
        ...

    def clear(self) -> int:
        """Remove every key of this broker's namespace -- only values whose header
        names the key they are stored under (``owned``), so a longer prefix that
        nests inside ours (``a:`` vs ``a:b:``) keeps its keys. Raises StoreDown."""
        ...

    def list_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` keys of the namespace (prefix removed). Raises StoreDown."""
        ...

    def probe(self, node: Node) -> None:
        """One cheap round trip to ``node``; raises StoreDown if it does not answer."""
        ...

    def start_announcements(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None],
    ) -> None:
        """Start following other brokers' announcements, if the store has them:
        ``on_keys`` gets announced keys (from a thread), ``on_resync`` is called
        when announcements may have been missed (subscribed again), ``on_health``
        when a node was seen up or down outside any call."""
        ...

    def stop(self) -> None:
        """Stop threads and cut sockets so workers return soon (idempotent)."""
        ...

    def close(self) -> None:
        """Release the client (idempotent)."""
        ...


def owned(stored_key_of_value: str | None, name: str) -> bool:
    """Is a value listed under ``name`` (prefix removed) this namespace's? Its header
    names the key it was written for; a namespace nested in ours (prefix ``a:b:``
    under ``a:``) wrote ``x`` where we list ``b:x``. A value whose header does not
    parse is ours to remove (nobody can serve it)."""
    return stored_key_of_value is None or stored_key_of_value == name
