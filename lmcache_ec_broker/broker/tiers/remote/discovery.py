"""Key discovery for the remote policy (rule 7 of ``policy.py``): listings of
the store's keys, coalesced (one at a time, one more if asked for meanwhile), and
announcements, folded into the membership filter in slices of ``fold_slice`` keys
per loop turn so that a listing of 300k keys never holds the event loop.

Own echoes. A store that announces (Redis pub/sub) delivers a broker's own
announcements back to it, on the subscriber thread: before the loop hears that the
write ended, or any time after -- possibly after a delete or clear of the key has
ended too. Such an echo carries no news: the write teaches the key itself when it
ends STORED (rule 2), unless a delete or clear came meanwhile, and then learning the
echo would put a deleted key back into the filter -- and the next write-behind of
the key would be skipped as "already in the store", so the value never reached the
fleet again. Invariant: every own write, from when it is sent, expects one echo
(``_echo_sent``) until it ends other than STORED (``_echo_settled``: nothing was
published) or the echo is heard; the first announcement of its key heard meanwhile
is taken as the echo and never learned (``_own_echo``). Announcements carry only
the key, so another broker's announcement of the same key heard first is taken
instead and the echo is learned in its place: the same news, one announcement later.
An echo never heard (the subscriber reconnected) is forgotten ``ECHO_TTL_S`` after
its write ended; until then it swallows one announcement of its key -- a key not
learned is a miss that costs a recomputation, never a wrong hit."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .jobs import ScanJob
from .part import PolicyPart
from .transport import StoreDown

if TYPE_CHECKING:
    from .jobs import Limits, LookupJob, Runner, WriteJob

log = logging.getLogger("lmcache_ec_broker.remote")

ECHO_TTL_S = 30.0  # longer than any subscriber backlog seen; see "Own echoes" above
ECHO_CAP = 65536


class KeyDiscovery(PolicyPart):
    """Mixed into RemotePolicy: the state it uses is the policy's (declared below);
    the policy's methods it calls are ``PolicyPart``'s."""

    limits: Limits
    runner: Runner
    closing: bool
    counters: collections.Counter[str]
    known: collections.OrderedDict[str, int]
    refused: collections.OrderedDict[str, float]
    live: set[LookupJob | ScanJob | WriteJob]
    complete: bool
    partial: bool
    clock: Callable[[], float]
    # key -> (own announcements not heard back yet, until when one is expected)
    echoes: collections.OrderedDict[str, tuple[int, float]]
    _seq: int
    _scan: ScanJob | None
    _scan_again: bool
    _fold: Iterator[None] | None

    def want_scan(self) -> None:
        """List the store's keys (coalesced: one at a time, one more if asked meanwhile)."""
        if self.closing or self.limits.filter_cap <= 0:
            return
        if self._scan is not None:
            self._scan_again = True
            return
        self._scan = ScanJob(self._next_id(), since=self._seq)
        self.live.add(self._scan)
        self.runner.dispatch(self._scan)

    def _scan_finished(self, job: ScanJob, result: Any) -> None:
        if isinstance(result, Exception):
            log.info("remote tier: listing keys failed (%s); learning them as they come", result)
            if isinstance(result, StoreDown):
                self._fail(result.nodes)
            self._scan_done()
            return
        self._fold = self._fold_scan(job, result)
        self.step_fold()

    def step_fold(self) -> None:
        """Fold one slice of a listing; schedules the next slice (rule 7)."""
        if self._fold is None:
            return
        try:
            next(self._fold)
        except StopIteration:
            self._fold = None
            self._scan_done()
            return
        self.runner.later(0.0, self.step_fold)

    def _fold_scan(self, job: ScanJob, found: set[str]) -> Iterator[None]:
        n = 0
        step = self.limits.fold_slice
        for key in list(self.known):  # gone from the store: evicted, expired, restarted
            n += 1
            if n % step == 0:
                yield
            seq = self.known.get(key)
            if seq is not None and seq <= job.since and key not in found:
                self._forget(key)
        if not job.cleared:
            learned = 0
            for key in found:
                n += 1
                if n % step == 0:
                    yield
                if job.cleared:
                    break
                if key not in job.gone and not self._blocked(key) and key not in self.refused:
                    learned += self._learn(key)
            self.counters["remote_announcements"] += learned
            if self.limits.announces:
                self.complete = 0 <= len(found) < self.limits.filter_cap
            cap = self.limits.filter_cap
            if self.limits.discovers and len(found) < cap and len(self.known) < cap:
                self.partial = False  # every listed key is folded in (or refused/gone)

    def _scan_done(self) -> None:
        if self._scan is not None:
            self.live.discard(self._scan)
        self._scan = None
        if self._scan_again:
            self._scan_again = False
            self.want_scan()

    def _echo_sent(self, keys: Sequence[str]) -> None:
        """Own writes of ``keys`` are dispatched: each may announce its key."""
        if not self.limits.announces:
            return
        until = self.clock() + ECHO_TTL_S
        for key in keys:
            n, _ = self.echoes.pop(key, (0, 0.0))
            self.echoes[key] = (n + 1, until)  # kept in order of expiry
        while len(self.echoes) > ECHO_CAP:
            self.echoes.popitem(last=False)

    def _echo_settled(self, key: str, stored: bool) -> None:
        """A dispatched write of ``key`` ended: STORED, its echo may still come (for
        ``ECHO_TTL_S`` from now); otherwise it published nothing."""
        got = self.echoes.get(key)
        if got is None:  # heard already
            return
        n, until = got
        if stored:
            del self.echoes[key]
            self.echoes[key] = (n, self.clock() + ECHO_TTL_S)  # last: the latest expiry
        elif n > 1:
            self.echoes[key] = (n - 1, until)
        else:
            del self.echoes[key]

    def _own_echo(self, key: str) -> bool:
        """Is this announcement of ``key`` one of this broker's own, heard back?"""
        now = self.clock()
        while self.echoes:
            oldest = next(iter(self.echoes))
            if self.echoes[oldest][1] > now:
                break
            del self.echoes[oldest]
        got = self.echoes.get(key)
        if got is None:
            return False
        n, until = got
        if n > 1:
            self.echoes[key] = (n - 1, until)
        else:
            del self.echoes[key]
        return True

    def announced(self, keys: Sequence[str]) -> None:
        """Keys brokers wrote (from the announcement stream; a bounded batch)."""
        if self.closing:
            return
        for key in keys[: self.limits.fold_slice]:
            self.counters["remote_announcements"] += 1
            if self._own_echo(key):
                continue  # see "Own echoes" in the module docstring
            self.refused.pop(key, None)  # a new value: worth asking for again
            if not self._blocked(key):
                self._learn(key)
