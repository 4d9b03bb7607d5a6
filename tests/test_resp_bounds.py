"""The RESP client's bounds on what a server may send (``broker/tiers/redis/resp.py``).

A real redis-server cannot be made to send these replies, so a listener on
127.0.0.1 plays the server's side with canned bytes; the client is the real one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from lmcache_ec_broker.broker.tiers.redis.resp import (
    ConnParams,
    Endpoint,
    ProtocolViolation,
    RespConnection,
)

MAX_REPLY = 16 << 20  # resp.MAX_REPLY: the documented bound


@pytest.fixture
def serve() -> Iterator:
    """serve(data) -> a RespConnection to a listener that sends ``data`` and then stalls."""
    listeners: list[socket.socket] = []
    conns: list[socket.socket] = []

    def start(data: bytes, timeout_s: float = 2.0) -> RespConnection:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        listeners.append(srv)

        def run() -> None:
            c, _ = srv.accept()
            conns.append(c)
            try:
                c.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout) and closed: what some tests check

        threading.Thread(target=run, daemon=True).start()
        return RespConnection(
            Endpoint("127.0.0.1", srv.getsockname()[1]), ConnParams(timeout_s=timeout_s)
        )

    yield start
    for s in listeners + conns:
        s.close()


def test_a_reply_larger_than_the_bound_in_total_is_refused(serve) -> None:
    """Each bulk string under its own limit, the array of them over the total bound."""
    item = 1 << 20
    n = MAX_REPLY // item + 2
    data = b"*%d\r\n" % n + (b"$%d\r\n" % item + b"x" * item + b"\r\n") * n
    conn = serve(data)
    with pytest.raises(ProtocolViolation, match="over"):
        conn.read_reply()
    conn.close()


def test_a_reply_cut_by_a_timeout_leaves_the_connection_out_of_step(serve) -> None:
    """Half a pub/sub message, then silence: the reader times out inside the reply and
    the connection says it is out of step (the subscriber then reconnects instead of
    reading the rest of the message as the next one)."""
    conn = serve(b"*3\r\n$7\r\nmessage\r\n", timeout_s=0.3)
    with pytest.raises(TimeoutError):
        conn.read_reply()
    assert getattr(conn, "partial", False), "the connection does not know it is out of step"
    assert not conn.idle
    conn.close()
