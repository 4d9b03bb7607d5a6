"""vLLM encoder-cache connector backed by the node-local broker.

Enable with (the package registers the name as a vLLM plugin)::

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECBrokerConnector",
      "ec_role": "ec_both",
      "ec_connector_extra_config": {"socket_path": "/run/lmcache-ec/broker.sock"}}'

(``"ec_connector_module_path": "lmcache_ec_broker.connector.vllm"`` works too, and
is needed where vLLM plugins are disabled through ``VLLM_PLUGINS``.)

Extra config keys: ``socket_path`` (default: $LMCACHE_EC_BROKER_SOCKET, then the
broker's default), ``scheduler_budget_ms`` (50: the longest the scheduler's hooks
wait for the broker, once per outage; the broker answers a lookup within half of
it even when its remote store is slower, a key the store has not answered being a
miss), ``worker_budget_ms`` (200: the same for a
worker's loads and puts), ``probe_interval_ms`` (500: how often a broker that
timed out is probed in the background), ``lease_ms`` (30000: how long a hit the
scheduler saw is protected from eviction if nothing releases it earlier),
``max_defer_s`` (10.0: how long a request may wait for its entries to be promoted
from a lower tier before they are encoded instead), ``stage_wait_ms``
(``worker_budget_ms`` + 500: how long a request may wait for its hits to be staged
on the workers before they are encoded instead), ``claim_wait_ms`` (10000: how long
a request may wait for an item another encoder has claimed, 0 = never wait),
``model_name`` (the model field of the keys, followed by the configuration's
fingerprint; default: the model path plus a fingerprint of its weights, see
:mod:`lmcache_ec_broker.connector.vllm.model_id`; after an in-place weight update, plus a
fingerprint of the encoder's weights in memory, see
:mod:`lmcache_ec_broker.connector.vllm.weights_identity`), ``client_uuid_namespace``
(unset: client ``multi_modal_uuids`` are never shared; set: shared among instances
with the same namespace, see :mod:`lmcache_ec_broker.connector.vllm.identifiers`),
``publish_wait_ms`` (2000; an
``ec_producer`` only: the longest a step waits for its entries to reach the fleet,
0 = no wait; below).

Disaggregated encoding (EPD, docs/epd.md): an ``ec_producer`` started with
``--mm-encoder-only`` looks its items up too (no lease: it never loads), in the
fleet's store as well (``fresh``: an announcement not heard yet does not hide a
key), and answers ``has_cache_item`` True for an item resident anywhere (READY or
PENDING): vLLM's scheduler then neither encodes nor loads it (an external load is a
consumer's only; the encoder-only runners run only the step's encoder inputs). At the
end of each step its workers ``publish`` the step's puts and those skipped items --
the step, hence the instance's answer to the proxy, ends only once the store holds
them (at most ``publish_wait_ms``; failures counted and logged). An ``ec_consumer``'s
lookups are ``fresh`` too. ``ec_both`` (aggregated) is unchanged: it looks up and loads
as a consumer and never waits.

Flow per engine step (staged loads: docs/design.md, "Staged loads"):

- scheduler ``ensure_cache_available`` (per multimodal request): one ``lookup``
  with a lease for the request's items still ahead of its computed tokens, within
  this step's reach (its token budget) and not held by vLLM's own encoder cache
  (mirrored from ``update_state_after_alloc`` and the step's freed hashes).
  READY with the expected dtype and shape: a stage order goes to every encoder
  rank over the staging link (stage_link.py; the book of orders: stage_book.py),
  and the request is held (False) until every rank reports the item staged, or
  the staging fails (then it is a miss: vLLM encodes it), bounded by
  ``stage_wait_ms``. PENDING (being promoted from the disk tier): the request waits
  for a later step (``max_defer_s``). CLAIMED (another encoder is encoding it): the
  request waits, at most ``claim_wait_ms``; the answer is kept across steps and
  the item asked about again at growing intervals (reask.py), not every step. A wrong dtype or shape: a miss,
  counted, and this request encodes the item; the entry is left alone (never
  deleted: it is another configuration's). Answers are memoised for the step.
- scheduler ``has_cache_item``: True only for an item staged on every encoder
  rank; ``update_state_after_alloc`` queues exactly those loads.
- ``build_connector_meta`` ships ``(req_id, mm_hash, num_embeds)`` loads to workers
  (each ends its stage order) and ends the leases that protect nothing any more.
- worker ``start_load_caches``: moves each load's staged tensor into vLLM's encoder
  cache; it fetches nothing and cannot fail. ``request_finished`` releases the
  stagings only that request waited for.
- worker ``save_caches``: ``put`` from every TP rank; the broker's two-phase put lets
  exactly one of them copy.

The worker side (staging, loads, puts) is a part this connector holds for the
worker role, ``worker.ECBrokerWorker``; the stage orders another,
``stage_book.StageBook`` (docs/design.md, "The vLLM connector's parts"); the
messages between the two sides and the key format are in ``meta.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from lmcache_ec_broker.connector.client import BrokerClient
from lmcache_ec_broker.connector.vllm.extra_config import check_extra_config
from lmcache_ec_broker.connector.vllm.identifiers import IdentifierPolicy
from lmcache_ec_broker.connector.vllm.meta import (  # noqa: F401 - re-exported
    STAT_FIELDS,
    ECBrokerConnectorMetadata,
    ECBrokerStats,
    ECBrokerWorkerMetadata,
    ECConnectorStats,
    LoadSpec,
    dtype_short_name,
    make_key,
)
from lmcache_ec_broker.connector.vllm.model_id import (
    check_model_name,
    config_fingerprint,
    model_id,
    with_config,
)
from lmcache_ec_broker.connector.vllm.process_clients import ProcessClient
from lmcache_ec_broker.connector.vllm.scheduler import ECBrokerScheduler, SchedulerSettings
from lmcache_ec_broker.connector.vllm.stage_book import StageBook, vllm_encoder_cache_size
from lmcache_ec_broker.connector.vllm.stage_link import (
    StageHub,
    encoder_ranks,
    link_path,
    loads_off_reason,
)
from lmcache_ec_broker.connector.vllm.weights_identity import (
    EngineWatch,
    track_model_loads,
    watch_engine_calls,
)
from lmcache_ec_broker.connector.vllm.worker import ECBrokerWorker, logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


DEFAULT_LEASE_MS = 30_000
DEFAULT_MAX_DEFER_S = 10.0
# Chosen from benchmarks/hung_broker.py (README, "When the broker fails").
DEFAULT_SCHEDULER_BUDGET_MS = 50.0
DEFAULT_WORKER_BUDGET_MS = 200.0
DEFAULT_PROBE_INTERVAL_MS = 500.0
DEFAULT_PUBLISH_WAIT_MS = 2000
DEFAULT_CLAIM_WAIT_MS = 10_000


def _worker_count(name: str) -> property:
    """A worker counter: the worker part's own; on the scheduler, the sum the workers
    reported in their metadata (update_connector_output)."""

    def get(self: ECBrokerConnector) -> int:
        worker = self.connector_worker
        return getattr(worker, name) if worker is not None else self._from_workers.get(name, 0)

    return property(get)


def _scheduler_count(name: str) -> property:
    """A scheduler counter: the scheduler part's own; 0 on a worker."""

    def get(self: ECBrokerConnector) -> int:
        part = self.connector_scheduler
        return getattr(part, name) if part is not None else 0

    return property(get)


