"""The key's model field follows the weights in memory, not only the files (issues 28, 39).

vLLM changes weights while it serves: ``reload_weights`` (``POST /collective_rpc``),
any ``collective_rpc`` that calls ``model.load_weights`` (RL frameworks' worker
extensions), ``model.load_weights`` called directly on the worker (colocated RL with
``external_launcher``), the weight-transfer API (``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update``), sleep level 2 + ``wake_up``. The
connector's hooks see none of that, so:

- **Workers fingerprint the multimodal encoder's parameters in memory**
  (:func:`local_digest`): every parameter outside ``get_language_model()``, read
  as 16-bit words and reduced on the device with integer sums (exact, so equal
  weights give equal digests whatever the GPU and reduction order), combined on the
  host with each tensor's name, dtype and shape.
- **Each worker sees weight changes where they happen** (:class:`WeightsTracker`,
  one per worker process): the connector's worker part wraps the model loaders'
  ``load_model`` (class attributes, once per process, before vLLM loads the model),
  so it holds the model vLLM loaded, fingerprints it right after the load (the
  *baseline*, per rank, no collective) and wraps that model's ``load_weights`` (the
  instance attribute, which every loader, ``reload_weights``, the weight-transfer
  engines' fallback path and RL code call) to count versions. Before each step's
  loads or stores the worker compares that count with the one it last
  fingerprinted (an integer compare: nothing else per step) and, if it moved,
  fingerprints again (:func:`settle_field`, every TP rank together: the step's
  hooks run on all of them) and reports its field to the scheduler with the step's
  worker metadata. A step whose worker changed its field neither loads nor stores
  (the fields differ: ``ECBrokerWorker.keys_agree``), and the scheduler adopts the
  new field before the next step.
- **The scheduler also refreshes at once after engine calls that may change
  weights** (:class:`EngineWatch`): ``EngineCore.collective_rpc``,
  ``reset_encoder_cache`` and ``wake_up`` are wrapped once per process on the class
  (vLLM's utility dispatch and its own internal calls reach them; the engine passes
  itself, nothing walks caller frames); after the call the scheduler's connector runs
  :func:`worker_identity` on every worker through the executor's
  ``collective_rpc`` -- between steps, where vLLM itself runs such calls -- so the
  very next step keys with the new field, and updates that write parameters without
  ``load_weights`` (a weight-transfer engine's direct path) are seen too.
- The model field is ``<field>`` (:mod:`.model_id`: files and configuration) while
  every rank's encoder digest equals its baseline, and ``<field>~w<digest>``
  otherwise (the ranks' digests combined). So instances still on the old weights
  keep their entries, instances that reach equal weights (and the same TP layout)
  share theirs, and going back to the original weights finds the original entries.
- Inside a weight-transfer session (``start_weight_update`` until
  ``finish_weight_update``) and while the engine sleeps, the scheduler's field is
  unknown: it answers misses without asking the broker, and workers neither load
  nor store (``ECBrokerConnectorMetadata.model == ""``).
- The digest's all-gather never waits on a rank that failed: each rank computes its
  digest inside a ``try`` and always joins the all-gather with a "failed" flag; a
  failure anywhere makes every rank raise :class:`DigestFailed` (the field is then
  unknown: misses, no stores), never a hang.

The cost is one digest of the encoder per load and per weight change (milliseconds;
see docs/design.md, "Keys") and one integer compare per step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

DIGEST_HEX = 16
# Exact int64 arithmetic on 16-bit words: |word| <= 2**15, coefficients < 2**12, a
# [rows, COLS] view with rows < 2**24 keeps every partial sum below 2**63. Tensors of
# at least BIG_WORDS words are reduced in place (no copy); smaller ones are packed
# together up to PACK_WORDS words first (fewer kernel launches).
COLS = 4096
COEF_MOD = 4093
BIG_WORDS = 1 << 20
PACK_WORDS = 1 << 22
_DIGEST_TAG = b"lmcache-ec-weights-v1\0"

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


# ------------------------------------------------------------------ the digest


def encoder_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters that determine the encoder's output: every parameter of the
    model outside its language model (vision/audio tower and projector). A model
    without ``get_language_model`` is fingerprinted whole."""
    language_model = None
    get_lm = getattr(model, "get_language_model", None)
    if callable(get_lm):
        try:
            language_model = get_lm()
        except Exception:  # a model that declares it but cannot answer
            language_model = None
    skip = (
        {id(p) for p in language_model.parameters()}
        if language_model is not None and language_model is not model
        else set()
    )
    return [(n, p) for n, p in model.named_parameters() if id(p) not in skip]


