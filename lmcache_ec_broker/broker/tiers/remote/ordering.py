"""Write-behind, deletes and clears of the remote policy (rules 1, 2, 4 and 8 of
``policy.py``): the queue of jobs in arrival order, the writes' budget, how
each write ends, and the follow-up delete of a key whose failed write may still land.
A mixin of ``RemotePolicy``: it works on the policy's own state, declared below.

Invariants:
- A queue job starts only when no earlier job on one of its keys is queued or running
  (``pump``); a clear starts only when it is first and nothing runs, and nothing after
  it passes it. A retried delete or clear (``finished``) and a follow-up delete go
  back to the head of the queue, before any later job of their keys.
- A delete cancels a queued write of its key (``superseded``: a running one that ends
  STORED does not teach the key); a clear does so for every key and marks every live
  job. ``deleting`` counts a key's pending deletes until each has ended
  (``_delete_ended``); ``clearing`` counts the pending clears.
- Every accepted write is in ``pending_writes`` and counts in ``pending_bytes`` until
  ``_end_write`` records its one outcome; writes beyond ``write_queue`` entries or
  ``max_pending_bytes`` are dropped at once (counted), never waited for.
- A write that FAILED after its bytes may have left keeps its key in ``uncertain``
  for ``LATE_WRITE_TIMEOUTS`` x ``timeout_s``, whatever later writes of the key do
  (a STORED one does not stop it landing); a delete or clear that ends meanwhile
  runs once more for that key when it can no longer land (``_follow_up``), and the
  key's ``deleting`` count stays up (lookups miss it) until then.
- ``own_stored`` is told once per write that ended STORED, ``own_deleted`` once per
  ended delete of a key, in the order the store saw them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ....protocol import Extent
from ..base import EntryMeta
from .jobs import ClearJob, DeleteJob, Job, LookupJob, ScanJob, WriteBatch, WriteJob
from .part import PolicyPart
from .transport import Outcome

if TYPE_CHECKING:
    from .circuit import Breakers
    from .jobs import Limits, QueueJob, Runner
    from .transport import Node

GONE_CAP = 65536
# A write that failed after its bytes may have left (a timeout, a lost connection) can
# still land that long after (x remote_timeout_s): a delete of its key runs once more then.
LATE_WRITE_TIMEOUTS = 4.0


class OwnWrites(Protocol):
    """Hears what this broker itself did to the shared store (promise 8)."""

    def own_stored(self, key: str, nbytes: int) -> None: ...
    def own_deleted(self, key: str) -> None: ...
    def own_cleared(self) -> None: ...


class WriteOrdering(PolicyPart):
    """Mixed into RemotePolicy: the state it uses is the policy's (declared below);
    the policy's methods it calls are ``PolicyPart``'s."""

    limits: Limits
    ready: Callable[[], bool]
    runner: Runner
    own: OwnWrites | None
    node_of: Callable[[str], Node]
    clock: Callable[[], float]
    counters: collections.Counter[str]
    breakers: Breakers
    closing: bool
    queue: list[QueueJob]
    running: set[Job]
    pending_writes: dict[str, WriteJob]
    pending_bytes: int
    deleting: collections.Counter[str]
    clearing: int
    gone: collections.OrderedDict[str, None]
    refused: collections.OrderedDict[str, float]
    uncertain: collections.OrderedDict[str, float]
    live: set[LookupJob | ScanJob | WriteJob]
    known: collections.OrderedDict[str, int]
    _timer_at: float


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
            # Kept until it expires or a follow-up delete takes it -- not dropped when a
            # later write of the key is STORED: the failed one may still land after that,
            # and after a delete or clear that follows (it would bring the key back).
            now = self.clock()
            self.uncertain[job.key] = now + LATE_WRITE_TIMEOUTS * self.limits.timeout_s
            self.uncertain.move_to_end(job.key)
            while self.uncertain and (
                len(self.uncertain) > GONE_CAP or next(iter(self.uncertain.values())) <= now
            ):  # oldest first: the same delay each, so expired ones lead
                self.uncertain.popitem(last=False)
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
            self._echo_sent([w.key for w in job.writes])  # discovery.py: own echoes
        self.running.add(job)
        self.runner.dispatch(job)
        return True

    def _follow_up(self, keys: list[str]) -> None:
        """Delete ``keys`` once more when their failed writes can no longer land
        (their ``deleting`` count stays up until then: lookups keep missing)."""
        if not keys:
            return
        until = max(self.uncertain.pop(k) for k in keys)
        job = DeleteJob(self._next_id(), keys, 0, until, follow_up=True)
        self.queue.insert(0, job)  # before any later job of these keys
