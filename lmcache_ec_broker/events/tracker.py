"""The broker side of the events, on its event loop: observes the slab and the lower
tiers, keeps this node's residency, and turns changes into numbered batches.

Cost on the broker's loop per change: a key split, two dict updates and a list
append; once per loop iteration the changes are encoded into one batch per model
and handed to ``sink`` (the publisher thread's bounded queue, which drops rather
than waits). Sequence numbers are taken here, in order, also for batches the
sink dropped: the gap tells a subscriber it missed something.

Invariants:
1. ``residency`` is the state after every batch numbered below ``next_seq``
   (pending changes are flushed before a snapshot is taken), and changes are
   published in the order they were observed (a tier-wide clear ends the batch
   before it, so nothing is reordered across it).
2. A shared (remote) tier is published only for what this broker did to it: a
   write of its own that ended STORED (``own_stored``), its own delete of the key
   (``own_deleted``) and its own clear of the tier (``own_cleared``). Its
   ``added``/``removed`` are ignored: they also report keys other brokers wrote
   (announcements, scans), which this node did not write. So "this node holds K on
   the remote tier" means "this broker wrote K there and has not deleted or
   cleared it since"; a removal by the store itself (eviction, TTL) or by another
   broker is not seen, and a restarted broker claims nothing it wrote before.
3. A remote removal is published only for an entry this tracker holds on that
   tier (a delete of a key another broker wrote publishes nothing).
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
# What a pending change is (the first field of ``ResidencyTracker._pending``).
STORED, REMOVED, OWN_REMOVED, CLEARED = range(4)
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
        # (kind, tier name, key, nbytes, tier to peek the size of or None)
        self._pending: list[tuple[int, str, str, int, Any]] = []
        self._scheduled = False
        self.closed = False

    # ------------------------------------------------------------ observer hooks

    def slab_stored(self, key: str, nbytes: int) -> None:
        self._note(STORED, "slab", key, nbytes)

    def slab_removed(self, key: str) -> None:
        self._note(REMOVED, "slab", key)

    def added(self, tier: Any, key: str) -> None:
        if not tier.remote:  # invariant 2
            self._note(STORED, tier.name, key, 0, tier)  # size read at flush (peek answers)

    def removed(self, tier: Any, key: str) -> None:
        if not tier.remote:
            self._note(REMOVED, tier.name, key)

    def own_stored(self, tier: Any, key: str, nbytes: int) -> None:
        self._note(STORED, tier.name, key, nbytes)

    def own_deleted(self, tier: Any, key: str) -> None:
        self._note(OWN_REMOVED, tier.name, key)

    def own_cleared(self, tier: Any) -> None:
        self._note(CLEARED, tier.name, "")

    def _note(self, kind: int, name: str, key: str, nbytes: int = -1, peek: Any = None) -> None:
        if self.closed:
            return
        self._pending.append((kind, name, key, nbytes, peek))
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
        for kind, name, key, nbytes, peek in ops:
            if kind == CLEARED:  # node-wide topic; what came before goes first (invariant 1)
                self._emit_all(by_model)
                by_model = {}
                self.residency.clear(name)
                self._emit("", [EncoderCacheCleared(name)])
                continue
            parts = split_key(key)
            if parts is None:
                self.counters["events_unparsed_keys"] += 1
                continue
            model, mm_hash, dtype = parts
            if kind == OWN_REMOVED and name not in self.residency.entries.get(parts, {}):
                continue  # invariant 3
            if kind != STORED:
                self.residency.removed(model, mm_hash, dtype, name)
                event: Event = EncoderCacheRemoved(mm_hash, model, dtype, name, MEDIUM.get(name))
            else:
                if peek is not None:
                    meta = peek.peek([key])
                    if not meta or meta[0] is None:
                        continue  # gone again before this flush (its removal follows)
                    nbytes = meta[0].nbytes
                self.residency.stored(model, mm_hash, dtype, name, nbytes)
                event = EncoderCacheStored(mm_hash, model, dtype, name, nbytes, MEDIUM.get(name))
            by_model.setdefault(model, []).append(event)
        self._emit_all(by_model)

    def _emit_all(self, by_model: dict[str, list[Event]]) -> None:
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
