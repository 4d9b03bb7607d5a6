"""The compiled residency copy (shm/_residency_copy.c, ResidencyReader.copy_into): the
same answers as the Python reader on every slot, sound or corrupt, and never a torn or
foreign copy reported as the entry while a writer rewrites the slot under it.

Real index segments (the broker's ResidencyWriter, mapped read-only through the sealed
descriptor as a client maps it) and real memory; the reference is the Python path the
client takes without the extension (ResidencyReader.find + the copy + unchanged).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_ec_broker.protocol import DTYPE_ITEMSIZE
from lmcache_ec_broker.shm import residency as R

pytestmark = pytest.mark.skipif(not R.usable_here(), reason="the index is read on x86-64 only")

SLAB = 1 << 20


def test_the_package_was_built_with_the_compiled_copy() -> None:
    # .ci/setup.sh installs the package with a C compiler present: the client must take the
    # compiled path there (without a compiler the extension is optional and the client
    # copies in Python -- this test then fails, saying so).
    assert R.LAYOUT == R._LAYOUT, (
        f"lmcache_ec_broker.shm._residency_copy is missing or of another layout ({R.LAYOUT}): "
        "reinstall the package with a C compiler (pip install -e .)"
    )
    assert None not in (R._copy_into, R._find_compiled, R._contains_compiled)


class Index:
    """A writer's index and a reader of it, with a slab of random bytes in memory."""

    def __init__(self) -> None:
        self.name = f"/ecb-test-{os.getpid()}-{id(self)}-r"
        self.w = R.ResidencyWriter(self.name, R.MIN_LOG2_SLOTS, SLAB)
        self.r = R.ResidencyReader(self.name, self.w.size, SLAB, fd=self.w.segment.share_fd())
        g = torch.Generator().manual_seed(7)
        self.slab = torch.randint(0, 256, (SLAB,), dtype=torch.uint8, generator=g)
        self.base = self.slab.data_ptr()

    def close(self) -> None:
        self.r.close()
        self.w.close()

    def compiled(self, key: str, dtype: str, shape: tuple[int, ...]) -> tuple[int, bytes | None]:
        out = torch.zeros(shape, dtype=getattr(torch, dtype))
        before = bytes(out.view(-1).view(torch.uint8).numpy())
        got = self.r.copy_into(
            key, out.data_ptr(), out.nbytes, dtype, tuple(shape), self.base, SLAB
        )
        data = bytes(out.view(-1).view(torch.uint8).numpy())
        if got == R.ABSENT:
            assert data == before, "ABSENT, yet the destination was written"
            return got, None
        return got, data

    def reference(self, key: str, dtype: str, shape: tuple[int, ...]) -> tuple[int, bytes | None]:
        """The Python client's answer (index_path.read_known_into without the extension)."""
        found = self.r._find_python(key)
        if found is None or found.dtype != dtype or found.shape != list(shape):
            return R.ABSENT, None
        u8 = self.slab
        data = b"".join(bytes(u8[o : o + n].numpy()) for o, n in found.extents)
        return (R.COPIED if self.r.unchanged(found) else R.CHANGED), data


@pytest.fixture
def index():
    ix = Index()
    yield ix
    ix.close()


def test_a_published_entry_is_copied_and_a_mismatch_is_absent(index: Index) -> None:
    assert index.w.publish("k", 64, "float32", [4, 4], [(4096, 32), (65536, 32)])
    want = bytes(index.slab[4096:4128].numpy()) + bytes(index.slab[65536:65568].numpy())
    assert index.compiled("k", "float32", (4, 4)) == (R.COPIED, want)
    assert _fields(index.r.find("k")) == _fields(index.r._find_python("k"))
    assert index.r.find("k").extents == [(4096, 32), (65536, 32)]
    assert index.compiled("k", "float32", (16,))[0] == R.ABSENT  # another shape
    assert index.compiled("k", "int32", (4, 4))[0] == R.ABSENT  # another dtype
    assert index.compiled("other", "float32", (4, 4))[0] == R.ABSENT  # not indexed
    index.w.withdraw("k")
    assert index.compiled("k", "float32", (4, 4))[0] == R.ABSENT
    # A dead index (a broker stopped cleanly) answers nothing.
    assert index.w.publish("k", 64, "float32", [4, 4], [(0, 64)])
    struct.pack_into("<I", index.w.mm, R._FLAGS_OFFSET, 0)
    assert index.compiled("k", "float32", (4, 4))[0] == R.ABSENT


def test_an_odd_seq_is_skipped_and_a_key_past_the_cap_is_absent(index: Index) -> None:
    assert index.w.publish("k", 16, "uint8", [16], [(128, 16)])
    at = index.r.find("k").at
    (seq,) = struct.unpack_from("@Q", index.w.mm, at)
    struct.pack_into("@Q", index.w.mm, at, seq + 1)  # being rewritten
    assert index.compiled("k", "uint8", (16,)) == index.reference("k", "uint8", (16,))
    assert index.compiled("k", "uint8", (16,))[0] == R.ABSENT
    struct.pack_into("@Q", index.w.mm, at, seq)
    assert index.compiled("k", "uint8", (16,))[0] == R.COPIED
    assert index.compiled("x" * (R.KEY_CAP + 1), "uint8", (16,))[0] == R.ABSENT


