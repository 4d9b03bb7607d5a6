"""Publish: answering once entries are visible to the whole fleet (the ``Publish``
request; docs/epd.md, "Guarantees").

An encoder instance (vLLM ``ec_producer``) asks this after its step's puts, before
its step -- hence its answer to the proxy -- ends, so that the prefill instance the
proxy sends the request to next finds every item in the fleet's store. Per key:

- an entry another client is still writing (RESERVED) is waited for: its commit
  offers it to the lower tiers (``WriteBehind.offer`` tells ``offered``);
- without a remote tier, a READY entry (or one on the local disk tier) is published:
  every instance of this node asks this broker;
- with one, the key is published when every remote tier holds it: its write-behind
  ended STORED or PRESENT (waited for while in flight), or the tier already knew the
  key. A READY entry the tier does not know and is not writing (its write-behind was
  dropped: a full queue, an open breaker) is offered again now and waited for. A key
  not in the slab is asked of the store itself (``fresh``: not trusting the filter);
- by ``wait_s`` at the latest: a key still in flight then is TIMEOUT.

Counted: ``publish_waits`` (requests), ``publish_failures`` (keys FAILED or ABSENT),
``publish_timeouts`` (keys TIMEOUT); each failure is logged. Nothing here blocks
the loop: every wait is on a future a tier or a commit resolves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..protocol import PublishState
from .entries import State

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("lmcache_ec_broker")

PUBLISH_COUNTERS = ("publish_waits", "publish_failures", "publish_timeouts")
# How often a key another client is writing is looked at again if no commit came
# (its writer aborted or died: the reservation is gone without an offer).
RESERVED_RECHECK_S = 0.02


class Publications:
    def __init__(self, tiers: Coordinator, counters: dict[str, int]) -> None:
        self.tiers = tiers
        self.counters = counters  # the server's: PUBLISH_COUNTERS are among them
        # key -> futures of publishers waiting for that key's commit
        self._committing: dict[str, list[asyncio.Future[None]]] = {}

    def offered(self, key: str) -> None:
        """An entry turned READY (commit, placement, promotion): wake its waiters."""
        waiting = self._committing.pop(key, None)
        for fut in waiting or ():
            if not fut.done():
                fut.set_result(None)

    async def publish(self, keys: Sequence[str], wait_s: float) -> list[int]:
        self.counters["publish_waits"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait_s, 0.0)
        unique = list(dict.fromkeys(keys))
        tasks = {k: loop.create_task(self._one(k, deadline)) for k in unique}
        _, pending = await asyncio.wait(
            set(tasks.values()), timeout=max(deadline - loop.time(), 0.0)
        )
        for task in pending:
            task.cancel()
        got: dict[str, int] = {}
        for key, task in tasks.items():
            state = PublishState.TIMEOUT
            if task in pending:
                pass
            elif task.exception() is not None:
                log.error("publishing %r failed: %r", key[:200], task.exception())
                state = PublishState.FAILED
            else:
                state = task.result()
            got[key] = state
        timeouts = sum(s == PublishState.TIMEOUT for s in got.values())
        failures = sum(s in (PublishState.FAILED, PublishState.ABSENT) for s in got.values())
        self.counters["publish_timeouts"] += timeouts
        self.counters["publish_failures"] += failures
        if timeouts or failures:
            bad = {k: s for k, s in got.items() if s != PublishState.PUBLISHED}
            log.warning(
                "publish: %d of %d entr%s not visible to the fleet within %.0f ms "
                "(%s): instances on other nodes encode them instead",
                len(bad),
                len(got),
                "y" if len(got) == 1 else "ies",
                wait_s * 1000,
                ", ".join(f"{k[:120]}={_NAMES[s]}" for k, s in list(bad.items())[:8]),
            )
        return [got[k] for k in keys]

    async def _one(self, key: str, deadline: float) -> int:
        tiers = self.tiers
        store = tiers.store
        loop = asyncio.get_running_loop()
        while (entry := store.entries.get(key)) is not None and entry.state is State.RESERVED:
            left = deadline - loop.time()
            if left <= 0:
                return PublishState.TIMEOUT
            fut: asyncio.Future[None] = loop.create_future()
            self._committing.setdefault(key, []).append(fut)
            try:
                await asyncio.wait({fut}, timeout=min(left, RESERVED_RECHECK_S))
            finally:
                waiting = self._committing.get(key)
                if waiting is not None and fut in waiting:
                    waiting.remove(fut)
                    if not waiting:
                        del self._committing[key]
        if not tiers.remote_tiers:
            if store.ready(key) is not None or any(_peek(t, key) for t in tiers.sync_tiers):
                return PublishState.PUBLISHED
            return PublishState.ABSENT
        if len(tiers.remote_tiers) == 1:  # the usual case: no task more (a known key
            return await self._on_tier(tiers.remote_tiers[0], key)  # answers in one turn)
        states = await asyncio.gather(*(self._on_tier(t, key) for t in tiers.remote_tiers))
        return max(states)  # PUBLISHED only if every remote tier holds it

    async def _on_tier(self, tier: Any, key: str) -> int:
        held = tier.publication(key)
        if held is None:  # neither known nor being written: write it now, or ask
            entry = self.tiers.store.ready(key)
            if entry is not None:
                if not self.tiers.writes.offer_to(entry, tier):
                    return PublishState.FAILED  # dropped: full queue, open breaker, too big
                held = tier.publication(key)
                if held is None:
                    return PublishState.FAILED
            else:
                metas = await self.tiers.asks.ask(tier, [key], fresh=True)
                return PublishState.PUBLISHED if metas[0] is not None else PublishState.ABSENT
        if isinstance(held, bool):
            return PublishState.PUBLISHED if held else PublishState.FAILED
        return PublishState.PUBLISHED if await held else PublishState.FAILED


def _peek(tier: Any, key: str) -> bool:
    got = tier.peek([key])
    return got is not None and got[0] is not None


_NAMES = {
    PublishState.PUBLISHED: "published",
    PublishState.ABSENT: "absent",
    PublishState.FAILED: "failed",
    PublishState.TIMEOUT: "timeout",
}
