"""The interface every lower tier implements (local disk, Redis/Valkey, Mooncake, ...).

The slab (``broker/store.py``) is the top tier and pure state. Below it, an
ordered list of *lower tiers* holds copies of entries. One coordinator
(``broker/coordinator.py``) owns how they combine: lookup order slab -> tier 0 ->
tier 1 ..., promotion upward into the slab, write-behind downward from the slab,
leases across tiers and the shared-memory membership filter. A tier never sees
the store, another tier, a client connection or the filter; it only sees

- the broker's mapping of the slab (``SlabAccess``), and only ever touches the
  byte *extents* the coordinator hands it for one call (reserved for a read,
  pinned for a write) -- never memory it was not given;
- a ``TierEvents`` sink through which it reports which keys it holds (the
  coordinator folds them into the membership filter).

Threading: every method is called on the broker's event loop thread and must not
block it (no file or network I/O inline, bounded CPU). Slow work runs on the
tier's own threads or as asyncio I/O; the awaitables it returns complete on the
loop. Events are reported on the loop thread.

Failures: a tier that is down or slow raises ``TierUnavailable`` (the coordinator
treats it as a miss and counts nothing against the tier's data); a value that
fails validation raises ``TierCorrupt`` after the tier counted it and stopped
offering it; a value that vanished raises ``TierMiss``. Values read from a file
or a network store are untrusted: the tier validates header, size, dtype/shape
and checksum before ``read_into`` returns successfully. Anything else raised is
a bug: the coordinator logs it and treats the call as failed.
"""

from __future__ import annotations

import asyncio
import mmap
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import msgspec

from ...protocol import Extent


class TierError(RuntimeError):
    """The tier cannot start; the message says why and what to do (shown to the user)."""


class TierUnavailable(Exception):
    """The tier cannot answer now (down, timed out, circuit open): treated as a miss."""


class TierMiss(Exception):
    """The tier no longer holds the key (evicted or removed since it said it had it)."""


class TierCorrupt(Exception):
    """The stored value failed validation; the tier counted it and dropped/quarantined it."""


class EntryMeta(msgspec.Struct, frozen=True):
    """What a tier knows about an entry without reading its data."""

    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class TierEvents(Protocol):
    """How a tier reports its key set (the coordinator keeps the membership filter).

    Invariant the tier keeps: ``added(key)`` is reported *before* any lookup of the
    tier can answer a hit for ``key``, and ``removed(key)`` only *after* it stopped
    answering hits for it; each ``added`` is matched by exactly one ``removed``
    (re-adding a key the tier already reported is not reported again). A remote tier
    that learns keys from announcements reports them the same way; a missed
    announcement may only cost a hit (never report a key it would not serve).
    """

    def added(self, tier: LowerTier, key: str) -> None: ...
    def removed(self, tier: LowerTier, key: str) -> None: ...


@runtime_checkable
class OwnTierEvents(Protocol):
    """Tier events that also hear what this broker itself wrote to or deleted from a
    shared tier (the coordinator; the remote policy's promise 8, ``remote/policy.py`` says when)."""

    def own_stored(self, tier: LowerTier, key: str, nbytes: int) -> None: ...
    def own_deleted(self, tier: LowerTier, key: str) -> None: ...
    def own_cleared(self, tier: LowerTier) -> None: ...


class SlabAccess:
    """The broker's own mapping of the slab, as given to tiers at ``start``.

    ``mm`` is the whole mapping (e.g. for registering it with an RDMA/Mooncake
    client once: ``address``/``size``); ``views`` yields memoryviews of exactly the
    extents a call was given, released on exit so the mapping can be closed.
    """

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.size = len(mm)

    @property
    def address(self) -> int:
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    @contextmanager
    def views(self, extents: Sequence[Extent]) -> Iterator[list[memoryview]]:
        base = memoryview(self.mm)
        out: list[memoryview] = []
        try:
            for start, n in extents:
                if start < 0 or n < 0 or start + n > self.size:
                    raise ValueError(f"extent {start}+{n} is outside the slab of {self.size}")
                out.append(base[start : start + n])
            yield out
        finally:
            for v in out:
                v.release()
            base.release()


