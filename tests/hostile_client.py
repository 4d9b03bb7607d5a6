"""A hostile admitted client: one real process that tries to starve its neighbours
(issue 40, finding 6 and 7's zero-byte reservations). Driven over stdin/stdout by
tests/test_broker_limits.py, one JSON line per command:

- ``attack``: opens connections until refused (a connection flood), pins every key
  it was told of on each (gets, never released) and leases them for 10 minutes,
  reserves one huge entry, then 1 MiB entries on every connection, then zero-byte
  entries until refused (never committing any), and asks every connection for a put
  arena. Answers what it got and the refusals it met.
- ``retreat``: closes every connection (the broker releases all it held).
- ``quit``.

    python hostile_client.py [--as UID GID] SOCKET KEY [KEY ...]
"""

from __future__ import annotations

import json
import os
import sys

from rawproto import RawConn

from lmcache_ec_broker.protocol import (
    PROTOCOL_VERSION,
    ArenaGrant,
    ArenaReply,
    ErrorReply,
    Get,
    GetReply,
    Has,
    HasReply,
    Hello,
    Reserve,
    ReserveReply,
)

MiB = 1 << 20
MAX_CONNS = 300  # well past the per-process limit
MAX_ZERO = 100_000  # issue 40: 60,000 were accepted


def _pipelined(conn: RawConn, msgs: list) -> list:
    for m in msgs:
        conn.send(m)
    return [conn.recv() for _ in msgs]


def attack(path: str, keys: list[str]) -> dict:
    out: dict = {"refusals": {}}
    conns: list[RawConn] = []
    refused = None
    for _ in range(MAX_CONNS):
        try:
            c = RawConn(path, hello=False)
        except OSError as exc:
            refused = f"oserror: {exc}"
            break
        try:
            c.send(Hello(PROTOCOL_VERSION, "hostile"))
        except OSError:
            pass  # refused and closed before the hello: its refusal is still readable
        try:
            reply = c.recv()
        except OSError as exc:
            reply = ErrorReply("closed", str(exc))
        if isinstance(reply, ErrorReply):
            refused = f"{reply.code}: {reply.message}"
            c.close()
            break
        conns.append(c)
    out["connections"] = len(conns)
    out["refusals"]["connect"] = refused
    # Pins (gets never released) and leases on every key it knows, on each connection.
    pins = leases = 0
    pref = lref = None
    for c in conns:
        g = c.call(Get(keys))
        if isinstance(g, GetReply):
            pins += sum(1 for it in g.items if it is not None)
        elif isinstance(g, ErrorReply):
            pref = f"{g.code}: {g.message}"
        h = c.call(Has(keys, lease_ms=600_000))
        if isinstance(h, HasReply):
            leases += sum(h.hits)
        elif isinstance(h, ErrorReply):
            lref = f"{h.code}: {h.message}"
    out["pins"], out["leases"] = pins, leases
    out["refusals"]["pin"], out["refusals"]["lease"] = pref, lref
    # One huge first reservation (issue: 48 of 64 MiB).
    big = conns[0].call(Reserve("huge", 48 * MiB, "uint8", [48 * MiB]))
    out["huge"] = big.status if isinstance(big, ReserveReply) else f"{big.code}: {big.message}"
    # 1 MiB reservations, never committed, on every connection until refused.
    held, href = 0, None
    for n, c in enumerate(conns):
        r = c.call(Reserve(f"held{n}", MiB, "uint8", [MiB]))
        if isinstance(r, ReserveReply) and r.status == "reserved":
            held += 1
        elif isinstance(r, ErrorReply):
            href = f"{r.code}: {r.message}"
    out["reserved_mib"] = held
    out["refusals"]["reserve"] = href
    # Zero-byte reservations until refused, spread over the connections, pipelined.
    zero, i, zref = 0, 0, None
    while zero < MAX_ZERO and zref is None:
        c = conns[i % len(conns)]
        batch = [Reserve(f"zero{i}-{j}", 0, "uint8", [0]) for j in range(256)]
        for r in _pipelined(c, batch):
            if isinstance(r, ReserveReply) and r.status == "reserved":
                zero += 1
            elif isinstance(r, ErrorReply):
                zref = f"{r.code}: {r.message}"
        i += 1
    out["zero_byte"] = zero
    out["refusals"]["zero_byte"] = zref
    # Put arenas on every connection.
    arena = 0
    for c in conns:
        r = c.call(ArenaGrant(8 * MiB))
        if isinstance(r, ArenaReply):
            arena += sum(n for _, n in r.runs)
    out["arena_blocks"] = arena
    attack.conns = conns  # type: ignore[attr-defined]
    return out


def retreat() -> dict:
    conns = getattr(attack, "conns", [])
    for c in conns:
        c.close()
    attack.conns = []  # type: ignore[attr-defined]
    return {"closed": len(conns)}


def main() -> None:
    args = sys.argv[1:]
    if args[0] == "--as":  # drop to another uid (the test runs as root), imports done
        uid, gid = int(args[1]), int(args[2])
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        args = args[3:]
    path, keys = args[0], args[1:]
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "attack":
            res = attack(path, keys)
        elif cmd == "retreat":
            res = retreat()
        else:
            break
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
