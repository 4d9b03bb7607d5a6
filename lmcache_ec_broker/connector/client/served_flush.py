"""The Served frame's deadline: what a client served from the residency index reaches
the broker's counters, Prometheus and LRU order within ``SERVED_FLUSH_S`` (plus one
turn of the broker's loop) whether or not the client sends anything else.

Usually the next request carries the pending Served frame (ServedBatch.take, as the
wire's prefix). A client that serves a hit and then idles -- a vLLM instance after
answering its last request -- sends nothing more, so ``ServedBatch.note`` arms this
when the batch becomes non-empty, and a daemon thread (one per client and process,
started on the first arm) wakes when the batch is due and, if no request carried it
meanwhile, sends it alone (BrokerClient._served_step).

What keeps the caller safe (docs/design.md "Served hits reach the broker within
100 ms"):
- one writer at a time: the thread sends only with the client's lock held, as every
  other send does, so frames from two threads never interleave;
- it never blocks anyone: it takes the lock with a timeout (a caller holding it is
  mid-call; the thread tries again), and writes with a non-blocking ``os.write``:
  what the socket cannot take now stays pending ahead of the next request
  (ServedBatch._unsent), so the lock is never held over a wait for the broker;
- it never touches a tripped circuit or a dropped session; a failed write is left
  to the next request to find (the counts die with the connection, like its pins);
- it holds the client weakly: a client nobody holds is freed, and its thread exits.

What keeps arming cheap (issue 42): waking a sleeping thread is an Event.set() -- a
futex wake, on this project's VMs an inter-processor interrupt to an idle vCPU,
7 us median and 31 us p90 on a busy 2-vCPU host, and then the woken thread's turn on
the GIL -- and a reader that serves one hit per request would pay it per request.
So after a batch the thread lingers: it keeps waking every ``flush_s`` for
``_LINGER_S`` and while it does (``_awake_until``), ``arm`` changes nothing, because
the thread's next wake-up is at most ``flush_s`` away and it then sleeps exactly
until the batch is due. The deadline is unchanged. Going idle, the thread first
clears ``_awake_until`` and then looks once more (``step``): a batch armed before
the clear is seen by that look, one armed after it wakes the thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from . import index_path

log = logging.getLogger(__name__)

# How often an idle flusher wakes to notice that its client was freed.
_IDLE_WAKE_S = 1.0
# Bumped in every forked child (os.register_at_fork): a flusher started before the fork
# has no thread there. arm() compares this counter rather than calling os.getpid() --
# a system call, which arm() would make in every index-served call that starts a batch,
# in a process that often just woke up (issue 42).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)
# How long the thread keeps waking every ``flush_s`` after its last batch, so that
# the next batch's arm costs no wake-up (a busy client arms many times a second).
_LINGER_S = 1.0
GONE = -1.0  # what a step returns once the client is gone: the thread exits


class ServedFlusher:
    """The thread that sends a due Served batch. ``step()`` (the client's, weakly
    bound) sends what is due and returns the seconds until it should run again, None
    when nothing is pending, or GONE."""

    __slots__ = ("_step", "_armed", "_stopping", "_thread", "_forks", "_awake_until")

    def __init__(self, step: Callable[[], float | None]) -> None:
        self._step = step
        self._armed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._forks = -1  # _forks when the thread started; -1: not started
        # While monotonic() is before this, the thread wakes at least every flush_s by
        # itself (it lingers): arming needs no wake-up. 0.0: it may sleep _IDLE_WAKE_S.
        self._awake_until = 0.0

    def arm(self) -> None:
        """A batch became non-empty (ServedBatch.note, with the client's lock held)."""
        if self._forks != _forks:  # first arm, or a forked child (no thread there)
            self._start()
        elif time.monotonic() < self._awake_until:
            return  # the lingering thread looks within flush_s (module docstring)
        self._armed.set()

    def _start(self) -> None:
        self._forks = _forks
        self._awake_until = 0.0
        self._armed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-ec-served", daemon=True)
        self._thread.start()

    def _turn(self) -> float | None:
        try:
            return self._step()
        except Exception:  # never let a report kill the thread (or log per hit)
            log.debug("Served flush failed", exc_info=True)
            return None

    def _run(self) -> None:
        armed, stopping = self._armed, self._stopping
        while not stopping.is_set():
            flush_s = index_path.SERVED_FLUSH_S or 0.05  # the longest lingering sleep
            armed.wait(_IDLE_WAKE_S)
            armed.clear()  # before the step: a batch armed from now on wakes us again
            linger_end = time.monotonic() + _LINGER_S
            # the thread is awake a little past its last sleep's end at most
            self._awake_until = linger_end - flush_s
            while not stopping.is_set():
                delay = self._turn()
                if delay == GONE:
                    return
                if delay is not None:  # a batch is pending: sleep until it is due
                    linger_end = time.monotonic() + delay + _LINGER_S
                    self._awake_until = linger_end - flush_s
                elif time.monotonic() < linger_end:
                    delay = flush_s  # nothing pending: look again within flush_s
                else:
                    # Going idle: say so first, then look once more (a batch armed
                    # before the clear did not wake us, and is seen here).
                    self._awake_until = 0.0
                    delay = self._turn()
                    if delay is None:
                        break
                    if delay == GONE:
                        return
                    linger_end = time.monotonic() + delay + _LINGER_S
                    self._awake_until = linger_end - flush_s
                if stopping.wait(delay):
                    return

    def stop(self) -> None:
        """The client closes or is freed: the thread exits at its next wake-up. A
        client used again after close() arms (and so starts) it again."""
        self._stopping.set()
        self._forks = -1
