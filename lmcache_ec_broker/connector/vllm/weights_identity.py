"""The key's model field holds the encoder's weights in memory, not only the files
(issues 28, 39).

The model field is ``<files>+c<config>~w<digest>`` (:mod:`.model_id` gives the part
before ``~w``): the digest of the multimodal encoder's weights as they are in memory,
taken right after the load and again after every weight change. So a
``--load-format dummy`` instance, a differently quantized one, one whose weights come
from elsewhere than the files the fingerprint samples, never meets the real one;
instances holding the same weights share, whatever their tensor-parallel layout; and
going back to earlier weights finds their entries again.

- **The digest** (:func:`local_parts`, :func:`combine`, :func:`settle_field`): every
  parameter outside ``get_language_model()`` (vision/audio tower and projector), read
  as 16-bit words, each word mapped through a fixed injective table and summed on the
  device along the dimension tensor parallelism splits (column-parallel layers: the
  output dimension; row-parallel: the input dimension; tensors held whole: along the
  first dimension and along the others). The exact int64 vectors left are sketched on
  the host (linear, mod 2**64) and all-gathered over the TP group's CPU group: the
  ranks' sketches of a split tensor add up to the sketch of the whole tensor, so TP 1
  and TP N give the same digest. A tensor of a layout it does not know (or held whole
  but unequal across ranks) makes the digest layout-bound: exact, not shared across TP
  sizes. Integer sums are exact: equal weights give equal digests on any device.
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
- The digest's all-gathers never wait on a rank that failed: each rank computes its
  parts inside a ``try`` and always joins the all-gathers with a "failed" flag; a
  failure anywhere makes every rank raise :class:`DigestFailed` (the field is then
  unknown: misses, no stores), never a hang.

The cost is one digest of the encoder per load and per weight change (a table look-up
and an add per weight; docs/design.md, "Keys", has the figures) and one integer
compare per step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

DIGEST_HEX = 16
_DIGEST_TAG = b"lmcache-ec-weights-v2\0"

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
#
# The digest must be the same for the same logical weights whatever the tensor-parallel
# layout (TP 1 and TP 2 of one model share entries), so it is built from per-shard
# parts that add up across ranks:
#
# - every 16-bit word w of a tensor is mapped through a fixed table T (a bijection of
#   32-bit integers restricted to 16 bits: injective, far from linear), and T[w] is
#   summed along the dimension tensor parallelism splits (column-parallel linears: the
#   output dimension, row-parallel ones: the input dimension). What remains is one
#   exact int64 per position of the dimensions that no layout splits -- the same
#   vector on TP 1 as the sum of the ranks' vectors on TP N, whichever rows a rank
#   holds (QKV and merged layers interleave theirs);
# - each such vector is sketched on the host by two dot products with fixed
#   pseudo-random 64-bit coefficients (mod 2**64): linear, so the ranks' sketches add
#   up to the sketch of the whole tensor's vector;
# - tensors no layout splits (norms, convolutions, replicated linears, biases of
#   row-parallel layers, every tensor of a layer with TP disabled) are held whole on
#   every rank: summed along their first dimension and along the others (their
#   position in both), and every rank's sketch must be equal (else, or for a layer of
#   an unknown sharding, the ranks' sketches are hashed in rank order with the TP size:
#   still exact, no longer shared with another layout).
#
# The ranks all-gather these sketches (a few int64 per tensor) over the TP group's CPU
# group, with a "failed" flag so that no rank waits on one that raised.

_TABLE_SEED = 0x9E3779B9
CHUNK_ELEMENTS = 1 << 24  # words mapped at once (an int64 temporary of 128 MiB at most)
_LANES = 2  # sketch coefficients per vector
_ROW = 2 + 2 * _LANES  # what a rank sends per tensor: descriptor, count, two sketches
_MASK64 = (1 << 64) - 1

# How a tensor's parts combine across the TP group.
SPLIT, WHOLE, LOCAL = "split", "whole", "local"


@functools.lru_cache(maxsize=1)
def _table_np() -> np.ndarray:
    """T: every 16-bit word to a distinct 32-bit value (lowbias32, a bijection)."""
    x = np.arange(1 << 16, dtype=np.uint64) ^ np.uint64(_TABLE_SEED)
    m32 = np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m32
    x ^= x >> np.uint64(16)
    return x.astype(np.int64)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.from_numpy(_table_np()).to(device)
    return table


@functools.lru_cache(maxsize=256)
def _coefficients(n: int) -> np.ndarray:
    """[_LANES, n] fixed pseudo-random uint64 (splitmix64 of the position)."""
    with np.errstate(over="ignore"):
        x = np.arange(1, n + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.arange(_LANES, dtype=np.uint64)[:, None] * np.uint64(0xD1B54A32D192ED03)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _sketch(vector: np.ndarray) -> list[int]:
    """``_LANES`` dot products of an exact int64 vector with fixed coefficients, mod 2**64."""
    with np.errstate(over="ignore"):
        prod = vector.astype(np.uint64)[None, :] * _coefficients(vector.size)
        return [int(v) for v in prod.sum(axis=1, dtype=np.uint64)]


def encoder_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters that determine the encoder's output: every parameter of the
    model outside its language model (vision/audio tower and projector). A model
    without ``get_language_model`` is fingerprinted whole."""
    return [(n, p) for n, p, _ in _encoder_parameters(model)]


