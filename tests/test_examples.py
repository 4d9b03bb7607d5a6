"""The shipped deployment examples: what they install, how long they let the broker
stop, and that the broker accepts the flags they pass."""

from __future__ import annotations

import re
import shlex

import yaml
from conftest import REPO, run_cli

from lmcache_ec_broker.config import BrokerConfig

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