class ECBrokerConnector(ECConnectorBase):
    """The class vLLM instantiates, once per role. It reads the configuration, owns
    the broker client of its process, and holds one part per role -- the scheduler
    side (``connector_scheduler``, scheduler.py) or the worker side
    (``connector_worker``, worker.py) -- and forwards vLLM's hooks to it in one line
    each: see docs/design.md, "The vLLM connector's parts"."""

    # The worker part's class (a test injecting faults subclasses it).
    worker_class: type[ECBrokerWorker] = ECBrokerWorker
    loads = _worker_count("loads")
    staged = _worker_count("staged")
    load_failures = _worker_count("load_failures")
    puts_stored = _worker_count("puts_stored")
    put_errors = _worker_count("put_errors")
    puts_skipped = _worker_count("puts_skipped")
    published = _worker_count("published")
    publish_failures = _worker_count("publish_failures")
    ec_hits = _scheduler_count("ec_hits")
    ec_misses = _scheduler_count("ec_misses")
    ec_deferred = _scheduler_count("ec_deferred")
    promotion_failures = _scheduler_count("promotion_failures")
    claim_waits = _scheduler_count("claim_waits")
    claim_reasks = _scheduler_count("claim_reasks")
    claims_awaited = _scheduler_count("claims_awaited")
    claim_timeouts = _scheduler_count("claim_timeouts")
    stage_timeouts = _scheduler_count("stage_timeouts")
    stage_over_budget = _scheduler_count("stage_over_budget")
    stage_orders = _scheduler_count("stage_orders")

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None  # the base class already raised otherwise
        check_extra_config(  # a misspelt key refuses, LMCache's are named once
            ec_config.ec_connector_extra_config,
            logger if role == ECConnectorRole.SCHEDULER else None,
        )
        extra = ec_config.get_from_extra_config
        self._socket_path: str | None = extra("socket_path", None)
        if extra("timeout_s", None) is not None:
            raise ValueError(
                "ec_connector_extra_config: timeout_s is gone; the broker's waits are bounded "
                "by scheduler_budget_ms (default 50) and worker_budget_ms (default 200): "
                "set those instead"
            )
        budget_ms = float(
            extra("scheduler_budget_ms", DEFAULT_SCHEDULER_BUDGET_MS)
            if role == ECConnectorRole.SCHEDULER
            else extra("worker_budget_ms", DEFAULT_WORKER_BUDGET_MS)
        )
        probe_ms = float(extra("probe_interval_ms", DEFAULT_PROBE_INTERVAL_MS))
        if budget_ms <= 0 or probe_ms <= 0:
            raise ValueError(
                "ec_connector_extra_config: scheduler_budget_ms, worker_budget_ms and "
                f"probe_interval_ms must be > 0 (got {budget_ms} and {probe_ms})"
            )
        self._timeout_s = budget_ms / 1000
        # The broker answers a lookup within half the budget even when its remote
        # store is slow (keys the store has not answered are a miss: an encode), so a
        # slow store never opens this circuit and turns local hits into encodes too.
        lookup_wait_ms = max(1, int(budget_ms / 2))
        self._probe_interval_s = probe_ms / 1000
        # Disaggregated encoding (the module docstring, "EPD"): which instance does what.
        self._encoder_only_producer = (
            self.is_producer
            and not self.is_consumer
            and bool(getattr(vllm_config, "is_mm_encoder_only", False))
        )
        fresh = self._encoder_only_producer or (self.is_consumer and not self.is_producer)
        publish_wait_ms = int(extra("publish_wait_ms", DEFAULT_PUBLISH_WAIT_MS))
        if publish_wait_ms < 0:
            raise ValueError(
                "ec_connector_extra_config: publish_wait_ms must be >= 0 "
                f"(got {publish_wait_ms}; 0 = an encoder instance does not wait)"
            )
        # Only a pure producer hands entries over to other instances: only it waits.
        self._publish_wait_ms = publish_wait_ms if self.is_producer and not self.is_consumer else 0
        lease_ms = int(extra("lease_ms", DEFAULT_LEASE_MS))
        max_defer_s = float(extra("max_defer_s", DEFAULT_MAX_DEFER_S))
        # In-flight deduplication (docs/design.md, "Staged loads"): an instance that
        # stores what it encodes claims the items it misses; an item another encoder
        # claimed holds the request, at most claim_wait_ms, then it is encoded here.
        claim_wait_ms = float(extra("claim_wait_ms", DEFAULT_CLAIM_WAIT_MS))
        if claim_wait_ms < 0:
            raise ValueError(
                f"ec_connector_extra_config: claim_wait_ms must be >= 0 (got {claim_wait_ms:g};"
                " 0 = never wait for another encoder)"
            )
        # The hold bound of a staging (stage_book.py): past a worker's own bounded wait.
        worker_ms = float(extra("worker_budget_ms", DEFAULT_WORKER_BUDGET_MS))
        stage_wait_s = float(extra("stage_wait_ms", worker_ms + 500)) / 1000
        if stage_wait_s <= 0:
            raise ValueError(
                "ec_connector_extra_config: stage_wait_ms must be > 0 "
                f"(got {stage_wait_s * 1000:g})"
            )
        if lease_ms <= 0 or max_defer_s < 0:
            raise ValueError(
                "ec_connector_extra_config: lease_ms must be > 0 and max_defer_s >= 0 "
                f"(got lease_ms={lease_ms}, max_defer_s={max_defer_s})"
            )
        model_config = vllm_config.model_config
        # The effective configuration is part of the field (model_id.config_parts).
        config = config_fingerprint(vllm_config)
        self._model_source = (
            str(model_config.model),
            getattr(model_config, "revision", None),
            None,
            config,
        )
        explicit = extra("model_name", None)
        # The scheduler is the one source of the model field: vLLM builds it after the
        # workers' load_model (the weights are downloaded by then), a worker before, so
        # a worker never computes it here; it keys with the field of each step's
        # metadata (see model_id).
        self._model: str | None = (
            with_config(check_model_name(explicit), config)
            if explicit is not None
            else model_id(*self._model_source)
            if role == ECConnectorRole.SCHEDULER
            else None
        )
        # Which item identifiers name their content (identifiers.py): only those key
        # shared entries; client UUIDs only under an explicit namespace.
        self._ids = IdentifierPolicy(
            vllm_config,
            extra("client_uuid_namespace", None),
            logger if role == ECConnectorRole.SCHEDULER else None,
        )
        self._dtype = model_config.dtype
        self._dtype_name = dtype_short_name(self._dtype)
        sched = getattr(vllm_config, "scheduler_config", None)
        # How far past its computed tokens one step can take a request (the scheduler's
        # token budget, capped by the long-prefill threshold): items beyond are not
        # looked up yet.
        reach = int(
            getattr(sched, "max_num_scheduled_tokens", None)
            or getattr(sched, "max_num_batched_tokens", None)
            or 1 << 62
        )
        threshold = int(getattr(sched, "long_prefill_token_threshold", 0) or 0)
        if threshold > 0:
            reach = min(reach, threshold)
        # The staging budget (stage_book.py, invariant 4): embeddings held staged on each
        # encoder rank's device at once, outside what vLLM profiled. By default what
        # vLLM's own encoder cache holds (computed where a book is built, below).
        explicit_stage_max = extra("stage_max_embeds", None)
        stage_max_embeds = None if explicit_stage_max is None else int(explicit_stage_max)
        if stage_max_embeds is not None and stage_max_embeds <= 0:
            raise ValueError(
                "ec_connector_extra_config: stage_max_embeds must be > 0 "
                f"(got {stage_max_embeds}; it bounds the embeddings staged on a device at once)"
            )
        # The step's client, and on a worker the staging thread's (process_clients.py).
        self._clients = ProcessClient(self._make_client)
        self._stage_clients = ProcessClient(self._make_client, "staging reads")

        # Counters of the connector itself (each side's part counts its own).
        self.invalid_skipped = 0  # entries of the wrong dtype/shape: misses, left alone
        self._reported: dict[str, int] = {}
        # Worker counters summed from the workers' metadata (scheduler role only): the
        # one route to vLLM's EC stats on the V1 runner too (worker.py says why).
        self._from_workers: dict[str, int] = {}

        # Whether hits may be staged and loaded at all (stage_link.loads_off_reason).
        self.loads_off = loads_off_reason(vllm_config)
        if self.loads_off and role == ECConnectorRole.SCHEDULER and self.is_consumer:
            logger.warning("EC broker: no loads in this configuration (%s); saving only", self.loads_off)
        stages = self.is_consumer and not self._encoder_only_producer and not self.loads_off
        # The scheduler side: a part of its own, given what it reads (scheduler.py),
        # with the stage orders it sends through the engine's staging link.
        self.connector_scheduler: ECBrokerScheduler | None = None
        if role == ECConnectorRole.SCHEDULER:
            book: StageBook | None = None
            if stages:
                if stage_max_embeds is None:
                    stage_max_embeds = vllm_encoder_cache_size(vllm_config)
                try:
                    hub = StageHub(link_path(vllm_config), encoder_ranks(vllm_config))
                except (OSError, ValueError) as exc:
                    self.loads_off = f"the staging link could not be set up: {exc}"
                    logger.warning("EC broker: no loads (%s); saving only", self.loads_off)
                else:
                    book = StageBook(hub, stage_wait_s, stage_max_embeds)
            self.connector_scheduler = ECBrokerScheduler(
                settings=SchedulerSettings(
                    encoder_only_producer=self._encoder_only_producer,
                    fresh=fresh,
                    lease_ms=lease_ms,
                    lookup_wait_ms=lookup_wait_ms,
                    max_defer_s=max_defer_s,
                    claims=self.is_producer and claim_wait_ms > 0,
                    claim_wait_s=claim_wait_ms / 1000,
                    stage_wait_s=stage_wait_s,
                    probe_interval_s=self._probe_interval_s,
                    reach=reach,
                ),
                # The field follows the weights in memory (weights_identity.py).
                field=self._model or "",
                dtype=self._dtype,
                widths=dict(getattr(ec_config, "mm_encoder_output_widths", {})),
                book=book,
                on_live_connection=self._clients.on_live_connection,
                live_client=self._clients.live,
                item_key=self._ids.item_key,
                mismatch=self._mismatch,
                delete_invalid=self._delete_invalid,
            )

        # The worker side: a part of its own, given what it reads (worker.py).
        self.connector_worker: ECBrokerWorker | None = None
        if role == ECConnectorRole.WORKER:
            self.connector_worker = self.worker_class(
                is_producer=self.is_producer,
                dtype=self._dtype,
                model=self._model,
                model_source=self._model_source,
                bound_metadata=lambda: self._connector_metadata,
                client=lambda: self.client,
                on_live_read_connection=self._stage_clients.on_live_connection,
                note_health=self._clients.note_health,
                mismatch=self._mismatch,
                delete_invalid=self._delete_invalid,
                private=self._private,
                publish_wait_ms=self._publish_wait_ms,
                item_key=self._ids.item_key,
            )
            track_model_loads(model_config)  # weight changes seen where they happen
            if stages:
                self.connector_worker.start_staging(link_path(vllm_config))

        # The engine core's weight-changing calls refresh the field at once
        # (weights_identity.py); the workers also report changes they see themselves.
        self.weights_watch: EngineWatch | None = None
        if role == ECConnectorRole.SCHEDULER and self._model is not None:
            assert self.connector_scheduler is not None
            self.weights_watch = EngineWatch(
                self._model,
                self.connector_scheduler.set_field,
                vllm_config,
                on_encoder_cache_reset=self.connector_scheduler.encoder_cache_reset,
            )
            if not watch_engine_calls():
                logger.warning(
                    "EC broker: no vLLM engine core here; the model field of the keys "
                    "follows only the weight changes the workers see"
                )
            logger.info("EC broker: model field of the keys is %s", self._model)

    # ------------------------------------------------------------------ helpers

    @property
    def model_id(self) -> str:
        """The model field of this instance's keys. On the scheduler: the field its
        part keys with ("" while unknown). On a worker: its part's
        (``ECBrokerWorker.model_id``)."""
        if self.connector_worker is not None:
            return self.connector_worker.model_id
        return self._scheduler.field

    def _private(self, identifier: str) -> bool:
        """An identifier that does not name the item's content, or a tower LoRA
        adapter's item: never looked up nor stored (identifiers.py)."""
        return self._ids.item_key(identifier) is None

    def key(self, mm_hash: str) -> str:
        return make_key(self.model_id, self._ids.item_key(mm_hash) or mm_hash, self._dtype)

    @property
    def client(self) -> BrokerClient:
        """This process's step client (made on first use, and again after a fork)."""
        return self._clients.get()

    def _make_client(self) -> BrokerClient:
        return BrokerClient(
            self._socket_path,
            timeout_s=self._timeout_s,
            connect_timeout_s=self._timeout_s,
            probe_interval_s=self._probe_interval_s,
        )

    @property
    def broker_timeouts(self) -> int:
        """Outages that cost this process a wait (one timeout each, see BrokerClient)."""
        own = self._clients.timeouts() + self._stage_clients.timeouts()
        if self.connector_worker is None:
            own += self._from_workers.get("broker_timeouts", 0)  # the workers' outages
        return own

    def stats(self) -> dict[str, int]:
        """Cumulative counters of this connector (this process, this role)."""
        return {name: getattr(self, name) for name in STAT_FIELDS}

    def get_ec_connector_stats(self) -> Any:
        # A worker's counters reach vLLM through its metadata and the scheduler's
        # connector (V1 calls this on the scheduler only; V2 on both: never twice).
        if ECConnectorStats is None or self.connector_worker is not None:
            return None
        now = self.stats()
        delta = {
            k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)
        }
        if not delta:
            return None
        self._reported = now
        return ECBrokerStats(data=delta)

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if ECConnectorStats is None:
            return None
        return ECBrokerStats(data=dict(data or {}))

    def wait_for_link(self, timeout_s: float) -> bool:
        """The scheduler part's ``wait_for_link`` (tests and benchmarks)."""
        return self._scheduler.wait_for_link(timeout_s)

    def wait_for_staging(self, timeout_s: float) -> None:
        """The scheduler part's ``wait_for_staging`` (tests and benchmarks)."""
        self._scheduler.wait_for_staging(timeout_s)

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()
        worker = self.connector_worker
        if worker is not None and worker.link is not None:
            worker.link.close()
        self._clients.close()
        self._stage_clients.close()

    def _mismatch(
        self, dtype: str, shape: list[int], num_embeds: int | None, width: int | None
    ) -> str:
        """Why an entry cannot be this model's output for the item; "" if it can."""
        if dtype != self._dtype_name:
            return f"dtype {dtype}, the model's is {self._dtype_name}"
        if len(shape) != 2:
            return f"shape {list(shape)} is not [num_embeds, width]"
        if num_embeds is not None and shape[0] != num_embeds:
            return f"shape {list(shape)}, the item has {num_embeds} embeddings"
        if width is not None and shape[1] != width:
            return f"shape {list(shape)}, the encoder's output width is {width}"
        return ""

    def _delete_invalid(self, bad: list[tuple[str, str]]) -> None:
        """An entry whose dtype or shape this instance would not have computed: a miss
        here, and left alone. It is another configuration's entry (issue 39: an
        instance never deletes what another stored -- the model field separates
        configurations, so this is rare); bytes that do not match their checksum are
        the broker's to quarantine, not the connector's."""
        for mm_hash, why in bad:
            logger.warning(
                "EC broker entry for mm_hash=%s is invalid for this model (%s): encoded "
                "here instead; the entry is left alone (another configuration's)",
                mm_hash,
                why,
            )
        self.invalid_skipped += len(bad)

    # ------------------------------------------------------------------- worker
    # vLLM calls these on the worker role only: forwards to the worker part.

    @property
    def _worker(self) -> ECBrokerWorker:
        worker = self.connector_worker
        if worker is None:
            raise RuntimeError("EC broker: a worker hook was called on the scheduler's connector")
        return worker

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._worker.start_load_caches(encoder_cache, **kwargs)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._worker.save_caches(encoder_cache, mm_hash, **kwargs)

    def start_save_caches(self, **kwargs: Any) -> None:
        self._worker.start_save_caches(**kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> ECBrokerWorkerMetadata | None:
        return self._worker.build_connector_worker_meta(self.broker_timeouts)

    # ---------------------------------------------------------------- scheduler

    # ---------------------------------------------------------------- scheduler
    # vLLM calls these on the scheduler role only: forwards to the scheduler part.

    @property
    def _scheduler(self) -> ECBrokerScheduler:
        part = self.connector_scheduler
        if part is None:
            raise RuntimeError("EC broker: a scheduler hook was called on a worker's connector")
        return part

    def ensure_cache_available(
        self, request: Request, num_computed_tokens: int, *args: Any, **kwargs: Any
    ) -> bool:
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, ECBrokerWorkerMetadata):
            return
        watch = self.weights_watch
        if meta.identity is not None and not (watch is not None and watch.in_session):
            self._scheduler.set_field(meta.identity)  # the workers saw their weights change
        for name, delta in meta.counts.items():
            if name in STAT_FIELDS:
                self._from_workers[name] = self._from_workers.get(name, 0) + delta
