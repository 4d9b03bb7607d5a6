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
  (connector/client/index_path.py), and told to the broker in a batched reply-less Served
  frame, ahead of the next request or, within 50 ms, alone (served_flush.py); so
  does a get of this connection's own placement the broker has not handled yet.
  Otherwise ``get`` waits for its Get reply and posts the Release, and ``has`` is
  one short request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ...private_dirs import default_socket_path
from ...protocol import (
    Clear,
    Delete,
    DeleteReply,
    EntryInfo,
    Has,
    HasReply,
    HelloReply,
    Lookup,
    LookupReply,
    LookupState,
    Ping,
    PongReply,
    Publish,
    PublishReply,
    Shutdown,
    Stats,
    StatsReply,
    Unclaim,
    Unlease,
    WaitReady,
)
from ...shm.residency import ResidencyReader
from . import index_path, reads, writes
from .client_link import ClientLink
from .errors import BrokerImpostor as BrokerImpostor
from .errors import BrokerRefused as BrokerRefused
from .errors import BrokerUnavailable
from .mappings import Mappings
from .membership import _as_list, _expand, split, with_posted
from .reads import copy_module
from .session import Session
from .trust import BROKER_UID_ENV as BROKER_UID_ENV
from .trust import trusted_uids

# The parts (docs/design.md "The client"): client_link.py (the connection kept across
# outages: lock, session, mappings, handshake, Redial/Circuit from broker_link.py,
# the Served flusher), session.py (one connection: frames.py's Wire, arena_put.py's
# PutArena, index_path.py's ServedBatch, posted keys), mappings.py (one broker
# epoch's segments), membership.py, reads.py and writes.py (the put path; functions
# over those parts).
# BrokerClient does the cache's work over its ClientLink.
_INDEX_HAS_MAX = (
    32  # measured (p50, loaded VM): 32 hits 117 us from the index vs 200 asked; 64: 189 vs 167
)

