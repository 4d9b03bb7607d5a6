"""One disk-tier entry = one safetensors file: naming, writing, validating, reading.

File format (readable by any safetensors reader, e.g. ``safetensors.safe_open``):
8-byte little-endian header length, a JSON header padded with spaces to a
multiple of 8 bytes, then the raw tensor bytes. The header holds one tensor,
``encoder_output``, and string metadata: ``format``, ``version``, the full
original ``key``, our ``dtype`` and ``shape`` and a ``checksum`` of the data
(``blake3:<hex>``, or ``blake2b:<hex>`` where blake3 is not installed; a reader
without blake3 leaves blake3 files alone rather than calling them corrupt). The
format is written here directly rather than through the safetensors package so
the data goes from the slab to the file (and back) with no intermediate copy.

Invariants kept here:
- ``key_to_filename`` yields one path component that is never ``.``/``..``,
  never starts with ``.`` (temp files and the lock do), contains only
  ``[A-Za-z0-9_@+=,.-]`` and ``%XX`` escapes, and is at most ``NAME_MAX`` bytes:
  no key can name a file outside the directory. Escaping is injective; names
  shortened with a hash suffix carry ``~`` (escaped everywhere else), so the two
  kinds never collide, and the stored key is compared on every load.
- A file is published only complete: temp file (``O_EXCL``, 0600 whatever the
  umask), fsync, rename.
- Nothing is served from a file whose header, size, key or checksum disagree, nor
  from one another uid owns or may write (``check_trusted``): a checksum is no
  defence against a writer, who can recompute it (``directory.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from ....protocol import DTYPE_ITEMSIZE, Extent, expected_nbytes

try:
    import blake3 as _blake3
except ImportError:  # pragma: no cover - blake3 is a core dependency
    _blake3 = None

FORMAT = "lmcache-ec-broker"
FORMAT_VERSION = "1"
TENSOR_NAME = "encoder_output"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = ".lock"
NAME_MAX = 255
_MAX_STEM = 160  # leaves room for '~<hash>', the suffix and a quarantine suffix
_MAX_HEADER = 1 << 20
_HEADER_LEN = struct.Struct("<Q")
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@+=,.-")

# Our dtype names (torch's) -> safetensors dtype codes. Dtypes safetensors has
# no code for are stored as flat U8 bytes; our dtype/shape in the metadata rule.
ST_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}


class CorruptFile(Exception):
    """A file that must not be served; the message says what is wrong with it."""


class UnverifiableFile(Exception):
    """A well-formed file whose checksum algorithm this install lacks (blake3 not
    installed): not served, but not corrupt either -- it must not be quarantined."""


def key_to_filename(key: str) -> str:
    raw = key.encode("utf-8", "surrogatepass")
    out = []
    for i, b in enumerate(raw):
        if b in _SAFE and not (i == 0 and b == 0x2E):  # no leading '.'
            out.append(chr(b))
        else:
            out.append(f"%{b:02X}")
    stem = "".join(out)
    if len(stem) > _MAX_STEM:
        cut = stem[:_MAX_STEM]
        if "%" in cut[-2:]:  # do not leave half an escape behind
            cut = cut[: cut.rindex("%")]
        stem = cut + "~" + hashlib.blake2b(raw, digest_size=16).hexdigest()
    return stem + SUFFIX


def _hasher() -> Any:
    return _blake3.blake3() if _blake3 is not None else hashlib.blake2b(digest_size=32)


def _checksum(h: Any) -> str:
    return f"{'blake3' if _blake3 is not None else 'blake2b'}:{h.hexdigest()}"


_PLACEHOLDER = _checksum(_hasher()).split(":")[0] + ":" + "0" * 64


def _verifier(checksum: str) -> Any:
    algo, _, digest = checksum.partition(":")
    if len(digest) != 64:
        raise CorruptFile(f"malformed checksum {checksum[:80]!r}")
    if algo == "blake3":
        if _blake3 is None:
            raise UnverifiableFile(
                "the file's checksum is blake3 but the blake3 package is not installed "
                "(pip install blake3)"
            )
        return _blake3.blake3()
    if algo == "blake2b":
        return hashlib.blake2b(digest_size=32)
    raise CorruptFile(f"unsupported checksum algorithm {algo[:20]!r}")


def _st_layout(dtype: str, shape: list[int], nbytes: int) -> tuple[str, list[int]]:
    code = ST_DTYPES.get(dtype)
    return (code, list(shape)) if code is not None else ("U8", [nbytes])


def build_header(key: str, dtype: str, shape: list[int], checksum: str) -> bytes:
    """Length prefix + padded JSON header; its size depends only on key, dtype and shape."""
    nbytes = expected_nbytes(dtype, shape)
    st_dtype, st_shape = _st_layout(dtype, shape, nbytes)
    header = {
        "__metadata__": {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "key": key,
            "dtype": dtype,
            "shape": json.dumps(list(shape), separators=(",", ":")),
            "checksum": checksum,
        },
        TENSOR_NAME: {"dtype": st_dtype, "shape": st_shape, "data_offsets": [0, nbytes]},
    }
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    body += b" " * (-(len(body) + 8) % 8)  # data starts 8-byte aligned, as the spec asks
    return _HEADER_LEN.pack(len(body)) + body


def file_size_for(key: str, dtype: str, shape: list[int]) -> int:
    return len(build_header(key, dtype, shape, _PLACEHOLDER)) + expected_nbytes(dtype, shape)


class FileMeta(msgspec.Struct):
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: str
    data_start: int
    file_size: int


class _TensorInfo(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


def _pread_exactly(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise CorruptFile(f"truncated: expected {n} bytes at offset {offset}")
        data += more
    return data


def read_meta(fd: int) -> FileMeta:
    """Parse and check the header of the open file ``fd``; CorruptFile says what is wrong."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CorruptFile(f"truncated: {size} bytes, not even a header length")
    (hlen,) = _HEADER_LEN.unpack(_pread_exactly(fd, 8, 0))
    if hlen < 2 or hlen > _MAX_HEADER:
        raise CorruptFile(f"not a safetensors file of ours: header length {hlen}")
    if 8 + hlen > size:
        raise CorruptFile(f"truncated: header of {hlen} bytes but the file has {size}")
    try:
        header = msgspec.json.decode(_pread_exactly(fd, hlen, 8))
        if not isinstance(header, dict) or set(header) != {"__metadata__", TENSOR_NAME}:
            raise CorruptFile("not a file of ours: unexpected header entries")
        meta = msgspec.convert(header["__metadata__"], dict[str, str])
        info = msgspec.convert(header[TENSOR_NAME], _TensorInfo)
        if meta.get("format") != FORMAT:
            raise CorruptFile(f"not a file of ours: format {meta.get('format', '')[:40]!r}")
        if meta.get("version") != FORMAT_VERSION:
            raise CorruptFile(f"unsupported format version {meta.get('version', '')[:20]!r}")
        key, dtype, checksum = meta["key"], meta["dtype"], meta["checksum"]
        shape = msgspec.json.decode(meta["shape"], type=list[int])
    except (msgspec.MsgspecError, KeyError, RecursionError) as exc:
        raise CorruptFile(f"malformed header: {str(exc)[:200]}") from None
    if dtype not in DTYPE_ITEMSIZE:
        raise CorruptFile(f"unknown dtype {dtype[:40]!r}")
    try:
        nbytes = expected_nbytes(dtype, shape)
    except ValueError as exc:
        raise CorruptFile(str(exc)) from None
    if (info.dtype, info.shape) != _st_layout(dtype, shape, nbytes) or info.data_offsets != (
        0,
        nbytes,
    ):
        raise CorruptFile("tensor description disagrees with the metadata")
    expected = 8 + hlen + nbytes
    if size != expected:
        kind = "truncated" if size < expected else "trailing bytes"
        raise CorruptFile(f"{kind}: {size} bytes, expected {expected}")
    _verifier(checksum)  # last: a damaged file is corrupt even where blake3 is missing
    return FileMeta(key, dtype, shape, nbytes, checksum, 8 + hlen, size)


