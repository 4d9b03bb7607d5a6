"""The key's model field holds the encoder's weights in memory, not only the files
(issues 28, 39).

The model field is ``<files>+c<config>~w<digest>`` (:mod:`.model_id` gives the part
before ``~w``): the digest of the multimodal encoder's weights as they are in memory,
taken right after the load and again after every weight change. So a
``--load-format dummy`` instance, a differently quantized one, one whose weights come
from elsewhere than the files the fingerprint samples, never meets the real one;
instances holding the same weights share, whatever their tensor-parallel layout; and
going back to earlier weights finds their entries again.

- **The digest** (:mod:`.encoder_digest`: one rank's parts and how they combine;
  :mod:`.tp_digest`: :func:`settle_field`, the same field on every TP rank): every
  parameter outside ``get_language_model()`` (vision/audio tower and projector),
  summed along the dimension tensor parallelism splits and sketched so that TP 1 and
  TP N give the same digest; exact (integer sums): equal weights give equal digests on
  any device.
- **At load**: the connector's worker part wraps the model loaders' ``load_model``
  (class attributes, once per process, before vLLM loads the model), so it holds the
  model vLLM loaded and wraps its ``load_weights``. The scheduler's connector asks
  every worker for its field right after the engine built the scheduler (vLLM's
  ``Executor.init_ec_output_aggregator``, which ``EngineCore`` calls next, is wrapped
  once per process to do so: :func:`watch_engine_calls`): one digest per load, before
  the first request. (On an engine without that call, the field is the one before
  ``~w`` until the first step: its workers fingerprint then and neither load nor
  store in it, see below.)
- **Each worker sees weight changes where they happen** (:class:`WeightsTracker`,
  one per worker process): the wrapped ``load_weights`` (which every loader,
  ``reload_weights``, the weight-transfer engines' fallback path and RL code call)
  counts versions. Before each step's loads or stores the worker compares that count
  with the one it last fingerprinted (an integer compare: nothing else per step) and,
  if it moved, fingerprints again (every TP rank together: the step's hooks run on all
  of them) and reports its field to the scheduler with the step's worker metadata. A
  step whose worker changed its field neither loads nor stores (the fields differ:
  ``ECBrokerWorker.keys_agree``), and the scheduler adopts the new field before the
  next step.
- **The scheduler also refreshes at once after engine calls that may change
  weights** (:class:`EngineWatch`): ``EngineCore.collective_rpc``,
  ``reset_encoder_cache`` and ``wake_up`` are wrapped once per process on the class
  (vLLM's utility dispatch and its own internal calls reach them; the engine passes
  itself, nothing walks caller frames); after the call the scheduler's connector runs
  :func:`worker_identity` on every worker through the executor's
  ``collective_rpc`` -- between steps, where vLLM itself runs such calls -- so the
  very next step keys with the new field, and updates that write parameters without
  ``load_weights`` (a weight-transfer engine's direct path) are seen too.
- Inside a weight-transfer session (``start_weight_update`` until
  ``finish_weight_update``) and while the engine sleeps, the scheduler's field is
  unknown: it answers misses without asking the broker, and workers neither load
  nor store (``ECBrokerConnectorMetadata.model == ""``).
- The digest's all-gathers never wait on a rank that failed: a failure anywhere makes
  every rank raise :class:`.tp_digest.DigestFailed` (the field is then unknown:
  misses, no stores), never a hang.

The cost is one digest of the encoder per load and per weight change (a table look-up
and an add per weight; docs/design.md, "Keys", has the figures) and one integer
compare per step.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_ec_broker.connector.vllm.encoder_digest import loaded_tensors, record_processed

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

# collective_rpc methods that leave the weights alone: no fingerprint after them.
NO_WEIGHT_CHANGE = frozenset(
    {
        "execute_model",
        "sample_tokens",
        "execute_dummy_batch",
        "take_draft_token_ids",
        "check_health",
        "get_kv_cache_spec",
        "determine_available_memory",
        "get_supported_tasks",
        "get_model_inspection",
        "compute_weight_checksums",
        "list_loras",
        "pin_lora",
        "add_lora",
        "remove_lora",
        "profile",
        "save_sharded_state",
        "synchronize_device",
        "reset_mm_cache",
        "sleep",
        "shutdown",
    }
)
# Inside this session weights are half-updated: the field is unknown until it ends.
SESSION_START = frozenset({"start_weight_update", "start_draft_weight_update"})
SESSION_CHUNK = frozenset({"update_weights"})


# ------------------------------------------------------------------ worker side


class WeightsTracker:
    """This worker process's view of the model vLLM loaded (one per process: the
    loaders are wrapped on their classes). Owns the model reference and the count of
    ``load_weights`` calls since.

    Invariants: ``version`` only grows; it moves after every ``load_weights`` call
    on the tracked model (returned or raised: a failed load may have written part of
    the weights) and after every new model load (the digest at load is then taken by
    the first identity request: every TP rank together, see ``worker_identity``);
    ``loaded_version`` is the version right after the load (the weights as loaded,
    which the scheduler's first field keys)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.version = 0
        self.loaded_version = 0  # ``version`` right after the tracked model's load
        self._target: tuple[str, tuple[str, ...]] | None = None
        self._lock = threading.Lock()

    def target(self, model_config: Any) -> None:
        """Track only the model of this configuration (not a draft model)."""
        self._target = _model_key(model_config)

    def loaded(self, model: nn.Module, model_config: Any) -> None:
        if self._target is not None and _model_key(model_config) != self._target:
            return
        original = model.load_weights

        @functools.wraps(original)
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.bump()

        model.load_weights = load_weights  # type: ignore[method-assign]
        with self._lock:
            self.model = model
            self.version += 1
            self.loaded_version = self.version

    def bump(self) -> None:
        with self._lock:
            self.version += 1


def _model_key(model_config: Any) -> tuple[str, tuple[str, ...]]:
    return (
        str(getattr(model_config, "model", "")),
        tuple(getattr(model_config, "architectures", None) or ()),
    )


TRACKER = WeightsTracker()
_LOADERS_WRAPPED = False


def track_model_loads(model_config: Any) -> None:
    """Wrap every model loader's ``load_model`` on its class (once per process), so
    ``TRACKER`` learns of each model vLLM loads here. The worker's connector is built
    before ``load_model`` runs, so the load at start is seen."""
    global _LOADERS_WRAPPED
    TRACKER.target(model_config)
    if _LOADERS_WRAPPED:
        return
    try:
        import vllm.model_executor.model_loader  # noqa: F401 - registers the loaders
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:  # pragma: no cover - a vLLM without the loader classes
        return
    _LOADERS_WRAPPED = True
    for cls in _subclasses(BaseModelLoader):
        if "load_model" in cls.__dict__:
            _wrap_load_model(cls)
    try:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    except ImportError:  # pragma: no cover
        return
    for cls in _subclasses(QuantizeMethodBase):
        if "process_weights_after_loading" in cls.__dict__:
            _wrap_process_weights(cls)


def _subclasses(root: type) -> list[type]:
    seen: list[type] = []
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _wrap_process_weights(cls: type) -> None:
    """After a quantization method's ``process_weights_after_loading``, what it did to
    the layer's parameters is recorded for the digest
    (:func:`.encoder_digest.record_processed`)."""
    original = cls.__dict__["process_weights_after_loading"]

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        before = loaded_tensors(layer)
        result = original(self, layer, *args, **kwargs)
        record_processed(layer, before)
        return result

    cls.process_weights_after_loading = process_weights_after_loading


def _wrap_load_model(cls: type) -> None:
    original = cls.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        # Only the outermost call: a subclass that calls super().load_model() gets
        # the model back here first, then once more in its own wrapper.
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        if getattr(model, "_lmcache_ec_tracked", False) is False:
            try:
                model._lmcache_ec_tracked = True
            except Exception:
                pass
            TRACKER.loaded(model, model_config)
        return model

    cls.load_model = load_model


def worker_identity(worker: Any, base: str) -> str | None:
    """Run on every worker by the scheduler (``collective_rpc``): fingerprint the
    encoder now, set this worker's connector's model field, return it. None from a
    worker without an encoder (a later pipeline stage)."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return None
    part = get_ec_transfer().connector_worker  # worker.ECBrokerWorker
    get_model = getattr(worker, "get_model", None)
    model = get_model() if callable(get_model) else worker.model_runner.get_model()
    return part.refresh_identity(model, base)


# ------------------------------------------------------------------ scheduler side


class EngineWatch:
    """Keeps the scheduler's model field on the weights the workers hold, refreshing
    right after engine calls that may change them (module doc). Owned by the
    scheduler's connector; the engine reaches it through ``EngineCore``'s wrapped
    methods (:func:`watch_engine_calls`), which pass the engine itself.

    ``set_field(field_or_empty)`` is the scheduler connector's setter ("" = unknown:
    misses, no loads, no stores). ``on_encoder_cache_reset`` runs after the engine's
    ``reset_encoder_cache`` (which tells connectors nothing): the scheduler connector
    forgets its mirror of what vLLM's encoder cache holds. With ``vllm_config``, the
    watch also takes the
    digest at load: the engine built on that configuration asks its workers as soon
    as its scheduler exists (:func:`watch_engine_calls`, ``at_load``)."""

    def __init__(
        self,
        base: str,
        set_field: Callable[[str], None],
        vllm_config: Any = None,
        on_encoder_cache_reset: Callable[[], None] | None = None,
    ) -> None:
        self._base = base
        self._set_field = set_field
        self._on_encoder_cache_reset = on_encoder_cache_reset
        self._in_session = False
        self._config = vllm_config
        if vllm_config is not None:
            _AT_LOAD.add(self)

    def at_load(self, executor: Any) -> bool:
        """If this watch belongs to ``executor``'s engine (the same configuration
        object), fingerprint its workers now (the digest at load) and stop waiting."""
        if getattr(executor, "vllm_config", None) is not self._config:
            return False
        _AT_LOAD.discard(self)
        self.refresh_executor(executor)
        return True

    @property
    def in_session(self) -> bool:
        """Inside a weight-transfer session: the field stays unknown until it ends."""
        return self._in_session

    def after_call(self, engine: Any, name: str, method: Any = None) -> None:
        if name == "reset_encoder_cache" and self._on_encoder_cache_reset is not None:
            self._on_encoder_cache_reset()  # vLLM's own encoder cache is empty now
        if name != "collective_rpc":
            self.refresh(engine)
            return
        method_name = method if isinstance(method, str) else getattr(method, "__name__", "")
        if method_name == worker_identity.__name__ or method_name in NO_WEIGHT_CHANGE:
            return
        if method_name in SESSION_START or method_name in SESSION_CHUNK:
            self._in_session = True
            self._set_field("")  # half-updated weights: misses until the session ends
            return
        self._in_session = False
        self.refresh(engine)

    def refresh(self, engine: Any) -> None:
        """Fingerprint the workers' weights now and adopt the answer ("" if the
        workers cannot answer or disagree: misses, never a wrong load)."""
        executor = getattr(engine, "model_executor", None)
        if executor is not None:
            self.refresh_executor(executor)

    def refresh_executor(self, executor: Any) -> None:
        """``refresh`` through the engine's executor."""
        if self._in_session or getattr(executor, "is_sleeping", False):
            self._set_field("")
            return
        try:
            answers = executor.collective_rpc(worker_identity, args=(self._base,))
        except Exception as exc:  # never take the engine down; stay safe instead
            log.error(
                "EC broker: cannot fingerprint the workers' weights (%s); the cache "
                "answers misses until they can be",
                exc,
            )
            self._set_field("")
            return
        fields = {a for a in answers if a is not None}
        if len(fields) != 1:
            log.error("EC broker: workers disagree on their weights (%s): misses", fields)
            self._set_field("")
            return
        self._set_field(fields.pop())


