"""The remote policy's units of work (``policy.py``) and how each one is run
against a transport (``execute``, on a worker thread)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ....protocol import Extent
from ..base import EntryMeta
from .transport import Node, Outcome, Retry, StoreDown, Transport

log = logging.getLogger("lmcache_ec_broker.remote")


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    timeout_s: float
    write_queue: int
    max_pending_bytes: int
    max_entry_bytes: int
    filter_cap: int
    #: False: the store does not announce writes (Mooncake): every lookup asks it
    announces: bool = True
    #: False: nothing lists the store's keys (Mooncake, mooncake_key_poll_s 0)
    discovers: bool = True
    lookup_concurrency: int = 4
    lookup_backlog: int = 8
    write_workers: int = 2
    write_batch: int = 1
    write_batch_bytes: int = 256 << 20
    fold_slice: int = 2048
    breaker_threshold: int = 3
    breaker_backoff_s: float = 0.5
    breaker_max_backoff_s: float = 30.0


# ---------------------------------------------------------------- jobs


@dataclass(eq=False)
class Job:
    id: int = 0


@dataclass(eq=False)
class WriteJob(Job):
    key: str = ""
    meta: EntryMeta = EntryMeta(0, "uint8", (0,))
    extents: list[Extent] = field(default_factory=list)
    overwrite: bool = False
    superseded: bool = False  # a delete/clear of the key came after it: learn nothing
    outcome: Outcome | None = None
    waiter: Any = None  # the runtime's awaitable (the coordinator's pin)


@dataclass(eq=False)
class WriteBatch(Job):
    writes: list[WriteJob] = field(default_factory=list)


@dataclass(eq=False)
class DeleteJob(Job):
    keys: list[str] = field(default_factory=list)
    tries: int = 0
    not_before: float = 0.0
    follow_up: bool = False  # the second delete after a write that may still land


@dataclass(eq=False)
class ClearJob(Job):
    tries: int = 0
    not_before: float = 0.0


@dataclass(eq=False)
class LookupJob(Job):
    keys: list[str] = field(default_factory=list)  # asked of the store
    asked: list[str] = field(default_factory=list)  # asked of the tier (the answer's order)
    deadline: float = 0.0
    started: bool = False
    expired: bool = False
    gone: set[str] = field(default_factory=set)  # deleted while this job ran
    cleared: bool = False
    answer: list[EntryMeta | None] | Exception | None = None
    waiter: Any = None


@dataclass(eq=False)
class ScanJob(Job):
    since: int = 0
    gone: set[str] = field(default_factory=set)
    cleared: bool = False


@dataclass(eq=False)
class ProbeJob(Job):
    node: Node = None


QueueJob = WriteJob | DeleteJob | ClearJob


class Runner(Protocol):
    """What the policy needs from whoever drives it (the tier's runtime, or a test)."""

    def dispatch(self, job: Job) -> None:
        """Run ``job``'s I/O (``execute``) off the loop; later call ``finished``."""

    def answered(self, job: LookupJob) -> None:
        """``job.answer`` is set: wake whoever waits for the lookup."""

    def write_ended(self, job: WriteJob) -> None:
        """``job.outcome`` is set: release whoever waits for the write."""

    def added(self, key: str) -> None: ...
    def removed(self, key: str) -> None: ...

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the loop after ``delay_s``."""


# ---------------------------------------------------------------- the I/O of a job


def execute(transport: Transport, job: Job, slab: Any) -> Any:
    """Run one job against the transport (on a worker thread). Never raises: the
    result (or the StoreDown/Retry) goes back to ``RemotePolicy.finished``."""
    try:
        if isinstance(job, LookupJob):
            return transport.lookup(job.keys)
        if isinstance(job, WriteBatch):
            return transport.write(job.writes, slab)
        if isinstance(job, DeleteJob):
            out: dict[str, Exception | None] = {}
            for key in job.keys:
                try:
                    transport.delete(key)
                    out[key] = None
                except (StoreDown, Retry) as exc:
                    out[key] = exc
            return out
        if isinstance(job, ClearJob):
            return transport.clear()
        if isinstance(job, ScanJob):
            return set(transport.list_keys(1 << 62))
        if isinstance(job, ProbeJob):
            transport.probe(job.node)
            return None
    except (StoreDown, Retry) as exc:
        return exc
    except Exception as exc:  # a transport bug: logged, treated as the store failing
        log.exception("remote tier: %s failed", type(job).__name__)
        return StoreDown([], f"{type(exc).__name__}: {exc}")
    raise AssertionError(f"unknown job {job!r}")
