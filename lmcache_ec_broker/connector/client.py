"""BrokerClient: synchronous, thread-safe client of one broker.

Failure model (what a serving engine can rely on):
- A broker outage never raises: ``has`` answers all-False, ``get`` None, ``put``
  False, quickly. A broker that is gone (connection refused or reset) is retried
  with a growing reconnect backoff during which calls return at once. A broker
  that hangs (alive, not answering) costs one ``timeout_s`` wait per outage, not
  one per call: the first timeout opens a circuit, every later call answers a
  miss at once without touching the socket, and a background thread probes the
  broker every ``probe_interval_s`` (a throwaway connection and handshake) and
  closes the circuit when it answers. A warning is logged once per outage.
- A refusal by the broker (entry too large, no space, bad dtype/key, ...) raises
  ``BrokerRefused`` carrying the broker's code and message, so the caller can
  tell "not stored because of X" from "not stored because someone else did".
- The broker must prove who it is before anything is sent or mapped: the peer's
  uid (SO_PEERCRED) must be this process's, root's or the configured
  ``broker_uid``, and so must the owner of every segment it names (fstat before
  mmap). Anyone else squatting the socket path is treated as an outage, with a
  warning naming their uid: they could read every tensor and feed back their own.
- After a reconnect the handshake's *epoch* says whether the broker restarted;
  if so the old mapping is dropped before the new segment is mapped, so no copy
  ever touches a stale segment. Every data operation runs under the client's
  lock from request to copy to commit/release, so a concurrent reconnect cannot
  unmap memory under a copy.
- Waits per call (issue 18): a ``put`` into the connection's put arena waits for
  nothing (copy, post a Place; docs/design.md "Put arenas"). The first put of a
  connection, and one the arena cannot take, reserves and waits for the Reserve
  reply only: the Commit is posted (sent after the copy; its reply is read and
  dropped before the next reply). A put that returned is still seen by every
  request made after it, from any process: its frame is already in the broker's
  socket; a reserved key is in the membership filter and a placed one is marked
  in the placement journal (so other clients ask), and the broker handles the
  pending frames of a reserving or placing connection before answering for a
  key it lacks. ``flush()`` waits for the posted replies. A ``has`` hit and a
  ``get`` of an entry in the broker's residency index (shm/residency.py) wait for
  nothing: answered, or copied and confirmed by the slot's seqlock word, locally
  (connector/index_path.py), and told to the broker in a batched reply-less Served
  frame; so does a get of this connection's own placement the broker has not
  handled yet. Otherwise ``get`` waits for its Get reply and posts the Release,
  and ``has`` is one short request.
"""

from __future__ import annotations

import select
import socket
import threading
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import default_socket_path
from ..protocol import (
    Abort,
    Clear,
    Commit,
    Delete,
    DeleteReply,
    EntryInfo,
    ErrorReply,
    Has,
    HasReply,
    HelloReply,
    Lookup,
    LookupReply,
    LookupState,
    Ping,
    PongReply,
    Reply,
    Reserve,
    ReserveReply,
    ReserveStatus,
    Shutdown,
    Stats,
    StatsReply,
    Unlease,
    expected_nbytes,
)
from ..shm.filter import FilterReader
from ..shm.journal import Journal
from ..shm.residency import ResidencyReader
from ..shm.segment import Segment
from . import index_path
from .arena_blocks import ArenaBlocks

# The mixins BrokerClient is made of, one concern per module; the "x as x" imports keep
# every name this module had before the split importable from here.
from .arena_put import ArenaPut
from .arena_put import _pending as _pending
from .broker_link import BrokerLink
from .errors import BrokerImpostor as BrokerImpostor
from .errors import BrokerRefused, BrokerUnavailable
from .frames import _HEADER_FROM as _HEADER_FROM
from .frames import _MAX_OWED as _MAX_OWED
from .frames import _MAX_REPLY_BYTES as _MAX_REPLY_BYTES
from .frames import FramedTransport
from .frames import _recv_exact as _recv_exact
from .index_path import _HUP as _HUP
from .index_path import _SERVED_AGE_S as _SERVED_AGE_S
from .index_path import _SERVED_MAX as _SERVED_MAX
from .index_path import IndexServing
from .membership import Membership, _expand
from .membership import _as_list as _as_list
from .reads import Reads
from .reads import _copy as _copy
from .trust import BROKER_UID_ENV as BROKER_UID_ENV
from .trust import _user_name as _user_name
from .trust import trusted_uids

# Where the pieces live: broker_link.py (connect, trust, segments, circuit), frames.py
# (framed transport, owed replies), arena_put.py (the put arena), index_path.py (the
# zero-wait index path, Served reports), membership.py (filter misses), reads.py (gets).
_INDEX_HAS_MAX = (
    32  # measured (p50, loaded VM): 32 hits 117 us from the index vs 200 asked; 64: 189 vs 167
)

