"""Local misses: the keys the broker's membership filter proves absent are answered
without a round trip, and the broker's answers for the rest merged back. A
BrokerClient mixin (the filter is mapped by broker_link.py); call with the lock held."""

from __future__ import annotations

import time
from typing import Any


class Membership:
    """Asking the broker only about the keys the filter cannot rule out."""

    def _ask(self, keys: list[str]) -> tuple[list[str], list[bool] | None]:
        """The keys to ask the broker about, and the filter's mask when it ruled some out
        (None when every key is asked, the usual case of a hit). Call with the lock held."""
        mask = self._maybe_mask(keys)
        if mask is None:
            return _as_list(keys), None
        maybe = mask.count(True)  # one C pass; the common answers need no list built
        if maybe == len(mask):
            return _as_list(keys), None
        if not maybe:
            self.local_misses += len(keys)
            return [], mask
        ask = [k for k, m in zip(keys, mask, strict=True) if m]
        self.local_misses += len(keys) - len(ask)
        return ask, mask

    def _maybe_mask(self, keys: list[str]) -> list[bool] | None:
        """Per key, False where the filter proves a miss; None if the filter is not usable.
        Call with the lock held."""
        flt = self._filter
        if (
            flt is None
            or self._sock is None
            or time.monotonic() - self._confirmed_at > self.filter_trust_s
        ):
            return None
        # An "absent" is proof only if no other connection's placement was pending when
        # the filter was read: the journal first, then the filter (read the other way
        # round, a placement handled in between would be missed). The journal check
        # scans only the slots in use (~1 us), less than a second filter pass.
        if self._arena_hidden():
            return None
        mask = flt.maybe_many(keys)
        if self._posted_keys:
            mask = [m or k in self._posted_keys for k, m in zip(keys, mask, strict=True)]
        return mask


def _as_list(keys: list[str]) -> list[str]:
    """The caller's list as is (the request is encoded before the call returns and the
    lock is held meanwhile), any other sequence copied into one."""
    return keys if type(keys) is list else list(keys)


def _expand(mask: list[bool], answers: list[Any], absent: Any) -> list[Any]:
    """Merge the broker's answers for the "maybe" keys back into one list per key."""
    it = iter(answers)
    return [next(it) if m else absent for m in mask]
