"""The broker's one typed configuration, and how sizes and paths are parsed."""

from __future__ import annotations

import os
import re

import msgspec

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

SOCKET_ENV = "LMCACHE_EC_BROKER_SOCKET"


def default_socket_path() -> str:
    """$LMCACHE_EC_BROKER_SOCKET, else $XDG_RUNTIME_DIR/lmcache-ec-broker.sock,
    else /tmp/lmcache-ec-broker-<uid>.sock."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "lmcache-ec-broker.sock")
    return f"/tmp/lmcache-ec-broker-{os.getuid()}.sock"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(value: str | int | float, plain_unit: int = GiB) -> int:
    """'512MiB', '2GiB', '64k', or a plain number of ``plain_unit`` (GiB by default)."""
    if isinstance(value, bool):
        raise ValueError(f"size must be a number or a string like 512MiB, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return int(value * plain_unit)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(
            f"cannot parse size {value!r}; use e.g. 512MiB, 2GiB or a plain number of GiB"
        )
    number, unit = float(m.group(1)), m.group(2)
    mult = plain_unit if unit is None else _UNITS[unit[0].lower()]
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
    lease_ms: int = 30_000
    prefault: bool = True
    local_disk: str | None = None
    max_local_disk_size: int = 0
    metrics_port: int = 0
    log_level: str = "INFO"

    def validate(self) -> None:
        """Raise ValueError naming the first invalid value."""
        if self.shm_size <= 0:
            raise ValueError(f"shm_size must be positive, got {self.shm_size}")
        if self.block_size < 4096 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 4 KiB, got {self.block_size}")
        if self.block_size > self.shm_size:
            raise ValueError("block_size is larger than shm_size")
        if self.max_entry_size < 0:
            raise ValueError("max_entry_size must not be negative")
        if not 1 <= self.max_key_length <= 64 * KiB:
            raise ValueError("max_key_length must be between 1 and 65536")
        if self.max_frame_bytes < 4 * KiB:
            raise ValueError("max_frame_bytes must be at least 4 KiB")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(
                f"socket_mode must be an octal permission like 0o660, got {self.socket_mode}"
            )
        if self.lease_ms < 0:
            raise ValueError("lease_ms must not be negative")
        if self.max_local_disk_size < 0:
            raise ValueError("max_local_disk_size must not be negative")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")


def load_config(
    cli: dict[str, object] | None = None, config_file: str | None = None
) -> tuple[BrokerConfig, dict[str, str]]:
    """The effective configuration and, per field, where its value came from.

    Precedence: CLI flags > defaults. (YAML and environment layers: see issue 4.)
    """
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    sources = {name: "default" for name in BrokerConfig.__struct_fields__}
    for name in cli:
        sources[name] = "cli"
    if "socket_path" not in cli and os.environ.get(SOCKET_ENV):
        sources["socket_path"] = f"env {SOCKET_ENV}"
    cfg = msgspec.convert(cli, BrokerConfig)
    cfg.validate()
    return cfg, sources
