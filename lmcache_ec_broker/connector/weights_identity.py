"""The key's model field follows the weights in memory, not only the files (issue 28).

vLLM changes weights while it serves: ``reload_weights`` (``POST /collective_rpc``),
any ``collective_rpc`` that calls ``model.load_weights`` (RL frameworks' worker
extensions), the weight-transfer API (``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update``), sleep level 2 + ``wake_up``. The
connector's hooks see none of that, so:

- **Workers fingerprint the multimodal encoder's parameters in memory**
  (:func:`weights_digest`): every parameter outside ``get_language_model()``, read
  as 16-bit words and reduced on the device with integer sums (exact, so equal
  weights give equal digests whatever the GPU and reduction order), combined on the
  host with each tensor's name, dtype and shape; under tensor parallelism the ranks'
  digests are all-gathered and combined, so every rank holds one digest.
- **The scheduler asks them, right after every engine call that may have changed
  weights** (:class:`EngineWatch`): it wraps the engine core's ``collective_rpc``,
  ``reset_encoder_cache`` and ``wake_up`` (the instance's attributes, so vLLM's
  utility dispatch and its own internal calls both reach the wrappers) and, after the
  call, runs :func:`worker_identity` on every worker through the executor's
  ``collective_rpc`` -- between steps, where vLLM itself runs such calls. Workers
  and scheduler adopt the answer together, before the next step is scheduled.
- The model field is ``<field>`` (the file-based one, :mod:`.model_id`) while the
  encoder's digest equals the one taken right after ``load_model``, and
  ``<field>~w<digest>`` otherwise. So instances still on the old weights keep their
  entries, instances that reach equal weights share theirs, and going back to the
  original weights finds the original entries.
- Inside a weight-transfer session (``start_weight_update`` until
  ``finish_weight_update``) and while the engine sleeps, the field is unknown: the
  scheduler answers misses without asking the broker, and workers neither load nor
  store (``ECBrokerConnectorMetadata.model == ""``).

The cost is one digest of the encoder per weight-changing call (milliseconds; see
docs/design.md, "Keys") and nothing per request or step.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
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


def _tp_group() -> Any | None:
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:  # pragma: no cover
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def weights_digest(model: nn.Module) -> str | None:
    """The encoder's digest, the same on every rank of the TP group (all ranks must
    call it together: it all-gathers over the group's CPU group)."""
    mine = local_digest(model)
    group = _tp_group()
    if group is None:
        return mine
    word = int(mine, 16) - (1 << 63) if mine is not None else 0
    flags = torch.tensor([word, int(mine is not None)], dtype=torch.int64)
    gathered = [torch.zeros_like(flags) for _ in range(group.world_size)]
    torch.distributed.all_gather(gathered, flags, group=group.cpu_group)
    if not any(int(g[1]) for g in gathered):
        return None
    h = hashlib.sha256(_DIGEST_TAG + b"tp\0")
    for g in gathered:
        h.update(f"{int(g[0])}:{int(g[1])}\0".encode())
    return h.hexdigest()[:DIGEST_HEX]


def field_for(base: str, baseline: str | None, digest: str | None) -> str:
    """The model field: ``base`` while the weights are those loaded at start."""
    if digest is None or digest == baseline:
        return base
    return f"{base}~w{digest}"


# ------------------------------------------------------------------ worker side


def worker_identity(worker: Any, base: str) -> str | None:
    """Run on every worker by the scheduler (``collective_rpc``): fingerprint the
    encoder now, set this worker's connector's model field, return it. The first
    call (at the scheduler's start, weights as loaded from the files) fixes the
    baseline. None from a worker without an encoder (a later pipeline stage)."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return None
    connector = get_ec_transfer()
    get_model = getattr(worker, "get_model", None)
    model = get_model() if callable(get_model) else worker.model_runner.get_model()
    digest = weights_digest(model)
    if digest is None:
        return None
    part = connector.connector_worker  # vllm_worker.ECBrokerWorker
    field = field_for(base, part.weights_baseline(digest), digest)
    # Outputs waiting for a broker outage to end were computed by other weights:
    # adopt_identity drops them when the field changes.
    if part.adopt_identity(field):
        log.info("EC broker: model field of this worker's keys is now %s", field)
    return field


# ------------------------------------------------------------------ scheduler side


def _caller_self(kind: type, depth: int = 16) -> Any | None:
    """The nearest caller frame's ``self`` that is a ``kind`` (the scheduler's
    connector is built inside ``EngineCore.__init__``, the executor already up)."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            obj = frame.f_locals.get("self")
            if isinstance(obj, kind):
                return obj
        return None
    finally:
        del frame


class EngineWatch:
    """Keeps the scheduler's model field on the weights the workers hold.

    ``set_field(field_or_empty)`` is the scheduler connector's setter ("" = unknown:
    misses, no loads, no stores)."""

    def __init__(self, engine: Any, base: str, set_field: Callable[[str], None]) -> None:
        self._engine = engine
        self._base = base
        self._set_field = set_field
        self._in_session = False
        self._wrap("collective_rpc", self._after_rpc)
        self._wrap("reset_encoder_cache", lambda *_: self.refresh())
        self._wrap("wake_up", lambda *_: self.refresh())

    @classmethod
    def attach(cls, base: str, set_field: Callable[[str], None]) -> EngineWatch | None:
        """Find the engine core this scheduler runs in and watch it; None outside one
        (then the field stays the file-based one: weight updates are not followed)."""
        try:
            from vllm.v1.engine.core import EngineCore
        except ImportError:  # pragma: no cover
            return None
        engine = _caller_self(EngineCore)
        if engine is None or getattr(engine, "model_executor", None) is None:
            return None
        watch = cls(engine, base, set_field)
        watch.refresh()  # the baseline: the weights as loaded from the files
        return watch

    def _wrap(self, name: str, after: Callable[..., None]) -> None:
        original = getattr(self._engine, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                after(*args, **kwargs)

        setattr(self._engine, name, wrapper)

    def _after_rpc(self, method: Any = None, *args: Any, **kwargs: Any) -> None:
        method = kwargs.get("method", method)
        name = method if isinstance(method, str) else getattr(method, "__name__", "")
        if name == worker_identity.__name__ or name in NO_WEIGHT_CHANGE:
            return
        if name in SESSION_START or name in SESSION_CHUNK:
            self._in_session = True
            self._set_field("")  # half-updated weights: misses until the session ends
            return
        self._in_session = False
        self.refresh()

    def refresh(self) -> None:
        """Fingerprint the workers' weights now and adopt the answer ("" if the
        workers cannot answer or disagree: misses, never a wrong load)."""
        executor = self._engine.model_executor
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
