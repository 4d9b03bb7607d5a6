"""Stats names every remote backend (Redis/Valkey, Mooncake) exports, so dashboards and
the metrics endpoint see one set whichever store a fleet runs."""

from __future__ import annotations

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
LATENCY_KEYS = tuple(f"remote_latency_ms_le_{b}" for b in LATENCY_BUCKETS_MS) + (
    "remote_latency_ms_le_inf",
)
REMOTE_COUNTERS = (
    "remote_hits",
    "remote_misses",
    "remote_bytes_read",
    "remote_bytes_written",
    "remote_writes",
    "remote_write_drops",
    "remote_writes_skipped",
    "remote_read_errors",
    "remote_write_errors",
    "remote_refused_values",
    "remote_announcements",  # keys learned from other brokers (announcements, key listings)
    "remote_circuit_opens",
    "remote_ask_redirects",  # Redis/Valkey Cluster: -ASK followed (a slot being migrated)
    "remote_moved_redirects",  # Redis/Valkey Cluster: -MOVED followed (slot map updated)
    "remote_writes_cancelled",  # a delete or clear of the key came before the write ran
    "remote_lookups_shed",  # lookups answered as a miss at once: too many waiting
    "remote_lookup_timeouts",  # lookups answered as a miss at their deadline
    "remote_lease_conflicts",  # Mooncake: deletes deferred by a reader's lease
    "remote_loop_lookups",  # lookups done on the event loop (no worker thread)
    "remote_loop_reads",  # promotions read on the event loop (no worker thread)
    "remote_staged_reads",  # Mooncake: gets read in one transfer via a staging buffer
    "remote_fleet_claims_won",  # encode claims this broker took in the store (dedup.py)
    "remote_fleet_claims_lost",  # ... another broker held: its client waits instead
    "remote_fleet_claims_unknown",  # store down, slow or busy: encoded here unclaimed
    *LATENCY_KEYS,
    "remote_latency_seconds_sum",
)
REMOTE_GAUGES = (
    "remote_up",
    "remote_known_keys",
    "remote_pending_writes",
    "remote_pending_bytes",
    "remote_lookups_running",
)


def record_latency(counters: dict[str, int | float], seconds: float) -> None:
    """Count one remote call in the cumulative latency buckets (caller holds its lock)."""
    ms = seconds * 1000.0
    for bound, key in zip(LATENCY_BUCKETS_MS, LATENCY_KEYS, strict=False):
        if ms <= bound:
            counters[key] += 1
    counters["remote_latency_ms_le_inf"] += 1
    counters["remote_latency_seconds_sum"] += seconds
