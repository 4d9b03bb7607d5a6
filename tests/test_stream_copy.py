"""A put's copy into the slab with non-temporal stores (shm/_stream_copy.c, issue 42):
byte-exact for every size and alignment on every store width this CPU has, never a byte
outside the destination, overlapping ranges as memmove, and the client's put streams
every extent of a put of ``SlabView.stream_min`` bytes or more -- read back by another
process through a real broker."""

from __future__ import annotations

import ctypes
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.client import copy as C

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from client_proc import make_tensor, parse  # noqa: E402

sc = pytest.importorskip("lmcache_ec_broker.shm._stream_copy")
KINDS = list(range(sc.BEST + 1))
GUARD = 64


def test_the_package_was_built_with_the_streaming_copy_and_uses_it() -> None:
    assert C._stream_copy is not None
    if platform.machine() in ("x86_64", "AMD64"):
        assert sc.BEST >= sc.SSE2  # every x86-64 CPU has SSE2's non-temporal stores


def _addr(buf: bytearray, off: int = 0) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) + off


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=st.one_of(st.integers(0, 600), st.integers(600, 70_000)),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    seed=st.integers(0, 255),
)
def test_every_size_and_alignment_copies_exactly_and_writes_nothing_else(
    kind: int, n: int, src_off: int, dst_off: int, seed: int
) -> None:
    src = bytearray((i * 7 + seed) & 0xFF for i in range(n + 64))
    dst = bytearray(b"\xa5" * (n + 64 + 2 * GUARD))
    sc.stream_copy(_addr(dst, GUARD + dst_off), _addr(src, src_off), n, kind)
    start = GUARD + dst_off
    assert dst[start : start + n] == src[src_off : src_off + n]
    assert dst[:start] == b"\xa5" * start
    assert dst[start + n :] == b"\xa5" * (len(dst) - start - n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shift", [-4096, -33, -1, 1, 31, 4096])
def test_overlapping_ranges_copy_as_memmove(kind: int, shift: int) -> None:
    n = 3 * 4096 + 17
    base = bytearray((i * 13) & 0xFF for i in range(n + 2 * 4096 + 64))
    expect = bytearray(base)
    src_off = 4096 + 32
    ctypes.memmove(_addr(expect, src_off + shift), _addr(expect, src_off), n)
    sc.stream_copy(_addr(base, src_off + shift), _addr(base, src_off), n, kind)
    assert base == expect


def test_bad_arguments_are_refused_naming_the_problem() -> None:
    buf = bytearray(8)
    with pytest.raises(ValueError, match="not available on this CPU"):
        sc.stream_copy(_addr(buf), _addr(buf, 4), 4, sc.BEST + 1)
    with pytest.raises(TypeError, match="3 or 4 arguments"):
        sc.stream_copy(_addr(buf), _addr(buf, 4))
    with pytest.raises(ValueError, match="null address"):
        sc.stream_copy(0, _addr(buf), 4)
    with pytest.raises(OverflowError):
        sc.stream_copy(-1, _addr(buf), 4)
    sc.stream_copy(0, 0, 0)  # nothing to copy: nothing touched


def test_a_put_of_stream_min_or_more_streams_every_extent_and_another_process_reads_it(
    broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed: list[int] = []
    real = C._stream_copy

    def counting(dst: int, src: int, n: int) -> None:
        streamed.append(n)
        real(dst, src, n)

    monkeypatch.setattr(C, "_stream_copy", counting)
    specs = {  # client_proc.py's SPECs: any process can rebuild and check the bytes
        "small": f"small:uint8:{C.STREAM_MIN - 4}:1",
        "large": f"large:uint8:{C.STREAM_MIN + 40}:2",
        "odd": "odd:int32:1021x1283:3",  # 5.0 MiB, laid over extents below STREAM_MIN
    }
    tensors = {name: make_tensor(*parse(spec)[1:]) for name, spec in specs.items()}
    with BrokerClient(broker.socket_path) as c:
        assert c.put("small", tensors["small"])
        assert not streamed  # below stream_min: memmove
        assert c.put("large", tensors["large"])
        assert c.put("odd", tensors["odd"])
        assert sum(streamed) == tensors["large"].nbytes + tensors["odd"].nbytes
    r = subprocess.run(
        [sys.executable, str(HERE / "client_proc.py"), broker.socket_path, "get", *specs.values()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {spec: "ok" for spec in specs.values()}
