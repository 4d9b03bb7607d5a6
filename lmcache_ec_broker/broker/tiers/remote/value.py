"""The value format of the remote tier: a self-describing header, then the tensor bytes.

A remote store is shared with other brokers (and anyone else who can write to
it), so every value read back is untrusted input. Layout, little-endian:

    fixed   magic 4s | version u16 | flags u16 | algo u8 | pad 3x | meta_len u32 |
            payload_len u64 | checksum 32s                        (56 bytes)
    meta    msgpack {key, dtype, shape}                            (meta_len bytes)
    mac     HMAC-SHA256 over fixed + meta (only with FLAG_HMAC)    (32 bytes)
    payload the tensor's bytes                                     (payload_len bytes)

The checksum covers the payload; ``algo`` says which one. Unsigned values use
xxh3-128 (zero-padded to 32 bytes): it catches truncation and corruption at ~27 GB/s,
where blake3 runs at ~5.5 GB/s and cost as much as moving a 2 MiB entry. Signed
values (``remote_hmac_key_file``) use blake3 (else blake2b-256): the MAC covers the
fixed part (so the checksum) and the meta, and only a collision-resistant checksum
makes that a signature of the payload too -- so a signed value with a
non-cryptographic checksum is refused. The key inside the meta must equal the key
it was read under: a value copied to another key is refused.

Nothing here trusts a length before checking it against a limit, and a value is
served only after ``Verifier.finish`` confirmed checksum and MAC.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgspec

from ....protocol import expected_nbytes

try:  # blake3 is a dependency, but the format stays readable without it
    import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised by hiding the module in a subprocess
    _blake3 = None
try:  # xxhash is a dependency too; without it unsigned values fall back to blake3
    import xxhash as _xxhash
except ImportError:  # pragma: no cover
    _xxhash = None

MAGIC = b"ECRV"
VERSION = 1
FLAG_HMAC = 1
ALGO_BLAKE3 = 1
ALGO_BLAKE2B = 2
ALGO_XXH3_128 = 3  # not collision-resistant: never accepted on a signed value
CRYPTOGRAPHIC = (ALGO_BLAKE3, ALGO_BLAKE2B)
KNOWN_ALGOS = (ALGO_BLAKE3, ALGO_BLAKE2B, ALGO_XXH3_128)
DIGEST_LEN = 32  # the header's checksum field; shorter digests are zero-padded
FIXED = struct.Struct("<4sHHB3xIQ32s")
MAC_LEN = 32
MAX_META = 4096  # bytes of msgpack meta; a real one is < 1.2 KiB (key <= 1 KiB)
MAX_HEADER = FIXED.size + MAX_META + MAC_LEN
MAX_NDIM = 16


class BadValue(ValueError):
    """The value is not servable; the message names what is wrong (for the log)."""


class _Meta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    key: str
    dtype: str
    shape: list[int]


_encode_meta = msgspec.msgpack.Encoder().encode
_decode_meta = msgspec.msgpack.Decoder(_Meta).decode


class Header(msgspec.Struct, frozen=True):
    """A parsed, bounds-checked header. ``size`` = bytes before the payload."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    algo: int
    checksum: bytes
    size: int
    signed: bool


def default_algo(hmac_key: bytes | None) -> int:
    """The checksum a writer uses: fast for unsigned values, cryptographic for signed ones."""
    if hmac_key is None and _xxhash is not None:
        return ALGO_XXH3_128
    return ALGO_BLAKE3 if _blake3 is not None else ALGO_BLAKE2B


def new_hasher(algo: int) -> Any:
    if algo == ALGO_BLAKE3:
        if _blake3 is None:
            raise BadValue("value is checksummed with blake3, which is not installed here")
        return _blake3.blake3()
    if algo == ALGO_BLAKE2B:
        return hashlib.blake2b(digest_size=32)
    if algo == ALGO_XXH3_128:
        if _xxhash is None:
            raise BadValue("value is checksummed with xxh3-128, but xxhash is not installed here")
        return _xxhash.xxh3_128()
    raise BadValue(f"unknown checksum algorithm {algo}")


def _digest(h: Any) -> bytes:
    return h.digest().ljust(DIGEST_LEN, b"\0")


def checksum(views: list[memoryview] | list[bytes], algo: int) -> bytes:
    h = new_hasher(algo)
    for v in views:
        h.update(v)
    return _digest(h)


def _mac(hmac_key: bytes, fixed: bytes, meta: bytes) -> bytes:
    return hmac.new(hmac_key, fixed + meta, hashlib.sha256).digest()


def encode_header(
    key: str,
    dtype: str,
    shape: list[int] | tuple[int, ...],
    payload_checksum: bytes,
    nbytes: int,
    algo: int,
    hmac_key: bytes | None = None,
) -> bytes:
    """The bytes to store in front of the payload."""
    meta = _encode_meta(_Meta(key, dtype, list(shape)))
    if len(meta) > MAX_META:
        raise ValueError(f"key too long for the remote value header ({len(meta)} > {MAX_META})")
    flags = FLAG_HMAC if hmac_key else 0
    fixed = FIXED.pack(MAGIC, VERSION, flags, algo, len(meta), nbytes, payload_checksum)
    mac = _mac(hmac_key, fixed, meta) if hmac_key else b""
    return fixed + meta + mac


