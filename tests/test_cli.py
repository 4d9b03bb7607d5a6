"""The command line against real broker processes."""

from __future__ import annotations

import json
import os
import socket

import pytest
from conftest import run_cli, shm_segments

from lmcache_ec_broker.config import GiB, MiB, parse_size

cli = run_cli


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * MiB), ("2GiB", 2 * GiB), ("2", 2 * GiB), ("0.5", GiB // 2), ("64k", 64 << 10)],
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
    for key in ("entries", "used_bytes", "capacity_bytes", "reserved_bytes", "pinned_entries",
                "hits", "misses", "evictions", "clients"):
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
    assert os.path.exists(path) and len(shm_segments(path)) == 1
    b = make_broker("--shm-size", "16MiB", socket_path=path)
    assert "stale socket" in b.read_log() and "stale shared-memory segment" in b.read_log()
    assert len(shm_segments(path)) == 1  # only the new broker's
    assert cli("ping", "--socket", path).returncode == 0


def test_a_non_socket_file_is_never_replaced(sock_dir) -> None:
    path = os.path.join(sock_dir, "not-a-socket")
    with open(path, "w") as f:
        f.write("precious")
    r = cli("start", "--socket", path, "--shm-size", "16MiB")
    assert r.returncode == 1 and "not a socket" in r.stderr
    assert open(path).read() == "precious"


def test_too_small_dev_shm_is_refused_with_a_fix(sock_dir) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    want = f"{free // MiB + 1024}MiB"
    r = cli("start", "--socket", os.path.join(sock_dir, "x.sock"), "--shm-size", want)
    assert r.returncode == 1
    assert "/dev/shm has" in r.stderr and "--shm-size" in r.stderr and "emptyDir" in r.stderr
    assert not os.path.exists(os.path.join(sock_dir, "x.sock"))


def test_socket_is_private_by_default(broker) -> None:
    assert os.stat(broker.socket_path).st_mode & 0o777 == 0o600
    (seg,) = shm_segments(broker.socket_path)
    assert os.stat("/dev/shm/" + seg).st_mode & 0o777 == 0o600


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
