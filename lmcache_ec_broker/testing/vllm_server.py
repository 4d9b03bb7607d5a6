"""Start and talk to real ``vllm serve`` processes (tests, benchmarks, examples).

Servers run through :mod:`lmcache_ec_broker.testing.vllm_cli` in their own
process group, so ``stop()`` ends the API server and every engine/worker process
it spawned, and nothing else; then it removes the shared memory those processes
used and vLLM left in /dev/shm (see :mod:`lmcache_ec_broker.testing.shm_cleanup`).
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lmcache_ec_broker.testing.shm_cleanup import (
    all_pids,
    list_vllm_shm,
    process_group,
    remove_shm,
    vllm_shm_in_use,
)

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /reset_encoder_cache
}

# The worker's place. On a GPU, vLLM runs a one-rank engine's worker inside the
# EngineCore process (the "uni" executor); the CPU platform moves it to a process of
# its own ("mp") unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py), and
# that process costs a third import of vLLM per start (about 10 of 31 s on the 2-core
# CI host). So one-rank servers run the GPU's layout; a server started with an
# explicit executor or more than one rank keeps vLLM's own choice (the tests of the
# multiprocess executor ask for "mp").
IN_ENGINE_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_MULTI_RANK_FLAGS = (
    "--distributed-executor-backend",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


def worker_in_engine(args: list[str]) -> bool:
    """Whether a server with these arguments runs its worker inside the EngineCore."""
    return not any(a.split("=", 1)[0] in _MULTI_RANK_FLAGS for a in args)


SMALL_MODEL_ARGS = [
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "512",
    "--no-enable-prefix-caching",
    # An explicit KV size also skips the CPU worker's warm-up pass (faster start).
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--limit-mm-per-prompt",
    '{"image": 1, "video": 0}',
]


_ports_given: set[int] = set()


def free_port() -> int:
    """A port free now on 127.0.0.1, never one this process handed out before (the
    kernel may hand a just-closed port out again; two servers started together would
    then be told the same one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _ports_given:
            _ports_given.add(port)
            return port


def _listener_inodes(port: int) -> set[str]:
    """Socket inodes listening on 127.0.0.1:``port`` or a wildcard (from /proc/net)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, hexport = f[1].rsplit(":", 1)
            # 0A: LISTEN; a wildcard (all zeros) or 127.0.0.1 (plain or v4-mapped)
            if f[3] == "0A" and int(hexport, 16) == port:
                if set(addr) == {"0"} or addr.endswith("0100007F"):
                    found.add(f[9])
    return found


def _session_socket_inodes(sid: int) -> set[str]:
    """Socket inodes held by the processes of session ``sid`` (a server and its children)."""
    inodes: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getsid(int(pid)) != sid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


# For tests that assert a load or a remote hit (not the budgets themselves): on a loaded
# 2-core CI host a healthy broker's reply can take longer than the production budgets
# (50 ms scheduler, 200 ms worker), which opens the client's circuit and turns the
# expected load into a (correct) re-encode. The budgets are tested in tests/e2e. The
# hold bound of a staging likewise: the staging thread of a worker process niced beside
# CPU-bound neighbours can wait seconds for a core (CI's vllm half runs at nice 10).
SLOW_HOST_BUDGETS = {
    "scheduler_budget_ms": 2000,
    "worker_budget_ms": 2000,
    "stage_wait_ms": 10000,
}


def ec_transfer_config(
    role: str,
    socket_path: str,
    *,
    connector: str = "ECBrokerConnector",
    module: str = "lmcache_ec_broker.connector.vllm",
    **extra: Any,
) -> str:
    return json.dumps(
        {
            "ec_connector": connector,
            "ec_role": role,
            "ec_connector_module_path": module,
            "ec_connector_extra_config": {"socket_path": socket_path, **extra},
        }
    )


def png_data_url(seed: int, size: int = 112) -> str:
    """A deterministic, seed-specific PNG as a ``data:`` URL."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
            for y in range(size)
            for x in range(size)
        ]
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# The connector's log lines for a stored and a loaded entry (connector/vllm/connector.py).
EC_PUT_LINE = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")
EC_LOAD_LINE = re.compile(r"EC load: loaded (\d+) bytes for mm_hash=(\S+)")

# Several test or benchmark processes each starting vLLM servers on one small host
# exhaust its memory and thrash; the first server a process starts takes this lock
# and holds it until the process exits, so such processes run one after another.
_HOST_LOCK_PATH = os.environ.get("LMCACHE_EC_VLLM_LOCK", "/tmp/lmcache-ec-vllm-tests.lock")
_host_lock_fd: int | None = None


