"""The remote tier's policy: one set of rules for every store (Redis/Valkey, Mooncake).

The transport (``transport.py``) moves bytes; this module decides what is
written, in which order, what is known, what is refused and when the store is
left alone. It is plain single-threaded state, driven by the event loop (the
runtime, ``tier.py``) or by a test: it *asks* for I/O through
``Runner.dispatch`` and hears back through ``finished``; time comes from ``clock``.

The promises (``tests/test_remote_policy_machine.py`` checks each of them):

1. Ordering. Writes, deletes and clears run in arrival order per key: a job starts
   only when no earlier job on one of its keys is queued or running, and a clear
   only when it is first and nothing runs (nothing after it passes it). A delete
   cancels a queued write of its key and waits for a running one; so does a clear
   for every key. A deleted key is never served again unless written after the
   delete: lookups answer a miss for it while its delete is pending (and, after a
   delete that failed for good, until the next write of it).
2. Outcomes. Each accepted write ends exactly once: STORED, PRESENT, FAILED,
   CANCELLED or ABANDONED, one counter each. Only STORED or PRESENT (a valid value
   was there) makes the key known -- and not if a delete or clear came meanwhile.
3. Refused values. A value that fails validation is never served; its key is
   remembered as refused and the next write of it overwrites whatever is stored.
   Lookups do not ask the store for a refused key for ``REFUSED_TTL_S`` -- unless
   another broker announces a new value of it (or this one stored it).
4. Budget. Writes queued or running hold at most ``max_pending_bytes`` (one entry
   larger than the budget is accepted only into an empty queue) and at most
   ``write_queue`` entries; beyond that they are dropped (counted), never waited for.
5. Lookups. At most ``lookup_concurrency`` run and ``lookup_backlog`` wait; more are
   shed at once (a miss). Every lookup is answered by its deadline
   (``timeout_s``); one that had not started by then is dropped and never runs;
   one that had is abandoned (its slot stays taken until its thread returns, so a
   slow store cannot pile up work) and counts as a failure of its nodes' breakers.
6. Breakers. One per node: failures and timeouts open it, a probe lets one call
   through after the backoff and a success closes it (then the keys are listed
   again: the store may have restarted empty).
7. Key discovery. Rescans are coalesced (one at a time; requests meanwhile make one
   more) and their results, like announcements, are folded into the filter in
   slices of ``fold_slice`` keys per loop turn. This broker's own announcements,
   heard back, are never learned (a delete may have ended before they arrive;
   ``discovery.py``, "Own echoes"). A key leaves the filter without
   ``partial`` set only when the policy saw it gone (a miss, a refused value, a
   listing without it, its own delete or clear); one forgotten for room sets
   ``partial`` first, and only a listing that fit under ``filter_cap`` clears it:
   while it is set, clients ask the broker rather than trust a filter miss.
8. Own writes (``own``, the residency events): ``own_stored`` once per write that
   ended STORED (this broker wrote the value; never for PRESENT, which another
   broker wrote), ``own_deleted`` when a delete of the key ends (done, or given up:
   the key is not served again until written again) and ``own_cleared`` when a clear
   ends -- each in the order the store saw them (rule 1), never for keys learned
   from announcements, scans or lookups. (Checked by ``tests/test_events.py``
   with real brokers and a real store, not by the machine.)
9. Fetches (a get's lookup and read in one store round trip, ``fetch_start`` /
   ``fetch_ended``) obey rules 1-3 and 6 as a lookup followed by a read does: a
   fetch of a key deleted or cleared before it ended is not served, a refused value
   is remembered, a store failure feeds the breaker.

``RemotePolicy`` is one object in parts (mixins over its state, each keeping its
rules' invariants, listed at its top): ``ordering.py`` the write-behind,
deletes and clears (rules 1, 2, 4, 8), ``lookups.py`` the lookups, promotion
reads and fetches (rules 5, 9), ``discovery.py`` the key discovery (rule 7); what
they call on the policy is declared once, abstract, in ``part.py``.
This module holds the state, the breakers (rule 6), the filter and refusals (rule 3),
the probes, the dispatch of finished jobs (``finished``) and shutdown.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..base import TierUnavailable
from .circuit import Breakers, BreakerState
from .discovery import KeyDiscovery
from .jobs import (
    ClearJob,
    DeleteJob,
    Job,
    Limits,
    LookupJob,
    ProbeJob,
    QueueJob,
    Runner,
    ScanJob,
    WriteBatch,
    WriteJob,
)
from .lookups import Lookups
from .ordering import (  # the constants re-exported: tests import them from here
    GONE_CAP,  # noqa: F401
    LATE_WRITE_TIMEOUTS,  # noqa: F401
    OwnWrites,
    WriteOrdering,
)
from .transport import Node, Outcome, Retry, StoreDown

log = logging.getLogger("lmcache_ec_broker.remote")

MAX_DELETE_TRIES = 6
REFUSED_CAP = 65536
REFUSED_TTL_S = 60.0


# ---------------------------------------------------------------- the policy


class RemotePolicy(WriteOrdering, Lookups, KeyDiscovery):
    """Loop-thread state of one remote tier (see the module docstring)."""

    def __init__(
        self,
        limits: Limits,
        runner: Runner,
        node_of: Callable[[str], Node],
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self.limits = limits
        self.ready = ready  # False: no client yet (Mooncake connecting): writes are dropped
        self.runner = runner
        self.own: OwnWrites | None = None  # promise 8; set by the runtime
        self.node_of = node_of
        self.clock = clock
        self.counters: collections.Counter[str] = collections.Counter()
        self.breakers = Breakers(
            limits.breaker_threshold,
            limits.breaker_backoff_s,
            limits.breaker_max_backoff_s,
            clock,
            self._breaker_changed,
        )
        self._ids = 0
        self.closing = False
        # write-behind, deletes, clears: arrival order; running ones apart
        self.queue: list[QueueJob] = []
        self.running: set[Job] = set()
        self.pending_writes: dict[str, WriteJob] = {}  # key -> its queued or running write
        self.pending_bytes = 0
        self.deleting: collections.Counter[str] = collections.Counter()  # pending deletes
        self.clearing = 0
        self.gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        # refused key -> until when lookups do not ask for it
        self.refused: collections.OrderedDict[str, float] = collections.OrderedDict()
        # key -> until when a failed write of it may still land in the store
        self.uncertain: collections.OrderedDict[str, float] = collections.OrderedDict()
        # jobs whose result may teach keys: a delete/clear meanwhile must reach them
        self.live: set[LookupJob | ScanJob | WriteJob] = set()
        # lookups
        self.lookups_running: set[LookupJob] = set()
        self.lookups_waiting: collections.deque[LookupJob] = collections.deque()
        # keys known to be in the store -> sequence number of when learned
        self.known: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._seq = 0
        self.complete = limits.announces and limits.filter_cap > 0
        # The filter lacks keys the store may hold (none folded, no listing, or the
        # oldest forgotten past filter_cap): its absences must not be trusted.
        # Set before such a key leaves the filter; cleared by a whole listing that fit.
        self.partial = limits.filter_cap <= 0 or not limits.discovers
        self.echoes: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._scan: ScanJob | None = None
        self._scan_again = False
        self._fold: Iterator[None] | None = None
        self._probing: set[Node] = set()
        self._said_down: set[Node] = set()  # nodes whose outage was logged
        self._timer_at = 0.0

    # ------------------------------------------------------------ helpers

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _breaker_changed(self, node: object, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            self.counters["remote_circuit_opens"] += 1
            if node not in self._said_down:  # once per outage, not at every failed probe
                self._said_down.add(node)
                log.warning("remote tier: store node %s is unavailable; serving local tiers", node)
        elif state is BreakerState.CLOSED:
            self._said_down.discard(node)
            log.info("remote tier: store node %s is reachable again", node)
            self.want_scan()  # it may have restarted empty: re-learn what it holds

    def _fail(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            self.breakers[node].failure()

    def _ok(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            cb = self.breakers[node]
            if not cb.up or cb.failures:
                cb.success()

    def _learn(self, key: str) -> bool:
        """Fold ``key`` into the filter; True if it was new."""
        if self.limits.filter_cap <= 0:
            return False
        self._seq += 1
        if key in self.known:
            self.known.move_to_end(key)
            self.known[key] = self._seq
            return False
        if len(self.known) >= self.limits.filter_cap:
            old, _ = self.known.popitem(last=False)
            self.partial = True  # before it leaves the filter: it may still be stored
            self.runner.removed(old)
            self.complete = False  # forgotten keys may still be in the store: ask for all
        self.runner.added(key)
        self.known[key] = self._seq
        return True

    def _forget(self, key: str) -> bool:
        if key in self.known:
            del self.known[key]
            self.runner.removed(key)
            return True
        return False

    def _blocked(self, key: str) -> bool:
        """A lookup must miss ``key`` without asking: a delete of it is pending or
        failed for good, or a clear is pending."""
        return self.clearing > 0 or key in self.deleting or key in self.gone

    def refuse(self, key: str, why: object) -> None:
        self.counters["remote_refused_values"] += 1
        self.refused[key] = self.clock() + REFUSED_TTL_S
        self.refused.move_to_end(key)
        while len(self.refused) > REFUSED_CAP:
            self.refused.popitem(last=False)
        self._forget(key)
        log.debug("remote tier: refusing the value of %r: %s", key[:200], why)

    # ------------------------------------------------------------ probes

    def maintain(self) -> None:
        """Periodic: probe every node whose breaker lets a probe through (rule 6)."""
        if self.closing:
            return
        for node, cb in self.breakers.items():
            if not cb.up and node not in self._probing and cb.allow():
                self._probing.add(node)
                job = ProbeJob(self._next_id(), node)
                self.running.add(job)
                self.runner.dispatch(job)

    def health(self, node: Node, ok: bool) -> None:
        """The transport saw ``node`` answer (or not) outside any job (a subscriber)."""
        if ok:
            self._ok([node])
        else:
            self._fail([node])

    # ------------------------------------------------------------ results

    def finished(self, job: Job, result: Any) -> None:
        """A dispatched job returned (loop thread): ``result`` as ``execute`` gave it."""
        self.running.discard(job)
        if isinstance(job, LookupJob):
            self._lookup_finished(job, result)
            return
        if isinstance(job, ScanJob):
            self._scan_finished(job, result)
            return
        if isinstance(job, ProbeJob):
            self._probing.discard(job.node)
            if isinstance(result, StoreDown):
                self._fail([job.node])
            elif result is None:
                self._ok([job.node])
            else:  # Retry (no client yet): no verdict; a later probe decides
                self.breakers[job.node].release()
            return
        if isinstance(job, WriteBatch):
            nodes = sorted({self.node_of(w.key) for w in job.writes}, key=str)
            if isinstance(result, StoreDown | Retry):
                if isinstance(result, StoreDown):
                    self._fail(result.nodes or nodes)
                for w in job.writes:  # Retry: not attempted (no client yet, busy)
                    self._echo_settled(w.key, stored=False)
                    self._end_write(w, Outcome.FAILED, sent=isinstance(result, StoreDown))
                log.debug("remote tier: write-behind failed: %s", result)
            else:
                failed = {self.node_of(w.key) for w, o in zip(job.writes, result, strict=True)
                          if o is Outcome.FAILED}  # fmt: skip
                self._fail(sorted(failed, key=str))
                self._ok([n for n in nodes if n not in failed])
                for w, outcome in zip(job.writes, result, strict=True):
                    self._echo_settled(w.key, stored=outcome is Outcome.STORED)
                    self._end_write(w, outcome)
        elif isinstance(job, DeleteJob):
            again: list[str] = []
            wait = 0.0
            now = self.clock()
            late = [k for k in job.keys if self.uncertain.get(k, 0.0) > now]
            for key in job.keys:
                res = result.get(key) if isinstance(result, dict) else result
                if res is None:
                    if key not in late:
                        self._delete_ended(key, gave_up=False)
                    continue
                if isinstance(res, StoreDown):
                    self._fail(res.nodes or [self.node_of(key)])
                if job.tries + 1 >= MAX_DELETE_TRIES or self.closing:
                    log.warning("remote tier: deleting %r failed for good: %s", key[:200], res)
                    self._delete_ended(key, gave_up=True)
                    late = [k for k in late if k != key]
                    continue
                if isinstance(res, Retry):  # e.g. a Mooncake reader's lease (counted there)
                    wait = max(wait, res.after_s)
                else:
                    wait = max(wait, self.limits.breaker_backoff_s * 2**job.tries)
                again.append(key)
            if again:
                retry = DeleteJob(
                    self._next_id(), again, job.tries + 1, self.clock() + max(wait, 0.05)
                )
                self.queue.insert(0, retry)  # before any later job of these keys
            self._follow_up([k for k in late if k not in again])
        elif isinstance(job, ClearJob):
            if isinstance(result, StoreDown | Retry) and not self.closing:
                if isinstance(result, StoreDown):
                    self._fail(result.nodes)
                if job.tries + 1 < MAX_DELETE_TRIES:
                    job.tries += 1
                    job.not_before = self.clock() + self.limits.breaker_backoff_s * 2**job.tries
                    self.queue.insert(0, job)
                    self.pump()
                    return
                log.warning("remote tier: clearing the namespace failed: %s", result)
            self.clearing -= 1
            if self.own is not None:
                self.own.own_cleared()
            now = self.clock()
            late = [k for k, until in self.uncertain.items() if until > now]
            for key in late:
                self.deleting[key] += 1
            self._follow_up(late)
        self.pump()

    # ------------------------------------------------------------ shutdown

    def abandon(self) -> None:
        """Shutdown: end every queued write without running it; lookups miss."""
        self.closing = True
        for job in [j for j in self.queue if isinstance(j, WriteJob)]:
            self.queue.remove(job)
            self._end_write(job, Outcome.ABANDONED)
        while self.lookups_waiting:
            self._answer(self.lookups_waiting.popleft(), TierUnavailable("shutting down"))

    @property
    def idle(self) -> bool:
        """Nothing queued or running (writes, deletes, clears)."""
        return not self.queue and not any(
            isinstance(j, WriteBatch | DeleteJob | ClearJob) for j in self.running
        )
