"""The client's framed transport: requests framed and sent, replies read in place
from one receive buffer, and the replies still owed for posted (reply-less to the
caller) requests read and dropped -- or kept, for arena blocks -- before the next.
A BrokerClient mixin; its state is set up in BrokerClient.__init__."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import msgspec

from ..protocol import (
    FRAME_HEADER,
    ArenaReply,
    ErrorReply,
    PlaceReply,
    ProtocolError,
    frame_length,
)
from .errors import BrokerRefused, BrokerUnavailable

_MAX_REPLY_BYTES = 256 << 20
_HEADER_FROM = FRAME_HEADER.unpack_from
# Posted requests whose replies may be left unread; past this a put reads them first
# (they are usually in already), so the broker's write buffer never backs up.
_MAX_OWED = 256

log = logging.getLogger("lmcache_ec_broker.connector.client")  # one name for the whole client


class FramedTransport:
    """Sending frames and reading replies on ``self._sock``. Call with the lock held."""

    def _read_reply(self) -> Any:
        """Decode the next reply frame; usually one recv_into per reply."""
        sock = self._sock
        assert sock is not None
        buf = self._rbuf
        while True:
            avail = self._rend - self._rpos
            need = 4
            if avail >= 4:
                try:  # the one header parser (protocol.frame_length), with the reply cap
                    length = frame_length(buf, _MAX_REPLY_BYTES - 4, self._rpos)
                except ProtocolError as exc:
                    raise BrokerUnavailable(f"implausible reply: {exc}") from None
                need = 4 + length
                if avail >= need:
                    start = self._rpos + 4
                    self._rpos = start + length
                    if self._rpos == self._rend:
                        self._rpos = self._rend = 0
                    with memoryview(buf) as view:
                        return self._decoder.decode(view[start : start + length])
            if self._rpos:  # keep the unread tail at the front
                buf[:avail] = buf[self._rpos : self._rend]
                self._rpos, self._rend = 0, avail
            if need > len(buf):
                buf.extend(bytes(need - len(buf)))
            with memoryview(buf) as view:
                k = sock.recv_into(view[self._rend :])
            if k == 0:
                raise BrokerUnavailable("the broker closed the connection")
            self._rend += k

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise BrokerUnavailable("not connected")
        if self._served_at:
            data = self._served_frame() + data  # in order, before this request
        try:
            sock.sendall(data)
        except OSError as exc:
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _frame(self, msg: msgspec.Struct) -> bytes:
        body = self._encoder.encode(msg)
        hello = self._hello
        limit = hello.max_frame_bytes if hello is not None else 0
        if limit and len(body) > limit:
            # Refused here: sent, it would make the broker drop the whole connection.
            raise BrokerRefused(
                "bad_request",
                f"{type(msg).__name__.lower()} request of {len(body)} bytes exceeds the "
                f"broker's maximum frame of {limit} bytes; split the batch or raise "
                "max_frame_bytes",
            )
        return FRAME_HEADER.pack(len(body)) + body

    def _read_replies(self, n: int) -> list[Any]:
        """Skip the owed replies, then read ``n`` replies."""
        try:
            while self._owed:
                owed = self._read_reply()
                self._owed -= 1
                self._owed_reply(owed)
            self._posted_keys.clear()
            self._grant_owed = False  # its reply, if one was owed, was just read
            out = [self._read_reply() for _ in range(n)]
        except (OSError, msgspec.MsgspecError) as exc:
            # The stream position is unknown, so start over; a timeout also trips.
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except BrokerUnavailable:
            self._drop_socket()
            raise
        self._confirmed_at = time.monotonic()
        return out

    def _owed_reply(self, owed: Any) -> None:
        """The reply of a posted request: arena grants and returned placements are kept
        (they carry blocks), refusals logged, the rest dropped."""
        if isinstance(owed, (ArenaReply, PlaceReply)):
            self._arena_reply(owed)
        elif isinstance(owed, ErrorReply):
            log.debug("deferred request refused: %s: %s", owed.code, owed.message)

    def _roundtrip(self, msg: msgspec.Struct) -> Any:
        sock = self._sock
        if sock is None or self._rend:
            self._send(self._frame(msg))
            return self._read_replies(1)[0]
        # Fast path (nothing buffered): one send, usually one recv holding the owed
        # replies (a get's posted Release, a put's posted Commit) and then this reply.
        # Whatever is not exactly that is left to the general reader, from where this
        # stopped; the owed replies are decoded, checked and dropped as it would.
        buf = self._rbuf
        decode = self._decoder.decode
        pos = 0
        try:
            sock.sendall(self._served_frame() + self._frame(msg))
            n = sock.recv_into(buf)
            while n - pos >= 4:
                (length,) = _HEADER_FROM(buf, pos)
                end = pos + 4 + length
                if end > n:
                    break
                if not self._owed:
                    if end != n:
                        break
                    self._posted_keys.clear()  # as _read_replies does once nothing is owed
                    self._grant_owed = False
                    with memoryview(buf) as view:
                        reply = decode(view[pos + 4 : end])
                    self._confirmed_at = time.monotonic()
                    return reply
                with memoryview(buf) as view:
                    owed = decode(view[pos + 4 : end])
                pos = end
                self._owed -= 1
                self._owed_reply(owed)
        except (OSError, msgspec.MsgspecError) as exc:
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if n == 0:
            self._drop_socket()
            raise BrokerUnavailable("the broker closed the connection")
        # A partial (or longer) reply: the general reader takes over from ``pos``.
        self._rpos, self._rend = (pos, n) if pos < n else (0, 0)
        return self._read_replies(1)[0]

    def _post(self, msg: msgspec.Struct) -> None:
        """Send without waiting: the reply is read (and dropped) before the next one."""
        self._send(self._frame(msg))
        self._owed += 1

    def _call(self, msg: msgspec.Struct) -> Any:
        """One request; raises BrokerUnavailable or BrokerRefused."""
        if not self._ensure_connected():
            raise BrokerUnavailable("not connected")
        reply = self._roundtrip(msg)
        if isinstance(reply, ErrorReply):
            raise BrokerRefused(reply.code, reply.message)
        return reply


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise BrokerUnavailable("the broker closed the connection")
        data += chunk
    return data
