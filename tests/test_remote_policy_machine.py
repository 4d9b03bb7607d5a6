"""A hypothesis state machine for the remote policy (``broker/tiers/remote/policy.py``),
the rules both remote backends share, against an in-memory store whose every call
the machine completes, fails, loses the reply of, or lets time out -- in any order.

The invariants are the policy's promises (its module docstring):

- a key deleted (or cleared) after its last put is never served again -- not by a
  lookup, not by a read -- unless someone writes it after the delete;
- a value the policy refused is never served, and the next write of the key replaces
  it (the in-memory store's write only checks existence, like an old ``EXISTS`` or
  Mooncake's ``put``: only the policy's overwrite flag replaces a bad value);
- every accepted write ends exactly once and is counted once; a failed one does not
  make the key known;
- write-behind never holds more than its byte budget (or one entry larger than it);
- no lookup is left unanswered past its deadline, and one that could not start in
  time never runs;
- the filter events are balanced (added/removed mirror the known set);
- a key leaves the filter with ``partial`` set unless the policy saw it gone (a
  miss, a refused value, a listing without it, its own delete or clear): clients
  then ask the broker instead of answering a local miss; ``partial`` is cleared
  only by a listing that fit under the filter's cap;
- a breaker with ``threshold`` failures in a row is not closed; a successful probe
  closes it;
- a failed write that may still land (``land_late``) is remembered until it cannot,
  whatever later writes of its key do, so that a delete or clear ending before it
  lands is run once more.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_ec_broker.broker.tiers.base import EntryMeta, TierMiss, TierUnavailable
from lmcache_ec_broker.broker.tiers.remote.circuit import BreakerState
from lmcache_ec_broker.broker.tiers.remote.jobs import (
    ClearJob,
    DeleteJob,
    Job,
    Limits,
    LookupJob,
    ProbeJob,
    ScanJob,
    WriteBatch,
    WriteJob,
    execute,
)
from lmcache_ec_broker.broker.tiers.remote.policy import LATE_WRITE_TIMEOUTS, RemotePolicy
from lmcache_ec_broker.broker.tiers.remote.transport import Declined, Outcome, StoreDown
from lmcache_ec_broker.broker.tiers.remote.value import BadValue

KEYS = [f"k{i}" for i in range(3)]
NODES = ("n0", "n1")  # two store nodes (a Cluster's masters): one breaker each
TIMEOUT = 1.0
BUDGET = 1000
THRESHOLD = 3

keys = st.sampled_from(KEYS)


def node_of(key: str) -> str:
    return NODES[int(key[1:]) % 2]


@dataclass
class Value:
    meta: EntryMeta
    valid: bool


class MemoryTransport:
    """The store: key -> Value. Calls apply atomically when the machine completes them."""

    write_batch = 3
    write_workers = 2

    def __init__(self) -> None:
        self.data: dict[str, Value] = {}

    def lookup(self, keys: list[str]) -> list[EntryMeta | None | BadValue]:
        out: list[EntryMeta | None | BadValue] = []
        for k in keys:
            v = self.data.get(k)
            out.append(None if v is None else v.meta if v.valid else BadValue("poisoned"))
        return out

    def write(self, items, slab) -> list[Outcome]:
        out = []
        for it in items:
            if it.key in self.data and not it.overwrite:
                # Existence only: whether a bad value is replaced is the policy's flag.
                out.append(Outcome.PRESENT)
            else:
                self.data[it.key] = Value(it.meta, True)
                out.append(Outcome.STORED)
        return out

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def clear(self) -> int:
        n = len(self.data)
        self.data.clear()
        return n

    def list_keys(self, limit: int) -> list[str]:
        return list(self.data)[:limit]

    def probe(self, node: object) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Runner:
    """Records what the policy asks for; the machine decides when it happens."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pending: list[Job] = []
        self.timers: list[tuple[float, int, object]] = []
        self.filter: set[str] = set()
        self.ended: dict[int, Outcome] = {}
        self.answered_jobs: list[LookupJob] = []
        self.store: MemoryTransport | None = None
        self.snapshots: dict[int, dict[str, Value]] = {}  # the store as a job found it
        self.policy: RemotePolicy | None = None
        self.forgetting = False  # inside the policy's _forget: it saw the key gone
        self._n = 0

    def dispatch(self, job: Job) -> None:
        if isinstance(job, LookupJob):
            assert job.answer is None, "a lookup answered (timed out) must never run"
            assert self.clock.now < job.deadline, "a lookup started after its deadline"
        self.pending.append(job)
        if self.store is not None:
            self.snapshots[job.id] = dict(self.store.data)

    def answered(self, job: LookupJob) -> None:
        assert job.answer is not None
        assert self.clock.now <= job.deadline + 1e-9, "a lookup answered past its deadline"
        self.answered_jobs.append(job)

    def write_ended(self, job: WriteJob) -> None:
        assert job.id not in self.ended, "a write ended twice"
        assert job.outcome is not None
        self.ended[job.id] = job.outcome

    def added(self, key: str) -> None:
        assert key not in self.filter, f"{key} added twice"
        self.filter.add(key)

    def removed(self, key: str) -> None:
        assert key in self.filter, f"{key} removed but never added"
        assert self.policy is not None
        assert self.forgetting or self.policy.partial, (
            f"{key} left the filter for room without marking it partial"
        )
        self.filter.discard(key)

    def later(self, delay_s: float, fn) -> None:
        self._n += 1
        self.timers.append((self.clock.now + delay_s, self._n, fn))

    def advance(self, dt: float) -> None:
        """Move time forward by ``dt``, firing each timer at its own time, in order."""
        target = self.clock.now + dt
        while True:
            due = sorted(t for t in self.timers if t[0] <= target)
            if not due:
                break
            self.timers.remove(due[0])
            self.clock.now = max(self.clock.now, due[0][0])
            due[0][2]()
        self.clock.now = target


