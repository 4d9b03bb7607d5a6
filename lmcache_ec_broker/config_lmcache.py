"""LMCache's own configuration keys, and the did-you-mean for keys nobody knows.

A file, environment or vLLM extra config written for LMCache is accepted by this
broker and its connector: LMCache's keys that the encoder cache has no use for are
named once, in one info line, and change nothing. Any other unknown key is refused
with the closest known name, so a typo (``local_disc``, ``LMCACHE_EC_SHM_SIZEE``,
``socket_pth``) stops the start instead of silently falling back to a default.

``LMCACHE_KEYS`` are the names of LMCache's ``LMCacheEngineConfig`` (the
``_CONFIG_DEFINITIONS`` of ``lmcache/v1/config.py``) and their deprecated aliases
(``_CONFIG_ALIASES``, ``_DEPRECATED_CONFIGS``), as of LMCache commit 000620e3
(2026). A key LMCache adds later is refused as unknown until it is added here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

LMCACHE_KEYS = frozenset(
    {
        # basic
        "chunk_size", "local_cpu", "max_local_cpu_size", "local_cpu_use_hugepages",
        "reserve_local_cpu_size", "local_disk", "local_disk_path_sharding",
        "max_local_disk_size", "remote_url", "remote_serde",
        # features
        "use_layerwise", "save_decode_cache", "pre_caching_hash_algorithm",
        "save_unfull_chunk", "enable_async_loading", "enable_kv_events",
        "use_gpu_connector_v3", "py_enable_gc", "cache_policy", "numa_mode",
        "cost_aware_half_life_seconds", "cost_aware_ewma_alpha", "priority_limit",
        "blocking_timeout_secs", "external_lookup_client", "extra_config",
        # blending
        "enable_blending", "blend_recompute_ratios", "blend_thresholds",
        "blend_check_layers", "blend_min_tokens", "blend_special_str",
        "retrieve_locations", "store_location",
        # p2p, controller, workers
        "enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "mp_host",
        "mp_port", "enable_controller", "lmcache_instance_id", "controller_pull_url",
        "controller_reply_url", "lmcache_worker_ports", "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time", "lmcache_worker_heartbeat_time",
        # disaggregated prefill, transfer, nixl
        "enable_pd", "pd_role", "pd_buffer_size", "pd_buffer_device", "pd_peer_host",
        "pd_peer_init_port", "pd_peer_alloc_port", "pd_peer_query_port",
        "pd_proxy_host", "pd_proxy_port", "pd_allocation_timeout_sec",
        "pd_shutdown_timeout_sec", "pd_condition_poll_interval_sec",
        "pd_max_prefill_len", "pd_backend_mode", "pd_skip_proxy_notification",
        "pd_bidirectional", "transfer_channel", "nixl_backends", "nixl_buffer_size",
        "nixl_buffer_device",
        # storage backends
        "gds_path", "gds_path_sharding", "gds_buffer_size", "use_gds", "gds_backend",
        "maru_path", "maru_pool_size", "audit_actual_remote_url",
        "runtime_plugin_locations", "storage_plugins", "remote_storage_plugins",
        # internal API server, lookup
        "internal_api_server_host", "internal_api_server_enabled",
        "internal_api_server_port_start", "internal_api_server_include_index_list",
        "internal_api_server_socket_path_prefix", "lookup_timeout_ms",
        "min_retrieve_tokens", "hit_miss_ratio", "lookup_server_worker_ids",
        "enable_scheduler_bypass_lookup", "script_allowed_imports",
        # memory
        "enable_lazy_memory_allocator", "lazy_memory_initial_ratio",
        "lazy_memory_expand_trigger_ratio", "lazy_memory_step_ratio",
        "lazy_memory_safe_size", "pin_timeout_sec", "pin_check_interval_sec",
        # statistics, remote configuration, hidden states
        "enable_chunk_statistics", "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours",
        "chunk_statistics_auto_exit_target_unique_chunks", "chunk_statistics_strategy",
        "remote_config_url", "app_id", "enable_hidden_state_cache",
        "max_hidden_state_cpu_size", "hidden_state_layers", "hidden_states_retrieve_mode",
        # deprecated names LMCache still accepts
        "enable_xpyd", "nixl_peer_host", "nixl_peer_init_port", "nixl_peer_alloc_port",
        "nixl_proxy_host", "nixl_proxy_port", "nixl_role", "nixl_peer_port",
        "controller_url", "lmcache_worker_port", "plugin_locations", "external_backends",
    }
)  # fmt: skip


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name a misspelt ``name`` most likely meant, or None when none is close."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return found[0] if found else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``name`` followed by `` (did you mean X?)`` when a known name is close."""
    match = closest(name, known)
    return f"{name} (did you mean {match}?)" if match else name
