"""The broker core across real processes: a real broker, real client processes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rawproto import RawConn

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.protocol import Get, GetReply, Reserve, ReserveReply, ReserveStatus

HERE = Path(__file__).parent
PROC = str(HERE / "client_proc.py")


def run_client(sock: str, cmd: str, *specs: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, PROC, sock, cmd, *specs],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {})),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def spawn_client(sock: str, cmd: str, *specs: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, PROC, sock, cmd, *specs],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **(env or {})),
    )


def assert_nothing_held(c: BrokerClient, timeout: float = 30.0) -> dict:
    # A wait for a condition: 30 s so that a broker starved of CPU on a loaded CI host
    # still gets to release what a closed or killed client held.
    deadline = time.monotonic() + timeout
    while True:
        st = c.stats()
        if (st["reserved_bytes"], st["pinned_entries"], st["pins"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"leaked: {st}"
        time.sleep(0.05)
    held = st["used_bytes"] + st["reserved_bytes"] + st["arena_bytes"]  # arena: put arenas
    assert st["free_bytes"] + held == st["capacity_bytes"]
    return st


CASES = [
    "b1:uint8:1:1",
    "b7:int8:7:2",
    "f16:float16:3x5:3",
    "bf16:bfloat16:576x1280:4",  # a typical image entry
    "f32:float32:1000x33:5",
    "i64:int64:17x3x2:6",
    "bool:bool:4096:7",
    "f8:float8_e4m3fn:64x64:8",
    "odd:float32:65537:9",  # crosses a block boundary
    "empty:bfloat16:0x1280:10",
]


def test_bytes_come_back_bit_identical_in_another_process(make_broker) -> None:
    b = make_broker("--shm-size", "384MiB")
    big = "v130:uint8:130000000:11"  # the seed's largest video entry, ~130 MB
    wrote = run_client(b.socket_path, "put", *CASES, big)
    assert all(wrote.values()), wrote
    read = run_client(b.socket_path, "get", *CASES, big)
    assert read == {s: "ok" for s in [*CASES, big]}
    with BrokerClient(b.socket_path) as c:
        st = assert_nothing_held(c)
        assert st["entries"] == len(CASES) + 1


def test_concurrent_writers_of_one_key_copy_once(make_broker) -> None:
    b = make_broker("--shm-size", "256MiB")
    start_at = str(time.time() + 4.0)  # all processes start their put at the same instant
    spec = "same:bfloat16:4096x4096:42"  # 32 MiB: the copy takes long enough to overlap
    procs = [spawn_client(b.socket_path, "put", spec, env={"START_AT": start_at}) for _ in range(5)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1])[spec])
    assert results.count(True) == 1, results
    assert run_client(b.socket_path, "get", spec) == {spec: "ok"}
    with BrokerClient(b.socket_path) as c:
        st = assert_nothing_held(c)
        assert st["puts"] == 1 and st["entries"] == 1


PIN_HOLDER = """
import sys, time
sys.path.insert(0, {here!r})
from rawproto import RawConn
from lmcache_ec_broker.protocol import Get
c = RawConn({sock!r})
r = c.call(Get({keys!r}))
print("pinned" if all(r.items) else "missed", flush=True)
time.sleep(600)
"""


def test_eviction_under_pressure_keeps_pinned_entries(make_broker) -> None:
    b = make_broker("--shm-size", "16MiB", "--block-size", "64KiB")
    with BrokerClient(b.socket_path) as c:
        t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB each
        for i in range(3):
            assert c.put(f"old{i}", t + i)
        holder = subprocess.Popen(
            [sys.executable, "-c", PIN_HOLDER.format(here=str(HERE), sock=b.socket_path, keys=["old0"])],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
            for i in range(6):  # 24 MiB of new entries through a 16 MiB slab
                assert c.put(f"new{i}", t * 2 + i), c.stats()
            assert c.has(["old0"]) == [True]  # pinned by the other process: survived
            assert c.stats()["evictions"] >= 3
            got = c.get("old0")
            assert got is not None and torch.equal(got, t)
        finally:
            holder.kill()
            holder.wait()
        assert_nothing_held(c)
        for i in range(4):
            assert c.put(f"newer{i}", t)
        assert c.has(["old0"]) == [False]  # unpinned now, so it was evicted like any other


HOLD_RESERVE = """
import sys, time
sys.path.insert(0, {here!r})
from rawproto import RawConn
from lmcache_ec_broker.protocol import Reserve
c = RawConn({sock!r})
r = c.call(Reserve("held", 8 << 20, "uint8", [8 << 20]))
print(r.status, flush=True)
time.sleep(600)
"""


def test_kill9_client_holding_a_reservation_leaks_nothing(broker) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD_RESERVE.format(here=str(HERE), sock=broker.socket_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "reserved"
    with BrokerClient(broker.socket_path) as c:
        assert c.stats()["reserved_bytes"] == 8 << 20
        p.kill()
        p.wait()
        assert_nothing_held(c)
        assert c.has(["held"]) == [False]
        assert c.put("held", torch.zeros(8 << 20, dtype=torch.uint8))  # the key is free again


@pytest.mark.parametrize("cmd", ["put-loop", "get-loop"])
def test_kill9_client_mid_copy_leaks_nothing(make_broker, cmd: str) -> None:
    b = make_broker("--shm-size", "128MiB")
    spec = "big:uint8:33554432:5"  # 32 MiB: most of the loop's time is spent copying
    if cmd == "get-loop":
        assert run_client(b.socket_path, "put", spec) == {spec: True}
    rng = random.Random(1234)
    with BrokerClient(b.socket_path) as c:
        for _ in range(3):
            p = spawn_client(b.socket_path, cmd, spec)
            assert p.stdout is not None and json.loads(p.stdout.readline())["ready"]
            time.sleep(rng.uniform(0.05, 0.4))
            p.kill()
            p.wait()
            # The broker notices the closed socket on its own schedule: wait for it to
            # count the dead client gone (bounded), then check it released everything.
            deadline = time.monotonic() + 30
            while c.stats()["clients"] != 1:
                assert time.monotonic() < deadline, f"the killed client is still counted: {c.stats()}"
                time.sleep(0.02)
            assert_nothing_held(c)
        if cmd == "get-loop":
            assert run_client(b.socket_path, "get", spec) == {spec: "ok"}


def test_malformed_frames_get_errors_and_the_broker_keeps_serving(broker) -> None:
    raw = RawConn(broker.socket_path)
    raw.send_body(b"\xc1\xc1\xc1")  # not msgpack
    r = raw.recv()
    assert r.code == "bad_request" and "malformed" in r.message
    raw.send_body(b"\x81\xa2op\xa7reserve")  # right tag, missing fields
    assert raw.recv().code == "bad_request"
    raw.send_body(b"\x85\xa2op\xa7reserve\xa3key\x01\xa6nbytes\xa1x\xa5dtype\x01\xa5shape\x01")
    r = raw.recv()
    assert r.code == "bad_request" and "Expected" in r.message
    # The connection is still usable after a bad frame.
    ok = raw.call(Reserve("k", 4, "float32", [1]))
    assert isinstance(ok, ReserveReply) and ok.status == ReserveStatus.RESERVED
    got = raw.call(Get(["k"]))
    assert isinstance(got, GetReply) and got.items == [None]  # reserved, not ready
    # An absurd length prefix cannot be resynchronised: error, then close.
    raw.send_raw((1 << 31).to_bytes(4, "big"))
    r = raw.recv()
    assert r.code == "bad_request" and "exceeds the maximum" in r.message
    assert raw.recv() is None
    # A request before the handshake is refused.
    early = RawConn(broker.socket_path, hello=False)
    r = early.call(Get(["k"]))
    assert r.code == "handshake_required"
    assert early.recv() is None
    with BrokerClient(broker.socket_path) as c:
        assert c.ping()
        assert_nothing_held(c)  # the raw connection's reservation died with it


def all_torch_dtypes() -> list[torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint")):
            seen[str(d)] = d
    return list(seen.values())


def test_every_torch_dtype_round_trips(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        for i, dt in enumerate(all_torch_dtypes()):
            raw = torch.randint(0, 256, (6 * 5 * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8)
            if dt == torch.bool:
                raw = raw % 2
            t = raw.view(dt).reshape(6, 5)
            assert c.put(f"dt{i}", t), dt
            got = c.get(f"dt{i}")
            assert got is not None and got.dtype == dt and got.shape == t.shape, dt
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), dt


def test_quantized_tensors_are_refused_clearly(broker) -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with BrokerClient(broker.socket_path) as c, pytest.raises(ValueError, match="dequantize"):
        c.put("q", q)
