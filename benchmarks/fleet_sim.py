"""Beyond one machine, on paper: a trace-driven simulation of a fleet of vLLM nodes,
each with its broker (slab + optional disk), sharing one remote tier.

    .venv/bin/python benchmarks/fleet_sim.py                  # default sweep
    .venv/bin/python benchmarks/fleet_sim.py --nodes 1,4,16 --requests 50000 --zipf 1.1

The trace: requests for media items drawn from a Zipf distribution (rank r has
weight 1/r^s) over a catalogue of images and videos; each request lands on a
uniformly random node. Per request the node looks in its slab, then its disk,
then (when enabled) the shared remote store; a miss everywhere runs the encoder
and stores the result in the node's slab, its disk and the remote store. Each
tier is an LRU of bytes (the remote one stands for Redis ``allkeys-lru``).

Costs: an encoder run costs ``encode_s`` of the item; a hit in a lower tier costs
its transfer time (size / bandwidth; the remote bandwidth is per node link and
capped by the store's aggregate bandwidth shared by the nodes reading at once,
approximated by the mean demand). Reported: hit ratio per tier and the
encoder-seconds saved (encode time avoided minus transfer time spent), with and
without the remote tier.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Kind:
    name: str
    share: float  # fraction of the catalogue
    nbytes: int
    encode_s: float


# Defaults from the project's measurements and the issue: a 576-token image embedding
# of a 7B VL model is ~2 MiB bf16 and encodes in ~50 ms on a GPU; a 128-frame video is
# ~130 MiB and takes seconds to encode.
KINDS = (
    Kind("image", 0.9, 2 * MiB, 0.05),
    Kind("video", 0.1, 130 * MiB, 2.0),
)


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.items: OrderedDict[int, int] = OrderedDict()

    def get(self, key: int) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False

    def put(self, key: int, size: int) -> None:
        if size > self.capacity:
            return
        if key in self.items:
            self.items.move_to_end(key)
            return
        while self.used + size > self.capacity:
            _, s = self.items.popitem(last=False)
            self.used -= s
        self.items[key] = size
        self.used += size


@dataclass
class Result:
    requests: int = 0
    slab: int = 0
    disk: int = 0
    remote: int = 0
    encodes: int = 0
    encode_s_needed: float = 0.0  # encoder time without any cache
    encode_s_spent: float = 0.0
    transfer_s: float = 0.0
    remote_bytes: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return (self.slab + self.disk + self.remote) / max(self.requests, 1)

    @property
    def saved_s(self) -> float:
        return self.encode_s_needed - self.encode_s_spent - self.transfer_s


def simulate(
    nodes: int,
    requests: int,
    catalogue: int,
    zipf_s: float,
    slab_bytes: int,
    disk_bytes: int,
    remote_bytes: int,
    link_gbps: float,
    store_gbps: float,
    disk_gbps: float,
    seed: int = 0,
) -> Result:
    rng = random.Random(seed)
    kinds: list[Kind] = []
    for k in KINDS:
        kinds += [k] * round(k.share * 1000)
    item_kind = [kinds[rng.randrange(len(kinds))] for _ in range(catalogue)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(catalogue)]
    trace = rng.choices(range(catalogue), weights=weights, k=requests)
    slabs = [LRU(slab_bytes) for _ in range(nodes)]
    disks = [LRU(disk_bytes) for _ in range(nodes)]
    remote = LRU(remote_bytes) if remote_bytes else None
    # Nodes read from the store concurrently: each gets its link, and at most a fair
    # share of the store's aggregate bandwidth.
    remote_Bps = min(link_gbps, store_gbps / max(nodes, 1) * 2) * 1e9 / 8
    disk_Bps = disk_gbps * 1e9 / 8
    res = Result()
    for item in trace:
        node = rng.randrange(nodes)
        kind = item_kind[item]
        res.requests += 1
        res.encode_s_needed += kind.encode_s
        counts = res.by_kind.setdefault(kind.name, [0, 0])
        counts[0] += 1
        if slabs[node].get(item):
            res.slab += 1
            counts[1] += 1
            continue
        if disk_bytes and disks[node].get(item):
            res.disk += 1
            counts[1] += 1
            res.transfer_s += kind.nbytes / disk_Bps
            slabs[node].put(item, kind.nbytes)
            continue
        if remote is not None and remote.get(item):
            res.remote += 1
            counts[1] += 1
            res.transfer_s += kind.nbytes / remote_Bps
            res.remote_bytes += kind.nbytes
            slabs[node].put(item, kind.nbytes)
            if disk_bytes:
                disks[node].put(item, kind.nbytes)
            continue
        res.encodes += 1
        res.encode_s_spent += kind.encode_s
        slabs[node].put(item, kind.nbytes)
        if disk_bytes:
            disks[node].put(item, kind.nbytes)
        if remote is not None:
            remote.put(item, kind.nbytes)
    return res


def _sizes(text: str) -> list[int]:
    from lmcache_ec_broker.sizes import parse_size

    return [parse_size(s.strip(), plain_unit=GiB) for s in text.split(",") if s.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--catalogue", type=int, default=50_000, help="distinct media items")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s")
    ap.add_argument("--slab", default="8GiB", help="per-node slab sizes (comma list)")
    ap.add_argument("--disk", default="0", help="per-node disk tier size (0: none)")
    ap.add_argument("--remote", default="256GiB", help="shared remote store size")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="node <-> store, Gb/s")
    ap.add_argument("--store-gbps", type=float, default=100.0, help="store aggregate, Gb/s")
    ap.add_argument("--disk-gbps", type=float, default=16.0, help="local NVMe read, Gb/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    from benchmarks._common import table

    disk = _sizes(args.disk)[0]
    remote = _sizes(args.remote)[0]
    rows, out = [], []
    for slab in _sizes(args.slab):
        for n in [int(x) for x in args.nodes.split(",")]:
            common = dict(
                nodes=n,
                requests=args.requests,
                catalogue=args.catalogue,
                zipf_s=args.zipf,
                slab_bytes=slab,
                disk_bytes=disk,
                link_gbps=args.link_gbps,
                store_gbps=args.store_gbps,
                disk_gbps=args.disk_gbps,
                seed=args.seed,
            )
            local = simulate(remote_bytes=0, **common)  # type: ignore[arg-type]
            shared = simulate(remote_bytes=remote, **common)  # type: ignore[arg-type]
            need = shared.encode_s_needed
            rows.append(
                [
                    f"{slab / GiB:g} GiB",
                    n,
                    f"{local.hit_ratio:.1%}",
                    f"{shared.hit_ratio:.1%}",
                    f"{shared.remote / shared.requests:.1%}",
                    f"{local.saved_s / need:.1%}",
                    f"{shared.saved_s / need:.1%}",
                    f"{shared.saved_s - local.saved_s:.0f}",
                    f"{shared.remote_bytes / max(shared.requests, 1) / MiB:.1f}",
                ]
            )
            out.append(
                {
                    "slab": slab,
                    "nodes": n,
                    "local": local.__dict__,
                    "shared": shared.__dict__,
                }
            )
    print(
        f"{args.requests} requests, {args.catalogue} items, Zipf s={args.zipf}, "
        f"{', '.join(f'{k.name} {k.share:.0%} {k.nbytes // MiB} MiB {k.encode_s}s' for k in KINDS)}; "
        f"disk {disk / GiB:g} GiB/node, remote {remote / GiB:g} GiB, link {args.link_gbps} Gb/s, "
        f"store {args.store_gbps} Gb/s\n"
    )
    print(
        table(
            [
                "slab/node",
                "nodes",
                "hit local-only",
                "hit +remote",
                "remote hits",
                "enc-s saved local",
                "enc-s saved +remote",
                "extra enc-s saved",
                "remote MiB/req",
            ],
            rows,
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
