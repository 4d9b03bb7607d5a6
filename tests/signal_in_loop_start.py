"""Runs a broker that receives SIGTERM inside its event loop's start-up.

The window: ``prepare()`` has bound the socket (clients can connect, so a
readiness probe passes) but ``serve()`` has not installed the loop's signal
handlers. In CI a SIGTERM once landed there, inside uvloop's own start-up code
(``Loop._run`` -> ``_setup_or_resume_signals`` -> a ``WeakValueDictionary``
lookup): an exception raised there leaves the loop half-started, and the broker
exited 1 with a traceback. This sends the signal from that lookup, the first
time it runs once the socket exists, so the landing spot is the same every run.

Usage: python tests/signal_in_loop_start.py SOCKET_PATH [extra start args]
"""

from __future__ import annotations

import os
import signal
import sys
import weakref

sock = sys.argv[1]
lookup = weakref.WeakValueDictionary.__getitem__
sent = False


def lookup_then_signal(self, key):  # type: ignore[no-untyped-def]
    global sent
    if not sent and os.path.exists(sock):
        sent = True
        os.kill(os.getpid(), signal.SIGTERM)  # its Python handler runs right here
    return lookup(self, key)


weakref.WeakValueDictionary.__getitem__ = lookup_then_signal  # type: ignore[method-assign]

from lmcache_ec_broker.cli import main  # noqa: E402

sys.exit(main(["start", "--socket", sock, "--shm-size", "64MiB", *sys.argv[2:]]))
