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
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often an idle flusher wakes to notice that its client was freed.
_IDLE_WAKE_S = 1.0
GONE = -1.0  # what a step returns once the client is gone: the thread exits


class ServedFlusher:
    """The thread that sends a due Served batch. ``step()`` (the client's, weakly
    bound) sends what is due and returns the seconds until it should run again, None
    when nothing is pending, or GONE."""

    __slots__ = ("_step", "_armed", "_stopping", "_thread", "_pid")

    def __init__(self, step: Callable[[], float | None]) -> None:
        self._step = step
        self._armed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = -1

    def arm(self) -> None:
        """A batch became non-empty (ServedBatch.note, with the client's lock held)."""
        if self._pid != os.getpid():  # first arm, or a forked child (no thread there)
            self._start()
        self._armed.set()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._armed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-ec-served", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        armed, stopping, step = self._armed, self._stopping, self._step
        while not stopping.is_set():
            armed.wait(_IDLE_WAKE_S)
            armed.clear()  # before the step: a batch armed from now on wakes us again
            while not stopping.is_set():
                try:
                    delay = step()
                except Exception:  # never let a report kill the thread (or log per hit)
                    log.debug("Served flush failed", exc_info=True)
                    delay = None
                if delay is None:
                    break
                if delay == GONE or stopping.wait(delay):
                    return

    def stop(self) -> None:
        """The client closes or is freed: the thread exits at its next wake-up. A
        client used again after close() arms (and so starts) it again."""
        self._stopping.set()
        self._pid = -1