WATCHED_ENGINE_CALLS = ("collective_rpc", "reset_encoder_cache", "wake_up")
_ENGINE_WRAPPED = False
# Watches waiting for their engine's digest at load (weakly held: a connector built
# without an engine, as tests do, is not kept alive by this).
_AT_LOAD: weakref.WeakSet[EngineWatch] = weakref.WeakSet()


def watch_engine_calls() -> bool:
    """Wrap ``EngineCore``'s weight-changing entry points on the class (once per
    process); after each call the engine's scheduler connector, if it has a
    ``weights_watch``, refreshes. Also wrap ``Executor.init_ec_output_aggregator``,
    which ``EngineCore.__init__`` calls right after it built the scheduler (and so its
    EC connector): the watch of that engine then takes the digest at load. False
    without vLLM's engine core."""
    global _ENGINE_WRAPPED
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover
        return False
    if _ENGINE_WRAPPED:
        return True
    _ENGINE_WRAPPED = True
    for name in WATCHED_ENGINE_CALLS:
        _wrap_engine_call(EngineCore, name)
    try:
        from vllm.v1.executor.abstract import Executor
    except ImportError:  # pragma: no cover - then the workers' first step reports it
        return True
    if hasattr(Executor, "init_ec_output_aggregator"):
        _wrap_at_load(Executor)
    return True


def _wrap_at_load(cls: type) -> None:
    original = cls.init_ec_output_aggregator

    @functools.wraps(original)
    def init_ec_output_aggregator(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for watch in list(_AT_LOAD):
            if watch.at_load(self):
                break
        return result

    cls.init_ec_output_aggregator = init_ec_output_aggregator


def _wrap_engine_call(cls: type, name: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            watch = getattr(
                getattr(getattr(self, "scheduler", None), "ec_connector", None),
                "weights_watch",
                None,
            )
            if isinstance(watch, EngineWatch):
                method = kwargs.get("method", args[0] if args else None)
                watch.after_call(self, name, method)

    setattr(cls, name, wrapper)
