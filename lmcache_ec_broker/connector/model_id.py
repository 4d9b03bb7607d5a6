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

This is the field at start. After an in-place weight update (``reload_weights``, an
RL weight sync) it becomes ``<field>~w<fingerprint of the encoder's weights in
memory>`` (:mod:`.weights_identity`).

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


def model_id(model: str, revision: str | None = None, explicit: str | None = None) -> str:
    """The model field of every key this instance reads and writes (see the module doc).
    Reads the model's files: call it once the weights are in place."""
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
        COMMIT.fullmatch(path.name) and path.parent.name == "snapshots" and repo.startswith("models--")
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
