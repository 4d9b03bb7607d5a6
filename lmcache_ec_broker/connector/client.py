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

import logging
import os
import pwd
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import check_private_dir, default_socket_path, private_socket_dir
from ..protocol import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    Abort,
    ArenaGrant,
    ArenaReply,
    Clear,
    Commit,
    Delete,
    DeleteReply,
    EntryInfo,
    ErrorReply,
    Get,
    GetReply,
    Has,
    HasReply,
    Hello,
    HelloReply,
    Hit,
    Lookup,
    LookupReply,
    LookupState,
    Ping,
    Place,
    PlaceReply,
    PongReply,
    ProtocolError,
    Release,
    Reply,
    Reserve,
    ReserveReply,
    ReserveStatus,
    Served,
    Shutdown,
    Stats,
    StatsReply,
    Unlease,
    expected_nbytes,
    frame_length,
)
from ..shm.filter import FilterReader
from ..shm.journal import Journal
from ..shm.residency import KEY_CAP, ResidencyReader
from ..shm.segment import Segment, ShmError
from . import index_path
from .arena_blocks import ArenaBlocks, extents_of

_MAX_REPLY_BYTES = 256 << 20
_HEADER_FROM = FRAME_HEADER.unpack_from
# Posted requests whose replies may be left unread; past this a put reads them first
# (they are usually in already), so the broker's write buffer never backs up.
_MAX_OWED = 256
# Index-served items (keys + has() hits) and age after which the Served frame is sent
# alone rather than ahead of the next request (see BrokerClient._post_served).
_SERVED_MAX = 64
_INDEX_HAS_MAX = (
    32  # measured (p50, loaded VM): 32 hits 117 us from the index vs 200 asked; 64: 189 vs 167
)
_HUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_SERVED_AGE_S = 0.005
BROKER_UID_ENV = "LMCACHE_EC_BROKER_UID"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

if TYPE_CHECKING:
    import torch

    from .copy import SlabView

