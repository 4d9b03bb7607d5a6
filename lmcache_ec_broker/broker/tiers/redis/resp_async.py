"""RESP on the broker's event loop: one pooled ``resp.RespConnection`` read and written
without blocking, for the two calls of a remote hit (the lookup's pipeline and the
promotion's ``GET``), so a hit waits for the store and nothing else -- no hand-off
to a worker thread and back (measured: 100-300 µs each on a loaded host,
``benchmarks/remote_attribution.py``).

The connection comes from the tier's ``Pool`` only when one is idle there (never a
blocking connect on the loop), plain TCP or a Unix socket (TLS stays on the
threads), and goes back only when its stream is in step: any error or cancellation
in the middle of a reply closes it. The same grammar and bounds as
``resp.RespConnection`` (``resp_wire.py``, shared): every length the server sends is
checked before it is used; bytes land only in the views the caller gives.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from .resp import Pool, RespConnection
from .resp_wire import (
    MAX_SMALL_BULK,
    ProtocolViolation,
    Reply,
    RespError,
    bulk_length,
    check_crlf,
    reply_head,
    take_buffered,
    take_line,
)

_FILL = 16 * 1024  # the header's read: the payload goes straight into the slab


class LoopConnection:
    """``conn`` used from ``loop``; ``release`` gives it back (or closes it)."""

    def __init__(self, conn: RespConnection, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.pool = pool
        self.loop = loop
        self.sock: socket.socket = conn.sock
        self.buf = bytearray()
        self.in_step = True  # False from a request until its whole reply is read
        self.sock.setblocking(False)

    @classmethod
    def take(
        cls, pool: Pool, ep: Any, loop: asyncio.AbstractEventLoop
    ) -> LoopConnection | None:
        """An idle pooled connection to ``ep`` usable on the loop, or None."""
        conn = pool.take_idle(ep)
        if conn is None:
            return None
        if conn.params.tls is not None or not conn.idle or conn.asking:
            pool.put(conn)
            return None
        return cls(conn, pool, loop)

    def release(self) -> None:
        conn = self.conn
        if self.in_step and not self.buf and not conn.closed:
            try:
                self.sock.settimeout(conn.params.timeout_s)
            except OSError:
                conn.close()
                return
            self.pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        self.in_step = False
        self.conn.close()

    # ------------------------------------------------------------ writing

    async def send(self, pieces: list[bytes | memoryview]) -> None:
        self.in_step = False
        await self.loop.sock_sendall(self.sock, b"".join(pieces))

    # ------------------------------------------------------------ reading

    async def _fill(self) -> None:
        chunk = await self.loop.sock_recv(self.sock, _FILL)
        if not chunk:
            raise ConnectionError(f"{self.conn.ep} closed the connection")
        self.buf += chunk

    async def line(self) -> bytes:
        while (line := take_line(self.buf, self.conn.ep)) is None:
            await self._fill()
        return line

    async def exact(self, n: int) -> bytes:
        out = bytearray(n)
        await self.into(memoryview(out))
        return bytes(out)

    async def into(self, view: memoryview, hasher: Any = None) -> None:
        """Fill ``view`` (buffered bytes first, then straight from the socket);
        ``hasher.update`` sees each piece as it lands."""
        got = take_buffered(self.buf, view, hasher)
        n = len(view)
        while got < n:
            r = await self.loop.sock_recv_into(self.sock, view[got:])
            if r == 0:
                raise ConnectionError(f"{self.conn.ep} closed the connection mid-value")
            if hasher is not None:
                hasher.update(view[got : got + r])
            got += r

    async def stream_into(self, views: list[memoryview], hasher: Any) -> None:
        """Fill ``views`` in order, straight from the socket: one reader registered for
        the whole value (not one per piece), one ``recv_into`` per readiness (draining
        to EAGAIN measured slower: a failing syscall per wake-up); ``hasher.update``
        sees every piece as it lands. Cancelled or failed, nothing more lands."""
        todo = [v for v in views if len(v)]
        while todo and self.buf:
            todo[0] = todo[0][take_buffered(self.buf, todo[0], hasher) :]
            if not len(todo[0]):
                todo.pop(0)
        if not todo:
            return
        done: asyncio.Future[None] = self.loop.create_future()
        sock = self.sock

        def readable() -> None:
            try:
                if todo:  # one recv per readiness: the poll says when there is more
                    view = todo[0]
                    r = sock.recv_into(view)
                    if r == 0:
                        raise ConnectionError(f"{self.conn.ep} closed the connection mid-value")
                    hasher.update(view[:r])
                    if r == len(view):
                        todo.pop(0)
                    else:
                        todo[0] = view[r:]
                if todo:
                    return
            except (BlockingIOError, InterruptedError):
                return
            except BaseException as exc:
                todo.clear()
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(None)

        readable()
        if done.done():
            return done.result()
        fd = sock.fileno()
        self.loop.add_reader(fd, readable)
        try:
            await done
        finally:
            todo.clear()  # cancelled or failed: nothing more lands in the views
            self.loop.remove_reader(fd)

    async def crlf(self) -> None:
        check_crlf(await self.exact(2), self.conn.ep)

    async def bulk_len(self) -> int | None:
        """The length line of a bulk reply (None: nil); an error reply raises RespError
        (the stream stays in step)."""
        line = await self.line()
        try:
            n = bulk_length(line, self.conn.ep)
        except RespError:
            self.in_step = True  # an error reply is the whole reply
            raise
        if n is None:
            self.in_step = True
        return n

    async def small_reply(self) -> Reply | RespError:
        """One reply that is a status, an error, an integer or a bulk string of at most
        ``MAX_SMALL_BULK`` bytes (what GETRANGE and STRLEN answer)."""
        self.in_step = False
        line = await self.line()
        if line[:1] == b"*":  # GETRANGE and STRLEN never answer an array
            raise ProtocolViolation(f"{self.conn.ep} sent an unexpected reply {line[:40]!r}")
        kind, value = reply_head(line, self.conn.ep, MAX_SMALL_BULK)
        if kind == b"$" and isinstance(value, int):
            data = await self.exact(value)
            await self.crlf()
            return data
        return value

    async def pipeline(self, pieces: list[bytes | memoryview], replies: int) -> list[Any]:
        await self.send(pieces)
        out = [await self.small_reply() for _ in range(replies)]
        self.in_step = True
        return out
