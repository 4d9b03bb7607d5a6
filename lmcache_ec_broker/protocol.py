"""The wire contract between the broker and its clients.

Every control message is a msgspec Struct encoded as msgpack and framed with a
4-byte big-endian length prefix. Requests and replies are tagged unions (field
``op``), decoded with typed decoders, so a frame of the wrong shape is a
``msgspec.ValidationError`` — never an arbitrary object (no pickle anywhere).

Tensor bytes never cross the socket: replies carry *extents* (byte offset,
length) inside the shared-memory slab and the client copies directly.
"""

from __future__ import annotations

import math
import struct

import msgspec

PROTOCOL_VERSION = 5  # 3: Lookup.fresh, Publish; 4: journal held/distrusted words; 5: claims
FRAME_HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 1 << 20

# dtype name (torch's short name) -> item size in bytes. The broker validates
# `nbytes == prod(shape) * itemsize` against this table without importing torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    # Sub-byte and raw-bit dtypes: torch stores one element per byte.
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"uint{n}": 1 for n in range(1, 8)},
    **{f"int{n}": 1 for n in range(1, 8)},
}
# Quantized dtypes carry a scale and zero point the cache does not store.
QUANTIZED_DTYPES = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})

Extent = tuple[int, int]  # (byte offset in the slab, length in bytes)


class ErrorCode:
    BAD_REQUEST = "bad_request"
    VERSION_MISMATCH = "version_mismatch"
    NOT_HELLO = "handshake_required"
    TOO_LARGE = "too_large"
    NO_SPACE = "no_space"
    UNKNOWN_TOKEN = "unknown_token"
    KEY_INVALID = "key_invalid"
    DTYPE_INVALID = "dtype_invalid"
    SHAPE_MISMATCH = "shape_mismatch"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    PERMISSION_DENIED = "permission_denied"
    # A connection already holds max_pins_per_connection pins or
    # max_leases_per_connection leases: release some first.
    TOO_MANY_PINS = "too_many_pins"
    TOO_MANY_LEASES = "too_many_leases"
    # A connection's open reservations already hold max_reserved_bytes_per_connection:
    # commit or abort some first.
    TOO_MANY_RESERVATIONS = "too_many_reservations"
    INTERNAL = "internal"


# ---------------------------------------------------------------- requests


class Hello(msgspec.Struct, tag="hello", tag_field="op", forbid_unknown_fields=True):
    version: int
    client_id: str
    pid: int = 0


class Has(msgspec.Struct, tag="has", tag_field="op", forbid_unknown_fields=True):
    keys: list[str]
    # >0: every hit is protected from eviction for this long (or until the
    # connection closes), so a worker can still load what the scheduler saw.
    lease_ms: int = 0
    # >0: answer within about this long; keys the remote store has not answered by
    # then are a MISS (the store's answer then leases and promotes nothing). 0: wait
    # for the store (at most the broker's remote_timeout_s).
    wait_ms: int = 0


class Reserve(msgspec.Struct, tag="reserve", tag_field="op", forbid_unknown_fields=True):
    key: str
    nbytes: int
    dtype: str
    shape: list[int]


class Commit(msgspec.Struct, tag="commit", tag_field="op", forbid_unknown_fields=True):
    token: int


class ArenaGrant(msgspec.Struct, tag="arena_grant", tag_field="op", forbid_unknown_fields=True):
    """Ask for up to ``nbytes`` more slab blocks in this connection's put arena (posted:
    the client reads the ArenaReply with its other owed replies)."""

    nbytes: int


class Place(msgspec.Struct, tag="place", tag_field="op", forbid_unknown_fields=True):
    """Commit an entry the client already copied into blocks of its own arena (posted).

    ``runs``: (first block, number of blocks) in the order the bytes were written;
    ``seq``: the client's placement count, which the broker writes to the connection's
    journal slot once the placement is handled (shm/journal.py)."""

    key: str
    nbytes: int
    dtype: str
    shape: list[int]
    runs: list[tuple[int, int]]
    seq: int


class Abort(msgspec.Struct, tag="abort", tag_field="op", forbid_unknown_fields=True):
    token: int


class Get(msgspec.Struct, tag="get", tag_field="op", forbid_unknown_fields=True):
    keys: list[str]


class Release(msgspec.Struct, tag="release", tag_field="op", forbid_unknown_fields=True):
    pins: list[int]


class Served(msgspec.Struct, tag="served", tag_field="op", forbid_unknown_fields=True):
    """Posted, and the broker sends NO reply: what the client answered from the residency
    index (shm/residency.py) without asking. ``keys``/``nbytes``: entries it copied (the
    broker counts their hits and bytes_loaded and touches them in the LRU, as a Get
    would); ``has_hits``: has() hits it answered."""

    keys: list[str] = []
    nbytes: list[int] = []
    has_hits: int = 0


class Delete(msgspec.Struct, tag="delete", tag_field="op", forbid_unknown_fields=True):
    keys: list[str]


