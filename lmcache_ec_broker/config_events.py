"""The ``events_*`` configuration keys: their validation (``BrokerConfig.validate`` calls
``validate_events``) and the node name they resolve to. Ground floor, like ``config.py``:
imports nothing of the package (``cfg`` is the ``BrokerConfig``, typed loosely so that
``config.py`` can import this module)."""

from __future__ import annotations

import re
import socket
from typing import Any

# A node name goes into ZMQ topics between '/' separators.
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def node_name(cfg: Any) -> str:
    """The configured ``events_node``, else this host's name (cleaned to the topic alphabet)."""
    if cfg.events_node:
        return str(cfg.events_node)
    host = re.sub(r"[^A-Za-z0-9._:-]", "-", socket.gethostname()) or "node"
    return host[:128]


def validate_events(cfg: Any) -> None:
    """Raise ValueError naming the first invalid ``events_*`` value."""
    for name in ("events_port", "events_lookup_port"):
        port = getattr(cfg, name)
        if not 0 <= port <= 65535:
            raise ValueError(f"{name} must be 0 (off) or a TCP port, got {port}")
    if cfg.events_port == 65535:
        raise ValueError("events_port must be below 65535: the replay socket uses events_port + 1")
    if cfg.events_port and cfg.events_lookup_port in (cfg.events_port, cfg.events_port + 1):
        raise ValueError(
            f"events_lookup_port {cfg.events_lookup_port} collides with the event sockets "
            f"(events_port {cfg.events_port} and {cfg.events_port + 1}); choose another port"
        )
    if cfg.events_node and not _NODE_RE.match(cfg.events_node):
        raise ValueError(
            f"events_node {cfg.events_node!r} must be 1-128 characters of letters, digits, "
            "'.', '_', ':' or '-' (it is part of the event topics)"
        )
    if not cfg.events_host or any(c.isspace() or c in "/*" for c in cfg.events_host):
        raise ValueError(
            f"events_host must be an address to bind, e.g. 127.0.0.1 or 0.0.0.0, "
            f"got {cfg.events_host!r}"
        )
    if cfg.events_queue < 1:
        raise ValueError(f"events_queue must be at least 1, got {cfg.events_queue}")
    if cfg.events_replay < 0:
        raise ValueError(
            f"events_replay must not be negative (0: no replay), got {cfg.events_replay}"
        )
    if not 0.05 <= cfg.events_heartbeat_s <= 3600:
        raise ValueError(
            f"events_heartbeat_s must be between 0.05 and 3600 seconds, got {cfg.events_heartbeat_s}"
        )