def meta(n: int) -> EntryMeta:
    return EntryMeta(n, "uint8", (n,))


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.runner = Runner(self.clock)
        self.store = MemoryTransport()
        self.runner.store = self.store
        self.limits = Limits(
            timeout_s=TIMEOUT,
            write_queue=4,
            max_pending_bytes=BUDGET,
            max_entry_bytes=4 * BUDGET,
            filter_cap=2,  # below len(KEYS): learning a key may forget another
            announces=False,  # every lookup asks the store (the interleavings that matter)
            lookup_concurrency=2,
            lookup_backlog=2,
            write_workers=MemoryTransport.write_workers,
            write_batch=MemoryTransport.write_batch,
            fold_slice=2,
            breaker_threshold=THRESHOLD,
            breaker_backoff_s=0.5,
            breaker_max_backoff_s=4.0,
        )
        self.policy = RemotePolicy(self.limits, self.runner, node_of, self.clock)
        self.runner.policy = self.policy
        forget = self.policy._forget

        def forgetting(key: str) -> bool:  # every removal the policy makes on evidence
            self.runner.forgetting = True
            try:
                return forget(key)
            finally:
                self.runner.forgetting = False

        self.policy._forget = forgetting  # type: ignore[method-assign]
        self.was_partial = self.policy.partial
        self.listing: set[str] | None = None  # the last listing the store answered
        self.accepted: dict[int, WriteJob] = {}
        # keys deleted/cleared by this broker and not written by anyone since
        self.deleted_since: set[str] = set()
        # keys this broker saw refused; a write accepted meanwhile must replace the value
        self.refused_seen: set[str] = set()
        self.must_replace: set[int] = set()  # write job ids
        self.late: list[tuple[float, WriteJob]] = []  # failed writes still on the wire
        # fetches in flight: (job, the store as it was when the fetch began)
        self.fetches: list[tuple[LookupJob, dict[str, Value]]] = []

    # ------------------------------------------------------------ the broker's calls

    @rule(key=keys, n=st.integers(1, 1500))
    def put(self, key: str, n: int) -> None:
        job = self.policy.write(key, meta(n), [])
        if job is None:
            return
        self.accepted[job.id] = job
        self.deleted_since.discard(key)
        if key in self.refused_seen:
            self.must_replace.add(job.id)

    @rule(ks=st.one_of(st.lists(keys, min_size=1, max_size=3), st.none()))
    def delete(self, ks: list[str] | None) -> None:
        if ks is None:  # a (shared) clear: rarer than deletes
            self.policy.clear()
            self.deleted_since |= set(KEYS)
            return
        self.policy.delete(ks)
        self.deleted_since |= set(ks)

    @rule(ks=st.lists(keys, min_size=1, max_size=4))
    def lookup(self, ks: list[str]) -> None:
        try:
            got = self.policy.lookup(ks)
        except TierUnavailable:
            return
        if isinstance(got, list):
            self._check_answer(ks, got)

    @rule(key=keys)
    def read(self, key: str) -> None:
        try:
            self.policy.read_start(key)
        except (TierUnavailable, TierMiss):
            return
        v = self.store.data.get(key)
        if v is None:
            self.policy.read_ended(key, TierMiss(key))
        elif not v.valid:
            self.refused_seen.add(key)
            self.policy.read_ended(key, BadValue("poisoned"))
        else:
            assert key not in self.deleted_since, f"{key} served after its delete"
            self.policy.read_ended(key, None)
            self.refused_seen.discard(key)

    @rule(key=keys)
    def fetch(self, key: str) -> None:
        """A get's lookup and read in one round trip (promise 9): admitted now, ended
        by ``complete_fetch`` after any interleaving."""
        try:
            job = self.policy.fetch_start(key)
        except (TierUnavailable, TierMiss):
            return
        self.fetches.append((job, dict(self.store.data)))

    @precondition(lambda self: self.fetches)
    @rule(
        i=st.integers(0, 10),
        mode=st.sampled_from(["ok", "early", "fail", "declined", "cancelled"]),
    )
    def complete_fetch(self, i: int, mode: str) -> None:
        """The fetch's GET answers with the value now ("ok") or as it was when the
        fetch began ("early": its bytes were on the way meanwhile), or the store did
        not answer, or the caller had no room after the header, or it was cancelled."""
        job, seen = self.fetches.pop(i % len(self.fetches))
        key = job.keys[0]
        data = seen if mode == "early" else self.store.data
        v = data.get(key)
        result: EntryMeta | BaseException | None
        if mode == "fail":
            result = StoreDown([node_of(key)], "connection lost")
        elif mode == "declined":
            result = Declined("no room")
        elif mode == "cancelled":
            result = TierUnavailable("cancelled")
        elif v is None:
            result = TierMiss(key)
        elif not v.valid:
            result = BadValue("poisoned")
            self.refused_seen.add(key)
        else:
            result = v.meta
        served = self.policy.fetch_ended(job, result)
        if served:
            assert isinstance(result, EntryMeta)
            assert key not in self.deleted_since, f"{key} fetched and served after its delete"
            assert v is not None and v.valid, f"{key}: a refused or absent value was served"
            self.refused_seen.discard(key)
        else:
            assert key not in self.policy.known or not isinstance(result, BadValue | TierMiss)
        if isinstance(result, StoreDown):
            cb = self.policy.breakers[node_of(key)]
            assert cb.failures < THRESHOLD or cb.state is not BreakerState.CLOSED

    # ------------------------------------------------------------ the store's side

    @precondition(lambda self: self.runner.pending)
    @rule(i=st.integers(0, 50), mode=st.sampled_from(["ok", "early", "fail", "lost_reply", "late"]))
    def complete(self, i: int, mode: str) -> None:
        """The store answers job ``i``: now ("ok"), as it was when the job started
        ("early": a read-only job whose answer was on its way meanwhile), not at all
        ("fail"), or it did the work but the reply was lost; "late": a write fails on
        the broker's side (a timeout) while its bytes are still on the wire and land
        later (``land_late``), within LATE_WRITE_TIMEOUTS x timeout."""
        job = self.runner.pending.pop(i % len(self.runner.pending))
        known_before = set(self.policy.known)
        seen = self.runner.snapshots.pop(job.id, {})
        used = self.store.data
        if mode == "early" and isinstance(job, LookupJob | ScanJob):
            then = MemoryTransport()
            then.data = used = seen
            result = execute(then, job, None)
        elif mode == "late" and isinstance(job, WriteBatch):
            for w in job.writes:
                self.late.append((self.clock.now + LATE_WRITE_TIMEOUTS * TIMEOUT, w))
            result = StoreDown([node_of(self._a_key(job))], "timed out")
        elif mode in ("fail", "late"):
            result = StoreDown([node_of(self._a_key(job))], "connection lost")
        else:
            result = execute(self.store, job, None)
            if mode == "lost_reply":  # it happened, the reply did not arrive
                result = StoreDown([node_of(self._a_key(job))], "reply lost")
        if isinstance(job, WriteBatch) and mode in ("ok", "early"):
            for w in job.writes:
                if w.id in self.must_replace:
                    assert self.store.data[w.key].valid, f"refused {w.key} was not replaced"
        if isinstance(job, LookupJob) and isinstance(result, list) and not job.expired:
            # what the policy learns from this answer (a late one is not used)
            for k, r in zip(job.keys, result, strict=True):
                if isinstance(r, BadValue):
                    self.refused_seen.add(k)
                elif r is not None and k not in job.gone and not job.cleared:
                    self.refused_seen.discard(k)
        self.policy.finished(job, result)
        if isinstance(job, WriteBatch):
            for w in job.writes:
                if w.outcome is Outcome.STORED:
                    self.refused_seen.discard(w.key)
        if (
            isinstance(job, LookupJob)
            and job.answer is not None
            and job in self.runner.answered_jobs
        ):
            if isinstance(job.answer, list):
                self._check_answer(job.asked, job.answer, used)
        if isinstance(job, WriteBatch):
            for w in job.writes:
                if w.outcome is Outcome.FAILED and w.key not in known_before:
                    assert w.key not in self.policy.known, "a failed write made its key known"
        if isinstance(job, ScanJob) and isinstance(result, set):
            self.listing = result
        if isinstance(job, ProbeJob) and mode in ("ok", "early"):
            assert self.policy.breakers[job.node].state is BreakerState.CLOSED
        if isinstance(result, StoreDown):
            for node in result.nodes:
                cb = self.policy.breakers[node]
                assert cb.failures < THRESHOLD or cb.state is not BreakerState.CLOSED

    @precondition(lambda self: self.late)
    @rule(i=st.integers(0, 10))
    def land_late(self, i: int) -> None:
        """A write that failed on the broker's side reaches the store after all."""
        until, w = self.late.pop(i % len(self.late))
        if self.clock.now < until:
            self.store.data[w.key] = Value(w.meta, True)

    @precondition(lambda self: self.runner.pending)
    @rule(mode=st.sampled_from(["ok", "early"]))
    def complete_oldest(self, mode: str) -> None:
        self.complete(0, mode)

    @staticmethod
    def _a_key(job: Job) -> str:
        if isinstance(job, WriteBatch):
            return job.writes[0].key
        if isinstance(job, LookupJob):
            return job.keys[0]
        if isinstance(job, DeleteJob):
            return job.keys[0]
        if isinstance(job, ProbeJob):
            return "k0" if job.node == "n0" else "k1"
        return "k0"

    def _check_answer(
        self, asked: list[str], answer: list[EntryMeta | None], data: dict[str, Value] | None = None
    ) -> None:
        """``data``: the store as the answer read it."""
        data = self.store.data if data is None else data
        assert len(answer) == len(asked)
        for k, m in zip(asked, answer, strict=True):
            if m is not None:
                assert k not in self.deleted_since, f"{k} answered as a hit after its delete"
                v = data.get(k)
                assert v is not None and v.valid, f"{k}: a refused or absent value was a hit"

    @rule(key=keys, kind=st.sampled_from(["write", "poison", "delete", "announce"]))
    def store_side(self, key: str, kind: str) -> None:
        """Another broker writes, poisons or deletes ``key``, or announces it."""
        if kind == "delete":
            self.store.data.pop(key, None)
        elif kind == "announce":
            self.policy.announced([key])
            self.refused_seen.discard(key)  # a new value announced: asked for again
        else:
            self.other_node_writes(key, kind == "write", 7)

    def other_node_writes(self, key: str, valid: bool, n: int) -> None:
        self.store.data[key] = Value(meta(n), valid)
        self.deleted_since.discard(key)

    def announcement(self, key: str) -> None:
        self.policy.announced([key])

    @rule(kind=st.sampled_from(["rescan", "maintain"]))
    def background(self, kind: str) -> None:
        if kind == "rescan":
            self.policy.want_scan()
        else:
            self.policy.maintain()

    @rule(dt=st.sampled_from([0.0, 0.0, 0.3, 0.6, 1.1, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.runner.advance(dt)

    # ------------------------------------------------------------ invariants

    @invariant()
    def budget_holds(self) -> None:
        pol = self.policy
        assert len(pol.pending_writes) <= self.limits.write_queue
        assert pol.pending_bytes <= BUDGET or len(pol.pending_writes) == 1
        assert pol.pending_bytes == sum(j.meta.nbytes for j in pol.pending_writes.values())

    @invariant()
    def outcomes_counted_once(self) -> None:
        ended = self.runner.ended
        pending = {j.id for j in self.policy.pending_writes.values()}
        assert set(ended) | pending == set(self.accepted)
        assert not set(ended) & pending
        c = self.policy.counters
        by = [o for o in ended.values()]
        assert c["remote_writes"] == by.count(Outcome.STORED)
        assert c["remote_write_errors"] == by.count(Outcome.FAILED) + by.count(Outcome.REJECTED)
        assert c["remote_writes_cancelled"] == by.count(Outcome.CANCELLED)

    @invariant()
    def no_lookup_past_its_deadline(self) -> None:
        pol = self.policy
        for job in [*pol.lookups_waiting, *pol.lookups_running]:
            if job.answer is None:
                assert self.clock.now < job.deadline, "an unanswered lookup is past its deadline"
        assert len(pol.lookups_running) <= self.limits.lookup_concurrency

    @invariant()
    def the_queue_moves(self) -> None:
        """Jobs queued while none runs must be waiting for a time (a retry, a follow-up)."""
        pol = self.policy
        runs = [j for j in pol.running if isinstance(j, WriteBatch | DeleteJob | ClearJob)]
        if pol.queue and not runs:
            waits = [getattr(j, "not_before", 0.0) for j in pol.queue]
            # ">=": the wake timer for a retry due at T is set as now + (T - now), which
            # float rounding can put a hair after T; Runner.advance then stops the clock
            # at exactly T with that timer still pending (seen in CI, 2026-12-02:
            # not_before == now == 128.1). A job due before now with nothing to run it
            # is the stall this catches.
            assert max(waits) >= self.clock.now, "queued jobs but nothing runs or waits"

    @invariant()
    def filter_mirrors_known(self) -> None:
        assert self.runner.filter == set(self.policy.known)
        assert len(self.policy.known) <= self.limits.filter_cap

    @invariant()
    def partial_cleared_only_by_a_listing_that_fit(self) -> None:
        pol = self.policy
        if self.was_partial and not pol.partial:
            assert self.listing is not None, "partial cleared without a listing"
            assert len(self.listing) < self.limits.filter_cap, "cleared by a listing past the cap"
            assert len(pol.known) < self.limits.filter_cap
        self.was_partial = pol.partial

    @invariant()
    def late_writes_remembered(self) -> None:
        """A failed write that may still land is remembered until it can no longer land
        (``uncertain``), or a delete of its key is set to run after that: whatever
        happens to the key meanwhile (a later write STORED, a delete, a clear), so that
        a delete or clear that ends before it lands is run once more. (Checked here, not
        only by ``deleted_keys_stay_away``: the whole sequence that brings the key back
        -- late write, delete, landing -- is rarely drawn; this breaks a step after the
        cause.)"""
        pol = self.policy
        for until, w in self.late:
            if self.clock.now >= until:
                continue
            if pol.uncertain.get(w.key, 0.0) >= until:
                continue
            assert any(
                isinstance(j, DeleteJob) and w.key in j.keys and j.not_before >= until
                for j in [*pol.queue, *pol.running]
            ), f"a failed write of {w.key} may still land but the policy forgot it"

    @invariant()
    def deleted_keys_stay_away(self) -> None:
        """Once no job of a deleted key is queued or running, the store lacks it."""
        pol = self.policy
        busy = set(pol.pending_writes) | {w.key for until, w in self.late if self.clock.now < until}
        for job in [*pol.queue, *pol.running]:
            if isinstance(job, DeleteJob):
                busy |= set(job.keys)
            elif isinstance(job, WriteBatch):
                busy |= {w.key for w in job.writes}
            elif not isinstance(job, LookupJob | ScanJob | ProbeJob):
                busy |= set(KEYS)  # a clear
        for k in self.deleted_since - busy:
            if k not in pol.gone:  # a delete that failed for good: never served instead
                assert k not in self.store.data, f"{k} came back after its delete"


PolicyMachine.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_remote_policy = PolicyMachine.TestCase


def test_machine_finds_a_write_that_overtakes_its_delete() -> None:
    """The machine can fail: a policy that runs a delete without waiting for the write
    of its key (the old Redis tier's bug) is caught by ``deleted_keys_stay_away``."""
    from lmcache_ec_broker.broker.tiers.remote import policy as remote_policy

    m = PolicyMachine()
    m.put("k0", 10)  # dispatched at once
    assert isinstance(m.runner.pending[0], WriteBatch)
    saved = remote_policy.RemotePolicy.pump

    def careless(self: RemotePolicy) -> None:  # start every queued delete at once
        for job in [j for j in self.queue if isinstance(j, DeleteJob)]:
            self.queue.remove(job)
            self.running.add(job)
            self.runner.dispatch(job)
        saved(self)

    remote_policy.RemotePolicy.pump = careless  # type: ignore[method-assign]
    try:
        m.delete(["k0"])
        m.complete(1, "ok")  # the delete runs first
        m.complete(0, "ok")  # then the write lands
        with pytest.raises(AssertionError, match="came back"):
            m.deleted_keys_stay_away()
    finally:
        remote_policy.RemotePolicy.pump = saved  # type: ignore[method-assign]


def test_a_lookup_answered_from_before_a_delete_is_a_miss() -> None:
    """The lookup read the store before the delete; the delete ends first; the
    lookup's (stale) hit must not be served. (The broad run above rarely reaches this
    exact order, so it is spelled out.)"""
    m = PolicyMachine()
    m.store_side("k0", "write")
    m.lookup(["k0"])
    m.delete(["k0"])
    lookup, delete = m.runner.pending
    assert isinstance(lookup, LookupJob) and isinstance(delete, DeleteJob)
    m.complete(1, "ok")  # the delete lands
    m.complete(0, "early")  # the lookup's answer, read before the delete, arrives
    assert lookup.answer == [None]
    assert "k0" not in m.policy.known


def test_a_write_that_lands_after_its_timeout_is_deleted_again() -> None:
    """A write fails on the broker's side but its bytes land after the delete: the
    delete runs once more when such a write can no longer land."""
    m = PolicyMachine()
    m.put("k0", 10)
    m.delete(["k0"])
    m.complete(0, "late")  # the write times out; its bytes are still on the wire
    m.complete(0, "ok")  # the delete
    m.land_late(0)  # ... and then the write lands
    assert "k0" in m.store.data
    m.time_passes(LATE_WRITE_TIMEOUTS * TIMEOUT + 0.1)
    (follow_up,) = m.runner.pending
    assert isinstance(follow_up, DeleteJob) and follow_up.follow_up
    m.complete(0, "ok")
    assert "k0" not in m.store.data
    m.deleted_keys_stay_away()


def test_writes_ended_without_io_do_not_stall_the_queue() -> None:
    """Writes of a node whose breaker opened end without I/O when their turn comes;
    they must not use up the pass that starts the jobs behind them (found by
    benchmarks/remote_faults.py: queued write-behinds stayed pending for ever)."""
    import msgspec

    m = PolicyMachine()
    m.policy.limits = msgspec.structs.replace(
        m.limits, write_queue=8, max_pending_bytes=10**6, write_batch=1
    )
    for k in ("k0", "k1"):  # both writers busy
        m.put(k, 10)
    for k in ("k2", "k4", "k6"):  # queued, all on node n0
        m.put(k, 10)
    m.policy.delete(["k3"])  # queued behind them (node n1)
    assert len(m.runner.pending) == 2
    for _ in range(THRESHOLD):
        m.policy.breakers["n0"].failure()
    m.complete(1, "ok")  # k1's write (n1) ends
    m.complete(0, "fail")  # k0's write (n0) fails
    m.the_queue_moves()
    assert any(isinstance(j, DeleteJob) for j in m.runner.pending)


def test_a_fetch_that_read_before_a_delete_is_not_served() -> None:
    """A get's fetch (lookup and read in one round trip) read the value; the key is
    deleted, and the delete ends, before the fetch does: it must not be served, nor
    learned. (``complete_fetch`` asserts the first; spelled out as the broad run
    rarely reaches this order.)"""
    m = PolicyMachine()
    m.store_side("k0", "write")
    m.fetch("k0")
    assert m.fetches, "the fetch was not admitted"
    m.delete(["k0"])
    (delete,) = m.runner.pending
    assert isinstance(delete, DeleteJob)
    m.complete(0, "ok")  # the delete lands
    hits = m.policy.counters["remote_hits"]
    m.complete_fetch(0, "early")  # the value it read before the delete arrives
    assert m.policy.counters["remote_hits"] == hits
    assert "k0" not in m.policy.known


@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_late_write_outlived_by_a_stored_one_is_deleted_again(how: str) -> None:
    """The machine's counterexample, replayed without its database: a write of k2 times
    out with its bytes still on the wire; a second write of k2 is STORED; the key is
    deleted (or the namespace cleared); then the first write lands. The STORED write
    does not make the first one's landing impossible (it may land after anything), so
    the delete must still run once more when it can no longer land."""
    m = PolicyMachine()
    m.background("rescan")
    m.complete_oldest("ok")
    m.put("k2", 1)
    m.complete(0, "late")  # the write times out; its bytes are still on the wire
    m.put("k2", 1)
    m.complete_oldest("ok")  # the second write is STORED
    m.late_writes_remembered()  # the first may still land: not forgotten
    m.delete(None if how == "clear" else ["k2"])
    m.complete_oldest("ok")  # the delete (clear) ends
    m.land_late(0)  # ... and then the first write lands
    m.deleted_keys_stay_away()
    m.time_passes(LATE_WRITE_TIMEOUTS * TIMEOUT + 0.1)
    (follow_up,) = m.runner.pending
    assert isinstance(follow_up, DeleteJob) and follow_up.follow_up
    m.complete(0, "ok")
    assert "k2" not in m.store.data
    m.deleted_keys_stay_away()