if TYPE_CHECKING:
    import torch

    from .copy import SlabView


class BrokerClient(Reads, ArenaPut, IndexServing, Membership, FramedTransport, BrokerLink):
    def __init__(
        self,
        socket_path: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        max_backoff_s: float = 2.0,
        prefault: bool = True,
        filter_trust_s: float = 1.0,
        broker_uid: int | str | None = None,
        probe_interval_s: float = 0.5,
    ) -> None:
        """``timeout_s``: the longest one wait for the broker may take (each reply of a
        call; a hung broker costs it once per outage, see the module docstring).
        ``probe_interval_s``: how often a hung broker is probed in the background.
        ``broker_uid`` (else $LMCACHE_EC_BROKER_UID): a uid or user name, besides this
        process's own and root's, that the broker may run as."""
        if timeout_s <= 0 or probe_interval_s <= 0:
            raise ValueError(
                f"timeout_s and probe_interval_s must be > 0 (got {timeout_s}, {probe_interval_s})"
            )
        self.socket_path = socket_path or default_socket_path()
        self.trusted_uids = trusted_uids(broker_uid)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.prefault = prefault
        self.client_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._hello: HelloReply | None = None
        self._segment: Segment | None = None
        self._slab: SlabView | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        # Receive buffer: frames are parsed in place; [_rpos, _rend) is unread data.
        self._rbuf = bytearray(1 << 16)
        self._rpos = 0
        self._rend = 0
        # Replies still owed by the broker for requests whose reply we do not wait
        # for (Release); they are read and discarded before the next reply.
        self._owed = 0
        # Keys of posted commits whose replies are still owed: the filter may not list
        # them yet, so they are never ruled out locally (read-your-writes).
        self._posted_keys: set[str] = set()
        # The put arena (docs/design.md "Put arenas"): slab blocks granted to this
        # connection ahead of time, as sorted (first block, count) runs. Invariant: a
        # block is in _arena only while the broker has it in this connection's arena
        # and no posted Place names it; everything resets with the connection.
        self._journal: Journal | None = None
        self._arena = ArenaBlocks()
        self._arena_slot = -1  # this connection's journal slot, known from the first grant
        self._arena_seq = 0  # placements made (journal "placed"; wraps at 2**32)
        # Entries this connection placed whose Place the broker may not have handled
        # yet: key -> (seq, extents, dtype, shape, nbytes). Until the broker settles
        # that seq the blocks are still this connection's arena blocks, which nobody
        # else can write, so a get of such a key may copy from them (index_path.py).
        self._own: dict[str, tuple[int, list[tuple[int, int]], str, list[int], int]] = {}
        self._placing: dict[str, tuple[int, list[tuple[int, int]], str, list[int], int]] = {}
        self._grant_owed = False  # an ArenaGrant is posted and its reply not read yet
        self._grant_after = 0.0  # after an empty grant: ask again no sooner than this
        # The broker's membership filter: a local "absent" skips the round trip. It is
        # trusted only while the connection was confirmed within filter_trust_s, so a
        # killed broker's stale filter cannot hide a restarted broker's entries for long.
        self.filter_trust_s = filter_trust_s
        self._filter: FilterReader | None = None
        self._confirmed_at = 0.0
        self.local_misses = 0
        # The broker's residency index (connector/index_path.py): positives answered
        # and copied here, trusted under the same rule as the filter.
        self._index: ResidencyReader | None = None
        self.index_hits = 0  # has() hits and gets served from the index
        self.index_retries = 0  # index copies discarded (slot rewritten) and asked again
        # What the index served, not yet told to the broker (_post_served).
        self._served_keys: list[str] = []
        self._served_nbytes: list[int] = []
        self._served_has = 0
        self._served_at = 0.0  # when the oldest pending item was noted; 0: none
        self._hup_poll: select.poll | None = None  # watches _hup_sock for the peer's end
        self._hup_sock: object = None
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._outage_logged = False
        self._attach_error: str | None = None  # set while the segment cannot be mapped
        self.reconnects = 0
        # Circuit: set by a timeout, cleared by the prober thread when the broker answers
        # again. While set, no call touches the socket (invariant: _tripped => _sock is None).
        self.probe_interval_s = probe_interval_s
        self._tripped = False
        self._prober: threading.Thread | None = None
        self._prober_pid = -1
        self._closing = threading.Event()
        self.timeouts = 0  # outages that cost a timeout (one per outage)
        with self._lock:
            self._ensure_connected(raise_refusal=True)

    # ------------------------------------------------------------ puts

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` under ``key``. True if this call stored it; False if the entry
        is already present, another writer is storing it, or the broker is unavailable.

        With a put arena (the common case once the connection holds one) nothing is
        waited for: the tensor is copied into this connection's own blocks and the
        Place is posted. Such a put returns True also in the rare race where another
        client stores the same key first (the broker keeps that entry, which by the
        cache's contract holds the same value, and the blocks return to the arena)."""
        from .copy import check_device, dtype_name

        check_device(tensor.device)
        dtype = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        nbytes = expected_nbytes(dtype, shape)
        with self._lock:
            try:
                if not self._ensure_connected():
                    return False
                placed = self._place_copy(key, tensor, dtype, shape, nbytes)
                if placed is not None:
                    self._send_placed([placed[0]], [key])
                    return True
                self._ask_arena()
                reply: ReserveReply = self._call(Reserve(key, nbytes, dtype, shape))
                if reply.status != ReserveStatus.RESERVED:
                    return False
                try:
                    self._slab_view().write(reply.extents, tensor)
                except BaseException:
                    if self._sock is not None:
                        try:
                            self._call(Abort(reply.token))
                        except (BrokerUnavailable, BrokerRefused):
                            pass
                    raise
                # Posted: the broker handles this connection's frames in order, so the
                # commit lands before anything this client asks next. It cannot be
                # refused (the token is this live connection's own open reservation,
                # which only the connection's end takes away); if the connection dies
                # first, the reservation is freed and the entry is simply absent.
                self._post(Commit(reply.token))
                self._posted_keys.add(key)
                return True
            except BrokerUnavailable:
                return False

    def put_many(self, items: list[tuple[str, torch.Tensor]]) -> list[bool]:
        """Batched put: entries that fit the arena are copied and their Places posted;
        the others are reserved in one round trip (sent with those Places) and their
        commits posted in one send. No wait at all when every entry fits the arena.

        One bool per item, as ``put``. If the broker refuses some items, the others
        are still stored, then the first refusal is raised as ``BrokerRefused``.
        """
        from .copy import check_device, dtype_name

        descs = []
        for _key, tensor in items:
            check_device(tensor.device)
            dtype = dtype_name(tensor.dtype)
            shape = list(tensor.shape)
            descs.append((dtype, shape, expected_nbytes(dtype, shape)))
        if not items:
            return []
        with self._lock:
            if not self._ensure_connected():
                return [False] * len(items)
            stored = [False] * len(items)
            try:
                placed = self._place_many(items, descs, stored)
            except BrokerUnavailable:
                return [False] * len(items)
            rest = [i for i in range(len(items)) if not stored[i]]
            if not rest:
                try:
                    self._send_placed(*placed)
                except BrokerUnavailable:
                    return [False] * len(items)
                return stored
            reqs = [Reserve(items[i][0], descs[i][2], *descs[i][:2]) for i in rest]
            try:
                if placed[0]:
                    self._send_placed(*placed)
                else:
                    self._ask_arena()
                self._send(b"".join(self._frame(r) for r in reqs))
                replies = self._read_replies(len(reqs))
            except BrokerUnavailable:
                return [False] * len(items)
            refusal = next((r for r in replies if isinstance(r, ErrorReply)), None)
            todo = [
                (rest[j], r.token, r.extents)
                for j, r in enumerate(replies)
                if isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED
            ]
            done: list[int] = []
            try:
                slab = self._slab_view() if todo else None
                for i, token, extents in todo:
                    assert slab is not None
                    slab.write(extents, items[i][1])
                    done.append(token)
            except BrokerUnavailable:
                # The segment cannot be mapped (the connection, and with it every
                # reservation, is already dropped): an outage, not an error.
                return [False] * len(items)
            except BaseException:
                for _, token, _ in todo:
                    if self._sock is not None:
                        try:
                            self._post(Abort(token))
                        except BrokerUnavailable:
                            pass
                raise
            if done:
                # Posted, as in put: one send, no wait (see put for why they cannot fail).
                try:
                    self._send(b"".join(self._frame(Commit(t)) for t in done))
                except BrokerUnavailable:
                    return [False] * len(items)
                self._owed += len(done)
                self._posted_keys.update(items[i][0] for i, _, _ in todo)
                for i, _, _ in todo:
                    stored[i] = True
            if refusal is not None:
                raise BrokerRefused(refusal.code, refusal.message)
            return stored

    def flush(self) -> bool:
        """Wait until the broker has handled every request this client posted (the
        commits of its puts, its releases): afterwards every other process sees this
        client's puts. Costs nothing when nothing is owed, else the wait for replies
        already on their way (no new request); what the residency index served and the
        broker was not told yet is sent and confirmed with a ping (its frame has no
        reply). False while the broker is unavailable."""
        with self._lock:
            if self._served_at and self._sock is not None:
                try:
                    self._call(Ping())  # the pending Served frame goes first
                except BrokerUnavailable:
                    return False
            if not self._owed:
                return self._sock is not None
            try:
                self._read_replies(0)
                return True
            except BrokerUnavailable:
                return False

    # ------------------------------------------------------------ lookups and the rest

    def has(self, keys: list[str], lease_ms: int = 0, wait_ms: int = 0) -> list[bool]:
        """One bool per key. ``lease_ms > 0`` protects each hit from eviction for that long
        (or until this client disconnects). Keys the broker's membership filter rules
        out are answered here, without a round trip. ``wait_ms > 0``: the broker answers
        within about that long, a key its remote store has not answered by then False."""
        with self._lock:
            ask, mask = self._ask(keys)
            if not ask:
                return [False] * len(keys)
            # A lease needs the broker; past _INDEX_HAS_MAX keys one round trip costs less
            # than reading the index key by key (~1-3 us each from Python).
            index = self._usable_index() if lease_ms <= 0 and len(ask) <= _INDEX_HAS_MAX else None
            if index is not None:
                known = index_path.has_known(index, ask)
                n = known.count(True)
                if n:
                    self.index_hits += n
                    self._post_served([], [], n)
                    if n < len(ask):
                        rest = [k for k, kn in zip(ask, known, strict=True) if not kn]
                        try:
                            more: HasReply = self._call(Has(rest, lease_ms, wait_ms))
                        except BrokerUnavailable:
                            more = HasReply([False] * len(rest))
                        it = iter(more.hits)
                        known = [True if kn else next(it) for kn in known]
                    return known if mask is None else _expand(mask, known, False)
            try:
                reply: HasReply = self._call(Has(ask, lease_ms, wait_ms))
            except BrokerUnavailable:
                return [False] * len(keys)
            return reply.hits if mask is None else _expand(mask, reply.hits, False)

    def lookup(self, keys: list[str], lease_ms: int = 0, wait_ms: int = 0) -> list[EntryInfo]:
        """Per key: MISS, READY (in the slab) or PENDING (being promoted from a lower
        tier: ask again shortly), with dtype and shape for the last two. Leases and
        bounds the wait (``wait_ms``) as ``has`` does. An outage answers all MISS."""
        miss = EntryInfo(LookupState.MISS)
        with self._lock:
            mask = self._maybe_mask(keys)
            ask = list(keys) if mask is None else [k for k, m in zip(keys, mask, strict=True) if m]
            self.local_misses += len(keys) - len(ask)
            if not ask:
                return [miss] * len(keys)
            try:
                reply: LookupReply = self._call(Lookup(ask, lease_ms, wait_ms))
            except BrokerUnavailable:
                return [miss] * len(keys)
            if mask is None or len(ask) == len(keys):
                return reply.items
            return _expand(mask, reply.items, miss)

    def unlease(self, keys: list[str]) -> None:
        """End this client's leases on ``keys`` (sent without waiting for the reply)."""
        if not keys:
            return
        with self._lock:
            if self._sock is None:
                return  # leases died with the connection
            try:
                self._post(Unlease(list(keys)))
            except BrokerUnavailable:
                pass

    def shutdown(self) -> bool:
        """Ask the broker to stop (its owner or root only). True if it accepted;
        raises BrokerRefused if it refused."""
        with self._lock:
            try:
                self._call(Shutdown())
                return True
            except BrokerUnavailable:
                return False

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            try:
                reply: DeleteReply = self._call(Delete(list(keys)))
                return reply.deleted
            except BrokerUnavailable:
                return [False] * len(keys)

    def clear(self, shared: bool = False) -> bool:
        """Empty the broker's local tiers (slab, disk); ``shared`` also removes its key
        prefix from the remote store, for every broker using it. Owner or root only
        (BrokerRefused otherwise); False while the broker is unavailable."""
        with self._lock:
            try:
                self._call(Clear(shared=shared))
                return True
            except BrokerUnavailable:
                return False

    def stats(self) -> dict[str, Any]:
        """The broker's counters; {} while it is unavailable."""
        with self._lock:
            try:
                reply: StatsReply = self._call(Stats())
                return dict(reply.stats)
            except BrokerUnavailable:
                return {}

    def ping(self) -> bool:
        with self._lock:
            try:
                reply: PongReply = self._call(Ping())
                return reply.epoch == self.epoch
            except BrokerUnavailable:
                return False

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            if (self._posted_keys or self._served_at) and self._sock is not None:
                self.flush()  # this client's last puts (and hits) are in before it goes
            self._drop_socket()
            self._unmap()
            if self._filter is not None:
                self._filter.close()
                self._filter = None
            self._close_journal()
            self._hello = None

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unmapping here (not left to the GC) keeps the order: CUDA unregistration first.
        try:
            self._drop_socket()
            self._unmap()
        except Exception:
            pass
