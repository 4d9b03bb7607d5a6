"""When the scheduler asks the broker again about an item another encoder claimed (a
part of the scheduler's connector).

A request whose item is CLAIMED (another instance or node is encoding it) is held
in ``ensure_cache_available`` until the item lands or ``claim_wait_ms`` passes.
vLLM steps an engine with held requests about every millisecond; asking the broker
on every step made each held item a claiming lookup per millisecond (across nodes a
store read each), and on a busy host that load pushed lookups past the scheduler's
budget (docs/performance.md, "In-flight deduplication"). The schedule keeps an
item's CLAIMED answer across steps and says when it is due again: first after
``first_s``, then at intervals growing by ``growth`` up to ``max_s`` -- so an item
that lands soon is seen soon, and a long encode costs about one lookup per
``max_s``. Per item, not per request: the requests held on one item share its
re-asks.

Invariants:

1. **Only CLAIMED is kept.** An item is in the schedule only after a lookup
   answered CLAIMED or went unanswered early in an outage (3); any other answer
   (READY, MISS: ours to encode, PENDING) drops it.
   A kept answer can only hold a request, never promise a load or skip an encode,
   so it cannot make an answer wrong.
2. **Bounded.** A kept answer is at most ``max_s`` old; the request's own
   ``claim_wait_ms`` bound is the connector's and is checked on every step.
3. **An outage holds items a bounded time, once.** A claiming lookup the broker
   did not answer (it timed out, or the circuit a timeout opened is still open)
   starts an *outage*, which the next answered lookup ends. (A broker that is gone
   -- connection refused or reset -- holds no claim anyone could wait for: its
   MISS is this instance's to encode, at once.) In the outage's
   first ``unreached_s`` (the connector passes twice its probe interval: one probe,
   then one re-ask) an item met unanswered is kept CLAIMED -- a re-ask of a held item
   as much as a first lookup: the broker is most likely busy, not gone, and another
   encoder may be on the item -- and re-asked on the schedule; once the outage is
   ``unreached_s`` old every item it holds leaves the schedule at its next re-ask
   and every item met until the broker answers again is encoded here at once. A dead or hung broker
   thus costs requests at most ``unreached_s`` of waiting per outage (those that
   meet its first ``unreached_s``), never a hang, never one wait per request.
4. **Released with its requests.** An item no held request waits for any more (the
   request finished, was aborted, stopped waiting) leaves the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Chosen from benchmarks/dedup_vllm.py (docs/performance.md, "In-flight
# deduplication"): an item landing within the first 5 ms is seen at once; after
# 5+10+20 ms an encode in progress is re-asked every 40 ms (a few % of a waiter's
# TTFT against ~1 lookup per ms per item before).
FIRST_S = 0.005
GROWTH = 2.0
MAX_S = 0.040


@dataclass
class _Item:
    due: float  # when to ask the broker again
    interval: float  # the wait before the next re-ask after this one
    requests: set[str] = field(default_factory=set)  # held on it


class ReaskSchedule:
    """Owns the CLAIMED answers kept across steps, per mm_hash."""

    def __init__(
        self,
        first_s: float = FIRST_S,
        growth: float = GROWTH,
        max_s: float = MAX_S,
        unreached_s: float = 0.0,
    ):
        if not 0 < first_s <= max_s or growth < 1 or unreached_s < 0:
            raise ValueError(
                f"re-ask schedule: need 0 < first_s <= max_s, growth >= 1 and "
                f"unreached_s >= 0 (got {first_s}, {max_s}, {growth}, {unreached_s})"
            )
        self._unreached_s = unreached_s
        self._first_s = first_s
        self._growth = growth
        self._max_s = max_s
        self._items: dict[str, _Item] = {}
        self._outage_since: float | None = None  # the first unanswered lookup (invariant 3)
        self.reasks = 0  # lookups of an item the schedule kept (a counter, for stats)

    def __len__(self) -> int:
        return len(self._items)

    def kept(self, mm_hash: str, now: float) -> bool:
        """True: ``mm_hash`` is still CLAIMED as far as this step needs to know (not
        due yet). False: ask the broker (a re-ask if it is in the schedule)."""
        item = self._items.get(mm_hash)
        if item is None:
            return False
        if now < item.due:
            return True
        self.reasks += 1
        return False

    def answered(self, mm_hash: str, claimed: bool, now: float) -> None:
        """The broker's answer to a claiming lookup of ``mm_hash`` (an outage ends)."""
        self._outage_since = None
        item = self._items.get(mm_hash)
        if not claimed:
            self._items.pop(mm_hash, None)
        elif item is None:
            self._items[mm_hash] = _Item(now + self._first_s, self._first_s)
        else:
            item.interval = min(item.interval * self._growth, self._max_s)
            item.due = now + item.interval

    def unreached(self, mm_hash: str, now: float) -> bool:
        """A claiming lookup of ``mm_hash`` the broker did not answer. True: keep it
        CLAIMED, re-asked on the schedule (within the outage's first ``unreached_s``,
        invariant 3); False: it is not in the schedule (any more): encode it here."""
        if self._outage_since is None:
            self._outage_since = now
        if now - self._outage_since >= self._unreached_s:
            self._items.pop(mm_hash, None)
            return False
        item = self._items.get(mm_hash)
        if item is None:
            self._items[mm_hash] = _Item(now + self._first_s, self._first_s)
        else:
            item.due = now + item.interval
        return True

    def hold(self, hashes: list[str], req_id: str) -> None:
        """``req_id`` is held on ``hashes`` (CLAIMED this step)."""
        for mm_hash in hashes:
            item = self._items.get(mm_hash)
            if item is not None:
                item.requests.add(req_id)

    def forget_request(self, req_id: str) -> None:
        """``req_id`` waits no more (finished, aborted, its items landed or its wait
        timed out): items no request is held on leave the schedule."""
        for mm_hash, item in list(self._items.items()):
            item.requests.discard(req_id)
            if not item.requests:
                del self._items[mm_hash]
