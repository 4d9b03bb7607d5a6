"""The model field of the connector's keys: which weights produced an entry.

A key is ``<model id>@1@0@<mm_hash>@<dtype>``. The disk and remote tiers keep
entries across restarts, and weights are often replaced in place at the same path,
so the model id must change whenever the encoder's output can, and must not
change with anything else (every instance, rank and host serving the same weights
has to agree, whatever is downloaded yet):

- a local directory (or single weights file, e.g. a GGUF): ``<model>#<fingerprint>``,
  the first 16 hex digits of a SHA-256 over

  - the configured HF ``revision``, if any;
  - the bytes of ``config.json`` and of every ``*processor*config*.json`` /
    ``preprocessor_config.json`` at the top of the directory (architecture,
    vision tower, image/video/audio preprocessing);
  - for each weight file at the top of the directory (``*.safetensors``, ``*.bin``,
    ``*.pt``, ``*.pth``, ``*.gguf``; or the model itself when it is one file),
    sorted by name: its name and size, and

    - safetensors: its JSON header (every tensor's name, dtype, shape, offsets)
      and 64 bytes at the start and 64 at the middle of every tensor's data;
    - other formats: 16 evenly spaced samples of 4 KiB.

  So a fingerprint reads a few bytes per tensor, never the whole multi-GB weights
  (milliseconds per shard). Mtimes and owners are not hashed, nor is the path into
  the fingerprint; but the field starts with the ``--model`` string, which vLLM also
  hashes into every mm_hash: the same weights share under the same path (or hub id)
  on every host, never across two paths.

- a hub model id found in the local Hugging Face cache: ``<model>#<commit>``, the
  first 16 hex digits of the snapshot's commit (``--revision`` or ``refs/main``
  resolved). A commit names every file of the repository, so this follows weight
  updates without reading any file, and it does not depend on which files of the
  snapshot are downloaded yet, on how the revision was spelled (branch, tag or
  hash) or on where the cache is. Files edited in place inside the cache are not
  noticed (serve such weights from a directory, or set ``model_name``). A path to a
  snapshot directory (``.../models--org--name/snapshots/<commit>``, what vLLM
  serves a hub id from when ``HF_HUB_OFFLINE`` is set) gets the same id as the hub
  id: ``org/name#<commit>``.

- a hub model id not in the cache: ``<model>`` (``<model>#rev=<revision>`` with a
  revision), and a warning that the key does not follow weight updates.

``model_name`` in the connector's extra config replaces all of this: the string is
used verbatim (a fleet that names its model versions itself).

To this file-based part (or ``model_name``) the connector appends
``+c<config>`` (:func:`config_fingerprint`): the effective configuration that decides
the encoder's output and is in neither the files nor vLLM's mm_hash -- load format
(``dummy`` weights!), quantization, hf overrides, remote code, server-level
processor and media kwargs, the model class, the vLLM version (issue 39).

Then ``~w<digest>``: the digest of the encoder's weights in memory
(:mod:`.weights_identity`), taken right after the load and after every weight change
(``reload_weights``, an RL weight sync, ``model.load_weights`` called directly), the
same for every tensor-parallel layout of the same weights. So the whole field is
``<files>+c<config>~w<digest>``.

Which process computes it matters as much as what is hashed: vLLM builds a
worker's connector before ``load_model`` downloads the weights and the
scheduler's after, so the connector computes the field in the scheduler only and
sends it to the workers with each step's metadata (:mod:`.vllm`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import struct
from pathlib import Path

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

FINGERPRINT_HEX = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TENSOR_SAMPLE = 64
FILE_SAMPLES = 16
FILE_SAMPLE_BYTES = 4096
# A snapshot directory of the HF cache is named after its commit (git SHA-1, or SHA-256).
COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# A safetensors header larger than this is not a header we should trust (the format's
# own reference reader refuses headers over 100 MB).
MAX_SAFETENSORS_HEADER = 100 << 20


def check_model_name(name: object) -> str:
    """An explicit ``model_name``: a non-empty string without ``@`` (the key's separator)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"ec_connector_extra_config model_name must be a non-empty string, got {name!r}"
        )
    if "@" in name:
        raise ValueError(
            f"ec_connector_extra_config model_name {name!r} contains '@', which separates "
            "the fields of a cache key; choose a name without '@'"
        )
    return name