def _hold_host_lock() -> None:
    global _host_lock_fd
    if _host_lock_fd is not None or not _HOST_LOCK_PATH:
        return
    fd = os.open(_HOST_LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(
            f"waiting for another process's vLLM servers to finish (lock {_HOST_LOCK_PATH})",
            file=sys.stderr,
            flush=True,
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
    _host_lock_fd = fd
    # Processes this one starts from now on (a benchmark a test session runs) are
    # covered by this lock; if they waited for it they would wait for their parent,
    # which holds it until it exits: a deadlock.
    os.environ["LMCACHE_EC_VLLM_LOCK"] = ""


class VllmServer:
    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        ec_config: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.log_path = Path(log_path)
        self.args = [*SMALL_MODEL_ARGS, *(extra_args or [])]
        if ec_config is not None:
            self.args += ["--ec-transfer-config", ec_config]
        layout = IN_ENGINE_WORKER_ENV if worker_in_engine(self.args) else {}
        self.env = {**os.environ, **CPU_ENV, **layout, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        # vLLM-named /dev/shm entries this server's processes were seen using, and
        # those that existed before it started.
        self.shm_seen: set[str] = set()
        self._shm_before: set[str] = set()
        # vLLM's ZMQ IPC sockets (ipc://$VLLM_RPC_BASE_PATH/<uuid>) go to a directory
        # of this server's own, removed when it stops: in the default, /tmp, every
        # start left a few behind (thousands on a CI host). None while not running, or
        # when the caller's environment names its own directory.
        self.rpc_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        cmd = [
            sys.executable,
            "-m",
            "lmcache_ec_broker.testing.vllm_cli",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        _hold_host_lock()
        self._shm_before = list_vllm_shm()
        env = self.env
        if "VLLM_RPC_BASE_PATH" not in env:
            # short (a Unix socket path holds 107 bytes), under the system's temp dir
            self.rpc_dir = tempfile.mkdtemp(prefix="vllm-rpc-")
            env = {**env, "VLLM_RPC_BASE_PATH": self.rpc_dir}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 300.0, _retries: int = 2) -> VllmServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    healthy = r.status == 200
            except (urllib.error.URLError, OSError):
                healthy = False
            if healthy:
                if self._owns_port():
                    self.note_shm()
                    return self
                # Another process answers on our port (it took the port between our pick
                # and our bind): our requests would silently reach the wrong server.
                if _retries <= 0:
                    raise RuntimeError(f"port {self.port} is served by another process")
                self.stop()
                self.port = free_port()
                self.start()
                return self.wait_ready(max(deadline - time.monotonic(), 60.0), _retries - 1)
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {timeout}s:\n{self.log_tail()}")

    def _owns_port(self) -> bool:
        """The listener on our port belongs to this server's processes (its session)."""
        assert self.proc is not None
        listeners = _listener_inodes(self.port)
        return bool(listeners) and listeners <= _session_socket_inodes(self.proc.pid)

    def note_shm(self) -> None:
        """Record the vLLM shared memory this server's processes use now."""
        if self.proc is not None and self.proc.poll() is None:
            # start_new_session: the process group is this server's alone.
            self.shm_seen |= vllm_shm_in_use(process_group(self.proc.pid))

    def terminate(self) -> None:
        """Ask the API server to shut down (it stops its engine and workers)."""
        if self.proc is not None and self.proc.poll() is None:
            self.note_shm()
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is ours alone
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of this server's process group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        # Names this server's own processes used; then those that appeared while it
        # ran and no live process uses (a semaphore created after the last look, when
        # a slow shutdown ended in SIGKILL). Segments other programs use are never touched.
        remove_shm(self.shm_seen)
        appeared = list_vllm_shm() - self._shm_before
        if appeared:
            remove_shm(appeared - vllm_shm_in_use(all_pids()))
        if self.rpc_dir is not None:  # every process of the group is gone (above)
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        self.wait_stopped(timeout)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def ec_put_hashes(self) -> list[str]:
        """mm_hashes this server's connector stored, in order (repeats kept)."""
        return [h for _, h in EC_PUT_LINE.findall(self.log_text())]

    def ec_puts(self) -> dict[str, int]:
        """mm_hash -> bytes for every entry this server's connector stored."""
        return {h: int(n) for n, h in EC_PUT_LINE.findall(self.log_text())}

    def ec_loads(self) -> list[str]:
        """mm_hashes this server's connector loaded, in order."""
        return [h for _, h in EC_LOAD_LINE.findall(self.log_text())]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> bytes:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def chat_token_ids(
        self, image_url: str, text: str = "describe the image", max_tokens: int = 8
    ) -> list[int]:
        """Greedy completion for one image + text; the generated token ids."""
        return self.chat_parts_token_ids(
            [{"type": "image_url", "image_url": {"url": image_url}}], text, max_tokens
        )

    def chat_parts_token_ids(
        self,
        parts: list[dict[str, Any]],
        text: str = "describe it",
        max_tokens: int = 8,
        **request: Any,
    ) -> list[int]:
        """Greedy completion for media ``parts`` (see ``testing.media``) + text; the
        generated token ids. ``request`` adds top-level fields (``media_io_kwargs``)."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            **request,
        }
        reply = json.loads(self._post("/v1/chat/completions", body, timeout=300))
        content = reply["choices"][0]["logprobs"]["content"]
        return [int(item["token"].removeprefix("token_id:")) for item in content]

    def reset_encoder_cache(self) -> None:
        self._post("/reset_encoder_cache", None, timeout=30)

    def __enter__(self) -> VllmServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def last_model_field(log: str) -> str | None:
    """The model field the scheduler keys with now: the last one it logged (the first
    is the files and configuration; the encoder digest at load follows at once)."""
    fields = re.findall(r"EC broker: model field of the keys is (?:now )?(\S+)", log)
    return fields[-1] if fields else None
