"""The keys of vLLM's ``ec_connector_extra_config`` that ECBrokerConnector reads, and
the refusal of any other.

A misspelt key (``socket_pth``) used to be ignored: the connector fell back to the
default socket and served misses from a broker nobody started. Now the connector
refuses to start, naming the closest key. LMCache's own settings, written as
LMCache's vLLM adapter takes them (``lmcache.<key>``) or bare (``chunk_size``), are
accepted and named in one info line: one extra config can serve both connectors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ...config_lmcache import LMCACHE_KEYS, closest

# Every key ECBrokerConnector.__init__ reads (connector/vllm/connector.py), with what it sets.
KEYS = {
    "socket_path": "the broker's Unix socket",
    "scheduler_budget_ms": "longest wait of the scheduler's hooks per outage",
    "worker_budget_ms": "longest wait of a worker's loads and puts per outage",
    "probe_interval_ms": "how often a broker that timed out is probed",
    "lease_ms": "how long a hit the scheduler saw is protected from eviction",
    "max_defer_s": "how long a request may wait for a promotion",
    "stage_wait_ms": "how long a request may wait for its hits to be staged on the workers",
    "stage_max_embeds": "the most embeddings held staged on an encoder rank's device at once",
    "claim_wait_ms": "how long a request may wait for an item another instance is encoding",
    "model_name": "the model field of the keys",
    "client_uuid_namespace": "who may share entries keyed by client multi_modal_uuids",
    "publish_wait_ms": "how long an encoder-only producer's step waits for its entries "
    "to reach the fleet",
}
# Keys earlier releases read; the connector refuses them with what to set instead.
RETIRED = frozenset({"timeout_s"})
LMCACHE_PREFIX = "lmcache."


def check_extra_config(extra: Mapping[str, object] | None, log: logging.Logger | None) -> None:
    """Raise ValueError naming every unknown key (with the closest known one); log the
    LMCache keys it ignores in one info line on ``log`` (None: say nothing)."""
    unknown: list[str] = []
    lmcache: list[str] = []
    for key in sorted(extra or {}):
        if key in KEYS or key in RETIRED:
            continue
        bare = key.removeprefix(LMCACHE_PREFIX)
        if bare in LMCACHE_KEYS:
            lmcache.append(key)
            continue
        if key.startswith(LMCACHE_PREFIX):
            match = closest(bare, LMCACHE_KEYS)
            unknown.append(f"{key} (did you mean {LMCACHE_PREFIX}{match}?)" if match else key)
        else:
            match = closest(key, [*KEYS, *LMCACHE_KEYS])
            unknown.append(f"{key} (did you mean {match}?)" if match else key)
    if unknown:
        noun = "key" if len(unknown) == 1 else "keys"
        raise ValueError(
            f"ec_connector_extra_config: unknown {noun} {', '.join(unknown)}; the connector "
            f"reads {', '.join(KEYS)} (and accepts LMCache's own settings, ignored)"
        )
    if lmcache and log is not None:
        log.info(
            "ec_connector_extra_config: LMCache settings without a use in the encoder-cache "
            "connector, accepted and ignored: %s",
            ", ".join(lmcache),
        )
