"""Command line: ``lmcache-ec-broker start | stop | stats | ping | clear``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
import time
from typing import TYPE_CHECKING

from .config import LOG_LEVELS
from .config_sources import SIZE_FIELDS, load_config
from .peercred import peer_cred
from .private_dirs import default_socket_path
from .sizes import format_size, parse_size

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
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    start = sub.add_parser(
        "start", help="run the broker in the foreground (SIGTERM/SIGINT stop it)"
    )
    start.add_argument(
        "--config", help="YAML file (LMCache keys accepted); default $LMCACHE_CONFIG_FILE"
    )
    start.add_argument("--socket", dest="socket_path", help="Unix socket path")
    start.add_argument(
        "--shm-size",
        type=_size,
        help="slab size: 512MiB, 2GiB, 2GB (decimal: 2*10^9 bytes), or a plain number of GiB",
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
        "--max-pins-per-connection",
        type=int,
        help="most get() pins one connection may hold unreleased (default 65536)",
    )
    start.add_argument(
        "--max-leases-per-connection",
        type=int,
        help="most has()/lookup() leases one connection may hold (default 65536)",
    )
    start.add_argument(
        "--max-reserved-per-connection",
        dest="max_reserved_bytes_per_connection",
        type=_bytes,
        help="slab one connection's open reservations may hold, e.g. 512MiB "
        "(default 0: a quarter of the slab)",
    )
    start.add_argument(
        "--put-arena-size",
        dest="put_arena_bytes",
        type=_bytes,
        help="slab one connection may hold for puts that wait for no reply, e.g. 8MiB "
        "(default; 0: every put reserves)",
    )
    start.add_argument(
        "--sched-batch",
        action="store_true",
        default=None,
        help="run the broker's threads SCHED_BATCH: a client's posted put no longer wakes "
        "the broker into preempting it (off by default; docs/performance.md)",
    )
    start.add_argument(
        "--local-disk", help="directory (or file:// URL) of the disk tier; off by default"
    )
    start.add_argument("--max-local-disk-size", type=_size, help="disk tier capacity")
    start.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: off)")
    start.add_argument(
        "--metrics-host",
        help="address the Prometheus endpoint binds (default 127.0.0.1: this host only; "
        "0.0.0.0 for a cluster's scraper)",
    )
    start.add_argument("--log-level", help=", ".join(LOG_LEVELS) + " (default INFO)")
    start.add_argument(
        "--remote-url",
        help="shared remote tier: redis://host:port[/db], rediss:// (TLS), valkey://, "
        "valkeys://, unix:///path.sock, redis://h1:p1,h2:p2 (Cluster), "
        "mooncakestore://master:port (Mooncake Store); password via remote_password_file, "
        "not here",
    )
    start.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )

    for name, text in (
        ("stop", "ask the broker on the socket to stop and wait until its process is gone"),
        ("stats", "print the broker's counters"),
        (
            "ping",
            "exit 0 if a broker answers on the socket, 1 otherwise; says whether its remote "
            "tier is up",
        ),
        ("clear", "empty the broker's slab and disk tier (owner or root only)"),
    ):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--socket", dest="socket_path", help="Unix socket path")
        sp.add_argument(
            "--reply-timeout",
            type=_positive_seconds,
            default=2.0,
            metavar="SECONDS",
            help="how long to wait for the broker to connect and answer each request "
            "(default 2; on a busy host a live broker can take longer, and a readiness "
            "probe wants it below the probe's own timeout)",
        )
        if name == "stats":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "ping":
            sp.add_argument(
                "--require-remote",
                action="store_true",
                help="also exit 1 when the broker's configured remote tier is down (for a "
                "readiness probe that should keep a node out of service without it)",
            )
        if name == "clear":
            sp.add_argument(
                "--shared",
                action="store_true",
                help="also remove the broker's key prefix from the shared remote store, for "
                "every broker using it (says what it would remove unless --yes)",
            )
            sp.add_argument("--yes", action="store_true", help="confirm --shared")
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
    "max_pins_per_connection",
    "max_leases_per_connection",
    "max_reserved_bytes_per_connection",
    "put_arena_bytes",
    "sched_batch",
    "local_disk",
    "max_local_disk_size",
    "metrics_port",
    "metrics_host",
    "log_level",
    "remote_url",
)


def _version() -> str:
    from . import __version__

    return __version__


def _shown(name: str, value: object) -> str:
    """A config value as --print-config shows it: permission modes in octal, sizes as
    `stats` shows them (with the exact bytes when the rounding hides some)."""
    if name.endswith("_mode") and isinstance(value, int):
        return f"0o{value:03o}"
    if name in SIZE_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        if value == 0:
            return "0"
        shown = format_size(value)
        number, _, unit = shown.partition(" ")
        exact = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}.get(unit, 1)
        return shown if float(number) * exact == value else f"{shown} ({value} bytes)"
    if name in ("remote_url", "mooncake_metadata_server") and isinstance(value, str):
        from .remote_url import mask_url

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
    from .broker.lifecycle import BrokerError
    from .run import run_broker
    from .shm.segment import ShmError

    cli = {k: getattr(args, k) for k in _START_KEYS}
    notes = _ConfigNotes()
    try:
        with notes:
            cfg, sources = load_config(cli, args.config or os.environ.get("LMCACHE_CONFIG_FILE"))
    except (ValueError, OSError) as exc:
        notes.print_to_stderr()
        print(f"lmcache-ec-broker: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        notes.print_to_stderr()
        import msgspec

        values = msgspec.structs.asdict(cfg)
        width = max(map(len, values))
        shown = {name: _shown(name, value) for name, value in values.items()}
        vwidth = min(max(map(len, shown.values())), 48)
        for name, text in shown.items():
            print(f"{name:{width}}  {text:{vwidth}}  ({sources.get(name, 'default')})")
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
        level=cfg.log_level.upper(),  # a known level name: validated by load_config
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    notes.replay()
    try:
        return run_broker(cfg)
    except (BrokerError, ShmError) as exc:
        print(f"lmcache-ec-broker: {exc}", file=sys.stderr)
        return 1


class _ConfigNotes(logging.Handler):
    """What the configuration says while it loads (LMCache keys it ignores, retired
    keys), kept until logging is set up from it, then logged with the broker's own
    format and level (``replay``): said before logging starts, an info line would be
    lost and a warning printed without time or source."""

    _LOGGER = "lmcache_ec_broker.config"

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _ConfigNotes:
        logger = logging.getLogger(self._LOGGER)
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def replay(self) -> None:
        for record in self.records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)

    def print_to_stderr(self) -> None:
        for record in self.records:
            print(f"lmcache-ec-broker: {record.getMessage()}", file=sys.stderr)


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


def _no_broker(path: str, causes: list[BaseException], timeout: float) -> str:
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
    elif cause is None or isinstance(cause, TimeoutError | socket.timeout):
        return (
            f"lmcache-ec-broker: the broker at {path} did not answer within {timeout:g} s; if "
            "it is busy (a loaded host), wait longer with --reply-timeout SECONDS"
        )
    else:
        why = str(cause)
    return f"lmcache-ec-broker: no broker answers at {path}: {why}; {_start_hint(path)}"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def _client(args: argparse.Namespace) -> BrokerClient | None:
    """A connected client, or None after saying on stderr why there is none."""
    from .connector.client import BrokerClient, BrokerRefused

    path = args.socket_path or default_socket_path()
    timeout = args.reply_timeout
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
            print(_no_broker(path, held.causes(), timeout), file=sys.stderr)
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
        print(_no_broker(c.socket_path, [], args.reply_timeout), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    width = max(map(len, stats), default=0)
    for key in sorted(stats, key=_natural):
        value = stats[key]
        shown = format_size(value) if key.endswith("_bytes") and isinstance(value, int) else value
        print(f"{key:{width}}  {shown}")
    return 0


def _natural(key: str) -> tuple:
    """Sort key reading digit runs as numbers: le_2 before le_10, le_inf after them."""
    parts = re.split(r"(\d+)", key)
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def remote_state(stats: dict) -> tuple[str, bool | None, str]:
    """(store as shown, up, reason) of the broker's remote tier; up is None when no
    remote tier is configured. The reason is the one `stats` gives (auth refused,
    connection refused, TLS, timeout...), or "not connected yet" before the first try."""
    store = stats.get("remote_store")
    if not store:
        return "", None, ""
    if stats.get("remote_up", 0):
        return str(store), True, ""
    return str(store), False, str(stats.get("remote_down_reason") or "not connected yet")


def _ping(args: argparse.Namespace) -> int:
    c = _client(args)
    if c is None:
        return 1
    ok = c.ping()
    epoch = c.epoch
    stats = c.stats() if ok else {}
    c.close()
    if not ok or not stats:
        print(_no_broker(c.socket_path, [], args.reply_timeout), file=sys.stderr)
        return 1
    store, up, reason = remote_state(stats)
    where = f"broker on {c.socket_path} (epoch {epoch[:12] if epoch else '?'})"
    if up is None:
        remote = "remote tier: none configured"
    elif up:
        remote = f"remote tier {store}: up"
    else:
        remote = f"remote tier {store}: down ({reason})"
    if up is False and args.require_remote:
        print(
            f"lmcache-ec-broker: not ready: the {where} answers, but its {remote}; "
            "`lmcache-ec-broker stats` shows remote_down_reason, the broker's log says how "
            "to fix it (drop --require-remote to accept a broker serving without it)",
            file=sys.stderr,
        )
        return 1
    print(f"ok: {where}; {remote}")
    return 0


def _socket_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _broker_process(path: str) -> tuple[int, str] | None:
    """(pid, start time) of the process listening on ``path`` as this pid namespace
    sees it, or None when it is not visible here (another pid namespace: the kernel
    reports pid 0). The start time tells the broker from a later process reusing its pid."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
        pid = peer_cred(s)[0]
    except OSError:
        return None
    finally:
        s.close()
    started = _start_time(pid) if pid > 0 else None
    return None if started is None else (pid, started)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time), None if the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # bytes: no codec import needed
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


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
    proc = _broker_process(path)
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
            return _wait_exit(path, proc, deadline)
        time.sleep(0.05)
    print(
        f"lmcache-ec-broker: the broker at {path} accepted the stop request but has not "
        f"removed its socket within {args.timeout:g}s; it may still be flushing its disk tier "
        "(see shutdown_flush_s) or have died mid-shutdown: read its log, or wait longer "
        "with --timeout",
        file=sys.stderr,
    )
    return 1


