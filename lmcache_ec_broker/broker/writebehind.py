"""Write-behind: offering READY slab entries down to the lower tiers.

Every committed client entry, every placed one, and every promoted one (to the
tiers other than its source) is offered to each lower tier. A tier that takes it
reads the entry's extents later, off the loop.

Invariant: the entry is pinned (on ``conn``, the coordinator's own store
connection) from the offer until that tier's write is done, so its extents are
not reused under the read.

Every offer is told to ``on_offered`` first (the publishers waiting for a key's
commit, ``publish.py``), lower tiers or not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from .store import Entry, Store
from .tiers.base import EntryMeta, LowerTier

log = logging.getLogger("lmcache_ec_broker")


class WriteBehind:
    def __init__(
        self,
        store: Store,
        lower_tiers: Sequence[LowerTier],
        conn: int,
        tasks: set[asyncio.Future[Any]],
    ) -> None:
        self.store = store
        self.lower_tiers = lower_tiers
        self.conn = conn
        self.tasks = tasks  # shared with the coordinator, whose shutdown waits for them
        self.closing = False  # set by the coordinator's shutdown: offer nothing more
        self.on_offered: Callable[[str], None] | None = None  # publish.Publications.offered

    def offer(self, entry: Entry, skip: LowerTier | None) -> None:
        """Offer a READY slab entry to every lower tier but ``skip`` (its source)."""
        if self.on_offered is not None:
            self.on_offered(entry.key)
        if not self.lower_tiers or self.closing:
            return
        for tier in self.lower_tiers:
            if tier is not skip:
                self.offer_to(entry, tier)

    def offer_to(self, entry: Entry, tier: LowerTier) -> bool:
        """Offer a READY slab entry to ``tier`` alone; True if the tier took the write
        (publish.py offers again an entry whose write-behind was dropped)."""
        if self.closing:
            return False
        meta = EntryMeta(entry.nbytes, entry.dtype, tuple(entry.shape))
        try:
            pending = tier.write(entry.key, meta, list(entry.extents))
        except Exception:
            log.exception("the %s tier failed to queue a write", tier.name)
            return False
        if pending is None:
            return False
        pin = self.store.pin_entry(self.conn, entry)
        fut = asyncio.ensure_future(pending)
        self.tasks.add(fut)
        fut.add_done_callback(lambda f, pin=pin, tier=tier: self._done(f, pin, tier))
        return True

    def _done(self, fut: asyncio.Future[Any], pin: int, tier: LowerTier) -> None:
        self.tasks.discard(fut)
        if self.conn in self.store.conns:
            self.store.release(self.conn, [pin])
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("the %s tier's write failed: %s", tier.name, fut.exception())
