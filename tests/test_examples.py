"""The shipped deployment examples: what they install, how long they let the broker
stop, and that the broker accepts the flags they pass."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, run_cli, shm_segments

from lmcache_ec_broker.config import BrokerConfig, MiB

EXAMPLES = REPO / "examples"
SYSTEMD = EXAMPLES / "systemd" / "lmcache-ec-broker.service"
DAEMONSET = EXAMPLES / "kubernetes" / "daemonset.yaml"
DOCKERFILE = EXAMPLES / "kubernetes" / "Dockerfile"
# Time between the broker's flush bound running out and the supervisor's SIGKILL:
# closing connections and unlinking the socket and segments.
MARGIN_S = 5.0
INSTALL_WITH_METRICS = re.compile(r"pip install\b.*\[[^\]]*\bmetrics\b[^\]]*\]")


def _flush_bound(start_args: list[str]) -> float:
    """shutdown_flush_s as the example's broker would run with it."""
    for i, arg in enumerate(start_args):
        if arg.startswith("--shutdown-flush-s="):
            return float(arg.split("=", 1)[1])
        if arg == "--shutdown-flush-s":
            return float(start_args[i + 1])
    return BrokerConfig().shutdown_flush_s


def _systemd_start_args() -> list[str]:
    text = SYSTEMD.read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0].endswith("lmcache-ec-broker") and argv[1] == "start", argv
    return argv[2:]


def _systemd_setting(name: str) -> str:
    (value,) = re.findall(rf"^{name}=(.*)$", SYSTEMD.read_text(), flags=re.MULTILINE)
    return value.strip()


def _daemonset_broker() -> tuple[dict, dict]:
    (doc,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    pod = doc["spec"]["template"]["spec"]
    (broker,) = [c for c in pod["containers"] if c["name"] == "broker"]
    return pod, broker


def _daemonset_start_args() -> list[str]:
    _, broker = _daemonset_broker()
    argv = [*broker.get("command", []), *broker.get("args", [])]
    assert argv[:2] == ["lmcache-ec-broker", "start"], argv
    return argv[2:]


def test_systemd_unit_installs_the_metrics_extra_when_it_serves_metrics() -> None:
    args = _systemd_start_args()
    if any(a.startswith("--metrics-port") for a in args):
        installs = [ln for ln in SYSTEMD.read_text().splitlines() if "pip install" in ln]
        assert installs, "the unit passes --metrics-port but never says how to install"
        assert all(INSTALL_WITH_METRICS.search(ln) for ln in installs), installs


def test_kubernetes_image_installs_the_metrics_extra_when_it_serves_metrics() -> None:
    args = _daemonset_start_args()
    if any(a.startswith("--metrics-port") for a in args):
        _, broker = _daemonset_broker()
        # The DaemonSet names the Dockerfile its image is built from ...
        text = DAEMONSET.read_text()
        assert f"-f examples/kubernetes/{DOCKERFILE.name} -t {broker['image']}" in text
        # ... and that Dockerfile installs the extra.
        runs = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("RUN ")]
        installs = [ln for ln in runs if "pip install" in ln]
        assert installs and all(INSTALL_WITH_METRICS.search(ln) for ln in installs), installs


def test_stop_timeouts_leave_room_for_the_shutdown_flush() -> None:
    systemd_stop = float(_systemd_setting("TimeoutStopSec"))
    assert systemd_stop >= _flush_bound(_systemd_start_args()) + MARGIN_S
    pod, _ = _daemonset_broker()
    grace = float(pod["terminationGracePeriodSeconds"])
    assert grace >= _flush_bound(_daemonset_start_args()) + MARGIN_S


def test_the_broker_accepts_every_flag_the_examples_pass() -> None:
    for args in (_systemd_start_args(), _daemonset_start_args()):
        r = run_cli("start", *args, "--print-config")
        assert r.returncode == 0, (args, r.stderr)


# ------------------------------------------------------------ two_instances.sh fails fast

TWO_INSTANCES = EXAMPLES / "two_instances.sh"


def _run_demo(tmpdir: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The demo script with PYTHON set to this interpreter; a hang is a failure
    (subprocess.TimeoutExpired), not a slow pass."""
    return subprocess.run(
        ["bash", str(TWO_INSTANCES), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHON=sys.executable, TMPDIR=tmpdir, **env),
    )


def _left_behind(r: subprocess.CompletedProcess[str]) -> list[str]:
    (work,) = re.findall(r"^logs in (\S+)$", r.stdout, flags=re.MULTILINE)
    sock = os.path.join(work, "broker.sock")
    return ([sock] if os.path.exists(sock) else []) + shm_segments(sock, include_filter=True)


def _unused_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_two_instances_refuses_a_taken_port_before_starting_anything(sock_dir) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # something else serves there: waiting for /health would never end
    try:
        (free,) = _unused_ports(1)
        port = taken.getsockname()[1]
        r = _run_demo(sock_dir, "/no/model", PORT_A=str(port), PORT_B=str(free))
    finally:
        taken.close()
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in r.stderr and "PORT_A" in r.stderr
    assert os.listdir(sock_dir) == []  # nothing started, no work directory


def test_two_instances_stops_when_the_broker_cannot_start(sock_dir) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    a, b = _unused_ports(2)
    r = _run_demo(
        sock_dir, "/no/model", SHM_SIZE=f"{free // MiB + 1024}MiB", PORT_A=str(a), PORT_B=str(b)
    )
    assert r.returncode == 1
    (log,) = re.findall(r"read (\S+/broker\.log)", r.stderr)
    assert "the broker exited before it was ready" in r.stderr
    assert "/dev/shm has" in r.stderr  # the end of the log is shown too
    assert os.path.exists(log)
    assert _left_behind(r) == []


@pytest.mark.vllm
def test_two_instances_stops_when_a_vllm_instance_exits(sock_dir) -> None:
    # The script starts vLLM itself: take the host lock that vLLM test processes share.
    from lmcache_ec_broker.testing.vllm_server import _hold_host_lock

    _hold_host_lock()
    a, b = _unused_ports(2)
    r = _run_demo(sock_dir, "/no/such/model", PORT_A=str(a), PORT_B=str(b))
    assert r.returncode == 1
    assert "broker answering" in r.stdout
    assert f"vLLM on :{a} exited before it was ready" in r.stderr
    (log,) = re.findall(rf"read (\S+/vllm-{a}\.log)", r.stderr)
    assert "/no/such/model" in open(log).read()
    assert _left_behind(r) == []  # the broker it started was stopped and cleaned up
