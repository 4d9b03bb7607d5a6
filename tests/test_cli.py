"""The command line against real broker processes."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys

import pytest
from conftest import BrokerProcess, memfd_segments, run_cli, shm_segments

from lmcache_ec_broker.broker.lifecycle import segment_prefix
from lmcache_ec_broker.shm.segment import memory_free_bytes
from lmcache_ec_broker.sizes import GiB, MiB, parse_size

cli = run_cli


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2", 2 * GiB),
        ("0.5", GiB // 2),
        ("64k", 64 << 10),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_size_is_a_clear_error() -> None:
    r = cli("start", "--shm-size", "lots")
    assert r.returncode == 2 and "512MiB" in r.stderr


def test_ping_stats_stop(broker) -> None:
    r = cli("ping", "--socket", broker.socket_path)
    assert r.returncode == 0 and r.stdout.startswith("ok")
    r = cli("stats", "--socket", broker.socket_path)
    assert r.returncode == 0 and "capacity_bytes" in r.stdout and "64.00 MiB" in r.stdout
    st = json.loads(cli("stats", "--json", "--socket", broker.socket_path).stdout)
    for key in (
        "entries",
        "used_bytes",
        "capacity_bytes",
        "reserved_bytes",
        "pinned_entries",
        "hits",
        "misses",
        "evictions",
        "clients",
    ):
        assert key in st
    r = cli("stop", "--socket", broker.socket_path)
    assert r.returncode == 0, r.stderr
    assert broker.proc.wait(10) == 0
    assert not os.path.exists(broker.socket_path)
    assert shm_segments(broker.socket_path, include_filter=True) == []
    assert cli("ping", "--socket", broker.socket_path).returncode == 1


def test_second_start_on_a_live_socket_refuses(broker) -> None:
    r = cli("start", "--socket", broker.socket_path, "--shm-size", "16MiB", timeout=30)
    assert r.returncode == 1
    assert "already running" in r.stderr
    assert cli("ping", "--socket", broker.socket_path).returncode == 0


def test_stale_socket_and_segment_of_a_dead_broker_are_replaced(make_broker, sock_dir) -> None:
    path = os.path.join(sock_dir, "stale.sock")
    dead = make_broker("--shm-size", "16MiB", socket_path=path)
    dead.kill9()
    # Its segments were memfds: nothing of them outlives the process.
    assert os.path.exists(path) and shm_segments(path, include_filter=True) == []
    # A named slab an older broker left (no one holds its lock): removed as stale.
    older = "/dev/shm/" + segment_prefix(path) + "0123456789ab"
    with open(older, "wb") as f:
        f.truncate(1 << 20)
    b = make_broker("--shm-size", "16MiB", socket_path=path)
    assert "stale socket" in b.read_log() and "stale shared-memory segment" in b.read_log()
    assert not os.path.exists(older) and shm_segments(path, include_filter=True) == []
    assert cli("ping", "--socket", path).returncode == 0


def test_a_non_socket_file_is_never_replaced(sock_dir) -> None:
    path = os.path.join(sock_dir, "not-a-socket")
    with open(path, "w") as f:
        f.write("precious")
    r = cli("start", "--socket", path, "--shm-size", "16MiB")
    assert r.returncode == 1 and "not a socket" in r.stderr
    assert open(path).read() == "precious"


def test_too_little_memory_is_refused_with_a_fix(sock_dir) -> None:
    # The slab is a memfd: no /dev/shm size bounds it, the memory the broker may use does.
    free, _ = memory_free_bytes()
    want = f"{free // MiB + 1024}MiB"
    r = cli("start", "--socket", os.path.join(sock_dir, "x.sock"), "--shm-size", want)
    assert r.returncode == 1
    assert "of memory" in r.stderr and "the slab needs" in r.stderr, r.stderr
    assert "--shm-size" in r.stderr and "memory limit" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(sock_dir, "x.sock"))


def test_the_memory_check_takes_the_cgroups_limit_when_it_is_lower(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 8388608 kB\n")  # 8 GiB
    (tmp_path / "cgroup").write_text("0::/ecb/x\n")
    group = tmp_path / "fs" / "ecb" / "x"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(f"{3 * GiB}\n")
    (group / "memory.current").write_text(f"{1 * GiB}\n")
    args = (str(meminfo), str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert memory_free_bytes(*args) == (2 * GiB, "cgroup memory.max 3.00 GiB")
    (group / "memory.max").write_text("max\n")  # no limit: the host's
    assert memory_free_bytes(*args) == (8 * GiB, "MemAvailable")
    (group / "memory.max").write_text(f"{64 * GiB}\n")  # a limit above what is there
    assert memory_free_bytes(*args) == (8 * GiB, "MemAvailable")
    assert memory_free_bytes(str(tmp_path / "none"), str(tmp_path / "none"))[0] == -1


def test_socket_is_private_by_default(broker) -> None:
    assert os.stat(broker.socket_path).st_mode & 0o777 == 0o600
    segs = memfd_segments(broker.pid)
    (slab,) = [label for label in segs if label.startswith(segment_prefix(broker.socket_path))
               and not label.endswith(("-f", "-r", "-j", "-js"))]  # fmt: skip
    assert os.stat(segs[slab]).st_mode & 0o777 == 0o600
    assert shm_segments(broker.socket_path, include_filter=True) == []  # no name to open


def test_broker_does_not_import_torch(broker) -> None:
    # The broker must start fast and small: no torch in its process.
    maps = open(f"/proc/{broker.pid}/maps").read()
    assert "libtorch" not in maps


def test_sigterm_exits_zero_and_cleans_up(broker) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(broker.socket_path)  # an open connection must not block shutdown
    assert broker.stop() == 0
    s.close()
    assert not os.path.exists(broker.socket_path)
    assert shm_segments(broker.socket_path, include_filter=True) == []


# ------------------------------------------------------------ stop through the protocol

# Runs as pid 1 of a new pid namespace: starts a sentinel whose pid there equals the
# pid the broker reports (the broker's pid in *its* namespace), then runs `stop`.
# A stop that signalled the reported pid would hit the sentinel.
IN_NEW_PID_NS = """
import json, subprocess, sys
broker_pid, sock = int(sys.argv[1]), sys.argv[2]
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(broker_pid - 1))
sentinel = subprocess.Popen(["sleep", "600"])
r = subprocess.run([sys.executable, "-m", "lmcache_ec_broker.cli", "stop", "--socket", sock],
                   capture_output=True, text=True, timeout=120)
