"""The worker side of the vLLM connector (``vllm.py``): loads and puts.

``ECBrokerWorker`` is a part the connector holds for the worker role (as vLLM's
own connectors hold a worker delegate); it is given what it reads. Its promises:

- a load never takes the worker down and never inserts what the model did not
  compute: an entry gone, of the wrong dtype/shape, or a broker away makes the
  runner encode the item in the same step (``_encode_instead``), on every TP rank
  alike (``union_over_tp``);
- a put never fails the step: refused or failed puts are counted and logged; one
  the broker was away for is retried from ``start_save_caches`` once it is back,
  while vLLM still holds the output (at most ``MAX_UNSAVED`` hashes);
- a pure producer (``publish_wait_ms`` > 0) ends no step before the broker said the
  step's puts, and the items its scheduler skipped as held by the fleet, are visible
  fleet-wide (``get_finished``, the last hook of a step on every vLLM runner, before
  the step's output -- and a finished request's answer -- leaves), or
  ``publish_wait_ms`` passed: then counted and logged, never failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from lmcache_ec_broker.connector.client import BrokerClient, BrokerRefused
from lmcache_ec_broker.connector.model_id import model_id
from lmcache_ec_broker.connector.runner_step import runner_step
from lmcache_ec_broker.connector.tp_agree import union_over_tp
from lmcache_ec_broker.connector.vllm_meta import (
    WORKER_STAT_FIELDS,
    ECBrokerConnectorMetadata,
    ECBrokerWorkerMetadata,
    LoadSpec,
    dtype_short_name,
    make_key,
)
from lmcache_ec_broker.connector.weights_identity import TRACKER, DigestFailed, settle_field
from lmcache_ec_broker.protocol import PublishState

# The connector's one logger (vllm.py uses it too): vLLM's handler and format.
logger = init_logger("vllm.lmcache_ec_broker.connector")

MAX_UNSAVED = 4096  # mm_hashes remembered for publishing after a broker outage


class ECBrokerWorker:
    """The connector's worker side (vLLM's worker role): created by
    ``ECBrokerConnector`` for that role, which forwards its worker hooks here in one
    line each. It owns its state: the hashes handled this step, outputs waiting for a
    broker outage to end, this worker's model field (``identity``, set by
    ``weights_identity.worker_identity``) and the worker counters. What it reads of
    the connector it is given here, as callables: the step's bound metadata, the
    broker client (per process, lazily) and the connector's shared helpers."""

    def __init__(
        self,
        *,
        is_producer: bool,
        dtype: torch.dtype,
        model: str | None,
        model_source: tuple[str, str | None],
        bound_metadata: Callable[[], Any],
        client: Callable[[], BrokerClient],
        on_live_connection: Callable[[Callable[[BrokerClient], Any]], Any],
        note_health: Callable[[BrokerClient], None],
        mismatch: Callable[[str, list[int], int | None, int | None], str],
        delete_invalid: Callable[[list[tuple[str, str]]], None],
        private: Callable[[str], bool],
        publish_wait_ms: int = 0,
        item_key: Callable[[str], str | None] | None = None,
    ) -> None:
        self.is_producer = is_producer
        self._dtype = dtype
        # The scheduler is the one source of the model field (vllm.py): an explicit
        # model_name, else the field of each step's metadata, kept for later.
        self._model = model
        self._model_source = model_source
        self._bound_metadata = bound_metadata
        self._client = client
        self._on_live_connection = on_live_connection
        self._note_health = note_health
        self._mismatch = mismatch
        self._delete_invalid = delete_invalid
        self._private = private
        self._item_key = item_key  # identifiers.IdentifierPolicy.item_key
        # The field this worker's last fingerprint gave (None until the scheduler
        # asked: weights_identity.worker_identity), and the first fingerprint.
        self.identity: str | None = None
        self._weights_seen = 0  # weights_identity.TRACKER.version last fingerprinted
        self._identity_told: str | None = None  # the identity last sent to the scheduler
        self._base: str | None = None  # the field of the weights as loaded
        self._unsaved: set[str] = set()  # put while the broker was away (<= MAX_UNSAVED)
        self._done_this_step: set[str] = set()  # reported to the scheduler (leases end)
        self._publish_wait_ms = publish_wait_ms  # > 0: a pure producer's steps publish
        self._put_this_step: list[str] = []  # mm_hashes put this step (to publish)
        # Counters (the connector's stats() reads them).
        self.loads = 0
        self.load_failures = 0
        self.reencoded = 0  # failed loads encoded in the same step instead
        self.puts_stored = 0
        self.put_errors = 0
        self.puts_skipped = 0  # broker unavailable: not waited for (retried once it is back)
        self.published = 0  # entries a step's publish found visible fleet-wide
        self.publish_failures = 0  # ... and not (failed, absent, timed out, broker away)
        self._told: dict[str, int] = {}  # counter values sent in the last metadata

    # ------------------------------------------------------------ identity, keys

    @property
    def model_id(self) -> str:
        """The field of this worker's own last fingerprint; before the scheduler asked
        for one, the scheduler's, from the step's metadata, kept for later; computed
        here (lazily, after load_model) only if vLLM calls a hook before any step told
        it (encoder-decoder models save outside the step's metadata)."""
        if self.identity is not None:
            return self.identity
        meta = self._bound_metadata()
        if isinstance(meta, ECBrokerConnectorMetadata) and meta.model:
            self._model = meta.model
        elif self._model is None:
            self._model = model_id(*self._model_source)
        return self._model

    def key(self, mm_hash: str) -> str:
        item = self._item_key(mm_hash) if self._item_key is not None else mm_hash
        return make_key(self.model_id, item or mm_hash, self._dtype)

    def base_field(self) -> str:
        """The field of the weights as loaded (files and configuration, or
        ``model_name``): what the scheduler keys with before any weight change."""
        if self._base is None:
            self._base = self._model if self._model is not None else model_id(*self._model_source)
        return self._base

    def check_weights(self) -> None:
        """Before a step's loads or stores: fingerprint again if ``load_weights`` ran on
        the model since the last fingerprint (an integer compare otherwise). Every TP
        rank runs the same hooks in the same step, and vLLM and RL frameworks call
        ``load_weights`` on every rank: the ranks reach the digest's all-gather together."""
        model = TRACKER.model
        if model is None or TRACKER.version == self._weights_seen:
            return
        self.refresh_identity(model, self.base_field())

    def refresh_identity(self, model: Any, base: str) -> str | None:
        """Fingerprint ``model`` now (every TP rank together), key with the field it
        gives and return it ("" if a rank could not fingerprint: no loads, no stores;
        None if this worker holds no encoder: it keys with the scheduler's field)."""
        version = TRACKER.version
        try:
            field = settle_field(model, base)
        except DigestFailed as exc:
            logger.error("EC broker: %s; no loads or stores until it can", exc)
            field = ""
        self._weights_seen = version
        # Outputs waiting for a broker outage to end were computed by other weights:
        # adopt_identity drops them when the field changes.
        if self.adopt_identity(field) and field is not None:
            logger.info(
                "EC broker: model field of this worker's keys is now %s", field or "unknown"
            )
        return field

    def adopt_identity(self, field: str | None) -> bool:
        """Key with ``field`` from now on; True if it changed. Outputs waiting for a
        broker outage to end were computed by other weights then: dropped."""
        changed = field != self.identity
        if changed:
            self._unsaved.clear()
        self.identity = field
        return changed

    def keys_agree(self) -> bool:
        """May this step load or store? Only if the scheduler's field (the bound
        metadata's) is known and is this worker's own: entries are keyed by the
        weights that computed them, never by weights another process believes in."""
        meta = self._bound_metadata()
        if not isinstance(meta, ECBrokerConnectorMetadata):
            return True  # a hook outside a step (encoder-decoder saves)
        return bool(meta.model) and (self.identity is None or meta.model == self.identity)

    # ------------------------------------------------------------------- hooks

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.check_weights()
        metadata = self._bound_metadata()
        assert isinstance(metadata, ECBrokerConnectorMetadata)
        if not metadata.loads:
            return
        todo: dict[str, list[LoadSpec]] = {}
        for spec in metadata.loads:
            self._done_this_step.add(spec.mm_hash)
            todo.setdefault(spec.mm_hash, []).append(spec)
        missing = [h for h in todo if h not in encoder_cache]
        here: set[str] = set()
        if missing:
            # Weights changed under the scheduler's field (weights_identity.py): encode.
            here = (
                set(missing)
                if not self.keys_agree()
                else self._load(encoder_cache, {h: todo[h][0] for h in missing})
            )
        # Every rank, even one with nothing to load: the metadata, hence the call, is
        # the same on all ranks of the TP group.
        failed = union_over_tp(list(todo), here)
        if failed:
            specs = {h: todo[h][0] for h in failed}
            self._encode_instead(encoder_cache, metadata, specs, failed - here)

    def fetch(self, keys: list[str], device: str) -> list[torch.Tensor | None]:
        """The entries under ``keys`` on ``device``; None where one cannot be had."""
        try:
            return self._on_live_connection(lambda c: c.get_many(keys, device=device))
        except Exception as exc:  # never take the worker down: the items are encoded
            logger.warning("EC broker get failed: %s", exc)
            return [None] * len(keys)

    def _load(self, encoder_cache: dict[str, torch.Tensor], specs: dict[str, LoadSpec]) -> set[str]:
        """Load ``specs`` into ``encoder_cache``; the hashes that could not be loaded."""
        hashes = list(specs)
        tensors = self.fetch([self.key(h) for h in hashes], _runner_device())
        failed: set[str] = set()
        invalid: list[tuple[str, str]] = []
        for mm_hash, tensor in zip(hashes, tensors, strict=True):
            spec = specs[mm_hash]
            why = "entry gone or broker unavailable"
            if tensor is not None:
                why = self._mismatch(
                    dtype_short_name(tensor.dtype), list(tensor.shape), spec.num_embeds, spec.width
                )
                if not why:
                    encoder_cache[mm_hash] = tensor
                    self.loads += 1
                    nbytes = tensor.numel() * tensor.element_size()
                    logger.info("EC load: loaded %d bytes for mm_hash=%s", nbytes, mm_hash)
                    continue
                invalid.append((mm_hash, why))
            self.load_failures += 1
            logger.warning("EC load failed for mm_hash=%s (%s)", mm_hash, why)
            failed.add(mm_hash)
        if invalid:
            self._delete_invalid(invalid)
        return failed

    def _encode_instead(
        self,
        encoder_cache: dict[str, torch.Tensor],
        metadata: ECBrokerConnectorMetadata,
        specs: dict[str, LoadSpec],
        elsewhere: set[str],
    ) -> None:
        """Have the runner encode ``specs`` in this step: it encodes the step's
        ``scheduled_encoder_inputs`` right after this hook returns, from the request's
        own multimodal inputs, then puts the outputs (save_caches) as for any miss.

        The dict written is the runner's own (``runner_step``: the SchedulerOutput in
        the calling frame whose metadata is the bound one), so it holds however the
        metadata travelled; only if that cannot be found, the metadata's reference
        (the same dict when both travel as one message, as every vLLM executor does).
        A spec whose request is not in the runner's step is not added (the V2 runner
        no longer holds a request preempted in its step: a KeyError in its encoder);
        the scheduler never ships one (``StepGuard``)."""
        step = runner_step(metadata)
        if step is not None:
            inputs = step.scheduled_encoder_inputs
            scheduled = step.num_scheduled_tokens
        else:
            inputs = metadata.encoder_inputs
            scheduled = None
            if inputs is None:  # never with vLLM; a caller that built the metadata by hand
                raise RuntimeError(
                    "EC load failed and the step's scheduled_encoder_inputs are unknown: pass "
                    "vLLM's SchedulerOutput to build_connector_meta"
                )
            logger.warning(
                "EC load failed and the runner's SchedulerOutput was not found above "
                "start_load_caches: re-encoding through the metadata's reference"
            )
        for mm_hash, spec in specs.items():
            if scheduled is not None and spec.req_id not in scheduled:
                logger.error(
                    "EC load of mm_hash=%s failed for request %s, which is not in this step: "
                    "not re-encoded",
                    mm_hash,
                    spec.req_id,
                )
                continue
            # A rank that did load it drops its copy: all ranks must encode the same items
            # (and vLLM's v2 runner skips items already in its cache).
            encoder_cache.pop(mm_hash, None)
            # A new list: in-process executors share the scheduler's own lists.
            inputs[spec.req_id] = sorted({*inputs.get(spec.req_id, ()), spec.index})
            self.reencoded += 1
            logger.warning(
                "EC load of mm_hash=%s failed%s; request %s encodes it in this step",
                mm_hash,
                " on another TP rank" if mm_hash in elsewhere else "",
                spec.req_id,
            )

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self.check_weights()
        if not self.is_producer or not self.keys_agree() or self._private(mm_hash):
            return
        if self._put(encoder_cache, mm_hash) is None:
            # Broker away: publish it from start_save_caches once it is back,
            # as long as vLLM still holds the output.
            if len(self._unsaved) < MAX_UNSAVED:
                self._unsaved.add(mm_hash)

    def start_save_caches(self, **kwargs: Any) -> None:
        """vLLM >= 0.31, every step on producers: retry outputs encoded while the
        broker was away (a no-op in microseconds while it still is)."""
        self.check_weights()
        encoder_cache = kwargs.get("encoder_cache")
        if not self._unsaved or not self.is_producer or encoder_cache is None:
            return
        if not self.keys_agree():  # weights changed since: never stored under this field
            self._unsaved.clear()
            return
        for mm_hash in list(self._unsaved):
            if mm_hash not in encoder_cache or self._put(encoder_cache, mm_hash) is not None:
                self._unsaved.discard(mm_hash)
            elif not self._client().connected:
                break

    def _put(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> bool | None:
        """True: stored; False: not stored for good (present, being stored, refused);
        None: broker unavailable, worth retrying."""
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return False
        if self._publish_wait_ms > 0:
            self._put_this_step.append(mm_hash)
        try:
            client = self._client()
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
        if client.connected:
            return False
        self.puts_skipped += 1
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._publish_wait_ms > 0:
            self._publish_step()
        return None, None

    def _publish_step(self) -> None:
        """Wait until the step's puts and skipped items are visible fleet-wide."""
        meta = self._bound_metadata()
        skipped = meta.publish if isinstance(meta, ECBrokerConnectorMetadata) else []
        hashes = list(dict.fromkeys([*self._put_this_step, *skipped]))
        self._put_this_step = []
        hashes = [h for h in hashes if not self._private(h)]
        if not hashes or not self.keys_agree():
            return
        keys = [self.key(h) for h in hashes]
        try:
            client = self._client()
            states = client.publish(keys, self._publish_wait_ms)
            self._note_health(client)
        except Exception as exc:  # never take the worker down
            logger.warning("EC publish failed: %s", exc)
            states = None
        if states is None:  # broker away: the puts were skipped too (counted there)
            self.publish_failures += len(keys)
            return
        bad = [h for h, st in zip(hashes, states, strict=True) if st != PublishState.PUBLISHED]
        self.published += len(hashes) - len(bad)
        if bad:
            self.publish_failures += len(bad)
            logger.warning(
                "EC publish: %d of %d entr%s not visible to the fleet within %d ms "
                "(the broker's log says why): instances on other nodes encode %s",
                len(bad),
                len(hashes),
                "y" if len(hashes) == 1 else "ies",
                self._publish_wait_ms,
                ", ".join(f"mm_hash={h}" for h in bad[:8]),
            )

    def build_connector_worker_meta(
        self, broker_timeouts: int = 0
    ) -> ECBrokerWorkerMetadata | None:
        """The step's handled hashes and the counters' deltas since the last call.

        The counters go to vLLM's EC stats this way, through the scheduler's connector
        (update_connector_output, get_ec_connector_stats), because it is the one route
        both runners take: vLLM 0.32's V1 runner never calls a worker's
        get_ec_connector_stats (only V2's ActiveECConnector does), but both put this
        metadata into the step's ECConnectorOutput, which the scheduler hands to its
        connector before it collects that connector's stats. (V1 drops the whole
        output of a producer-only instance: make_empty_encoder_model_runner_output.)"""
        now = {name: getattr(self, name) for name in WORKER_STAT_FIELDS}
        now["broker_timeouts"] = broker_timeouts
        told = self._told
        counts = {k: v - told.get(k, 0) for k, v in now.items() if v != told.get(k, 0)}
        # A field this worker found itself (check_weights): the scheduler adopts it.
        identity = self.identity if self.identity != self._identity_told else None
        if not self._done_this_step and not counts and identity is None:
            return None
        self._told = now
        self._identity_told = self.identity
        meta = ECBrokerWorkerMetadata(done=self._done_this_step, counts=counts, identity=identity)
        self._done_this_step = set()
        return meta


def _runner_device() -> str:
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if current_platform.is_cuda_alike():
        device = f"{device}:{torch.cuda.current_device()}"
    return device
