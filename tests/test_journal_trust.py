"""The fast paths' health under a hostile journal writer (issue 40 item 5).

Any admitted client can write any slot's ``placed`` word of the placement journal
(shm/journal.py): one 4-byte write to a slot nobody holds used to turn off every
client's local filter misses (each has() of an absent key asked the broker) and its
arena puts, for as long as nobody was handed that slot again; rewriting one's own
live slot every millisecond did the same (each new value restarted the excuse's
clock). Now a slot nobody holds is skipped, and a held slot found pending for
``STALL_BOUND_S`` of wall clock is distrusted whatever values it shows.

Real broker (the CLI), real client processes; the writer of the 4 bytes is an
admitted client of the same uid, as in the issue.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from conftest import wait_until

from lmcache_ec_broker import BrokerClient

HERE = Path(__file__).resolve().parent
MISSES = [f"absent-{i}" for i in range(200)]


def _slot(c: BrokerClient) -> int:
    s = c._link.session
    assert s is not None
    return s.arena.slot


def _journal(c: BrokerClient):
    m = c._link.maps
    assert m is not None and m.journal is not None
    return m.journal


def _local_has(c: BrokerClient) -> bool:
    """One has() of absent keys; True if the filter answered all of them here."""
    before = c.local_misses
    assert c.has(MISSES) == [False] * len(MISSES)
    return c.local_misses - before == len(MISSES)


def _arena_puts(c: BrokerClient, prefix: str, n: int) -> int:
    before = c.stats()["arena_places"]
    for i in range(n):
        assert c.put(f"{prefix}-{i}", torch.full((64,), float(i)))
    assert c.flush()
    return c.stats()["arena_places"] - before


def test_a_write_to_a_slot_nobody_holds_changes_nothing(broker) -> None:
    # Fails on the old code: 0 of 200 has() answered locally and 0/50 arena puts.
    with BrokerClient(broker.socket_path) as r, BrokerClient(broker.socket_path) as h:
        assert r.put("r-warm", torch.ones(8)) and r.flush()  # r holds a slot first
        assert _slot(r) >= 0
        with BrokerClient(broker.socket_path) as x:
            assert x.put("x-warm", torch.ones(8)) and x.flush()
            freed = _slot(x)
            assert freed >= 0 and freed != _slot(r)
        # x is gone: its slot is free. h (no slot of its own) writes 4 bytes into it.
        wait_until(lambda: r.stats()["clients"] == 2 or None, "x's connection closed")
        _journal(h).mark_placed(freed, 0xDEAD)
        assert sum(_local_has(r) for _ in range(20)) == 20
        assert _arena_puts(r, "r", 50) == 50


REWRITER = textwrap.dedent(
    """
    import sys, threading, time, torch
    from lmcache_ec_broker import BrokerClient
    c = BrokerClient(sys.argv[1])
    assert c.put("h-warm", torch.ones(8)) and c.flush()
    slot = c._link.session.arena.slot
    journal = c._link.maps.journal
    stop = threading.Event()

    def rewrite():  # its own live slot, a new value every millisecond
        i = 1 << 20
        while not stop.is_set():
            i += 1
            journal.mark_placed(slot, i)
            time.sleep(0.001)

    t = threading.Thread(target=rewrite, daemon=True)
    t.start()
    print("rewriting", slot, flush=True)
    for line in sys.stdin:
        if line.startswith("put"):
            key = line.split()[1]
            print("put", c.put(key, torch.full((256,), 3.0)), flush=True)
        else:
            break
    stop.set()
    t.join()
    c.close()
    """
)


def test_a_client_rewriting_its_own_slot_holds_the_fast_paths_down_for_a_bound_only(
    broker,
) -> None:
    # Fails on the old code: local misses never came back (each rewrite restarted the
    # excuse's clock). Now the slot is distrusted once found pending for 50 ms of wall
    # clock; what the rewriter loses is its own: its puts wait for the broker, and are
    # still seen by everyone once they return.
    with BrokerClient(broker.socket_path) as r:
        assert r.put("r-warm", torch.ones(8)) and r.flush()
        h = subprocess.Popen(
            [sys.executable, "-c", REWRITER, broker.socket_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(HERE.parent),
        )  # fmt: skip
        assert h.stdin is not None and h.stdout is not None
        try:
            assert h.stdout.readline().split()[0] == "rewriting"
            t0 = time.monotonic()
            # 15 s: 300 times the bound (journal.STALL_BOUND_S), room for a loaded host
            wait_until(lambda: _local_has(r) or None, "local misses came back", timeout=15)
            took = time.monotonic() - t0
            # The first distrust lasts DISTRUST_S (1 s): the next 20 questions are local.
            assert sum(_local_has(r) for _ in range(20)) >= 19
            assert _arena_puts(r, "r", 50) == 50
            h.stdin.write("put h-key\n")
            h.stdin.flush()
            assert h.stdout.readline().split() == ["put", "True"]
            assert r.has(["h-key"]) == [True]  # read-after-put, the distrust notwithstanding
            print(f"local misses back after {took * 1e3:.0f} ms")
        finally:
            h.stdin.close()
            h.wait(30)