def _wait_exit(path: str, proc: tuple[int, str] | None, deadline: float) -> int:
    """The socket is gone (the broker's last shutdown step); wait for its process too,
    when this pid namespace can see it."""
    if proc is None:
        print(
            f"stopped the broker at {path}: its socket is removed; its process is not "
            "visible from here (another pid namespace) and exits within a few seconds"
        )
        return 0
    pid, started = proc
    while _start_time(pid) == started:
        if time.monotonic() >= deadline:
            print(
                f"lmcache-ec-broker: the broker at {path} removed its socket but its process "
                f"(pid {pid}) has not exited yet; it may be stuck: read its log, or kill {pid}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    print(f"stopped the broker at {path} (pid {pid} exited)")
    return 0


def _clear(args: argparse.Namespace) -> int:
    """Empty the broker's local tiers, or with --shared also its prefix in the remote
    store, which every broker using that prefix loses too: --shared first says what
    it would remove and does it only with --yes."""
    from .connector.client import BrokerRefused

    c = _client(args)
    if c is None:
        return 1
    try:
        before = c.stats()
        if not before:  # it went away after connecting
            print(_no_broker(c.socket_path, [], args.reply_timeout), file=sys.stderr)
            return 1
        store = before.get("remote_store")
        prefix = before.get("remote_key_prefix")
        if args.shared and not store:
            print(
                f"lmcache-ec-broker: the broker at {c.socket_path} has no remote tier; "
                "run `lmcache-ec-broker clear` without --shared",
                file=sys.stderr,
            )
            return 2
        if args.shared and not args.yes:
            print(
                f"this would remove every key under {prefix!r} in {store}: the entries of "
                f"every broker using that prefix, not only this one's ({c.socket_path}), "
                "plus this broker's slab and disk tier. Run again with --yes to do it.",
                file=sys.stderr,
            )
            return 2
        try:
            done = c.clear(shared=args.shared)
        except BrokerRefused as exc:
            print(
                f"lmcache-ec-broker: the broker at {c.socket_path} refused to clear: {exc.message}",
                file=sys.stderr,
            )
            return 1
    finally:
        c.close()
    if not done:
        print(_no_broker(c.socket_path, [], args.reply_timeout), file=sys.stderr)
        return 1
    disk = before.get("disk_entries", 0)
    what = f"{before.get('entries', 0)} slab entries" + (
        f" and {disk} disk entries" if disk else ""
    )
    if args.shared:
        print(f"cleared {what}, and every key under {prefix!r} in {store}")
    elif store:
        print(
            f"cleared {what}; the remote store ({store}, prefix {prefix!r}) is kept "
            "(clear --shared removes it)"
        )
    else:
        print(f"cleared {what}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"start": _start, "stop": _stop, "stats": _stats, "ping": _ping, "clear": _clear}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
