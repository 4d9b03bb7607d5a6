"""The broker's one typed configuration, and how sizes and paths are parsed."""

from __future__ import annotations

import logging
import os
import re
import stat
import urllib.parse
from collections.abc import Collection

import msgspec

from .config_lmcache import LMCACHE_KEYS, closest, did_you_mean

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

SOCKET_ENV = "LMCACHE_EC_BROKER_SOCKET"


def private_socket_dir() -> str:
    """The per-user directory of the default socket when there is no XDG_RUNTIME_DIR."""
    return f"/tmp/lmcache-ec-broker-{os.getuid()}"


def default_socket_path() -> str:
    """$LMCACHE_EC_BROKER_SOCKET, else $XDG_RUNTIME_DIR/lmcache-ec-broker.sock,
    else /tmp/lmcache-ec-broker-<uid>/broker.sock (a directory only that user may write:
    a socket directly in world-writable /tmp could be bound first by another user)."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "lmcache-ec-broker.sock")
    return os.path.join(private_socket_dir(), "broker.sock")


def check_private_dir(path: str, owners: Collection[int] | None = None) -> None:
    """Refuse a socket directory another user could have prepared: it must be a real
    directory (not a symlink), owned by one of ``owners`` (default: this uid), that no
    one else may write to. Raises ValueError naming the problem and the fix."""
    allowed = {os.getuid()} if owners is None else set(owners)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"cannot inspect the socket directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"{path} is not a directory (a symlink or a file); another user may have put it "
            "there to intercept the broker's socket. Remove it, or choose a socket path with "
            f"--socket / {SOCKET_ENV}"
        )
    if st.st_uid not in allowed:
        raise ValueError(
            f"the socket directory {path} belongs to uid {st.st_uid}, not to uid "
            f"{' or '.join(map(str, sorted(allowed)))}; another user may have created it to "
            "intercept the broker's socket. Remove it (as root), or choose a socket path with "
            f"--socket / {SOCKET_ENV}"
        )
    if st.st_mode & 0o022:
        raise ValueError(
            f"the socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
            f"can replace the socket in it. Run chmod 700 {path}"
        )


def ensure_private_dir(path: str) -> None:
    """Create ``path`` with mode 0700 if it is missing, then check it (check_private_dir).
    The broker calls this for the default socket directory before binding."""
    try:
        os.mkdir(path, 0o700)  # the umask can only narrow it
    except FileExistsError:
        pass
    except OSError as exc:
        raise ValueError(f"cannot create the socket directory {path}: {exc.strerror}") from None
    check_private_dir(path)


def ensure_socket_dir(socket_path: str, socket_mode: int = 0o600, gid: int | None = None) -> None:
    """For a socket in its per-user default directory: create and check that directory.
    Another path is the operator's choice: an existing directory is left as it is; a
    missing one (its parent must exist) is created, owned by this user, searchable
    only by whom ``socket_mode`` admits (group, with ``gid``; others)."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    if parent == private_socket_dir():
        ensure_private_dir(parent)
        return
    if os.path.isdir(parent):
        return
    mode = 0o700 | (0o050 if socket_mode & 0o060 else 0) | (0o005 if socket_mode & 0o006 else 0)
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        return  # made meanwhile (another start): claim_socket_path checks the rest
    except OSError as exc:
        raise ValueError(
            f"the socket's directory {parent} does not exist and cannot be created "
            f"({exc.strerror}); create it for uid {os.getuid()}, e.g. "
            f"sudo install -d -o {os.getuid()} -m 0700 {parent}"
        ) from None
    if gid is not None:
        os.chown(parent, -1, gid)
    os.chmod(parent, mode)  # after chown: never more open than it ends up
    log.info("created the socket directory %s (mode %04o)", parent, mode)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt](?:ib?|b)?|b)?\s*$", re.IGNORECASE)
