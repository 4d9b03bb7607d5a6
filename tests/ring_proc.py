"""One process of the read-after-put ring (tests/test_read_after_put.py).

    python ring_proc.py SOCKET INDEX KEYS READ_FD WRITE_FD WRITER

Puts KEYS keys ``r<INDEX>-<n>``; after each put() returned, writes n (u32) to WRITE_FD
(its reader's pipe). Every n read from READ_FD names a key ``r<WRITER>-<n>`` whose put
in process WRITER already returned: has() must say True, get() must return its bytes, and every fourth
key's delete() must find it. Prints one JSON line of counts."""

from __future__ import annotations

import json
import os
import struct
import sys

import torch

from lmcache_ec_broker import BrokerClient

_N = struct.Struct("<I")


def tensor(proc: int, n: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32) * 7 + proc * 1_000_003 + n


def main() -> None:
    path, me, keys, rfd, wfd, writer = sys.argv[1:]
    me_i, nkeys, rfd_i, wfd_i, prev = int(me), int(keys), int(rfd), int(wfd), int(writer)
    out = {"checked": 0, "has_miss": 0, "get_miss": 0, "delete_miss": 0, "wrong": 0}
    buf = b""
    with BrokerClient(path, timeout_s=60) as c:

        def check(n: int) -> None:
            key = f"r{prev}-{n}"
            out["checked"] += 1
            if c.has([key]) != [True]:
                out["has_miss"] += 1
            got = c.get(key)
            if got is None:
                out["get_miss"] += 1
            elif not torch.equal(got, tensor(prev, n)):
                out["wrong"] += 1
            if n % 4 == 0 and c.delete_many([key]) != [True]:
                out["delete_miss"] += 1

        def take(block: bool) -> None:
            nonlocal buf
            os.set_blocking(rfd_i, block)
            try:
                data = os.read(rfd_i, 4096)
            except BlockingIOError:
                return
            if block and not data:
                raise SystemExit("the previous process closed its pipe early")
            buf += data
            whole = len(buf) // 4 * 4
            for (n,) in _N.iter_unpack(buf[:whole]):
                check(n)
            buf = buf[whole:]

        for n in range(nkeys):
            if not c.put(f"r{me_i}-{n}", tensor(me_i, n)):
                raise SystemExit(f"put r{me_i}-{n} was not stored")
            os.write(wfd_i, _N.pack(n))
            take(block=False)
        os.close(wfd_i)
        while out["checked"] < nkeys:
            take(block=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
