"""In-flight deduplication on one node (issue 41, deliverable 2): an item another
client is encoding is waited for, not encoded again; every wait ends (the item, the
encoder giving up or crashing, the claim's TTL, the waiter's own deadline); the
claimant's own ranks are never held. A real broker (CLI-started), real client
processes (tests/dedup_proc.py) and in-process clients; no fixed sleeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from conftest import PATIENT, broker_stats, wait_until
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import Abort, Commit, LookupState, Reserve, ReserveReply

HERE = os.path.dirname(__file__)
MISS, READY, CLAIMED = LookupState.MISS, LookupState.READY, LookupState.CLAIMED


def spawn(sock: str, claim_ms: int, wait_ms: int, *specs: str, hold: bool = False):
    args = [sys.executable, os.path.join(HERE, "dedup_proc.py"), sock, str(claim_ms), str(wait_ms)]
    return subprocess.Popen(
        [*args, *(["--hold"] if hold else []), *specs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def first_line(p: subprocess.Popen) -> list[int]:
    assert p.stdout is not None
    return json.loads(p.stdout.readline())["first"]


def last_line(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def states(items) -> list[int]:
    return [i.state for i in items]


def test_waiters_load_what_one_claimant_encodes(broker) -> None:
    """Three client processes meet the same two cold items: the first claims and
    encodes them, the other two wait and load them -- two puts, not six."""
    sock = broker.socket_path
    specs = ("img-a:float32:64x32:1", "img-b:bfloat16:16x8:2")
    a = spawn(sock, 30_000, 30_000, *specs, hold=True)
    try:
        assert first_line(a) == [MISS, MISS]  # a holds both claims, encoding held back
        waiters = [spawn(sock, 30_000, 30_000, *specs) for _ in range(2)]
        for w in waiters:
            assert first_line(w) == [CLAIMED, CLAIMED]
        wait_until(lambda: broker_stats(sock).get("claim_waiters") == 2, "both waiting")
        assert a.stdin is not None
        a.stdin.write("go\n")
        a.stdin.flush()
        assert last_line(a)["encoded"] == ["img-a", "img-b"]
        for w in waiters:
            got = last_line(w)
            assert got["encoded"] == [] and got["corrupt"] == []
            assert sorted(got["loaded"]) == ["img-a", "img-b"] and got["after"] == [READY] * 2
    finally:
        a.kill()
    stats = broker_stats(sock)
    assert stats["puts"] == 2, stats
    assert stats["claims_landed"] == 2 and stats["claims_held"] == 0, stats
    assert stats["claim_waits"] == 2 and stats["claim_waits_timed_out"] == 0, stats


def test_killed_claimant_hands_its_item_to_a_waiter(broker) -> None:
    """kill -9 of the encoder ends its claim at once: the waiter takes the item over
    (claimed for it) and encodes it, long before its own deadline."""
    sock = broker.socket_path
    spec = "img-k:float16:32x16:7"
    a = spawn(sock, 60_000, 60_000, spec, hold=True)
    try:
        assert first_line(a) == [MISS]
        b = spawn(sock, 60_000, 60_000, spec)
        assert first_line(b) == [CLAIMED]
        wait_until(lambda: broker_stats(sock).get("claim_waiters") == 1, "b waiting")
        a.kill()  # SIGKILL
        a.wait(30)
        got = last_line(b)
        assert got["after"] == [MISS] and got["encoded"] == ["img-k"], got
        assert got["waited_s"] < 30, got  # woken by the close, not by its 60 s deadline
    finally:
        a.kill()
    with BrokerClient(sock, **PATIENT) as c:
        t = c.get("img-k")
        assert t is not None and t.dtype == torch.float16 and list(t.shape) == [32, 16]


def test_every_wait_ends_by_ttl_or_deadline(broker) -> None:
    """A claim whose holder never puts (hung, not closed) ends at its TTL and a waiter
    takes it over; a waiter whose claimant outlives the waiter's deadline is answered
    CLAIMED at that deadline and encodes itself."""
    sock = broker.socket_path
    with (
        BrokerClient(sock, **PATIENT) as hung,
        BrokerClient(sock, **PATIENT) as b,
        BrokerClient(sock, **PATIENT) as c,
    ):
        assert states(hung.lookup(["t"], claim_ms=300)) == [MISS]
        t0 = time.monotonic()
        assert states(b.wait_ready(["t"], 30_000, claim_ms=60_000)) == [MISS]  # b's now
        assert time.monotonic() - t0 < 15  # the TTL (0.3 s + a 0.1 s sweep), not 30 s
        t0 = time.monotonic()
        assert states(c.wait_ready(["t"], 300)) == [CLAIMED]  # b holds it for 60 s
        waited = time.monotonic() - t0
        assert 0.29 <= waited < 15, waited
        stats = c.stats()
        assert stats["claims_expired"] == 1 and stats["claim_waits_timed_out"] == 1, stats


def test_claims_follow_puts_and_never_hold_the_claimants_ranks(broker) -> None:
    """The two-phase put and claims together: a key reserved by the claimant's rank is
    MISS to the claimant (its own put) and CLAIMED to others; a reservation without a
    claim is in progress too; an abort ends the claim, a commit makes it READY; a
    lookup that meets any claimed key claims nothing; unclaim and the per-connection
    bound."""
    sock = broker.socket_path
    rank0 = RawConn(sock)
    with BrokerClient(sock, **PATIENT) as sched, BrokerClient(sock, **PATIENT) as other:
        assert states(sched.lookup(["k1"], claim_ms=30_000)) == [MISS]
        r1 = rank0.call(Reserve("k1", 64, "float32", [16]))
        assert isinstance(r1, ReserveReply) and r1.status == "reserved", r1
        assert states(sched.lookup(["k1"], claim_ms=30_000)) == [MISS]  # its own rank's put
        assert states(other.lookup(["k1"], claim_ms=30_000)) == [CLAIMED]
        r2 = rank0.call(Reserve("k2", 64, "float32", [16]))  # a put nobody claimed
        assert states(other.lookup(["k2"], claim_ms=30_000)) == [CLAIMED]
        assert states(other.lookup(["k2"])) == [MISS]  # a plain lookup is unchanged
        # all or nothing: k1 is claimed elsewhere, so k3 is not claimed by `other`
        assert states(other.lookup(["k3", "k1"], claim_ms=30_000)) == [MISS, CLAIMED]
        assert states(sched.lookup(["k3"], claim_ms=30_000)) == [MISS]  # sched got it
        rank0.call(Abort(r1.token))  # the encoder gave up: the claim ends
        assert states(other.lookup(["k1"], claim_ms=30_000)) == [MISS]  # other's now
        assert states(sched.lookup(["k1"], claim_ms=30_000)) == [CLAIMED]
        rank0.call(Commit(r2.token))
        got = other.wait_ready(["k2"], 30_000)
        assert states(got) == [READY] and got[0].shape == [16]
        other.unclaim(["k1"])
        assert states(sched.lookup(["k1"], claim_ms=30_000)) == [MISS]
        many = [f"m{i}" for i in range(1100)]
        assert states(other.lookup(many, claim_ms=30_000)) == [MISS] * 1100
        stats = other.stats()
        assert stats["claims_refused"] == 1100 - 1024, stats  # the per-connection bound
    rank0.close()


def test_a_killed_waiter_leaves_nothing_waiting(broker) -> None:
    """kill -9 of a client while its wait sleeps: the broker drops the wait at the
    close (not at the wait's 60 s deadline)."""
    sock = broker.socket_path
    with BrokerClient(sock, **PATIENT) as holder:
        assert states(holder.lookup(["held"], claim_ms=60_000)) == [MISS]
        w = spawn(sock, 60_000, 60_000, "held:uint8:16:1")
        try:
            assert first_line(w) == [CLAIMED]
            wait_until(lambda: broker_stats(sock).get("claim_waiters") == 1, "w waiting")
        finally:
            w.kill()
            w.wait(30)
        wait_until(lambda: broker_stats(sock).get("claim_waiters") == 0, "the wait dropped")
        assert holder.stats()["claims_held"] == 1  # the holder's claim is untouched