_BINARY = {"b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def _unit_bytes(unit: str) -> int:
    """KiB/Ki/K and friends are powers of 1024; KB, MB, GB, TB are powers of 1000, as
    written (a '2GB' slab is 2,000,000,000 bytes, never silently 2 GiB)."""
    u = unit.lower()
    if len(u) == 2 and u[1] == "b" and u[0] in _POWER:
        return 1000 ** _POWER[u[0]]
    return _BINARY[u[0]]


def parse_size(value: str | int | float, plain_unit: int = GiB) -> int:
    """'512MiB', '2GiB', '64k' (binary), '2GB' (decimal: 2 * 10**9), or a plain number of
    ``plain_unit`` (GiB by default)."""
    if isinstance(value, bool):
        raise ValueError(f"size must be a number or a string like 512MiB, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return int(value * plain_unit)
    if str(value).strip().startswith("-"):
        raise ValueError(f"size must not be negative, got {value!r}")
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(
            f"cannot parse size {value!r}; use e.g. 512MiB, 2GiB (binary), 2GB (decimal) "
            "or a plain number of GiB"
        )
    number, unit = float(m.group(1)), m.group(2)
    mult = plain_unit if unit is None else _unit_bytes(unit)
    return int(number * mult)


def format_size(nbytes: int | float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


class BrokerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    socket_path: str = msgspec.field(default_factory=default_socket_path)
    shm_size: int = 2 * GiB
    block_size: int = 64 * KiB
    max_entry_size: int = 0  # 0: the whole slab
    max_key_length: int = 1024
    max_frame_bytes: int = 1 * MiB
    max_connections: int = 1024
    socket_mode: int = 0o600
    socket_group: str | None = None
    allowed_uids: list[int] = []
    local_disk: str | None = None
    max_local_disk_size: int = 0
    # Seconds a stopping broker spends flushing write-behinds to its lower tiers;
    # keep it below the supervisor's stop timeout (systemd/Kubernetes: 30 s).
    shutdown_flush_s: float = 20.0
    metrics_port: int = 0
    # Address the Prometheus endpoint binds: local only unless set (0.0.0.0: all, for
    # a cluster's scraper), as events_host.
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    # Remote tier (Redis/Valkey; off unless remote_url is set). See docs/scaling.md.
    remote_url: str | None = None
    remote_key_prefix: str = "lmcache-ec:"
    remote_ttl_s: int = 0  # 0: no expiry (the store's maxmemory-policy evicts)
    remote_timeout_s: float = 1.0
    remote_write_queue: int = 64  # queued write-behinds; more are dropped (counted)
    remote_filter_keys: int = 100_000  # remote keys folded into the membership filter
    remote_password_file: str | None = None
    remote_hmac_key_file: str | None = None
    remote_tls_ca_file: str | None = None
    # Mooncake Store backend (remote_url: mooncakestore://<master host:port>); docs/mooncake.md.
    mooncake_local_hostname: str = ""  # address other nodes reach this broker at; "": hostname
    mooncake_metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata, etcd://...
    mooncake_protocol: str = "tcp"  # tcp or rdma
    mooncake_device_name: str = ""  # RDMA device(s), e.g. mlx5_0 (rdma only)
    mooncake_global_segment_size: int = 1 * GiB  # memory this broker lends the Mooncake pool
    mooncake_local_buffer_size: int = 16 * MiB  # Mooncake's own transfer buffer
    mooncake_admin_port: int = 9003  # the master's metrics/admin port (lists keys for the filter)
    mooncake_key_poll_s: float = 5.0  # how often the store's keys are folded in; 0: never
    # What one connection may hold at once (a client that never releases is refused,
    # not allowed to grow the broker's memory): get() pins and has()/lookup() leases.
    max_pins_per_connection: int = 65536
    max_leases_per_connection: int = 65536
    # Slab a connection may hold ahead of time for puts that wait for no round trip
    # (docs/design.md "Put arenas"); all arenas together take at most a quarter of the
    # slab. 0: every put reserves (one round trip).
    put_arena_bytes: int = 8 * MiB
    # Slab one connection's open reservations (reserved, not yet committed or aborted)
    # may hold; a connection holding none may still reserve any entry the slab takes.
    # 0: a quarter of the slab. Bounds what one client holding reservations evicts.
    max_reserved_bytes_per_connection: int = 0
    # Residency events and lookup (docs/events.md), off by default. The ZMQ PUB socket
    # binds events_host:events_port, its replay/snapshot ROUTER events_port + 1.
    events_port: int = 0  # 0: no events
    events_host: str = "127.0.0.1"  # like metrics: local only unless set (0.0.0.0: all)
    events_node: str = ""  # node name in the topics; "": this host's name
    events_queue: int = 1024  # batches waiting for the publisher thread; more are dropped
    events_replay: int = 10_000  # batches kept for replay requests
    events_heartbeat_s: float = 1.0  # a heartbeat batch (with the epoch) this often
    events_lookup_port: int = 0  # HTTP/JSON lookup of this broker's residency; 0: off

    def validate(self) -> None:
        """Raise ValueError naming the first invalid value."""
        if self.shm_size <= 0:
            raise ValueError(f"shm_size must be positive, got {self.shm_size}")
        if self.block_size < 4096 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two >= 4 KiB, got {self.block_size} bytes; "
                "use e.g. 64KiB (KB, MB, GB are decimal units)"
            )
        if self.block_size > self.shm_size:
            raise ValueError("block_size is larger than shm_size")
        if self.max_entry_size < 0:
            raise ValueError("max_entry_size must not be negative")
        if self.max_entry_size > self.shm_size:
            raise ValueError(
                f"max_entry_size ({format_size(self.max_entry_size)}) is larger than shm_size "
                f"({format_size(self.shm_size)}); an entry must fit in the slab"
            )
        if not 1 <= self.max_key_length <= 64 * KiB:
            raise ValueError("max_key_length must be between 1 and 65536")
        if not 4 * KiB <= self.max_frame_bytes <= 64 * MiB:
            # The broker buffers a whole frame per connection before decoding it.
            raise ValueError(
                f"max_frame_bytes must be between 4 KiB and 64 MiB, got {self.max_frame_bytes}"
            )
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(
                f"socket_mode must be an octal permission like 0o660, got {self.socket_mode}"
            )
        if self.max_local_disk_size < 0:
            raise ValueError("max_local_disk_size must not be negative")
        if not 0 <= self.shutdown_flush_s <= 3600:
            raise ValueError(
                f"shutdown_flush_s must be between 0 and 3600 seconds, got {self.shutdown_flush_s}"
            )
        if self.local_disk is not None:
            if not os.path.isabs(self.local_disk):
                raise ValueError(f"local_disk must be an absolute path, got {self.local_disk!r}")
            if self.max_local_disk_size <= 0:
                raise ValueError(
                    "local_disk is set but max_local_disk_size is 0; give the disk tier a "
                    "capacity, e.g. max_local_disk_size: 16 (GiB) or '512MiB'"
                )
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")
        check_bind_host("metrics_host", self.metrics_host)
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(
                f"log_level {self.log_level!r} is not a log level; use one of "
                f"{', '.join(LOG_LEVELS)}"
            )
        if self.max_pins_per_connection < 1 or self.max_leases_per_connection < 1:
            raise ValueError("max_pins_per_connection and max_leases_per_connection must be >= 1")
        # Larger values are fine: every arena is capped at a quarter of the slab anyway.
        if self.put_arena_bytes != 0 and self.put_arena_bytes < self.block_size:
            raise ValueError(
                f"put_arena_bytes must be 0 (off) or at least block_size ({self.block_size}), "
                f"got {self.put_arena_bytes}"
            )
        if self.max_reserved_bytes_per_connection != 0 and not (
            self.block_size <= self.max_reserved_bytes_per_connection <= self.shm_size
        ):
            raise ValueError(
                "max_reserved_bytes_per_connection must be 0 (a quarter of the slab) or "
                f"between block_size ({format_size(self.block_size)}) and shm_size "
                f"({format_size(self.shm_size)}), got {self.max_reserved_bytes_per_connection}"
            )
        self._validate_access()
        self._validate_remote()
        from .config_events import validate_events

        validate_events(self)
        self._refuse_ignored_settings()

    def _validate_access(self) -> None:
        """Invariant: every principal the config admits can also pass the file
        permissions of the socket and segment (connect and map need read+write)."""
        group_rw = self.socket_mode & 0o060 == 0o060
        other_rw = self.socket_mode & 0o006 == 0o006
        mode = f"{self.socket_mode:04o}"
        if self.socket_group is not None and not group_rw:
            raise ValueError(
                f"socket_group {self.socket_group!r} cannot use the broker: socket_mode {mode} "
                "gives its group no read and write access; set socket_mode 0660"
            )
        if self.allowed_uids and not other_rw and not (self.socket_group and group_rw):
            raise ValueError(
                f"allowed_uids {','.join(map(str, self.allowed_uids))} cannot connect: "
                f"socket_mode {mode} lets no other user open the socket; set socket_mode 0666 "
                "(the broker still refuses uids it does not admit), or put those users in a "
                "socket_group with socket_mode 0660"
            )

    def _refuse_ignored_settings(self) -> None:
        """A setting the chosen remote backend would silently ignore is refused: every
        key must do something. With the remote tier off (no remote_url) its settings
        are left alone, so unsetting remote_url alone turns the tier off."""
        url = (self.remote_url or "").strip().lower()
        if not url:
            return
        default = BrokerConfig()
        changed = {n for n in _BACKEND_KEYS if getattr(self, n) != getattr(default, n)}
        if url.startswith("mooncakestore://"):
            used: frozenset[str] = _SHARED_REMOTE_KEYS | _MOONCAKE_KEYS
            backend = "the Mooncake backend (remote_url mooncakestore://)"
        else:
            used = _SHARED_REMOTE_KEYS | _REDIS_KEYS
            if not url.startswith(("rediss", "valkeys")):
                used -= {"remote_tls_ca_file"}
            backend = "the Redis/Valkey backend" + (
                "" if "remote_tls_ca_file" in used else " without TLS (use rediss:// for TLS)"
            )
        unused = sorted(changed - used)
        if unused:
            raise ValueError(
                f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} set but {backend} "
                "does not use it; remove it"
            )

    def _validate_remote(self) -> None:
        if not self.remote_url:
            return
        if self.remote_url.strip().lower().startswith("mooncakestore://"):
            from .config_mooncake import validate_mooncake

            validate_mooncake(self)  # the Mooncake backend checks its own settings
            return
        from .remote_url import parse_remote_url, read_hmac_key, resolve_password

        _refuse_raw_slash_in_password(self.remote_url)
        target = parse_remote_url(self.remote_url)
        resolve_password(target, self.remote_password_file)
        if self.remote_hmac_key_file:
            read_hmac_key(self.remote_hmac_key_file)
        if self.remote_tls_ca_file and not os.path.isfile(self.remote_tls_ca_file):
            raise ValueError(f"remote_tls_ca_file {self.remote_tls_ca_file} is not a file")
        if not 0 < self.remote_timeout_s <= 600:
            raise ValueError(f"remote_timeout_s must be in (0, 600], got {self.remote_timeout_s}")
        if self.remote_ttl_s < 0:
            raise ValueError("remote_ttl_s must not be negative (0: no expiry)")
        if self.remote_write_queue < 1:
            raise ValueError("remote_write_queue must be at least 1")
        if self.remote_filter_keys < 0:
            raise ValueError("remote_filter_keys must not be negative (0: fold none)")
        if not 0 < len(self.remote_key_prefix) <= 256 or any(
            c.isspace() for c in self.remote_key_prefix
        ):
            raise ValueError(
                f"remote_key_prefix must be 1-256 characters without spaces, "
                f"got {self.remote_key_prefix!r}"
            )


def check_bind_host(name: str, host: str) -> None:
    """An address to bind a TCP listener to: a host name or an IP literal, nothing else."""
    if not host or any(c.isspace() or c in "/*[]" for c in host):
        raise ValueError(
            f"{name} must be an address to bind, e.g. 127.0.0.1 (this host only), 0.0.0.0 "
            f"(every IPv4 address), :: (every address), got {host!r}"
        )


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Remote-tier settings by the backend that reads them (anything else set is refused).
_SHARED_REMOTE_KEYS = frozenset(
    {
        "remote_key_prefix",
        "remote_timeout_s",
        "remote_write_queue",
        "remote_filter_keys",
        "remote_hmac_key_file",
    }
)
_REDIS_KEYS = frozenset({"remote_ttl_s", "remote_password_file", "remote_tls_ca_file"})
_MOONCAKE_KEYS = frozenset(
    {
        "mooncake_local_hostname",
        "mooncake_metadata_server",
        "mooncake_protocol",
        "mooncake_device_name",
        "mooncake_global_segment_size",
        "mooncake_local_buffer_size",
        "mooncake_admin_port",
        "mooncake_key_poll_s",
    }
)
_BACKEND_KEYS = _SHARED_REMOTE_KEYS | _REDIS_KEYS | _MOONCAKE_KEYS


def _refuse_raw_slash_in_password(url: str) -> None:
    """A '/' in a URL's password ends its authority early, so the parser would read
    part of the password as a host or port and echo it in its error. Refuse first,
    without showing any of it."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() == "unix" or rest.startswith("/") or "@" not in rest:
        return
    if "@" not in rest.split("/", 1)[0]:
        from .remote_url import mask_url

        raise ValueError(
            f"remote_url {mask_url(url)!r}: its password contains '/'; percent-encode it "
            "(%2F, and %40 for '@') or move the password to remote_password_file"
        )


ENV_PREFIX = "LMCACHE_EC_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
# LMCache keys that name one of our fields differently.
_ALIASES = {"max_local_cpu_size": "shm_size"}
# Environment variables of this project that are not settings: read by the clients
# (socket, broker uid), the remote tier (password) and the test harness. Any other
# LMCACHE_EC_* variable must name a setting (unknown_env_error).
OTHER_ENV = frozenset(
    {
        SOCKET_ENV,
        "LMCACHE_EC_BROKER_UID",
        "LMCACHE_EC_REMOTE_PASSWORD",
        "LMCACHE_EC_VLLM_LOCK",
        "LMCACHE_EC_FAULT_FILE",
        "LMCACHE_EC_VLLM_NEXT_SRC",
    }
)
OTHER_ENV_PREFIXES = ("LMCACHE_EC_TEST_", "LMCACHE_EC_KEEP_")
# Keys earlier releases accepted but never used; old files and environments still
# start, with a warning that says what to do instead.
_RETIRED = {
    "lease_ms": "the lease a vLLM instance takes on a hit is set per instance, in "
    "ec_connector_extra_config's lease_ms",
    "prefault": "the broker always pre-faults its slab at start",
}
# Plain numbers (YAML, environment) are GiB for capacities, as in LMCache, and bytes for the rest.
_GIB_SIZES = frozenset({"shm_size", "max_local_disk_size"})
_BYTE_SIZES = frozenset(
    {
        "block_size",
        "max_entry_size",
        "max_frame_bytes",
        "put_arena_bytes",
        "max_reserved_bytes_per_connection",
        "mooncake_global_segment_size",
        "mooncake_local_buffer_size",
    }
)
# Every size-valued field (--print-config shows them as sizes).
SIZE_FIELDS = _GIB_SIZES | _BYTE_SIZES
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

log = logging.getLogger("lmcache_ec_broker.config")


def normalize_local_disk(value: str | None) -> str | None:
    """A ``file://`` URL or a path -> an absolute path; '' and None -> None (no disk tier)."""
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        return None
    if "://" in value:
        url = urllib.parse.urlparse(value)
        if url.scheme != "file":
            raise ValueError(
                f"local_disk {value!r} uses the unsupported URL scheme {url.scheme!r}; "
                "use a directory path or a file:///absolute/path URL"
            )
        if url.netloc not in ("", "localhost"):
            raise ValueError(
                f"local_disk {value!r} names host {url.netloc!r}; only local directories are "
                "supported (file:///absolute/path)"
            )
        value = urllib.parse.unquote(url.path)
        if not value.startswith("/"):
            raise ValueError(f"local_disk URL must name an absolute path, got {value!r}")
    if "\0" in value:
        raise ValueError("local_disk contains a NUL byte")
    return os.path.abspath(os.path.expanduser(value))


def check_local_disk(path: str) -> None:
    """Refuse a disk-tier directory the broker could not use, before anything is created."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"local_disk {path} exists and is not a directory")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise ValueError(
                f"local_disk {path} is not readable and writable by uid {os.getuid()}; "
                "fix its permissions or choose another directory"
            )
        return
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"local_disk {path} does not exist and cannot be created: {parent or '/'} is not a "
            f"writable directory for uid {os.getuid()}"
        )


def _coerce(name: str, raw: object, ftype: object, from_text: bool) -> object:
    """One value from YAML or the environment -> the field's type; ValueError says why."""
    if name == "local_disk":
        return normalize_local_disk(None if raw is None else str(raw))
    if name in _GIB_SIZES or name in _BYTE_SIZES:
        return parse_size(raw, GiB if name in _GIB_SIZES else 1)  # type: ignore[arg-type]
    if name == "socket_mode" and isinstance(raw, str):
        try:
            return int(raw.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"{raw!r} is not an octal mode like 0660") from None
    if ftype is bool and isinstance(raw, str):
        low = raw.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(f"{raw!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
    if from_text and isinstance(raw, str) and getattr(ftype, "__origin__", None) is list:
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    elif getattr(ftype, "__origin__", None) is list and not isinstance(raw, list):
        raw = [raw]
    try:
        return msgspec.convert(raw, ftype, strict=False)  # type: ignore[arg-type]
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def _field_for(key: str) -> str:
    return _ALIASES.get(key, key)


def _read_yaml(path: str) -> dict[str, object]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"config file {path} must be a mapping of option names to values")
    return data


def _yaml_keys(path: str) -> list[tuple[str, bool, str, object]]:
    """(key as written, ec_-prefixed, bare name, value) for each key of the file;
    LMCache's nested ``ec:`` map counts as ``ec_``-prefixed keys (shown ``ec.<key>``)."""
    out: list[tuple[str, bool, str, object]] = []
    for key, value in _read_yaml(path).items():
        if key == "ec" and isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ValueError(f"config file {path}: the keys under ec: must be option names")
            out += [(f"ec.{k}", True, k, v) for k, v in value.items()]
        elif key.startswith("ec_"):
            out.append((key, True, key[3:], value))
        else:
            out.append((key, False, key, value))
    return out


def _yaml_layers(
    path: str, fields: dict[str, object]
) -> tuple[dict[str, tuple[object, str]], dict[str, tuple[object, str]], list[str], list[str]]:
    """(plain layer, ec_ layer, unknown keys, LMCache keys without a use here); each
    layer maps field -> (raw value, source)."""
    plain: dict[str, tuple[object, str]] = {}
    prefixed: dict[str, tuple[object, str]] = {}
    unknown: list[str] = []
    unused: list[str] = []
    for key, is_prefixed, bare, value in _yaml_keys(path):
        layer = prefixed if is_prefixed else plain
        if bare in _RETIRED:
            _warn_retired(bare, f"config {path}: {key}")
            continue
        name = _field_for(bare)
        if name not in fields:
            if bare in LMCACHE_KEYS:
                unused.append(key)
                if bare == "local_cpu" and value is False:
                    log.warning(
                        "config %s: local_cpu: false is ignored; the encoder cache always "
                        "keeps entries in the shared-memory slab",
                        path,
                    )
            else:
                unknown.append(key)
            continue
        if name in layer:
            raise ValueError(
                f"config file {path} sets {name} twice ({layer[name][1].split(': ')[-1]} and "
                f"{key}); keep one of them"
            )
        layer[name] = (value, f"yaml {path}: {key}")
    return plain, prefixed, unknown, unused


def describe_unknown(unknown: list[str], known: list[str]) -> str:
    """'unknown key X (did you mean Y?)', naming the closest known key for each
    misspelling instead of listing every key."""
    parts = []
    for key in sorted(unknown):
        prefix = "ec_" if key.startswith("ec_") else "ec." if key.startswith("ec.") else ""
        bare = key.removeprefix(prefix)
        match = closest(bare, known)
        parts.append(f"{key} (did you mean {prefix}{match}?)" if match else key)
    noun = "unknown key" if len(parts) == 1 else "unknown keys"
    return (
        f"{noun} {', '.join(parts)}; fix or remove {'it' if len(parts) == 1 else 'them'} "
        "(`lmcache-ec-broker start --print-config` lists the broker's settings)"
    )


def _env_names(fields: dict[str, object]) -> tuple[list[str], list[str]]:
    """(unknown, LMCache-only) LMCACHE_EC_* variables: every other one names a setting,
    an alias or a retired key, or is one of OTHER_ENV (LMCache reads LMCACHE_EC_<its
    key> as its own encoder-cache override, so those are LMCache's, not typos)."""
    ours = {ENV_PREFIX + n.upper() for n in (*fields, *_ALIASES, *_RETIRED)}
    unknown: list[str] = []
    unused: list[str] = []
    for var in sorted(os.environ):
        if not var.startswith(ENV_PREFIX) or var in ours or var in OTHER_ENV:
            continue
        if var.startswith(OTHER_ENV_PREFIXES):
            continue
        if var[len(ENV_PREFIX) :].lower() in LMCACHE_KEYS:
            unused.append(var)
        else:
            unknown.append(var)
    return unknown, unused


def unknown_env_error(unknown: list[str], fields: dict[str, object]) -> ValueError:
    """The refusal of misspelt LMCACHE_EC_* variables, each with the closest setting's."""
    known = [ENV_PREFIX + n.upper() for n in (*fields, *_ALIASES)] + sorted(OTHER_ENV)
    named = ", ".join(did_you_mean(var, known) for var in unknown)
    what = "variable" if len(unknown) == 1 else "variables"
    return ValueError(
        f"environment {what} {named}: not a broker setting; fix the name or unset it "
        f"(every setting is {ENV_PREFIX}<NAME> of a name `lmcache-ec-broker start "
        "--print-config` lists)"
    )


def _note_lmcache_only(parts: list[str]) -> None:
    """One info line naming every LMCache setting given that the encoder cache does not use."""
    if parts:
        log.info(
            "LMCache settings without a use in the encoder-cache broker, accepted and "
            "ignored: %s",
            "; ".join(parts),
        )


def _warn_retired(name: str, where: str) -> None:
    log.warning(
        "%s is ignored: %s is no longer a broker setting (it never had an effect); %s. "
        "Remove it.",
        where,
        name,
        _RETIRED[name],
    )


def _env_layer(fields: dict[str, object]) -> dict[str, tuple[object, str]]:
    layer: dict[str, tuple[object, str]] = {}
    for name in _RETIRED:
        if ENV_PREFIX + name.upper() in os.environ:
            _warn_retired(name, f"environment variable {ENV_PREFIX + name.upper()}")
    names = [(f, f) for f in fields] + [(a, f) for a, f in _ALIASES.items()]
    for key, name in names:
        var = ENV_PREFIX + key.upper()
        if var not in os.environ:
            continue
        if name in layer:
            raise ValueError(f"both {layer[name][1][4:]} and {var} are set; unset one of them")
        layer[name] = (os.environ[var], f"env {var}")
    # The socket variable the clients also read; the field-named variable wins over it.
    if "socket_path" in fields and "socket_path" not in layer and os.environ.get(SOCKET_ENV):
        layer["socket_path"] = (os.environ[SOCKET_ENV], f"env {SOCKET_ENV}")
    return layer


def _with_source(exc: ValueError, sources: dict[str, str]) -> ValueError:
    """Name where the offending value came from, so the user knows which layer to fix."""
    msg = str(exc)
    named = [f"{n} from {src}" for n, src in sources.items() if src != "default" and n in msg]
    return ValueError(f"{msg} ({'; '.join(named)})" if named else msg)


def load_config(
    cli: dict[str, object] | None = None, config_file: str | None = None
) -> tuple[BrokerConfig, dict[str, str]]:
    """The effective configuration and, per field, where its value came from.

    Precedence, highest first: CLI flags > ``LMCACHE_EC_<FIELD>`` environment >
    ``ec_``-prefixed YAML keys > plain YAML keys (LMCache's names accepted) > defaults.
    The YAML file is ``config_file`` (``--config``), else ``$LMCACHE_CONFIG_FILE``.
    Raises ValueError, naming the value and its source, before anything is created.
    """
    fields = {f.name: f.type for f in msgspec.structs.fields(BrokerConfig)}
    config_file = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    plain: dict[str, tuple[object, str]] = {}
    prefixed: dict[str, tuple[object, str]] = {}
    unused: list[str] = []
    if config_file:
        plain, prefixed, unknown, unused = _yaml_layers(config_file, fields)
        if unknown:
            known = [*fields, *_ALIASES, *_RETIRED, *LMCACHE_KEYS]
            raise ValueError(f"config file {config_file}: {describe_unknown(unknown, known)}")
    env_unknown, env_unused = _env_names(fields)
    if env_unknown:
        raise unknown_env_error(env_unknown, fields)
    _note_lmcache_only(
        ([f"{', '.join(unused)} (config {config_file})"] if unused else [])
        + ([f"{', '.join(env_unused)} (environment)"] if env_unused else [])
    )
    env = _env_layer(fields)
    values: dict[str, object] = {}
    sources = {name: "default" for name in fields}
    for layer in (plain, prefixed, env):
        for name, (raw, source) in layer.items():
            try:
                values[name] = _coerce(name, raw, fields[name], source.startswith("env "))
            except ValueError as exc:
                shown = _mask(raw) if name == "remote_url" else raw
                raise ValueError(f"{name} = {shown!r} from {source}: {exc}") from None
            sources[name] = source
    for name, value in (cli or {}).items():
        if value is None:
            continue
        if name == "local_disk":
            try:
                value = normalize_local_disk(str(value))
            except ValueError as exc:
                raise ValueError(f"--local-disk: {exc}") from None
        values[name] = value
        sources[name] = "cli"
    try:
        cfg = msgspec.convert(values, BrokerConfig)
    except msgspec.ValidationError as exc:
        raise _with_source(ValueError(str(exc)), sources) from None
    try:
        cfg.validate()
        if cfg.local_disk:
            check_local_disk(cfg.local_disk)
    except ValueError as exc:
        raise _with_source(exc, sources) from None
    if sources.get("remote_url") == "cli" and cfg.remote_url and _mask(cfg.remote_url) != cfg.remote_url:
        raise ValueError(
            "--remote-url carries a password, which every user can read in the process list; "
            "put it in remote_password_file, $LMCACHE_EC_REMOTE_PASSWORD, or the YAML/env URL"
        )
    return cfg, sources


def _mask(raw: object) -> object:
    from .remote_url import mask_url

    return mask_url(raw) if isinstance(raw, str) else raw
