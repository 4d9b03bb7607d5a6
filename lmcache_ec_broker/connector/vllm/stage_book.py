"""The scheduler's book of staged loads (a part of the scheduler's connector).

Per item (mm_hash) the book holds one *stage order* at a time, sent through the
engine's ``StageHub`` to every encoder rank (stage_link.py), and its state:

- ``STAGING``: ordered; waiting for every rank's report (bounded by ``hold_s``);
- ``STAGED``: every rank holds the tensor: a hit ``has_cache_item`` may promise,
  and whose load cannot fail (``start_load_caches`` only moves the tensor);
- ``FAILED``: some rank could not stage it (gone, wrong, broker away) or did not
  answer in time: the request encodes it.

Invariants (what makes a shipped load find its tensor on every rank):

1. **One order, one end.** Every order ends exactly once: *shipped* (a load of
   the item went out with a step's metadata; each rank's ``start_load_caches``
   takes the tensor), or *released* (``StageRelease``: no request needs it any more,
   or it failed; ranks drop it). The workers count orders per item, so an order
   sent while an older order's load is still on its way to the worker (async
   scheduling) does not take that load's tensor away.
2. **A load is promised only for a STAGED item** (``has_cache_item``), and the
   entry ends when that load ships: a later promise needs a new order.
3. **Bounded.** A STAGING entry older than ``hold_s`` fails; the hub is then
   *late* until every rank answered again, and orders nothing meanwhile (lookups
   are misses): a hung worker or broker costs one bounded wait per outage.
4. **Bounded memory.** The embeddings of the open orders (staging or staged, not
   yet shipped or released) never exceed ``max_embeds``, except for one order
   alone in the book (an item larger than the budget is still staged, by itself).
   Every rank holds a device tensor per open order, outside the memory vLLM
   profiled: without the bound, vLLM's waiting loop -- which skips a held request
   and looks at the next -- would stage every waiting request's hits in one step.
   An item that does not fit is not ordered: it is *held back* (``held_back``),
   and the scheduler holds its request until loads have made room, at most
   ``stage_wait_ms`` per request, then encodes it (room_waits.py):
   open orders end as their requests are scheduled, fail (invariant 3) or end, so
   room comes -- where other requests' orders hold it (``room_may_come``); a
   request whose own orders fill the budget is not held for room (they end only
   once it is scheduled): that item is encoded.
   ``over_budget`` counts each item once per time it is *held back*: from the
   step that first leaves it out until it is ordered, encoded instead
   (``allocated``: vLLM's encoder cache took it), or no request that met it left
   out is alive (``forget_request``): an item left out in three steps and ordered
   in the fourth counts 1. Those marks are bounded by the live requests' items.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from lmcache_ec_broker.connector.vllm.stage_link import Stage, StageHub, StageItem, StageRelease

log = logging.getLogger("vllm.lmcache_ec_broker.connector")


def vllm_encoder_cache_size(vllm_config: Any) -> int:
    """The default of the staging budget (invariant 4): the size vLLM's scheduler gives
    its own encoder cache, in embeddings -- more could not be loaded in one step anyway.

    That is not the configuration's ``encoder_cache_size``: vLLM's ``Scheduler``
    sizes its ``EncoderCacheManager`` with ``MultiModalBudget(...).encoder_cache_size``,
    which is ``max(encoder_cache_size, the largest item's embeddings)``
    (``compute_mm_encoder_budget``). This asks the same vLLM code the scheduler does,
    with the same config (vLLM 0.32 and 0.33 alike: ``vllm.multimodal.encoder_budget``,
    ``enable_cache=False`` as vLLM's own encoder-width probe builds it; the cache only
    memoises dummy inputs, it changes no size). Its cost is the processor's creation
    (about 0.3 s on the tiny test model), which the scheduler's own call right after
    then finds cached. Where vLLM has no encoder cache (no multimodal inputs, or every
    modality disabled) or vLLM's code fails here (the scheduler then fails the same way,
    or the helper moved in another version: a warning), the configuration's size."""
    sched = getattr(vllm_config, "scheduler_config", None)
    configured = int(
        getattr(sched, "encoder_cache_size", None)
        or getattr(sched, "max_num_batched_tokens", None)
        or 8192
    )
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "supports_multimodal_inputs", False) is not True:
        return configured
    try:
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget

        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
        size = int(budget.encoder_cache_size)
    except Exception as exc:  # never take the engine down for a default
        log.warning(
            "EC stage: could not compute vLLM's encoder cache size (%s: %s); the staging "
            "budget is the configured %d embeddings (set stage_max_embeds to choose)",
            type(exc).__name__,
            exc,
            configured,
        )
        return configured
    return size if size > 0 else configured


