"""A real client process that meets an item and either encodes it or waits for it
(the in-flight deduplication tests and benchmarks/dedup.py).

    python dedup_proc.py SOCKET CLAIM_MS WAIT_MS [--hold] [--encode-ms N] SPEC...

SPEC is key:dtype:shape:seed (client_proc.py). One claiming lookup of every key; it
prints {"first": [state, ...]} at once. Keys answered MISS are "encoded" (the tensor
made from the seed, after a line on stdin with --hold, after N ms with --encode-ms: a
stand-in for encoder time) and put; if any key answered CLAIMED, wait_ready(WAIT_MS,
claim_ms=CLAIM_MS) and then get (verified against the seed) or encode what it answers.
CLAIM_MS 0: no claims (every miss is encoded: today's behaviour). Last line:
{"encoded": [keys], "loaded": [keys], "corrupt": [keys], "waited_s": s, "after": [...]}.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from client_proc import digest, make_tensor, parse  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.protocol import LookupState  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    hold = "--hold" in args
    encode_s = 0.0
    if "--encode-ms" in args:
        i = args.index("--encode-ms")
        encode_s = float(args[i + 1]) / 1000.0
        del args[i : i + 2]
    args = [a for a in args if a != "--hold"]
    sock, claim_ms, wait_ms, *specs = args
    claim, wait = int(claim_ms), int(wait_ms)
    c = BrokerClient(sock, timeout_s=60, connect_timeout_s=60)
    by_key = {parse(s)[0]: parse(s) for s in specs}
    keys = list(by_key)
    first = c.lookup(keys, lease_ms=10_000, claim_ms=claim)
    print(json.dumps({"first": [i.state for i in first]}), flush=True)
    out: dict[str, object] = {"encoded": [], "loaded": [], "corrupt": [], "waited_s": 0.0}

    def encode(todo: list[str]) -> None:
        if not todo:
            return
        if hold:
            sys.stdin.readline()
        if encode_s:
            time.sleep(encode_s)  # the encoder's time (a GPU's, not this CPU's)
        for k in todo:
            _, dtype, shape, seed = by_key[k]
            assert c.put(k, make_tensor(dtype, shape, seed))
            out["encoded"].append(k)  # type: ignore[union-attr]
        c.flush()

    def load(todo: list[str]) -> None:
        for k in todo:
            _, dtype, shape, seed = by_key[k]
            got = c.get(k)
            ok = got is not None and digest(got) == digest(make_tensor(dtype, shape, seed))
            out["loaded" if ok else "corrupt"].append(k)  # type: ignore[union-attr]

    loadable = (LookupState.READY, LookupState.PENDING)
    ready = [k for k, i in zip(keys, first, strict=True) if i.state in loadable]
    claimed = [k for k, i in zip(keys, first, strict=True) if i.state == LookupState.CLAIMED]
    encode([k for k, i in zip(keys, first, strict=True) if i.state == LookupState.MISS])
    if claimed:
        t0 = time.monotonic()
        after = c.wait_ready(claimed, wait, lease_ms=10_000, claim_ms=claim)
        out["waited_s"] = round(time.monotonic() - t0, 4)
        out["after"] = [i.state for i in after]
        ready += [k for k, i in zip(claimed, after, strict=True) if i.state in loadable]
        # MISS: its encoder gave up (claimed for us now); CLAIMED: our deadline passed
        encode([k for k, i in zip(claimed, after, strict=True) if i.state not in loadable])
    load(ready)
    print(json.dumps(out), flush=True)
    c.close()


if __name__ == "__main__":
    main()
