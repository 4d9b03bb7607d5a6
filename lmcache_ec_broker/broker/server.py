"""The broker process: one asyncio loop serving many clients on a Unix socket.

``BrokerServer`` owns the slab, the shared-memory indexes and the store, and
answers each request (``dispatch``). The store is synchronous and never blocks;
slow work (promotions from a lower tier) runs off the loop. A client's
connection -- framing, reply order, back-pressure, the greeting -- is
``connection.py``'s.

Nothing a client does can grow the broker's memory without bound: a client that
stops reading its replies or pipelines requests behind a slow one is held back or
disconnected (``connection.py``); a client that never releases what it gets or
leases: past ``max_pins_per_connection`` pins or ``max_leases_per_connection``
leases its gets and leasing lookups are refused (``too_many_pins``/
``too_many_leases``, counted) until it releases some; a client that holds
reservations: past ``max_reserved_bytes_per_connection`` its reserves are refused
(``too_many_reservations``, counted), so it cannot evict the whole slab; and what
one client process or uid holds in all its connections together is capped too
(``quotas.py``: connections, reservations, held bytes, pins, leases), and a
reservation left uncommitted lapses after ``reservation_ttl_s``.

How the tiers combine is the coordinator's business (``coordinator.py``), who
may connect is ``access.py``'s, starting and stopping the process is
``lifecycle.py``'s.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence

import msgspec

from ..config import BrokerConfig
from ..private_dirs import ensure_socket_dir
from ..protocol import (
    Abort,
    ArenaGrant,
    Clear,
    Commit,
    Delete,
    DeleteReply,
    ErrorCode,
    ErrorReply,
    Get,
    Has,
    HasReply,
    Hello,
    Lookup,
    LookupReply,
    OkReply,
    Ping,
    Place,
    PlaceReply,
    PongReply,
    Publish,
    PublishReply,
    Release,
    Request,
    Reserve,
    Served,
    Shutdown,
    Stats,
    StatsReply,
    Unclaim,
    Unlease,
    WaitReady,
    encode_frame,
)
from ..shm.filter import FilterWriter, slots_for
from ..shm.journal import Journal
from ..shm.residency import ResidencyWriter
from ..shm.residency import slots_for as residency_slots
from ..shm.segment import Segment, remove_stale
from ..sizes import format_size
from .access import AccessPolicy
from .connection import Connection
from .coordinator import Coordinator
from .lifecycle import (
    BrokerError,
    SocketLock,
    bind_socket,
    claim_socket_path,
    is_socket,
    probe_socket,
    resolve_group,
    segment_prefix,
)
from .publish import PUBLISH_COUNTERS, Publications
from .quotas import QuotaLimits
from .store import Entry, State, Store
from .tiers import TierError, make_lower_tiers

__all__ = ["AddOn", "BrokerError", "BrokerServer", "probe_socket", "segment_prefix"]

log = logging.getLogger("lmcache_ec_broker")

MAX_LEASE_MS = 600_000
# Monotonic counters of the server itself (exported as counters by the metrics endpoint).
SERVER_COUNTERS = ("queue_pauses", *PUBLISH_COUNTERS)
# Started by ``prepare`` with the server, in order (``run.py`` chooses them: the
# metrics endpoint, the residency events; the server imports neither). Each plugs into
# the hooks below and the store's and coordinator's ``observer``, or raises BrokerError.
AddOn = Callable[["BrokerServer"], object]


class BrokerServer:
    def __init__(self, config: BrokerConfig, add_ons: Sequence[AddOn] = ()) -> None:
        config.validate()
        self.config = config
        self.add_ons = list(add_ons)
        self.epoch = uuid.uuid4().hex
        self.started_at = time.time()
        self.store = Store(
            capacity_bytes=config.shm_size,
            block_size=config.block_size,
            max_entry_bytes=config.max_entry_size or None,
            max_key_length=config.max_key_length,
            max_pins_per_conn=config.max_pins_per_connection,
            max_leases_per_conn=config.max_leases_per_connection,
            arena_bytes=config.put_arena_bytes,
            arena_slots=config.max_connections,
            max_reserved_bytes_per_conn=config.max_reserved_bytes_per_connection,
            quotas=QuotaLimits.from_config(config, config.shm_size // config.block_size),
            reservation_ttl_s=config.reservation_ttl_s,
        )
        self.counters = dict.fromkeys(SERVER_COUNTERS, 0)
        self.tiers = Coordinator(self.store, make_lower_tiers(config, self.store.capacity_bytes))
        # Publish requests (publish.py): told of every commit through the write-behind.
        self.publications = Publications(self.tiers, self.counters)
        self.tiers.writes.on_offered = self.publications.offered
        self.store.on_abort = self.publications.ended  # no polling (publish.py)
        self.access = AccessPolicy(os.getuid(), config.allowed_uids, None, config.max_connections)
        self.segment: Segment | None = None
        self.filter: FilterWriter | None = None
        self.journal: Journal | None = None  # put arenas' placement journal (shm/journal.py)
        self.residency: ResidencyWriter | None = None  # the residency index (shm/residency.py)
        self.conn_ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        self.decoder = msgspec.msgpack.Decoder(Request)
        self._encoder = msgspec.msgpack.Encoder()
        self._server: asyncio.AbstractServer | None = None
        self._sock: socket.socket | None = None
        self._lock: SocketLock | None = None
        self._tiers_open = False
        self._stopping: asyncio.Event | None = None
        # A SIGTERM/SIGINT that came after prepare() and before serve() installed the
        # loop's handlers (run_broker notes it; raising there would break the loop's start).
        self.stop_signal: int | None = None
        # Called with (op name, seconds) after every request; metrics plug in here.
        self.observers: list[Callable[[str, float], None]] = []
        # Run after the tiers are flushed, before the segment goes (the metrics endpoint).
        self.shutdown_hooks: list[Callable[[], Awaitable[None] | None]] = []
        # Each adds keys to stats() (metrics latency summaries).
        self.stats_providers: list[Callable[[], dict[str, int | float]]] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # set while serving
        # The connection whose request settle_reservations is settling (0: none), and
        # the connections whose request was read during such a settle and waits for
        # its own (``run_deferred``: one after another, never nested).
        self.settling_for = 0
        self.deferred: collections.deque[Connection] = collections.deque()
        self._running_deferred = False

    # ---------------------------------------------------------------- wiring

    def encode_frame(self, msg: msgspec.Struct) -> bytes:
        return encode_frame(self._encoder, msg)

    def settle_reservations(self, conn: int, keys: Collection[str]) -> None:
        """Before ``conn`` reads ``keys``: any key another client has reserved may have
        its posted Commit waiting in that client's socket; handle it first, so a put
        that returned is seen by every request made after it (read-after-put across
        processes). A key the index lacks may have been placed from another client's
        put arena: the connections whose journal slot shows a placement not handled
        yet are read first (bounded: only those, one read_pending each).

        Never nested (issue 40 item 4): while settling, a request read from a writer's
        socket that would itself settle (it reads keys, or reserves) is not handled
        there: its connection defers it (``Connection.defer``; that connection reads
        nothing more meanwhile), and ``run_deferred`` handles it after the request
        being settled, one connection after another -- iteration, so the stack stays
        a few frames deep whatever the number of connections, and no frame read is
        ever dropped. Deferring loses nothing: a deferred request is one its client
        waits for, so an honest client sent nothing after it (its posted Commit/Place
        precede its next request in its socket and are handled here; the model in
        tests/test_settle_machine.py checks this)."""
        if self.settling_for:
            return  # cannot happen (requests that settle are deferred); be safe
        entries = self.store.entries
        self.settling_for = conn
        try:
            missing = False
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    missing = True
                    continue
                if entry.state is not State.RESERVED or entry.owner == conn:
                    continue
                owner = self.connections.get(entry.owner)
                if owner is not None:
                    owner.read_pending()
            if missing and len(self.store.arenas) and self.journal is not None:
                self._settle_arenas(conn)
        finally:
            self.settling_for = 0

    def run_deferred(self) -> None:
        """Handle the requests deferred by settles (``settle_reservations``), in turn,
        until none is left (one deferred here may defer others: they queue behind).
        Called after every request a connection handled outside a settle; a call made
        while this runs (or during a settle) returns at once."""
        if self._running_deferred or self.settling_for:
            return
        self._running_deferred = True
        try:
            deferred = self.deferred
            while deferred:
                deferred.popleft().resume()
        finally:
            self._running_deferred = False

    def _settle_arenas(self, conn: int) -> None:
        journal = self.journal
        assert journal is not None
        for holder, slot in self.store.arenas.holders().items():
            if holder != conn and journal.unsettled(slot):
                owner = self.connections.get(holder)
                if owner is not None:
                    owner.read_pending()
                    if journal.unsettled(slot):  # a stopped client bounds only itself
                        journal.stalled(slot, owner.drain_pending)

    def _place(self, conn: int, msg: Place) -> msgspec.Struct:
        """Store an entry the client wrote into its arena; the journal slot is settled
        afterwards whatever the outcome, an exception included (shm/journal.py: after
        the filter add). Invariant: a Place handled is a Place settled -- an unsettled
        slot makes every other client ask the broker for each miss, and lets the
        placing client keep serving the key from blocks the broker may have reused."""
        store = self.store
        try:
            got = store.place(conn, msg.key, msg.nbytes, msg.dtype, msg.shape, msg.runs)
            if isinstance(got, Entry):
                self.tiers.placed(got)
                got = PlaceReply(True)
            elif isinstance(got, PlaceReply) and store.ready(msg.key) is not None:
                self.tiers.dedup.landed(msg.key, written=False)  # present: ends its claim
            return got
        finally:
            slot = store.arena_slot(conn)
            if slot >= 0 and self.journal is not None:
                self.journal.settle(slot, msg.seq)

    def _grant(self, conn: int, nbytes: int) -> msgspec.Struct:
        had = self.store.arena_slot(conn)
        reply = self.store.grant(conn, nbytes)
        slot = self.store.arena_slot(conn)
        if had < 0 <= slot and self.journal is not None:
            self.journal.hand_out(slot)  # before the client learns the slot
        return reply

    def observe(self, op: str, started: float) -> None:
        observers = self.observers
        if observers:
            elapsed = time.perf_counter() - started
            for obs in observers:
                obs(op, elapsed)

    def dispatch(
        self, conn: int, msg: object, peer_uid: int = -1
    ) -> msgspec.Struct | Awaitable[msgspec.Struct] | None:
        tiers = self.tiers
        store = self.store
        match msg:
            case Lookup(keys=keys, lease_ms=lease_ms, wait_ms=wait_ms, fresh=fresh):
                if lease_ms > 0 and (refusal := self._admit_leases(conn, keys)) is not None:
                    return refusal
                lease = min(max(lease_ms, 0), MAX_LEASE_MS)
                if msg.claim_ms > 0:  # in-flight deduplication (dedup.py)
                    got = tiers.dedup.lookup(
                        conn, peer_uid, keys, lease, _wait(wait_ms), fresh, msg.claim_ms
                    )
                else:
                    got = tiers.lookup(conn, keys, lease, _wait(wait_ms), fresh)
                return LookupReply(got) if isinstance(got, list) else _wrap(got, LookupReply)
            case WaitReady(keys=keys, wait_ms=wait_ms, lease_ms=lease_ms, claim_ms=claim_ms):
                if lease_ms > 0 and (refusal := self._admit_leases(conn, keys)) is not None:
                    return refusal
                lease = min(max(lease_ms, 0), MAX_LEASE_MS)
                waiting = tiers.dedup.wait_ready(
                    conn, peer_uid, keys, wait_ms, lease, claim_ms, msg.fresh
                )
                return _wrap(waiting, LookupReply)
            case Unclaim(keys=keys):
                tiers.dedup.unclaim(conn, keys)
                return OkReply()
            case Publish(keys=keys, wait_ms=wait_ms):
                # bounded by the client's wait, and by a lease's longest life at most
                wait_s = min(max(wait_ms, 0), MAX_LEASE_MS) / 1000.0
                return _wrap(self.publications.publish(keys, wait_s), PublishReply)
            case Unlease(keys=keys):
                tiers.unlease(conn, keys)
                return OkReply()
            case Shutdown():
                refusal = self.access.may_shutdown(peer_uid)
                if refusal is not None:
                    return refusal
                log.info("shutdown requested by a client (uid %d)", peer_uid)
                if self.loop is not None:
                    self.loop.call_soon(self.request_stop)
                return OkReply()
            case Has(keys=keys, lease_ms=lease_ms, wait_ms=wait_ms):
                if lease_ms > 0 and (refusal := self._admit_leases(conn, keys)) is not None:
                    return refusal
                hits = tiers.has(conn, keys, min(max(lease_ms, 0), MAX_LEASE_MS), _wait(wait_ms))
                return HasReply(hits) if isinstance(hits, list) else _wrap(hits, HasReply)
            case Reserve(key=key, nbytes=nbytes, dtype=dtype, shape=shape):
                return tiers.reserve(conn, key, nbytes, dtype, shape)
            case Commit(token=token):
                return tiers.commit(conn, token) or OkReply()
            case Place():
                return self._place(conn, msg)
            case ArenaGrant(nbytes=nbytes):
                if self.journal is None:
                    return ErrorReply(ErrorCode.BAD_REQUEST, "this broker grants no put arenas")
                return self._grant(conn, nbytes)
            case Abort(token=token):
                return tiers.abort(conn, token) or OkReply()
            case Get(keys=keys):
                if (refusal := store.admit_pins(conn, keys)) is not None:
                    return refusal
                return tiers.get(conn, keys)  # awaitable when promoting from a lower tier
            case Release(pins=pins):
                return store.release(conn, pins) or OkReply()
            case Served(keys=keys, nbytes=nbytes, has_hits=has_hits):
                store.served(*self._served_once(keys, nbytes), has_hits)
                return None  # posted without a reply: the client owes itself nothing
            case Delete(keys=keys):
                return DeleteReply(tiers.delete(keys))
            case Clear(shared=shared):
                refusal = self.access.may_clear(peer_uid)
                if refusal is not None:
                    return refusal
                log.info("clear requested by uid %d: %s", peer_uid, self.clear_scope(shared))
                tiers.clear(shared=shared)
                return OkReply()
            case Stats():
                return StatsReply(self.stats())
            case Ping():
                return PongReply(self.epoch)
            case Hello():
                return ErrorReply(ErrorCode.BAD_REQUEST, "hello was already received")
        return ErrorReply(ErrorCode.BAD_REQUEST, f"unsupported request {type(msg).__name__}")

    def _served_once(self, keys: list[str], nbytes: list[int]) -> tuple[list[str], list[int]]:
        """The keys of a Served frame that count (issue 40 item 8): each at most once
        per frame (a frame naming one key 50,000 times counts one hit), and only keys
        the residency index holds now -- the only keys a client can have copied
        without asking (an unindexed key, one too long or never published, is served
        by the broker's Get, counted there)."""
        index = self.residency
        seen: dict[str, int] = {}
        for i, key in enumerate(keys):
            if key not in seen and (index is None or index.holds(key)):
                seen[key] = nbytes[i] if i < len(nbytes) else 0
        return list(seen), list(seen.values())

    def _admit_leases(self, conn: int, keys: list[str]) -> ErrorReply | None:
        return self.store.admit_leases(conn, keys, self.tiers.leases_held(conn))

    def clear_scope(self, shared: bool) -> str:
        """What a Clear removes, in words (logged, and shown by `lmcache-ec-broker clear`)."""
        local = "the slab" + (
            f" and the disk tier ({self.config.local_disk})" if self.config.local_disk else ""
        )
        if not self.config.remote_url:
            return local
        where = f"every key under {self.config.remote_key_prefix!r} in {self._remote_shown()}"
        if shared:
            return f"{local}, and {where}, for every broker using that prefix"
        return f"{local} (the remote store is kept: {where})"

    def _remote_shown(self) -> str:
        from ..remote_url import mask_url

        return mask_url(self.config.remote_url or "")

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(self.store.stats())
        out.update(
            clients=len(self.connections),
            epoch=self.epoch,
            pid=os.getpid(),
            uptime_s=round(time.time() - self.started_at, 3),
            segment=self.segment.name if self.segment else "",
            socket=self.config.socket_path,
        )
        out.update(
            max_pins_per_connection=self.store.max_pins_per_conn,
            max_leases_per_connection=self.store.max_leases_per_conn,
            max_reserved_bytes_per_connection=self.store.max_reserved_blocks_per_conn
            * self.store.block_size,
            max_held_bytes_per_process=self.store.quotas.limits.process.held_blocks
            * self.store.block_size,
            max_held_bytes_per_uid=self.store.quotas.limits.uid.held_blocks
            * self.store.block_size,
            max_connections_per_process=self.store.quotas.limits.process.connections,
            max_connections_per_uid=self.store.quotas.limits.uid.connections,
            reservation_ttl_s=self.store.reservation_ttl,
        )
        out.update(self.counters)
        out.update(self.tiers.stats())
        if self.config.remote_url:
            out.update(
                remote_store=self._remote_shown(),
                remote_key_prefix=self.config.remote_key_prefix,
                remote_down_reason=self._remote_down_reason(),
            )
        if self.filter is not None:
            out.update(filter_slots=self.filter.nslots, filter_saturated=self.filter.saturated)
        if self.residency is not None:
            out.update(
                residency_slots=self.residency.nslots, residency_entries=self.residency.entries
            )
        for provide in self.stats_providers:
            out.update(provide())
        return out

    def _remote_down_reason(self) -> str:
        """Why the remote tier last failed to reach its store ("" while it is up)."""
        for tier in self.tiers.remote_tiers:
            trouble = getattr(getattr(tier, "transport", None), "trouble", None)
            reason = trouble.reason if trouble is not None else ""
            if reason and not tier.stats().get("remote_up", 1):
                return str(reason)
        return ""

    # ---------------------------------------------------------------- lifecycle

    def prepare(self) -> None:
        """Everything that can fail at start, before serving: refuse clearly or succeed."""
        cfg = self.config
        path = cfg.socket_path
        gid = resolve_group(cfg.socket_group)
        try:
            # The per-user default directory: created 0700 and checked; another missing
            # directory (e.g. /run/lmcache-ec): created, open only as far as socket_mode.
            ensure_socket_dir(path, cfg.socket_mode, gid)
        except ValueError as exc:
            raise BrokerError(str(exc)) from None
        self._lock = claim_socket_path(path)  # held until cleanup(): no start races us
        try:
            for name in remove_stale(segment_prefix(path)):
                log.warning(
                    "removed stale shared-memory segment /dev/shm/%s of a dead broker", name
                )
            self.access.group_gid = gid
            # Every segment is a memfd (no name in /dev/shm: nobody takes one first,
            # opens one by path, and none outlives its last descriptor and mapping),
            # the slab's sealed against resizing (shm/segment.py). Admitted clients get
            # the segments as descriptors over the socket (connection.py hello).
            # remove_stale above still takes an older broker's named slab, -f, -j, -r.
            t0 = time.perf_counter()
            name = "/" + segment_prefix(path) + self.epoch[:12]  # a label only
            self.segment = Segment.create_slab(name, self.store.capacity_bytes)
            log.info(
                "created shared-memory slab %s (%s, %s blocks, prefaulted in %.2fs)",
                name,
                format_size(self.segment.size),
                format_size(self.store.block_size),
                time.perf_counter() - t0,
            )
            self._publish_filter(name)
            self._publish_residency(name + "-r")
            if self.store.arenas.cap_blocks:
                self.journal = Journal.create(name + "-j", self.config.max_connections)
            for add_on in self.add_ons:  # before the socket exists: a refusal precedes readiness
                add_on(self)
            try:
                self.tiers.open()
            except TierError as exc:
                raise BrokerError(str(exc)) from exc
            self._tiers_open = True
            self._sock = bind_socket(path, cfg.socket_mode, gid)
        except BaseException:
            self.cleanup()
            raise

    def _publish_filter(self, slab_name: str) -> None:
        # Every tier counts its keys in it, so it is sized for the keys of all of them.
        keys = self.tiers.expected_keys()
        self.filter = FilterWriter(slab_name + "-f", slots_for(keys))
        self.tiers.attach_filter(self.filter)

    def _publish_residency(self, name: str) -> None:
        store = self.store
        self.residency = ResidencyWriter(name, residency_slots(store.nblocks), store.capacity_bytes)
        store.index.residency = self.residency

    def handover(self) -> tuple[list[str], list[int]]:
        """The segments an admitted client gets over the socket, as (labels, fds):
        read-write what clients write (slab, journal placed words), sealed memfds what
        they only read (filter, index, the settled words: no writable mapping can be
        made of them, whatever the descriptor's mode)."""
        labels: list[str] = []
        fds: list[int] = []
        for label, seg in (
            ("slab", self.segment),
            ("filter", self.filter.segment if self.filter else None),
            ("journal", self.journal.segment if self.journal else None),
            ("settled", self.journal.settled_segment if self.journal else None),
            ("index", self.residency.segment if self.residency else None),
        ):
            if seg is not None:
                labels.append(label)
                fds.append(seg.share_fd())
        return labels, fds

    async def serve(self) -> None:
        assert self._sock is not None and self.segment is not None, "prepare() first"
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        self.tiers.start(loop, self.segment.mm)
        self._server = await loop.create_unix_server(lambda: Connection(self), sock=self._sock)
        log.info(
            "serving on %s (epoch %s, pid %d); %s",
            self.config.socket_path,
            self.epoch[:12],
            os.getpid(),
            "tiers: slab, " + ", ".join(t.name for t in self.tiers.lower_tiers)
            if self.tiers.lower_tiers
            else "no disk tier: entries live in memory only and a restart starts empty",
        )
        sweeper = asyncio.ensure_future(self._sweep_leases())
        if self.stop_signal is not None:  # asked before the loop's handlers were in
            self.request_stop(self.stop_signal)
        try:
            await self._stopping.wait()
        finally:
            sweeper.cancel()
            await self._shutdown()

    def request_stop(self, sig: int | None = None) -> None:
        stopping = self._stopping
        if stopping is None or stopping.is_set():
            return  # e.g. the loop also hands on a signal run_broker already noted
        if sig is not None:
            log.info("received %s, shutting down", signal.Signals(sig).name)
        stopping.set()

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.tiers.expire_leases()
            if self.journal is not None:
                self.journal.sweep()  # distrusted slots whose time is up

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting
        for conn in list(self.connections.values()):
            conn.close()
        await asyncio.sleep(0)  # let connection_lost run: releases pins and reservations
        if self.tiers.lower_tiers:
            log.info(
                "flushing the lower tiers for up to %gs (shutdown_flush_s)",
                self.config.shutdown_flush_s,
            )
        try:
            await self.tiers.shutdown(self.config.shutdown_flush_s)
        except Exception:
            log.exception("flushing the lower tiers failed")
        for hook in self.shutdown_hooks:
            try:
                res = hook()
                if isinstance(res, Awaitable):
                    await res
            except Exception:
                log.exception("shutdown hook failed")
        self.cleanup()
        log.info("stopped; socket and shared-memory segment removed")

    def cleanup(self) -> None:
        """Unlink the socket, close the segments (memfds: their memory goes with the
        last client's mapping); safe to call more than once and on any exit path."""
        path = self.config.socket_path
        # A socket at the path while this start holds the path's lock is this broker's
        # (or a dead one's it would replace): removed even if a stop signal landed after
        # bind_socket listened but before _sock kept it (a readiness probe had already
        # connected; tests/signal_at_bind.py lands it there).
        if self._sock is not None or self._lock is not None:
            try:
                if is_socket(path):
                    os.unlink(path)
            except OSError:
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.filter is not None:
            self.tiers.attach_filter(None)
            self.filter.close()
            self.filter = None
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.residency is not None:
            self.store.index.residency = None
            self.residency.close()  # clears LIVE first: readers ask the broker from here
            self.residency = None
        if self._tiers_open:
            self.tiers.close()
            self._tiers_open = False
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self._lock is not None:
            self._lock.release()  # last: until here no other start may touch the path
            self._lock = None


def _wait(wait_ms: int) -> int:
    """A client's ``wait_ms``, untrusted: <= 0 is no bound of its own; longer than a
    lease can be is no tighter a bound than the broker's own (remote_timeout_s)."""
    return min(wait_ms, MAX_LEASE_MS) if wait_ms > 0 else 0


async def _wrap(pending: Awaitable, reply: type[msgspec.Struct]) -> msgspec.Struct:
    return reply(await pending)
