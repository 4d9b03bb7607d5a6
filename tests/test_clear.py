"""`lmcache-ec-broker clear`: the local tiers by default; the shared remote store only
when asked explicitly (it says what it would remove, then needs --yes)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_cli, wait_until
from redis_servers import RedisServer

from lmcache_ec_broker import BrokerClient


@pytest.fixture
def redis_server():
    srv = RedisServer(tcp=False)
    yield srv
    srv.stop()


def _remote_keys(srv: RedisServer) -> list[str]:
    out = srv.cli("--scan", "--pattern", "lmcache-ec:*")
    return [k for k in out.splitlines() if k and k != "lmcache-ec:announce"]


def test_clear_keeps_the_shared_store_unless_told_and_confirmed(
    make_broker, tmp_path, redis_server
) -> None:
    cfg = tmp_path / "b.yaml"
    disk = tmp_path / "disk"
    cfg.write_text(
        f"remote_url: '{redis_server.url('unix')}'\nlocal_disk: {disk}\nmax_local_disk_size: 64MiB\n"
    )
    b = make_broker("--shm-size", "64MiB", "--config", str(cfg))
    sock = b.socket_path
    t = torch.arange(4096, dtype=torch.float32)
    with BrokerClient(sock) as c:
        assert c.put("m@1@0@h1@float32", t)
        wait_until(lambda: _remote_keys(redis_server), "the write-behind to reach redis")
        wait_until(lambda: c.stats()["disk_entries"] == 1, "the disk write-behind")
    held = _remote_keys(redis_server)

    r = run_cli("clear", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert "cleared 1 slab entries and 1 disk entries" in r.stdout, r.stdout
    assert "the remote store" in r.stdout and "is kept" in r.stdout and "--shared" in r.stdout
    assert _remote_keys(redis_server) == held  # other brokers' entries are untouched
    with BrokerClient(sock) as c:
        st = c.stats()
        assert st["entries"] == 0 and st["disk_entries"] == 0
        assert torch.equal(c.get("m@1@0@h1@float32"), t)  # promoted back from the store

    r = run_cli("clear", "--shared", "--socket", sock)
    assert r.returncode == 2
    assert (
        "every key under 'lmcache-ec:'" in r.stderr and "every broker using that prefix" in r.stderr
    )
    assert "--yes" in r.stderr and redis_server.unix_path in r.stderr
    assert _remote_keys(redis_server) == held

    r = run_cli("clear", "--shared", "--yes", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert "and every key under 'lmcache-ec:'" in r.stdout
    wait_until(lambda: not _remote_keys(redis_server), "the shared clear to reach redis")
    assert "clear requested by uid" in b.read_log()


def test_clear_shared_without_a_remote_tier_says_so(broker) -> None:
    r = run_cli("clear", "--shared", "--yes", "--socket", broker.socket_path)
    assert r.returncode == 2 and "has no remote tier" in r.stderr
    assert os.path.exists(broker.socket_path)
