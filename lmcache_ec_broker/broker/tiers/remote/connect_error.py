"""Why a remote store cannot be reached, in the operator's words, said once.

A wrong password and a store that is not there used to look the same (one
"unavailable" warning, no reason). ``classify`` names the cause from the exception
a connection attempt raised; ``ConnectTrouble`` logs it once per change of cause
and keeps the last one for ``stats`` (``remote_down_reason``) until a connection
succeeds again. No heavy imports: both transports use it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading

log = logging.getLogger("lmcache_ec_broker.remote")

AUTH_REFUSED = "auth refused"
CONNECTION_REFUSED = "connection refused"
TIMEOUT = "timeout"
TLS = "TLS"
HOST_NOT_FOUND = "host not found"
NO_SOCKET = "no socket at that path"
PERMISSION = "permission denied"
RESET = "connection reset"

# What each cause usually means, for the one log line.
_HINTS = {
    AUTH_REFUSED: "check remote_password_file / the URL's user and password",
    CONNECTION_REFUSED: "nothing listens there: is the store running, on that port?",
    TIMEOUT: "no answer within remote_timeout_s: a firewall, a wrong address, or a store "
    "too busy to accept",
    TLS: "check rediss:// vs redis://, remote_tls_ca_file and the server's certificate",
    HOST_NOT_FOUND: "the host name does not resolve",
    NO_SOCKET: "the Unix socket path does not exist",
    PERMISSION: "this broker's uid may not open the store's socket",
    RESET: "the store closed the connection (maxclients, protected mode, or restarting)",
}
_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password", "invalid username")


def classify(exc: BaseException) -> str:
    """A short cause for a failed connection attempt (a key of _HINTS, or the
    exception's type when none fits)."""
    text = str(exc)
    if any(word.lower() in text.lower() for word in _AUTH_WORDS):
        return AUTH_REFUSED
    if isinstance(exc, ssl.SSLError | ssl.CertificateError) or "handshake" in text.lower():
        return TLS  # a handshake that times out: usually a server not speaking TLS
    if isinstance(exc, TimeoutError | socket.timeout):
        return TIMEOUT
    if isinstance(exc, ConnectionRefusedError):
        return CONNECTION_REFUSED
    if isinstance(exc, socket.gaierror):
        return HOST_NOT_FOUND
    if isinstance(exc, FileNotFoundError):
        return NO_SOCKET
    if isinstance(exc, PermissionError):
        return PERMISSION
    if isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError):
        return RESET
    return type(exc).__name__


class ConnectTrouble:
    """The last connection failure's cause; thread-safe (transport threads report)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._reason = ""

    @property
    def reason(self) -> str:
        return self._reason

    def failed(self, exc: BaseException, node: object = None) -> str:
        """Record a failed attempt; the first of a cause is logged (with the fix)."""
        reason = classify(exc)
        with self._lock:
            new, self._reason = reason != self._reason, reason
        if new:
            at = f" ({node})" if node is not None and str(node) not in self.where else ""
            hint = _HINTS.get(reason, "see the exception")
            log.warning(
                "remote tier: cannot connect to %s%s: %s (%s); %s",
                self.where,
                at,
                reason,
                exc,
                hint,
            )
        return reason

    def ok(self) -> None:
        """A connection succeeded: the next failure is news again."""
        if self._reason:
            with self._lock:
                self._reason = ""