def _encoder_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor, nn.Module]]:
    """``encoder_parameters`` with the module that owns each parameter."""
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
    out: list[tuple[str, torch.Tensor, nn.Module]] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in skip or id(param) in seen:
                continue
            seen.add(id(param))
            out.append((f"{prefix}.{name}" if prefix else name, param, module))
    return out


def _plain_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors holding a parameter's bytes (vLLM's own expansion for shared and
    wrapper-subclass parameters, e.g. TorchAO's qdata/scale, where it has one)."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import _tensors
    except ImportError:  # pragma: no cover - older vLLM
        yield name, tensor
        return
    yield from _tensors(name, tensor)


def _layout(module: nn.Module, param: torch.Tensor) -> tuple[int | None, bool]:
    """(the dimension tensor parallelism splits this kind of parameter along, or None;
    whether this module's shards are a partition over the whole TP group of a known
    kind). Decided by the layer's kind, not by the TP size, so TP 1 computes the same
    vectors as the sum of TP N's."""
    try:
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            LinearBase,
            QKVParallelLinear,
            RowParallelLinear,
        )
    except ImportError:  # pragma: no cover
        return None, False
    if isinstance(module, RowParallelLinear):
        dim = getattr(param, "input_dim", None)
    elif isinstance(module, ColumnParallelLinear):
        dim = getattr(param, "output_dim", None)
        if isinstance(module, QKVParallelLinear) and getattr(module, "num_kv_head_replicas", 1) > 1:
            return dim, False  # K/V rows held by several ranks: not a partition
    elif isinstance(module, LinearBase):
        return None, type(module).__name__ == "ReplicatedLinear"
    else:
        return None, True
    if not isinstance(dim, int) or not 0 <= dim < param.dim():
        dim = None
    return dim, True


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 16-bit words, shaped ``[*t.shape, words per element]``
    (one word per element for 1- and 2-byte types)."""
    flat = t.detach()
    if flat.dim() == 0:
        flat = flat.reshape(1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8).unsqueeze(-1)
    if size == 2:
        return flat.view(torch.int16).unsqueeze(-1)
    raw = flat.reshape(-1).view(torch.uint8)
    if raw.numel() % 2:  # pragma: no cover - odd-sized elements do not exist
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16).view(*flat.shape, -1)


def _mapped_sums(words: torch.Tensor, dims: list[int | None]) -> list[torch.Tensor]:
    """For each entry of ``dims``: the sums of T[word] along that dimension (None: the
    sums along every dimension but the first), flattened, exact int64. Chunked along
    the first dimension so that temporaries stay small: sums along it add up across
    chunks, sums along others are concatenated in order."""
    if words.numel() == 0:  # an empty tensor: its descriptor (shape) is all there is
        return [torch.zeros(0, dtype=torch.int64) for _ in dims]
    first = words.shape[0]
    inner = max(1, words.numel() // max(first, 1))
    step = max(1, CHUNK_ELEMENTS // inner)
    cpu = words.device.type == "cpu"
    added: list[Any] = [None] * len(dims)
    pieces: list[list[Any]] = [[] for _ in dims]
    for start in range(0, first, step):
        part = words[start : start + step]
        if cpu:  # numpy: single-threaded (a busy host's OpenMP pool is far slower here)
            raw = part.numpy()
            mapped = _table_np()[raw.view(np.uint16) if raw.dtype == np.int16 else raw]
        else:
            idx = (part.to(torch.int32) & 0xFFFF).reshape(-1)
            mapped = torch.index_select(_table(part.device), 0, idx).view(part.shape)
        for i, dim in enumerate(dims):
            if dim == 0:
                s = mapped.sum(0).reshape(-1)
                added[i] = s if added[i] is None else added[i] + s
            elif dim is None:
                pieces[i].append(mapped.reshape(mapped.shape[0], -1).sum(1))
            else:
                pieces[i].append(mapped.sum(dim).reshape(-1))
    out = []
    for i in range(len(dims)):
        if added[i] is not None:
            v = added[i]
        else:
            v = np.concatenate(pieces[i]) if cpu else torch.cat(pieces[i])
        out.append(torch.from_numpy(np.ascontiguousarray(v)) if cpu else v)
    return out


class Part:
    """One tensor's contribution on this rank: what identifies it, how it combines
    across the TP group, and the exact vectors of its sketches (computed on the
    tensor's device; ``finish`` sketches them on the host)."""

    __slots__ = ("desc", "kind", "count", "vectors", "sketch")

    def __init__(self, desc: str, kind: str, count: int, vectors: list[torch.Tensor]) -> None:
        self.desc = desc
        self.kind = kind
        self.count = count
        self.vectors = vectors
        self.sketch: list[int] = []


def _tensor_part(
    t: torch.Tensor, param: torch.Tensor, module: nn.Module, inner: bool = False
) -> tuple[str, str, int, list[torch.Tensor]]:
    """(descriptor without the name, kind, element count, exact vectors) of ``t``: the
    bytes of ``param`` (``inner``: one of the inner tensors vLLM keeps them in)."""
    dim, known = _layout(module, param)
    tp = int(getattr(module, "tp_size", 1) or 1)
    split = None if inner else dim
    if tp > 1:
        kind = SPLIT if known and split is not None else WHOLE if known else LOCAL
        if inner:
            kind = LOCAL  # an inner tensor of a sharded wrapper: layout unknown
    else:
        kind = WHOLE
    words = _words(t)
    if split is None:  # held whole: positions along the first dimension and the rest
        dims: list[int | None] = [None] if t.dim() <= 1 else [0, None]
        shape = tuple(words.shape)
    else:
        dims = [split]
        shape = tuple(s for i, s in enumerate(words.shape) if i != split)
    return f"{t.dtype} {split} {shape}", kind, t.numel(), _mapped_sums(words, dims)


# What a backend's process_weights_after_loading did to a parameter, per layer (_HELD:
# parameter name -> (the loaded tensor's id, what)), set by the wrapped method
# (track_model_loads). vLLM's CPU build packs every unquantized linear weight into a
# oneDNN handle and leaves an empty parameter: the layer keeps the parts of the weight
# as loaded ("gone", part). Its small-GEMM path turns bf16 biases into float32 (for
# some shapes only, so TP 1 and TP 2 differ): the bias is read back in the dtype it
# was loaded in, exactly ("as", dtype).
_HELD = "_lmcache_ec_held"


def local_parts(model: nn.Module) -> list[Part] | None:
    """This rank's parts of the encoder digest (module comment above), or None if the
    model has no encoder parameters here (a pipeline stage without the encoder). The
    device work is one table look-up and a sum per word; one device-to-host copy."""
    parts: list[Part] = []
    for name, param, module in sorted(_encoder_parameters(model), key=lambda x: x[0]):
        held = getattr(module, _HELD, {}).get(name.rpartition(".")[2])
        what = held[1] if held is not None else None
        if isinstance(what, tuple) and not param.numel():  # the weight as loaded ("gone")
            desc, kind, count, vectors = what
            parts.append(Part(f"{name} {desc}", kind, count, list(vectors)))
            continue
        if isinstance(what, torch.dtype) and param.dtype != what:  # widened ("as")
            desc, kind, count, vectors = _tensor_part(param.detach().to(what), param, module)
            parts.append(Part(f"{name} {desc}", kind, count, vectors))
            continue
        for tname, t in _plain_tensors(name, param):
            if t.device.type == "meta":
                continue
            desc, kind, count, vectors = _tensor_part(t, param, module, t is not param)
            parts.append(Part(f"{tname} {desc}", kind, count, vectors))
    if not parts:
        return None
    flat = [v for p in parts for v in p.vectors]
    lengths = [v.numel() for v in flat]
    host = torch.cat([v.reshape(-1).to(flat[0].device) for v in flat]).cpu().numpy()
    offset = 0
    it = iter(lengths)
    for p in parts:
        for _ in p.vectors:
            n = next(it)
            p.sketch.extend(_sketch(host[offset : offset + n]))
            offset += n
        p.vectors = []
    return parts


def _desc_word(desc: str) -> int:
    return int.from_bytes(hashlib.sha256(desc.encode()).digest()[:8], "little", signed=True)


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _rows(parts: list[Part]) -> list[list[int]]:
    """What this rank sends per tensor: [descriptor, kind, count, sketches...] as int64."""
    kinds = {SPLIT: 0, WHOLE: 1, LOCAL: 2}
    rows = []
    for p in parts:
        sketch = (p.sketch + [0] * (2 * _LANES))[: 2 * _LANES]
        rows.append([_desc_word(p.desc), kinds[p.kind], p.count] + [_signed(s) for s in sketch])
    return rows


def combine(ranks: list[list[list[int]]]) -> str:
    """The encoder digest from every TP rank's rows (the same answer on every rank: it
    reads only the gathered rows). SPLIT tensors: the ranks' sketches added up; WHOLE
    ones: equal on every rank, taken once; anything else (LOCAL, unequal WHOLE, ranks
    that disagree on the tensors): the ranks' rows in rank order, with the TP size."""
    h = hashlib.sha256(_DIGEST_TAG)
    world = len(ranks)
    layout_bound = len({len(r) for r in ranks}) != 1 or any(
        len({tuple(r[i][:2]) for r in ranks}) != 1 for i in range(len(ranks[0]))
    )
    if not layout_bound:
        for i in range(len(ranks[0])):
            rows = [r[i] for r in ranks]
            desc, kind = rows[0][0], rows[0][1]
            if kind == 0:  # SPLIT
                count = sum(row[2] for row in rows)
                sketch = [sum(row[3 + j] for row in rows) & _MASK64 for j in range(2 * _LANES)]
                h.update(f"{desc} {count} {sketch}\0".encode())
            elif kind == 1 and all(row == rows[0] for row in rows):  # WHOLE, as it should be
                sketch = [v & _MASK64 for v in rows[0][3:]]
                h.update(f"{desc} {rows[0][2]} {sketch}\0".encode())
            else:
                layout_bound = True
                h.update(f"{desc} {rows}\0".encode())
    if layout_bound:
        h.update(f"tp={world} {ranks}\0".encode())
    return h.hexdigest()[:DIGEST_HEX]


def local_digest(model: nn.Module) -> str | None:
    """The encoder digest of a model held whole by this process (TP 1), or None if it
    has no encoder parameters."""
    parts = local_parts(model)
    return None if parts is None else combine([_rows(parts)])


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


def settle_field(model: nn.Module, base: str) -> str | None:
    """The model field for the weights ``model`` holds now: ``<base>~w<digest>``, the
    same on every rank of the TP group and for every TP size (all ranks must call it
    together: it all-gathers over the group's CPU group). None: no rank has an
    encoder.

    Invariant: every rank reaches both all-gathers, whatever its own digest did; a
    failure on any rank raises DigestFailed on all of them."""
    failure: BaseException | None = None
    rows: list[list[int]] = []
    try:
        parts = local_parts(model)
        rows = _rows(parts) if parts is not None else []
        mine = parts is not None
    except Exception as exc:  # joins the all-gathers anyway, flagged
        mine, failure = False, exc
    group = _tp_group()
    if group is None:
        if failure is not None:
            raise DigestFailed(f"cannot fingerprint the encoder: {failure!r}") from failure
        return f"{base}~w{combine([rows])}" if mine else None
    flags = torch.tensor([int(mine), int(failure is not None), len(rows)], dtype=torch.int64)
    gathered = [torch.zeros_like(flags) for _ in range(group.world_size)]
    torch.distributed.all_gather(gathered, flags, group=group.cpu_group)
    failed = [rank for rank, g in enumerate(gathered) if int(g[1])]
    if failed:
        raise DigestFailed(
            f"TP rank(s) {failed} could not fingerprint the encoder"
            + (f" (here: {failure!r})" if failure is not None else "")
        ) from failure
    if not any(int(g[0]) for g in gathered):
        return None
    # Every rank saw the same lengths: all pad to the longest, all join the same gather.
    longest = max(int(g[2]) for g in gathered)
    payload = torch.zeros((longest + 1, 3 + 2 * _LANES), dtype=torch.int64)
    payload[0, 0] = len(rows)
    if rows:
        payload[1 : len(rows) + 1] = torch.tensor(rows, dtype=torch.int64)
    everyone = [torch.zeros_like(payload) for _ in range(group.world_size)]
    torch.distributed.all_gather(everyone, payload, group=group.cpu_group)
    ranks = [
        [list(map(int, row)) for row in p[1 : int(p[0, 0]) + 1].tolist()]
        for p in everyone
        if int(p[0, 0])  # a rank without an encoder (not a TP layout) adds nothing
    ]
    return f"{base}~w{combine(ranks)}"


def weights_digest(model: nn.Module) -> str | None:
    """The encoder's digest, the same on every rank of the TP group and for every TP
    size (all ranks must call it together). Raises DigestFailed on every rank if any
    rank failed."""
    field = settle_field(model, "")
    return None if field is None else field.rpartition("~w")[2]


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
    """After a quantization method's ``process_weights_after_loading``: a parameter
    it emptied (its bytes moved into a backend's own packed handle) keeps its parts
    on the layer, taken from the tensor it had (local_parts reads them). A glance at
    the layer's parameters otherwise, once per layer and load."""
    original = cls.__dict__["process_weights_after_loading"]

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        params = getattr(layer, "named_parameters", None)
        # The loaded tensors (``.data``: the storage the parameter holds now, kept
        # even if the method replaces the parameter's data).
        before = {n: (p, p.data) for n, p in params(recurse=False)} if callable(params) else {}
        result = original(self, layer, *args, **kwargs)
        for name, (param, old) in before.items():
            now = getattr(layer, name, None)
            if not isinstance(now, torch.Tensor) or not old.numel():
                continue
            held = layer.__dict__.setdefault(_HELD, {})
            if name in held and held[name][0] == id(old):
                continue  # a subclass's wrapper already took it
            if not now.numel():  # moved into the backend's handle: keep its parts
                try:
                    held[name] = (id(old), _tensor_part(old, param, layer))
                except Exception as exc:  # then the digest misses this tensor's bytes
                    held.pop(name, None)
                    log.warning(
                        "EC broker: cannot fingerprint %s before it is packed: %s", name, exc
                    )
            elif (
                now.shape == old.shape
                and now.dtype != old.dtype
                and now.dtype.is_floating_point
                and old.dtype.is_floating_point
                and now.dtype.itemsize > old.dtype.itemsize
            ):  # widened (exact): read back in the loaded dtype
                held[name] = (id(old), old.dtype)
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
    misses, no loads, no stores). With ``vllm_config``, the watch also takes the
    digest at load: the engine built on that configuration asks its workers as soon
    as its scheduler exists (:func:`watch_engine_calls`, ``at_load``)."""

    def __init__(
        self, base: str, set_field: Callable[[str], None], vllm_config: Any = None
    ) -> None:
        self._base = base
        self._set_field = set_field
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