if TYPE_CHECKING:
    import torch

    from .copy import SlabView


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
        self.socket_path = path = socket_path or default_socket_path()
        self.trusted_uids = trusted = trusted_uids(broker_uid)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self.prefault = prefault
        self.probe_interval_s = probe_interval_s
        # The membership filter and the residency index are trusted only while the
        # connection was confirmed within filter_trust_s, so a killed broker's stale
        # filter cannot hide a restarted broker's entries for long.
        self.filter_trust_s = filter_trust_s
        self._link = ClientLink(
            path, trusted, timeout_s, connect_timeout_s, max_backoff_s, prefault, probe_interval_s
        )
        self.client_id = self._link.client_id
        self.local_misses = 0  # keys the filter answered absent here
        self.index_hits = 0  # has() hits and gets served from the index
        self.index_retries = 0  # index copies discarded (slot rewritten) and asked again
        with self._link.lock:
            self._link.live(raise_refusal=True)

    # ------------------------------------------------------------ the parts, composed

    def _maybe_mask(self, s: Session, keys: list[str]) -> list[bool] | None:
        """Per key, False where the filter proves a miss; None if it is not usable."""
        m = self._link.maps
        flt = m.filter if m is not None else None
        if flt is None or time.monotonic() - s.wire.confirmed_at > self.filter_trust_s:
            return None
        # An "absent" is proof only if no other connection's placement was pending when
        # the filter was read: the journal first, then the filter (read the other way
        # round, a placement handled in between would be missed).
        if m.others_pending(s.arena.slot):  # type: ignore[union-attr]
            return None
        return with_posted(keys, flt.maybe_many(keys), s.posted)

    def _ask(self, keys: list[str]) -> tuple[list[str], list[bool] | None]:
        """The keys to ask the broker about and the filter's mask (None: ask all)."""
        s = self._link.session
        mask = self._maybe_mask(s, keys) if s is not None else None
        ask, mask = split(keys, mask)
        if mask is not None:
            self.local_misses += len(keys) - len(ask)
        return ask, mask

    def _usable_index(self, s: Session | None) -> ResidencyReader | None:
        """The residency index while it may be trusted (the filter's rule)."""
        m = self._link.maps
        if s is None or m is None or m.index is None:
            return None
        if time.monotonic() - s.wire.confirmed_at > self.filter_trust_s:
            return None
        # A killed broker cannot clear its index, and answering from it would also keep
        # its dead slab mapped: a hang-up on the socket (one poll, ~1 us) is an outage.
        if s.wire.peer_gone():
            self._link.drop_session()
            return None
        return m.index

    def _post_served(self, s: Session, keys: list[str], nbytes: list[int], hits: int) -> None:
        """Note what the index served; sent ahead of the next request, alone when
        enough is pending (ServedBatch.note), else by the flusher once it is due."""
        if s.served.note(keys, nbytes, hits):
            try:
                s.wire.send(b"")
            except BrokerUnavailable:
                pass  # uncounted, like a get whose Release could not be sent

    # ------------------------------------------------------------ puts (writes.py)

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` under ``key``. True if this call stored it; False if the entry
        is already present, another writer is storing it, or the broker is unavailable.

        With a put arena (the common case once the connection holds one) nothing is
        waited for: the tensor is copied into this connection's own blocks and the
        Place is posted. Such a put returns True also in the rare race where another
        client stores the same key first (the broker keeps that entry, which by the
        cache's contract holds the same value, and the blocks return to the arena)."""
        return writes.put(self._link, self.filter_trust_s, key, tensor)

    def put_many(self, items: list[tuple[str, torch.Tensor]]) -> list[bool]:
        """Batched put: entries that fit the arena are copied and their Places posted;
        the others are reserved in one round trip (sent with those Places) and their
        commits posted in one send. No wait at all when every entry fits the arena.

        One bool per item, as ``put``. If the broker refuses some items, the others
        are still stored, then the first refusal is raised as ``BrokerRefused``.
        """
        return writes.put_many(self._link, self.filter_trust_s, items)

    def flush(self) -> bool:
        """Wait until the broker has handled every request this client posted (the
        commits of its puts, its releases): afterwards every other process sees this
        client's puts. Costs nothing when nothing is owed, else the wait for replies
        already on their way (no new request); what the residency index served and the
        broker was not told yet is sent and confirmed with a ping (its frame has no
        reply). False while the broker is unavailable."""
        with self._link.lock:
            s = self._link.session
            if s is not None and s.served.at:
                try:
                    s.wire.call(Ping())  # the pending Served frame goes first
                except BrokerUnavailable:
                    return False
            s = self._link.session
            if s is None:
                return False
            if not s.wire.owed:
                return True
            try:
                s.wire.read_replies(0)
                return True
            except BrokerUnavailable:
                return False

    # ------------------------------------------------------------ gets (reads.py)

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        return self.get_many([key], device)[0]

    def get_many(
        self, keys: list[str], device: str | torch.device = "cpu"
    ) -> list[torch.Tensor | None]:
        """New tensors (same dtype and shape as put) for the hits, None for misses."""
        cp = copy_module()
        dev = cp.torch.device(device)
        cp.check_device(dev)
        with self._link.lock:
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
            got = self._get_asked(ask, dev) if ask else []
            if mask is not None:
                got = _expand(mask, got, None)
            if local is None:
                return got
            it = iter(got)
            return [t if t is not None else next(it) for t in local]

    def _get_local(self, keys: list[str], dev: torch.device) -> list[torch.Tensor | None] | None:
        """The index's copies (None where the broker must be asked), or None when the
        index served nothing. Posts the Served frame."""
        s = self._link.session
        index = self._usable_index(s)
        if index is None or s is None:
            return None
        try:
            slab = self._link.slab()
        except BrokerUnavailable:
            return None
        own = None
        if s.arena.own and any(k in s.arena.own for k in keys):
            own = reads.own_reader(s.arena, s.wire.peer_gone, slab, dev)
        local, retries = index_path.read_known(index, slab, keys, dev, copy_module().torch_dtype, own)
        self.index_retries += retries
        served = [k for k, t in zip(keys, local, strict=True) if t is not None]
        if not served:
            return None
        self.index_hits += len(served)
        self._post_served(s, served, [t.nbytes for t in local if t is not None], 0)
        return local

    def _get_asked(self, ask: list[str], dev: torch.device) -> list[torch.Tensor | None]:
        """get_many's round trip for ``ask``: a Get, the copies, a posted Release."""
        try:
            s = self._link.live()
            if s is None:
                return [None] * len(ask)
            return reads.get_asked(s.wire, self._link.slab, ask, dev)
        except BrokerUnavailable:
            return [None] * len(ask)

    def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the entry into ``out`` (same dtype and shape, contiguous; CPU or CUDA).

        The copy-only path: no allocation, so no first-touch page faults on the
        destination. True on a hit; False on a miss or while the broker is away.
        On False ``out`` is either untouched or zeroed (zeroed when an index copy
        was discarded and the broker then had no entry): it never holds another
        entry's bytes.
        """
        cp = copy_module()
        if not out.is_cpu:
            cp.check_device(out.device)
        with self._link.lock:
            wrote = False
            s = self._link.session
            index = self._usable_index(s)  # first: a get usually follows a has() hit
            if index is not None and s is not None:
                try:
                    slab = self._link.slab()
                except BrokerUnavailable:
                    return False
                if key in s.arena.own:
                    got, wrote = reads.own_into(s.arena, s.wire.peer_gone, slab, key, out, cp)
                    if got:
                        self.index_hits += 1
                        self._post_served(s, [key], [out.nbytes], 0)
                        return True
                nbytes, wrote_index = index_path.read_known_into(
                    index, slab, key, out, cp.dtype_name
                )
                if nbytes is not None:
                    self.index_hits += 1
                    self._post_served(s, [key], [nbytes], 0)
                    return True
                self.index_retries += wrote or wrote_index
                wrote = wrote or wrote_index
            s = self._link.session
            mask = self._maybe_mask(s, [key]) if s is not None else None
            if mask is not None and not mask[0]:
                self.local_misses += 1
                hit = False
            else:
                try:
                    s = self._link.live()
                    hit = s is not None and reads.get_into_asked(s.wire, self._link.slab, key, out, cp)
                except BrokerUnavailable:
                    hit = False
            if wrote and not hit:
                out.zero_()  # the discarded copy's bytes must not be shown
            return hit

    # ------------------------------------------------------------ lookups and the rest

    def has(self, keys: list[str], lease_ms: int = 0, wait_ms: int = 0) -> list[bool]:
        """One bool per key. ``lease_ms > 0`` protects each hit from eviction for that long
        (or until this client disconnects). Keys the broker's membership filter rules
        out are answered here, without a round trip. ``wait_ms > 0``: the broker answers
        within about that long, a key its remote store has not answered by then False."""
        with self._link.lock:
            ask, mask = self._ask(keys)
            if not ask:
                return [False] * len(keys)
            # A lease needs the broker; past _INDEX_HAS_MAX keys one round trip costs less
            # than reading the index key by key (~1-3 us each from Python).
            s = self._link.session
            index = self._usable_index(s) if lease_ms <= 0 and len(ask) <= _INDEX_HAS_MAX else None
            if index is not None and s is not None:
                known = index_path.has_known(index, ask)
                n = known.count(True)
                if n:
                    self.index_hits += n
                    self._post_served(s, [], [], n)
                    if n < len(ask):
                        rest = [k for k, kn in zip(ask, known, strict=True) if not kn]
                        try:
                            more: HasReply = self._link.call(Has(rest, lease_ms, wait_ms))
                        except BrokerUnavailable:
                            more = HasReply([False] * len(rest))
                        it = iter(more.hits)
                        known = [True if kn else next(it) for kn in known]
                    return known if mask is None else _expand(mask, known, False)
            try:
                reply: HasReply = self._link.call(Has(ask, lease_ms, wait_ms))
            except BrokerUnavailable:
                return [False] * len(keys)
            return reply.hits if mask is None else _expand(mask, reply.hits, False)

    def lookup(
        self,
        keys: list[str],
        lease_ms: int = 0,
        wait_ms: int = 0,
        fresh: bool = False,
        claim_ms: int = 0,
    ) -> list[EntryInfo]:
        """Per key: MISS, READY (in the slab) or PENDING (being promoted from a lower
        tier: ask again shortly), with dtype and shape for the last two. Leases and
        bounds the wait (``wait_ms``) as ``has`` does. An outage answers all MISS.
        ``fresh``: the membership filter's absences are not trusted -- every key is
        asked of the broker, which asks its remote store for the keys it does not know
        (an entry another node published just now; protocol.Lookup.fresh).

        ``claim_ms > 0`` (in-flight deduplication, docs/design.md "Claims"): a MISS
        means "encode it" -- this connection now holds the key's claim for up to
        ``claim_ms`` (or the broker's bounds refused one: encode anyway) -- and
        CLAIMED means another encoder (another instance, or another node through the
        remote store) is on it: ``wait_ready`` for it. All or nothing: if any key is
        CLAIMED, no key of this call was claimed. Every key is asked of the broker."""
        miss = EntryInfo(LookupState.MISS)
        with self._link.lock:
            s = self._link.session
            local = s is not None and not fresh and claim_ms <= 0
            mask = self._maybe_mask(s, keys) if local else None
            ask = list(keys) if mask is None else [k for k, m in zip(keys, mask, strict=True) if m]
            self.local_misses += len(keys) - len(ask)
            if not ask:
                return [miss] * len(keys)
            try:
                msg = Lookup(ask, lease_ms, wait_ms, fresh, max(claim_ms, 0))
                reply: LookupReply = self._link.call(msg)
            except BrokerUnavailable:
                return [miss] * len(keys)
            if mask is None or len(ask) == len(keys):
                return reply.items
            return _expand(mask, reply.items, miss)

    def publish(self, keys: list[str], wait_ms: int) -> list[int] | None:
        """Wait until every entry of ``keys`` is visible to the whole fleet (in the
        remote store; without one, in this broker), at most ``wait_ms`` on the broker's
        side: one ``PublishState`` per key. Puts posted before on this client are
        handled first (one connection, in order). None during an outage. This call
        alone may hold its connection for ``wait_ms`` plus the client's ``timeout_s``."""
        if not keys:
            return []
        with self._link.lock:
            s = self._link.live()
            if s is None:
                return None
            sock = s.wire.sock
            before = sock.gettimeout() if hasattr(sock, "gettimeout") else None
            if before is not None:
                sock.settimeout(before + max(wait_ms, 0) / 1000.0)
            try:
                reply: PublishReply = s.wire.call(Publish(list(keys), max(wait_ms, 0)))
            except BrokerUnavailable:
                return None
            finally:
                if before is not None and s.wire.sock is sock:
                    sock.settimeout(before)
            return list(reply.states)

    def wait_ready(
        self,
        keys: list[str],
        wait_ms: int,
        lease_ms: int = 0,
        claim_ms: int = 0,
        fresh: bool = False,
    ) -> list[EntryInfo]:
        """Wait until no key of ``keys`` is CLAIMED any more (each claim ended: the key
        landed, or its encoder gave up), at most ``wait_ms`` on the broker's side, then
        answer as ``lookup(keys, lease_ms, claim_ms=claim_ms, fresh=fresh)`` would: a
        key still CLAIMED at the deadline is the caller's to encode. The broker wakes
        the wait on the claim's end (no polling on the node). This call alone holds
        its connection for up to ``wait_ms`` plus ``timeout_s``; an outage answers all
        MISS (encode)."""
        miss = EntryInfo(LookupState.MISS)
        if not keys:
            return []
        with self._link.lock:
            s = self._link.live()
            if s is None:
                return [miss] * len(keys)
            sock = s.wire.sock
            before = sock.gettimeout() if hasattr(sock, "gettimeout") else None
            if before is not None:
                sock.settimeout(before + max(wait_ms, 0) / 1000.0)
            try:
                msg = WaitReady(list(keys), max(wait_ms, 0), lease_ms, max(claim_ms, 0), fresh)
                reply: LookupReply = s.wire.call(msg)
            except BrokerUnavailable:
                return [miss] * len(keys)
            finally:
                if before is not None and s.wire.sock is sock:
                    sock.settimeout(before)
            return list(reply.items)

    def unclaim(self, keys: list[str]) -> None:
        """End this client's claims on ``keys`` (it will not put them after all: the
        encode failed, the request ended). Sent without waiting for the reply; claims
        also end when the key's put commits or aborts, the connection closes, or the
        ``claim_ms`` given at the lookup passes."""
        if keys:
            self._post_on_session(Unclaim(list(keys)))

    def unlease(self, keys: list[str]) -> None:
        """End this client's leases on ``keys`` (sent without waiting for the reply)."""
        if keys:
            self._post_on_session(Unlease(list(keys)))

    def _post_on_session(self, msg: Unclaim | Unlease) -> None:
        """Post ``msg`` on the session that holds what it ends, if it is still open:
        claims and leases die with their connection, so there is nothing to end
        without one (and nothing to reconnect for)."""
        with self._link.lock:
            s = self._link.session
            if s is None:
                return
            try:
                s.wire.post(msg)
            except BrokerUnavailable:
                pass

    def shutdown(self) -> bool:
        """Ask the broker to stop (its owner or root only). True if it accepted;
        raises BrokerRefused if it refused."""
        with self._link.lock:
            try:
                self._link.call(Shutdown())
                return True
            except BrokerUnavailable:
                return False

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: list[str]) -> list[bool]:
        with self._link.lock:
            try:
                reply: DeleteReply = self._link.call(Delete(list(keys)))
                return reply.deleted
            except BrokerUnavailable:
                return [False] * len(keys)

    def clear(self, shared: bool = False) -> bool:
        """Empty the broker's local tiers (slab, disk); ``shared`` also removes its key
        prefix from the remote store, for every broker using it. Owner or root only
        (BrokerRefused otherwise); False while the broker is unavailable."""
        with self._link.lock:
            try:
                self._link.call(Clear(shared=shared))
                return True
            except BrokerUnavailable:
                return False

    def stats(self) -> dict[str, Any]:
        """The broker's counters; {} while it is unavailable."""
        with self._link.lock:
            try:
                reply: StatsReply = self._link.call(Stats())
                return dict(reply.stats)
            except BrokerUnavailable:
                return {}

    def ping(self) -> bool:
        with self._link.lock:
            try:
                reply: PongReply = self._link.call(Ping())
                return reply.epoch == self.epoch
            except BrokerUnavailable:
                return False

    # ------------------------------------------------------------ state and seams

    @property
    def reconnects(self) -> int:
        """Connections made after the first (a restarted or recovered broker)."""
        return self._link.reconnects

    @property
    def connected(self) -> bool:
        return self._link.session is not None

    @property
    def tripped(self) -> bool:
        """True while a hung broker is being probed: calls answer misses at once."""
        return self._link.circuit.tripped

    @property
    def timeouts(self) -> int:
        """Outages that cost a timeout (one per outage)."""
        return self._link.circuit.timeouts

    @property
    def epoch(self) -> str | None:
        return self._link.hello.epoch if self._link.hello else None

    @property
    def handshake(self) -> HelloReply | None:
        """The broker's answer to the last handshake (segment names, limits), or None
        after close()."""
        return self._link.hello

    @property
    def mappings(self) -> Mappings | None:
        """The current broker epoch's mapped segments (``filter``, ``index``,
        ``journal``, ``slab``), or None while none are mapped (an outage)."""
        return self._link.maps

    def slab(self) -> SlabView:
        """The broker's slab, mapped now if it is not yet (for tools and tests that
        write a reservation themselves). Raises BrokerUnavailable during an outage."""
        with self._link.lock:
            if self._link.live() is None:
                raise BrokerUnavailable("not connected")
            return self._link.slab()

    def request(self, msg: msgspec.Struct) -> Any:
        """Send one protocol request and return its reply (tools and tests; the
        methods above are the API). Raises BrokerUnavailable or BrokerRefused."""
        with self._link.lock:
            return self._link.call(msg)

    def post(self, msg: msgspec.Struct, keys: tuple[str, ...] = ()) -> None:
        """Send one protocol request without waiting; its reply is read before the next
        one. ``keys``: keys it writes (never ruled out locally until it is handled)."""
        with self._link.lock:
            s = self._link.live()
            if s is None:
                raise BrokerUnavailable("not connected")
            s.wire.post(msg)
            s.posted.update(keys)

    def instrument_socket(self, wrap: Callable[[Any], Any]) -> None:
        """Replace this connection's socket (and every later one's) by ``wrap(sock)``,
        an object with the socket's methods: counting round trips in tests, timing
        syscalls in benchmarks."""
        with self._link.lock:
            self._link.wrap = wrap
            s = self._link.session
            if s is not None:
                s.wire.wrap(wrap)

    def close(self) -> None:
        self._link.stop_threads()
        with self._link.lock:
            s = self._link.session
            if s is not None and (s.posted or s.served.at):
                self.flush()  # this client's last puts (and hits) are in before it goes
            self._link.release()
            self._link.hello = None

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unmapping here (not left to the GC) keeps the order: CUDA unregistration first.
        try:
            self._link.stop_threads()
            self._link.release()
        except Exception:
            pass