def _plain_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors holding a parameter's bytes (vLLM's own expansion for shared and
    wrapper-subclass parameters, e.g. TorchAO's qdata/scale, where it has one)."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import _tensors
    except ImportError:  # pragma: no cover - older vLLM
        yield name, tensor
        return
    yield from _tensors(name, tensor)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int16 tensor on its device (a view when possible)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16)


def _matrix_sums(w: torch.Tensor) -> torch.Tensor:
    """Exact int64 sums of a [rows, COLS] int16 matrix: column-weighted and
    row-weighted (a permutation of words changes them too), read once each. On the
    CPU with numpy (single-threaded: a busy host's OpenMP pool makes these small
    reductions 100x slower); the sums are exact integers, so every device and
    library gives the same digest for the same weights."""
    if w.device.type == "cpu":
        a = w.numpy()
        cols_np = (np.arange(COLS, dtype=np.int64) * 2654435761) % COEF_MOD + 1
        rows_np = np.arange(a.shape[0], dtype=np.int64) % COEF_MOD + 1
        by_col = int(a.sum(0, dtype=np.int64) @ cols_np)
        by_row = int(a.sum(1, dtype=np.int64) @ rows_np)
        return torch.tensor([by_col, by_row], dtype=torch.int64)
    cols = (torch.arange(COLS, device=w.device, dtype=torch.int64) * 2654435761) % COEF_MOD + 1
    rowc = torch.arange(w.shape[0], device=w.device, dtype=torch.int64) % COEF_MOD + 1
    by_col = (w.sum(0, dtype=torch.int64) * cols).sum()
    by_row = (w.sum(1, dtype=torch.int64) * rowc).sum()
    return torch.stack([by_col, by_row])