def model_id(
    model: str,
    revision: str | None = None,
    explicit: str | None = None,
    config: str | None = None,
) -> str:
    """The model field of every key this instance reads and writes (see the module doc):
    with ``config`` (:func:`config_fingerprint`), followed by ``+c<config>``. Reads the
    model's files: call it once the weights are in place."""
    if config is not None:
        return with_config(model_id(model, revision, explicit), config)
    if explicit is not None:
        return check_model_name(explicit)
    path = Path(model).expanduser()
    repo_id = _cached_repo_id(path.absolute())
    if repo_id is not None and path.is_dir():
        # vLLM itself replaces a hub id by this path when HF_HUB_OFFLINE is set.
        return f"{repo_id}#{path.name[:FINGERPRINT_HEX]}"
    if path.is_dir() or path.is_file():
        return f"{model}#{fingerprint(str(path), revision)}"
    snapshot = _hub_snapshot(model, revision)
    if snapshot is None:
        log.warning(
            "EC broker: cannot find the files of model %r locally; its cache keys will not "
            "change when its weights do (set ec_connector_extra_config model_name to a "
            "name that changes with them)",
            model,
        )
        return f"{model}#rev={revision}" if revision else model
    if _cached_repo_id(snapshot) is not None:
        return f"{model}#{snapshot.name[:FINGERPRINT_HEX]}"
    return f"{model}#{fingerprint(str(snapshot), revision)}"  # not the usual cache layout


def _cached_repo_id(path: Path) -> str | None:
    """``org/name`` if ``path`` is a snapshot directory of a model in an HF cache
    (``.../models--org--name/snapshots/<commit>``), else None. Hub ids never contain
    ``--``, so the folder name maps back to exactly one id."""
    repo = path.parent.parent.name
    if not (
        COMMIT.fullmatch(path.name)
        and path.parent.name == "snapshots"
        and repo.startswith("models--")
    ):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1)


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The directory in the local HF cache that ``config.json`` of ``model`` at
    ``revision`` (default ``main``) was read from, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # an id that is no repository name, a broken cache
        return None
    return Path(found).parent if isinstance(found, str) else None


@functools.lru_cache(maxsize=16)
def fingerprint(directory: str | Path, revision: str | None = None) -> str:
    """Short hex digest of what determines the encoder's output (see the module doc);
    ``directory`` may also be a single weights file."""
    root = Path(directory)
    h = hashlib.sha256()
    h.update(b"lmcache-ec-model-v1\0")
    h.update(f"revision={revision or ''}\0".encode())
    if root.is_file():  # a single-file model
        _hash_weights(h, root)
        return h.hexdigest()[:FINGERPRINT_HEX]
    names = sorted(os.listdir(root))
    for name in names:
        if _is_config(name) and (root / name).is_file():
            data = (root / name).read_bytes()
            h.update(f"config {name} {len(data)}\0".encode())
            h.update(data)
    for name in names:
        if name.endswith(WEIGHT_SUFFIXES) and (root / name).is_file():
            _hash_weights(h, root / name)
    return h.hexdigest()[:FINGERPRINT_HEX]


def _is_config(name: str) -> bool:
    return name == "config.json" or (
        name.endswith(".json") and "processor" in name and "config" in name
    )


def _hash_weights(h: hashlib._Hash, path: Path) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"weights {path.name} {size}\0".encode())
        if path.name.endswith(".safetensors") and _hash_safetensors(h, f.fileno(), size):
            return
        for i in range(FILE_SAMPLES):
            off = (size - FILE_SAMPLE_BYTES) * i // max(FILE_SAMPLES - 1, 1)
            h.update(os.pread(f.fileno(), FILE_SAMPLE_BYTES, max(off, 0)))


