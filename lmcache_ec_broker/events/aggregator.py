"""``lmcache-ec-aggregator``: follow many brokers' residency events and answer lookups
for the fleet over HTTP/JSON (``lookup_http.py``; bound to 127.0.0.1 by default, as
the brokers' metrics endpoint).

    lmcache-ec-aggregator --broker tcp://node-a:5557 --broker tcp://node-b:5557 --port 8790
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .lookup_http import LookupServer
from .subscriber import Subscriber, replay_endpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-ec-aggregator",
        description="Follow brokers' encoder-cache residency events; serve /v1/lookup.",
    )
    p.add_argument(
        "--broker",
        action="append",
        required=True,
        metavar="tcp://HOST:PORT",
        help="a broker's events endpoint (its events_host:events_port); repeat per broker",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8790, help="HTTP port (default 8790)")
    p.add_argument(
        "--down-after",
        type=float,
        default=3.0,
        help="seconds without any event or heartbeat after which a broker's entries are "
        "dropped (default 3; keep it a few times the brokers' events_heartbeat_s)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        for ep in args.broker:
            replay_endpoint(ep)
        if not 0 < args.down_after <= 3600:
            raise ValueError(f"--down-after must be in (0, 3600] seconds, got {args.down_after}")
    except ValueError as exc:
        print(f"lmcache-ec-aggregator: {exc}", file=sys.stderr)
        return 2
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        print(
            f"lmcache-ec-aggregator: needs pyzmq ({exc}); pip install 'lmcache-ec-broker[events]'",
            file=sys.stderr,
        )
        return 2
    sub = Subscriber(args.broker, args.down_after)
    try:
        http = LookupServer(args.host, args.port, sub.lookup, sub.nodes)
    except OSError as exc:
        sub.close()
        print(
            f"lmcache-ec-aggregator: cannot serve on {args.host}:{args.port}: {exc}; "
            "choose another --port",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sub.start()
    http.start()
    logging.getLogger("lmcache_ec_broker.events").info(
        "aggregating %d brokers; lookups on http://%s:%d/v1/lookup",
        len(args.broker),
        args.host,
        http.port,
    )
    print(f"ready http://{args.host}:{http.port}", flush=True)
    stop.wait()
    http.close()
    sub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
