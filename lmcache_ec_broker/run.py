"""The broker process, top-down: a ``BrokerServer`` with the add-ons its config asks for
(the metrics endpoint, the residency events), run until SIGTERM/SIGINT or a Shutdown
request, then cleaned up. It stands above both ``broker/`` and ``events/``.

The server imports neither add-on: it hands itself to each one in ``prepare`` (after
the slab and its indexes exist, before the tiers open and the socket is bound, so a
refusal precedes readiness), and an add-on plugs in through the server's hooks
(``observers``, ``stats_providers``, ``shutdown_hooks``) and the store's and the
coordinator's ``observer``. Adding one means a branch in ``add_ons``, nothing in the
server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from .broker.server import AddOn, BrokerServer
from .config import BrokerConfig
from .cpu_group import shared_cpu_group

log = logging.getLogger(__name__)


def add_ons(config: BrokerConfig) -> list[AddOn]:
    """What ``config`` turns on, in start order."""
    out: list[AddOn] = []
    if config.metrics_port:
        out.append(_metrics)
    if config.events_port or config.events_lookup_port:  # residency events (docs/events.md)
        out.append(_events)
    return out


def _metrics(server: BrokerServer) -> None:
    from .broker.metrics import start  # prometheus_client: imported only when metrics are on

    start(server)


def _events(server: BrokerServer) -> None:
    from .events.install import install

    install(server)  # BrokerError naming the fix if it cannot start


def sched_batch() -> bool:
    """Make this process's threads (and every thread started later) SCHED_BATCH: woken by a client's
    frame, the broker then never preempts the client that sent it (Linux applies
    wakeup preemption to SCHED_NORMAL tasks only); no privilege is needed. False, with
    a warning, where the platform refuses."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        # threads some import already started (Linux: a thread id is a pid here)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:
                pass  # it ended meanwhile
    except (AttributeError, OSError) as exc:
        log.warning("sched_batch: cannot make the broker SCHED_BATCH (%s); it runs as before", exc)
        return False
    log.info("sched_batch: the broker's threads run SCHED_BATCH")
    return True


def run_broker(config: BrokerConfig) -> int:
    """Start, serve until SIGTERM/SIGINT or a Shutdown request, clean up; the exit code."""
    if config.sched_batch:
        sched_batch()  # first: every thread started from here on inherits the policy
    group = shared_cpu_group()
    if group is not None:
        log.info(
            "the broker shares the CPU scheduling group of session %d (%s, Linux autogroup) "
            "with the processes that started it: a CPU-bound process of that session delays "
            "its answers, past the clients' budgets on a busy host; run it as a service "
            "(systemd, a container) or under setsid (docs/operations.md)",
            os.getsid(0),
            group,
        )
    server = BrokerServer(config, add_ons(config))
    prepared = False

    def stop_during_startup(signum: int, frame: object) -> None:
        if not prepared:
            raise SystemExit(0)  # prepare() cleans up; the slab, a memfd, goes with us
        # Between prepare() and the loop's own handlers: raising here would land inside
        # the event loop's start-up and break it (exit 1, a traceback); serve() stops
        # as soon as its handlers are in.
        server.stop_signal = signum

    # Until the loop installs its own handlers: the default SIGTERM action would skip
    # the clean-up (the socket, the lock; a named segment once, in /dev/shm).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    try:  # a stop right after prepare() returns still cleans up (cleanup is idempotent)
        server.prepare()
        prepared = True
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        runner(server.serve())
    finally:
        server.cleanup()
    return 0
