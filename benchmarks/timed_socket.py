"""The benchmarks' timed socket: wraps a client's socket to time its sends and waits
(attribution.py and attribution_across.py both use it)."""

from __future__ import annotations

import socket
import time
from typing import Any


class Timers:
    """Accumulated nanoseconds per phase (reset per operation)."""

    def __init__(self) -> None:
        self.send = 0
        self.wait = 0
        self.copy = 0

    def reset(self) -> None:
        self.send = self.wait = self.copy = 0


class TimedSocket:
    """Wraps the client's socket: times sendall and recv_into, forwards the rest."""

    def __init__(self, sock: socket.socket, timers: Timers) -> None:
        self._sock = sock
        self._t = timers

    def sendall(self, data: Any) -> None:
        t0 = time.perf_counter_ns()
        self._sock.sendall(data)
        self._t.send += time.perf_counter_ns() - t0

    def recv_into(self, buf: Any, *args: Any) -> int:
        t0 = time.perf_counter_ns()
        n = self._sock.recv_into(buf, *args)
        self._t.wait += time.perf_counter_ns() - t0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
