"""GPU data path: device->slab put and slab->device get against cudaMemcpy with pinned memory.

    .venv/bin/python benchmarks/gpu_transfer.py                 # ~1 minute on one GPU
    .venv/bin/python benchmarks/gpu_transfer.py --sizes 2MiB,34MiB --runs 3

Per size (median of --runs), in one process and one run:
- ``put``: BrokerClient.put(cuda tensor) -- D2H copy into the registered slab on
  the client's copy stream, synchronize, then post: into the connection's put arena
  (entries under put_arena_bytes, 8 MiB by default: a Place, no wait) or, larger,
  after a reserve (one wait), the commit;
- ``get_into``: BrokerClient.get_into(key, cuda tensor) -- found in the broker's
  residency index (no wait), H2D copy from the slab on the copy stream, synchronize,
  the slot's seqlock word re-read (a changed slot falls back to get, copy, release);
- ``D2H pinned`` / ``H2D pinned``: the same bytes between the device and an
  ordinary pinned host buffer (cudaMemcpyAsync + synchronize): the PCIe limit;
- ``D2H pageable``: what an unregistered slab would get.
It also reports what cudaHostRegister of the slab costs once per client process.

Exit status 3 with a one-line message when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import Broker, MiB, fmt_size, median, parse_sizes, table  # noqa: E402

NO_DEVICE_EXIT = 3


def timed(fn, sync) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="64KiB,2MiB,8MiB,34MiB,130MiB")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_transfer: no CUDA device is visible (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}); run this on a machine with a GPU and a CUDA build of torch",
            file=sys.stderr,
        )
        return NO_DEVICE_EXIT
    from lmcache_ec_broker import BrokerClient

    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    sizes = parse_sizes(args.sizes)
    slab = max(512 * MiB, 3 * max(sizes))
    sync = torch.cuda.synchronize
    rows = []
    with Broker(slab) as broker:
        c = BrokerClient(broker.socket_path, timeout_s=60)
        view = c.slab()  # map + prefault: not part of the registration cost
        t_reg = timed(lambda: view._ensure_cuda(dev), sync)
        registered = view.pinned
        for size in sizes:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
            out = torch.empty_like(src)
            pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pageable = torch.empty(size, dtype=torch.uint8)
            pageable.fill_(0)
            m: dict[str, list[float]] = {}
            for r in range(args.runs + 1):  # the first round warms up streams and caches
                key = f"gpu-{size}-{r}"
                samples = {
                    "D2H pinned": timed(partial(pinned.copy_, src, non_blocking=True), sync),
                    "H2D pinned": timed(partial(out.copy_, pinned, non_blocking=True), sync),
                    "D2H pageable": timed(partial(pageable.copy_, src), sync),
                    "put": timed(partial(c.put, key, src), sync),
                    "get_into": timed(partial(c.get_into, key, out), sync),
                }
                if not torch.equal(out, src):
                    raise SystemExit(f"gpu_transfer: {fmt_size(size)} came back different")
                c.delete(key)
                if r:
                    for k, v in samples.items():
                        m.setdefault(k, []).append(v)
            med = {k: median(v) for k, v in m.items()}

            def gb(t: float, n: int = size) -> str:
                return f"{n / t / 1e9:.2f}"

            rows.append([
                fmt_size(size),
                gb(med["D2H pinned"]),
                f"{gb(med['put'])} ({med['D2H pinned'] / med['put']:.2f}x)",
                gb(med["H2D pinned"]),
                f"{gb(med['get_into'])} ({med['H2D pinned'] / med['get_into']:.2f}x)",
                gb(med["D2H pageable"]),
            ])  # fmt: skip
        c.close()
    print(f"device: {torch.cuda.get_device_name(dev)}; slab {fmt_size(slab)}")
    print(
        f"cudaHostRegister of the slab: {t_reg * 1e3:.1f} ms "
        f"({t_reg / (slab / (1 << 30)) * 1e3:.1f} ms per GiB), "
        + ("registered: copies are DMA" if registered else "FAILED: pageable fallback (see log)")
    )
    print()
    print(
        table(
            ["size", "D2H pinned GB/s", "put GB/s (x pinned)", "H2D pinned GB/s",
             "get_into GB/s (x pinned)", "D2H pageable GB/s"],
            rows,
        )
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
