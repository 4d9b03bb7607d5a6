"""Command line: ``lmcache-ec-broker start | stop | stats | ping``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

from .config import default_socket_path, format_size, load_config, parse_size

if TYPE_CHECKING:
    from .connector.client import BrokerClient

METRICS_EXTRA = "pip install 'lmcache-ec-broker[metrics]' (from a clone: pip install '.[metrics]')"


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
        "--remote-url",
        help="shared remote tier: redis://host:port[/db], rediss://, unix:///path.sock, "
        "redis://h1:p1,h2:p2 (Cluster); password via remote_password_file, not here",
    )
    start.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )

    for name, text in (
        ("stop", "ask the broker on the socket to stop and wait until it is gone"),
        ("stats", "print the broker's counters"),
        ("ping", "exit 0 if a broker answers on the socket, 1 otherwise"),
    ):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--socket", dest="socket_path", help="Unix socket path")
        if name == "stats":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "stop":
            sp.add_argument(
                "--timeout",
                type=float,
                default=30.0,
                help="seconds to wait for the broker to finish (its disk flush included)",
            )
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
    "remote_url",
)


def _shown(name: str, value: object) -> str:
    """A config value as --print-config shows it: permission modes in octal."""
    if name.endswith("_mode") and isinstance(value, int):
        return f"0o{value:03o}"
    if name == "remote_url" and isinstance(value, str):
        from .broker.tiers.remote_url import mask_url

        return mask_url(value)
    return str(value)


def _metrics_missing() -> str | None:
    """Why metrics cannot be served (prometheus_client absent), or None."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


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
            print(f"{name:22} {_shown(name, value):40} ({sources.get(name, 'default')})")
        return 0
    if cfg.metrics_port:
        # Checked before anything exists: the broker would otherwise fail half-way
        # through its start with the segment already made.
        missing = _metrics_missing()
        if missing is not None:
            print(
                f"lmcache-ec-broker: metrics_port {cfg.metrics_port} "
                f"({sources.get('metrics_port', 'default')}) needs prometheus_client, which "
                f"cannot be imported ({missing}); install the metrics extra: {METRICS_EXTRA}, "
                "or leave metrics off (metrics_port 0)",
                file=sys.stderr,
            )
            return 2
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


class _Held(logging.Handler):
    """Keeps the client library's warnings instead of printing them: its wording
    ("serving misses and retrying in the background") is for a long-lived process,
    not for a one-shot command, which says what happened in its own words."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def causes(self) -> list[BaseException]:
        args = [r.args for r in self.records if isinstance(r.args, tuple)]
        return [a for tup in args for a in tup if isinstance(a, BaseException)]


def _start_hint(path: str) -> str:
    flag = "" if path == default_socket_path() else f" --socket {path}"
    return (
        f"start one with `lmcache-ec-broker start{flag}` (it runs in the foreground: use "
        "another terminal), or point --socket at a running one"
    )


def _no_broker(path: str, causes: list[BaseException]) -> str:
    from .connector.client import BrokerImpostor

    cause = causes[0] if causes else None
    if isinstance(cause, BrokerImpostor):
        return f"lmcache-ec-broker: not talking to the process at {path}: {cause}"
    if isinstance(cause, FileNotFoundError) or (cause is None and not os.path.exists(path)):
        why = "there is no socket there"
    elif isinstance(cause, ConnectionRefusedError):
        why = "the socket is left over from a broker that is no longer running"
    elif isinstance(cause, PermissionError):
        return (
            f"lmcache-ec-broker: cannot connect to the broker at {path}: permission denied for "
            f"uid {os.getuid()}; its socket_mode/socket_group or allowed_uids must admit you"
        )
    elif isinstance(cause, TimeoutError | socket.timeout):
        why = "it did not answer in time"
    elif cause is not None:
        why = str(cause)
    else:
        why = "it did not answer"
    return f"lmcache-ec-broker: no broker answers at {path}: {why}; {_start_hint(path)}"


def _client(args: argparse.Namespace, timeout: float = 2.0) -> BrokerClient | None:
    """A connected client, or None after saying on stderr why there is none."""
    from .connector.client import BrokerClient, BrokerRefused

    path = args.socket_path or default_socket_path()
    held = _Held()
    logger = logging.getLogger("lmcache_ec_broker")
    logger.addHandler(held)
    try:
        try:
            c = BrokerClient(path, timeout_s=timeout, connect_timeout_s=timeout)
        except BrokerRefused as exc:
            print(
                f"lmcache-ec-broker: the broker at {path} refused: {exc.message}", file=sys.stderr
            )
            return None
        if not c.connected:
            c.close()
            print(_no_broker(path, held.causes()), file=sys.stderr)
            return None
        return c
    finally:
        logger.removeHandler(held)


def _stats(args: argparse.Namespace) -> int:
    c = _client(args)
    if c is None:
        return 1
    stats = c.stats()
    c.close()
    if not stats:
        print(_no_broker(c.socket_path, []), file=sys.stderr)
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
    if c is None:
        return 1
    ok = c.ping()
    epoch = c.epoch
    c.close()
    if ok:
        print(f"ok: broker on {c.socket_path} (epoch {epoch[:12] if epoch else '?'})")
        return 0
    print(_no_broker(c.socket_path, []), file=sys.stderr)
    return 1


def _socket_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stop(args: argparse.Namespace) -> int:
    """Stop through the protocol, never by signalling a pid: the pid a broker reports
    is in its own pid namespace, which may not be ours (a DaemonSet and its sidecars).
    The broker removes its socket as the last step of its shutdown (after the disk
    flush), so the socket being gone, or replaced by a new broker's, means done."""
    from .connector.client import BrokerRefused

    c = _client(args)
    if c is None:
        return 1
    path = c.socket_path
    before = _socket_id(path)
    try:
        accepted = c.shutdown()
    except BrokerRefused as exc:
        print(
            f"lmcache-ec-broker: the broker at {path} refused to stop: {exc.message}",
            file=sys.stderr,
        )
        return 1
    finally:
        c.close()
    if not accepted:
        print(
            f"lmcache-ec-broker: the broker at {path} went away before it accepted the stop "
            "request; run `lmcache-ec-broker ping` to see whether it still answers",
            file=sys.stderr,
        )
        return 1
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        now = _socket_id(path)
        if now is None or now != before:
            print(f"stopped the broker at {path}")
            return 0
        time.sleep(0.05)
    print(
        f"lmcache-ec-broker: the broker at {path} accepted the stop request but has not "
        f"removed its socket within {args.timeout:g}s; it may still be flushing its disk tier "
        "(see shutdown_flush_s) or have died mid-shutdown: read its log, or wait longer "
        "with --timeout",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"start": _start, "stop": _stop, "stats": _stats, "ping": _ping}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
