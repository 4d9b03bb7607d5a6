"""Probe: what one membership-filter lookup costs a client, per key and per batch.

The filter (lmcache_ec_broker/shm/filter.py) answers definite misses locally; its
cost is one keyed hash per key plus the slot reads. This probe times, in one
process and one run, the hash candidates side by side on two key shapes:

- ``short``: what benchmarks/transfer.py's has() table probes (``absent-i-j``);
- ``vllm``: a vLLM-style key, model prefix + 64 hex chars of mm_hash + dtype.

Candidates (per key, from Python, output bits the filter would use):

- ``blake2b keyed (v1)``: the version-1 hash, ``copy()/update()/digest()`` of a
  blake2b keyed once with the salt (a PRF: keys cannot be aimed without the key);
- ``blake2b one-shot``: ``hashlib.blake2b(data, key=...)`` per key (re-keys each call);
- ``blake3 keyed``: the ``blake3`` package's keyed mode (also a PRF);
- ``xxh3-64 seeded (v2)``: what the filter uses now (not a PRF; see filter.py);
- ``numpy U-array only``: ``np.array(keys)``, the first step of any vectorised
  hash over the batch, alone (a lower bound for that approach);
- ``encode only``: the per-key ``str.encode`` every per-key hash pays.

Then ``FilterReader.maybe_many`` itself (hash + slot reads) at several batch
sizes, for the per-key loop and the numpy gather path, which sets _BATCH_MIN.

    .venv/bin/python benchmarks/filter_probe.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import median, table  # noqa: E402


def _best_per_call(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Median over ``repeat`` rounds of the mean seconds per call in a round."""
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - t0) / number)
    return median(rounds)


def hash_candidates(salt: bytes) -> dict[str, Callable[[list[str]], Any]]:
    import blake3
    import numpy as np
    import xxhash

    seed = int.from_bytes(salt[:8], "little")
    base = hashlib.blake2b(digest_size=8, key=salt)
    key32 = salt * 2
    xxh3 = xxhash.xxh3_64_intdigest

    def blake2b_v1(keys: list[str]) -> list[bytes]:
        copy, out = base.copy, []
        for k in keys:
            d = copy()
            d.update(k.encode("utf-8", "surrogatepass"))
            out.append(d.digest())
        return out

    def blake2b_oneshot(keys: list[str]) -> list[bytes]:
        b2 = hashlib.blake2b
        return [b2(k.encode("utf-8", "surrogatepass"), digest_size=8, key=salt).digest() for k in keys]

    def blake3_keyed(keys: list[str]) -> list[bytes]:
        b3 = blake3.blake3
        return [b3(k.encode("utf-8", "surrogatepass"), key=key32).digest(8) for k in keys]

    def xxh3_seeded(keys: list[str]) -> list[int]:
        return [xxh3(k.encode(), seed) for k in keys]

    def numpy_u(keys: list[str]) -> Any:
        return np.array(keys)

    def encode_only(keys: list[str]) -> list[bytes]:
        return [k.encode() for k in keys]

    return {
        "blake2b keyed (v1)": blake2b_v1,
        "blake2b one-shot": blake2b_oneshot,
        "blake3 keyed": blake3_keyed,
        "xxh3-64 seeded (v2)": xxh3_seeded,
        "numpy U-array only": numpy_u,
        "encode only": encode_only,
    }


def key_sets(n: int) -> dict[str, list[str]]:
    return {
        "short": [f"absent-{i}-{j}" for i in range(1) for j in range(n)],
        "vllm": [f"Qwen/Qwen2.5-VL-3B-Instruct@{os.urandom(32).hex()}@bfloat16" for _ in range(n)],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64, help="keys per batch for the hash table")
    p.add_argument("--sizes", default="1,4,8,16,32,64,256", help="batch sizes for maybe_many")
    p.add_argument("--number", type=int, default=2000, help="calls per round")
    p.add_argument("--repeat", type=int, default=7, help="rounds (the median is reported)")
    args = p.parse_args()

    from lmcache_ec_broker.shm import filter as flt

    sets = key_sets(args.batch)
    cands = hash_candidates(os.urandom(16))
    rows = []
    for name, fn in cands.items():
        row = [name]
        for keys in sets.values():
            t = _best_per_call(lambda fn=fn, keys=keys: fn(keys), args.number, args.repeat)
            row += [f"{t * 1e6:.2f}", f"{t * 1e9 / len(keys):.0f}"]
        rows.append(row)
    print(f"\nHash candidates, a batch of {args.batch} keys (median of {args.repeat} rounds)\n")
    heads = ["candidate"]
    for s in sets:
        heads += [f"{s}: us/batch", f"{s}: ns/key"]
    print(table(heads, rows))

    w = flt.FilterWriter(f"/ecb-bench-filter-{uuid.uuid4().hex[:12]}", flt.MIN_LOG2_SLOTS)
    r = flt.FilterReader(w.name, w.size, fd=w.segment.share_fd())
    batch_min = flt._BATCH_MIN
    try:
        for k in sets["vllm"][::2]:  # half present: the slot reads are not all zero
            w.add(k)
        rows = []
        for n in [int(x) for x in args.sizes.split(",")]:
            keys = key_sets(n)["vllm"]
            row = [str(n)]
            for force in (1 << 30, 0):  # per-key loop, numpy gather
                flt._BATCH_MIN = force
                t = _best_per_call(lambda keys=keys: r.maybe_many(keys), args.number, args.repeat)
                row.append(f"{t * 1e6:.2f}")
            flt._BATCH_MIN = batch_min
            assert r.maybe_many(keys) == [r.maybe(k) for k in keys]
            rows.append(row)
    finally:
        flt._BATCH_MIN = batch_min
        r.close()
        w.close()
    print(f"\nFilterReader.maybe_many, vllm keys (us per call; filter uses numpy from {batch_min})\n")
    print(table(["keys", "per-key loop", "numpy gather"], rows))


if __name__ == "__main__":
    main()