alive = sentinel.poll() is None
sentinel.kill()
sentinel.wait()
print(json.dumps({"sentinel_pid": sentinel.pid, "alive": alive, "rc": r.returncode,
                  "stdout": r.stdout, "stderr": r.stderr}))
"""


def _need_root_and_unshare() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make a pid namespace")
    probe = subprocess.run(
        ["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=60
    )
    if probe.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")


def test_stop_from_another_pid_namespace_signals_no_pid(broker) -> None:
    _need_root_and_unshare()
    reported = json.loads(cli("stats", "--json", "--socket", broker.socket_path).stdout)["pid"]
    assert reported == broker.pid
    r = subprocess.run(
        ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", IN_NEW_PID_NS,
         str(reported), broker.socket_path],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sentinel_pid"] == reported  # the trap was set
    assert out["alive"], "stop signalled the pid the broker reported"
    assert out["rc"] == 0, out["stderr"]
    assert "stopped the broker" in out["stdout"]
    assert broker.proc.wait(30) == 0
    assert not os.path.exists(broker.socket_path)
    assert shm_segments(broker.socket_path, include_filter=True) == []


# The interpreter lives where another uid may not read it: import, then drop to the uid.
AS_UID = """
import os, sys
import lmcache_ec_broker.cli as cli
import lmcache_ec_broker.connector.client  # noqa: F401
uid, gid = int(sys.argv[1]), int(sys.argv[2])
cli._parser().parse_args(sys.argv[3:])  # argparse imports some modules on first use
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
sys.exit(cli.main(sys.argv[3:]))
"""


def _cli_as(uid: int, gid: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AS_UID, str(uid), str(gid), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stop_by_an_admitted_other_uid_is_refused(make_broker, sock_dir) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    nobody = pwd.getpwnam("nobody")
    os.chmod(sock_dir, 0o755)
    b = make_broker(
        "--shm-size", "16MiB", "--socket-mode", "0666", "--allowed-uids", str(nobody.pw_uid)
    )
    r = _cli_as(nobody.pw_uid, nobody.pw_gid, "stop", "--socket", b.socket_path)
    assert r.returncode == 1
    assert "refused to stop" in r.stderr and f"uid {nobody.pw_uid}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # Admitted as a client, just not allowed to stop it: it still serves.
    ping = _cli_as(nobody.pw_uid, nobody.pw_gid, "ping", "--socket", b.socket_path)
    assert ping.returncode == 0, ping.stderr
    assert b.proc.poll() is None


# ------------------------------------------------------------ one-shot commands, no broker


def test_reply_timeout_waits_for_a_busy_broker_and_names_itself_when_it_runs_out(broker) -> None:
    """A broker that answers late (here: stopped for 3 s, past the default 2 s) is
    waited for with ``--reply-timeout``; one that does not answer within it is reported
    as not answering in time, with the flag as the fix."""
    import signal
    import time

    os.kill(broker.pid, signal.SIGSTOP)
    try:
        r = cli("ping", "--reply-timeout", "0.5", "--socket", broker.socket_path)
        assert r.returncode == 1
        assert "did not answer within 0.5 s" in r.stderr, r.stderr
        assert "--reply-timeout" in r.stderr and "Traceback" not in r.stderr
        patient = subprocess.Popen(
            [sys.executable, "-m", "lmcache_ec_broker.cli", "ping", "--reply-timeout", "120",
             "--socket", broker.socket_path],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(3.0)  # the stop outlasts the default 2 s reply timeout
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    out, err = patient.communicate(timeout=120)
    assert patient.returncode == 0, err
    assert out.startswith("ok: broker on"), out
    for bad in ("0", "-1", "soon", "inf"):
        r = cli("ping", "--reply-timeout", bad, "--socket", broker.socket_path)
        assert r.returncode == 2 and "expected a number of seconds above 0" in r.stderr, r.stderr


def _stale_socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # bound, never listening: what a kill -9'd broker leaves behind
    s.close()


@pytest.mark.parametrize("command", ["ping", "stats", "stop"])
@pytest.mark.parametrize("leftover", [False, True], ids=["no-socket", "stale-socket"])
def test_one_shot_command_without_a_broker_says_how_to_start_one(
    sock_dir, command: str, leftover: bool
) -> None:
    path = os.path.join(sock_dir, "none.sock")
    if leftover:
        _stale_socket(path)
    r = cli(command, "--socket", path)
    assert r.returncode == 1
    assert f"no broker answers at {path}" in r.stderr, r.stderr
    assert f"lmcache-ec-broker start --socket {path}" in r.stderr
    assert ("left over" in r.stderr) == leftover
    assert "retrying in the background" not in r.stderr and "serving misses" not in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------ start: config and refusals


def test_print_config_shows_modes_in_octal(sock_dir) -> None:
    sock = os.path.join(sock_dir, "b.sock")
    r = cli("start", "--print-config", "--socket", sock)
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["socket_mode"].split()[1] == "0o600", lines["socket_mode"]
    r = cli("start", "--print-config", "--socket", sock, "--socket-mode", "0660")
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["socket_mode"].split()[1] == "0o660"
    assert "432" not in lines["socket_mode"] and not os.path.exists(sock)


def test_metrics_port_without_prometheus_client_is_refused(sock_dir, tmp_path) -> None:
    # A module that shadows the installed prometheus_client: importing it fails as
    # it does where the metrics extra is not installed.
    fake = tmp_path / "no_prometheus"
    fake.mkdir()
    (fake / "prometheus_client.py").write_text(
        "raise ImportError(\"No module named 'prometheus_client'\")\n"
    )
    sock = os.path.join(sock_dir, "m.sock")
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for how in (["--metrics-port", "9464"], []):
        run_env = env if how else dict(env, LMCACHE_EC_METRICS_PORT="9464")
        r = subprocess.run(
            [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--socket", sock,
             "--shm-size", "16MiB", *how],
            capture_output=True, text=True, timeout=60, env=run_env,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert "pip install 'lmcache-ec-broker[metrics]'" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not os.path.exists(sock)
        assert shm_segments(sock, include_filter=True) == []


def test_stop_gives_up_at_its_timeout_with_a_clear_message(broker) -> None:
    # --timeout 0: the request is accepted, but stop does not wait for the socket to go.
    r = cli("stop", "--socket", broker.socket_path, "--timeout", "0")
    assert r.returncode == 1
    assert "accepted the stop request but has not removed its socket within 0s" in r.stderr
    assert "--timeout" in r.stderr and "Traceback" not in r.stderr
    assert broker.proc.wait(30) == 0  # it stops all the same
    assert not os.path.exists(broker.socket_path)


def test_one_shot_command_without_permission_says_so(make_broker, sock_dir) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    nobody = pwd.getpwnam("nobody")
    os.chmod(sock_dir, 0o755)
    b = make_broker("--shm-size", "16MiB")  # socket 0600, owned by root
    r = _cli_as(nobody.pw_uid, nobody.pw_gid, "ping", "--socket", b.socket_path)
    assert r.returncode == 1
    assert f"cannot connect to the broker at {b.socket_path}: permission denied" in r.stderr
    assert f"uid {nobody.pw_uid}" in r.stderr and "allowed_uids" in r.stderr
    assert "retrying in the background" not in r.stderr


def test_one_shot_command_facing_a_squatter_names_its_uid(sock_dir) -> None:
    # Another user bound the socket path first (tests/squatter.py answers like a broker).
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    nobody = pwd.getpwnam("nobody")
    os.chmod(sock_dir, 0o777)
    sock = os.path.join(sock_dir, "broker.sock")
    segment = f"/ecb-squat-{os.getpid()}"
    squatter = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "squatter.py"), sock, segment,
         "--uid", str(nobody.pw_uid)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
        for command in ("ping", "stats", "stop"):
            r = cli(command, "--socket", sock)
            assert r.returncode == 1
            assert f"not talking to the process at {sock}" in r.stderr, r.stderr
            assert f"runs as uid {nobody.pw_uid}" in r.stderr
            assert "retrying in the background" not in r.stderr
    finally:
        squatter.terminate()
        squatter.communicate(timeout=20)
        os.unlink(f"/dev/shm{segment}")


# ------------------------------------------------------------ operator experience


def test_version() -> None:
    from lmcache_ec_broker import __version__

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lmcache-ec-broker {__version__}"


def test_unknown_log_level_is_a_one_line_error(sock_dir) -> None:
    sock = os.path.join(sock_dir, "l.sock")
    r = cli("start", "--socket", sock, "--shm-size", "16MiB", "--log-level", "verbose")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "log_level 'verbose'" in r.stderr and "DEBUG, INFO, WARNING" in r.stderr
    assert not os.path.exists(sock) and shm_segments(sock, include_filter=True) == []
    r = cli("start", "--print-config", "--socket", sock, "--log-level", "debug")
    assert r.returncode == 0, r.stderr


def test_decimal_units_are_decimal_and_shown_as_such(sock_dir) -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("2GiB") == 2 * GiB
    assert parse_size("512MB") == 512 * 10**6 and parse_size("64KiB") == 64 << 10
    r = cli("start", "--print-config", "--socket", os.path.join(sock_dir, "s"), "--shm-size", "2GB")
    assert r.returncode == 0, r.stderr
    shm = next(line for line in r.stdout.splitlines() if line.startswith("shm_size "))
    assert "1.86 GiB (2000000000 bytes)" in shm, shm
    r = cli(
        "start", "--print-config", "--socket", os.path.join(sock_dir, "s"), "--block-size", "64KB"
    )
    assert r.returncode == 2 and "64000" in r.stderr and "64KiB" in r.stderr, r.stderr


def test_print_config_shows_sizes_in_units_in_aligned_columns(sock_dir) -> None:
    r = cli("start", "--print-config", "--socket", os.path.join(sock_dir, "b.sock"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    by_name = {line.split()[0]: line for line in lines}
    assert by_name["shm_size"].split()[1:3] == ["2.00", "GiB"], by_name["shm_size"]
    assert "1.00 GiB" in by_name["mooncake_global_segment_size"]
    assert "2147483648" not in r.stdout
    # The value column and the source column start at the same place on every line.
    valued = [line for line in lines if not line.split()[1].startswith("(")]
    value_cols = {len(line) - len(line[len(line.split()[0]) :].lstrip()) for line in valued}
    source_cols = {line.rindex("(") for line in lines if line.endswith(")")}
    assert len(value_cols) == 1 and len(source_cols) == 1, (value_cols, source_cols)


def test_stats_sorts_numbered_keys_as_numbers(broker) -> None:
    r = cli("stats", "--socket", broker.socket_path)
    assert r.returncode == 0, r.stderr
    keys = [line.split()[0] for line in r.stdout.splitlines()]
    buckets = [k.removeprefix("remote_latency_ms_le_") for k in keys if "_ms_le_" in k]
    assert len(buckets) > 3, keys
    assert buckets[-1] == "inf"
    numbers = [float(b) for b in buckets[:-1]]
    assert numbers == sorted(numbers), buckets


def test_remote_url_help_and_errors_name_every_scheme(sock_dir) -> None:
    r = cli("start", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for scheme in ("redis://", "rediss://", "valkey://", "unix://", "mooncakestore://"):
        assert scheme in text, scheme
    r = run_cli("start", "--print-config", "--socket", os.path.join(sock_dir, "s"))
    env = dict(os.environ, LMCACHE_EC_REMOTE_URL="memcached://h:1")
    r = subprocess.run(
        [sys.executable, "-m", "lmcache_ec_broker.cli", "start", "--print-config"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 2
    for scheme in ("redis://", "valkey://", "mooncakestore://"):
        assert scheme in r.stderr, r.stderr


def test_start_creates_a_missing_socket_directory_no_more_open_than_the_socket(sock_dir) -> None:
    def start(subdir: str, *args: str) -> BrokerProcess:
        b = BrokerProcess(os.path.join(sock_dir, subdir, "b.sock"), ["--shm-size", "16MiB", *args])
        b.log_path = os.path.join(sock_dir, f"{subdir}.log")  # not in the missing directory
        started.append(b)
        return b.start()

    started: list[BrokerProcess] = []
    try:
        private = start("run")
        st = os.stat(os.path.dirname(private.socket_path))
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert cli("ping", "--socket", private.socket_path).returncode == 0
        shared = start("o", "--socket-mode", "0666")
        assert stat.S_IMODE(os.stat(os.path.dirname(shared.socket_path)).st_mode) == 0o755
    finally:
        for b in started:
            assert b.stop() == 0
    # Only the last component is created: a missing parent is the operator's typo.
    r = cli("start", "--socket", os.path.join(sock_dir, "x", "y", "b.sock"), "--shm-size", "16MiB")
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr


def test_stop_returns_after_the_process_has_exited(broker) -> None:
    r = cli("stop", "--socket", broker.socket_path)
    assert r.returncode == 0, r.stderr
    # No wait here: `stop` itself waited for the process, not only for its socket.
    assert broker.proc.poll() == 0, "stop returned while the broker process still ran"
    assert f"(pid {broker.pid} exited)" in r.stdout


def test_clear_by_an_admitted_other_uid_is_refused(make_broker, sock_dir) -> None:
    # Any admitted client used to be able to empty the broker for everyone.
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    torch = pytest.importorskip("torch")  # the quick-start venv has no torch
    from lmcache_ec_broker import BrokerClient

    nobody = pwd.getpwnam("nobody")
    os.chmod(sock_dir, 0o755)
    b = make_broker(
        "--shm-size", "16MiB", "--socket-mode", "0666", "--allowed-uids", str(nobody.pw_uid)
    )
    with BrokerClient(b.socket_path) as c:
        assert c.put("k", torch.ones(8))
    r = _cli_as(nobody.pw_uid, nobody.pw_gid, "clear", "--socket", b.socket_path)
    assert r.returncode == 1, r.stderr
    assert "refused to clear" in r.stderr and "only the broker's owner" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    with BrokerClient(b.socket_path) as c:
        assert c.stats()["entries"] == 1
    r = cli("clear", "--socket", b.socket_path)  # the owner (root here) may
    assert r.returncode == 0 and "cleared 1 slab entries" in r.stdout, r.stderr


# ---------------------------------------------------------------- ping and the remote tier


def _remote_broker(make_broker, tmp_path, url: str):
    cfg = tmp_path / f"r{abs(hash(url)) % 10_000}.yaml"
    cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 0.5\n")
    return make_broker("--shm-size", "16MiB", "--config", str(cfg))


def test_ping_reports_the_remote_tier_and_require_remote_makes_it_fatal(
    make_broker, tmp_path
) -> None:
    """Readiness including the remote tier: a wrong password leaves the broker
    answering (ping 0, saying the tier is down and why) but `ping --require-remote`
    exits 1; the right password: up, 0 both ways. Real redis-server, real brokers."""
    from conftest import wait_until
    from redis_servers import RedisServer

    srv = RedisServer(password="right-Pq73", unix=False)
    try:
        wrong = _remote_broker(make_broker, tmp_path, f"redis://:wrong-Zv19@{srv.host_port}/0")
        right = _remote_broker(make_broker, tmp_path, f"redis://:right-Pq73@{srv.host_port}/0")
        wait_until(
            lambda: "auth refused" in cli("ping", "--socket", wrong.socket_path).stdout,
            "ping to name the wrong password's refusal",
            timeout=30,
        )
        r = cli("ping", "--socket", wrong.socket_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("ok") and ": down (auth refused)" in r.stdout, r.stdout
        assert "wrong-Zv19" not in r.stdout  # the URL is shown masked
        r = cli("ping", "--require-remote", "--socket", wrong.socket_path)
        assert r.returncode == 1 and r.stdout == "", r.stdout
        assert "not ready" in r.stderr and "down (auth refused)" in r.stderr, r.stderr
        wait_until(
            lambda: cli("ping", "--require-remote", "--socket", right.socket_path).returncode == 0,
            "the right password's tier to be up",
            timeout=30,
        )
        r = cli("ping", "--require-remote", "--socket", right.socket_path)
        assert r.stdout.startswith("ok") and r.stdout.rstrip().endswith(": up"), r.stdout
        # The store goes away: the probe turns not-ready, plain ping stays ok.
        srv.stop()
        wait_until(
            lambda: cli("ping", "--require-remote", "--socket", right.socket_path).returncode == 1,
            "the probe to notice the store is gone",
            timeout=30,
        )
        assert cli("ping", "--socket", right.socket_path).returncode == 0
    finally:
        srv.stop()


def test_ping_without_a_remote_tier_says_so_and_require_remote_passes(broker) -> None:
    for args in ((), ("--require-remote",)):
        r = cli("ping", *args, "--socket", broker.socket_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("ok") and "remote tier: none configured" in r.stdout
