"""Which uids may serve this client, and the check a listener must pass before
anything is sent to it or mapped from it (SO_PEERCRED, the private socket dir)."""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Collection

from ...peercred import peer_cred
from ...private_dirs import check_private_dir, default_socket_dirs
from .errors import BrokerImpostor

BROKER_UID_ENV = "LMCACHE_EC_BROKER_UID"


def check_peer(sock: socket.socket, socket_path: str, trusted: Collection[int]) -> None:
    """Before sending or mapping anything: is the listener on ``sock`` a broker we trust?
    Raises BrokerImpostor naming the uid otherwise."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    if parent in default_socket_dirs():
        try:
            check_private_dir(parent, trusted)
        except ValueError as exc:
            raise BrokerImpostor(str(exc)) from None
    pid, uid, _gid = peer_cred(sock)
    if uid not in trusted:
        raise BrokerImpostor(
            f"refusing the process on {socket_path}: it runs as uid {uid} "
            f"({_user_name(uid)}, pid {pid}), and only uid "
            f"{', '.join(map(str, sorted(trusted)))} may serve this client. "
            "Another user may be squatting the socket path; if that uid runs your broker, "
            f"pass broker_uid={uid} or set {BROKER_UID_ENV}={uid}"
        )


def trusted_uids(broker_uid: int | str | None = None) -> frozenset[int]:
    """This process's uid, root, and ``broker_uid`` (else $LMCACHE_EC_BROKER_UID), which
    may be a uid or a user name. ValueError names a value that is neither."""
    source = "broker_uid"
    if broker_uid is None or broker_uid == "":
        broker_uid, source = os.environ.get(BROKER_UID_ENV, ""), BROKER_UID_ENV
    uids = {os.getuid(), 0}
    if isinstance(broker_uid, int) and not isinstance(broker_uid, bool):
        if broker_uid < 0:
            raise ValueError(f"{source} must be a uid >= 0 or a user name, got {broker_uid}")
        uids.add(broker_uid)
    elif isinstance(broker_uid, str) and broker_uid.strip():
        text = broker_uid.strip()
        if text.isdigit():
            uids.add(int(text))
        else:
            try:
                uids.add(pwd.getpwnam(text).pw_uid)
            except KeyError:
                raise ValueError(
                    f"{source} = {text!r} is neither a uid nor a known user name; set it to "
                    "the uid the broker runs as (id -u on the broker's side)"
                ) from None
    elif not isinstance(broker_uid, str):
        raise ValueError(f"{source} must be a uid or a user name, got {broker_uid!r}")
    return frozenset(uids)


def _user_name(uid: int) -> str:
    try:
        return "user " + pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"