_DTYPES = ["float32", "bfloat16", "uint8", "int64"]
_U64 = st.integers(0, (1 << 64) - 1)


def _field(name: str):
    """A slot field's scribble: mostly near the sound value's range, sometimes anything."""
    small = {
        "gen": st.integers(0, 3),
        "nbytes": st.sampled_from([0, 1, 16, 32, 64, 4096, SLAB, SLAB + 1]),
        "keylen": st.integers(0, 200),
        "dtype": st.integers(0, 255),
        "ndim": st.integers(0, 8),
        "next": st.integers(0, 9),
    }[name]
    limit = {"keylen": 0xFFFF, "dtype": 0xFF, "ndim": 0xFF, "next": 0xFF}.get(name)
    return st.one_of(small, st.integers(0, limit) if limit else _U64)


_EXTENT_VALUE = st.one_of(
    st.sampled_from([0, 8, 16, 32, 4096, SLAB - 32, SLAB - 16, SLAB, SLAB + 16]), _U64
)


def _publish_scribbled(
    index: Index, dtype: str, shape: list[int], split: bool, change: dict[int, int], odd: bool
) -> None:
    """Publish "key" (one extent, or two far apart), then overwrite _FIXED's values at
    the positions in ``change`` (0-5 SLOT_FIELDS, 6-11 the shape, 12-19 the extents)."""
    w = index.w
    for key in list(w._slot_of):
        w.withdraw(key)
    nbytes = DTYPE_ITEMSIZE[dtype]
    for d in shape:
        nbytes *= d
    extents = [(4096, nbytes)] if not split or nbytes < 2 else [
        (8192, nbytes // 2), (SLAB - (nbytes - nbytes // 2), nbytes - nbytes // 2)
    ]  # fmt: skip
    assert w.publish("key", nbytes, dtype, shape, extents)
    at = index.r.find("key").at
    fixed = list(R._FIXED.unpack_from(w.mm, at + R._FIXED_AT))
    for i, v in change.items():
        fixed[i] = v
    R._FIXED.pack_into(w.mm, at + R._FIXED_AT, *fixed)
    if odd:
        (seq,) = struct.unpack_from("@Q", w.mm, at)
        struct.pack_into("@Q", w.mm, at, seq | 1)


_EXT0 = 6 + R.MAX_DIMS  # the first extent's offset; its length is next


@pytest.mark.parametrize(
    "change",
    [
        {_EXT0: SLAB - 8},  # would read past the slab
        {_EXT0: (1 << 64) - 16},  # wraps around
        {_EXT0 + 1: SLAB + 64},  # longer than the slab
        {3: 250},  # no such dtype
        {3: 0},  # no dtype
        {1: 128},  # nbytes is not the shape's
        {_EXT0 + 1: 32},  # the extents do not cover nbytes
        {5: 9},  # more extents than a slot holds
        {5: 0},  # none
        {4: 7},  # more dims than a slot holds
        {2: 4},  # another key length ("key" has 3 bytes)
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_a_corrupt_slot_is_absent_for_both_paths(index: Index, change: dict[int, int]) -> None:
    _publish_scribbled(index, "float32", [4, 4], False, change, False)
    got = index.compiled("key", "float32", (4, 4))
    assert got == index.reference("key", "float32", (4, 4)) == (R.ABSENT, None)
    assert index.r.find("key") is None and index.r._find_python("key") is None
    # has() does not decode the entry: a slot whose key and seq are sound is a hit
    assert index.r.contains("key") == index.r._contains_python("key") == (2 not in change)


def _fields(found: R.Found | None) -> tuple | None:
    if found is None:
        return None
    return (found.at, found.seq, found.gen, found.nbytes, found.dtype, found.shape, found.extents)


_DTYPES = ["float32", "bfloat16", "uint8", "int64"]
_U64 = st.integers(0, (1 << 64) - 1)
_NEAR = {  # per _FIXED position: values near the sound ones' range (else: anything)
    0: st.integers(0, 3),
    1: st.sampled_from([0, 1, 16, 32, 64, 4096, SLAB, SLAB + 1]),
    2: st.integers(0, 200),
    3: st.integers(0, 255),
    4: st.integers(0, 8),
    5: st.integers(0, 9),
    **{6 + i: st.integers(0, 5) for i in range(R.MAX_DIMS)},
    **{
        _EXT0 + i: st.sampled_from([0, 8, 16, 32, 4096, SLAB - 32, SLAB - 16, SLAB, SLAB + 16])
        for i in range(2 * R.MAX_EXTENTS)
    },
}
_WIDTH = {2: 0xFFFF, 3: 0xFF, 4: 0xFF, 5: 0xFF}  # the narrow fields' largest values


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dtype=st.sampled_from(_DTYPES),
    ask_dtype=st.none() | st.sampled_from(_DTYPES),  # None: the entry's own
    ask_shape=st.none() | st.lists(st.integers(1, 4), min_size=0, max_size=7),
    split=st.booleans(),
    positions=st.lists(st.sampled_from(sorted(_NEAR)), max_size=3, unique=True),
    odd=st.booleans(),
    data=st.data(),
)
def test_the_compiled_copy_answers_as_the_python_reader_on_any_slot(
    index: Index, shape, dtype, ask_dtype, ask_shape, split, positions, odd, data
) -> None:  # fmt: skip
    """Every answer of the compiled copy -- ABSENT, COPIED with which bytes, CHANGED -- and
    of the compiled find is the Python reader's, for a sound slot and for one scribbled
    anywhere in its fixed fields (a corrupt or hostile index: out-of-slab extents, wrong
    sizes, bad codes)."""
    change = {
        i: data.draw(_NEAR[i] | st.integers(0, _WIDTH.get(i, (1 << 64) - 1)), label=f"_FIXED[{i}]")
        for i in positions
    }
    _publish_scribbled(index, dtype, shape, split, change, odd)
    want_shape = tuple(shape if ask_shape is None else ask_shape)
    want_dtype = dtype if ask_dtype is None else ask_dtype
    assert _fields(index.r.find("key")) == _fields(index.r._find_python("key"))
    assert index.r.contains("key") == index.r._contains_python("key")
    assert index.compiled("key", want_dtype, want_shape) == index.reference(
        "key", want_dtype, want_shape
    )


def test_a_copy_racing_a_writer_is_never_reported_torn(index: Index) -> None:
    """A writer thread withdraws the entry, rewrites its bytes with the next version's
    and publishes it again, every half millisecond, while this thread copies it (8 MiB: the
    copy runs with the GIL released). Every COPIED holds one version's bytes whole; the
    rewrites are seen (CHANGED or ABSENT), not missed."""
    size = 8 << 20
    name = f"/ecb-test-{os.getpid()}-race-r"
    w = R.ResidencyWriter(name, R.MIN_LOG2_SLOTS, 2 * size)
    r = R.ResidencyReader(name, w.size, 2 * size, fd=w.segment.share_fd())
    slab = torch.zeros(2 * size, dtype=torch.uint8)
    base = slab.data_ptr()
    extents = [(size, size // 2), (0, size // 2)]  # two extents, in reverse order
    stop = threading.Event()
    versions = [0]

    def write() -> None:
        v = 1
        while not stop.is_set():
            w.withdraw("big")
            slab.fill_(v % 251)  # every byte of the slab is this version's
            versions[0] = v
            w.publish("big", size, "uint8", [size], extents)
            v += 1
            # The GIL goes to the reader here, with the entry published (else the reader
            # would only ever run during fill_, while the entry is withdrawn).
            time.sleep(0.0005)

    slab.fill_(0)
    assert w.publish("big", size, "uint8", [size], extents)
    out = torch.empty(size, dtype=torch.uint8)
    answers = {R.ABSENT: 0, R.COPIED: 0, R.CHANGED: 0}
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and (
            answers[R.COPIED] < 20 or answers[R.CHANGED] + answers[R.ABSENT] < 20
        ):
            out.fill_(255)  # a value no version writes (v % 251 < 251)
            got = r.copy_into("big", out.data_ptr(), size, "uint8", (size,), base, 2 * size)
            answers[got] += 1
            if got == R.COPIED:
                first = int(out[0])
                assert first != 255 and bool((out == first).all()), "a torn copy was COPIED"
    finally:
        stop.set()
        writer.join(30)
        r.close()
        w.close()
    assert answers[R.COPIED] >= 20, answers
    assert answers[R.CHANGED] + answers[R.ABSENT] >= 20, answers
    assert versions[0] > 1


def test_the_extension_checks_its_arguments() -> None:
    if R._copy_into is None:
        pytest.skip("built without the extension")
    with pytest.raises(TypeError, match="12 arguments"):
        R._copy_into(1, 2)
    buf = ctypes.create_string_buffer(4096)
    with pytest.raises(TypeError):
        R._copy_into(None, ctypes.addressof(buf), 4096, 7, 0, "str", 0, 0, 0, 0, 1, ())
    with pytest.raises(OverflowError):
        R._copy_into(None, -1, 4096, 7, 0, b"k", 0, 0, 0, 0, 1, ())
    with pytest.raises(TypeError, match="8 arguments"):
        R._find_compiled(1)
    with pytest.raises(TypeError):
        R._find_compiled(None, ctypes.addressof(buf), 4096, 7, 0, b"k", 0, "not bytes")
    # A mask the mapping does not hold is never probed: absent, nothing read past it.
    assert R._find_compiled(None, ctypes.addressof(buf), 4096, 1 << 20, 0, b"k", 0, b"") is None


def test_closing_the_reader_while_a_compiled_read_holds_the_view_does_not_raise() -> None:
    # A compiled call holds the reader's view (an export of the mapping) as an argument:
    # close() in another thread meanwhile must not fail; the mapping goes with the view.
    ix = Index()
    try:
        held = ix.r._view
        assert held is not None
        ix.r.close()  # would raise BufferError without the guard
        assert not ix.r.compiled  # the reader no longer reads through the view
        del held
    finally:
        ix.w.close()
