"""The Prometheus endpoint's bind address (``metrics_host`` / ``--metrics-host``):
127.0.0.1 unless set, as the events sockets, so a cluster's scraper can reach a
DaemonSet's broker only when the operator says so. Real brokers, real sockets."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from test_config import _cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrapes(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            return b"lmcache_ec_broker_capacity_bytes" in r.read()
    except OSError:
        return False


def _other_ip() -> str | None:
    """This host's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_default_is_loopback_only(make_broker) -> None:
    port = _free_port()
    make_broker("--shm-size", "4MiB", "--put-arena-size", "0", "--metrics-port", str(port))
    assert _scrapes("127.0.0.1", port)
    other = _other_ip()
    if other is not None:
        assert not _scrapes(other, port)


def test_flag_binds_every_address(make_broker) -> None:
    other = _other_ip()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address to scrape from")
    port = _free_port()
    make_broker(
        "--shm-size", "4MiB", "--put-arena-size", "0",
        "--metrics-port", str(port), "--metrics-host", "0.0.0.0",
    )  # fmt: skip
    assert _scrapes(other, port) and _scrapes("127.0.0.1", port)


def test_environment_and_yaml_key_choose_the_address(make_broker, tmp_path) -> None:
    # 127.0.0.2 is a loopback address too, but not 127.0.0.1: bound there, only there.
    port = _free_port()
    make_broker(
        "--shm-size", "4MiB", "--put-arena-size", "0", "--metrics-port", str(port),
        env={"LMCACHE_EC_METRICS_HOST": "127.0.0.2"},
    )  # fmt: skip
    assert _scrapes("127.0.0.2", port) and not _scrapes("127.0.0.1", port)
    cfg = tmp_path / "m.yaml"
    port2 = _free_port()
    cfg.write_text(f"metrics_port: {port2}\nmetrics_host: 127.0.0.3\n")
    make_broker("--shm-size", "4MiB", "--put-arena-size", "0", "--config", str(cfg))
    assert _scrapes("127.0.0.3", port2) and not _scrapes("127.0.0.1", port2)


@pytest.mark.parametrize(
    ("host", "expected"),
    [("", "metrics_host must be an address"), ("0.0.0.0/0", "metrics_host must be an address")],
)
def test_a_bad_address_is_refused_before_start(tmp_path, host, expected) -> None:
    sock = str(tmp_path / "b.sock")
    r = _cli("start", "--socket", sock, "--metrics-port", "9", "--metrics-host", host)
    assert r.returncode == 2 and expected in r.stderr, r.stderr


def test_an_address_not_on_this_host_names_the_flag(tmp_path) -> None:
    sock = str(tmp_path / "b.sock")
    r = _cli(
        "start", "--socket", sock, "--shm-size", "4MiB",
        "--metrics-port", str(_free_port()), "--metrics-host", "192.0.2.123",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "cannot serve metrics on 192.0.2.123:" in r.stderr and "--metrics-host" in r.stderr
