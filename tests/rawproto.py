"""A bare protocol connection for tests that need to misbehave (no BrokerClient)."""

from __future__ import annotations

import socket

import msgspec

from lmcache_ec_broker.protocol import FRAME_HEADER, PROTOCOL_VERSION, Hello, HelloReply, Reply


class RawConn:
    def __init__(self, path: str, hello: bool = True, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(Reply)
        self.hello: HelloReply | None = None
        if hello:
            reply = self.call(Hello(PROTOCOL_VERSION, "raw-test"))
            assert isinstance(reply, HelloReply), reply
            self.hello = reply

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(FRAME_HEADER.pack(len(body)) + body)

    def send(self, msg: msgspec.Struct) -> None:
        self.send_body(self.enc.encode(msg))

    def recv(self):
        """The next reply, or None if the broker closed the connection."""
        header = self._exactly(4)
        if header is None:
            return None
        (n,) = FRAME_HEADER.unpack(header)
        body = self._exactly(n)
        return None if body is None else self.dec.decode(body)

    def call(self, msg: msgspec.Struct):
        self.send(msg)
        return self.recv()

    def _exactly(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()