class StageState(enum.Enum):
    STAGING = 1
    STAGED = 2
    FAILED = 3


@dataclass
class _Entry:
    since: float
    embeds: int  # the item's embeddings (its share of the budget)
    state: StageState = StageState.STAGING
    ranks: set[int] = field(default_factory=set)  # ranks that reported it staged
    requests: set[str] = field(default_factory=set)  # requests that wait for it


class StageBook:
    """Owns the stage orders of one scheduler connector; given its hub."""

    def __init__(self, hub: StageHub, hold_s: float, max_embeds: int) -> None:
        if max_embeds <= 0:
            raise ValueError(f"max_embeds must be > 0 (got {max_embeds})")
        self._hub = hub
        self._hold_s = hold_s
        self._max_embeds = max_embeds
        self._entries: dict[str, _Entry] = {}
        self._open_embeds = 0  # sum of the entries' embeds (invariant 4)
        self._late = False  # a rank missed a hold bound and has not answered since
        self.timeouts = 0  # hold bounds that passed (a counter, for stats)
        # Items held back for lack of room, not ordered since: mm_hash -> the requests
        # that met them left out (invariant 4). Each time an item enters, it counts.
        self._held_back: dict[str, set[str]] = {}
        self.over_budget = 0  # times an item was held back (a counter, for stats)

    @property
    def ready(self) -> bool:
        """May new orders be sent: every rank linked, none late."""
        return self._hub.up and not self._late

    @property
    def max_embeds(self) -> int:
        """The budget of the open orders' embeddings (invariant 4)."""
        return self._max_embeds

    @property
    def open_embeds(self) -> int:
        """The embeddings of the open orders (invariant 4)."""
        return self._open_embeds

    def order(self, req_id: str, items: list[StageItem]) -> bool:
        """Order ``items`` (those not in the book yet) for ``req_id``, in turn, while
        they fit the budget (invariant 4); False if the link is not ready. Items left
        out (no room, or the link not ready) are not in the book: misses, except that
        the caller may hold the request of one left out for lack of room, which is
        held back (``held_back``): counted in ``over_budget`` if it was not held back
        already."""
        new: dict[str, StageItem] = {}
        left_out: list[str] = []
        room = self._max_embeds - self._open_embeds
        for item in items:
            if item.mm_hash in self._entries or item.mm_hash in new:
                continue
            if item.num_embeds <= room or not (self._entries or new):  # or alone
                new[item.mm_hash] = item
                room -= item.num_embeds
            else:
                left_out.append(item.mm_hash)
        if new and not self.ready:
            return False
        for h in left_out:
            if h not in self._held_back:
                self.over_budget += 1
            self._held_back.setdefault(h, set()).add(req_id)
        if new:
            if not self._hub.send(Stage(list(new.values()))):
                return False
            now = time.monotonic()
            for item in new.values():
                self._entries[item.mm_hash] = _Entry(now, item.num_embeds)
                self._open_embeds += item.num_embeds
                self._held_back.pop(item.mm_hash, None)
        for item in items:
            entry = self._entries.get(item.mm_hash)
            if entry is not None:
                entry.requests.add(req_id)
        return True

    def _end(self, mm_hash: str) -> bool:
        entry = self._entries.pop(mm_hash, None)
        if entry is None:
            return False
        self._open_embeds -= entry.embeds
        return True

    def refresh(self) -> set[str]:
        """Read the ranks' reports, apply the hold bound; the hashes whose orders
        became STAGED or FAILED (their broker leases can end)."""
        settled: set[str] = set()
        for report in self._hub.poll():
            self._late = False
            for h in report.ok:
                entry = self._entries.get(h)
                if entry is not None and entry.state is StageState.STAGING:
                    entry.ranks.add(report.rank)
                    if len(entry.ranks) >= self._hub.ranks:
                        entry.state = StageState.STAGED
                        settled.add(h)
            for h in report.failed:
                entry = self._entries.get(h)
                if entry is not None and entry.state is StageState.STAGING:
                    entry.state = StageState.FAILED
                    settled.add(h)
        expired = time.monotonic() - self._hold_s
        for h, entry in self._entries.items():
            if entry.state is StageState.STAGING and (entry.since < expired or not self._hub.up):
                entry.state = StageState.FAILED
                settled.add(h)
                if self._hub.up:
                    self.timeouts += 1
                    self._late = True
                    log.warning(
                        "EC stage: mm_hash=%s not staged on every encoder rank within "
                        "%.1f s (stage_wait_ms); encoded instead, no orders until the "
                        "ranks answer again",
                        h,
                        self._hold_s,
                    )
        return settled

    def state(self, mm_hash: str) -> StageState | None:
        entry = self._entries.get(mm_hash)
        return None if entry is None else entry.state

    def staging(self) -> set[str]:
        return {h for h, e in self._entries.items() if e.state is StageState.STAGING}

    def shipped(self, mm_hash: str) -> None:
        """A load of ``mm_hash`` went out: its ranks take the tensor (invariant 1)."""
        self._end(mm_hash)

    def release(self, hashes: set[str]) -> None:
        """End these orders without a load (failed, or no longer wanted)."""
        gone = [h for h in hashes if self._end(h)]
        if gone:
            self._hub.send(StageRelease(gone))

    def held_back(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` was left out for lack of room and not ordered since."""
        return mm_hash in self._held_back

    def fits(self, num_embeds: int) -> bool:
        """Whether an item of ``num_embeds`` would be ordered now (invariant 4)."""
        return not self._entries or num_embeds <= self._max_embeds - self._open_embeds

    def room_may_come(self, req_id: str, num_embeds: int) -> bool:
        """Whether orders ``req_id`` does not wait for hold the room an item of
        ``num_embeds`` lacks, so that waiting can give it: false where only the
        request's own orders fill the budget (they end only once it is scheduled) or
        its own orders and the item would not fit together."""
        own = sum(e.embeds for e in self._entries.values() if req_id in e.requests)
        others = self._open_embeds - own
        return others > 0 and (own == 0 or own + num_embeds <= self._max_embeds)

    def allocated(self, mm_hash: str) -> None:
        """vLLM allocated ``mm_hash`` in its encoder cache (encoded or loaded): if it
        was held back, that time ends (invariant 4); a later one counts again."""
        self._held_back.pop(mm_hash, None)

    def forget_request(self, req_id: str) -> None:
        """``req_id`` ended (finished, aborted): orders only it waited for end, and
        items held back only for it are held back no more."""
        done = set()
        for h, entry in self._entries.items():
            entry.requests.discard(req_id)
            if not entry.requests:
                done.add(h)
        self.release(done)
        for h in [h for h, reqs in self._held_back.items() if reqs <= {req_id}]:
            del self._held_back[h]
        for reqs in self._held_back.values():
            reqs.discard(req_id)

    def clear(self) -> None:
        self.release(set(self._entries))

    def wait(self, timeout_s: float) -> None:
        """Until a worker wrote or connected, at most ``timeout_s`` (tests)."""
        self._hub.wait(timeout_s)

    def close(self) -> None:
        self._entries.clear()
        self._held_back.clear()
        self._open_embeds = 0
        self._hub.close()

    def __len__(self) -> int:
        return len(self._entries)
