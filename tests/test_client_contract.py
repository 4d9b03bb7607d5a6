"""The client's outage contract, for every public call: an outage never raises.

Three kinds of outage, each against real broker processes: nothing listens on
the path, the broker is killed (-9) while the calls wait for its answers, and
the broker answers but its shared-memory segment cannot be mapped.
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch
from conftest import memfd_segments, shm_segments, slab_of

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import LookupState
from lmcache_ec_broker.shm.residency import KEY_CAP

MISS, READY = LookupState.MISS, LookupState.READY
T = torch.arange(1000, dtype=torch.float32)


def calls(hit: str) -> dict[str, Callable[[BrokerClient], object]]:
    """Every public call; ``hit`` names an entry the broker holds (when it is up)."""
    return {
        "put": lambda c: c.put("new", T),
        "put_many": lambda c: c.put_many([("new1", T), ("new2", T)]),
        "get": lambda c: c.get(hit),
        "get_many": lambda c: c.get_many([hit, "absent"]),
        "get_into": lambda c: c.get_into(hit, torch.zeros(1000)),
        "has": lambda c: c.has([hit, "absent"]),
        "lookup": lambda c: [i.state for i in c.lookup([hit, "absent"])],
        "delete": lambda c: c.delete(hit),
        "delete_many": lambda c: c.delete_many([hit, "absent"]),
        "clear": lambda c: c.clear(),
        "stats": lambda c: c.stats(),
        "ping": lambda c: c.ping(),
        "unlease": lambda c: c.unlease([hit]),
        "shutdown": lambda c: c.shutdown(),
    }


OUTAGE = {
    "put": False,
    "put_many": [False, False],
    "get": None,
    "get_many": [None, None],
    "get_into": False,
    "has": [False, False],
    "lookup": [MISS, MISS],
    "delete": False,
    "delete_many": [False, False],
    "clear": False,
    "stats": {},
    "ping": False,
    "unlease": None,
    "shutdown": False,
}


def _run_all(c: BrokerClient, hit: str, names: list[str] | None = None) -> dict[str, object]:
    out = {}
    for name, call in calls(hit).items():
        if names is None or name in names:
            out[name] = call(c)
    return out


def test_every_call_with_nothing_listening(sock_dir) -> None:
    missing = os.path.join(sock_dir, "missing.sock")
    stale = os.path.join(sock_dir, "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)  # a socket file nobody listens on: ECONNREFUSED
    s.close()
    for path in (missing, stale):
        with BrokerClient(path, max_backoff_s=0.0) as c:
            assert not c.connected
            assert _run_all(c, "k") == OUTAGE, path


def test_every_call_when_the_broker_is_killed_mid_call(make_broker) -> None:
    b = make_broker("--shm-size", "64MiB")
    names = list(OUTAGE)
    clients = {n: BrokerClient(b.socket_path, timeout_s=60) for n in names}
    for n, c in clients.items():  # every client connected, mapped, with an entry to hit
        assert c.put(f"hit-{n}", T)
    results: dict[str, object] = {}
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            results[name] = calls(f"hit-{name}")[name](clients[name])
        except BaseException as exc:  # noqa: BLE001 - any exception is the failure
            errors[name] = exc

    os.kill(b.pid, signal.SIGSTOP)  # requests are sent, no answer comes
    threads = {n: threading.Thread(target=run, args=(n,), daemon=True) for n in names}
    try:
        for t in threads.values():
            t.start()
        for t in threads.values():
            t.join(0.5)  # most are now blocked waiting for the stopped broker
        b.kill9()
        for t in threads.values():
            t.join(60)
        assert not [n for n, t in threads.items() if t.is_alive()], "calls still blocked"
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(10)
        for c in clients.values():
            c.close()
        # kill -9 leaves the socket and segments behind: remove them as a restart would.
        if os.path.exists(b.socket_path):
            os.unlink(b.socket_path)
        for name in shm_segments(b.socket_path, include_filter=True):
            os.unlink("/dev/shm/" + name)
    assert errors == {}
    # A put into the client's arena waits for nothing, so it may return True before the
    # broker is killed (the entry is lost with the broker, like every other entry).
    assert results["put_many"] in ([True, True], OUTAGE["put_many"])
    # has() and the gets may be answered from the residency index without waiting (the
    # connection was confirmed within filter_trust_s): then with the entry itself.
    served = {
        "has": lambda r: r == [True, False],
        "get_into": lambda r: r is True,
        "get": lambda r: r is not None and torch.equal(r, T),
        "get_many": lambda r: r[1] is None and r[0] is not None and torch.equal(r[0], T),
    }
    outage = {
        "has": lambda r: r == [False, False],
        "get_into": lambda r: r is False,
        "get": lambda r: r is None,
        "get_many": lambda r: r == [None, None] if r[0] is None else False,
    }
    for name, want in served.items():
        assert outage[name](results[name]) or want(results[name]), (name, results[name])
        results[name] = OUTAGE[name]
    assert results == {**OUTAGE, "put": results["put"], "put_many": results["put_many"]}


def test_every_call_when_the_segment_cannot_be_mapped(make_broker, caplog) -> None:
    b = make_broker("--shm-size", "64MiB")
    with BrokerClient(b.socket_path) as first:
        assert first.put("hit", T)
    slab = slab_of(b.pid, b.socket_path)  # the slab (the filter still maps)
    assert slab is not None
    # Clients map the descriptor the broker hands over (a memfd, no name): a slab owned
    # by a uid the client does not trust is what cannot be mapped now.
    if os.geteuid() != 0:
        pytest.skip("needs root to give the slab to another uid")
    os.chown(memfd_segments(b.pid)[slab], pwd.getpwnam("nobody").pw_uid, -1)
    names = [n for n in OUTAGE if n != "shutdown"]
    with caplog.at_level(logging.WARNING, logger="lmcache_ec_broker.connector.client"):
        # max_backoff_s=0: each call reconnects, so the calls that need no mapping
        # answer for real and the ones that do meet the unmappable segment.
        with BrokerClient(b.socket_path, max_backoff_s=0.0) as c:
            data = _run_all(c, "hit", ["put", "put_many", "get", "get_many", "get_into"])
            control = _run_all(c, "hit", [n for n in names if n not in data])
    assert data == {n: OUTAGE[n] for n in data}
    assert control == {
        "has": [True, False],
        "lookup": [READY, MISS],
        "delete": True,
        "delete_many": [False, False],
        "clear": True,
        "stats": control["stats"],
        "ping": True,
        "unlease": None,
    }
    assert control["stats"]["reserved_bytes"] == 0  # the failed puts' reservations ended
    warned = [r.getMessage() for r in caplog.records if "cannot map" in r.getMessage()]
    assert len(warned) == 1 and slab in warned[0], warned  # once, naming the segment


def test_a_hung_broker_costs_one_timeout_per_outage(make_broker) -> None:
    """SIGSTOP: the first call waits timeout_s, every later call answers the outage at
    once (no reconnect, no second wait) until the background probe hears the broker
    again after SIGCONT; then the same client serves hits again."""
    b = make_broker("--shm-size", "64MiB")
    # timeout_s 3: a call that waited for it stands well apart from one answered at
    # once, whatever the load (with 0.2 s, a later call had to answer within 20 ms)
    timeout_s = 3.0
    c = BrokerClient(b.socket_path, timeout_s=timeout_s, probe_interval_s=0.1)
    # A key too long for the residency index (KEY_CAP): every call on it needs the
    # broker, so each one meets the hung broker (an indexed hit would be served from
    # the slab without waiting, if its commit was handled before the SIGSTOP).
    hit = "hit-" + "x" * (KEY_CAP + 1)
    try:
        assert c.put(hit, T)
        assert c.flush()  # the placement handled: not served from the client's own arena
        os.kill(b.pid, signal.SIGSTOP)
        try:
            waits = []
            for _ in range(3):
                # Puts last: into the arena they wait for nothing (True, stored once
                # the broker runs again), so they cannot meet the timeout.
                for name in sorted(OUTAGE, key=lambda n: n in ("put", "put_many")):
                    if name == "shutdown":
                        continue
                    t0 = time.perf_counter()
                    assert calls(hit)[name](c) == OUTAGE[name], name
                    waits.append(time.perf_counter() - t0)
            # the one timeout of this outage (a loaded host adds to it, never takes off)
            assert timeout_s * 0.9 < waits[0] < timeout_s + 10, waits[0]
            # answered at once: under a third of a timeout leaves a loaded host room,
            # and a call that waited for the timeout again takes all of it
            assert max(waits[1:]) < timeout_s / 3, f"later calls waited: {max(waits[1:]):.3f} s"
            assert c.tripped and c.timeouts == 1
        finally:
            os.kill(b.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while c.tripped:
            assert time.monotonic() < deadline, "the probe did not find the broker again"
            time.sleep(0.02)
        assert c.has([hit]) == [True] and torch.equal(c.get(hit), T)
        assert c.timeouts == 1
    finally:
        c.close()


def test_probe_interval_must_be_positive(sock_dir) -> None:
    import pytest

    with pytest.raises(ValueError, match="probe_interval_s"):
        BrokerClient(os.path.join(sock_dir, "x.sock"), probe_interval_s=0)
