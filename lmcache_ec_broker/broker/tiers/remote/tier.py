"""The remote tier at run time: the policy (``policy.py``) on the event loop,
the transport's calls on the tier's own threads.

Threads: lookups (``lookup_concurrency``), promotions (reads), write-behind
(``write_workers``, at background CPU priority) and one for key listings and
probes. Every result comes back to the loop through the executor's future, where
the policy -- and only the policy -- updates its state; the futures' results are
always retrieved (no "exception was never retrieved" from an abandoned lookup).

A transport that can do a lookup or a promotion's read on the event loop itself
(``lookup_on_loop`` / ``read_on_loop``: Redis with an idle connection at hand) is
asked first: a remote hit then pays no thread hand-offs. It answers "not here"
(None / False) before any I/O when it cannot, and the threads do it as before; its
result goes to the policy exactly as a thread's would. A get that no lookup preceded
is one ``fetch`` (policy promise 9): on the loop (``fetch_on_loop``) or as one
read-thread job into a staging buffer of the transport's (``fetch_staged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ....protocol import Extent
from ..base import (
    EntryMeta,
    LowerTier,
    OwnTierEvents,
    SlabAccess,
    TierCorrupt,
    TierEvents,
    TierMiss,
    TierUnavailable,
)
from .jobs import (
    ClearJob,
    DeleteJob,
    Job,
    LookupJob,
    ProbeJob,
    ScanJob,
    WriteBatch,
    WriteJob,
    execute,
)
from .policy import Limits, RemotePolicy
from .stats import REMOTE_COUNTERS, REMOTE_GAUGES, record_latency
from .transport import Declined, Outcome, Retry, StoreDown, Transport
from .value import BadValue

log = logging.getLogger("lmcache_ec_broker.remote")

BACKGROUND_NICE = 10
MAINTAIN_S = 0.25


def _background_priority() -> None:
    """Lower this thread's CPU priority (Linux: setpriority on the thread id)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE)
        )
    except (OSError, AttributeError):
        pass


class Meter:
    """Counters the transport's threads update (bytes moved, latency, redirects)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int | float] = dict.fromkeys(names, 0)

    def count(self, name: str, n: int | float = 1) -> None:
        with self._lock:
            self.values[name] += n

    def observe(self, seconds: float) -> None:
        with self._lock:
            record_latency(self.values, seconds)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self.values)


async def _uncancellable(fut: asyncio.Future[Any]) -> Any:
    """Await ``fut`` to its end even if the caller is cancelled (then re-raise the
    cancellation): reserved extents stay reserved while a transfer may write them."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


