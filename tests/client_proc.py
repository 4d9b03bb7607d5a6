"""A real client process for the multi-process tests.

    python client_proc.py SOCKET put|get|hold-reserve|hold-pin|put-loop|get-loop SPEC...

SPEC is key:dtype:shape:seed (shape as 4x128). Tensor contents derive from the
seed, so any process can verify what any other wrote. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402


def make_tensor(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == "bool":
        return (raw % 2).to(torch.bool).reshape(shape)  # only canonical 0/1 bytes are valid bools
    return raw.view(getattr(torch, dtype)).reshape(shape)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def parse(spec: str) -> tuple[str, str, list[int], int]:
    key, dtype, shape, seed = spec.split(":")
    dims = [int(x) for x in shape.split("x")] if shape else []
    return key, dtype, dims, int(seed)


def main() -> None:
    sock, cmd, *specs = sys.argv[1:]
    c = BrokerClient(sock, timeout_s=30)
    out: dict[str, object] = {}
    if cmd == "put":
        start_at = float(os.environ.get("START_AT", "0"))
        tensors = [(s, make_tensor(*parse(s)[1:])) for s in specs]
        while time.time() < start_at:
            pass
        for s, t in tensors:
            out[s] = c.put(parse(s)[0], t)
    elif cmd == "get":
        for s in specs:
            key, dtype, shape, seed = parse(s)
            got = c.get(key)
            if got is None:
                out[s] = "miss"
            else:
                want = make_tensor(dtype, shape, seed)
                ok = got.dtype == want.dtype and list(got.shape) == shape and digest(got) == digest(want)
                out[s] = "ok" if ok else "corrupt"
    elif cmd in ("put-loop", "get-loop"):
        # Runs until killed: the parent kills it at a random point mid-copy.
        key, dtype, shape, seed = parse(specs[0])
        t = make_tensor(dtype, shape, seed)
        print(json.dumps({"ready": True}), flush=True)
        i = 0
        while True:
            if cmd == "put-loop":
                c.put(f"{key}-{i}", t)
                c.delete(f"{key}-{i}")
            else:
                c.get(key)
            i += 1
    print(json.dumps(out), flush=True)
    c.close()


if __name__ == "__main__":
    main()
