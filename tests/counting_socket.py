"""A client's real socket wrapped to count what the client does with it (tests only)."""

from __future__ import annotations


class CountingSocket:
    """Counts sends and round trips: ``waits`` are reads that follow a send (a reply
    may arrive in several reads; a posted request is a send with no read)."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.waits = 0
        self.sends = 0
        self._sent = False

    def sendall(self, data) -> None:
        self.sends += 1
        self._sent = True
        self._sock.sendall(data)

    def recv_into(self, *a):
        self.waits += self._sent
        self._sent = False
        return self._sock.recv_into(*a)

    def __getattr__(self, name):
        return getattr(self._sock, name)