class LowerTier(ABC):
    """One tier below the slab. Subclasses set ``name`` and ``counter_names``.

    Lifecycle: ``open()`` (before serving; may raise TierError) -> ``start(loop,
    slab, events)`` -> requests -> ``await shutdown(deadline_s)`` -> ``close()``.
    ``close`` is idempotent and also called after a failed ``open``.
    """

    #: short lower-case name: stats keys, logs ("disk", "remote")
    name: str = "tier"
    #: monotonic counters among ``stats()`` keys (exported as Prometheus counters)
    counter_names: tuple[str, ...] = ()
    #: True when ``peek`` cannot answer and ``lookup`` needs a round trip
    remote: bool = False
    #: True while the tier may hold keys it has not reported through ``added``
    #: (the membership filter's absences then prove nothing: shm/filter.py, "Partial")
    filter_partial: bool = False

    # ---------------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Acquire resources and rebuild any index (sync, before the socket exists).
        Report every key already held through the events sink given to ``start``
        -- or buffer them and report them at ``start``. Raise TierError to refuse.
        A remote tier that cannot reach its store must NOT refuse: it starts down."""
        return None

    @abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop, slab: SlabAccess, events: TierEvents) -> None:
        """Begin serving on ``loop``: start threads/connections; report held keys."""

    @abstractmethod
    async def shutdown(self, deadline_s: float) -> None:
        """Stop accepting work, finish or abandon queued writes and in-flight reads
        within ``deadline_s`` seconds (never longer), stop threads. After it returns
        the tier touches the slab no more (every ``read_into``/``write`` awaitable
        is complete)."""

    def close(self) -> None:
        """Release files/sockets/locks (sync, idempotent, safe after a failed open)."""
        return None

    def expected_keys(self, block_size: int) -> int:
        """How many keys this tier may report through ``TierEvents`` at most (sizes
        the shared membership filter; 0 if it reports none)."""
        return 0

    # ---------------------------------------------------------------- lookups

    def peek(self, keys: Sequence[str]) -> list[EntryMeta | None] | None:
        """Answer from memory, no I/O: meta per key (None = not here), or None
        for the whole call when this tier can only answer with a round trip."""
        return None

    async def lookup(self, keys: Sequence[str]) -> list[EntryMeta | None]:
        """Meta per key (None = not here). May do I/O; must complete within the
        tier's own configured timeout or raise TierUnavailable. The default
        answers from ``peek``."""
        got = self.peek(keys)
        if got is None:
            raise TierUnavailable(f"{self.name} tier implements neither peek nor lookup")
        return got

    # ---------------------------------------------------------------- data

    @abstractmethod
    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None]:
        """Copy the value of ``key`` into ``extents`` of the slab (reserved by the
        coordinator for exactly ``meta.nbytes``), off the event loop, and verify it.
        Completes normally only if every byte is written and verified; otherwise
        raises TierMiss / TierCorrupt / TierUnavailable (the extents may then hold
        garbage: the coordinator aborts the reservation)."""

    @abstractmethod
    def write(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None] | None:
        """Write-behind: start copying a committed entry out of ``extents`` (pinned
        by the coordinator until the returned awaitable completes, success or not).
        Return None (nothing started, nothing pinned) when the tier skips it: it
        already holds the key with this meta, its queue is full (count a drop),
        the entry is too large, or it is shutting down. Must never block; errors
        are counted by the tier and end the awaitable normally or with an exception
        (the coordinator only logs it)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Forget ``keys`` now (lookups miss from here on; I/O may follow async,
        ordered after any earlier queued write of the same key). True per key the
        tier held or was writing."""

    @abstractmethod
    def clear(self) -> int:
        """Forget every key of this broker's namespace; returns how many were known."""

    def touch(self, key: str) -> None:
        """The entry was used (recency for the tier's own eviction); optional."""
        return None

    # ---------------------------------------------------------------- leases

    def hold(self, key: str) -> None:
        """A lease covers ``key``: keep this tier's copy until ``unhold`` (counted per
        call; a local tier must not evict it meanwhile -- it may exceed its capacity
        rather than drop it). A remote tier that cannot protect a copy does nothing;
        the coordinator then relies on the promotion it starts at lookup."""
        return None

    def unhold(self, key: str) -> None:
        """Undo one ``hold`` (unknown keys ignored)."""
        return None

    # ---------------------------------------------------------------- inspection

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Gauges and the counters in ``counter_names``; keys prefixed with the tier
        name (e.g. ``disk_entries``, ``remote_hits``); stable while the tier is off:
        ``empty_stats()`` returns the same keys with zeros."""

    @classmethod
    def empty_stats(cls) -> dict[str, int | float]:
        """The stats keys with zero values (reported when the tier is not configured)."""
        return dict.fromkeys(cls.counter_names, 0)
