"""The remote tier's policy: one set of rules for every store (Redis/Valkey, Mooncake).

The transport (``remote_transport.py``) moves bytes; this module decides what is
written, in which order, what is known, what is refused and when the store is
left alone. It is plain single-threaded state, driven by the event loop (the
runtime, ``remote_tier.py``) or by a test: it *asks* for I/O through
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
   ``remote_discovery.py``, "Own echoes").
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
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ...protocol import Extent
from .base import EntryMeta, TierMiss, TierUnavailable
from .circuit import Breakers, State
from .remote_discovery import KeyDiscovery
from .remote_jobs import (
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
from .remote_transport import Declined, Node, Outcome, Retry, StoreDown
from .remote_value import BadValue

log = logging.getLogger("lmcache_ec_broker.remote")

MAX_DELETE_TRIES = 6
REFUSED_CAP = 65536
GONE_CAP = 65536
# A write that failed after its bytes may have left (a timeout, a lost connection) can
# still land that long after (x remote_timeout_s): a delete of its key runs once more then.
LATE_WRITE_TIMEOUTS = 4.0
REFUSED_TTL_S = 60.0


class OwnWrites(Protocol):
    """Hears what this broker itself did to the shared store (promise 8)."""

    def own_stored(self, key: str, nbytes: int) -> None: ...
    def own_deleted(self, key: str) -> None: ...
    def own_cleared(self) -> None: ...


# ---------------------------------------------------------------- the policy


class RemotePolicy(KeyDiscovery):
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

    def _breaker_changed(self, node: object, state: State) -> None:
        if state is State.OPEN:
            self.counters["remote_circuit_opens"] += 1
            if node not in self._said_down:  # once per outage, not at every failed probe
                self._said_down.add(node)
                log.warning("remote tier: store node %s is unavailable; serving local tiers", node)
        elif state is State.CLOSED:
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

    # ------------------------------------------------------------ write-behind

    def write(
        self, key: str, meta: EntryMeta, extents: list[Extent], waiter: Any = None
    ) -> WriteJob | None:
        """Accept a write-behind (None: skipped or dropped, counted)."""
        if self.closing or meta.nbytes > self.limits.max_entry_bytes:
            return None
        if key in self.pending_writes or (key in self.known and key not in self.refused):
            self.counters["remote_writes_skipped"] += 1
            return None
        full = len(self.pending_writes) >= self.limits.write_queue or (
            self.pending_writes and self.pending_bytes + meta.nbytes > self.limits.max_pending_bytes
        )
        if full or not self.ready() or self.breakers[self.node_of(key)].refusing():
            self.counters["remote_write_drops"] += 1
            return None
        job = WriteJob(
            self._next_id(), key, meta, list(extents), overwrite=key in self.refused, waiter=waiter
        )
        self.gone.pop(key, None)  # written after its delete: servable again once stored
        self.pending_writes[key] = job
        self.pending_bytes += meta.nbytes
        self.live.add(job)
        self.queue.append(job)
        self.pump()
        return job

    def _end_write(self, job: WriteJob, outcome: Outcome, sent: bool = True) -> None:
        assert job.outcome is None, "a write outcome is recorded exactly once"
        job.outcome = outcome
        self.counters[
            {
                Outcome.STORED: "remote_writes",
                Outcome.PRESENT: "remote_writes_skipped",
                Outcome.FAILED: "remote_write_errors",
                Outcome.REJECTED: "remote_write_errors",
                Outcome.CANCELLED: "remote_writes_cancelled",
                Outcome.ABANDONED: "remote_write_drops",
            }[outcome]
        ] += 1
        if self.pending_writes.get(job.key) is job:
            del self.pending_writes[job.key]
        self.pending_bytes -= job.meta.nbytes
        self.live.discard(job)
        if outcome is Outcome.FAILED and sent:  # its bytes may still be on the wire
            self.uncertain[job.key] = self.clock() + LATE_WRITE_TIMEOUTS * self.limits.timeout_s
            self.uncertain.move_to_end(job.key)
            while len(self.uncertain) > GONE_CAP:
                self.uncertain.popitem(last=False)
        elif outcome is Outcome.STORED:
            self.uncertain.pop(job.key, None)
        if outcome in (Outcome.STORED, Outcome.PRESENT) and not job.superseded:
            if outcome is Outcome.STORED:
                self.refused.pop(job.key, None)
            if job.key not in self.refused and not self._blocked(job.key):
                self._learn(job.key)
        if outcome is Outcome.STORED and self.own is not None:
            self.own.own_stored(job.key, job.meta.nbytes)
        self.runner.write_ended(job)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Forget ``keys`` now; their deletes run after any earlier write of them."""
        out = []
        keys = list(dict.fromkeys(keys))
        for key in keys:
            held = self._forget(key)
            job = self.pending_writes.get(key)
            if job is not None:
                held = True
                job.superseded = True
                if job in self.queue:
                    self.queue.remove(job)
                    self._end_write(job, Outcome.CANCELLED)
            for live in self.live:
                if isinstance(live, LookupJob | ScanJob):
                    live.gone.add(key)
            self.deleting[key] += 1
            out.append(held)
        if keys and not self.closing:
            self.queue.append(DeleteJob(self._next_id(), keys))
            self.pump()
        elif keys:
            for key in keys:
                self._delete_ended(key, gave_up=True)
        return out

    def clear(self) -> int:
        """Forget every key; remove the namespace from the store after every
        earlier job (queued writes are cancelled)."""
        n = len(self.known)
        for job in [j for j in self.queue if isinstance(j, WriteJob)]:
            self.queue.remove(job)
            job.superseded = True
            self._end_write(job, Outcome.CANCELLED)
        for live in self.live:
            if isinstance(live, WriteJob):
                live.superseded = True
            else:
                live.cleared = True
        for key in list(self.known):
            self._forget(key)
        if not self.closing:
            self.clearing += 1
            self.queue.append(ClearJob(self._next_id()))
            self.pump()
        return n

    def _delete_ended(self, key: str, gave_up: bool) -> None:
        self.deleting[key] -= 1
        if self.deleting[key] <= 0:
            del self.deleting[key]
        if gave_up and key not in self.pending_writes:
            # The old value may still be there: never serve it until written again.
            self.gone[key] = None
            while len(self.gone) > GONE_CAP:
                self.gone.popitem(last=False)
        if self.own is not None:
            self.own.own_deleted(key)

    def pump(self) -> None:
        """Start every queue job that may start now (ordering rule 1)."""
        now = self.clock()
        busy: set[str] = set()
        queue_jobs = [j for j in self.running if isinstance(j, WriteBatch | DeleteJob | ClearJob)]
        slots = self.limits.write_workers - len(queue_jobs)
        for job in self.running:
            if isinstance(job, WriteBatch):
                busy.update(w.key for w in job.writes)
            elif isinstance(job, DeleteJob):
                busy.update(job.keys)
        clear_running = any(isinstance(j, ClearJob) for j in self.running)
        wake = 0.0
        ended = False  # a job ended without I/O: the keys it held are free again
        i = 0
        while i < len(self.queue) and slots > 0 and not clear_running:
            job = self.queue[i]
            if isinstance(job, ClearJob):
                if i == 0 and not queue_jobs and job.not_before <= now:
                    self.queue.pop(0)
                    self._start(job)
                elif job.not_before > now:
                    wake = job.not_before
                break  # nothing passes a clear
            keys = [job.key] if isinstance(job, WriteJob) else job.keys
            if isinstance(job, DeleteJob) and job.not_before > now:
                wake = min(wake or job.not_before, job.not_before)
                busy.update(keys)
                i += 1
                continue
            if any(k in busy for k in keys):
                busy.update(keys)
                i += 1
                continue
            self.queue.pop(i)
            busy.update(keys)
            if isinstance(job, DeleteJob):
                self._start(job)
            else:
                batch = [job]
                nbytes = job.meta.nbytes
                j = i
                while (
                    j < len(self.queue)
                    and len(batch) < self.limits.write_batch
                    and nbytes < self.limits.write_batch_bytes
                ):
                    nxt = self.queue[j]
                    if not isinstance(nxt, WriteJob):
                        break
                    if nxt.key in busy:
                        break
                    self.queue.pop(j)
                    busy.add(nxt.key)
                    batch.append(nxt)
                    nbytes += nxt.meta.nbytes
                if not self._start(WriteBatch(self._next_id(), batch)):
                    ended = True
                    continue  # the slot is still free
            slots -= 1
        if wake and wake != self._timer_at:
            self._timer_at = wake
            self.runner.later(max(wake - now, 0.0) + 0.001, self._woken)
        if ended:
            self.pump()

    def _woken(self) -> None:
        # A loop timer may fire a hair early: forget it, so that pump sets another.
        self._timer_at = 0.0
        self.pump()

    def _start(self, job: Job) -> bool:
        """Dispatch ``job``; False if nothing was left to run."""
        if isinstance(job, WriteBatch):
            # a write whose node is known down ends now, without I/O
            down = [w for w in job.writes if self.breakers[self.node_of(w.key)].refusing()]
            for w in down:
                self._end_write(w, Outcome.FAILED, sent=False)
            job.writes = [w for w in job.writes if w not in down]
            if not job.writes:
                return False
            self._echo_sent([w.key for w in job.writes])  # remote_discovery.py: own echoes
        self.running.add(job)
        self.runner.dispatch(job)
        return True

    # ------------------------------------------------------------ lookups

    def lookup(self, keys: Sequence[str]) -> list[EntryMeta | None] | LookupJob:
        """Answer now (a list) or admit a lookup job that ``answered`` will end by
        its deadline. Raises TierUnavailable when shed or every node is down."""
        if self.closing:
            raise TierUnavailable("remote tier is shutting down")
        keys = list(keys)
        now = self.clock()
        ask = [
            k
            for k in dict.fromkeys(keys)
            if not self._blocked(k)
            and (not self.complete or k in self.known)
            and self.refused.get(k, 0.0) <= now
        ]
        if ask:
            up = [k for k in ask if not self.breakers[self.node_of(k)].refusing()]
            if not up:
                raise TierUnavailable("remote store unavailable (circuit open)")
            ask = up
        if not ask:
            self.counters["remote_misses"] += len(keys)
            return [None] * len(keys)
        if len(self.lookups_running) >= self.limits.lookup_concurrency and (
            len(self.lookups_waiting) >= self.limits.lookup_backlog
        ):
            self.counters["remote_lookups_shed"] += 1
            raise TierUnavailable("remote lookups are backed up: answered as a miss")
        job = LookupJob(self._next_id(), ask, keys, deadline=self.clock() + self.limits.timeout_s)
        self.live.add(job)
        self.lookups_waiting.append(job)
        self.runner.later(self.limits.timeout_s, self.expire_lookups)
        self._start_lookups()
        return job

    def _start_lookups(self) -> None:
        now = self.clock()
        while self.lookups_waiting and len(self.lookups_running) < self.limits.lookup_concurrency:
            job = self.lookups_waiting.popleft()
            if job.deadline <= now:
                self._answer(job, TierUnavailable("remote lookup could not start in time"))
                self.counters["remote_lookup_timeouts"] += 1
                continue
            nodes = {self.node_of(k) for k in job.keys}
            refused = {n for n in nodes if not self.breakers[n].allow()}
            if refused:
                job.keys = [k for k in job.keys if self.node_of(k) not in refused]
            if not job.keys:
                self._answer(job, TierUnavailable("remote store unavailable (circuit open)"))
                continue
            job.started = True
            self.lookups_running.add(job)
            self.runner.dispatch(job)

    def expire_lookups(self) -> None:
        """Answer every lookup past its deadline (timer; rule 5)."""
        # a loop timer may fire a hair before the deadline by this clock: 1 ms of slack
        now = self.clock() + 0.001
        for job in [j for j in self.lookups_waiting if j.deadline <= now]:
            self.lookups_waiting.remove(job)  # never runs
            self.counters["remote_lookup_timeouts"] += 1
            self._answer(job, TierUnavailable("remote lookup could not start in time"))
        for job in [j for j in self.lookups_running if not j.expired and j.deadline <= now]:
            job.expired = True  # its slot stays taken until its thread returns
            self.counters["remote_lookup_timeouts"] += 1
            self._fail(sorted({self.node_of(k) for k in job.keys}, key=str))
            self._answer(
                job, TierUnavailable(f"remote lookup took longer than {self.limits.timeout_s}s")
            )
        left = [
            j.deadline
            for j in (*self.lookups_waiting, *self.lookups_running)
            if j.answer is None and j.deadline - now < 0.05
        ]
        if left:  # a timer that fired early: look again at the deadline
            self.runner.later(max(min(left) - self.clock(), 0.001), self.expire_lookups)

    def _answer(self, job: LookupJob, answer: list[EntryMeta | None] | Exception) -> None:
        self.live.discard(job)
        if isinstance(answer, list):
            got = dict(zip(job.keys, answer, strict=True))
            answer = [got.get(k) for k in job.asked]
            hits = sum(m is not None for m in answer)
            self.counters["remote_hits"] += hits
            self.counters["remote_misses"] += len(answer) - hits
        job.answer = answer
        self.runner.answered(job)

    def _lookup_finished(self, job: LookupJob, result: Any) -> None:
        self.lookups_running.discard(job)
        nodes = sorted({self.node_of(k) for k in job.keys}, key=str)
        if job.expired:  # answered at its deadline; the late result is not used
            self._start_lookups()
            return
        if isinstance(result, Exception):  # StoreDown, or Retry (busy: not the store's fault)
            if isinstance(result, StoreDown):
                self._fail(result.nodes or nodes)
            self._answer(job, TierUnavailable(str(result)))
            self._start_lookups()
            return
        self._ok(nodes)
        metas: list[EntryMeta | None] = []
        for key, res in zip(job.keys, result, strict=True):
            if isinstance(res, BadValue):
                self.refuse(key, res)
                metas.append(None)
            elif isinstance(res, EntryMeta) and not (
                job.cleared or key in job.gone or self._blocked(key)
            ):
                self.refused.pop(key, None)
                self._learn(key)  # before the coordinator can answer a hit for it
                metas.append(res)
            else:
                if res is None:
                    self._forget(key)
                metas.append(None)
        self._answer(job, metas)
        self._start_lookups()

    # ------------------------------------------------------------ promotion

    def read_start(self, key: str) -> None:
        """May a promotion read ``key`` now? Raises TierMiss / TierUnavailable."""
        if self.closing:
            raise TierUnavailable("remote tier is shutting down")
        if self._blocked(key):
            raise TierMiss(key)
        if not self.breakers[self.node_of(key)].allow():
            raise TierUnavailable("remote store unavailable (circuit open)")

    def read_ended(self, key: str, exc: BaseException | None) -> None:
        node = self.node_of(key)
        if isinstance(exc, StoreDown):
            self.counters["remote_read_errors"] += 1
            self._fail(exc.nodes or [node])
            return
        self._ok([node])
        if isinstance(exc, BadValue):
            self.refuse(key, exc)
        elif isinstance(exc, TierMiss):
            self._forget(key)

    # ------------------------------------------------------------ fetch: lookup + read

    def fetch_start(self, key: str) -> LookupJob:
        """May a get read ``key`` straight away, its lookup and read one store round trip
        (the value's header says what it is)? The admission of a one-key lookup and of a
        read: raises TierMiss (a delete or clear is pending, the key is refused, or a
        complete filter lacks it) or TierUnavailable (circuit open, shutting down).
        ``fetch_ended`` must follow, whatever happens."""
        if self.closing:
            raise TierUnavailable("remote tier is shutting down")
        now = self.clock()
        if (
            self._blocked(key)
            or (self.complete and key not in self.known)
            or self.refused.get(key, 0.0) > now
        ):
            self.counters["remote_misses"] += 1
            raise TierMiss(key)
        if not self.breakers[self.node_of(key)].allow():
            raise TierUnavailable("remote store unavailable (circuit open)")
        job = LookupJob(self._next_id(), [key], [key], deadline=now + self.limits.timeout_s)
        job.started = True
        self.live.add(job)  # a delete or clear meanwhile marks it (rule 1)
        return job

    def fetch_ended(self, job: LookupJob, result: EntryMeta | BaseException | None) -> bool:
        """How a fetch ended: the meta of the valid value now in the caller's reserved
        range, or why not (StoreDown, BadValue, TierMiss/None: absent, Declined: the
        caller took nothing after the header, anything else: no verdict). True: it may
        be served -- never a value whose key was deleted or cleared meanwhile."""
        self.live.discard(job)
        key = job.keys[0]
        node = self.node_of(key)
        if isinstance(result, StoreDown):
            self.counters["remote_read_errors"] += 1
            self._fail(result.nodes or [node])
            return False
        if isinstance(result, Declined):
            self._ok([node])  # the store answered; the caller had no room for it
            return False
        if isinstance(result, BaseException) and not isinstance(result, BadValue | TierMiss):
            self.breakers[node].release()  # no verdict (cancelled, Retry)
            return False
        self._ok([node])
        if isinstance(result, BadValue):
            self.refuse(key, result)
            self.counters["remote_misses"] += 1
            return False
        if not isinstance(result, EntryMeta):  # absent
            self._forget(key)
            self.counters["remote_misses"] += 1
            return False
        if job.cleared or key in job.gone or self._blocked(key):
            self.counters["remote_misses"] += 1
            return False
        self.refused.pop(key, None)
        self._learn(key)
        self.counters["remote_hits"] += 1
        return True

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

    def _follow_up(self, keys: list[str]) -> None:
        """Delete ``keys`` once more when their failed writes can no longer land
        (their ``deleting`` count stays up until then: lookups keep missing)."""
        if not keys:
            return
        until = max(self.uncertain.pop(k) for k in keys)
        job = DeleteJob(self._next_id(), keys, 0, until, follow_up=True)
        self.queue.insert(0, job)  # before any later job of these keys

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
