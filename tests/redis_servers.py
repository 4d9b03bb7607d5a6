"""Real redis-server processes for the remote-tier tests and benchmarks.

Everything listens on 127.0.0.1 or a Unix socket in a private directory. Each
server dies with the process that started it (PR_SET_PDEATHSIG), and ``stop``
removes its files, so an interrupted run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


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
    """One redis-server: a Unix socket and/or a 127.0.0.1 TCP port, optional AUTH and TLS.

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
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.dir = directory or tempfile.mkdtemp(prefix="ecb-redis-", dir="/tmp")
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
        auth = f":{self.password}@" if self.password and with_password else ""
        if transport == "unix":
            return f"unix://{auth}{self.unix_path}" + (f"?db={db}" if db else "")
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}{self.host_port}/{db}"

    # ------------------------------------------------------------ process

    def _argv(self) -> list[str]:
        assert REDIS_SERVER is not None
        argv = [
            REDIS_SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
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
                raise RuntimeError(f"redis-server did not start:\n{log}")
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
    """A Redis Cluster of ``masters`` nodes on 127.0.0.1, no replicas, all 16384 slots covered."""

    def __init__(self, masters: int = 3, password: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ecb-rcluster-", dir="/tmp")
        self.password = password
        self.nodes: list[RedisServer] = []
        try:
            for i in range(masters):
                d = os.path.join(self.dir, f"n{i}")
                os.mkdir(d)
                self.nodes.append(
                    RedisServer(password=password, cluster=True, unix=False, directory=d)
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
        auth = f":{self.password}@" if self.password and with_password else ""
        return "redis-cluster://" + auth + ",".join(n.host_port for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
