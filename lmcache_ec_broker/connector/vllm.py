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
from a lower tier before they are encoded instead), ``model_name`` (the model field
of the keys, followed by the configuration's fingerprint; default: the model path
plus a fingerprint of its weights, see :mod:`lmcache_ec_broker.connector.model_id`;
after an in-place weight update, plus a fingerprint of the encoder's weights in
memory, see :mod:`lmcache_ec_broker.connector.weights_identity`),
``client_uuid_namespace`` (unset: client ``multi_modal_uuids`` are never shared; set:
shared among instances with the same namespace, see
:mod:`lmcache_ec_broker.connector.identifiers`), ``publish_wait_ms`` (2000; an
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

Flow per engine step (vLLM >= 0.24; older versions skip the first hook):

- scheduler ``ensure_cache_available`` (per multimodal request): one ``lookup``
  with a lease for the request's items still ahead of its computed tokens, within
  this step's reach (its token budget) and not held by vLLM's own encoder cache
  (mirrored from ``update_state_after_alloc`` and the step's freed hashes).
  READY with the expected dtype and shape: a hit. PENDING (being promoted from
  the disk tier): the request waits for a later step, so the worker's load never
  waits on a promotion. A wrong dtype or shape: a miss, counted, and this request
  encodes the item; the entry is left alone (never deleted: it is another
  configuration's). Answers are memoised for the step.
- scheduler ``has_cache_item`` answers from that memo (asking the broker itself
  only if vLLM did not call the hook above); ``update_state_after_alloc`` queues
  exactly the items answered True.
- ``build_connector_meta`` ships ``(req_id, mm_hash, num_embeds)`` loads to workers
  and ends the leases that protect nothing any more (hits not loaded this step).
- worker ``start_load_caches``: one ``get_many`` onto the runner's device; the
  worker reports the hashes it handled, and ``update_connector_output`` ends their
  leases (``start_load_caches`` is synchronous in the step). ``request_finished``
  ends the leases of a request that stops while it waits.
- worker ``save_caches``: ``put`` from every TP rank; the broker's two-phase put lets
  exactly one of them copy.

If an entry the scheduler counted as a hit is gone (or wrong) when the worker
loads it, the worker has the runner encode the item in the same step: it adds the
failed ``(request, item index)`` to the ``scheduled_encoder_inputs`` of the
``SchedulerOutput`` the runner is executing (found in the frame of vLLM's EC wrapper
that calls ``start_load_caches``, ``runner_step.py``), so this holds however the
metadata travels (one message with the output, or apart from it). Under
tensor parallelism the ranks first agree (through shared memory with a bounded wait
when the TP ranks share a host, else a max all-reduce over the TP group's CPU group:
connector/tp_agree.py) so that every rank runs the encoder on the same items. Nothing is ever
inserted that the model did not compute; no request is failed; see
docs/design.md, "A load that fails".

The worker side (loads, puts, the re-encode of a failed load) is a part this
connector holds for the worker role, ``vllm_worker.ECBrokerWorker``; which loads
ship with a step, another, ``step_guard.StepGuard`` (docs/design.md, "The vLLM
connector's parts"); the messages between the two sides and the key format are in
``vllm_meta.py``.
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
from lmcache_ec_broker.connector.extra_config import check_extra_config
from lmcache_ec_broker.connector.identifiers import IdentifierPolicy
from lmcache_ec_broker.connector.model_id import (
    check_model_name,
    config_fingerprint,
    model_id,
    with_config,
)
from lmcache_ec_broker.connector.step_guard import StepGuard
from lmcache_ec_broker.connector.vllm_meta import (  # noqa: F401 - re-exported
    STAT_FIELDS,
    ECBrokerConnectorMetadata,
    ECBrokerStats,
    ECBrokerWorkerMetadata,
    ECConnectorStats,
    LoadSpec,
    dtype_short_name,
    make_key,
)
from lmcache_ec_broker.connector.vllm_worker import ECBrokerWorker, logger
from lmcache_ec_broker.connector.weights_identity import (
    EngineWatch,
    track_model_loads,
    watch_engine_calls,
)
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
    worker role (``connector_worker``, vllm_worker.py), the step's load rules another
    (``step_guard``, step_guard.py): see docs/design.md, "The vLLM connector's parts"."""

    # The worker part's class (a test injecting faults subclasses it).
    worker_class: type[ECBrokerWorker] = ECBrokerWorker
    loads = _worker_count("loads")
    load_failures = _worker_count("load_failures")
    reencoded = _worker_count("reencoded")
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
        # Worker: its part's identity (vllm_worker.py).
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
        self._reported: dict[str, int] = {}
        # Worker counters summed from the workers' metadata (scheduler role only): the
        # one route to vLLM's EC stats on the V1 runner too (vllm_worker.py says why).
        self._from_workers: dict[str, int] = {}

        # Scheduler state. Per step: the broker's answer per mm_hash (memoised so that
        # every hook of the step sees one decision), which answers were counted, and the
        # hashes leased. Across steps: requests waiting for promotions and loads the
        # worker has not reported yet; both keep their leases.
        self._step_state: dict[str, int] = {}
        self._counted: set[str] = set()
        self._step_leased: set[str] = set()
        self._waiting: dict[str, _Waiting] = {}
        # mm_hash -> [steps that shipped its load and the worker has not reported done,
        # when the last of them was shipped]
        self._inflight: dict[str, list[float]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._widths: dict[str, int] = dict(getattr(ec_config, "mm_encoder_output_widths", {}))
        # A mirror of the mm_hashes vLLM's own encoder cache holds (allocated, not yet
        # reported freed): they are never looked up. It can only be stale towards
        # "held" after vLLM's reset_encoder_cache; has_cache_item then sees a held
        # hash (vLLM asks only about items it lacks) and drops the mirror.
        self._held: set[str] = set()

        # Which loads may be promised and shipped (step_guard.py).
        self.step_guard = StepGuard(vllm_config, self._width)
        self.loads_off = self.step_guard.loads_off
        if self.loads_off and role == ECConnectorRole.SCHEDULER and self.is_consumer:
            logger.warning("EC broker: no loads in this configuration (%s); saving only", self.loads_off)

        # The worker side: a part of its own, given what it reads (vllm_worker.py).
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
        self._inflight.clear()
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

    def shutdown(self) -> None:
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
        defers the request to a later step (never on an encoder-only producer: an
        item on a lower tier is held by the fleet, it need not come here)."""
        if self._encoder_only_producer:
            expected = self._ahead(request, num_computed_tokens)
            ask = [h for h in expected if h not in self._step_state]
            if ask:
                self._lookup(ask, expected)
            return True
        if not self.is_consumer or self.loads_off:
            return True
        expected = self._ahead(request, num_computed_tokens)
        for h in self.step_guard.note_request(request, num_computed_tokens):
            # inputs released on the worker: a load could not be re-encoded
            self._step_state.setdefault(h, LookupState.MISS)
        ask = [h for h in expected if h not in self._step_state]
        if ask:
            self._lookup(ask, expected)
        req_id = request.request_id
        waiting = self._waiting.get(req_id)
        if waiting is not None:
            # Waited for these; the broker now says MISS: the promotion failed.
            self.promotion_failures += sum(
                1 for h in waiting.hashes if self._step_state.get(h) == LookupState.MISS
            )
        pending = {h for h in expected if self._step_state.get(h) == LookupState.PENDING}
        if not pending:
            self._waiting.pop(req_id, None)
            return True
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
            return True
        if waiting is None:
            logger.info(
                "EC defer: request %s waits for %s (being promoted into the broker's slab)",
                req_id,
                ", ".join(f"mm_hash={h}" for h in sorted(pending)),
            )
        self._waiting[req_id] = _Waiting(since, pending)
        self.ec_deferred += 1
        return False

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
                continue  # vLLM's own encoder cache has it: never looked up nor leased
            if self._private(feature.identifier):
                continue  # a tower LoRA adapter's item: never looked up
            if feature.identifier not in expected:
                width = self._width(feature.modality)
                expected[feature.identifier] = (_num_embeds(request, index), width)
        return expected

    def _lookup(self, hashes: list[str], expected: dict[str, tuple[int, int | None]]) -> None:
        """One batched lookup with a lease; memoises a state per hash for the step."""
        if not self._field:  # weights changing: no field to key with yet
            for mm_hash in hashes:
                self._step_state[mm_hash] = LookupState.MISS
            return
        keys = [self.key(h) for h in hashes]
        # An encoder-only producer never loads: nothing to protect from eviction.
        lease_ms = 0 if self._encoder_only_producer else self._lease_ms
        try:
            infos = self._on_live_connection(
                lambda c: c.lookup(
                    keys, lease_ms=lease_ms, wait_ms=self._lookup_wait_ms, fresh=self._fresh
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
            else:
                state = LookupState.MISS  # including states a newer broker may invent
            self._step_state[mm_hash] = state
        if bad:
            self._delete_invalid(bad)

    def has_cache_item(self, identifier: str) -> bool:
        producer = self._encoder_only_producer
        if not producer and (not self.is_consumer or self.loads_off):
            return False
        if identifier in self._held:
            # vLLM asks only about items its encoder cache lacks: the mirror is stale
            # (reset_encoder_cache), so forget it; it refills from the allocations.
            self._held.clear()
        if self._private(identifier):
            self._step_state[identifier] = LookupState.MISS
        if identifier not in self._step_state:
            # vLLM did not call ensure_cache_available (older than 0.24) for this item:
            # without a way to defer, an entry still on a lower tier is encoded instead.
            self._lookup([identifier], {})
        state = self._step_state[identifier]
        # A producer skips what the fleet holds anywhere; a consumer loads only from the slab.
        answer = state == LookupState.READY or (producer and state == LookupState.PENDING)
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
        if not self.is_consumer or self._step_state.get(mm_hash) != LookupState.READY:
            return
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
        # Every vLLM with EC connectors passes its SchedulerOutput here.
        self._pending_loads = self.step_guard.guard_loads(scheduler_output, self._pending_loads)
        encoder_inputs = getattr(scheduler_output, "scheduled_encoder_inputs", None)
        self._held.difference_update(getattr(scheduler_output, "free_encoder_mm_hashes", ()))
        meta = ECBrokerConnectorMetadata(
            loads=self._pending_loads,
            encoder_inputs=encoder_inputs,
            model=self.model_id,
            publish=self._publish,
        )
        self._publish = []
        now = time.monotonic()
        if self._inflight:
            # A report that never came (a failed step): the broker ended that lease at
            # lease_ms anyway, so stop holding later leases of the hash for it.
            expired = now - self._lease_ms / 1000
            for mm_hash in [h for h, (_, t) in self._inflight.items() if t < expired]:
                del self._inflight[mm_hash]
        for mm_hash in {spec.mm_hash for spec in self._pending_loads}:
            count = self._inflight[mm_hash][0] if mm_hash in self._inflight else 0
            self._inflight[mm_hash] = [count + 1, now]
        leased = self._step_leased
        self._pending_loads = []
        self._step_state = {}
        self._counted = set()
        self._step_leased = set()
        # Hits not loaded this step (the request was not scheduled after all, the item
        # was in vLLM's own encoder cache, a wrong entry) protect nothing any more.
        self._unlease(leased)
        return meta

    def _needed(self) -> set[str]:
        needed = set(self._inflight) | self._step_leased
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
        ended = set()
        for mm_hash in meta.done:
            entry = self._inflight.get(mm_hash)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] <= 0:
                del self._inflight[mm_hash]
                ended.add(mm_hash)
        self._unlease(ended)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        waiting = self._waiting.pop(request.request_id, None)
        if waiting is not None:  # aborted or failed while waiting for a promotion
            self._unlease(waiting.hashes)
        return False, None


def _num_embeds(request: Request, index: int) -> int:
    for name in ("get_num_encoder_embeds", "get_num_encoder_tokens"):
        method = getattr(request, name, None)
        if method is not None:
            return int(method(index))
    return int(request.mm_features[index].mm_position.length)
