"""A real Mooncake Store confined to loopback, for the Mooncake remote-tier tests.

Mooncake's transfer engine advertises and listens on the host's interfaces, so
nothing of it runs in the host's network namespace: ``MooncakeNetns`` makes a
private named namespace (``ip netns add``) in which only ``lo`` exists, and the
master, the brokers and every Mooncake client run inside it. The test process
stays outside and talks to the brokers over their Unix sockets (path-based
sockets and /dev/shm are not network-namespaced). ``listeners()`` shows what
listens inside; ``host_listeners()`` lets a test prove nothing listens outside.

Every process started here dies with the test process (PR_SET_PDEATHSIG) and
``close()`` kills them and deletes the namespace, so an interrupted run leaves
neither processes nor namespaces behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

IP = shutil.which("ip")
SS = shutil.which("ss")
MASTER_PORT = 50051
ADMIN_PORT = 9003  # the master's metrics/admin HTTP port (also lists keys)


def mooncake_master_binary() -> str | None:
    """The master shipped inside the ``mooncake-transfer-engine-non-cuda`` wheel."""
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return str(path) if path.is_file() else None


def unavailable_reason() -> str | None:
    """Why these tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if IP is None or SS is None:
        return "iproute2 (ip, ss) is not installed"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"Mooncake is not installed (pip install 'lmcache-ec-broker[mooncake]'): {exc}"
    if mooncake_master_binary() is None:
        return "the mooncake package ships no mooncake_master binary"
    return None


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class MooncakeNetns:
    """A private network namespace with only ``lo`` (up), and the processes run in it."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.name = f"ecb-mc-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        subprocess.run([IP, "netns", "add", self.name], check=True, capture_output=True)
        try:
            self.exec_argv(["ip", "link", "set", "lo", "up"], check=True)
        except BaseException:
            self.close()
            raise

    def prefix(self) -> list[str]:
        assert IP is not None
        return [IP, "netns", "exec", self.name]

    def exec_argv(self, argv: Sequence[str], check: bool = False, timeout: float = 30):
        return subprocess.run(
            [*self.prefix(), *argv], capture_output=True, text=True, check=check, timeout=timeout
        )

    def popen(self, argv: Sequence[str], log_path: str | None = None, env=None):
        """Start ``argv`` inside the namespace (``ip netns exec`` execs it: same pid)."""
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                [*self.prefix(), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        finally:
            if log_path:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def listeners(self) -> str:
        """``ss -ltnp`` inside the namespace."""
        return self.exec_argv([SS or "ss", "-Hltnp"]).stdout

    @staticmethod
    def host_listeners() -> str:
        """``ss -ltnp`` in the test's own (host) namespace."""
        return subprocess.run([SS or "ss", "-Hltnp"], capture_output=True, text=True).stdout

    def interfaces(self) -> list[str]:
        out = self.exec_argv(["ip", "-o", "link", "show"]).stdout
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line]

    def http_get(self, url: str, timeout: float = 5) -> str:
        """GET an address inside the namespace (Python, so no curl is needed)."""
        code = (
            "import sys, urllib.request;"
            f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout={timeout}).read()"
            ".decode('utf-8', 'replace'))"
        )
        out = self.exec_argv([sys.executable, "-c", code], timeout=timeout + 10)
        if out.returncode != 0:
            raise RuntimeError(f"GET {url} failed: {out.stderr.strip()[-500:]}")
        return out.stdout

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                self.kill(proc)
        self.procs.clear()
        subprocess.run([IP or "ip", "netns", "del", self.name], capture_output=True)

    def __enter__(self) -> MooncakeNetns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MooncakeMaster:
    """``mooncake_master`` inside a namespace, on 127.0.0.1 only (RPC and admin port).

    Started in P2P-handshake mode (no HTTP metadata server, so no port 8080).
    ``restart()`` starts it again on the same port: empty, as after a crash.
    """

    def __init__(self, ns: MooncakeNetns, log_dir: str, lease_ttl_ms: int | None = None) -> None:
        self.ns = ns
        self.log_path = os.path.join(log_dir, "mooncake_master.log")
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{MASTER_PORT}"

    @property
    def url(self) -> str:
        return f"mooncakestore://{self.address}"

    def start(self, timeout: float = 30) -> None:
        binary = mooncake_master_binary()
        assert binary is not None
        argv = [
            binary, "-rpc_address=127.0.0.1", f"-rpc_port={MASTER_PORT}",
            "-metrics_host=127.0.0.1", f"-metrics_port={ADMIN_PORT}", "-logtostderr",
        ]  # fmt: skip
        if self.lease_ttl_ms is not None:
            argv.append(f"-default_kv_lease_ttl={self.lease_ttl_ms}")
        self.proc = self.ns.popen(argv, log_path=self.log_path)
        deadline = time.monotonic() + timeout
        while f"127.0.0.1:{MASTER_PORT}" not in self.ns.listeners():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start:\n{self.read_log()}")
            time.sleep(0.05)

    def read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def keys(self) -> list[str]:
        """Every key the master knows (its admin endpoint; one key per line)."""
        text = self.ns.http_get(f"http://127.0.0.1:{ADMIN_PORT}/get_all_keys")
        return [k for k in text.split("\n") if k]

    def kill(self) -> None:
        """SIGKILL: the master's metadata (so every object) is gone."""
        if self.proc is not None:
            self.ns.kill(self.proc)

    def restart(self) -> None:
        self.kill()
        self.start()


