"""RESP2 on the wire, without I/O: commands packed, replies read from a buffer with
every length the server sends bounded before it is used. One grammar for both
readers, the threads' blocking ``resp.RespConnection`` and the loop's
``resp_async.LoopConnection``; each brings its own way to wait for bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_LINE = 64 * 1024
MAX_SMALL_BULK = 1 << 20  # replies that are not streamed (headers, SCAN pages, INFO)
MAX_ARRAY = 100_000
MAX_REPLY = 16 << 20  # bytes of bulk strings in one (non-streamed) reply, arrays included

Arg = bytes | str | int | memoryview
Reply = bytes | int | str | list["Reply"] | None


class RespError(Exception):
    """The server answered with an error reply (the connection stays usable)."""


class ProtocolViolation(ConnectionError):
    """The server sent something this client refuses; the connection is closed."""


# ---------------------------------------------------------------- commands


def _b(arg: Arg) -> bytes | memoryview:
    if isinstance(arg, bytes | memoryview):
        return arg
    if isinstance(arg, int):
        return str(arg).encode()
    return arg.encode("utf-8", "surrogatepass")


def pack(args: Sequence[Arg]) -> list[bytes | memoryview]:
    """RESP pieces for one command; large arguments are passed through, not copied."""
    out: list[bytes | memoryview] = []
    head = [b"*%d\r\n" % len(args)]
    for a in args:
        data = _b(a)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        head.append(b"$%d\r\n" % n)
        if n > 16 * 1024:
            out.append(b"".join(head))
            out.append(data)
            head = [b"\r\n"]
        else:
            head.append(bytes(data))
            head.append(b"\r\n")
    out.append(b"".join(head))
    return out


def pack_set(
    key: bytes, value: Sequence[bytes | memoryview], ttl_s: int = 0
) -> list[bytes | memoryview]:
    """``SET key <value pieces concatenated> [EX ttl]`` without joining the pieces."""
    total = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in value)
    nargs = 5 if ttl_s > 0 else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(key), key, total)
    tail = b"\r\n"
    if ttl_s > 0:
        ttl = str(ttl_s).encode()
        tail += b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    return [head, *value, tail]


ASKING = pack(["ASKING"])[0]


# ---------------------------------------------------------------- replies


def take_line(buf: bytearray, ep: object) -> bytes | None:
    """The next line in ``buf`` (taken out, without its CRLF); None: read more first.
    A line may be MAX_LINE bytes long at most."""
    i = buf.find(b"\r\n")
    if i >= 0:
        line = bytes(buf[:i])
        del buf[: i + 2]
        return line
    if len(buf) > MAX_LINE:
        raise ProtocolViolation(f"{ep} sent a line longer than {MAX_LINE} bytes")
    return None


def take_buffered(buf: bytearray, view: memoryview, hasher: Any = None) -> int:
    """Move what ``buf`` holds, up to ``len(view)`` bytes, to the start of ``view``;
    ``hasher.update`` sees it. How many bytes moved."""
    take = min(len(view), len(buf))
    if take:
        view[:take] = buf[:take]
        del buf[:take]
        if hasher is not None:
            hasher.update(view[:take])
    return take


def check_crlf(data: bytes, ep: object) -> None:
    """``data``: the two bytes after a bulk string."""
    if data != b"\r\n":
        raise ProtocolViolation(f"{ep} sent a bulk string without its CRLF")


def reply_head(line: bytes, ep: object, max_bulk: int) -> tuple[bytes, Reply | RespError]:
    """What the first line of a reply says, bounds checked: (type byte, value).

    ``+`` a status (str), ``-`` an error (a RespError, returned: whether to raise it
    is the reader's call) and ``:`` an integer are the whole reply. ``$``: the length
    of the bulk string that follows, at most ``max_bulk``; ``*``: how many replies
    follow, at most MAX_ARRAY. Either is None for nil. Anything else raises
    ProtocolViolation."""
    kind, rest = line[:1], line[1:]
    try:
        if kind == b"+":
            return kind, rest.decode(errors="replace")
        if kind == b"-":
            return kind, RespError(rest.decode(errors="replace"))
        if kind == b":":
            return kind, int(rest)
        if kind == b"$" or kind == b"*":
            n = int(rest)
            if n == -1:
                return kind, None
            if kind == b"$" and not 0 <= n <= max_bulk:
                raise ProtocolViolation(f"{ep} sent a {n}-byte reply (limit {max_bulk})")
            if kind == b"*" and not 0 <= n <= MAX_ARRAY:
                raise ProtocolViolation(f"{ep} sent an array of {n} items")
            return kind, n
    except ValueError:
        raise ProtocolViolation(f"{ep} sent a malformed reply {line[:40]!r}") from None
    raise ProtocolViolation(f"{ep} sent an unknown reply type {line[:40]!r}")


def bulk_length(line: bytes, ep: object) -> int | None:
    """The length line of a streamed bulk reply (a value ``GET`` answers): its length,
    None for nil. An error reply raises RespError; the caller bounds the length by
    what the value may be."""
    if line[:1] == b"-":
        raise RespError(line[1:].decode(errors="replace"))
    if line[:1] != b"$":
        raise ProtocolViolation(f"{ep} answered {line[:40]!r} where a value was expected")
    try:
        n = int(line[1:])
    except ValueError:
        raise ProtocolViolation(f"{ep} sent a malformed length") from None
    if n < -1:
        raise ProtocolViolation(f"{ep} sent a negative length")
    return None if n == -1 else n
