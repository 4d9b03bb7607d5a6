"""Lookups, promotion reads and fetches of the remote policy (rules 5 and 9 of
``policy.py``, and the lookup side of rules 1, 3 and 6). A mixin of
``RemotePolicy``: it works on the policy's own state, declared below.

Invariants:
- At most ``lookup_concurrency`` lookups run and ``lookup_backlog`` wait; a lookup
  beyond that is shed at once (TierUnavailable: a miss).
- Every admitted lookup is answered exactly once (``_answer``), by its deadline
  (``expire_lookups``): one that had not started is dropped and never runs; one that
  had keeps its slot until its thread returns and counts as a failure of its nodes.
- A key whose delete or clear is pending (or whose delete failed for good), or that
  was deleted or cleared while its lookup or fetch was live, is answered a miss and
  never learned; a refused key is not asked for until its refusal ends (its TTL, or an
  announcement or store of it), and a bad value found is refused, never served.
- A store failure (StoreDown) of a lookup, read or fetch, and a lookup past its
  deadline, count against its nodes' breakers; a store answer counts for them; a
  fetch that ended without a verdict releases its breaker's probe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..base import EntryMeta, TierMiss, TierUnavailable
from .jobs import LookupJob, ScanJob, WriteJob
from .part import PolicyPart
from .transport import Declined, StoreDown
from .value import BadValue

if TYPE_CHECKING:
    from .circuit import Breakers
    from .jobs import Limits, Runner
    from .transport import Node


class Lookups(PolicyPart):
    """Mixed into RemotePolicy: the state it uses is the policy's (declared below);
    the policy's methods it calls are ``PolicyPart``'s."""

    limits: Limits
    runner: Runner
    node_of: Callable[[str], Node]
    clock: Callable[[], float]
    counters: collections.Counter[str]
    breakers: Breakers
    closing: bool
    refused: collections.OrderedDict[str, float]
    live: set[LookupJob | ScanJob | WriteJob]
    lookups_running: set[LookupJob]
    lookups_waiting: collections.deque[LookupJob]
    known: collections.OrderedDict[str, int]
    complete: bool


    def lookup(
        self, keys: Sequence[str], fresh: bool = False
    ) -> list[EntryMeta | None] | LookupJob:
        """Answer now (a list) or admit a lookup job that ``answered`` will end by
        its deadline. Raises TierUnavailable when shed or every node is down.
        ``fresh``: a key the filter does not know is asked of the store even when the
        filter is complete (another broker's announcement of it may be on its way)."""
        if self.closing:
            raise TierUnavailable("remote tier is shutting down")
        keys = list(keys)
        now = self.clock()
        ask = [
            k
            for k in dict.fromkeys(keys)
            if not self._blocked(k)
            and (fresh or not self.complete or k in self.known)
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
