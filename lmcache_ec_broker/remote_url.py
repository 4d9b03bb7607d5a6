"""``remote_url`` in LMCache's style -> where the remote store is and how to reach it.

    redis://[[user]:password@]host[:port][/db]      standalone Redis or Valkey (TCP)
    rediss://...                                    the same over TLS
    valkey://..., valkeys://...                     aliases of redis://, rediss://
    unix://[[user]:password@]/path/redis.sock[?db=N]   a Unix socket
    redis://h1:p1,h2:p2,...  (or redis-cluster://, rediss-cluster://)   Redis Cluster seeds

Several hosts mean a Cluster (the seeds only need to include one reachable
master). No heavy imports: config validation uses this module too.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, field

DEFAULT_PORT = 6379
_SCHEMES = {
    "redis": (False, False),
    "valkey": (False, False),
    "rediss": (True, False),
    "valkeys": (True, False),
    "redis-cluster": (False, True),
    "rediss-cluster": (True, True),
    "valkey-cluster": (False, True),
    "valkeys-cluster": (True, True),
}
PASSWORD_ENV = "LMCACHE_EC_REMOTE_PASSWORD"


@dataclass(frozen=True)
class RemoteTarget:
    hosts: list[tuple[str, int]] = field(default_factory=list)
    unix_path: str = ""
    tls: bool = False
    cluster: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """Where, without credentials (for logs and stats)."""
        if self.unix_path:
            return f"unix://{self.unix_path}" + (f"?db={self.db}" if self.db else "")
        scheme = ("rediss" if self.tls else "redis") + ("-cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


def _split_auth(netloc: str) -> tuple[str | None, str | None, str]:
    if "@" not in netloc:
        return None, None, netloc
    auth, rest = netloc.rsplit("@", 1)
    user, _, password = auth.partition(":")
    return (
        urllib.parse.unquote(user) or None,
        urllib.parse.unquote(password) or None,
        rest,
    )


def _host_port(text: str, url: str) -> tuple[str, int]:
    text = text.strip()
    if not text:
        raise ValueError(f"remote_url {mask_url(url)!r} names an empty host")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ValueError(
            f"remote_url {mask_url(url)!r}: port {port_text!r} is not a number"
        ) from None
    if not 0 < port < 65536:
        raise ValueError(f"remote_url {mask_url(url)!r}: port {port} is out of range")
    return host, port


def parse_remote_url(url: str) -> RemoteTarget:
    """Parse; ValueError names the problem and shows the accepted forms (never the password)."""
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    forms = (
        "redis://host:port[/db], rediss://host:port (TLS), unix:///path/redis.sock, "
        "redis://h1:p1,h2:p2 or redis-cluster://h1:p1,h2:p2 (Cluster); "
        "valkey://, valkeys://, valkey-cluster:// are the same for Valkey; "
        "mooncakestore://master:port for Mooncake Store"
    )
    if not sep:
        raise ValueError(f"remote_url {mask_url(url)!r} has no scheme; use {forms}")
    if scheme == "unix":
        user, password, path_part = _split_auth(rest)
        path, _, query = path_part.partition("?")
        path = urllib.parse.unquote(path)
        if not path.startswith("/"):
            raise ValueError(f"remote_url {mask_url(url)!r} must name an absolute socket path")
        db = 0
        for k, v in urllib.parse.parse_qsl(query):
            if k != "db":
                raise ValueError(f"remote_url: unknown option {k!r} (only db=N)")
            db = _db(v, url)
        return RemoteTarget(unix_path=path, db=db, username=user, password=password)
    if scheme not in _SCHEMES:
        raise ValueError(f"remote_url scheme {scheme!r} is not supported; use {forms}")
    tls, cluster = _SCHEMES[scheme]
    user, password, hostpart = _split_auth(rest.split("/", 1)[0] if "/" in rest else rest)
    path = rest.split("/", 1)[1] if "/" in rest else ""
    if "?" in path or "?" in hostpart:
        raise ValueError(f"remote_url {mask_url(url)!r}: query options are not supported here")
    hosts = [_host_port(h, url) for h in hostpart.split(",")]
    cluster = cluster or len(hosts) > 1
    db = _db(path, url) if path.strip("/") else 0
    if cluster and db:
        raise ValueError("remote_url: Redis Cluster has only database 0; drop the /db part")
    return RemoteTarget(
        hosts=hosts, tls=tls, cluster=cluster, db=db, username=user, password=password
    )


def _db(text: str, url: str) -> int:
    text = text.strip("/")
    try:
        db = int(text)
    except ValueError:
        raise ValueError(
            f"remote_url {mask_url(url)!r}: database {text!r} is not a number"
        ) from None
    if not 0 <= db < 1 << 16:
        raise ValueError(f"remote_url: database {db} is out of range")
    return db


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (user kept), for anything printed.

    The credentials end at the *last* ``@`` before the path: a password may hold
    ``/``, ``@`` and ``:`` unescaped, and whatever it holds must never be shown.
    A Unix socket URL without credentials starts its path right after ``//``.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest or rest.startswith("/"):
        return url
    if scheme.strip().lower() == "unix":
        # unix://[user:pass@]/path: the path starts at the last "@/" ...
        at = rest.rfind("@/")
        at = at if at >= 0 else rest.rfind("@")
    else:
        at = rest.rfind("@")
    auth, hostpart = rest[:at], rest[at + 1 :]
    user, colon, _ = auth.partition(":")
    masked = f"{user}:***" if colon else "***"
    return f"{scheme}://{masked}@{hostpart}"


def resolve_password(target: RemoteTarget, password_file: str | None) -> str | None:
    """URL password, else the file's first line, else $LMCACHE_EC_REMOTE_PASSWORD."""
    if target.password:
        return target.password
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                pw = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(
                f"cannot read remote_password_file {password_file}: {exc.strerror or exc}"
            ) from None
        if not pw:
            raise ValueError(f"remote_password_file {password_file} is empty")
        return pw
    return os.environ.get(PASSWORD_ENV) or None


def read_hmac_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            key = f.read(4097).strip()
    except OSError as exc:
        raise ValueError(
            f"cannot read remote_hmac_key_file {path}: {exc.strerror or exc}"
        ) from None
    if len(key) < 16:
        raise ValueError(
            f"remote_hmac_key_file {path} holds {len(key)} bytes; use at least 16 random bytes "
            "(e.g. head -c 32 /dev/urandom | base64 > FILE)"
        )
    if len(key) > 4096:
        raise ValueError(f"remote_hmac_key_file {path} is larger than 4 KiB")
    return key
