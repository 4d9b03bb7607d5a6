"""The Mooncake backend's configuration keys: ``remote_url: mooncakestore://<master
host:port>`` plus the ``mooncake_*`` keys, checked at config time (``BrokerConfig.validate``
calls ``validate_mooncake``). Ground floor, like ``config.py``: imports nothing of the
package but ``remote_url.py`` (``cfg`` is the ``BrokerConfig``, typed loosely so that
``config.py`` can import this module). The tier's resolved settings are
``broker/tiers/mooncake/settings.py``'s.
"""

from __future__ import annotations

from typing import Any

from .remote_url import read_hmac_key

SCHEME = "mooncakestore"
PROTOCOLS = ("tcp", "rdma")


def parse_mooncake_url(url: str) -> str:
    """``mooncakestore://host:port`` -> ``host:port`` of the master; ValueError says why."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() != SCHEME:
        raise ValueError(f"remote_url {url!r} is not a {SCHEME}://host:port URL")
    rest = rest.rstrip("/")
    if "@" in rest or "/" in rest or "?" in rest or "," in rest:
        raise ValueError(
            f"remote_url {url!r}: use {SCHEME}://<master host>:<port>; the master takes no "
            "user, path or options (set the mooncake_* keys for the rest)"
        )
    host, _, port_text = rest.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"remote_url {url!r} must name the master as host:port, e.g. {SCHEME}://127.0.0.1:50051"
        )
    return f"{host}:{int(port_text)}"


def is_mooncake_url(url: str | None) -> bool:
    return bool(url) and str(url).strip().lower().startswith(SCHEME + "://")


def validate_mooncake(cfg: Any) -> None:
    """Raise ValueError naming the first invalid Mooncake setting and the fix."""
    assert cfg.remote_url is not None
    parse_mooncake_url(cfg.remote_url)
    if cfg.mooncake_protocol not in PROTOCOLS:
        raise ValueError(
            f"mooncake_protocol must be one of {', '.join(PROTOCOLS)}, got {cfg.mooncake_protocol!r}"
        )
    if cfg.mooncake_protocol == "rdma" and not cfg.mooncake_device_name:
        raise ValueError(
            "mooncake_protocol rdma needs mooncake_device_name (the RDMA device, e.g. mlx5_0)"
        )
    if cfg.mooncake_global_segment_size <= 0:
        raise ValueError(
            "mooncake_global_segment_size must be positive: it is the memory this broker "
            "contributes to the Mooncake pool (e.g. 4GiB)"
        )
    if cfg.mooncake_local_buffer_size <= 0:
        raise ValueError("mooncake_local_buffer_size must be positive (e.g. 16MiB)")
    if not 0 < cfg.mooncake_admin_port < 65536:
        raise ValueError(f"mooncake_admin_port must be a TCP port, got {cfg.mooncake_admin_port}")
    if cfg.mooncake_key_poll_s < 0:
        raise ValueError("mooncake_key_poll_s must not be negative (0: no key listing)")
    if not cfg.mooncake_metadata_server.strip():
        raise ValueError("mooncake_metadata_server is empty; use P2PHANDSHAKE or the server's URL")
    # The settings every remote backend shares.
    if not 0 < cfg.remote_timeout_s <= 600:
        raise ValueError(f"remote_timeout_s must be in (0, 600], got {cfg.remote_timeout_s}")
    if cfg.remote_write_queue < 1:
        raise ValueError("remote_write_queue must be at least 1")
    if cfg.remote_filter_keys < 0:
        raise ValueError("remote_filter_keys must not be negative (0: fold none)")
    if not 0 < len(cfg.remote_key_prefix) <= 256 or any(c.isspace() for c in cfg.remote_key_prefix):
        raise ValueError(
            f"remote_key_prefix must be 1-256 characters without spaces, got {cfg.remote_key_prefix!r}"
        )
    if cfg.remote_hmac_key_file:
        read_hmac_key(cfg.remote_hmac_key_file)
