"""One neighbour cannot starve the node (issue 40, finding 6 and the zero-byte half of
finding 7; deliverable 7). A real broker from the CLI, a hostile real process with
many connections (tests/hostile_client.py) and an honest client (this process).

How the 2x latency bound is kept from meaning noise on a loaded 2-core VM: the
honest client's quiet and attacked figures are measured in the same test, in
alternating blocks (quiet, attacked, attacked, quiet, ...: the hostile closes its
connections between blocks, so the broker releases all it held, and attacks afresh),
each block starting on a full slab (so quiet puts evict as attacked ones do), many
samples per block, and the p99 of each phase is taken over all its blocks together;
so a burst of load from elsewhere lands in both phases alike. A
measurement that misses the bound is repeated (up to three in all) and the test
fails only if every one misses it: a real starvation (refusals, evicted entries,
fallbacks to slow paths) shows every time, a noisy minute does not.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time

import pytest
import torch
from conftest import PATIENT, broker_stats, wait_until
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import Commit, ErrorReply, Reserve, ReserveReply

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
PROTECTED = [f"protected{i}" for i in range(10)]  # the honest client's leased entries


class Hostile:
    """tests/hostile_client.py as a real process, one JSON line per command."""

    def __init__(self, path: str, keys: list[str], as_user: tuple[int, int] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        drop = ["--as", *map(str, as_user)] if as_user else []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "hostile_client.py"), *drop, path, *keys],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def do(self, cmd: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the hostile client died (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def _honest_block(c: BrokerClient, tag: str, n: int, times: dict[str, list[float]]) -> None:
    """``n`` rounds of put (a new 64 KiB entry), has of the protected keys with a lease
    (what a scheduler does: a broker round trip), get of the entry just put."""
    clock = time.perf_counter
    for i in range(n):
        key = f"{tag}-{i}"
        value = torch.full((16 * 1024,), float(i % 1000))
        t0 = clock()
        stored = c.put(key, value)
        t1 = clock()
        hits = c.has(PROTECTED, lease_ms=600_000)
        t2 = clock()
        got = c.get(key)
        t3 = clock()
        assert stored, f"honest put {key} refused"
        assert hits == [True] * len(PROTECTED), f"a leased entry was lost: {hits}"
        assert got is not None and torch.equal(got, value), f"honest get {key}"
        times["put"].append(t1 - t0)
        times["has"].append(t2 - t1)
        times["get"].append(t3 - t2)


def _retreat(hostile: Hostile, c: BrokerClient) -> None:
    """The hostile closes all its connections; wait until the broker let them go."""
    hostile.do("retreat")
    wait_until(
        lambda: c.stats().get("client_processes") == 1, what="the hostile's connections closed"
    )


def _fill(c: BrokerClient, tag: str) -> None:
    """Fill the slab's free space with evictable entries, so every block, quiet or
    attacked, runs on a full slab (its puts evict): what is compared is the
    hostile's effect, not a full slab's against an empty one's."""
    free = c.stats()["free_bytes"]
    for i in range(free // MiB):
        assert c.put(f"fill-{tag}-{i}", torch.zeros(MiB // 4))
    assert c.flush()


def _measure(c: BrokerClient, hostile: Hostile, rounds: int, n: int, attempt: int) -> dict:
    quiet: dict[str, list[float]] = {"put": [], "has": [], "get": []}
    loud: dict[str, list[float]] = {"put": [], "has": [], "get": []}
    reports = []
    for r in range(rounds):
        order = ("quiet", "attack") if r % 2 == 0 else ("attack", "quiet")
        for phase in order:
            if phase == "attack":
                reports.append(hostile.do("attack"))
                _fill(c, f"a{attempt}-{r}")
                _honest_block(c, f"a{attempt}-{r}", n, loud)
                _retreat(hostile, c)
            else:
                _fill(c, f"q{attempt}-{r}")
                _honest_block(c, f"q{attempt}-{r}", n, quiet)
    figures = {op: (_p99(quiet[op]), _p99(loud[op])) for op in quiet}
    return {"figures": figures, "reports": reports}


def test_a_hostile_process_cannot_starve_an_honest_client(make_broker) -> None:
    # Seen failing on the old code (main at 9b2e719): the hostile process held 300
    # connections (then the honest newcomer ... ) and 100,000 zero-byte reservations,
    # its first reservation took 48 of 64 MiB, and the honest client's puts were
    # refused no_space while it held its reservations.
    b = make_broker("--shm-size", "64MiB")  # reservations lapse after 60 s: never, here
    path = b.socket_path
    with BrokerClient(path, **PATIENT) as c:
        for i, key in enumerate(PROTECTED):
            assert c.put(key, torch.full((MiB // 4,), float(i)))  # 1 MiB each
        assert c.flush()
        assert c.has(PROTECTED, lease_ms=600_000) == [True] * len(PROTECTED)
        hostile = Hostile(path, PROTECTED)
        try:
            got = hostile.do("attack")
            # Connection flood: stopped at the per-process limit, named.
            assert got["connections"] == 64, got
            assert "max_connections_per_process" in (got["refusals"]["connect"] or ""), got
            # ... and a new honest client still gets in.
            with BrokerClient(path, **PATIENT) as newcomer:
                assert newcomer.ping()
            # The huge first reservation: refused, the held-bytes limit named.
            assert "max_held_bytes_per_process" in got["huge"], got
            # Zero-byte reservations: counted, refused at the limit.
            assert got["zero_byte"] <= 256, got  # a quarter of the 1024 blocks
            assert "max_reservations_per_process" in (got["refusals"]["zero_byte"] or ""), got
            # Everything it keeps from eviction together: at most half the slab.
            st = broker_stats(path)
            assert st["top_process_held_bytes"] <= 32 * MiB, st
            assert st["max_held_bytes_per_process"] == 32 * MiB
            print("hostile attack:", json.dumps(got))
            _retreat(hostile, c)

            # The honest client's figures: quiet and attacked, interleaved.
            for attempt in range(3):
                res = _measure(c, hostile, rounds=6, n=100, attempt=attempt)
                figs = res["figures"]
                print(f"attempt {attempt}: p99 quiet/attacked (us):", {
                    op: (round(q * 1e6), round(a * 1e6)) for op, (q, a) in figs.items()
                })  # fmt: skip
                if all(a <= 2 * q for q, a in figs.values()):
                    break
            else:
                raise AssertionError(f"honest p99 more than 2x its quiet figure: {figs}")
            for report in res["reports"]:  # every attack met the same limits
                assert report["connections"] == 64 and report["zero_byte"] <= 256, report
        finally:
            hostile.close()
        # It lost no entry it leased, and they hold their bytes.
        for i, key in enumerate(PROTECTED):
            value = c.get(key)
            assert value is not None and torch.equal(value, torch.full((MiB // 4,), float(i)))
    st = broker_stats(path)
    assert st["reserved_bytes"] == 0 and st["client_processes"] == 1, st  # itself


def test_a_lapsed_reservation_frees_its_key_and_its_commit_fails_cleanly(make_broker) -> None:
    # Seen failing on the old code: a reservation never lapsed (the key stayed
    # in_progress for everyone for as long as its holder liked).
    b = make_broker("--shm-size", "16MiB", env={"LMCACHE_EC_RESERVATION_TTL_S": "0.5"})
    path = b.socket_path
    slow = RawConn(path)
    try:
        r = slow.call(Reserve("slow", MiB, "uint8", [MiB]))
        assert isinstance(r, ReserveReply) and r.status == "reserved", r
        with BrokerClient(path, **PATIENT) as c:
            # The key is free again once the reservation lapsed: another writer stores it
            # (before, its put found it in_progress for as long as the holder liked) ...
            value = torch.arange(MiB // 4, dtype=torch.float32)
            wait_until(lambda: c.put("slow", value), what="the lapsed key stored by another")
            assert c.flush() and broker_stats(path)["reservations_expired"] == 1
            # ... while the lapsed blocks stay reserved, not handed to anyone: the slow
            # writer may still be copying into them.
            assert broker_stats(path)["reserved_bytes"] == MiB
            late = slow.call(Commit(r.token))
            assert isinstance(late, ErrorReply) and late.code == "unknown_token", late
            assert "reservation_ttl_s" in late.message and "nothing was stored" in late.message
            got = c.get("slow")
            assert got is not None and torch.equal(got, value)
            st = broker_stats(path)
            assert st["reserved_bytes"] == 0 and st["lapsed_reservations"] == 0, st
    finally:
        slow.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_one_uids_processes_together_stop_at_the_uids_share(make_broker) -> None:
    # Seen failing on the old code: nothing counted per uid, so two processes of
    # one uid held what two uids would (here until the slab was full, no_space).
    # Two hostile processes of uid nobody (admitted by allowed_uids): the first keeps
    # its process's share (half of 64 MiB), the second only what is left of the uid's
    # (three quarters, as other uids are admitted), refused naming the uid's setting;
    # another uid (root, the honest one here) keeps its own room.
    nobody = pwd.getpwnam("nobody")
    b = make_broker(
        "--shm-size", "64MiB", "--allowed-uids", str(nobody.pw_uid), "--socket-mode", "0666"
    )  # fmt: skip
    os.chmod(os.path.dirname(b.socket_path), 0o755)  # nobody must reach the socket
    hostiles = [Hostile(b.socket_path, [], as_user=(nobody.pw_uid, nobody.pw_gid)) for _ in range(2)]
    try:
        first, second = (h.do("attack") for h in hostiles)
        assert first["reserved_mib"] == 32, first
        assert second["reserved_mib"] == 16, second
        refusal = second["refusals"]["reserve"] or ""
        assert f"uid {nobody.pw_uid} keeps 48.00 MiB" in refusal, refusal
        assert "max_held_bytes_per_uid" in refusal, refusal
        with BrokerClient(b.socket_path, **PATIENT) as c:
            for i in range(6):  # what the hostile uid left: 16 MiB, 8 of it root's put arena
                assert c.put(f"honest{i}", torch.full((MiB // 4,), float(i)))
            assert c.flush()
            assert all(c.get(f"honest{i}") is not None for i in range(6))
            st = c.stats()
            assert st["client_uids"] == 2 and st["max_held_bytes_per_uid"] == 48 * MiB, st
    finally:
        for h in hostiles:
            h.close()
