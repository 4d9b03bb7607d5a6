"""The wire of one connection: requests framed and sent, replies read in place from
one receive buffer, and the replies still owed for posted (reply-less to the
caller) requests read and handed on before the next reply.

``Wire`` is a part of one ``Session`` (connector/client/session.py): made when the
connection is made, dropped with it. It knows nothing of the other parts; what it
must tell them comes through the callables it is given:

- ``prefix()``: bytes to send ahead of the next request (the Served batch);
- ``on_owed(reply)``: the reply of a posted request (arena grants, placements);
- ``on_caught_up()``: every owed reply has been read (posted keys are handled);
- ``on_lost(timed_out)``: the connection failed; the wire is already closed.

Invariant: ``owed`` is the number of replies the broker still owes for requests
sent without waiting; they are read, in order, before any reply waited for.
Call everything with the client's lock held.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ...protocol import FRAME_HEADER, ErrorReply, ProtocolError, Reply, frame_length
from .errors import BrokerRefused, BrokerUnavailable

_MAX_REPLY_BYTES = 256 << 20
_HEADER_FROM = FRAME_HEADER.unpack_from
# Posted requests whose replies may be left unread; past this a put reads them first
# (they are usually in already), so the broker's write buffer never backs up.
_MAX_OWED = 256
_HUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


class Framer:
    """Requests to frames, refused here when the broker's frame limit would drop the
    whole connection. Shared by the parts of one session that build frames."""

    __slots__ = ("_encode", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int) -> None:
        self._encode = msgspec.msgpack.Encoder().encode
        self.max_frame_bytes = max_frame_bytes

    def frame(self, msg: msgspec.Struct) -> bytes:
        body = self._encode(msg)
        limit = self.max_frame_bytes
        if limit and len(body) > limit:
            raise BrokerRefused(
                "bad_request",
                f"{type(msg).__name__.lower()} request of {len(body)} bytes exceeds the "
                f"broker's maximum frame of {limit} bytes; split the batch or raise "
                "max_frame_bytes",
            )
        return FRAME_HEADER.pack(len(body)) + body


class Wire:
    """One connection's socket (see the module docstring)."""

    __slots__ = (
        "sock",
        "owed",
        "confirmed_at",
        "frame",
        "_rbuf",
        "_rpos",
        "_rend",
        "_decode",
        "_prefix",
        "_on_owed",
        "_on_caught_up",
        "_on_lost",
        "_hup",
    )

    def __init__(
        self,
        sock: socket.socket,
        framer: Framer,
        prefix: Callable[[], bytes],
        on_owed: Callable[[Any], None],
        on_caught_up: Callable[[], None],
        on_lost: Callable[[bool], None],
    ) -> None:
        self.sock: Any = sock  # None once closed
        self.owed = 0
        self.confirmed_at = time.monotonic()  # the handshake was just answered
        self.frame = framer.frame
        # Receive buffer: frames are parsed in place; [_rpos, _rend) is unread data.
        self._rbuf = bytearray(1 << 16)
        self._rpos = 0
        self._rend = 0
        self._decode = msgspec.msgpack.Decoder(Reply).decode
        self._prefix = prefix
        self._on_owed = on_owed
        self._on_caught_up = on_caught_up
        self._on_lost = on_lost
        self._hup: select.poll | None = None

    # ---------------------------------------------------------------- life

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._rpos = self._rend = 0
        self.owed = 0
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _fail(self, exc: BaseException) -> BrokerUnavailable:
        """Close, tell the session's owner, and return the exception to raise."""
        self.close()
        self._on_lost(isinstance(exc, TimeoutError))
        if isinstance(exc, BrokerUnavailable):
            return exc
        return BrokerUnavailable(f"{type(exc).__name__}: {exc}")

    def wrap(self, wrap: Callable[[Any], Any]) -> None:
        """Replace the socket by ``wrap(socket)`` (instrumentation: tests, benchmarks)."""
        if self.sock is not None:
            self.sock = wrap(self.sock)

    def peer_gone(self) -> bool:
        """True once the broker's end of the connection is closed (one poll(0))."""
        sock = self.sock
        if sock is None:
            return True
        if self._hup is None:
            self._hup = select.poll()
            self._hup.register(sock.fileno(), _HUP)
        return bool(self._hup.poll(0))

    # ---------------------------------------------------------------- sending

    def send(self, data: bytes) -> None:
        sock = self.sock
        if sock is None:
            raise BrokerUnavailable("not connected")
        pre = self._prefix()
        if pre:
            data = pre + data  # in order, before this request
        try:
            sock.sendall(data)
        except OSError as exc:
            raise self._fail(exc) from exc

    def send_posted(self, data: bytes, n: int) -> None:
        """Send ``n`` framed requests without waiting for their replies."""
        self.send(data)
        self.owed += n

    def post(self, msg: msgspec.Struct) -> None:
        """Send without waiting: the reply is read (and handed on) before the next one."""
        self.send(self.frame(msg))
        self.owed += 1

    def call(self, msg: msgspec.Struct) -> Any:
        """One request and its reply; raises BrokerUnavailable or BrokerRefused."""
        reply = self.roundtrip(msg)
        if isinstance(reply, ErrorReply):
            raise BrokerRefused(reply.code, reply.message)
        return reply

    # ---------------------------------------------------------------- reading

    def _read_reply(self) -> Any:
        """Decode the next reply frame; usually one recv_into per reply."""
        sock = self.sock
        if sock is None:
            raise BrokerUnavailable("not connected")
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
                        return self._decode(view[start : start + length])
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

    def read_replies(self, n: int) -> list[Any]:
        """Read the owed replies (handed to on_owed), then ``n`` replies."""
        try:
            if self.owed:
                while self.owed:
                    owed = self._read_reply()
                    self.owed -= 1
                    self._on_owed(owed)
                self._on_caught_up()
            out = [self._read_reply() for _ in range(n)]
        except (OSError, msgspec.MsgspecError, BrokerUnavailable) as exc:
            # The stream position is unknown, so start over; a timeout also trips.
            raise self._fail(exc) from exc
        self.confirmed_at = time.monotonic()
        return out

    def roundtrip(self, msg: msgspec.Struct) -> Any:
        sock = self.sock
        if sock is None or self._rend:
            self.send(self.frame(msg))
            return self.read_replies(1)[0]
        # Fast path (nothing buffered): one send, usually one recv holding the owed
        # replies (a get's posted Release, a put's posted Commit) and then this reply.
        # Whatever is not exactly that is left to the general reader, from where this
        # stopped; the owed replies are decoded, checked and handed on as it would.
        buf = self._rbuf
        decode = self._decode
        pos = 0
        try:
            sock.sendall(self._prefix() + self.frame(msg))
            n = sock.recv_into(buf)
            while n - pos >= 4:
                (length,) = _HEADER_FROM(buf, pos)
                end = pos + 4 + length
                if end > n:
                    break
                if not self.owed:
                    if end != n:
                        break
                    with memoryview(buf) as view:
                        reply = decode(view[pos + 4 : end])
                    self.confirmed_at = time.monotonic()
                    return reply
                with memoryview(buf) as view:
                    owed = decode(view[pos + 4 : end])
                pos = end
                self.owed -= 1
                self._on_owed(owed)
                if not self.owed:
                    self._on_caught_up()
        except (OSError, msgspec.MsgspecError) as exc:
            raise self._fail(exc) from exc
        if n == 0:
            raise self._fail(BrokerUnavailable("the broker closed the connection"))
        # A partial (or longer) reply: the general reader takes over from ``pos``.
        self._rpos, self._rend = (pos, n) if pos < n else (0, 0)
        return self.read_replies(1)[0]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise BrokerUnavailable("the broker closed the connection")
        data += chunk
    return data
