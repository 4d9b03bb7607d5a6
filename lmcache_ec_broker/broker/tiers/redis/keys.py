"""The namespace's keys on a Redis store: listed by ``SCAN`` on every master, and
cleared -- only the values whose header names the key they are stored under, so a
nested prefix's values (``a:b:x`` under ``a:``) stay."""

from __future__ import annotations

from ..remote.transport import StoreDown, owned
from ..remote.value import MAX_HEADER, stored_key
from .link import UNMAPPED, Link
from .resp import ProtocolViolation, RespConnection, RespError

_SCAN_COUNT = 1000


def scan(link: Link, channel: bytes, limit: int) -> list[str]:
    """Up to ``limit`` keys of the namespace (prefix removed; the announcement
    ``channel`` is not a key). Raises StoreDown."""
    if link.cluster:
        try:
            link.router.refresh()
        except (OSError, RespError) as exc:
            raise StoreDown([UNMAPPED], str(exc)) from None
    found: list[str] = []
    n = len(link.prefix)
    pattern = _glob_escape(link.prefix) + b"*"
    for ep in link.router.masters():

        def one_node(conn: RespConnection) -> None:
            cursor: bytes | int = b"0"
            while True:
                reply = conn.command("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
                if not (isinstance(reply, list) and len(reply) == 2):
                    raise ProtocolViolation("SCAN answered a malformed reply")
                cursor, keys = reply
                if not isinstance(keys, list) or not isinstance(cursor, bytes):
                    raise ProtocolViolation("SCAN answered a malformed reply")
                for k in keys:
                    if isinstance(k, bytes) and k != channel:
                        found.append(k[n:].decode("utf-8", "surrogateescape"))
                if cursor == b"0" or len(found) >= limit or link.stopped.is_set():
                    return

        try:
            link.call(ep, one_node)
        except RespError as exc:
            raise StoreDown([ep], str(exc)) from None
    return found[:limit]


def clear(link: Link, channel: bytes) -> int:
    """DEL every value of the namespace that is ours (``owned``); how many went."""
    names = scan(link, channel, 1 << 62)
    removed = 0
    for lo in range(0, len(names), 100):
        chunk = names[lo : lo + 100]
        for name in chunk:
            rk = link.rk(name)
            try:
                head = link.routed(
                    rk, lambda c, rk=rk: c.command("GETRANGE", rk, 0, MAX_HEADER - 1)
                )
                if not isinstance(head, bytes) or not head:
                    continue
                if not owned(stored_key(head), name):
                    continue  # another namespace nested inside ours
                removed += int(link.routed(rk, lambda c, rk=rk: c.command("DEL", rk)) or 0)
            except RespError as exc:
                raise StoreDown([link.node_of(name)], str(exc)) from None
    return removed


def _glob_escape(b: bytes) -> bytes:
    out = bytearray()
    for c in b:
        if c in b"*?[]\\":
            out.append(0x5C)
        out.append(c)
    return bytes(out)
