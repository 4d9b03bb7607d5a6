"""The broker side of the events, on its event loop: observes the slab and the lower
tiers, keeps this node's residency, and turns changes into numbered batches.

Cost on the broker's loop per change: a key split, two dict updates and a list
append; once per loop iteration the changes are encoded into one batch per model
and handed to ``sink`` (the publisher thread's bounded queue, which drops rather
than waits). Sequence numbers are taken here, in order, also for batches the
sink dropped: the gap tells a subscriber it missed something.

Invariants:
1. ``residency`` is the state after every batch numbered below ``next_seq``
   (pending changes are flushed before a snapshot is taken).
2. Remote tiers are not published: their added/removed also report keys other
   brokers wrote (announcements, scans), which this node does not hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .residency import Residency
from .schema import (
    MEDIUM,
    SCHEMA_VERSION,
    EncoderCacheCleared,
    EncoderCacheRemoved,
    EncoderCacheStored,
    Event,
    EventBatch,
    Heartbeat,
    Snapshot,
    encoder,
    split_key,
    topic,
)

# Events per batch at most (bounds a message and the loop time spent encoding it).
MAX_BATCH_EVENTS = 512
Sink = Callable[[bytes, int, bytes], bool]  # (topic, seq, payload) -> accepted

TRACKER_COUNTERS = (
    "events_batches",
    "events_sent",
    "events_dropped_batches",
    "events_dropped",
    "events_unparsed_keys",
)


class ResidencyTracker:
    """``Store.observer`` and ``Coordinator.observer``; all methods on the loop thread."""

    def __init__(self, node: str, epoch: str, sink: Sink | None = None) -> None:
        self.node = node
        self.epoch = epoch
        self.sink = sink
        self.residency = Residency()
        self.next_seq = 0
        self.counters = dict.fromkeys(TRACKER_COUNTERS, 0)
        # (tier or None for the slab, key, nbytes or -1 for a removal)
        self._pending: list[tuple[Any, str, int]] = []
        self._scheduled = False
        self.closed = False

    # ------------------------------------------------------------ observer hooks

    def slab_stored(self, key: str, nbytes: int) -> None:
        self._note(None, key, nbytes)

    def slab_removed(self, key: str) -> None:
        self._note(None, key, -1)

    def added(self, tier: Any, key: str) -> None:
        if not tier.remote:
            self._note(tier, key, 0)  # its size is read at flush (peek answers by then)

    def removed(self, tier: Any, key: str) -> None:
        if not tier.remote:
            self._note(tier, key, -1)

    def _note(self, tier: Any, key: str, nbytes: int) -> None:
        if self.closed:
            return
        self._pending.append((tier, key, nbytes))
        if not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not serving (a test driving the store directly)
                self.flush()
                return
            self._scheduled = True
            loop.call_soon(self.flush)

    # ------------------------------------------------------------ batches

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        ops, self._pending = self._pending, []
        by_model: dict[str, list[Event]] = {}
        for tier, key, nbytes in ops:
            parts = split_key(key)
            if parts is None:
                self.counters["events_unparsed_keys"] += 1
                continue
            model, mm_hash, dtype = parts
            name = "slab" if tier is None else tier.name
            if nbytes < 0:
                self.residency.removed(model, mm_hash, dtype, name)
                event: Event = EncoderCacheRemoved(mm_hash, model, dtype, name, MEDIUM.get(name))
            else:
                if tier is not None:
                    meta = tier.peek([key])
                    if not meta or meta[0] is None:
                        continue  # gone again before this flush (its removal follows)
                    nbytes = meta[0].nbytes
                self.residency.stored(model, mm_hash, dtype, name, nbytes)
                event = EncoderCacheStored(mm_hash, model, dtype, name, nbytes, MEDIUM.get(name))
            by_model.setdefault(model, []).append(event)
        for model, events in by_model.items():
            for i in range(0, len(events), MAX_BATCH_EVENTS):
                self._emit(model, events[i : i + MAX_BATCH_EVENTS])

    def _emit(self, model: str, events: list[Event]) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self.counters["events_batches"] += 1
        if self.sink is None:
            return
        payload = encoder.encode(EventBatch(time.time(), events))
        if self.sink(topic(self.node, model).encode(), seq, payload):
            self.counters["events_sent"] += len(events)
        else:
            self.counters["events_dropped_batches"] += 1
            self.counters["events_dropped"] += len(events)

    def heartbeat(self) -> None:
        if not self.closed:
            self.flush()
            self._emit("", [Heartbeat(self.epoch)])

    def close(self) -> None:
        """The broker stops: publish that nothing here is served any more."""
        if self.closed:
            return
        self.flush()
        self._emit("", [EncoderCacheCleared(None)])
        self.closed = True

    def snapshot(self) -> Snapshot:
        self.flush()
        return Snapshot(
            SCHEMA_VERSION, self.node, self.epoch, self.next_seq, self.residency.snapshot()
        )

    def lookup(self, model: str, mm_hashes: list[str]) -> list[dict[str, int]]:
        self.flush()
        return [self.residency.lookup(model, h) for h in mm_hashes]

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "events_seq": self.next_seq,
            "events_entries": len(self.residency),
        }
