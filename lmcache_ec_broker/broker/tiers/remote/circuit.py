"""A circuit breaker for a remote store: stop calling a store that keeps failing, probe
it again after a growing backoff, and close as soon as a probe succeeds.

States: CLOSED (calls go through) -> after ``threshold`` consecutive failures OPEN
(calls refused at once, no I/O) -> after the backoff HALF_OPEN (one probe call is
let through; others are still refused) -> CLOSED on success, OPEN with a doubled
backoff (capped) on failure. Thread-safe: the tier's threads report outcomes.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        threshold: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        if threshold < 1 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("threshold >= 1 and 0 < backoff_s <= max_backoff_s")
        self.threshold = threshold
        self.base_backoff = backoff_s
        self.max_backoff = max_backoff_s
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.backoff = backoff_s
        self.retry_at = 0.0
        self._probing = False
        self._probe_at = 0.0
        self.opened = 0  # how many times it opened (a counter for stats)

    @property
    def up(self) -> bool:
        return self.state is BreakerState.CLOSED

    def allow(self) -> bool:
        """May a call go to the store now? In HALF_OPEN only one probe at a time."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN:
                if self._clock() < self.retry_at:
                    return False
                self._set(BreakerState.HALF_OPEN)
            # A probe that never reported (its caller failed before reaching the store)
            # must not keep the breaker half-open forever.
            if self._probing and self._clock() - self._probe_at < self.max_backoff:
                return False
            self._probing = True
            self._probe_at = self._clock()
            return True

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self._probing = False
            self.backoff = self.base_backoff
            if self.state is not BreakerState.CLOSED:
                self._set(BreakerState.CLOSED)

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            was_probe = self._probing
            self._probing = False
            if self.state is BreakerState.HALF_OPEN or (was_probe and self.state is not BreakerState.CLOSED):
                self.backoff = min(self.backoff * 2, self.max_backoff)
                self._open()
            elif self.state is BreakerState.CLOSED and self.failures >= self.threshold:
                self._open()

    def _open(self) -> None:
        self.retry_at = self._clock() + self.backoff
        if self.state is not BreakerState.OPEN:
            self.opened += 1
            self._set(BreakerState.OPEN)

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)

    def release(self) -> None:
        """A probe ended without a verdict (the call could not be made): let the next
        ``allow`` hand out another probe; state and backoff unchanged."""
        with self._lock:
            self._probing = False

    def refusing(self) -> bool:
        """Would ``allow`` refuse now? (No side effect: takes no probe.)"""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return False
            if self.state is BreakerState.OPEN:
                return self._clock() < self.retry_at
            return self._probing and self._clock() - self._probe_at < self.max_backoff


class Breakers:
    """One breaker per node of a store (a Redis Cluster's masters; one for a store
    that is a single service), created on first use: a dead node opens its own
    breaker only, the keys on healthy nodes keep being served."""

    def __init__(
        self,
        threshold: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[object, BreakerState], None] | None = None,
    ) -> None:
        self._args = (threshold, backoff_s, max_backoff_s, clock)
        self._on_change = on_change
        self._by_node: dict[object, CircuitBreaker] = {}

    def __getitem__(self, node: object) -> CircuitBreaker:
        cb = self._by_node.get(node)
        if cb is None:
            threshold, backoff_s, max_backoff_s, clock = self._args
            hook = self._on_change

            def changed(state: BreakerState, node: object = node) -> None:
                if hook is not None:
                    hook(node, state)

            cb = CircuitBreaker(threshold, backoff_s, max_backoff_s, clock, changed)
            self._by_node[node] = cb
        return cb

    def items(self) -> list[tuple[object, CircuitBreaker]]:
        return list(self._by_node.items())

    @property
    def up(self) -> bool:
        """No node's breaker is open."""
        return all(cb.up for cb in self._by_node.values())

    @property
    def opened(self) -> int:
        return sum(cb.opened for cb in self._by_node.values())
