"""A TCP proxy on 127.0.0.1 in front of a real store, for putting faults on the wire:
replies late by ``reply_delay_s`` (a slow or distant store), a command (``hold_s``,
e.g. ``{"SET": 1.5}``: a slow link for large values, or ``{"DEL": 1.0}``) held before
it reaches the store, or the connection carrying the next ``SET`` cut (a lost
connection), or the pub/sub messages a subscriber receives delivered late
(``push_delay_s``: a loaded host's subscriber thread). Order on each connection
is kept: later bytes wait for held ones. Used by the remote-tier tests and by
``benchmarks/remote_faults.py``; everything it reaches is the real server behind it.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import re
import socket
import threading
import time

_SET = b"$3\r\nSET\r\n"
_MESSAGE = b"$7\r\nmessage\r\n"  # a pub/sub push (RESP2 array or RESP3 push)
_NAME = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n")  # a RESP array's command name
_SCAN_START = b"$4\r\nSCAN\r\n$1\r\n0\r\n"  # SCAN from cursor 0: a key listing begins
_SCAN_END = b"*2\r\n$1\r\n0\r\n"  # SCAN's reply with cursor 0: the listing ended


def _command(name: str) -> bytes:
    """How a RESP array names command ``name`` (its first bulk string)."""
    return b"$%d\r\n%s\r\n" % (len(name), name.encode())


class DelayProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.reply_delay_s = 0.0
        # > 0: replies trickle, one byte per trickle_s -- no single gap long enough for a
        # socket timeout, yet the whole reply takes long (a store that is just slow)
        self.trickle_s = 0.0
        self.hold_s: dict[str, float] = {}  # command -> how long to hold it
        self.push_delay_s = 0.0  # pub/sub messages to subscribers: delivered this late
        self.pushes_delivered = 0  # chunks carrying pub/sub messages, delivered
        self.reset_next_set = False
        self.held = 0  # commands held (counter)
        self.sets_cut = 0  # connections cut at a SET
        self.holding = threading.Event()  # a command is being held right now
        # commands forwarded to the store, by upper-case name (counted as they are sent
        # on: tests wait on these counts instead of guessing how long a step takes)
        self.forwarded: collections.Counter[str] = collections.Counter()
        self.scans_started = 0  # key listings begun (SCAN from cursor 0), forwarded
        self.scans_ended = 0  # SCAN replies with cursor 0 (a listing's last page), delivered
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(64)
        self.port = self._listen.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    def url(self, password: str | None = None) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listen.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _cut(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        """Client -> store, holding a command or cutting at a SET."""
        try:
            while True:
                data = client.recv(1 << 20)
                if not data:
                    break
                if _SET in data and self.reset_next_set:
                    self.reset_next_set = False
                    self.sets_cut += 1
                    break
                hold = max(
                    (s for name, s in self.hold_s.items() if _command(name) in data), default=0.0
                )
                if hold > 0:
                    self.held += 1
                    self.holding.set()
                    time.sleep(hold)
                    self.holding.clear()
                server.sendall(data)
                for name in _NAME.findall(data):
                    self.forwarded[name.decode().upper()] += 1
                self.scans_started += data.count(_SCAN_START)
        except OSError:
            pass
        self._cut(client, server)

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        """Store -> client, each chunk delivered ``reply_delay_s`` after it arrived."""
        q: queue.Queue[tuple[float, bytes, bool] | None] = queue.Queue()

        def deliver() -> None:
            try:
                while True:
                    item = q.get()
                    if item is None:
                        break
                    due, data, push = item
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    if self.trickle_s > 0:
                        for i in range(len(data)):
                            time.sleep(self.trickle_s)
                            client.sendall(data[i : i + 1])
                    else:
                        client.sendall(data)
                    self.pushes_delivered += push
                    self.scans_ended += data.startswith(_SCAN_END)
            except OSError:
                pass
            self._cut(client, server)

        threading.Thread(target=deliver, daemon=True).start()
        try:
            while True:
                data = server.recv(1 << 20)
                if not data:
                    break
                push = _MESSAGE in data
                late = self.reply_delay_s + (self.push_delay_s if push else 0.0)
                q.put((time.monotonic() + late, data, push))
        except OSError:
            pass
        q.put(None)