def encode_value(
    key: str,
    dtype: str,
    shape: list[int],
    payload: bytes,
    hmac_key: bytes | None = None,
    algo: int | None = None,
) -> bytes:
    """Header + payload in one bytes object (tests and tools; the tier streams instead)."""
    algo = algo or default_algo(hmac_key)
    return (
        encode_header(key, dtype, shape, checksum([payload], algo), len(payload), algo, hmac_key)
        + payload
    )


def fixed_lengths(fixed: bytes) -> tuple[int, int]:
    """(header size, payload length) from the fixed part, after the cheap checks."""
    if len(fixed) < FIXED.size:
        raise BadValue(f"value is {len(fixed)} bytes long, shorter than a header")
    magic, version, flags, _algo, meta_len, payload_len, _ = FIXED.unpack_from(fixed, 0)
    if magic != MAGIC:
        raise BadValue("not an encoder-cache value (bad magic)")
    if version != VERSION:
        raise BadValue(f"value format version {version}; this broker reads version {VERSION}")
    if flags & ~FLAG_HMAC:
        raise BadValue(f"unknown header flags {flags:#x}")
    if meta_len > MAX_META:
        raise BadValue(f"header meta of {meta_len} bytes exceeds {MAX_META}")
    return FIXED.size + meta_len + (MAC_LEN if flags & FLAG_HMAC else 0), payload_len


def parse_header(
    data: bytes | memoryview,
    key: str,
    max_nbytes: int,
    hmac_key: bytes | None = None,
    total_len: int | None = None,
) -> Header:
    """Parse and check the header at the start of ``data`` (which must hold all of it).

    ``total_len`` is the whole value's length when known: it must be exactly header
    + payload. With ``hmac_key`` an unsigned or wrongly signed value is refused.
    Raises BadValue naming the first problem.
    """
    data = bytes(data[:MAX_HEADER])
    size, payload_len = fixed_lengths(data)
    if len(data) < size:
        raise BadValue(f"value is truncated inside its header ({len(data)} < {size} bytes)")
    _, _, flags, algo, meta_len, _, digest = FIXED.unpack_from(data, 0)
    if algo not in KNOWN_ALGOS:
        raise BadValue(f"unknown checksum algorithm {algo}")
    fixed = data[: FIXED.size]
    meta_raw = data[FIXED.size : FIXED.size + meta_len]
    signed = bool(flags & FLAG_HMAC)
    if hmac_key is not None:
        if not signed:
            raise BadValue("value is not signed but remote_hmac_key_file is set")
        if algo not in CRYPTOGRAPHIC:
            raise BadValue(
                "value is signed over a non-cryptographic checksum (its payload could be swapped)"
            )
        mac = data[FIXED.size + meta_len : size]
        if not hmac.compare_digest(mac, _mac(hmac_key, fixed, meta_raw)):
            raise BadValue("value signature does not match (wrong key or altered value)")
    try:
        meta = _decode_meta(meta_raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadValue(f"header meta does not parse: {exc}") from None
    if meta.key != key:
        raise BadValue("value was stored under another key")
    if len(meta.shape) > MAX_NDIM:
        raise BadValue(f"shape has {len(meta.shape)} dimensions (max {MAX_NDIM})")
    if any(d < 0 or d > 1 << 62 for d in meta.shape):
        raise BadValue(f"shape {meta.shape[:MAX_NDIM]} has an impossible dimension")
    try:
        implied = expected_nbytes(meta.dtype, meta.shape)
    except ValueError as exc:
        raise BadValue(str(exc)) from None
    if implied != payload_len:
        raise BadValue(
            f"payload length {payload_len} does not match dtype {meta.dtype} shape {meta.shape}"
        )
    if payload_len > max_nbytes:
        raise BadValue(f"payload of {payload_len} bytes exceeds the limit of {max_nbytes}")
    if total_len is not None and total_len != size + payload_len:
        raise BadValue(
            f"value is {total_len} bytes, header says {size + payload_len} "
            "(truncated or has trailing bytes)"
        )
    return Header(meta.dtype, tuple(meta.shape), payload_len, algo, digest, size, signed)


def stored_key(data: bytes | memoryview) -> str | None:
    """The key a value's header says it was written for, without checking anything
    else (no signature): None when the header does not parse. Used only to tell
    apart namespaces that nest (``remote_transport.owned``), never to serve."""
    try:
        data = bytes(data[:MAX_HEADER])
        size, _ = fixed_lengths(data)
        meta_len = FIXED.unpack_from(data, 0)[4]
        return _decode_meta(data[FIXED.size : FIXED.size + meta_len]).key
    except (BadValue, msgspec.DecodeError, msgspec.ValidationError, struct.error):
        return None


class Verifier:
    """Checksum of a payload streamed in pieces; ``finish`` raises BadValue on mismatch."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self._h = new_hasher(header.algo)
        self.seen = 0

    def update(self, piece: bytes | memoryview) -> None:
        self._h.update(piece)
        self.seen += len(piece)

    def finish(self) -> None:
        if self.seen != self.header.nbytes:
            raise BadValue(f"payload has {self.seen} bytes, header says {self.header.nbytes}")
        if not hmac.compare_digest(_digest(self._h), self.header.checksum):
            raise BadValue("payload checksum does not match its header")
