"""Who may use the broker: peer credentials checked at connect, and who may stop or
clear it.

Admission is decided once per connection from what the kernel recorded at
``connect()`` (``SO_PEERCRED``, ``SO_PEERGROUPS``), never from anything the peer
says. It fails closed: a peer whose credentials cannot be read is refused. The pid
and uid it reads are what the broker's per-process and per-uid limits charge the
connection to (``quotas.py``; the store checks those).
"""

from __future__ import annotations

import socket
import struct

from ..peercred import peer_cred
from ..protocol import ErrorCode, ErrorReply

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


class AccessPolicy:
    def __init__(
        self,
        owner_uid: int,
        allowed_uids: list[int],
        group_gid: int | None,
        max_connections: int,
    ) -> None:
        self.owner_uid = owner_uid
        self.allowed_uids = frozenset(allowed_uids)
        self.group_gid = group_gid
        self.max_connections = max_connections

    def admit(
        self, sock: socket.socket | None, open_connections: int
    ) -> tuple[int, int, ErrorReply | None]:
        """(peer pid or 0, peer uid or -1, refusal or None) for a new connection."""
        if open_connections >= self.max_connections:
            return 0, -1, ErrorReply(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the broker already serves {self.max_connections} connections "
                "(max_connections); close idle clients or raise the limit",
            )
        try:
            if sock is None:
                raise OSError("the event loop does not expose the connection's socket")
            pid, uid, gid = peer_cred(sock)
        except OSError as exc:
            return 0, -1, ErrorReply(
                ErrorCode.PERMISSION_DENIED, f"cannot read the peer's credentials: {exc}"
            )
        # Root is admitted: it bypasses file permissions and can read any process's
        # memory anyway, so refusing it protects nothing.
        if uid in (self.owner_uid, 0) or uid in self.allowed_uids:
            return pid, uid, None
        if self.group_gid is not None and self.group_gid in peer_groups(sock, gid):
            return pid, uid, None
        return pid, uid, ErrorReply(
            ErrorCode.PERMISSION_DENIED,
            f"uid {uid} may not use this broker (owner uid {self.owner_uid}); "
            "add it to allowed_uids or use socket_group",
        )

    def may_shutdown(self, uid: int) -> ErrorReply | None:
        """Only the broker's owner or root may stop it (allowed users and groups may not)."""
        if uid in (self.owner_uid, 0):
            return None
        return ErrorReply(
            ErrorCode.PERMISSION_DENIED,
            f"only the broker's owner (uid {self.owner_uid}) or root may stop it; you are uid {uid}",
        )

    def may_clear(self, uid: int) -> ErrorReply | None:
        """Only the broker's owner or root may empty it: a Clear drops every other
        client's entries (and, with ``shared``, those of every broker sharing the
        remote store). Admitted users and groups may read, write and delete keys."""
        if uid in (self.owner_uid, 0):
            return None
        return ErrorReply(
            ErrorCode.PERMISSION_DENIED,
            f"only the broker's owner (uid {self.owner_uid}) or root may clear it; you are "
            f"uid {uid} (delete the keys you own instead)",
        )


def peer_groups(sock: socket.socket, gid: int) -> set[int]:
    """The peer's primary and supplementary groups, as the kernel saw them at connect.

    The file system admits a group member through any of its groups (usually a
    supplementary one), so the primary gid from SO_PEERCRED alone is not enough.
    """
    groups = {gid}
    try:
        # 1024 bytes (256 groups) is the most Python's getsockopt accepts.
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
    except OSError:
        return groups  # old kernel, or more than 256 groups: primary group only
    groups.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return groups
