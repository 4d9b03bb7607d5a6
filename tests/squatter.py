"""A process squatting a broker's socket path, for the client-trust tests.

    python squatter.py SOCKET SEGMENT [--uid UID] [--segment-owner UID] [--announce-size N]

Creates SEGMENT (1 MiB of 0xAB), optionally hands it to --segment-owner, then
(after every import, as the interpreter may live where another uid cannot read)
becomes --uid, binds SOCKET and answers like a broker: every put reserved at
offset 0, every key a hit whose bytes are its own. Prints ``ready`` once
listening. On SIGTERM it prints one JSON line: connections accepted and request
frames received (those still in the kernel's queues included), then exits (the test
unlinks the segment).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import sys

import msgspec
import posix_ipc

from lmcache_ec_broker.protocol import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    EntryInfo,
    Get,
    GetReply,
    Has,
    HasReply,
    Hello,
    HelloReply,
    Hit,
    Lookup,
    LookupReply,
    LookupState,
    OkReply,
    Ping,
    PongReply,
    Request,
    Reserve,
    ReserveReply,
    ReserveStatus,
)

SIZE = 1 << 20
FILL = 0xAB


def split_frames(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete frames' bodies at the start of ``buf``, and the rest."""
    bodies = []
    while len(buf) >= 4 and len(buf) >= 4 + FRAME_HEADER.unpack_from(buf)[0]:
        (n,) = FRAME_HEADER.unpack_from(buf)
        bodies.append(buf[4 : 4 + n])
        buf = buf[4 + n :]
    return bodies, buf


def answer(msg: object, segment: str, announce: int) -> msgspec.Struct:
    if isinstance(msg, Hello):
        return HelloReply(
            PROTOCOL_VERSION, segment, announce, 4096, "squatter", os.getpid(), 1 << 20
        )
    if isinstance(msg, Reserve):
        return ReserveReply(ReserveStatus.RESERVED, 1, [(0, msg.nbytes)])
    if isinstance(msg, Has):
        return HasReply([True] * len(msg.keys))
    if isinstance(msg, Lookup):
        return LookupReply([EntryInfo(LookupState.READY, "uint8", [64])] * len(msg.keys))
    if isinstance(msg, Get):
        return GetReply([Hit(1, 64, "uint8", [64], [(0, 64)]) for _ in msg.keys])
    if isinstance(msg, Ping):
        return PongReply("squatter")
    return OkReply()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("segment")
    ap.add_argument("--uid", type=int)
    ap.add_argument("--segment-owner", type=int)
    ap.add_argument("--announce-size", type=int, default=SIZE, help="segment size told to clients")
    args = ap.parse_args()

    shm = posix_ipc.SharedMemory(args.segment, posix_ipc.O_CREX, mode=0o666, size=SIZE)
    os.write(shm.fd, bytes([FILL]) * SIZE)
    if args.segment_owner is not None:
        os.fchown(shm.fd, args.segment_owner, -1)
    shm.close_fd()
    if args.uid is not None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(args.uid)

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(args.socket)
    srv.listen(16)
    stats = {"uid": os.getuid(), "connections": 0, "frames": 0}

    def stop(*_: object) -> None:
        # Count what the kernel already holds for us, whether or not this process ran
        # since: connections still in the listen backlog (a client may connect, be
        # refused and close before a loaded host schedules us) and bytes not read yet.
        srv.setblocking(False)
        while True:
            try:
                conn, _addr = srv.accept()
            except OSError:
                break
            stats["connections"] += 1
            bufs[conn] = b""
        for conn, buf in bufs.items():
            conn.setblocking(False)
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    break
                if not data:
                    break
                buf += data
            stats["frames"] += len(split_frames(buf)[0])
        print(json.dumps(stats), flush=True)
        srv.close()
        os.unlink(args.socket)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Request)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    bufs: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is srv:
                conn, _addr = srv.accept()
                stats["connections"] += 1
                bufs[conn] = b""
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = s.recv(1 << 16)
            except ConnectionResetError:  # the client closed with our replies unread
                data = b""
            if not data:
                sel.unregister(s)
                bufs.pop(s, None)
                s.close()
                continue
            bodies, buf = split_frames(bufs[s] + data)
            for frame in bodies:
                msg = dec.decode(frame)
                stats["frames"] += 1
                body = enc.encode(answer(msg, args.segment, args.announce_size))
                s.sendall(FRAME_HEADER.pack(len(body)) + body)
            bufs[s] = buf


if __name__ == "__main__":
    main()
