"""Command line: ``lmcache-ec-broker start | stop | stats | ping``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from .config import format_size, load_config, parse_size


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _bytes(value: str) -> int:
    """Like _size, but a plain number is bytes (as for these keys in YAML and env)."""
    try:
        return parse_size(value, plain_unit=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _octal(value: str) -> int:
    try:
        return int(value, 8)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an octal mode like 0660") from exc


def _uids(value: str) -> list[int]:
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of uids like 1000,1001") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-ec-broker",
        description="Node-local, multi-process encoder cache for vLLM.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    start = sub.add_parser(
        "start", help="run the broker in the foreground (SIGTERM/SIGINT stop it)"
    )
    start.add_argument(
        "--config", help="YAML file (LMCache keys accepted); default $LMCACHE_CONFIG_FILE"
    )
    start.add_argument("--socket", dest="socket_path", help="Unix socket path")
    start.add_argument(
        "--shm-size", type=_size, help="slab size: 512MiB, 2GiB, or a plain number of GiB"
    )
    start.add_argument("--block-size", type=_bytes, help="allocation block size, e.g. 64KiB")
    start.add_argument(
        "--max-entry-size", type=_bytes, help="largest accepted entry (default: the slab)"
    )
    start.add_argument(
        "--socket-mode", type=_octal, help="socket and segment permissions (default 0600)"
    )
    start.add_argument(
        "--socket-group", help="group that may use the socket (with --socket-mode 0660)"
    )
    start.add_argument(
        "--allowed-uids",
        type=_uids,
        help="comma-separated uids admitted besides the owner and root (e.g. 1000,1001)",
    )
    start.add_argument("--max-key-length", type=int, help="longest accepted key (characters)")
    start.add_argument(
        "--max-frame-size",
        dest="max_frame_bytes",
        type=_bytes,
        help="largest accepted control message, e.g. 1MiB",
    )
    start.add_argument("--max-connections", type=int, help="most clients served at once")
    start.add_argument(
        "--local-disk", help="directory (or file:// URL) of the disk tier; off by default"
    )
    start.add_argument("--max-local-disk-size", type=_size, help="disk tier capacity")
    start.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: off)")
    start.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    start.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )

    for name, text in (
        ("stop", "stop the broker on the socket (SIGTERM) and wait for it to exit"),
        ("stats", "print the broker's counters"),
        ("ping", "exit 0 if a broker answers on the socket, 1 otherwise"),
    ):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--socket", dest="socket_path", help="Unix socket path")
        if name == "stats":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "stop":
            sp.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    return p


_START_KEYS = (
    "socket_path",
    "shm_size",
    "block_size",
    "max_entry_size",
    "socket_mode",
    "socket_group",
    "allowed_uids",
    "max_key_length",
    "max_frame_bytes",
    "max_connections",
    "local_disk",
    "max_local_disk_size",
    "metrics_port",
    "log_level",
)


def _start(args: argparse.Namespace) -> int:
    from .broker.server import BrokerError, run_broker
    from .shm.segment import ShmError

    cli = {k: getattr(args, k) for k in _START_KEYS}
    try:
        cfg, sources = load_config(cli, args.config or os.environ.get("LMCACHE_CONFIG_FILE"))
    except (ValueError, OSError) as exc:
        print(f"lmcache-ec-broker: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        import msgspec

        for name, value in msgspec.structs.asdict(cfg).items():
            print(f"{name:22} {value!s:40} ({sources.get(name, 'default')})")
        return 0
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return run_broker(cfg)
    except (BrokerError, ShmError) as exc:
        print(f"lmcache-ec-broker: {exc}", file=sys.stderr)
        return 1


def _client(args: argparse.Namespace, timeout: float = 2.0):
    from .connector.client import BrokerClient

    return BrokerClient(args.socket_path, timeout_s=timeout, connect_timeout_s=timeout)


def _stats(args: argparse.Namespace) -> int:
    c = _client(args)
    stats = c.stats()
    c.close()
    if not stats:
        print(f"lmcache-ec-broker: no broker answers on {c.socket_path}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    for key in sorted(stats):
        value = stats[key]
        shown = format_size(value) if key.endswith("_bytes") and isinstance(value, int) else value
        print(f"{key:24} {shown}")
    return 0


def _ping(args: argparse.Namespace) -> int:
    c = _client(args)
    ok = c.ping()
    epoch = c.epoch
    c.close()
    if ok:
        print(f"ok: broker on {c.socket_path} (epoch {epoch[:12] if epoch else '?'})")
        return 0
    print(f"lmcache-ec-broker: no broker answers on {c.socket_path}", file=sys.stderr)
    return 1


def _stop(args: argparse.Namespace) -> int:
    c = _client(args)
    stats = c.stats()
    c.close()
    if not stats:
        print(f"lmcache-ec-broker: no broker answers on {c.socket_path}", file=sys.stderr)
        return 1
    pid = int(stats["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"stopped broker pid {pid}")
            return 0
        if not os.path.exists(c.socket_path):
            print(f"stopped broker pid {pid}")
            return 0
        time.sleep(0.05)
    print(
        f"lmcache-ec-broker: broker pid {pid} did not exit within {args.timeout}s", file=sys.stderr
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"start": _start, "stop": _stop, "stats": _stats, "ping": _ping}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
