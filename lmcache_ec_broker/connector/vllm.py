"""vLLM encoder-cache connector backed by the node-local broker.

Enable with::

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECBrokerConnector",
      "ec_role": "ec_both", "ec_connector_module_path": "lmcache_ec_broker.connector.vllm",
      "ec_connector_extra_config": {"socket_path": "/run/lmcache-ec/broker.sock"}}'

Extra config keys: ``socket_path`` (default: $LMCACHE_EC_BROKER_SOCKET, then the
broker's default), ``timeout_s`` (5.0), ``lease_ms`` (30000: how long a hit the
scheduler saw is protected from eviction until the worker loads it).

Flow per engine step (vLLM >= 0.15):

- scheduler ``has_cache_item``: one ``has`` with a lease; answers are memoised for
  the step so ``update_state_after_alloc`` queues exactly the items the scheduler
  decided to load (re-asking the broker could disagree with that decision).
- ``build_connector_meta`` ships ``(req_id, mm_hash, num_embeds)`` loads to workers.
- worker ``start_load_caches``: one ``get_many`` onto the runner's device.
- worker ``save_caches``: ``put`` from every TP rank; the broker's two-phase put lets
  exactly one of them copy.

If an entry the scheduler saw is gone when the worker loads it (broker restarted
or cleared in between), vLLM would raise on the missing embedding and kill the
engine. The worker instead inserts a zero placeholder so the step can run and
reports the request; the scheduler fails it via ``take_unavailable_requests``
(vLLM >= 0.31) and refuses, through ``ensure_cache_available``, to run any request
against that placeholder until the worker has repaired or dropped it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.logger import init_logger

# Hooks a given vLLM does not have are simply never called (``update_connector_output``
# and ``build_connector_worker_meta`` from 0.29, ``take_unavailable_requests`` from
# 0.31, ``ensure_cache_available`` from 0.24); only imports need a guard.
try:  # vLLM >= 0.29
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM
    ECConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

try:  # vLLM >= 0.31: stats reported here are logged as "EC Transfer metrics: ..."
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats
except ImportError:  # pragma: no cover - older vLLM
    ECConnectorStats = None  # type: ignore[assignment,misc]

from lmcache_ec_broker.connector.client import BrokerClient, BrokerRefused

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under the "vllm" logger so that vLLM's handler and format apply.
logger = init_logger("vllm.lmcache_ec_broker.connector")

DEFAULT_LEASE_MS = 30_000
MAX_UNSAVED = 4096  # mm_hashes remembered for publishing after a broker outage


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


@dataclass
class ECBrokerConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class ECBrokerWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    # mm_hash -> request ids whose load found the entry gone (placeholder inserted)
    failed: dict[str, set[str]] = field(default_factory=dict)
    # placeholders that are no longer in the worker's encoder cache (repaired or freed)
    cleared: set[str] = field(default_factory=set)

    def aggregate(self, other: Any) -> ECBrokerWorkerMetadata:
        if isinstance(other, ECBrokerWorkerMetadata):
            for mm_hash, reqs in other.failed.items():
                self.failed.setdefault(mm_hash, set()).update(reqs)
            self.cleared |= other.cleared
        return self


STAT_FIELDS = ("ec_hits", "ec_misses", "loads", "load_failures", "puts_stored", "put_errors")

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


class ECBrokerConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None  # the base class already raised otherwise
        self._socket_path: str | None = ec_config.get_from_extra_config("socket_path", None)
        self._timeout_s = float(ec_config.get_from_extra_config("timeout_s", 5.0))
        self._lease_ms = int(ec_config.get_from_extra_config("lease_ms", DEFAULT_LEASE_MS))
        model_config = vllm_config.model_config
        self._model = str(model_config.model)
        self._dtype = model_config.dtype
        self._embed_width = _embed_width(model_config)
        self._client: BrokerClient | None = None
        self._client_pid = -1
        self._client_lock = threading.Lock()
        self._broker_up = True

        # Counters (scheduler side: has_cache_item answers; worker side: loads, puts).
        self.ec_hits = 0
        self.ec_misses = 0
        self.loads = 0
        self.load_failures = 0
        self.puts_stored = 0
        self.put_errors = 0
        self._reported: dict[str, int] = {}

        # Scheduler state.
        self._step_answers: dict[str, bool] = {}
        self._pending_loads: list[LoadSpec] = []
        self._unavailable: set[str] = set()
        self._poisoned: set[str] = set()

        # Worker state.
        self._placeholders: set[str] = set()
        self._unsaved: set[str] = set()
        self._failed_this_step: dict[str, set[str]] = {}
        self._cleared_this_step: set[str] = set()

    # ------------------------------------------------------------------ helpers

    def key(self, mm_hash: str) -> str:
        return make_key(self._model, mm_hash, self._dtype)

    @property
    def client(self) -> BrokerClient:
        # Lazily, and again after a fork: a socket and mapping must not be shared.
        with self._client_lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = BrokerClient(self._socket_path, timeout_s=self._timeout_s)
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

    def stats(self) -> dict[str, int]:
        """Cumulative counters of this connector (this process, this role)."""
        return {name: getattr(self, name) for name in STAT_FIELDS}

    def get_ec_connector_stats(self) -> Any:
        if ECConnectorStats is None:
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

    # ---------------------------------------------------------------- scheduler

    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer:
            return False
        answer = self._step_answers.get(identifier)
        if answer is None:
            try:
                client = self.client
                answer = client.has([self.key(identifier)], lease_ms=self._lease_ms)[0]
                self._note_health(client)
            except Exception as exc:  # never take the scheduler down
                logger.warning("EC broker has() failed: %s", exc)
                answer = False
            self._step_answers[identifier] = answer
            if answer:
                self.ec_hits += 1
            else:
                self.ec_misses += 1
        return answer

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # Also called for items the scheduler chose to encode locally: only the
        # ones has_cache_item answered True for this step are external loads.
        mm_hash = request.mm_features[index].identifier
        if not self.is_consumer or not self._step_answers.get(mm_hash, False):
            return
        self._pending_loads.append(
            LoadSpec(request.request_id, mm_hash, _num_embeds(request, index))
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = ECBrokerConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._step_answers.clear()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, ECBrokerWorkerMetadata):
            return
        for mm_hash, req_ids in meta.failed.items():
            self._poisoned.add(mm_hash)
            self._unavailable.update(req_ids)
        self._poisoned -= meta.cleared

    def ensure_cache_available(
        self, request: Request, num_computed_tokens: int, *args: Any, **kwargs: Any
    ) -> bool:
        if not self._poisoned:
            return True
        if any(f.identifier in self._poisoned for f in request.mm_features):
            # Never run a request against a placeholder embedding; fail it (retryable).
            self._unavailable.add(request.request_id)
            return False
        return True

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        if taken:
            logger.warning(
                "EC broker: failing %d request(s) whose cached encoder output vanished", len(taken)
            )
        return taken

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ------------------------------------------------------------------- worker

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._check_placeholders(encoder_cache)
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECBrokerConnectorMetadata)
        todo: dict[str, list[LoadSpec]] = {}
        for spec in metadata.loads:
            if spec.mm_hash not in encoder_cache:
                todo.setdefault(spec.mm_hash, []).append(spec)
        if not todo:
            return
        hashes = list(todo)
        device = _runner_device()
        try:
            client = self.client
            tensors = client.get_many([self.key(h) for h in hashes], device=device)
            self._note_health(client)
        except Exception as exc:
            logger.warning("EC broker get failed: %s", exc)
            tensors = [None] * len(hashes)
        for mm_hash, tensor in zip(hashes, tensors, strict=True):
            expected = todo[mm_hash][0].num_embeds
            if tensor is not None and tensor.dim() == 2 and tensor.shape[0] == expected:
                encoder_cache[mm_hash] = tensor
                self.loads += 1
                nbytes = tensor.numel() * tensor.element_size()
                logger.info("EC load: loaded %d bytes for mm_hash=%s", nbytes, mm_hash)
                continue
            self.load_failures += 1
            logger.error(
                "EC load failed for mm_hash=%s (%s); its request(s) will be failed",
                mm_hash,
                "entry gone"
                if tensor is None
                else f"shape {tuple(tensor.shape)} != ({expected}, *)",
            )
            encoder_cache[mm_hash] = torch.zeros(
                expected, self._embed_width, dtype=self._dtype, device=device
            )
            self._placeholders.add(mm_hash)
            self._failed_this_step.setdefault(mm_hash, set()).update(
                s.req_id for s in todo[mm_hash]
            )

    def _check_placeholders(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Repair placeholders from the broker when possible; forget freed ones."""
        if not self._placeholders:
            return
        for mm_hash in list(self._placeholders):
            if mm_hash not in encoder_cache:
                self._placeholders.discard(mm_hash)
                self._cleared_this_step.add(mm_hash)
                continue
            try:
                tensor = self.client.get(self.key(mm_hash), device=encoder_cache[mm_hash].device)
            except Exception:
                tensor = None
            if tensor is not None and tensor.shape == encoder_cache[mm_hash].shape:
                encoder_cache[mm_hash] = tensor
                self._placeholders.discard(mm_hash)
                self._cleared_this_step.add(mm_hash)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if not self.is_producer:
            return
        if self._put(encoder_cache, mm_hash) is None:
            # Broker away: publish it from start_save_caches once it is back,
            # as long as vLLM still holds the output.
            if len(self._unsaved) < MAX_UNSAVED:
                self._unsaved.add(mm_hash)

    def start_save_caches(self, **kwargs: Any) -> None:
        """vLLM >= 0.31, every step on producers: retry outputs encoded while the
        broker was away (a no-op in microseconds while it still is)."""
        encoder_cache = kwargs.get("encoder_cache")
        if not self._unsaved or not self.is_producer or encoder_cache is None:
            return
        for mm_hash in list(self._unsaved):
            if mm_hash not in encoder_cache or self._put(encoder_cache, mm_hash) is not None:
                self._unsaved.discard(mm_hash)
            elif not self.client.connected:
                break

    def _put(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> bool | None:
        """True: stored; False: not stored for good (present, being stored, refused);
        None: broker unavailable, worth retrying."""
        tensor = encoder_cache.get(mm_hash)
        if tensor is None or mm_hash in self._placeholders:
            return False
        try:
            client = self.client
            stored = client.put(self.key(mm_hash), tensor.detach())
            self._note_health(client)
        except BrokerRefused as exc:
            self.put_errors += 1
            logger.warning("EC put refused for mm_hash=%s: %s", mm_hash, exc)
            return False
        except Exception as exc:
            self.put_errors += 1
            logger.warning("EC put failed for mm_hash=%s: %s", mm_hash, exc)
            return False
        if stored:
            self.puts_stored += 1
            nbytes = tensor.numel() * tensor.element_size()
            logger.info("EC put: stored %d bytes for mm_hash=%s", nbytes, mm_hash)
            return True
        return False if client.connected else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> ECBrokerWorkerMetadata | None:
        if not self._failed_this_step and not self._cleared_this_step:
            return None
        meta = ECBrokerWorkerMetadata(
            failed=self._failed_this_step, cleared=self._cleared_this_step
        )
        self._failed_this_step, self._cleared_this_step = {}, set()
        return meta


def _num_embeds(request: Request, index: int) -> int:
    for name in ("get_num_encoder_embeds", "get_num_encoder_tokens"):
        method = getattr(request, name, None)
        if method is not None:
            return int(method(index))
    return int(request.mm_features[index].mm_position.length)


def _embed_width(model_config: Any) -> int:
    getter = getattr(model_config, "get_inputs_embeds_size", None)
    if getter is not None:
        return int(getter())
    return int(model_config.get_hidden_size())


def _runner_device() -> str:
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if current_platform.is_cuda_alike():
        device = f"{device}:{torch.cuda.current_device()}"
    return device
