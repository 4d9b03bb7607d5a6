"""The worker side of the vLLM connector (``connector.py``): loads and puts.

``ECBrokerWorker`` is a part the connector holds for the worker role (as vLLM's
own connectors hold a worker delegate); it is given what it reads. Its promises:

- a load cannot fail: the item was staged on this worker's device before the
  scheduler promised it (``start_staging``: the link's thread copies each ordered
  entry from the broker, checks it, holds it; stage_link.py), and
  ``start_load_caches`` only moves the held tensor into vLLM's encoder cache. An
  entry gone, of the wrong dtype/shape, keyed by other weights, or a broker away
  fails the *staging*: the scheduler then has vLLM encode the item (never inserted
  is what the model did not compute);
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
from lmcache_ec_broker.connector.vllm.meta import (
    WORKER_STAT_FIELDS,
    ECBrokerConnectorMetadata,
    ECBrokerWorkerMetadata,
    dtype_short_name,
    make_key,
)
from lmcache_ec_broker.connector.vllm.model_id import model_id
from lmcache_ec_broker.connector.vllm.stage_link import StageItem, StageLink
from lmcache_ec_broker.connector.vllm.tp_digest import DigestFailed, settle_field
from lmcache_ec_broker.connector.vllm.weights_identity import TRACKER
from lmcache_ec_broker.protocol import PublishState

# The connector's one logger (connector.py uses it too): vLLM's handler and format.
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
        model_source: tuple[Any, ...],
        bound_metadata: Callable[[], Any],
        client: Callable[[], BrokerClient],
        on_live_read_connection: Callable[[Callable[[BrokerClient], Any]], Any],
        note_health: Callable[[BrokerClient], None],
        mismatch: Callable[[str, list[int], int | None, int | None], str],
        delete_invalid: Callable[[list[tuple[str, str]]], None],
        private: Callable[[str], bool],
        publish_wait_ms: int = 0,
        item_key: Callable[[str], str | None] | None = None,
    ) -> None:
        self.is_producer = is_producer
        self._dtype = dtype
        # The scheduler is the one source of the model field (connector.py): an explicit
        # model_name, else the field of each step's metadata, kept for later.
        self._model = model
        self._model_source = model_source
        self._bound_metadata = bound_metadata
        self._client = client
        # Reads (the staging thread's; fetch's rare in-step fallback too): a client of
        # their own, so a copy never holds up the step's puts (process_clients.py)
        self._on_live_read_connection = on_live_read_connection
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
        self.link: StageLink | None = None  # the staging link (start_staging)
        self._device = "cpu"
        self._publish_wait_ms = publish_wait_ms  # > 0: a pure producer's steps publish
        self._put_this_step: list[str] = []  # mm_hashes put this step (to publish)
        # Counters (the connector's stats() reads them).
        self.loads = 0
        self.staged = 0  # entries staged on this worker's device
        self.load_failures = 0  # stage orders this worker could not stage (encoded)
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

    def check_weights(self) -> bool:
        """Before a step's loads or stores: fingerprint again if ``load_weights`` ran on
        the model since the last fingerprint (an integer compare otherwise). Every TP
        rank runs the same hooks in the same step, and vLLM and RL frameworks call
        ``load_weights`` on every rank: the ranks reach the digest's all-gather together.
        True if this worker's field changed."""
        model = TRACKER.model
        if model is None or TRACKER.version == self._weights_seen:
            return False
        before = self.identity
        return self.refresh_identity(model, self.base_field()) != before

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

    def start_staging(self, path: str) -> None:
        """Link to the scheduler's hub (stage_link.py) if this worker runs the encoder
        (the first pipeline stage); its TP rank says which reports are its own."""
        rank, first_stage = _ranks()
        if first_stage:
            self._device = _runner_device()
            self.link = StageLink(path, rank, self._stage_fetch, self._prepare_reads)

    def _prepare_reads(self) -> None:
        """The link's thread, before it links: the staging client connected, the slab
        mapped and, on a GPU, registered with CUDA (each takes a while for a slab of
        GiBs), so the first staged hit does not pay for them within ``stage_wait_ms``.
        Only this thread uses that client. Raises during an outage."""
        slab = self._on_live_read_connection(lambda c: c.slab())
        slab.prepare_device(torch.device(self._device))

    def _stage_fetch(self, items: list[StageItem]) -> list[torch.Tensor | str]:
        """The link's thread: the ordered entries on this worker's device, checked (the
        model field is this worker's own, dtype and shape the item's); else why not."""
        out: list[torch.Tensor | str] = []
        fetch = []
        # load_weights ran since the last fingerprint (the step thread takes the next
        # one, every rank together): the field of the weights now is not known yet.
        # Never fingerprinted yet: the weights as loaded are what the base field keys.
        seen = self._weights_seen or TRACKER.loaded_version
        changing = TRACKER.model is not None and TRACKER.version != seen
        for item in items:
            field = item.key.split("@", 1)[0]
            if changing:
                out.append("weights changed, not fingerprinted yet")  # encoded
            elif self.identity is not None and field != self.identity:
                out.append("keyed by other weights")  # weights changed: encoded
            else:
                out.append("")
                fetch.append(item)
        tensors = iter(self.fetch([i.key for i in fetch], self._device)) if fetch else iter(())
        invalid: list[tuple[str, str]] = []
        for n, item in enumerate(items):
            if out[n]:
                self.load_failures += 1
                continue
            tensor = next(tensors)
            why = "entry gone or broker unavailable"
            if tensor is not None:
                why = self._mismatch(
                    dtype_short_name(tensor.dtype), list(tensor.shape), item.num_embeds, item.width
                )
                if not why:
                    out[n] = tensor
                    self.staged += 1
                    continue
                invalid.append((item.mm_hash, why))
            out[n] = why
            self.load_failures += 1
            logger.warning("EC staging failed for mm_hash=%s (%s): encoded", item.mm_hash, why)
        if invalid:
            self._delete_invalid(invalid)
        return out

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Move each shipped load's staged tensor into the encoder cache. The scheduler
        ships a load only once every encoder rank reported the item staged, and the
        tensor stays held until this takes it (stage_book.py): this cannot fail.

        A weight change this worker sees first here (``load_weights`` called on the
        model directly) cannot reach a staged tensor fetched after it (``_stage_fetch``
        refuses while a change is not fingerprinted); one staged just before it is
        inserted, as vLLM's own encoder cache keeps what it holds across such a call,
        and the new field keys every lookup from this step on."""
        if self.check_weights():
            logger.warning(
                "EC broker: weights changed under %d shipped load(s); they were staged "
                "before the change and are inserted (as vLLM's encoder cache keeps its "
                "entries); lookups use the new field from now on",
                len(self._bound_loads()),
            )
        metadata = self._bound_metadata()
        assert isinstance(metadata, ECBrokerConnectorMetadata)
        for spec in {s.mm_hash: s for s in metadata.loads}.values():
            tensor = self.link.take(spec.mm_hash) if self.link is not None else None
            if spec.mm_hash in encoder_cache:
                continue  # vLLM holds it already (the order is ended all the same)
            if tensor is None:  # stage_book.py's invariant 1 broken: say so, fetch it
                logger.error(
                    "EC broker: load of mm_hash=%s shipped without a staged tensor on "
                    "this worker (a bug); fetching it in the step",
                    spec.mm_hash,
                )
                (tensor,) = self.fetch([self.key(spec.mm_hash)], self._device)
                if tensor is None:
                    self.load_failures += 1
                    continue
            encoder_cache[spec.mm_hash] = tensor
            self.loads += 1
            nbytes = tensor.numel() * tensor.element_size()
            logger.info("EC load: loaded %d bytes for mm_hash=%s", nbytes, spec.mm_hash)

    def _bound_loads(self) -> list[Any]:
        meta = self._bound_metadata()
        return list(meta.loads) if isinstance(meta, ECBrokerConnectorMetadata) else []

    def fetch(self, keys: list[str], device: str) -> list[torch.Tensor | None]:
        """The entries under ``keys`` on ``device``; None where one cannot be had."""
        try:
            return self._on_live_read_connection(lambda c: c.get_many(keys, device=device))
        except Exception as exc:  # never take the worker down: the items are encoded
            logger.warning("EC broker get failed: %s", exc)
            return [None] * len(keys)

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

    def build_connector_worker_meta(self, broker_timeouts: int = 0) -> ECBrokerWorkerMetadata | None:
        """The counters' deltas since the last call, and this worker's model field when
        it changed.

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
        if not counts and identity is None:
            return None
        self._told = now
        self._identity_told = self.identity
        return ECBrokerWorkerMetadata(counts=counts, identity=identity)


def _runner_device() -> str:
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if current_platform.is_cuda_alike():
        device = f"{device}:{torch.cuda.current_device()}"
    return device


def _ranks() -> tuple[int, bool]:
    """This worker's TP rank and whether it is in the first pipeline stage (0, True
    outside a distributed run: one worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), bool(get_pp_group().is_first_rank)
    except Exception:  # no distributed state: a single in-process worker
        return 0, True