# ---------------------------------------------------------------------------
# A tier driver: the real MooncakeTier in its own process inside the namespace,
# with a slab of its own, commanded over stdin/stdout (one JSON object a line).


def payload(nbytes: int, seed: int) -> bytes:
    """Deterministic bytes any process can regenerate from (nbytes, seed)."""
    import random

    return random.Random(seed).randbytes(nbytes)


class TierDriver:
    """Test-side handle of a driver process (``python mooncake_env.py driver``)."""

    def __init__(self, ns: MooncakeNetns, log_dir: str, settings: dict[str, object]) -> None:
        import json

        self._json = json
        self.log_path = os.path.join(log_dir, f"driver-{uuid.uuid4().hex[:6]}.log")
        self.proc = subprocess.Popen(
            [*ns.prefix(), sys.executable, __file__, "driver", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_path, "ab"),  # noqa: SIM115 - the child owns it
            preexec_fn=_die_with_parent,
        )
        ns.procs.append(self.proc)
        hello = self._read(60)
        if not hello.get("ok"):
            raise RuntimeError(f"tier driver did not start: {hello}\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _read(self, timeout: float) -> dict:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"tier driver gave no answer in {timeout}s\n{self.read_log()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tier driver exited ({self.proc.poll()})\n{self.read_log()}")
        return self._json.loads(line)

    def call(self, op: str, timeout: float = 60, **args: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((self._json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if "error" in reply and reply.get("fatal"):
            raise RuntimeError(f"driver {op}: {reply['error']}\n{self.read_log()}")
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=30)
            except (RuntimeError, TimeoutError, BrokenPipeError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _driver_main(settings_json: str) -> None:  # pragma: no cover - runs in a child
    import asyncio
    import base64
    import hashlib
    import json
    import mmap
    import traceback

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lmcache_ec_broker.broker.tiers.base import (
        EntryMeta,
        SlabAccess,
        TierCorrupt,
        TierMiss,
        TierUnavailable,
    )
    from lmcache_ec_broker.broker.tiers.mooncake.transport import MooncakeSettings, MooncakeTier
    from lmcache_ec_broker.protocol import expected_nbytes

    raw = json.loads(settings_json)
    if raw.get("hmac_key"):
        raw["hmac_key"] = raw["hmac_key"].encode()
    slab_size = int(raw.pop("slab_size", 64 << 20))
    settings = MooncakeSettings(**raw)
    slab_mm = mmap.mmap(-1, slab_size)
    slab = SlabAccess(slab_mm)
    events: list[tuple[str, str]] = []

    class Events:
        def added(self, tier: object, key: str) -> None:
            events.append(("added", key))

        def removed(self, tier: object, key: str) -> None:
            events.append(("removed", key))

    state = {"next": 0}

    def alloc(nbytes: int, pieces: int) -> list[tuple[int, int]]:
        """``pieces`` extents with gaps between them (exercises scatter/gather)."""
        out = []
        left = nbytes
        for i in range(pieces):
            n = left if i == pieces - 1 else nbytes // pieces
            start = state["next"]
            if start + n + 4096 > slab_size:
                start = state["next"] = 0
            out.append((start, n))
            state["next"] = (start + n + 4096 + 4095) // 4096 * 4096
            left -= n
        return [e for e in out if e[1] > 0] or [(0, 0)]

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def cancel_after(tier: MooncakeTier, task: asyncio.Future, delay_s: float) -> dict:
        """Cancel ``task`` after ``delay_s``: how it ended and how many of the tier's
        transfers still run (none may outlive a cancelled read)."""
        await asyncio.sleep(delay_s)
        task.cancel()
        try:
            await task
            outcome = "finished"
        except asyncio.CancelledError:
            outcome = "cancelled"
        running = [f for f in tier._inflight if not f.done()]
        return {"outcome": outcome, "transfers_running": len(running)}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tier = MooncakeTier(settings)
        tier.open()
        tier.start(loop, slab, Events())
        out({"ok": True})
        reader = asyncio.StreamReader(limit=64 << 20)  # raw_put lines carry values
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            op = cmd["op"]
            try:
                if op == "quit":
                    await tier.shutdown(10)
                    tier.close()
                    out({"ok": True})
                    return
                if op == "wait_up":
                    deadline = time.monotonic() + cmd.get("for_s", 30)
                    while not tier.stats()["remote_up"] and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    out({"up": bool(tier.stats()["remote_up"])})
                elif op == "put":
                    shape = cmd["shape"]
                    nbytes = expected_nbytes(cmd["dtype"], shape)
                    extents = alloc(nbytes, cmd.get("pieces", 2))
                    data = payload(nbytes, cmd["seed"])
                    pos = 0
                    with slab.views(extents) as views:
                        for v in views:
                            v[:] = data[pos : pos + len(v)]
                            pos += len(v)
                    meta = EntryMeta(nbytes, cmd["dtype"], tuple(shape))
                    fut = tier.write(cmd["key"], meta, extents)
                    if fut is None:
                        out({"started": False})
                    else:
                        await fut
                        out({"started": True})
                elif op == "lookup":
                    try:
                        metas = await tier.lookup(cmd["keys"])
                        out(
                            {
                                "metas": [
                                    None if m is None else [m.nbytes, m.dtype, list(m.shape)]
                                    for m in metas
                                ]
                            }
                        )
                    except TierUnavailable as exc:
                        out({"unavailable": str(exc)})
                elif op == "read":
                    n, dtype, shape = cmd["meta"]
                    meta = EntryMeta(n, dtype, tuple(shape))
                    extents = alloc(n, cmd.get("pieces", 3))
                    with slab.views(extents) as views:
                        for v in views:
                            v[:] = b"\xee" * len(v)  # stale bytes a failed read must not hide
                    try:
                        await tier.read_into(cmd["key"], meta, extents)
                    except (TierMiss, TierCorrupt, TierUnavailable) as exc:
                        out({"failed": type(exc).__name__, "why": str(exc)})
                        continue
                    h = hashlib.sha256()
                    with slab.views(extents) as views:
                        for v in views:
                            h.update(v)
                    out({"sha256": h.hexdigest(), "extents": len(extents)})
                elif op == "fetch":  # a get no lookup preceded (RemoteTier.fetch)
                    reserved: list[list] = []

                    def reserve(
                        meta: EntryMeta, reserved: list = reserved, cmd: dict = cmd
                    ) -> list[tuple[int, int]] | None:
                        reserved.append([meta.nbytes, meta.dtype, list(meta.shape)])
                        if cmd.get("decline"):
                            return None
                        extents = alloc(meta.nbytes, cmd.get("pieces", 3))
                        with slab.views(extents) as views:
                            for v in views:
                                v[:] = b"\xee" * len(v)  # stale bytes a failed read must not hide
                        reserved[-1].append(extents)
                        return extents

                    try:
                        done = await tier.fetch(cmd["key"], reserve)
                    except (TierMiss, TierCorrupt, TierUnavailable) as exc:
                        out({"failed": type(exc).__name__, "why": str(exc), "reserved": reserved})
                        continue
                    got: dict = {"done": done, "reserved": reserved}
                    if done:
                        h = hashlib.sha256()
                        with slab.views(reserved[-1][3]) as views:
                            for v in views:
                                h.update(v)
                        got["sha256"] = h.hexdigest()
                    out(got)
                elif op == "fetch_together":  # several fetches started in one loop turn
                    counts: list[int] = []

                    def take(meta: EntryMeta, counts: list = counts) -> list[tuple[int, int]]:
                        counts.append(meta.nbytes)
                        return alloc(meta.nbytes, 2)

                    done = await asyncio.gather(*(tier.fetch(k, take) for k in cmd["keys"]))
                    out({"done": list(done), "reserved": counts})
                elif op == "fetch_cancel":  # cancel a fetch while its transfer runs
                    task = asyncio.ensure_future(tier.fetch(cmd["key"], lambda m: alloc(m.nbytes, 2)))
                    out(await cancel_after(tier, task, cmd.get("after_s", 0.002)))
                elif op == "read_cancel":  # cancel a promotion mid-transfer
                    n, dtype, shape = cmd["meta"]
                    meta = EntryMeta(n, dtype, tuple(shape))
                    task = asyncio.ensure_future(
                        tier.read_into(cmd["key"], meta, alloc(n, cmd.get("pieces", 3)))
                    )
                    out(await cancel_after(tier, task, 0.002))
                elif op == "delete":
                    out({"held": tier.delete(cmd["keys"])})
                elif op == "clear":
                    out({"n": tier.clear()})
                elif op == "stats":
                    out({"stats": tier.stats(), "events": events})
                elif op == "raw_put":  # bytes straight into the store (poisoning)
                    store = tier._store
                    rc = store.put(settings.key_prefix + cmd["key"], base64.b64decode(cmd["data"]))
                    out({"rc": rc})
                elif op == "raw_remove":
                    rc = tier._store.remove(settings.key_prefix + cmd["key"], True)
                    out({"rc": rc})
                else:
                    out({"error": f"unknown op {op}", "fatal": True})
            except Exception as exc:  # noqa: BLE001
                out(
                    {
                        "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                        "fatal": True,
                    }
                )

    asyncio.run(main())


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) == 3 and sys.argv[1] == "driver":
        _driver_main(sys.argv[2])
    else:
        sys.exit("usage: mooncake_env.py driver SETTINGS_JSON")
