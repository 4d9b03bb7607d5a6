"""The Mooncake backend's settings, resolved for the tier from the broker's config
(``remote_url: mooncakestore://<master host:port>`` plus the ``mooncake_*`` keys, which
``config_mooncake.py`` checks at config time).

No heavy imports (the Mooncake client itself is imported only when the tier opens).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import msgspec

from ....config_mooncake import parse_mooncake_url

if TYPE_CHECKING:
    from ....config import BrokerConfig

EXTRA_HINT = "pip install 'lmcache-ec-broker[mooncake]'"


class MooncakeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the tier needs, resolved from the broker's config."""

    master: str  # host:port of mooncake_master's RPC service
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this broker's segment at
    metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata, etcd://...
    protocol: str = "tcp"  # or "rdma"
    device_name: str = ""  # RDMA device(s), e.g. "mlx5_0"; "" for tcp
    global_segment_size: int = 1 << 30  # memory this broker contributes to the pool
    local_buffer_size: int = 16 << 20  # Mooncake's own staging buffer (unused by our paths)
    key_prefix: str = "ecb:"
    timeout_s: float = 2.0  # bound on a lookup round trip; Mooncake's RPC timeout too
    write_queue: int = 256  # queued write-behinds before new ones are dropped
    max_entry_size: int = 0  # 0: no limit beyond the slab
    hmac_key: bytes | None = None
    admin_port: int = 9003  # the master's metrics/admin HTTP port (key listing)
    key_poll_s: float = 5.0  # how often to fold the store's keys into the filter; 0: off
    max_reported_keys: int = 1 << 20  # remote keys folded into the membership filter


def settings_from_config(cfg: BrokerConfig) -> MooncakeSettings:
    assert cfg.remote_url is not None
    hmac_key = None
    if cfg.remote_hmac_key_file:
        from ....remote_url import read_hmac_key

        hmac_key = read_hmac_key(cfg.remote_hmac_key_file)
    return MooncakeSettings(
        master=parse_mooncake_url(cfg.remote_url),
        local_hostname=cfg.mooncake_local_hostname or socket.gethostname(),
        metadata_server=cfg.mooncake_metadata_server,
        protocol=cfg.mooncake_protocol,
        device_name=cfg.mooncake_device_name,
        global_segment_size=cfg.mooncake_global_segment_size,
        local_buffer_size=cfg.mooncake_local_buffer_size,
        key_prefix=cfg.remote_key_prefix,
        timeout_s=cfg.remote_timeout_s,
        write_queue=cfg.remote_write_queue,
        max_entry_size=cfg.max_entry_size,
        hmac_key=hmac_key,
        admin_port=cfg.mooncake_admin_port,
        key_poll_s=cfg.mooncake_key_poll_s,
        max_reported_keys=cfg.remote_filter_keys,
    )
