"""Lay a local model out as a Hugging Face hub cache (tests of hub model ids, offline).

The layout is the one ``huggingface_hub`` writes and reads (``HF_HUB_CACHE``)::

    <cache>/models--<org>--<name>/blobs/<sha256>
    <cache>/models--<org>--<name>/snapshots/<commit>/<file> -> ../../blobs/<sha256>
    <cache>/models--<org>--<name>/refs/main                  (the commit, no newline)

``snapshot(..., weights=False)`` leaves the weight files out: a cache after vLLM's
API server has fetched the configs and before a worker's ``load_model`` has
downloaded the weights. ``add_weights`` is that download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def repo_dir(cache: str | Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def snapshot(
    model_dir: str | Path, cache: str | Path, repo_id: str, commit: str, *, weights: bool = True
) -> Path:
    """Put the files at the top of ``model_dir`` into the cache as snapshot ``commit``
    of ``repo_id`` and point ``refs/main`` at it; returns the snapshot directory."""
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be 40 lowercase hex digits, got {commit!r}")
    repo = repo_dir(cache, repo_id)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for src in sorted(Path(model_dir).iterdir()):
        if src.is_file() and (weights or not src.name.endswith(WEIGHT_SUFFIXES)):
            _link_blob(src, repo, snap / src.name)
    refs = repo / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(commit)
    return snap


def add_weights(model_dir: str | Path, snap: str | Path) -> list[str]:
    """Copy the weight files of ``model_dir`` that ``snap`` lacks into it (each appears
    whole, as a finished download does); returns the names copied."""
    snap = Path(snap)
    repo = snap.parent.parent
    copied = []
    for src in sorted(Path(model_dir).iterdir()):
        if src.is_file() and src.name.endswith(WEIGHT_SUFFIXES) and not (snap / src.name).exists():
            _link_blob(src, repo, snap / src.name)
            copied.append(src.name)
    return copied


def _link_blob(src: Path, repo: Path, dest: Path) -> None:
    digest = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    blobs = repo / "blobs"
    blobs.mkdir(exist_ok=True)
    blob = blobs / digest.hexdigest()
    if not blob.exists():
        tmp = blob.with_name(f".{blob.name}.{os.getpid()}.incomplete")
        shutil.copyfile(src, tmp)
        os.replace(tmp, blob)
    tmp_link = dest.with_name(f".{dest.name}.{os.getpid()}.link")
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(os.path.relpath(blob, dest.parent))
    os.replace(tmp_link, dest)
