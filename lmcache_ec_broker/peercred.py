"""Who is at the other end of a connected Unix socket, as the kernel recorded it at
``connect()`` (``SO_PEERCRED``): never anything the peer says. The broker admits
clients by it (``broker/access.py``), a client checks its broker by it
(``connector/client/trust.py``), and ``lmcache-ec-broker stop`` finds the broker's pid by it.
Ground floor: imports nothing of the package."""

from __future__ import annotations

import socket
import struct

PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of ``sock``'s peer; OSError if they cannot be read. The pid is 0
    when the peer lives in another pid namespace."""
    pid, uid, gid = PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    )
    return pid, uid, gid