def _packed_sums(pieces: list[torch.Tensor]) -> torch.Tensor:
    """``_matrix_sums`` of small pieces packed one after another, zero-padded."""
    n = sum(p.numel() for p in pieces)
    rows = -(-n // COLS)
    if pieces[0].device.type == "cpu":  # numpy: see _matrix_sums
        buf = np.zeros(rows * COLS, dtype=np.int16)
        np.concatenate([p.numpy() for p in pieces], out=buf[:n])
        return _matrix_sums(torch.from_numpy(buf).view(rows, COLS))
    packed = pieces[0].new_zeros(rows * COLS)
    torch.cat(pieces, out=packed[:n])
    return _matrix_sums(packed.view(rows, COLS))


def local_digest(model: nn.Module) -> str | None:
    """This rank's digest of the encoder parameters, or None if the model has none
    (a pipeline stage without the encoder). One device-to-host copy at the end."""
    h = hashlib.sha256(_DIGEST_TAG)
    sums: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []
    size = 0
    found = False
    for name, param in encoder_parameters(model):
        for tname, t in _plain_tensors(name, param):
            if t.device.type == "meta":
                continue
            found = True
            h.update(f"{tname} {t.dtype} {tuple(t.shape)}\0".encode())
            words = _words(t)
            if words.numel() >= BIG_WORDS:
                rows = words.numel() // COLS
                sums.append(_matrix_sums(words[: rows * COLS].view(rows, COLS)))
                words = words[rows * COLS :]
                if not words.numel():
                    continue
            if pending and size + words.numel() > PACK_WORDS:
                sums.append(_packed_sums(pending))
                pending, size = [], 0
            pending.append(words)
            size += words.numel()
    if pending:
        sums.append(_packed_sums(pending))
    if not found:
        return None
    for pair in torch.stack(sums).cpu().tolist() if sums else []:
        h.update(b"".join(int(v).to_bytes(8, "little", signed=True) for v in pair))
    return h.hexdigest()[:DIGEST_HEX]


class DigestFailed(RuntimeError):
    """A rank could not fingerprint its encoder (raised on every rank alike)."""


def _tp_group() -> Any | None:
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:  # pragma: no cover
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def _word(digest: str | None) -> int:
    return int(digest, 16) - (1 << 63) if digest is not None else 0


def settle_field(model: nn.Module, base: str, baseline: str | None) -> str | None:
    """The model field for the weights ``model`` holds now, the same on every rank of
    the TP group (all ranks must call it together: it all-gathers over the group's
    CPU group). ``baseline``: this rank's digest right after the load (None: unknown,
    then any digest counts as changed). None: no rank has an encoder.

    Invariant: every rank reaches the all-gather, whatever its own digest did; a
    failure on any rank raises DigestFailed on all of them."""
    failure: BaseException | None = None
    try:
        mine = local_digest(model)
    except Exception as exc:  # joins the all-gather anyway, flagged
        mine, failure = None, exc
    changed = mine is not None and mine != baseline
    group = _tp_group()
    if group is None:
        if failure is not None:
            raise DigestFailed(f"cannot fingerprint the encoder: {failure!r}") from failure
        return None if mine is None else field_for(base, baseline, mine)
    flags = torch.tensor(
        [_word(mine), int(mine is not None), int(changed), int(failure is not None)],
        dtype=torch.int64,
    )
    gathered = [torch.zeros_like(flags) for _ in range(group.world_size)]
    torch.distributed.all_gather(gathered, flags, group=group.cpu_group)
    failed = [rank for rank, g in enumerate(gathered) if int(g[3])]
    if failed:
        raise DigestFailed(
            f"TP rank(s) {failed} could not fingerprint the encoder"
            + (f" (here: {failure!r})" if failure is not None else "")
        ) from failure
    if not any(int(g[1]) for g in gathered):
        return None
    if not any(int(g[2]) for g in gathered):
        return base
    h = hashlib.sha256(_DIGEST_TAG + b"tp\0")
    for g in gathered:
        h.update(f"{int(g[0])}:{int(g[1])}\0".encode())
    return f"{base}~w{h.hexdigest()[:DIGEST_HEX]}"


def weights_digest(model: nn.Module) -> str | None:
    """The encoder's digest, the same on every rank of the TP group (all ranks must
    call it together). Raises DigestFailed on every rank if any rank failed."""
    field = settle_field(model, "", None)
    return None if field is None else field.rpartition("~w")[2]


def field_for(base: str, baseline: str | None, digest: str | None) -> str:
    """The model field: ``base`` while the weights are those loaded at start."""
    if digest is None or digest == baseline:
        return base
    return f"{base}~w{digest}"


# ------------------------------------------------------------------ worker side


class WeightsTracker:
    """This worker process's view of the model vLLM loaded (one per process: the
    loaders are wrapped on their classes). Owns the model reference, the baseline
    digest per load and the count of ``load_weights`` calls since.

    Invariants: ``version`` only grows; it moves after every ``load_weights`` call
    on the tracked model (returned or raised: a failed load may have written part of
    the weights) and after every new model load; ``baseline`` is this rank's digest
    right after the tracked model was loaded, ``loaded_version`` the version then
    (the weights as loaded: the scheduler's base field keys them)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.baseline: str | None = None
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
        try:
            baseline = local_digest(model)
        except Exception as exc:  # then the first refresh's digest counts as changed
            log.warning("EC broker: cannot fingerprint the encoder at load (%s)", exc)
            baseline = None
        original = model.load_weights

        @functools.wraps(original)
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.bump()

        model.load_weights = load_weights  # type: ignore[method-assign]
        with self._lock:
            self.model, self.baseline = model, baseline
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
    seen: set[type] = set()
    todo: list[type] = [BaseModelLoader]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        if "load_model" in cls.__dict__:
            _wrap_load_model(cls)


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
    part = get_ec_transfer().connector_worker  # vllm_worker.ECBrokerWorker
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
    misses, no loads, no stores)."""

    def __init__(self, base: str, set_field: Callable[[str], None]) -> None:
        self._base = base
        self._set_field = set_field
        self._in_session = False

    @property
    def in_session(self) -> bool:
        """Inside a weight-transfer session: the field stays unknown until it ends."""
        return self._in_session

    def after_call(self, engine: Any, name: str, method: Any = None) -> None:
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
        if executor is None:
            return
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


def watch_engine_calls() -> bool:
    """Wrap ``EngineCore``'s weight-changing entry points on the class (once per
    process); after each call the engine's scheduler connector, if it has a
    ``weights_watch``, refreshes. False without vLLM's engine core."""
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
    return True


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
