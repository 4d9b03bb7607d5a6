"""Local misses: which keys to ask the broker about, given the membership filter's
mask (False where the filter proves a key absent), and the broker's answers for the
asked keys merged back. Plain functions: BrokerClient decides when the filter may
be trusted (connector/client/broker_client.py ``_maybe_mask``) and passes the mask in."""

from __future__ import annotations

from typing import Any


def split(keys: list[str], mask: list[bool] | None) -> tuple[list[str], list[bool] | None]:
    """The keys to ask the broker about, and the mask when it ruled some out (None when
    every key is asked, the usual case of a hit)."""
    if mask is None:
        return _as_list(keys), None
    maybe = mask.count(True)  # one C pass; the common answers need no list built
    if maybe == len(mask):
        return _as_list(keys), None
    if not maybe:
        return [], mask
    return [k for k, m in zip(keys, mask, strict=True) if m], mask


def with_posted(keys: list[str], mask: list[bool], posted: set[str]) -> list[bool]:
    """Keys of posted requests whose replies are still owed are never ruled out: the
    filter may not list them yet (read-your-writes)."""
    if not posted:
        return mask
    return [m or k in posted for k, m in zip(keys, mask, strict=True)]


def _as_list(keys: list[str]) -> list[str]:
    """The caller's list as is (the request is encoded before the call returns and the
    lock is held meanwhile), any other sequence copied into one."""
    return keys if type(keys) is list else list(keys)


def _expand(mask: list[bool], answers: list[Any], absent: Any) -> list[Any]:
    """Merge the broker's answers for the "maybe" keys back into one list per key."""
    it = iter(answers)
    return [next(it) if m else absent for m in mask]