class Clear(msgspec.Struct, tag="clear", tag_field="op", forbid_unknown_fields=True):
    """Empty the local tiers (slab, disk). ``shared``: also remove this broker's key
    prefix from the remote store, which every broker using that prefix shares.
    Honoured for the broker's own uid or root only."""

    shared: bool = False


class Stats(msgspec.Struct, tag="stats", tag_field="op", forbid_unknown_fields=True):
    pass


class Ping(msgspec.Struct, tag="ping", tag_field="op", forbid_unknown_fields=True):
    pass


class Lookup(msgspec.Struct, tag="lookup", tag_field="op", forbid_unknown_fields=True):
    """Like Has, but says per key whether the entry is in the slab now or still being
    promoted from a lower tier, and its dtype and shape (the vLLM connector defers a
    request while any of its entries is PENDING and checks shapes before trusting a hit)."""

    keys: list[str]
    lease_ms: int = 0
    wait_ms: int = 0  # as Has.wait_ms
    # True: a key the remote tier's membership filter does not know is asked of the
    # store anyway (its announcement may not have arrived yet: an encoder instance on
    # another node published it just now). For disaggregated instances only (docs/epd.md).
    fresh: bool = False
    # >0: claim every key this answer would call MISS for this long (at most 120 s):
    # "I am encoding it". A key claimed by another connection -- or by another broker
    # through the remote store, or reserved by another writer -- is answered CLAIMED
    # instead (wait for it: WaitReady). A claim ends when the key lands in the slab,
    # a put of it aborts, Unclaim, the connection closes, or claim_ms passes
    # (broker/claims.py). MISS with claim_ms: encode it (claimed, or over the bounds).
    claim_ms: int = 0


class WaitReady(msgspec.Struct, tag="wait_ready", tag_field="op", forbid_unknown_fields=True):
    """Answer (a LookupReply) once no key is CLAIMED by another encoder any more -- each
    claim ended: landed (READY/PENDING) or gave up (MISS) -- or at ``wait_ms`` with
    the keys still claimed answered CLAIMED (the caller then encodes them itself). The
    answer is a Lookup's with the same ``lease_ms``/``claim_ms``/``fresh``: with
    ``claim_ms`` a key whose encoder gave up is claimed for the caller (one waiter
    takes over; the others keep waiting). Holds this connection while it waits."""

    keys: list[str]
    wait_ms: int
    lease_ms: int = 0
    claim_ms: int = 0
    fresh: bool = False


class Unclaim(msgspec.Struct, tag="unclaim", tag_field="op", forbid_unknown_fields=True):
    """End this connection's claims on ``keys`` (it will not put them: its encode
    failed or its request ended); their waiters wake and encode them themselves."""

    keys: list[str]


class Publish(msgspec.Struct, tag="publish", tag_field="op", forbid_unknown_fields=True):
    """Answer once every key is visible to the whole fleet -- in the remote store (its
    write-behind ended STORED, or the store already held it), or, on a broker without a
    remote tier, READY in the slab -- or by ``wait_ms`` at the latest. An entry in the
    slab the store lacks (its write-behind was dropped) is written now. An encoder
    instance (``ec_producer``) asks this after its step's puts so that its answer never
    reaches the proxy before the entries reach the fleet (docs/epd.md, "Guarantees")."""

    keys: list[str]
    wait_ms: int = 0


class Unlease(msgspec.Struct, tag="unlease", tag_field="op", forbid_unknown_fields=True):
    """End this connection's leases on ``keys`` (the load they protected is done)."""

    keys: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", tag_field="op", forbid_unknown_fields=True):
    """Stop the broker (honoured for the broker's own uid or root only)."""


Request = (
    Hello
    | Has
    | Reserve
    | Commit
    | Abort
    | ArenaGrant
    | Place
    | Get
    | Release
    | Served
    | Delete
    | Clear
    | Stats
    | Ping
    | Lookup
    | Unlease
    | Shutdown
    | Publish
    | WaitReady
    | Unclaim
)


# ---------------------------------------------------------------- replies


class HelloReply(msgspec.Struct, tag="hello_reply", tag_field="op"):
    version: int
    segment_name: str
    segment_size: int
    block_size: int
    epoch: str
    broker_pid: int
    max_frame_bytes: int
    # The membership filter segment (shm/filter.py); "" when the broker publishes none.
    filter_name: str = ""
    filter_size: int = 0
    # The put arena (shm/journal.py): 0 / "" when the broker grants none. The limits
    # let a client place only entries the broker will accept (else it reserves, and the
    # refusal is raised as usual); 0: unknown.
    put_arena_bytes: int = 0
    journal_name: str = ""
    journal_size: int = 0
    max_key_length: int = 0
    max_entry_bytes: int = 0
    # The residency index (shm/residency.py); "" when the broker publishes none.
    residency_name: str = ""
    residency_size: int = 0
    # What the file descriptors that came with this reply (SCM_RIGHTS) are, in order:
    # "slab", "filter", "journal", "settled", "index" (docs/design.md "Shared memory").
    segment_fds: list[str] = []


class HasReply(msgspec.Struct, tag="has_reply", tag_field="op"):
    hits: list[bool]


