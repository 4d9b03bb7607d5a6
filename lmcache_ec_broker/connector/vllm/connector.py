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
  request waits, at most ``claim_wait_ms``. A wrong dtype or shape: a miss,
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

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

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
from lmcache_ec_broker.connector.vllm.stage_book import StageBook, StageState
from lmcache_ec_broker.connector.vllm.stage_link import (
    StageHub,
    StageItem,
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
from lmcache_ec_broker.protocol import EntryInfo, LookupState

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
CLAIM_MS = 30_000  # how long this instance's encode claim holds at most (its put ends it)
_MISS = EntryInfo(LookupState.MISS)
_T = TypeVar("_T")


@dataclass
class _Waiting:
    """A request deferred until its entries are promoted into the slab."""

    since: float
    hashes: set[str]


def _worker_count(name: str) -> property:
    """A worker counter: the worker part's own; on the scheduler, the sum the workers
    reported in their metadata (update_connector_output)."""

    def get(self: ECBrokerConnector) -> int:
        worker = self.connector_worker
        return getattr(worker, name) if worker is not None else self._from_workers.get(name, 0)

    return property(get)


class ECBrokerConnector(ECConnectorBase):
    """The scheduler side is this class; the worker side is a part it holds for the
    worker role (``connector_worker``, worker.py), the stage orders another
    (``_book``, stage_book.py): see docs/design.md, "The vLLM connector's parts"."""

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
        self._lookup_wait_ms = max(1, int(budget_ms / 2))
        self._probe_interval_s = probe_ms / 1000
        # Disaggregated encoding (the module docstring, "EPD"): which instance does what.
        self._encoder_only_producer = (
            self.is_producer
            and not self.is_consumer
            and bool(getattr(vllm_config, "is_mm_encoder_only", False))
        )
        self._fresh = self._encoder_only_producer or (self.is_consumer and not self.is_producer)
        publish_wait_ms = int(extra("publish_wait_ms", DEFAULT_PUBLISH_WAIT_MS))
        if publish_wait_ms < 0:
            raise ValueError(
                "ec_connector_extra_config: publish_wait_ms must be >= 0 "
                f"(got {publish_wait_ms}; 0 = an encoder instance does not wait)"
            )
        # Only a pure producer hands entries over to other instances: only it waits.
        self._publish_wait_ms = publish_wait_ms if self.is_producer and not self.is_consumer else 0
        self._publish: list[str] = []  # this step's items an encoder-only producer skipped
        self._lease_ms = int(extra("lease_ms", DEFAULT_LEASE_MS))
        self._max_defer_s = float(extra("max_defer_s", DEFAULT_MAX_DEFER_S))
        # In-flight deduplication (docs/design.md, "Staged loads"): an instance that
        # stores what it encodes claims the items it misses; an item another encoder
        # claimed holds the request, at most claim_wait_ms, then it is encoded here.
        claim_wait_ms = float(extra("claim_wait_ms", DEFAULT_CLAIM_WAIT_MS))
        if claim_wait_ms < 0:
            raise ValueError(
                f"ec_connector_extra_config: claim_wait_ms must be >= 0 (got {claim_wait_ms:g};"
                " 0 = never wait for another encoder)"
            )
        self._claim_wait_s = claim_wait_ms / 1000
        self._claims = self.is_producer and claim_wait_ms > 0
        self._claim_waiting: dict[str, float] = {}  # req_id -> since when it waits
        self._claimed_by: dict[str, set[str]] = {}  # req_id -> items it claimed
        # The hold bound of a staging (stage_book.py): past a worker's own bounded wait.
        worker_ms = float(extra("worker_budget_ms", DEFAULT_WORKER_BUDGET_MS))
        self._stage_wait_s = float(extra("stage_wait_ms", worker_ms + 500)) / 1000
        if self._stage_wait_s <= 0:
            raise ValueError(
                "ec_connector_extra_config: stage_wait_ms must be > 0 "
                f"(got {self._stage_wait_s * 1000:g})"
            )
        if self._lease_ms <= 0 or self._max_defer_s < 0:
            raise ValueError(
                "ec_connector_extra_config: lease_ms must be > 0 and max_defer_s >= 0 "
                f"(got lease_ms={self._lease_ms}, max_defer_s={self._max_defer_s})"
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
        # The field follows the weights in memory (weights_identity.py). Scheduler:
        # the field it keys with now, "" while unknown (misses, no loads, no stores).
        # Worker: its part's identity (worker.py).
        self._field = self._model or ""
        self._dtype = model_config.dtype
        self._dtype_name = dtype_short_name(self._dtype)
        sched = getattr(vllm_config, "scheduler_config", None)
        # How far past its computed tokens one step can take a request (the scheduler's
        # token budget, capped by the long-prefill threshold): items beyond are not
        # looked up yet.
        self._reach = int(
            getattr(sched, "max_num_scheduled_tokens", None)
            or getattr(sched, "max_num_batched_tokens", None)
            or 1 << 62
        )
        threshold = int(getattr(sched, "long_prefill_token_threshold", 0) or 0)
        if threshold > 0:
            self._reach = min(self._reach, threshold)
        self._client: BrokerClient | None = None
        self._client_pid = -1
        self._client_lock = threading.Lock()
        self._broker_up = True

        # Counters (scheduler side: lookups and their answers; worker side: loads, puts).
        self.ec_hits = 0
        self.ec_misses = 0
        self.ec_deferred = 0  # steps a request waited for a promotion
        self.promotion_failures = 0  # waited for a promotion that did not come: encoded
        self.invalid_skipped = 0  # entries of the wrong dtype/shape: misses, left alone
        self.claim_waits = 0  # steps a request waited for another encoder's claim
        self.claim_timeouts = 0  # ... that did not land within claim_wait_ms: encoded
        self._reported: dict[str, int] = {}
        # Worker counters summed from the workers' metadata (scheduler role only): the
        # one route to vLLM's EC stats on the V1 runner too (worker.py says why).
        self._from_workers: dict[str, int] = {}

        # Scheduler state. Per step: the broker's answer per mm_hash (memoised so that
        # every hook of the step sees one decision), which answers were counted, and the
        # hashes leased. Across steps: requests waiting for promotions, and the stage
        # orders (``_book``, stage_book.py); both keep their leases until they settle.
        self._step_state: dict[str, int] = {}
        self._counted: set[str] = set()
        self._step_leased: set[str] = set()
        self._waiting: dict[str, _Waiting] = {}
        self._pending_loads: list[LoadSpec] = []
        self._widths: dict[str, int] = dict(getattr(ec_config, "mm_encoder_output_widths", {}))
        # A mirror of the mm_hashes vLLM's own encoder cache holds (allocated, not yet
        # reported freed): they are never looked up. It can only be stale towards
        # "held" after vLLM's reset_encoder_cache; has_cache_item then sees a held
        # hash (vLLM asks only about items it lacks) and drops the mirror.
        self._held: set[str] = set()
        # This step's items _ahead skipped as held: mm_hash -> (embeddings, width)
        self._held_skipped: dict[str, tuple[int, int | None]] = {}

        # Whether hits may be staged and loaded at all (stage_link.loads_off_reason).
        self.loads_off = loads_off_reason(vllm_config)
        if self.loads_off and role == ECConnectorRole.SCHEDULER and self.is_consumer:
            logger.warning("EC broker: no loads in this configuration (%s); saving only", self.loads_off)
        stages = self.is_consumer and not self._encoder_only_producer and not self.loads_off
        # The scheduler's stage orders, through the engine's staging link (stage_link.py).
        self._book: StageBook | None = None
        if stages and role == ECConnectorRole.SCHEDULER:
            try:
                hub = StageHub(link_path(vllm_config), encoder_ranks(vllm_config))
            except (OSError, ValueError) as exc:
                self.loads_off = f"the staging link could not be set up: {exc}"
                logger.warning("EC broker: no loads (%s); saving only", self.loads_off)
            else:
                self._book = StageBook(hub, self._stage_wait_s)

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
                on_live_connection=self._on_live_connection,
                note_health=self._note_health,
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
            self.weights_watch = EngineWatch(self._model, self._set_field, vllm_config)
            if not watch_engine_calls():
                logger.warning(
                    "EC broker: no vLLM engine core here; the model field of the keys "
                    "follows only the weight changes the workers see"
                )
            logger.info("EC broker: model field of the keys is %s", self._model)

    # ------------------------------------------------------------------ helpers

    @property
    def model_id(self) -> str:
        """The model field of this instance's keys. On the scheduler: the field it
        adopted from the workers' fingerprint ("" while unknown). On a worker: its
        part's (``ECBrokerWorker.model_id``)."""
        if self.connector_worker is not None:
            return self.connector_worker.model_id
        return self._field

    def _set_field(self, field: str) -> None:
        """Scheduler: key with ``field`` from now on ("" = unknown). Called between
        steps (weights_identity.EngineWatch). Leases taken under the old field end
        now: their loads, if any are still to run, are refused by the workers (other
        weights) and encoded instead."""
        old = self._field
        if field == old:
            return
        logger.info(
            "EC broker: model field of the keys is now %s",
            field or "unknown (weights changing: misses until they are fingerprinted)",
        )
        held = self._needed()
        self._field = field
        if self._book is not None:  # orders keyed by the old field: encoded instead
            self._book.clear()
        if old and held and self._client is not None and self._client_pid == os.getpid():
            try:
                self._client.unlease(
                    [make_key(old, self._ids.item_key(h) or h, self._dtype) for h in held]
                )
            except Exception as exc:  # leases also end on their own (lease_ms)
                logger.warning("EC broker unlease failed: %s", exc)

    def _private(self, identifier: str) -> bool:
        """An identifier that does not name the item's content, or a tower LoRA
        adapter's item: never looked up nor stored (identifiers.py)."""
        return self._ids.item_key(identifier) is None

    def key(self, mm_hash: str) -> str:
        return make_key(self.model_id, self._ids.item_key(mm_hash) or mm_hash, self._dtype)

    def _width(self, modality: str) -> int | None:
        """The encoder's output width for ``modality``, if vLLM told it."""
        return self._widths.get(modality)

    @property
    def client(self) -> BrokerClient:
        # Lazily, and again after a fork: a socket and mapping must not be shared.
        with self._client_lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = BrokerClient(
                    self._socket_path,
                    timeout_s=self._timeout_s,
                    connect_timeout_s=self._timeout_s,
                    probe_interval_s=self._probe_interval_s,
                )
                self._client_pid = os.getpid()
                self._broker_up = True
                self._note_health(self._client)
            return self._client

    def _note_health(self, client: BrokerClient) -> None:
        """Log each transition between reachable and unreachable broker once."""
        up = client.connected
        if up == self._broker_up:
            return
        self._broker_up = up
        if up:
            logger.info("EC broker at %s is reachable again", client.socket_path)
        else:
            logger.warning(
                "EC broker not reachable at %s; serving without it (misses) "
                "and reconnecting in the background",
                client.socket_path,
            )

    def _on_live_connection(self, call: Callable[[BrokerClient], _T]) -> _T:
        """``call(client)``, once more if the connection died under it. A connection
        idle across a broker restart is found dead only when used; the retry connects
        to the new broker at once (no backoff is pending), so the first load after a
        restart does not fail its request. Only for reads: they are safe to repeat."""
        client = self.client
        result = call(client)
        if not client.connected:
            result = call(client)
        self._note_health(client)
        return result

    @property
    def broker_timeouts(self) -> int:
        """Outages that cost this process a wait (one timeout each, see BrokerClient)."""
        client = self._client
        own = client.timeouts if client is not None and self._client_pid == os.getpid() else 0
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

    @property
    def stage_timeouts(self) -> int:
        """Stagings whose hold bound passed (a worker did not answer in time)."""
        return self._book.timeouts if self._book is not None else 0

    @property
    def stage_orders(self) -> int:
        """Stage orders open now (staging, or staged and not yet shipped)."""
        return len(self._book) if self._book is not None else 0

    def wait_for_link(self, timeout_s: float) -> bool:
        """Block until every encoder rank's staging link is up, at most ``timeout_s``
        (tests and benchmarks that send a request at once; a served engine's workers
        link long before its first request). True if up (or nothing to link)."""
        book = self._book
        if book is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._settle(book.refresh())
            left = deadline - time.monotonic()
            if book.ready or left <= 0:
                return book.ready
            book.wait(min(left, 0.05))

    def wait_for_staging(self, timeout_s: float) -> None:
        """Block until every staging ordered so far is settled (staged or failed), at
        most ``timeout_s``: for a caller driving the engine's steps itself (tests,
        benchmarks), which then sees the same steps whatever the link's timing."""
        book = self._book
        if book is None:
            return
        deadline = time.monotonic() + timeout_s
        while book.staging():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            book.wait(left)
            self._settle(book.refresh())

    def shutdown(self) -> None:
        if self._book is not None:
            self._book.close()
        worker = self.connector_worker
        if worker is not None and worker.link is not None:
            worker.link.close()
        with self._client_lock:
            if self._client is not None and self._client_pid == os.getpid():
                self._client.close()
            self._client = None

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

    def ensure_cache_available(
        self, request: Request, num_computed_tokens: int, *args: Any, **kwargs: Any
    ) -> bool:
        """vLLM >= 0.24, every step before a multimodal request is scheduled: False
        holds the request for a later step while a hit is being staged on the workers
        (bounded: stage_book.py) or an entry promoted from a lower tier (``max_defer_s``);
        never on an encoder-only producer (an item on a lower tier is held by the
        fleet, it need not come here)."""
        if self._encoder_only_producer:
            expected = self._ahead(request, num_computed_tokens)
            ask = [h for h in expected if h not in self._step_state]
            if ask:
                self._lookup(ask, expected, request.request_id)
            return not self._claim_hold(request.request_id, expected)
        book = self._book
        if not self.is_consumer or self.loads_off or book is None:
            return True
        self._settle(book.refresh())
        expected = self._ahead(request, num_computed_tokens)
        ask = [h for h in expected if h not in self._step_state and book.state(h) is None]
        req_id = request.request_id
        if ask:
            self._lookup(ask, expected, req_id)
        if self._claim_hold(req_id, expected):
            return False
        # Hits the broker holds: staged on every encoder rank before they are promised.
        order = [
            StageItem(h, self.key(h), *expected[h])
            for h in expected
            if book.state(h) is not None or self._step_state.get(h) == LookupState.READY
        ]
        if order and not book.order(req_id, order):
            for item in order:  # the link is not up: these are encoded
                if book.state(item.mm_hash) is None:
                    self._step_state[item.mm_hash] = LookupState.MISS
        staging = False
        for h in expected:
            state = book.state(h)
            if state is StageState.FAILED:  # could not be staged: encoded, order ended
                book.release({h})
                self._step_state[h] = LookupState.MISS
            elif state is StageState.STAGING:
                staging = True
        waiting = self._waiting.get(req_id)
        if waiting is not None:
            # Waited for these; the broker now says MISS: the promotion failed.
            self.promotion_failures += sum(
                1 for h in waiting.hashes if self._step_state.get(h) == LookupState.MISS
            )
        pending = {h for h in expected if self._step_state.get(h) == LookupState.PENDING}
        if not pending:
            self._waiting.pop(req_id, None)
            return not staging
        now = time.monotonic()
        since = waiting.since if waiting is not None else now
        if now - since >= self._max_defer_s:
            logger.warning(
                "EC broker: %d entr%s of request %s not promoted within %.1f s; encoding instead",
                len(pending),
                "y" if len(pending) == 1 else "ies",
                req_id,
                self._max_defer_s,
            )
            self.promotion_failures += len(pending)
            for h in pending:
                self._step_state[h] = LookupState.MISS
            self._waiting.pop(req_id, None)
            return not staging
        if waiting is None:
            logger.info(
                "EC defer: request %s waits for %s (being promoted into the broker's slab)",
                req_id,
                ", ".join(f"mm_hash={h}" for h in sorted(pending)),
            )
        self._waiting[req_id] = _Waiting(since, pending)
        self.ec_deferred += 1
        return False

    def _claim_hold(self, req_id: str, expected: dict[str, tuple[int, int | None]]) -> bool:
        """Hold the request while another encoder (instance, node) has claimed one of
        its items, at most claim_wait_ms; then those are encoded here (never wrong,
        only duplicated). Each step looks them up again (with a claim): READY is
        staged, MISS is ours to encode."""
        claimed = [h for h in expected if self._step_state.get(h) == LookupState.CLAIMED]
        if not claimed:
            self._claim_waiting.pop(req_id, None)
            return False
        now = time.monotonic()
        since = self._claim_waiting.setdefault(req_id, now)
        if now - since < self._claim_wait_s:
            if since == now:
                logger.info(
                    "EC claim: request %s waits for %s (being encoded by another instance)",
                    req_id,
                    ", ".join(f"mm_hash={h}" for h in sorted(claimed)),
                )
            self.claim_waits += 1
            return True
        logger.warning(
            "EC claim: %d item(s) of request %s not encoded elsewhere within %.1f s; "
            "encoding here",
            len(claimed),
            req_id,
            self._claim_wait_s,
        )
        self.claim_timeouts += len(claimed)
        for h in claimed:
            self._step_state[h] = LookupState.MISS
        self._claim_waiting.pop(req_id, None)
        return False

    def _stage_now(self, mm_hash: str, dims: tuple[int, int | None]) -> None:
        """An item the stale mirror hid from ensure_cache_available (after vLLM's
        reset_encoder_cache, which tells connectors nothing): look it up and stage it
        while the scheduler waits, bounded by the hold bound (once per outage, as any
        staging: stage_book.py). Rare: the first step after a reset, per item."""
        book = self._book
        assert book is not None
        self._lookup([mm_hash], {mm_hash: dims})
        if self._step_state.get(mm_hash) != LookupState.READY:
            return
        if not book.order("", [StageItem(mm_hash, self.key(mm_hash), *dims)]):
            return
        self.wait_for_staging(self._stage_wait_s)
        if book.state(mm_hash) is not StageState.STAGED:
            book.release({mm_hash})

    def _settle(self, settled: set[str]) -> None:
        """Stagings that ended (staged or failed) need their broker leases no more:
        a staged tensor is on every encoder rank, a failed one is encoded."""
        if settled:
            self._step_leased -= settled
            self._unlease(settled)

    def _ahead(
        self, request: Request, num_computed_tokens: int
    ) -> dict[str, tuple[int, int | None]]:
        """The request's items this step may need, to look up: mm_hash -> (embeddings,
        the encoder's output width if known)."""
        expected: dict[str, tuple[int, int | None]] = {}
        reach = num_computed_tokens + self._reach
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already in the KV cache: no encoder output needed
            if pos.offset >= reach:
                continue  # not in this step's reach
            if feature.identifier in self._held:
                # vLLM's own encoder cache has it: never looked up nor leased (noted,
                # in case the mirror is stale: has_cache_item)
                self._held_skipped[feature.identifier] = (
                    _num_embeds(request, index),
                    self._width(feature.modality),
                )
                continue
            if self._private(feature.identifier):
                continue  # a tower LoRA adapter's item: never looked up
            if feature.identifier not in expected:
                width = self._width(feature.modality)
                expected[feature.identifier] = (_num_embeds(request, index), width)
        return expected

    def _lookup(
        self,
        hashes: list[str],
        expected: dict[str, tuple[int, int | None]],
        req_id: str | None = None,
    ) -> None:
        """One batched lookup with a lease; memoises a state per hash for the step."""
        if not self._field:  # weights changing: no field to key with yet
            for mm_hash in hashes:
                self._step_state[mm_hash] = LookupState.MISS
            return
        keys = [self.key(h) for h in hashes]
        # An encoder-only producer never loads: nothing to protect from eviction.
        lease_ms = 0 if self._encoder_only_producer else self._lease_ms
        claim_ms = CLAIM_MS if self._claims else 0
        try:
            infos = self._on_live_connection(
                lambda c: c.lookup(
                    keys,
                    lease_ms=lease_ms,
                    wait_ms=self._lookup_wait_ms,
                    fresh=self._fresh,
                    claim_ms=claim_ms,
                )
            )
        except Exception as exc:  # never take the scheduler down
            logger.warning("EC broker lookup failed: %s", exc)
            infos = [_MISS] * len(hashes)
        bad: list[tuple[str, str]] = []
        for mm_hash, info in zip(hashes, infos, strict=True):
            state = info.state
            if state in (LookupState.READY, LookupState.PENDING):
                if lease_ms:
                    self._step_leased.add(mm_hash)
                num_embeds, width = expected.get(mm_hash, (None, None))
                why = self._mismatch(info.dtype, info.shape, num_embeds, width)
                if why:
                    bad.append((mm_hash, why))
                    state = LookupState.MISS
            elif state == LookupState.CLAIMED and claim_ms:
                pass  # another encoder is on it: the request waits (_claim_hold)
            else:
                if claim_ms and state == LookupState.MISS and req_id is not None:
                    self._claimed_by.setdefault(req_id, set()).add(mm_hash)  # ours now
                state = LookupState.MISS  # including states a newer broker may invent
            self._step_state[mm_hash] = state
        if bad:
            self._delete_invalid(bad)

    def has_cache_item(self, identifier: str) -> bool:
        producer = self._encoder_only_producer
        book = self._book
        if not producer and (not self.is_consumer or self.loads_off or book is None):
            return False
        stale = identifier in self._held
        if stale:
            # vLLM asks only about items its encoder cache lacks: the mirror is stale
            # (reset_encoder_cache), so forget it; it refills from the allocations.
            self._held.clear()
        if producer:
            if self._private(identifier):
                self._step_state[identifier] = LookupState.MISS
            if identifier not in self._step_state:
                self._lookup([identifier], {})
            # A producer skips what the fleet holds anywhere.
            state = self._step_state[identifier]
            answer = state in (LookupState.READY, LookupState.PENDING)
        else:
            # A consumer promises only what every encoder rank holds staged (an item
            # ensure_cache_available did not order, or that failed, is encoded).
            assert book is not None
            dims = self._held_skipped.get(identifier)
            if stale and dims is not None and book.state(identifier) is None:
                self._stage_now(identifier, dims)
            answer = book.state(identifier) is StageState.STAGED
        if identifier not in self._counted:
            self._counted.add(identifier)
            if answer:
                self.ec_hits += 1
            else:
                self.ec_misses += 1
        return answer

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # Also called for items the scheduler chose to encode locally: only the
        # ones has_cache_item answered True for this step are external loads.
        mm_hash = request.mm_features[index].identifier
        self._held.add(mm_hash)  # encoded or loaded, vLLM's encoder cache now has it
        if self._encoder_only_producer:
            if self._step_state.get(mm_hash) in (LookupState.READY, LookupState.PENDING):
                self._publish.append(mm_hash)  # skipped: its workers publish it
            return
        book = self._book
        if book is None or book.state(mm_hash) is not StageState.STAGED:
            return
        if any(spec.mm_hash == mm_hash for spec in self._pending_loads):
            return  # one load per item and step
        modality = request.mm_features[index].modality
        self._pending_loads.append(
            LoadSpec(
                request.request_id,
                mm_hash,
                _num_embeds(request, index),
                self._width(modality),
                index,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        # Every vLLM with EC connectors passes its SchedulerOutput here. Every load goes
        # out, even one whose request was preempted later in the step: its tensor
        # moves into the encoder cache (vLLM holds the item) and its order ends.
        self._held.difference_update(getattr(scheduler_output, "free_encoder_mm_hashes", ()))
        meta = ECBrokerConnectorMetadata(
            loads=self._pending_loads,
            model=self.model_id,
            publish=self._publish,
        )
        self._publish = []
        if self._book is not None:
            for spec in self._pending_loads:
                self._book.shipped(spec.mm_hash)
            # _stage_now's orders were for this step's has_cache_item only: one vLLM
            # did not allocate after all is released here, not held until a reset.
            self._book.forget_request("")
        leased = self._step_leased
        self._pending_loads = []
        self._step_state = {}
        self._counted = set()
        self._step_leased = set()
        self._held_skipped = {}
        # Hits not staging (the request was not scheduled after all, the item was in
        # vLLM's own encoder cache, a wrong entry, staged already) protect nothing.
        self._unlease(leased)
        return meta

    def _needed(self) -> set[str]:
        needed = set(self._book.staging()) if self._book is not None else set()
        needed |= self._step_leased
        for waiting in self._waiting.values():
            needed |= waiting.hashes
        return needed

    def _unlease(self, hashes: set[str]) -> None:
        done = hashes - self._needed()
        if not done or not self.model_id:  # "": nothing was leased under a field
            return
        if self._client is None or self._client_pid != os.getpid():
            return
        try:
            self._client.unlease([self.key(h) for h in done])
        except Exception as exc:  # leases also end on their own (lease_ms)
            logger.warning("EC broker unlease failed: %s", exc)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, ECBrokerWorkerMetadata):
            return
        watch = self.weights_watch
        if meta.identity is not None and not (watch is not None and watch.in_session):
            self._set_field(meta.identity)  # the workers saw their weights change
        for name, delta in meta.counts.items():
            if name in STAT_FIELDS:
                self._from_workers[name] = self._from_workers.get(name, 0) + delta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._claim_waiting.pop(request.request_id, None)
        claimed = self._claimed_by.pop(request.request_id, None)
        if claimed and self._field and self._client is not None:
            # a claim whose put landed is gone already; one of an aborted request is
            # let go so that no other instance waits for an encode that will not come
            try:
                self._client.unclaim([self.key(h) for h in claimed])
            except Exception as exc:  # claims also end on their own (CLAIM_MS)
                logger.warning("EC broker unclaim failed: %s", exc)
        waiting = self._waiting.pop(request.request_id, None)
        if waiting is not None:  # aborted or failed while waiting for a promotion
            self._unlease(waiting.hashes)
        if self._book is not None:  # its stagings no other request waits for end
            before = self._book.staging()
            self._book.forget_request(request.request_id)
            self._unlease(before - self._book.staging())
        return False, None


def _num_embeds(request: Request, index: int) -> int:
    for name in ("get_num_encoder_embeds", "get_num_encoder_tokens"):
        method = getattr(request, name, None)
        if method is not None:
            return int(method(index))
    return int(request.mm_features[index].mm_position.length)
