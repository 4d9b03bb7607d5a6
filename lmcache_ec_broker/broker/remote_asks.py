"""Asking a remote tier which keys it holds, without trusting stale answers.

Invariant (3 of the coordinator, for promotions not started yet): a key deleted,
or a shared clear, while the tier was being asked is answered as a miss -- the
tier's answer predates the delete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .tiers.base import EntryMeta, LowerTier, TierUnavailable

log = logging.getLogger("lmcache_ec_broker")


@dataclass(slots=True, eq=False)
class _Asking:
    """A remote lookup in flight: what was deleted or cleared meanwhile."""

    gone: set[str] = field(default_factory=set)
    cleared: bool = False


class RemoteAsks:
    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters  # the coordinator's; counts ``tier_unavailable``
        self._asking: set[_Asking] = set()

    async def ask(
        self, tier: LowerTier, keys: list[str], fresh: bool = False
    ) -> list[EntryMeta | None]:
        """``tier``'s meta per key; None: a miss, the tier down or failing, or a key
        deleted (or a shared clear) while it was asked. ``fresh``: the store is asked
        also for keys the tier's filter does not know (a remote tier's ``lookup``)."""
        asking = _Asking()
        self._asking.add(asking)
        try:
            metas = await (tier.lookup(keys, fresh=True) if fresh else tier.lookup(keys))  # type: ignore[call-arg]
        except TierUnavailable:
            self.counters["tier_unavailable"] += 1
            return [None] * len(keys)
        except Exception:
            log.exception("the %s tier failed a lookup", tier.name)
            return [None] * len(keys)
        finally:
            self._asking.discard(asking)
        if len(metas) != len(keys):
            log.error("the %s tier answered %d of %d keys", tier.name, len(metas), len(keys))
            return [None] * len(keys)
        if asking.cleared:
            return [None] * len(keys)
        return [None if k in asking.gone else m for k, m in zip(keys, metas, strict=True)]

    def deleted(self, keys: set[str]) -> None:
        for asking in self._asking:
            asking.gone |= keys

    def cleared(self) -> None:
        """The shared store was cleared: answers asked for before are stale."""
        for asking in self._asking:
            asking.cleared = True
