"""Runs a broker that receives SIGTERM the moment its socket listens.

The window: ``bind_socket`` has bound and is listening (a readiness probe connects)
but ``prepare()`` has not kept the socket yet. A SIGTERM there raises ``SystemExit``
inside ``prepare()``; its clean-up found no socket to remove and the socket file
stayed behind (a CI failure: "brokers left behind" after a stop at readiness).

Usage: python tests/signal_at_bind.py SOCKET_PATH
"""

from __future__ import annotations

import os
import signal
import sys

import lmcache_ec_broker.broker.server as server

bind = server.bind_socket


def bind_then_signal(*args, **kwargs):  # type: ignore[no-untyped-def]
    sock = bind(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # its Python handler runs right here
    return sock


server.bind_socket = bind_then_signal

from lmcache_ec_broker.cli import main  # noqa: E402

sys.exit(main(["start", "--socket", sys.argv[1], "--shm-size", "16MiB"]))
