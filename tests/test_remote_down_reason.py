"""Why the remote tier is unavailable: said once in the log and shown in `stats`
(`remote_down_reason`), so a wrong password no longer looks like a store that is not
there. Real brokers against a real redis-server, a closed port, a plain-TCP server
spoken to with TLS, and a listener that never answers."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import run_cli, wait_until
from redis_servers import RedisServer, free_port


@pytest.fixture
def start_node(make_broker, tmp_path):
    def start(url: str):
        cfg = tmp_path / f"n{free_port()}.yaml"
        cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 0.5\n")
        return make_broker("--shm-size", "16MiB", "--config", str(cfg))

    return start


def _reason(b) -> str:
    r = run_cli("stats", "--json", "--socket", b.socket_path)
    st = json.loads(r.stdout)
    return st["remote_down_reason"] if st["remote_up"] == 0 else ""


def _opens(b) -> int:
    return json.loads(run_cli("stats", "--json", "--socket", b.socket_path).stdout)[
        "remote_circuit_opens"
    ]


def _down_because(b, reason: str) -> None:
    wait_until(lambda: _reason(b) == reason, f"remote_down_reason {reason!r}", timeout=30)


def test_wrong_password_and_absent_store_say_different_things(start_node) -> None:
    srv = RedisServer(password="right-Zq81", unix=False)
    try:
        wrong = start_node(f"redis://:wrong-Kx42@127.0.0.1:{srv.port}/0")
        absent = start_node(f"redis://127.0.0.1:{free_port()}/0")
        _down_because(wrong, "auth refused")
        _down_because(absent, "connection refused")
        for b, reason in ((wrong, "auth refused"), (absent, "connection refused")):
            text = run_cli("stats", "--socket", b.socket_path).stdout
            assert any(
                line.split()[0] == "remote_down_reason" and line.endswith(reason)
                for line in text.splitlines()
            ), text
        wait_until(lambda: "is unavailable" in wrong.read_log(), "the breaker to open")
        wait_until(lambda: _opens(wrong) >= 3, "the breaker to reopen after failed probes")
        log = wrong.read_log()
        # Said once, with the fix, however often the broker retried meanwhile.
        assert log.count("cannot connect to") == 1, log
        assert log.count("is unavailable") == 1, log
        assert "auth refused" in log and "remote_password_file" in log
        assert "wrong-Kx42" not in log
    finally:
        srv.stop()


def test_tls_mismatch_and_a_silent_listener_are_named(start_node) -> None:
    srv = RedisServer(unix=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # never accepts: connects complete, nothing ever answers
    try:
        tls = start_node(f"rediss://127.0.0.1:{srv.port}/0")
        mute = start_node(f"redis://:pw-Jq5@127.0.0.1:{silent.getsockname()[1]}/0")
        _down_because(tls, "TLS")
        _down_because(mute, "timeout")
    finally:
        silent.close()
        srv.stop()


def test_mooncake_master_not_there_is_named(make_broker, tmp_path) -> None:
    pytest.importorskip("mooncake.store")
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        f"remote_url: mooncakestore://127.0.0.1:{free_port()}\nmooncake_local_hostname: 127.0.0.1\n"
    )
    b = make_broker("--shm-size", "16MiB", "--config", str(cfg))
    _down_because(b, "connection refused")
    wait_until(lambda: b.read_log().count("cannot connect to") == 1, "the log")
    # Retried meanwhile, counted (was: 2 s of sleep, fewer retries on a loaded host):
    # the breaker has reopened after failed probes, and it is still said once.
    wait_until(lambda: _opens(b) >= 3, "the breaker to reopen after failed probes", timeout=60)
    assert b.read_log().count("cannot connect to Mooncake master") == 1, b.read_log()