class LookupState:
    MISS = 0  # on no tier
    READY = 1  # in the slab: a get now is a hit
    PENDING = 2  # on a lower tier, being promoted into the slab: ask again shortly
    CLAIMED = 3  # on no tier yet; another encoder claimed it: WaitReady for it (claim_ms)


class EntryInfo(msgspec.Struct, array_like=True):
    state: int  # LookupState
    dtype: str = ""
    shape: list[int] = []


class LookupReply(msgspec.Struct, tag="lookup_reply", tag_field="op"):
    items: list[EntryInfo]


class PublishState:
    PUBLISHED = 0  # visible fleet-wide (the store holds it; no remote tier: READY here)
    ABSENT = 1  # not in this broker's slab nor in the store: nothing to publish
    FAILED = 2  # its write to the store failed, was dropped or refused (counted, logged)
    TIMEOUT = 3  # its write was still in flight at wait_ms


class PublishReply(msgspec.Struct, tag="publish_reply", tag_field="op"):
    states: list[int]  # PublishState, one per key


class ReserveStatus:
    RESERVED = "reserved"  # write the extents, then Commit(token) or Abort(token)
    PRESENT = "present"  # a ready entry already exists: nothing to write
    IN_PROGRESS = "in_progress"  # another writer holds the reservation


class ReserveReply(msgspec.Struct, tag="reserve_reply", tag_field="op"):
    status: str
    token: int = 0
    extents: list[Extent] = []


class ArenaReply(msgspec.Struct, tag="arena_reply", tag_field="op"):
    """Blocks newly granted to the connection's arena (possibly none) and its journal slot."""

    slot: int
    runs: list[tuple[int, int]] = []


class PlaceReply(msgspec.Struct, tag="place_reply", tag_field="op"):
    """``stored`` False: the key was already present or being written by another
    client; the entry is kept and ``runs`` went back to the connection's arena."""

    stored: bool
    runs: list[tuple[int, int]] = []


class Hit(msgspec.Struct):
    pin: int
    nbytes: int
    dtype: str
    shape: list[int]
    extents: list[Extent]


class GetReply(msgspec.Struct, tag="get_reply", tag_field="op"):
    items: list[Hit | None]


class DeleteReply(msgspec.Struct, tag="delete_reply", tag_field="op"):
    deleted: list[bool]


class StatsReply(msgspec.Struct, tag="stats_reply", tag_field="op"):
    stats: dict[str, int | float | str]


class OkReply(msgspec.Struct, tag="ok", tag_field="op"):
    pass


class PongReply(msgspec.Struct, tag="pong", tag_field="op"):
    epoch: str


class ErrorReply(msgspec.Struct, tag="error", tag_field="op"):
    code: str
    message: str


Reply = (
    HelloReply
    | HasReply
    | LookupReply
    | PublishReply
    | ReserveReply
    | ArenaReply
    | PlaceReply
    | GetReply
    | DeleteReply
    | StatsReply
    | OkReply
    | PongReply
    | ErrorReply
)


class ProtocolError(Exception):
    """A frame that cannot be accepted (too large, truncated, undecodable)."""


def encode_frame(encoder: msgspec.msgpack.Encoder, msg: msgspec.Struct) -> bytes:
    body = encoder.encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


def frame_length(header: bytes | bytearray | memoryview, max_frame: int, offset: int = 0) -> int:
    """Body length from the 4-byte header at ``offset``; ProtocolError if over ``max_frame``."""
    (length,) = FRAME_HEADER.unpack_from(header, offset)
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the maximum of {max_frame} bytes")
    return length


class FrameReader:
    """Splits a byte stream into frame bodies (the one parser both sides use).

    An oversized length raises ProtocolError as soon as its header arrives, before
    any of its body is buffered; the stream cannot be resynchronised after that.
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def __len__(self) -> int:
        return len(self._buf)

    def next_frame(self) -> bytes | None:
        """The next complete body, or None until more bytes arrive."""
        buf = self._buf
        if len(buf) < FRAME_HEADER.size:
            return None
        length = frame_length(buf, self.max_frame)
        end = FRAME_HEADER.size + length
        if len(buf) < end:
            return None
        body = bytes(buf[FRAME_HEADER.size : end])
        del buf[:end]
        return body


def expected_nbytes(dtype: str, shape: list[int]) -> int:
    """nbytes implied by dtype and shape; ValueError names what is wrong."""
    itemsize = DTYPE_ITEMSIZE.get(dtype)
    if dtype in QUANTIZED_DTYPES:
        raise ValueError(
            f"quantized dtype {dtype} is not supported: its scale and zero point would be "
            "lost; dequantize first or store the int representation (tensor.int_repr())"
        )
    if itemsize is None:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_ITEMSIZE))}")
    if len(shape) > 16:
        raise ValueError(f"shape has {len(shape)} dimensions; at most 16 are accepted")
    if shape and min(shape) < 0:  # min(): no generator frame per call (a put's hot path)
        raise ValueError(f"shape {shape} has a negative dimension")
    return math.prod(shape) * itemsize
