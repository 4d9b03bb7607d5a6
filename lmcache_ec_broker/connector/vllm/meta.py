"""What the vLLM connector sends between its processes, and the stats it reports.

``ECBrokerConnectorMetadata`` goes from the scheduler to every worker each step (pickled
by vLLM together with the SchedulerOutput); ``ECBrokerWorkerMetadata`` comes back from
each worker with its counters and is aggregated over TP ranks (stage orders and
reports travel on the staging link instead: stage_link.py says why); ``ECBrokerStats`` carries counter deltas;
``make_key`` is the broker key both sides use for an item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

# Hooks a given vLLM does not have are simply never called (``update_connector_output``
# and ``build_connector_worker_meta`` from 0.29, ``ensure_cache_available`` from 0.24);
# only imports need a guard.
try:  # vLLM >= 0.29
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM
    ECConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

try:  # vLLM >= 0.31: stats reported here are logged as "EC Transfer metrics: ..."
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
except ImportError:  # pragma: no cover - older vLLM
    ECConnectorStats = None  # type: ignore[assignment,misc]


def dtype_short_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through the same way."""
    return str(dtype).removeprefix("torch.")


def make_key(model: str, mm_hash: str, dtype: Any) -> str:
    # world_size=1, worker_id=0: one entry shared by all TP ranks.
    return f"{model}@1@0@{mm_hash}@{dtype_short_name(dtype)}"


@dataclass(frozen=True)
class LoadSpec:
    req_id: str
    mm_hash: str
    num_embeds: int
    width: int | None = None  # the encoder's output width when vLLM measured it
    index: int = 0  # the item's index in the request's mm_features


@dataclass
class ECBrokerConnectorMetadata(ECConnectorMetadata):
    # Items staged on every encoder rank (stage_book.py) whose tensors start_load_caches
    # moves into the encoder cache this step.
    loads: list[LoadSpec] = field(default_factory=list)
    # The scheduler's model field (see ECBrokerConnector.model_id). A worker loads and
    # stores in this step only if it is its own field too; "" (unknown: weights
    # changing) means neither (weights_identity.py).
    model: str = ""
    # An encoder-only producer: the mm_hashes it did not encode because the fleet holds
    # them; its workers publish them with the step's puts (docs/epd.md, "Guarantees").
    publish: list[str] = field(default_factory=list)


@dataclass
class ECBrokerWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    # worker counter deltas since the last metadata (WORKER_STAT_FIELDS, broker_timeouts)
    counts: dict[str, int] = field(default_factory=dict)
    # the model field the worker found its weights under (weights_identity.py), when it
    # changed since its last metadata; "" = unknown. The scheduler adopts it.
    identity: str | None = None

    def aggregate(self, other: Any) -> ECBrokerWorkerMetadata:
        # Counters are summed over ranks, as vLLM sums the V2 runner's per-worker stats.
        if isinstance(other, ECBrokerWorkerMetadata):
            if other.identity is not None:  # ranks that disagree: unknown (misses)
                same = self.identity in (None, other.identity)
                self.identity = other.identity if same else ""
            for name, delta in other.counts.items():
                self.counts[name] = self.counts.get(name, 0) + delta
        return self


# The worker part's counters (worker.py), which its metadata carries.
WORKER_STAT_FIELDS = (
    "loads",
    "staged",
    "load_failures",
    "puts_stored",
    "put_errors",
    "puts_skipped",
    "published",
    "publish_failures",
)
STAT_FIELDS = (
    "ec_hits",
    "ec_misses",
    "ec_deferred",
    "promotion_failures",
    "invalid_skipped",
    "stage_timeouts",
    "stage_over_budget",
    "claim_waits",
    "claim_reasks",
    "claim_timeouts",
    *WORKER_STAT_FIELDS,
    "broker_timeouts",
)

if ECConnectorStats is not None:

    @dataclass
    class ECBrokerStats(ECConnectorStats):
        """Counter deltas of one interval; vLLM sums them across steps and workers."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: ECConnectorStats) -> ECBrokerStats:
            for name, value in (other.data or {}).items():
                self.data[name] = self.data.get(name, 0) + value
            return self

        def reduce(self) -> dict[str, int | float]:
            return {name: self.data.get(name, 0) for name in STAT_FIELDS if name in self.data}

        def is_empty(self) -> bool:
            return not any(self.data.values())

else:  # pragma: no cover - older vLLM: the connector reports no stats
    ECBrokerStats = None  # type: ignore[assignment,misc]