def _hash_safetensors(h: hashlib._Hash, fd: int, size: int) -> bool:
    """Header plus a sample of every tensor; False if the file is not valid safetensors
    (then it is sampled like any other file)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return False
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_SAFETENSORS_HEADER, size - 8):
        return False
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(header, dict):
        return False
    h.update(raw)
    base = 8 + n
    for name in sorted(k for k in header if k != "__metadata__"):
        offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
        ):
            return False
        start, end = offsets
        for off in (start, start + (end - start) // 2):
            h.update(os.pread(fd, min(TENSOR_SAMPLE, max(end - off, 0)), base + off))
    return True


# ------------------------------------------------------------------ configuration

CONFIG_TAG = "lmcache-ec-config-v1"


def _stable(value: object) -> object:
    """A JSON-able, process-independent form of a config value (a callable by its
    qualified name: its repr would carry an address)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_stable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return _stable(to_dict())
        except Exception:  # a config object that cannot dump itself
            pass
    return str(value)


def _model_class(model_config: object) -> str:
    """The class vLLM runs the model with (``module.qualname``), else the architectures."""
    architectures = list(getattr(model_config, "architectures", None) or [])
    try:
        from vllm.model_executor.models import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(architectures, model_config)
        return f"{cls.__module__}.{cls.__qualname__}"
    except Exception:  # a registry that cannot resolve here: the names still separate
        return ",".join(architectures)


def _remote_code(model: str, trust_remote_code: bool) -> str:
    """A digest of the model directory's Python files when remote code runs (the
    modelling code is then the model's own, not vLLM's)."""
    if not trust_remote_code:
        return ""
    root = Path(model).expanduser()
    if not root.is_dir():
        return "hub"  # the hub commit (the file part) names the code too
    h = hashlib.sha256()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and (root / name).is_file():
            data = (root / name).read_bytes()
            h.update(f"{name} {len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()[:FINGERPRINT_HEX]


def config_parts(vllm_config: object) -> dict[str, object]:
    """Every part of the effective configuration that decides the encoder's output
    and is in neither the weight files nor vLLM's mm_hash (docs/design.md, "Keys",
    says why each is there). Not in it, on purpose: tensor/pipeline/data parallel
    sizes, the executor, the EC role, ``--mm-encoder-only``, attention backends,
    batch sizes, the KV cache (same computation, so instances that differ in them
    keep sharing); the dtype (its own field of the key)."""
    import vllm

    mc = getattr(vllm_config, "model_config", None)
    mm = getattr(mc, "multimodal_config", None)
    load = getattr(vllm_config, "load_config", None)
    model = str(getattr(mc, "model", ""))
    trust = bool(getattr(mc, "trust_remote_code", False))
    return {
        "vllm": getattr(vllm, "__version__", "?"),
        "model_class": _model_class(mc) if mc is not None else "",
        "load_format": _stable(getattr(load, "load_format", None)),
        "model_loader_extra_config": _stable(getattr(load, "model_loader_extra_config", None)),
        "quantization": _stable(getattr(mc, "quantization", None)),
        "hf_overrides": _stable(getattr(mc, "hf_overrides", None)),
        "model_class_overrides": _stable(getattr(mc, "model_class_overrides", None)),
        "trust_remote_code": trust,
        "remote_code": _remote_code(model, trust),
        "code_revision": _stable(getattr(mc, "code_revision", None)),
        "mm_processor_kwargs": _stable(getattr(mm, "mm_processor_kwargs", None)),
        "media_io_kwargs": _stable(getattr(mm, "media_io_kwargs", None)),
        "mm_device_do_normalize": _stable(getattr(mm, "mm_device_do_normalize", None)),
        "mm_encoder_attn_dtype": _stable(getattr(mm, "mm_encoder_attn_dtype", None)),
        "mm_encoder_fp8_scale_path": _stable(getattr(mm, "mm_encoder_fp8_scale_path", None)),
        "video_pruning_rate": _stable(getattr(mm, "video_pruning_rate", None)),
        "video_pruning_method": _stable(getattr(mm, "video_pruning_method", None)),
    }


def config_fingerprint(vllm_config: object) -> str:
    """Short hex digest of :func:`config_parts`."""
    text = json.dumps(config_parts(vllm_config), sort_keys=True, default=str)
    return hashlib.sha256(f"{CONFIG_TAG}\0{text}".encode()).hexdigest()[:FINGERPRINT_HEX]


def with_config(field: str, config: str) -> str:
    """The model field: the file-based part (or ``model_name``) and the configuration's."""
    return f"{field}+c{config}"
