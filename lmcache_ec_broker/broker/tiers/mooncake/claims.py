"""Fleet encode claims on Mooncake Store (in-flight deduplication across nodes,
``broker/dedup.py``), with what the store allows: ``put`` of an existing key returns 0
and does **not** overwrite, so "put, then read back" says who holds a claim; the store
has no per-object TTL, so the claim's value carries its own deadline.

A claim object is ``lmcache-ec-claim:`` + the value's store key (outside the value
namespace: the key listing and clear never meet it). Its value is
``<owner token> <deadline, wall-clock ms>``. A claim past its deadline is removed
(forced: reads lease objects for 10 s) and claimed anew; a crashed broker's claim
ends by that deadline, or sooner when the master drops the dead client's segment
(the claim then reads as absent). Wall clocks of the brokers differ by their skew:
a lease ends that much early or late, never later than the waiters' own deadlines.
Nothing read here is trusted beyond "someone else claims it" -- a wrong or hostile
value costs a waiter its wait (bounded by its deadline), never a wrong answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..remote.transport import StoreDown
from .data_path import RPC_FAIL

CLAIM_PREFIX = "lmcache-ec-claim:"
_MAX_VALUE = 128


def _value(owner: bytes, ttl_ms: int) -> bytes:
    return owner + b" " + str(int(time.time() * 1000) + ttl_ms).encode()


def _parse(raw: Any) -> tuple[bytes, int] | None:
    """(owner, deadline ms) of a claim value; None: absent or not a claim value."""
    if not isinstance(raw, bytes | bytearray) or not raw or len(raw) > _MAX_VALUE:
        return None
    owner, _, deadline = bytes(raw).partition(b" ")
    try:
        return owner, int(deadline)
    except ValueError:
        return None


def _live(raw: Any) -> tuple[bytes, int] | None:
    got = _parse(raw)
    if got is None or got[1] <= time.time() * 1000:
        return None
    return got


def claim(store: Any, mkey: str, owner: bytes, ttl_ms: int) -> bool | None:
    """True: ``owner`` holds the claim on store key ``mkey`` now; False: another owner
    does; None: unknown (the claim reads back as nothing: a dead client's segment).
    Raises StoreDown when the master does not answer."""
    ck = CLAIM_PREFIX + mkey
    for _ in range(2):  # a second try after removing an expired claim
        rc = int(store.put(ck, _value(owner, ttl_ms)))
        if rc == RPC_FAIL:
            raise StoreDown([], "Mooncake master RPC failed (claim)")
        raw = store.get(ck)
        got = _parse(raw)
        if got is None:
            return None
        if got[0] == owner:
            return True
        if got[1] > time.time() * 1000:
            return False
        store.remove(ck, True)  # expired: forced (our read leased it)
    return None


def held_by_others(store: Any, mkey: str, owner: bytes) -> bool:
    got = _live(store.get(CLAIM_PREFIX + mkey))
    return got is not None and got[0] != owner


def unclaim(store: Any, mkeys: Sequence[str], owner: bytes) -> None:
    """Remove the claims on ``mkeys`` that ``owner`` still holds."""
    for mkey in mkeys:
        ck = CLAIM_PREFIX + mkey
        got = _parse(store.get(ck))
        if got is not None and got[0] == owner:
            store.remove(ck, True)


def value_exists(store: Any, mkey: str) -> bool:
    return int(store.is_exist(mkey)) == 1
