"""The digest of the multimodal encoder's weights as they are in memory (the ``~w``
part of the key's model field; when it is taken: :mod:`.weights_identity`).

Every parameter outside ``get_language_model()`` (vision/audio tower and projector),
read as 16-bit words, each word mapped through a fixed injective table and summed on
the device along the dimension tensor parallelism splits (column-parallel layers: the
output dimension; row-parallel: the input dimension; tensors held whole: along the
first dimension and along the others). The exact int64 vectors left are sketched on
the host (linear, mod 2**64): the ranks' sketches of a split tensor add up to the
sketch of the whole tensor, so TP 1 and TP N give the same digest. A tensor of a
layout it does not know (or held whole but unequal across ranks) makes the digest
layout-bound: exact, not shared across TP sizes. Integer sums are exact: equal weights
give equal digests on any device.

This module is one rank's part (:func:`local_parts`, :func:`rank_rows`) and how the
ranks' rows combine (:func:`combine`); gathering them over the TP group is
:mod:`.tp_digest`'s.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

DIGEST_HEX = 16
_DIGEST_TAG = b"lmcache-ec-weights-v2\0"

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
LANES = 2  # sketch coefficients per vector
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
    """[LANES, n] fixed pseudo-random uint64 (splitmix64 of the position)."""
    with np.errstate(over="ignore"):
        x = np.arange(1, n + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.arange(LANES, dtype=np.uint64)[:, None] * np.uint64(0xD1B54A32D192ED03)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _sketch(vector: np.ndarray) -> list[int]:
    """``LANES`` dot products of an exact int64 vector with fixed coefficients, mod 2**64."""
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
# parameter name -> (the loaded tensor's id, what)). Written by record_processed only
# (weights_identity wraps every quantization method's process_weights_after_loading to
# call it), read by local_parts only. vLLM's CPU build packs every unquantized linear
# weight into a oneDNN handle and leaves an empty parameter: the layer keeps the parts
# of the weight as loaded ("gone", part). Its small-GEMM path turns bf16 biases into
# float32 (for some shapes only, so TP 1 and TP 2 differ): the bias is read back in the
# dtype it was loaded in, exactly ("as", dtype).
_HELD = "_lmcache_ec_held"


def loaded_tensors(layer: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The layer's own parameters with the tensors they hold now (``.data``: the
    storage, kept even if a backend then replaces the parameter's data); taken before
    its quantization method's ``process_weights_after_loading``."""
    params = getattr(layer, "named_parameters", None)
    return {n: (p, p.data) for n, p in params(recurse=False)} if callable(params) else {}


def record_processed(layer: Any, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """After ``process_weights_after_loading``: a parameter it emptied (its bytes moved
    into a backend's own packed handle) keeps its parts on the layer, taken from the
    tensor it had (``before``: :func:`loaded_tensors`); one it widened is read back in
    the loaded dtype. A glance at the layer's parameters otherwise, once per layer and
    load."""
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
                log.warning("EC broker: cannot fingerprint %s before it is packed: %s", name, exc)
        elif (
            now.shape == old.shape
            and now.dtype != old.dtype
            and now.dtype.is_floating_point
            and old.dtype.is_floating_point
            and now.dtype.itemsize > old.dtype.itemsize
        ):  # widened (exact): read back in the loaded dtype
            held[name] = (id(old), old.dtype)


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


def rank_rows(parts: list[Part]) -> list[list[int]]:
    """What this rank sends per tensor: [descriptor, kind, count, sketches...] as int64."""
    kinds = {SPLIT: 0, WHOLE: 1, LOCAL: 2}
    rows = []
    for p in parts:
        sketch = (p.sketch + [0] * (2 * LANES))[: 2 * LANES]
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
                sketch = [sum(row[3 + j] for row in rows) & _MASK64 for j in range(2 * LANES)]
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
    return None if parts is None else combine([rank_rows(parts)])
