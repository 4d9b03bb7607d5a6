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

No polling (issue 40 item 7): a request waiting for keys other clients reserve
sleeps on one future, woken only when one of those reservations ends -- a commit or
placement (``offered``) or an abort, its writer's connection closing included
(``ended``, the store's ``on_abort``) -- and then looks at the woken keys alone. Its
work is bounded per request: each key is looked at once when the request comes and
once per end of a reservation of it, and the first pass yields to the loop every
``_CHUNK`` keys, so one Publish of many keys never holds the loop for long (one of
60,000 zero-byte reservations used to wake 60,000 tasks every 20 ms for up to
``wait_ms``, and other clients' ping+has took 1.9 s).

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
# Keys a request looks at per loop turn on its first pass (then it yields).
_CHUNK = 1024


class _PublishWaiter:
    """One Publish request's keys whose writer it waits for; ``woken`` the ones whose
    reservation ended since it last looked; ``fut`` what it sleeps on."""

    __slots__ = ("keys", "woken", "fut")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.woken: list[str] = []
        self.fut: asyncio.Future[None] | None = None


class Publications:
    def __init__(self, tiers: Coordinator, counters: dict[str, int]) -> None:
        self.tiers = tiers
        self.counters = counters  # the server's: PUBLISH_COUNTERS are among them
        # key -> the requests waiting for the end of that key's reservation
        self._committing: dict[str, list[_PublishWaiter]] = {}

    def offered(self, key: str) -> None:
        """An entry turned READY (commit, placement, promotion): wake its waiters."""
        self.ended(key)

    def ended(self, key: str) -> None:
        """A reservation of ``key`` ended (committed, placed or aborted): wake the
        requests waiting for it (each looks at this key again, and only this one)."""
        waiting = self._committing.pop(key, None)
        for req in waiting or ():
            req.woken.append(key)
            if req.fut is not None and not req.fut.done():
                req.fut.set_result(None)

    def _reserved(self, key: str) -> bool:
        entry = self.tiers.store.entries.get(key)
        return entry is not None and entry.state is State.RESERVED

    def _watch(self, req: _PublishWaiter, key: str) -> None:
        req.keys.add(key)
        self._committing.setdefault(key, []).append(req)

    def _forget(self, req: _PublishWaiter) -> None:
        committing = self._committing
        for key in req.keys:
            waiting = committing.get(key)
            if waiting is not None and req in waiting:
                waiting.remove(req)
                if not waiting:
                    del committing[key]

    async def publish(self, keys: Sequence[str], wait_s: float) -> list[int]:
        self.counters["publish_waits"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait_s, 0.0)
        got: dict[str, int] = {}
        tasks: dict[str, asyncio.Task[int]] = {}
        req = _PublishWaiter()
        try:
            for n, key in enumerate(dict.fromkeys(keys)):
                if n and not n % _CHUNK:
                    await asyncio.sleep(0)  # bounded work per loop turn
                if self._reserved(key):
                    self._watch(req, key)
                else:
                    self._start(key, got, tasks)
            while req.keys:
                left = deadline - loop.time()
                if left <= 0:
                    break
                if not req.woken:
                    req.fut = loop.create_future()
                    await asyncio.wait({req.fut}, timeout=left)
                woken, req.woken = req.woken, []
                for key in woken:
                    if key not in req.keys:
                        continue
                    if self._reserved(key):  # reserved again (another writer): wait on
                        self._committing.setdefault(key, []).append(req)
                    else:
                        req.keys.discard(key)
                        self._start(key, got, tasks)
        finally:
            self._forget(req)
        for key in req.keys:
            got[key] = PublishState.TIMEOUT
        if tasks:
            _, pending = await asyncio.wait(
                set(tasks.values()), timeout=max(deadline - loop.time(), 0.0)
            )
            for task in pending:
                task.cancel()
            for key, task in tasks.items():
                if task in pending:
                    got[key] = PublishState.TIMEOUT
                elif task.exception() is not None:
                    log.error("publishing %r failed: %r", key[:200], task.exception())
                    got[key] = PublishState.FAILED
                else:
                    got[key] = task.result()
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

    def _start(self, key: str, got: dict[str, int], tasks: dict[str, asyncio.Task[int]]) -> None:
        """``key`` is written (no reservation left): answer it now from this node, or
        start finding out whether every remote tier holds it."""
        tiers = self.tiers
        if not tiers.remote_tiers:
            store = tiers.store
            if store.ready(key) is not None or any(_peek(t, key) for t in tiers.sync_tiers):
                got[key] = PublishState.PUBLISHED
            else:
                got[key] = PublishState.ABSENT
            return
        tasks[key] = asyncio.get_running_loop().create_task(self._remote(key))

    async def _remote(self, key: str) -> int:
        tiers = self.tiers
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
