"""Fleet encode claims on Redis/Valkey (in-flight deduplication across nodes,
``broker/dedup.py``): ``SET claim-key owner NX PX ttl`` -- on a Cluster too: each
claim is one key, routed like a value (redirects followed by ``Link.routed``).

A claim key is ``lmcache-ec-claim:`` + the value's store key, outside the value
namespace (the namespace's SCAN, discovery and clear never meet it); it holds the
claiming broker's random owner token and expires by itself (PX), so a crashed
broker's claim ends at its TTL. What another party wrote there is only ever read as
"someone else claims it" -- a wrong or hostile value costs a waiter its wait
(bounded by its deadline), never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..remote.transport import StoreDown
from .link import Link
from .resp import RespConnection, RespError

CLAIM_PREFIX = b"lmcache-ec-claim:"
# Deletes the claim only if it is still ours (compare-and-delete in one step).
_UNCLAIM = (
    b"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def claim_key(link: Link, key: str) -> bytes:
    return CLAIM_PREFIX + link.rk(key)


def claim(link: Link, owner: bytes, keys: Sequence[str], ttl_ms: int) -> list[bool]:
    """Per key: True if ``owner`` holds its claim now (newly, or already), False if
    another owner does -- or if the value itself is in the store already (its encoder's
    write landed and its claim went between our lookup and this claim: our claim is
    deleted again and the caller looks it up instead of encoding it twice). Raises
    StoreDown."""
    out: list[bool] = []
    for key in keys:
        ck = claim_key(link, key)

        def one(c: RespConnection, ck: bytes = ck) -> list[object]:
            replies = c.pipeline([["SET", ck, owner, "NX", "PX", ttl_ms], ["GET", ck]])
            for r in replies:
                if isinstance(r, RespError):
                    raise r  # Link.routed follows -MOVED/-ASK; any other is StoreDown
            return replies

        try:
            set_reply, held = link.routed(ck, one)
        except RespError as exc:
            raise StoreDown([link.node_of(key)], str(exc)) from None
        if isinstance(set_reply, RespError):
            raise StoreDown([link.node_of(key)], str(set_reply))
        won = set_reply == b"OK" or held == owner
        if won and _value_exists(link, key):
            unclaim(link, owner, [key])
            won = False
        out.append(won)
    return out


def _value_exists(link: Link, key: str) -> bool:
    rk = link.rk(key)
    try:
        return bool(link.routed(rk, lambda c: c.command("EXISTS", rk)))
    except RespError as exc:
        raise StoreDown([link.node_of(key)], str(exc)) from None


def held_by_others(link: Link, owner: bytes, keys: Sequence[str]) -> list[bool]:
    """Per key: does an owner other than ``owner`` hold its claim -- or, with no claim
    on it, is the value itself in the store? The caller read the value as absent just
    before; an encoder writes the value, then deletes its claim, so a claim gone
    meanwhile may mean the value landed: True sends the caller to look again instead
    of encoding it twice. Raises StoreDown."""
    out: list[bool] = []
    for key in keys:
        ck = claim_key(link, key)
        try:
            held = link.routed(ck, lambda c, ck=ck: c.command("GET", ck))
        except RespError as exc:
            raise StoreDown([link.node_of(key)], str(exc)) from None
        out.append(held != owner if held is not None else _value_exists(link, key))
    return out


def unclaim(link: Link, owner: bytes, keys: Sequence[str]) -> None:
    """Delete the claims on ``keys`` that ``owner`` still holds (another's are kept).
    A store that refuses scripts keeps them until their TTL. Raises StoreDown."""
    for key in keys:
        ck = claim_key(link, key)
        try:
            link.routed(ck, lambda c, ck=ck: c.command("EVAL", _UNCLAIM, 1, ck, owner))
        except RespError:
            continue  # scripting disabled (ACL): the claim expires by itself
