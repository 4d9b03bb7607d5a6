"""The broker's one typed configuration and its validation (where values come from:
config_sources.py; sizes: sizes.py; the socket's directory: private_dirs.py)."""

from __future__ import annotations

import os

import msgspec

from .private_dirs import default_socket_path
from .sizes import GiB, KiB, MiB, format_size


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
    # Run the broker's threads SCHED_BATCH: a broker woken by a client's posted frame
    # (a put's Place) then never preempts that client on its CPU, so the put's send
    # no longer pays for the broker's handling of it; round trips may wait a little
    # longer while every CPU is busy (docs/performance.md, issue 42). Off by default.
    sched_batch: bool = False
    # Slab one connection's open reservations (reserved, not yet committed or aborted)
    # may hold; a connection holding none may still reserve any entry the slab takes.
    # 0: a quarter of the slab. Bounds what one client holding reservations evicts.
    max_reserved_bytes_per_connection: int = 0
    # Fairness between client processes and uids (broker/quotas.py; docs/reliability.md
    # "Limits"): what one process (SO_PEERCRED pid) or one uid holds over all its
    # connections together. Defaults no production node reaches (vLLM instances with
    # TP ranks: a few connections per process, tens per uid). "Held" bytes: slab kept
    # from eviction -- open reservations, put arenas, entries it pins or leases.
    max_connections_per_process: int = 64
    # Per uid, 0: three quarters of max_connections / of the slab when allowed_uids or
    # socket_group admit other uids; else all of them (no other uid to protect).
    max_connections_per_uid: int = 0
    max_held_bytes_per_process: int = 0  # 0: half the slab (also bounds one reservation)
    max_held_bytes_per_uid: int = 0
    # Open reservations, zero-byte ones included (each is a membership-filter key).
    # 0: a quarter of the slab's block count per process (at least 64); the block
    # count per uid (at least 256).
    max_reservations_per_process: int = 0
    max_reservations_per_uid: int = 0
    max_pins_per_process: int = 1 << 17
    max_pins_per_uid: int = 1 << 19
    max_leases_per_process: int = 1 << 17
    max_leases_per_uid: int = 1 << 19
    # Seconds a client's reservation may stay uncommitted; then its key is free again
    # and its commit is refused (nothing stored: the client misses and encodes again).
    reservation_ttl_s: float = 60.0
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
        self._validate_quotas()
        self._validate_access()
        self._validate_remote()
        from .config_events import validate_events

        validate_events(self)
        self._refuse_ignored_settings()

    def _validate_quotas(self) -> None:
        for name in (
            "max_connections_per_process",
            "max_pins_per_process",
            "max_pins_per_uid",
            "max_leases_per_process",
            "max_leases_per_uid",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_reservations_per_process", "max_reservations_per_uid"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (the default share) or at least 1")
        if self.max_connections_per_uid < 0:
            raise ValueError(
                "max_connections_per_uid must be 0 (the default share) or at least 1, "
                f"got {self.max_connections_per_uid}"
            )
        for name, share in (
            ("max_held_bytes_per_process", "half"),
            ("max_held_bytes_per_uid", "the default share"),
        ):
            value = getattr(self, name)
            if value != 0 and not self.block_size <= value <= self.shm_size:
                raise ValueError(
                    f"{name} must be 0 ({share} of the slab) or between block_size "
                    f"({format_size(self.block_size)}) and shm_size "
                    f"({format_size(self.shm_size)}), got {value}"
                )
        if not 0.1 <= self.reservation_ttl_s <= 3600:
            raise ValueError(
                "reservation_ttl_s must be between 0.1 and 3600 seconds, got "
                f"{self.reservation_ttl_s}"
            )

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