def _ignore_failure(inflight: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(fut: asyncio.Future[Any]) -> None:
        inflight.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("remote tier: deleting fleet claims failed: %s", fut.exception())

    return done


class RemoteTier(LowerTier):
    """A LowerTier over any transport; subclasses build the transport and limits."""

    name = "remote"
    counter_names = REMOTE_COUNTERS
    remote = True
    gauge_names = REMOTE_GAUGES

    def __init__(self, transport: Transport, limits: Limits, meter: Meter, describe: str) -> None:
        self.transport = transport
        self.limits = limits
        self.meter = meter
        self.describe = describe
        self.policy = RemotePolicy(limits, self, transport.node_of, ready=transport.ready)
        self.policy.own = self
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slab: SlabAccess | None = None
        self._events: TierEvents | None = None
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._inflight: set[asyncio.Future[Any]] = set()
        self._maintainer: asyncio.TimerHandle | None = None
        self._poll_s = float(getattr(transport, "poll_s", 0.0))
        self._last_poll = 0.0
        # Fleet encode claims (claim_fleet): this broker start's owner token, and the
        # keys whose claim it holds in the store (deleted when their write-behind ends,
        # or when the node claim ends without the key; else they expire by their TTL).
        self._claim_owner = uuid.uuid4().hex.encode()
        self._fleet_held: set[str] = set()

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        self.transport.open()

    def start(self, loop: asyncio.AbstractEventLoop, slab: SlabAccess, events: TierEvents) -> None:
        self._loop, self._slab, self._events = loop, slab, events
        lim = self.limits
        self._pools = {
            "lookup": ThreadPoolExecutor(lim.lookup_concurrency, "ec-remote-lookup"),
            "read": ThreadPoolExecutor(2, "ec-remote-read"),
            # Write-behind and maintenance yield the CPU to the loop and the readers.
            "write": ThreadPoolExecutor(
                lim.write_workers, "ec-remote-write", initializer=_background_priority
            ),
            "control": ThreadPoolExecutor(1, "ec-remote-control", initializer=_background_priority),
            # fleet encode claims: never queued behind (or ahead of) the policy's lookups
            "claims": ThreadPoolExecutor(2, "ec-remote-claims"),
        }
        self.transport.start(slab)
        log.info("remote tier: %s, timeout %.2fs", self.describe, lim.timeout_s)
        self.transport.start_announcements(self._on_keys, self._on_resync, self._on_health)
        self._maintainer = loop.call_later(MAINTAIN_S, self._maintain)

    def _on_keys(self, keys: list[str]) -> None:  # a transport thread
        self._threadsafe(self.policy.announced, keys)

    def _on_resync(self) -> None:  # a transport thread
        self._threadsafe(self.policy.want_scan)

    def _on_health(self, node: object, ok: bool) -> None:  # a transport thread
        self._threadsafe(self.policy.health, node, ok)

    def _threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(fn, *args)

    def _maintain(self) -> None:
        if self.policy.closing:
            return
        self.policy.maintain()
        if self._poll_s > 0 and time.monotonic() - self._last_poll >= self._poll_s:
            self._last_poll = time.monotonic()
            self.policy.want_scan()
        assert self._loop is not None
        self._maintainer = self._loop.call_later(MAINTAIN_S, self._maintain)

    async def shutdown(self, deadline_s: float) -> None:
        end = time.monotonic() + max(deadline_s, 0.0)
        pol = self.policy
        pol.closing = True
        if self._maintainer is not None:
            self._maintainer.cancel()
        # queued writes may drain for half the deadline, then are abandoned
        while not pol.idle and time.monotonic() < end - deadline_s / 2:
            await asyncio.sleep(0.02)
        pol.abandon()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=max(end - time.monotonic(), 0.0))
        if self._inflight:
            log.warning("remote tier: abandoning %d transfers at shutdown", len(self._inflight))
            self.transport.stop()  # cuts sockets: the threads leave the slab now
            await asyncio.wait(set(self._inflight), timeout=max(self.limits.timeout_s, 1.0))
        self.transport.stop()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._slab = None

    def close(self) -> None:
        self.transport.stop()
        self.transport.close()

    def expected_keys(self, block_size: int) -> int:
        return self.limits.filter_cap

    # ------------------------------------------------------------ Runner (policy side)

    def dispatch(self, job: Job) -> None:
        assert self._loop is not None
        if isinstance(job, LookupJob) and hasattr(self.transport, "lookup_on_loop"):
            task = self._loop.create_task(self._lookup_on_loop(job))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            return
        self._dispatch_thread(job)

    async def _lookup_on_loop(self, job: LookupJob) -> None:
        try:
            result: Any = await self.transport.lookup_on_loop(job.keys)  # type: ignore[attr-defined]
        except (StoreDown, Retry) as exc:
            result = exc
        except asyncio.CancelledError:  # shutdown: the policy still hears of it
            self.policy.finished(job, StoreDown([], "cancelled at shutdown"))
            raise
        except Exception as exc:  # a transport bug: treated as the store failing
            log.exception("remote tier: a lookup on the loop failed")
            result = StoreDown([], f"{type(exc).__name__}: {exc}")
        if result is None:  # not on the loop: a thread does it
            self._dispatch_thread(job)
            return
        self.policy.finished(job, result)

    def _dispatch_thread(self, job: Job) -> None:
        assert self._loop is not None
        if isinstance(job, LookupJob):
            pool = self._pools["lookup"]
        elif isinstance(job, WriteBatch | DeleteJob | ClearJob):
            pool = self._pools["write"]
        else:
            assert isinstance(job, ScanJob | ProbeJob)
            pool = self._pools["control"]
        try:
            fut = self._loop.run_in_executor(pool, execute, self.transport, job, self._slab)
        except RuntimeError:  # executor shut down
            self.policy.finished(job, StoreDown([], "remote tier is shut down"))
            return
        self._inflight.add(fut)
        fut.add_done_callback(lambda f, job=job: self._job_done(job, f))

    def _job_done(self, job: Job, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        if fut.cancelled():
            result: Any = StoreDown([], "cancelled at shutdown")
        else:
            result = fut.result()  # execute never raises
        self.policy.finished(job, result)

    def answered(self, job: LookupJob) -> None:
        waiter = job.waiter
        if waiter is None or waiter.done():
            return
        if isinstance(job.answer, Exception):
            waiter.set_exception(job.answer)
            waiter.exception()  # retrieved here: a caller that stopped waiting logs nothing
        else:
            waiter.set_result(job.answer)

    def write_ended(self, job: WriteJob) -> None:
        if job.waiter is not None and not job.waiter.done():
            job.waiter.set_result(None)
        if job.key in self._fleet_held:  # stored (or failed): the claim has done its part
            self.unclaim_fleet([job.key])

    @property
    def filter_partial(self) -> bool:  # type: ignore[override]
        return self.policy.partial

    def added(self, key: str) -> None:
        if self._events is not None:
            self._events.added(self, key)

    def removed(self, key: str) -> None:
        if self._events is not None:
            self._events.removed(self, key)

    # OwnWrites (policy side): passed on to events that want them
    def own_stored(self, key: str, nbytes: int) -> None:
        if isinstance(self._events, OwnTierEvents):
            self._events.own_stored(self, key, nbytes)

    def own_deleted(self, key: str) -> None:
        if isinstance(self._events, OwnTierEvents):
            self._events.own_deleted(self, key)

    def own_cleared(self) -> None:
        if isinstance(self._events, OwnTierEvents):
            self._events.own_cleared(self)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            if delay_s <= 0:
                self._loop.call_soon(fn)
            else:
                self._loop.call_later(delay_s, fn)

    # ------------------------------------------------------------ LowerTier

    async def lookup(self, keys: Sequence[str], fresh: bool = False) -> list[EntryMeta | None]:
        got = self.policy.lookup(keys, fresh)
        if isinstance(got, list):
            return got
        assert self._loop is not None
        if got.answer is None:
            got.waiter = self._loop.create_future()
            # the policy answers every lookup by its deadline; the margin only guards a bug
            await asyncio.wait_for(asyncio.shield(got.waiter), self.limits.timeout_s + 1.0)
        if isinstance(got.answer, Exception):
            raise got.answer
        assert got.answer is not None
        return got.answer

    def read_into(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None]:
        return self._read(key, meta, list(extents))

    async def _read(self, key: str, meta: EntryMeta, extents: list[Extent]) -> None:
        self.policy.read_start(key)
        slab = self._slab
        assert self._loop is not None and slab is not None
        on_loop = getattr(self.transport, "read_on_loop", None)
        if on_loop is not None:
            try:
                done = await on_loop(key, meta, extents, slab)
            except (StoreDown, Retry, BadValue, TierMiss) as exc:
                self._read_ended(key, exc)
                return
            except Exception as exc:  # a transport bug: treated as the store failing
                log.exception("remote tier: reading %r failed", key[:200])
                self._read_ended(key, StoreDown([], f"{type(exc).__name__}: {exc}"))
                return
            if done:
                self._read_ended(key, None)
                return

        def job() -> BaseException | None:
            try:
                self.transport.read_into(key, meta, extents, slab)
            except (StoreDown, Retry, BadValue, TierMiss) as exc:
                return exc
            except Exception as exc:  # a transport bug: treated as the store failing
                log.exception("remote tier: reading %r failed", key[:200])
                return StoreDown([], f"{type(exc).__name__}: {exc}")
            return None

        fut = self._loop.run_in_executor(self._pools["read"], job)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        self._read_ended(key, await _uncancellable(fut))

    def _read_ended(self, key: str, exc: BaseException | None) -> None:
        """The policy hears how a promotion's read ended; raises what the caller sees."""
        if isinstance(exc, Retry):  # busy here, not the store's fault
            raise TierUnavailable(str(exc))
        self.policy.read_ended(key, exc)
        if isinstance(exc, StoreDown):
            raise TierUnavailable(str(exc))
        if isinstance(exc, BadValue):
            raise TierCorrupt(str(exc))
        if isinstance(exc, TierMiss):
            raise exc

    @property
    def can_fetch(self) -> bool:
        """Can ``fetch`` read a value without a lookup first (the transport's kind)?"""
        return bool(getattr(self.transport, "fetches", False))

    async def fetch(
        self, key: str, reserve: Callable[[EntryMeta], list[Extent] | None]
    ) -> bool | None:
        """A get of ``key`` that no lookup preceded: lookup and read in one store
        transfer where the transport can -- on the loop (``fetch_on_loop``: Redis), or
        on one read thread into a staging buffer (``fetch_staged``: Mooncake). The
        value's header says what it is; ``reserve(meta)`` gives the extents to fill,
        or None to take nothing. True: the extents hold the verified value; False:
        ``reserve`` declined; None: not done here (no I/O, nothing reserved): look up
        and read as usual. Raises TierMiss, TierCorrupt or TierUnavailable (then
        anything reserved must be aborted)."""
        transport: Any = self.transport
        if self._slab is None:
            return None
        if hasattr(transport, "fetch_on_loop"):
            lc = transport.loop_fetch_conn(key)
            if lc is None:
                return None
            try:
                job = self.policy.fetch_start(key)
            except BaseException:
                lc.release()
                raise
            return await self._fetch_ended(
                job, key, transport.fetch_on_loop(lc, key, reserve, self._slab)
            )
        if hasattr(transport, "fetch_staged"):
            stage = transport.take_stage()
            if stage is None:
                return None
            try:
                job = self.policy.fetch_start(key)
            except BaseException:
                transport.give_stage(stage)
                raise
            return await self._fetch_ended(job, key, self._fetch_staged(key, stage, reserve))
        return None

    async def _fetch_staged(
        self, key: str, stage: int, reserve: Callable[[EntryMeta], list[Extent] | None]
    ) -> EntryMeta:
        """One read-thread job moves the whole value into ``stage`` and checks its
        header there (bounds, key, dtype table, exact length, MAC): a header that lies
        never costs a reservation. Then, on the loop, the slab range is reserved and
        the payload copied into it and checksummed (a mismatch raises BadValue: the
        caller aborts the range, nothing was visible). A value larger than a stage: its
        header on the thread, then the range, then the pipelined read into it.
        ``stage`` is freed here, after every thread that may write into it returned."""
        transport: Any = self.transport
        held: int | None = stage
        try:
            fetched = await self._on_read_thread(transport.fetch_staged, key, stage)
            extents = reserve(fetched.meta)
            if extents is None:
                raise Declined(f"no room for {key[:200]!r}")
            # never a byte outside what was reserved for exactly this payload
            if sum(n for _, n in extents) != fetched.meta.nbytes:
                raise ValueError("reserved extents do not match the value's size")
            if fetched.staged:
                transport.unstage(stage, fetched, extents)
            else:
                transport.give_stage(stage)
                held = None
                await self._on_read_thread(
                    self.transport.read_into, key, fetched.meta, extents, self._slab
                )
        finally:
            if held is not None:
                transport.give_stage(held)
        return fetched.meta

    async def _on_read_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a read thread, awaited to its end even if cancelled (what it
        writes into stays reserved until then)."""
        assert self._loop is not None
        try:
            fut = self._loop.run_in_executor(self._pools["read"], fn, *args)
        except RuntimeError:  # executor shut down
            raise StoreDown([], "remote tier is shut down") from None
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return await _uncancellable(fut)

    async def _fetch_ended(self, job: Any, key: str, doing: Awaitable[EntryMeta]) -> bool:
        """Await a fetch started by ``policy.fetch_start``; the policy hears how it ended
        (promise 9) and the caller sees True, False (declined) or the tier's errors."""
        try:
            meta = await doing
        except (StoreDown, Retry, BadValue, TierMiss, Declined) as exc:
            self.policy.fetch_ended(job, exc)
            if isinstance(exc, Declined):
                return False
            if isinstance(exc, BadValue):
                raise TierCorrupt(str(exc)) from None
            if isinstance(exc, TierMiss):
                raise
            raise TierUnavailable(str(exc)) from None
        except BaseException as exc:  # cancelled, or a transport bug
            self.policy.fetch_ended(job, exc)
            if isinstance(exc, Exception):
                log.exception("remote tier: fetching %r failed", key[:200])
                raise TierUnavailable(f"{type(exc).__name__}: {exc}") from None
            raise
        if not self.policy.fetch_ended(job, meta):
            raise TierMiss(key)  # deleted or cleared meanwhile
        return True

    def write(self, key: str, meta: EntryMeta, extents: list[Extent]) -> Awaitable[None] | None:
        if self._loop is None or self._slab is None:
            return None
        waiter: asyncio.Future[None] = self._loop.create_future()
        job = self.policy.write(key, meta, extents, waiter)
        if job is None and key in self._fleet_held:  # not written: nothing to wait for
            self.unclaim_fleet([key])
        return None if job is None else waiter

    # ------------------------------------------------------------ fleet claims (dedup.py)

    @property
    def keeps_fleet_claims(self) -> bool:
        """Does the transport keep encode claims in the store (``claim_keys``)?"""
        return hasattr(self.transport, "claim_keys")

    async def claimed_fleet(self, keys: Sequence[str], budget_s: float = 0.0) -> list[bool]:
        """Per key: does another broker hold its claim in the store -- or did the value
        land there since the caller's lookup (its claim given back after the write: the
        caller looks again)? Claims nothing; an answer the store does not give in time
        (``budget_s``, the tier's timeout) or a store that is down reads False (the
        caller encodes)."""
        got = await self._on_claims_thread(
            self.transport.claimed_by_others,  # type: ignore[attr-defined]
            (self._claim_owner, list(keys)),
            budget_s,
        )
        return [False] * len(keys) if got is None else list(got)

    async def _on_claims_thread(
        self, fn: Callable[..., Any], args: tuple[Any, ...], budget_s: float
    ) -> Any | None:
        """``fn(*args)`` on a claims thread within ``budget_s`` (0: the tier's timeout);
        None when the store is down, its breaker open, it failed or did not answer in
        time (the call's result is then dropped)."""
        loop = self._loop
        pol = self.policy
        if loop is None or pol.closing or not (self.transport.ready() and pol.breakers.up):
            return None
        try:
            fut = loop.run_in_executor(self._pools["claims"], fn, *args)
        except RuntimeError:  # executor shut down
            return None
        self._inflight.add(fut)
        fut.add_done_callback(_ignore_failure(self._inflight))
        timeout = self.limits.timeout_s if budget_s <= 0 else min(budget_s, self.limits.timeout_s)
        done, _ = await asyncio.wait({fut}, timeout=max(timeout, 0.001))
        if not done or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    async def claim_fleet(
        self, keys: Sequence[str], ttl_ms: int, budget_s: float = 0.0
    ) -> list[bool | None]:
        """Claim ``keys`` in the store for this broker for ``ttl_ms``: per key True (ours),
        False (another broker's: its client waits) or None (unknown: the store is down,
        its breaker open, or it did not answer within ``budget_s`` / the tier's timeout --
        the key is encoded here, unclaimed fleet-wide). Never waits longer than that."""
        unknown: list[bool | None] = [None] * len(keys)
        loop = self._loop
        pol = self.policy
        if loop is None or pol.closing or not (self.transport.ready() and pol.breakers.up):
            self.meter.count("remote_fleet_claims_unknown", len(keys))
            return unknown
        ttl = max(ttl_ms, 1)  # bounded by the caller (claims.MAX_CLAIM_MS)
        call = self.transport.claim_keys  # type: ignore[attr-defined]
        try:
            fut = loop.run_in_executor(
                self._pools["claims"], call, self._claim_owner, list(keys), ttl
            )
        except RuntimeError:  # executor shut down
            return unknown
        self._inflight.add(fut)
        fut.add_done_callback(lambda f, keys=list(keys): self._claimed(f, keys))
        timeout = self.limits.timeout_s if budget_s <= 0 else min(budget_s, self.limits.timeout_s)
        done, _ = await asyncio.wait({fut}, timeout=max(timeout, 0.001))
        if not done or fut.cancelled() or fut.exception() is not None:
            self.meter.count("remote_fleet_claims_unknown", len(keys))
            return unknown
        won = fut.result()
        self._fleet_held.update(k for k, w in zip(keys, won, strict=True) if w)  # now, not
        # at the done callback: the caller may end (and so delete) them at once
        self.meter.count("remote_fleet_claims_won", sum(1 for w in won if w))
        self.meter.count("remote_fleet_claims_lost", sum(1 for w in won if w is False))
        self.meter.count("remote_fleet_claims_unknown", sum(1 for w in won if w is None))
        return list(won)

    def _claimed(self, fut: asyncio.Future[Any], keys: list[str]) -> None:
        """A claim call ended (in time or late): the keys it won are held (a late win
        too: deleted after the key's write-behind, or expiring by its TTL)."""
        self._inflight.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            return
        for key, won in zip(keys, fut.result(), strict=True):
            if won:
                self._fleet_held.add(key)

    def unclaim_fleet(self, keys: Sequence[str]) -> None:
        """Delete this broker's claims on ``keys`` in the store, in the background
        (a failure leaves them to their TTL). Never waits."""
        held = [k for k in keys if k in self._fleet_held]
        if not held or self._loop is None:
            return
        self._fleet_held.difference_update(held)
        call = self.transport.unclaim_keys  # type: ignore[attr-defined]
        try:
            fut = self._loop.run_in_executor(self._pools["claims"], call, self._claim_owner, held)
        except RuntimeError:
            return
        self._inflight.add(fut)
        fut.add_done_callback(_ignore_failure(self._inflight))

    def publication(self, key: str) -> bool | asyncio.Future[bool] | None:
        """Does the store hold ``key`` (``publish.py``)? True: known to be there (this
        broker's write of it ended STORED/PRESENT, or it was learned and not deleted
        since); a future: its write is in flight, resolving to whether it ended
        STORED/PRESENT without a delete or clear meanwhile; None: neither (not known,
        not being written -- it may still be there, unannounced)."""
        pol = self.policy
        job = pol.pending_writes.get(key)
        if job is not None and isinstance(job.waiter, asyncio.Future) and self._loop is not None:
            held: asyncio.Future[bool] = self._loop.create_future()

            def ended(_: object, job: WriteJob = job) -> None:
                if not held.done():
                    ok = job.outcome in (Outcome.STORED, Outcome.PRESENT) and not job.superseded
                    held.set_result(ok)

            job.waiter.add_done_callback(ended)
            return held
        if key in pol.known and key not in pol.refused and not pol._blocked(key):
            return True
        return None

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.policy.delete(keys)

    def clear(self) -> int:
        """Forget every key of this key prefix -- in the shared store too: every broker
        configured with the same ``remote_key_prefix`` loses them."""
        return self.policy.clear()

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict.fromkeys(self.counter_names, 0)
        out.update(self.meter.snapshot())
        for name, n in self.policy.counters.items():
            out[name] = out.get(name, 0) + n
        pol = self.policy
        out["remote_up"] = int(self.transport.ready() and pol.breakers.up)
        out["remote_known_keys"] = len(pol.known)
        out["remote_pending_writes"] = len(pol.pending_writes)
        out["remote_pending_bytes"] = pol.pending_bytes
        out["remote_lookups_running"] = len(pol.lookups_running)
        return out

    @classmethod
    def empty_stats(cls) -> dict[str, int | float]:
        return dict.fromkeys((*cls.counter_names, *cls.gauge_names), 0)