FILE_MODE = 0o600


def check_trusted(fd: int, unreachable: bool = False) -> None:
    """Refuse a file the broker's uid does not own (CorruptFile: it is quarantined,
    never served), or one others may write unless ``unreachable`` (its directory was
    private all along: nobody else could get to it); make a loose one 0600."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise CorruptFile(f"owned by uid {st.st_uid}, not the broker's: another user wrote it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and not unreachable:
        raise CorruptFile(f"mode {mode:04o}: other users could have rewritten it")
    if mode & 0o077:
        os.fchmod(fd, FILE_MODE)


def open_nofollow(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_meta_path(path: str, unreachable: bool = False) -> FileMeta:
    """``unreachable``: as in ``check_trusted``."""
    fd = open_nofollow(path)
    try:
        check_trusted(fd, unreachable)
        return read_meta(fd)
    finally:
        os.close(fd)


@contextmanager
def slab_views(mm: Any, extents: list[Extent]) -> Iterator[list[memoryview]]:
    """Views of ``extents`` of the mapping, all released on exit (so it can be unmapped)."""
    base = memoryview(mm)
    views = [base[start : start + n] for start, n in extents]
    try:
        yield views
    finally:
        for v in views:
            v.release()
        base.release()


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    try:
        while view.nbytes:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        view.release()


def write_file(
    directory: str,
    dir_fd: int,
    key: str,
    dtype: str,
    shape: list[int],
    views: list[memoryview],
) -> tuple[int, int]:
    """Write one entry atomically; returns (file size, inode) of the published file."""
    final = os.path.join(directory, key_to_filename(key))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            header = build_header(key, dtype, shape, _PLACEHOLDER)
            _write_all(fd, header)
            h = _hasher()
            for v in views:
                h.update(v)
                _write_all(fd, v)
            final_header = build_header(key, dtype, shape, _checksum(h))
            assert len(final_header) == len(header)  # same length: rewrite in place
            os.pwrite(fd, final_header, 0)
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    return st.st_size, st.st_ino


def read_into(path: str, key: str, views: list[memoryview]) -> FileMeta:
    """Fill ``views`` with the data of the file for ``key`` and verify the checksum.

    Raises FileNotFoundError if the file is gone, CorruptFile if it must not be
    served (the views may then hold garbage: the caller aborts the reservation).
    """
    fd = open_nofollow(path)
    try:
        check_trusted(fd)
        meta = read_meta(fd)
        if meta.key != key:
            raise CorruptFile(f"file holds key {meta.key[:80]!r}, not the one requested")
        if sum(v.nbytes for v in views) != meta.nbytes:
            raise CorruptFile("file size changed since it was indexed")
        h = _verifier(meta.checksum)
        offset = meta.data_start
        for v in views:
            got = 0
            while got < v.nbytes:
                n = os.preadv(fd, [v[got:]], offset + got)
                if n == 0:
                    raise CorruptFile(f"truncated while reading at offset {offset + got}")
                got += n
            h.update(v)
            offset += v.nbytes
        if h.hexdigest() != meta.checksum.partition(":")[2]:
            raise CorruptFile("checksum mismatch: the data is corrupt")
        return meta
    finally:
        os.close(fd)