log = logging.getLogger(__name__)


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached right now (internal; public calls turn it into a miss)."""


class BrokerImpostor(BrokerUnavailable):
    """The process on the socket, or a segment it names, belongs to an untrusted uid."""


class BrokerRefused(RuntimeError):
    """The broker answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BrokerClient:
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

    # ------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def tripped(self) -> bool:
        """True while a hung broker is being probed: calls answer misses at once."""
        return self._tripped

    def _trip(self) -> None:
        """A wait timed out: stop using the broker until the prober hears from it."""
        self._drop_socket()
        if self._tripped:
            return
        self._tripped = True
        self.timeouts += 1
        log.warning(
            "lmcache-ec-broker at %s did not answer within %.3f s; serving misses without "
            "waiting until it answers a probe again (every %.2f s)",
            self.socket_path,
            self.timeout_s,
            self.probe_interval_s,
        )
        self._closing.clear()  # a client used again after close()
        alive = self._prober is not None and self._prober.is_alive()
        if not alive or self._prober_pid != os.getpid():  # one per process, it never exits
            self._prober_pid = os.getpid()
            self._prober = threading.Thread(
                target=self._probe_loop, name="lmcache-ec-probe", daemon=True
            )
            self._prober.start()

    def _probe_loop(self) -> None:
        while not self._closing.wait(self.probe_interval_s):
            if self._tripped and self._probe_once():
                self._next_attempt = 0.0
                self._backoff = 0.0
                self._tripped = False
                log.info("lmcache-ec-broker at %s answers again", self.socket_path)

    def _probe_once(self) -> bool:
        """A throwaway connection and handshake, never under the client's lock."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(self.timeout_s, self.connect_timeout_s))
            sock.connect(self.socket_path)
            self._check_peer(sock)
            body = msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, uuid.uuid4().hex, os.getpid()))
            sock.sendall(FRAME_HEADER.pack(len(body)) + body)
            header = _recv_exact(sock, FRAME_HEADER.size)
            (length,) = FRAME_HEADER.unpack(header)
            if length > 1 << 20:
                return False
            reply = msgspec.msgpack.decode(_recv_exact(sock, length), type=Reply)
            return isinstance(reply, HelloReply)
        except (OSError, BrokerUnavailable, msgspec.MsgspecError):
            return False
        finally:
            sock.close()

    @property
    def epoch(self) -> str | None:
        return self._hello.epoch if self._hello else None

    def _ensure_connected(self, raise_refusal: bool = False) -> bool:
        """Connect if needed. A refusal (permission, too many connections) raises only
        when asked (at construction); later it is an outage like any other."""
        if self._sock is not None:
            return True
        if self._tripped:
            return False
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        try:
            self._connect()
        except (OSError, BrokerUnavailable, BrokerRefused, ShmError) as exc:
            if raise_refusal and isinstance(exc, BrokerRefused):
                raise
            if isinstance(exc, TimeoutError):  # connect or handshake hung
                self._trip()
            # Let go of the old mappings now: unlinked shared memory stays charged to
            # /dev/shm while anyone maps it, and a restarting broker needs that room.
            self._unmap()
            if self._filter is not None:
                self._filter.close()
                self._filter = None
            self._close_journal()
            self._close_index()
            self._back_off()
            if not self._outage_logged:
                log.warning(
                    "lmcache-ec-broker at %s is unavailable (%s); serving misses and "
                    "retrying in the background",
                    self.socket_path,
                    exc,
                )
                self._outage_logged = True
            return False
        if self._outage_logged:
            log.info("reconnected to lmcache-ec-broker at %s", self.socket_path)
        self._outage_logged = False
        if self._attach_error is None:  # else the backoff grows until a mapping works
            self._backoff = 0.0
        return True

    def _back_off(self) -> None:
        self._backoff = min(max(self._backoff * 2, 0.05), self.max_backoff_s)
        self._next_attempt = time.monotonic() + self._backoff

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.socket_path)
            self._check_peer(sock)
            sock.settimeout(self.timeout_s)
            try:
                sock.sendall(self._frame(Hello(PROTOCOL_VERSION, self.client_id, os.getpid())))
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refusing broker writes why and closes at once: its reason is queued
            self._sock = sock
            reply = self._read_replies(1)[0]
        except BaseException:
            self._drop_socket()
            sock.close()
            raise
        if isinstance(reply, ErrorReply):
            self._drop_socket()
            raise BrokerRefused(reply.code, reply.message)
        if not isinstance(reply, HelloReply):
            self._drop_socket()
            raise BrokerUnavailable(f"unexpected handshake reply {type(reply).__name__}")
        if self._hello is not None:
            self.reconnects += 1
            if self._hello.epoch != reply.epoch:
                self._unmap()  # the broker restarted: its old segment is gone
        self._hello = reply
        self._map_filter(reply)
        self._map_journal(reply)
        self._close_index()
        self._index = index_path.map_index(reply, self.trusted_uids)

    def _check_peer(self, sock: socket.socket) -> None:
        """Before sending or mapping anything: is the listener a broker we trust?"""
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if parent == private_socket_dir():
            try:
                check_private_dir(parent, self.trusted_uids)
            except ValueError as exc:
                raise BrokerImpostor(str(exc)) from None
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, _gid = _PEERCRED.unpack(raw)
        if uid not in self.trusted_uids:
            raise BrokerImpostor(
                f"refusing the process on {self.socket_path}: it runs as uid {uid} "
                f"({_user_name(uid)}, pid {pid}), and only uid "
                f"{', '.join(map(str, sorted(self.trusted_uids)))} may serve this client. "
                "Another user may be squatting the socket path; if that uid runs your broker, "
                f"pass broker_uid={uid} or set {BROKER_UID_ENV}={uid}"
            )

    def _map_filter(self, hello: HelloReply) -> None:
        if self._filter is not None:
            self._filter.close()
            self._filter = None
        if hello.filter_name:
            try:
                self._filter = FilterReader(
                    hello.filter_name, hello.filter_size, owners=self.trusted_uids
                )
            except (ShmError, ValueError, OverflowError) as exc:
                log.warning("not using the broker's membership filter: %s", exc)

    def _close_index(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None

    def _usable_index(self) -> ResidencyReader | None:
        """The residency index while it may be trusted (the filter's rule: a connection
        confirmed within filter_trust_s). Call with the lock held."""
        index = self._index
        sock = self._sock
        if (
            index is None
            or sock is None
            or time.monotonic() - self._confirmed_at > self.filter_trust_s
        ):
            return None
        # A killed broker cannot clear its index, and answering from it would also keep
        # its dead slab mapped: a hang-up on the socket (one poll, ~1 us) is an outage.
        if self._peer_gone():
            self._drop_socket()
            return None
        return index

    def _peer_gone(self) -> bool:
        """True once the broker's end of the connection is closed (one poll(0))."""
        sock = self._sock
        if sock is None:
            return True
        if self._hup_sock is not sock:
            self._hup_poll = select.poll()
            self._hup_poll.register(sock.fileno(), _HUP)
            self._hup_sock = sock
        assert self._hup_poll is not None
        return bool(self._hup_poll.poll(0))

    def _own_read(
        self, key: str, copy: Callable[[list[tuple[int, int]], str, list[int]], Any]
    ) -> Any:
        """``copy(extents, dtype, shape)`` from this connection's own blocks if ``key``
        was placed here and the broker has not handled that Place before or during the
        copy; None otherwise (the index or the broker is asked). Why it is exact: until
        the broker settles the seq, the blocks are this connection's arena blocks, freed
        only when the connection closes -- after its socket is closed, which the poll
        after the copy sees; and the journal word is re-read after the copy (x86-TSO,
        as for the index). Call with the lock held, the index usable."""
        own = self._own.get(key)
        journal = self._journal
        if own is None or journal is None or self._arena_slot < 0:
            return None
        seq, extents, dtype, shape, _nbytes = own
        before = journal.settled(self._arena_slot)
        if not _pending(seq, before):
            del self._own[key]  # handled: the index (or the broker) has the last word
            return None
        got = copy(extents, dtype, shape)
        if journal.settled(self._arena_slot) != before or self._peer_gone():
            return None
        return got

    def _post_served(self, keys: list[str], nbytes: list[int], has_hits: int) -> None:
        """Note what the index served (hits, bytes, LRU touches) for the broker. Sent
        as one reply-less Served frame ahead of this client's next request, or alone
        once _SERVED_MAX calls' worth or _SERVED_AGE_S of it is pending (a send per
        call would cost a wake-up of the broker per hit), and by flush() and close()."""
        if not self._served_at:
            self._served_at = time.monotonic()
        self._served_keys += keys
        self._served_nbytes += nbytes
        self._served_has += has_hits
        if (
            len(self._served_keys) + self._served_has >= _SERVED_MAX
            or time.monotonic() - self._served_at >= _SERVED_AGE_S
        ):
            try:
                self._send(b"")
            except BrokerUnavailable:
                pass  # uncounted, like a get whose Release could not be sent

    def _served_frame(self) -> bytes:
        """The pending Served frame (b"" if none), taken: the caller sends it first."""
        if not self._served_at:
            return b""
        keys, nbytes, has_hits = self._served_keys, self._served_nbytes, self._served_has
        self._served_keys, self._served_nbytes, self._served_has = [], [], 0
        self._served_at = 0.0
        # Indexed keys are <= KEY_CAP bytes: this many always fit the broker's frame limit.
        hello = self._hello
        limit = hello.max_frame_bytes if hello is not None and hello.max_frame_bytes else 1 << 20
        per = max(1, (limit - 64) // (KEY_CAP + 24))
        return b"".join(
            self._frame(Served(keys[i : i + per], nbytes[i : i + per], has_hits if not i else 0))
            for i in range(0, max(len(keys), 1), per)
        )

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def _map_journal(self, hello: HelloReply) -> None:
        self._close_journal()
        if hello.put_arena_bytes and hello.journal_name:
            try:
                self._journal = Journal.attach(
                    hello.journal_name, hello.journal_size, self.trusted_uids
                )
            except (ShmError, ValueError, OverflowError) as exc:
                # Without it, arena puts are off and the filter is not trusted (_maybe_mask).
                log.warning("not using the broker's put arena: %s", exc)

    def _drop_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._rpos = self._rend = 0
        self._owed = 0
        self._posted_keys.clear()
        self._served_keys, self._served_nbytes, self._served_has = [], [], 0
        self._served_at = 0.0  # the counts die with the connection, like its pins
        self._own.clear()
        self._placing.clear()
        self._arena.clear()  # the broker frees the arena with the connection
        self._arena_slot = -1
        self._grant_owed = False

    def _unmap(self) -> None:
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _slab_view(self) -> SlabView:
        if self._slab is None:
            from .copy import SlabView

            hello = self._hello
            assert hello is not None
            try:
                self._segment = Segment.attach(
                    hello.segment_name, hello.segment_size, self.prefault, self.trusted_uids
                )
            except ShmError as exc:
                # An outage like any other: the connection (and everything it holds)
                # goes, misses are served, and reconnecting backs off.
                self._drop_socket()
                self._back_off()
                if self._attach_error is None:
                    log.warning(
                        "cannot map the shared memory of lmcache-ec-broker at %s (%s); "
                        "serving misses and retrying in the background",
                        self.socket_path,
                        exc,
                    )
                self._attach_error = str(exc)
                raise BrokerUnavailable(str(exc)) from exc
            self._slab = SlabView(self._segment.mm, hello.segment_size)
            if self._attach_error is not None:
                log.info("mapped the shared memory of lmcache-ec-broker at %s", self.socket_path)
                self._attach_error = None
                self._backoff = 0.0
        return self._slab

    # ------------------------------------------------------------ transport

    def _read_reply(self) -> Any:
        """Decode the next reply frame; usually one recv_into per reply."""
        sock = self._sock
        assert sock is not None
        buf = self._rbuf
        while True:
            avail = self._rend - self._rpos
            need = 4
            if avail >= 4:
                try:  # the one header parser (protocol.frame_length), with the reply cap
                    length = frame_length(buf, _MAX_REPLY_BYTES - 4, self._rpos)
                except ProtocolError as exc:
                    raise BrokerUnavailable(f"implausible reply: {exc}") from None
                need = 4 + length
                if avail >= need:
                    start = self._rpos + 4
                    self._rpos = start + length
                    if self._rpos == self._rend:
                        self._rpos = self._rend = 0
                    with memoryview(buf) as view:
                        return self._decoder.decode(view[start : start + length])
            if self._rpos:  # keep the unread tail at the front
                buf[:avail] = buf[self._rpos : self._rend]
                self._rpos, self._rend = 0, avail
            if need > len(buf):
                buf.extend(bytes(need - len(buf)))
            with memoryview(buf) as view:
                k = sock.recv_into(view[self._rend :])
            if k == 0:
                raise BrokerUnavailable("the broker closed the connection")
            self._rend += k

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise BrokerUnavailable("not connected")
        if self._served_at:
            data = self._served_frame() + data  # in order, before this request
        try:
            sock.sendall(data)
        except OSError as exc:
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _frame(self, msg: msgspec.Struct) -> bytes:
        body = self._encoder.encode(msg)
        hello = self._hello
        limit = hello.max_frame_bytes if hello is not None else 0
        if limit and len(body) > limit:
            # Refused here: sent, it would make the broker drop the whole connection.
            raise BrokerRefused(
                "bad_request",
                f"{type(msg).__name__.lower()} request of {len(body)} bytes exceeds the "
                f"broker's maximum frame of {limit} bytes; split the batch or raise "
                "max_frame_bytes",
            )
        return FRAME_HEADER.pack(len(body)) + body

    def _read_replies(self, n: int) -> list[Any]:
        """Skip the owed replies, then read ``n`` replies."""
        try:
            while self._owed:
                owed = self._read_reply()
                self._owed -= 1
                self._owed_reply(owed)
            self._posted_keys.clear()
            self._grant_owed = False  # its reply, if one was owed, was just read
            out = [self._read_reply() for _ in range(n)]
        except (OSError, msgspec.MsgspecError) as exc:
            # The stream position is unknown, so start over; a timeout also trips.
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except BrokerUnavailable:
            self._drop_socket()
            raise
        self._confirmed_at = time.monotonic()
        return out

    def _owed_reply(self, owed: Any) -> None:
        """The reply of a posted request: arena grants and returned placements are kept
        (they carry blocks), refusals logged, the rest dropped."""
        if isinstance(owed, (ArenaReply, PlaceReply)):
            self._arena_reply(owed)
        elif isinstance(owed, ErrorReply):
            log.debug("deferred request refused: %s: %s", owed.code, owed.message)

    def _roundtrip(self, msg: msgspec.Struct) -> Any:
        sock = self._sock
        if sock is None or self._rend:
            self._send(self._frame(msg))
            return self._read_replies(1)[0]
        # Fast path (nothing buffered): one send, usually one recv holding the owed
        # replies (a get's posted Release, a put's posted Commit) and then this reply.
        # Whatever is not exactly that is left to the general reader, from where this
        # stopped; the owed replies are decoded, checked and dropped as it would.
        buf = self._rbuf
        decode = self._decoder.decode
        pos = 0
        try:
            sock.sendall(self._served_frame() + self._frame(msg))
            n = sock.recv_into(buf)
            while n - pos >= 4:
                (length,) = _HEADER_FROM(buf, pos)
                end = pos + 4 + length
                if end > n:
                    break
                if not self._owed:
                    if end != n:
                        break
                    self._posted_keys.clear()  # as _read_replies does once nothing is owed
                    self._grant_owed = False
                    with memoryview(buf) as view:
                        reply = decode(view[pos + 4 : end])
                    self._confirmed_at = time.monotonic()
                    return reply
                with memoryview(buf) as view:
                    owed = decode(view[pos + 4 : end])
                pos = end
                self._owed -= 1
                self._owed_reply(owed)
        except (OSError, msgspec.MsgspecError) as exc:
            self._drop_socket()
            if isinstance(exc, TimeoutError):
                self._trip()
            raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if n == 0:
            self._drop_socket()
            raise BrokerUnavailable("the broker closed the connection")
        # A partial (or longer) reply: the general reader takes over from ``pos``.
        self._rpos, self._rend = (pos, n) if pos < n else (0, 0)
        return self._read_replies(1)[0]

    def _post(self, msg: msgspec.Struct) -> None:
        """Send without waiting: the reply is read (and dropped) before the next one."""
        self._send(self._frame(msg))
        self._owed += 1

    def _call(self, msg: msgspec.Struct) -> Any:
        """One request; raises BrokerUnavailable or BrokerRefused."""
        if not self._ensure_connected():
            raise BrokerUnavailable("not connected")
        reply = self._roundtrip(msg)
        if isinstance(reply, ErrorReply):
            raise BrokerRefused(reply.code, reply.message)
        return reply

    # ------------------------------------------------------------ public API

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

    # ------------------------------------------------------------ put arena

    def _may_place(self, key: str, nbytes: int) -> bool:
        """Whether ``key`` can go into the arena: the broker grants one, it will accept
        the entry (else the reserve path raises its refusal), and the trusted filter
        says the key is absent (a present key would be copied for nothing)."""
        hello = self._hello
        flt = self._filter
        return (
            hello is not None
            and self._arena_slot >= 0
            and self._journal is not None
            and flt is not None
            and 0 < len(key) <= hello.max_key_length
            and nbytes <= hello.max_entry_bytes
            and key not in self._posted_keys
            and time.monotonic() - self._confirmed_at <= self.filter_trust_s
            and not self._arena_hidden()  # else the filter's "absent" is no proof
            and not flt.maybe(key)
        )

    def _place_copy(
        self, key: str, tensor: torch.Tensor, dtype: str, shape: list[int], nbytes: int
    ) -> tuple[bytes, list[tuple[int, int]]] | None:
        """Copy ``tensor`` into arena blocks and return its Place frame (not sent yet)
        and the blocks; None: not placeable now, take the reserve path. Call with the
        lock held."""
        if self._owed >= _MAX_OWED:
            self._read_replies(0)
        if not self._may_place(key, nbytes):
            return None
        hello = self._hello
        assert hello is not None
        bs = hello.block_size
        need = -(-nbytes // bs)
        if self._arena.blocks < need and self._grant_owed:
            self._read_replies(0)  # the refill's reply, usually in already
            if not self._may_place(key, nbytes):
                return None
        runs = self._arena.take(need)
        if runs is None:
            return None
        try:
            self._slab_view().write(extents_of(runs, nbytes, bs), tensor)
        except BrokerUnavailable:
            raise  # the connection, and with it the arena, is gone
        except BaseException:
            self._arena.give(runs)
            raise
        self._arena_seq = seq = (self._arena_seq + 1) & 0xFFFFFFFF
        self._placing[key] = (seq, extents_of(runs, nbytes, bs), dtype, shape, nbytes)
        return self._frame(Place(key, nbytes, dtype, shape, runs, seq)), runs

    def _send_placed(self, frames: list[bytes], keys: list[str]) -> None:
        """Post the Place frames (and a refill if the arena runs low) in one send. The
        journal says "placed" before the frames leave: from then on other processes
        ask the broker rather than trust their filter (shm/journal.py)."""
        assert self._journal is not None
        self._journal.mark_placed(self._arena_slot, self._arena_seq)
        grant = self._grant_frame()
        self._send(b"".join(frames) + grant)
        self._owed += len(frames) + (1 if grant else 0)
        if grant:
            self._grant_owed = True
        self._posted_keys.update(keys)
        placing, own = self._placing, self._own
        for key in keys:
            own[key] = placing[key]
        placing.clear()
        if len(own) > _MAX_OWED:  # drop what the broker has handled (the index has it)
            settled = self._journal.settled(self._arena_slot)
            for key in [k for k, v in own.items() if not _pending(v[0], settled)]:
                del own[key]

    def _grant_frame(self) -> bytes:
        """An ArenaGrant frame topping the arena up to the broker's cap, or b"" when it
        is at least half full, a grant is owed, or the last grant came back empty."""
        hello = self._hello
        if hello is None or not hello.put_arena_bytes or self._journal is None:
            return b""
        held = self._arena.blocks * hello.block_size
        if self._grant_owed or held * 2 >= hello.put_arena_bytes:
            return b""
        if time.monotonic() < self._grant_after:
            return b""
        return self._frame(ArenaGrant(hello.put_arena_bytes - held))

    def _ask_arena(self) -> None:
        """Post a grant when the arena is low (lazily: the first put of a connection);
        the reserve that follows reads its reply. Call with the lock held."""
        grant = self._grant_frame()
        if grant:
            self._send(grant)
            self._owed += 1
            self._grant_owed = True

    def _arena_reply(self, reply: ArenaReply | PlaceReply) -> None:
        """A grant's new blocks, or the blocks of a placement the broker did not store
        (the key was present), go (back) into the arena."""
        hello = self._hello
        if hello is None:
            return
        if isinstance(reply, ArenaReply):
            self._grant_owed = False
            if reply.slot >= 0:
                self._arena_slot = reply.slot
            if not reply.runs:
                self._grant_after = time.monotonic() + 1.0
        elif reply.stored:
            return
        nblocks = hello.segment_size // hello.block_size
        ok = [(b, n) for b, n in reply.runs if n > 0 and 0 <= b and b + n <= nblocks]
        if ok:
            self._arena.give(ok)

    def _arena_hidden(self) -> bool:
        """True while another connection may have placed an entry the broker has not
        handled yet: a local filter "absent" is then no proof (shm/journal.py)."""
        hello = self._hello
        if hello is None or not hello.put_arena_bytes:
            return False
        journal = self._journal
        return journal is None or journal.any_unsettled(self._arena_slot)

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

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        return self.get_many([key], device)[0]

    def get_many(
        self, keys: list[str], device: str | torch.device = "cpu"
    ) -> list[torch.Tensor | None]:
        """New tensors (same dtype and shape as put) for the hits, None for misses."""
        cp = _copy()
        dev = cp.torch.device(device)
        cp.check_device(dev)
        with self._lock:
            # The index first (a get usually follows a has() hit), then the filter for
            # what it lacks, then the broker for what the filter cannot rule out.
            local = self._get_local(_as_list(keys), dev)
            rest = (
                keys
                if local is None
                else [k for k, t in zip(keys, local, strict=True) if t is None]
            )
            if not rest:
                return [] if local is None else local  # no keys, or every one served here
            ask, mask = self._ask(rest)
            got = self._get_many_asked(ask, dev) if ask else []
            if mask is not None:
                got = _expand(mask, got, None)
            if local is None:
                return got
            it = iter(got)
            return [t if t is not None else next(it) for t in local]

    def _get_local(self, keys: list[str], dev: torch.device) -> list[torch.Tensor | None] | None:
        """The index's copies (None where the broker must be asked), or None when the
        index served nothing. Posts the Served frame. Call with the lock held."""
        index = self._usable_index()
        if index is None:
            return None
        try:
            slab = self._slab_view()
        except BrokerUnavailable:
            return None
        torch_dtype = _copy().torch_dtype
        from_own = None
        if self._own and any(k in self._own for k in keys):

            def from_own(key: str) -> torch.Tensor | None:
                return self._own_read(key, lambda e, d, s: slab.read(e, torch_dtype(d), s, dev))

        local, retries = index_path.read_known(index, slab, keys, dev, torch_dtype, from_own)
        self.index_retries += retries
        served = [k for k, t in zip(keys, local, strict=True) if t is not None]
        if not served:
            return None
        self.index_hits += len(served)
        self._post_served(served, [t.nbytes for t in local if t is not None], 0)
        return local

    def _get_many_asked(self, ask: list[str], dev: torch.device) -> list[torch.Tensor | None]:
        """get_many's round trip for ``ask``. Call with the lock held."""
        cp = _copy()
        torch_dtype = cp.torch_dtype
        try:
            reply: GetReply = self._call(Get(ask))
        except BrokerUnavailable:
            return [None] * len(ask)
        items = reply.items
        hits: list[Hit] = [h for h in items if h is not None]
        out: list[torch.Tensor | None] = []
        try:
            slab = self._slab_view() if hits else None
            for item in items:
                if item is None:
                    out.append(None)
                else:
                    assert slab is not None
                    out.append(slab.read(item.extents, torch_dtype(item.dtype), item.shape, dev))
        except BrokerUnavailable:
            return [None] * len(ask)
        finally:
            self._release(hits)
        return out

    def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the entry into ``out`` (same dtype and shape, contiguous; CPU or CUDA).

        The copy-only path: no allocation, so no first-touch page faults on the
        destination. True on a hit; False on a miss or while the broker is away.
        On False ``out`` is either untouched or zeroed (zeroed when an index copy
        was discarded and the broker then had no entry): it never holds another
        entry's bytes.
        """
        cp = _copy()
        if not out.is_cpu:
            cp.check_device(out.device)
        with self._lock:
            keys = [key]
            wrote = False
            index = self._usable_index()  # first: a get usually follows a has() hit
            if index is not None:
                try:
                    slab = self._slab_view()
                except BrokerUnavailable:
                    return False
                if key in self._own:
                    name = cp.dtype_name(out.dtype)

                    def copy_into(e: list[tuple[int, int]], d: str, s: list[int]) -> bool | None:
                        nonlocal wrote
                        if d != name or s != list(out.shape):
                            return None  # a mismatch is reported by the broker's path
                        wrote = True
                        slab.read_into(e, out)
                        return True

                    if self._own_read(key, copy_into):
                        self.index_hits += 1
                        self._post_served([key], [out.nbytes], 0)
                        return True
                found, wrote_index = index_path.read_known_into(
                    index, slab, key, out, cp.dtype_name
                )
                if found is not None:
                    self.index_hits += 1
                    self._post_served([key], [found.nbytes], 0)
                    return True
                self.index_retries += wrote or wrote_index
                wrote = wrote or wrote_index
            mask = self._maybe_mask(keys)
            if mask is not None and not mask[0]:
                self.local_misses += 1
                hit = False
            else:
                hit = self._get_into_asked(key, out, cp)
            if wrote and not hit:
                out.zero_()  # the discarded copy's bytes must not be shown
            return hit

    def _get_into_asked(self, key: str, out: torch.Tensor, cp: Any) -> bool:
        """get_into's round trip. Call with the lock held."""
        keys = [key]
        try:
            reply: GetReply = self._call(Get(keys))
        except BrokerUnavailable:
            return False
        item = reply.items[0]
        if item is None:
            return False
        try:
            dtype_name = cp.dtype_name
            if item.dtype != dtype_name(out.dtype) or item.shape != list(out.shape):
                raise ValueError(
                    f"entry {key!r} is {item.dtype} {item.shape}, the output tensor is "
                    f"{dtype_name(out.dtype)} {list(out.shape)}; pass a matching tensor "
                    "or use get()"
                )
            self._slab_view().read_into(item.extents, out)
        except BrokerUnavailable:
            return False
        finally:
            self._release([item])
        return True

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

    def _place_many(
        self,
        items: list[tuple[str, torch.Tensor]],
        descs: list[tuple[str, list[int], int]],
        stored: list[bool],
    ) -> tuple[list[bytes], list[str]]:
        """Copy every placeable item into the arena (marking it in ``stored``); the
        Place frames and keys, not sent yet. A failed copy gives every block back."""
        frames: list[bytes] = []
        keys: list[str] = []
        taken: list[tuple[int, int]] = []
        try:
            for i, (key, tensor) in enumerate(items):
                if key in keys:
                    continue  # a second item of the same key reserves (and finds it)
                dtype, shape, nbytes = descs[i]
                got = self._place_copy(key, tensor, dtype, shape, nbytes)
                if got is None:
                    continue
                frames.append(got[0])
                taken += got[1]
                keys.append(key)
                stored[i] = True
        except BrokerUnavailable:
            raise
        except BaseException:
            if self._sock is not None:
                self._arena.give(taken)  # nothing of this batch was sent
            raise
        return frames, keys

    def has(self, keys: list[str], lease_ms: int = 0) -> list[bool]:
        """One bool per key. ``lease_ms > 0`` protects each hit from eviction for that long
        (or until this client disconnects). Keys the broker's membership filter rules
        out are answered here, without a round trip."""
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
                            more: HasReply = self._call(Has(rest, lease_ms))
                        except BrokerUnavailable:
                            more = HasReply([False] * len(rest))
                        it = iter(more.hits)
                        known = [True if kn else next(it) for kn in known]
                    return known if mask is None else _expand(mask, known, False)
            try:
                reply: HasReply = self._call(Has(ask, lease_ms))
            except BrokerUnavailable:
                return [False] * len(keys)
            return reply.hits if mask is None else _expand(mask, reply.hits, False)

    def lookup(self, keys: list[str], lease_ms: int = 0) -> list[EntryInfo]:
        """Per key: MISS, READY (in the slab) or PENDING (being promoted from a lower
        tier: ask again shortly), with dtype and shape for the last two. Leases as
        ``has`` does. An outage answers all MISS."""
        miss = EntryInfo(LookupState.MISS)
        with self._lock:
            mask = self._maybe_mask(keys)
            ask = list(keys) if mask is None else [k for k, m in zip(keys, mask, strict=True) if m]
            self.local_misses += len(keys) - len(ask)
            if not ask:
                return [miss] * len(keys)
            try:
                reply: LookupReply = self._call(Lookup(ask, lease_ms))
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

    def _ask(self, keys: list[str]) -> tuple[list[str], list[bool] | None]:
        """The keys to ask the broker about, and the filter's mask when it ruled some out
        (None when every key is asked, the usual case of a hit). Call with the lock held."""
        mask = self._maybe_mask(keys)
        if mask is None:
            return _as_list(keys), None
        maybe = mask.count(True)  # one C pass; the common answers need no list built
        if maybe == len(mask):
            return _as_list(keys), None
        if not maybe:
            self.local_misses += len(keys)
            return [], mask
        ask = [k for k, m in zip(keys, mask, strict=True) if m]
        self.local_misses += len(keys) - len(ask)
        return ask, mask

    def _maybe_mask(self, keys: list[str]) -> list[bool] | None:
        """Per key, False where the filter proves a miss; None if the filter is not usable.
        Call with the lock held."""
        flt = self._filter
        if (
            flt is None
            or self._sock is None
            or time.monotonic() - self._confirmed_at > self.filter_trust_s
        ):
            return None
        # An "absent" is proof only if no other connection's placement was pending when
        # the filter was read: the journal first, then the filter (read the other way
        # round, a placement handled in between would be missed). The journal check
        # scans only the slots in use (~1 us), less than a second filter pass.
        if self._arena_hidden():
            return None
        mask = flt.maybe_many(keys)
        if self._posted_keys:
            mask = [m or k in self._posted_keys for k, m in zip(keys, mask, strict=True)]
        return mask

    def _release(self, hits: list[Hit]) -> None:
        if hits and self._sock is not None:
            try:
                self._post(Release([h.pin for h in hits]))
            except BrokerUnavailable:
                pass  # the pins died with the connection

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


def trusted_uids(broker_uid: int | str | None = None) -> frozenset[int]:
    """This process's uid, root, and ``broker_uid`` (else $LMCACHE_EC_BROKER_UID), which
    may be a uid or a user name. ValueError names a value that is neither."""
    source = "broker_uid"
    if broker_uid is None or broker_uid == "":
        broker_uid, source = os.environ.get(BROKER_UID_ENV, ""), BROKER_UID_ENV
    uids = {os.getuid(), 0}
    if isinstance(broker_uid, int) and not isinstance(broker_uid, bool):
        if broker_uid < 0:
            raise ValueError(f"{source} must be a uid >= 0 or a user name, got {broker_uid}")
        uids.add(broker_uid)
    elif isinstance(broker_uid, str) and broker_uid.strip():
        text = broker_uid.strip()
        if text.isdigit():
            uids.add(int(text))
        else:
            try:
                uids.add(pwd.getpwnam(text).pw_uid)
            except KeyError:
                raise ValueError(
                    f"{source} = {text!r} is neither a uid nor a known user name; set it to "
                    "the uid the broker runs as (id -u on the broker's side)"
                ) from None
    elif not isinstance(broker_uid, str):
        raise ValueError(f"{source} must be a uid or a user name, got {broker_uid!r}")
    return frozenset(uids)


def _user_name(uid: int) -> str:
    try:
        return "user " + pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user name"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise BrokerUnavailable("the broker closed the connection")
        data += chunk
    return data


def _as_list(keys: list[str]) -> list[str]:
    """The caller's list as is (the request is encoded before the call returns and the
    lock is held meanwhile), any other sequence copied into one."""
    return keys if type(keys) is list else list(keys)


_COPY: Any = None


def _copy() -> Any:
    """The copy module (it imports torch, so it is loaded on first use, not at import);
    kept here because an import statement per call costs a microsecond."""
    global _COPY
    if _COPY is None:
        from . import copy

        _COPY = copy
    return _COPY


def _pending(seq: int, settled: int) -> bool:
    """Whether placement ``seq`` is after the last one the broker settled (u32 wrap)."""
    return 0 < (seq - settled) & 0xFFFFFFFF < 1 << 31


def _expand(mask: list[bool], answers: list[Any], absent: Any) -> list[Any]:
    """Merge the broker's answers for the "maybe" keys back into one list per key."""
    it = iter(answers)
    return [next(it) if m else absent for m in mask]
