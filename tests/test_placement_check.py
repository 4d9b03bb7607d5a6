"""The put arena's compiled check (shm/_placement_check.c, Mappings.proven_absent): the
same answer as the Python readers (Journal.any_unsettled, then FilterReader.maybe) for
any journal words and filter counters.

Real segments: the broker's FilterWriter and Journal (their writable mappings are how
the test sets words), the filter mapped read-only through its sealed descriptor as a
client maps it; ``Mappings.proven_absent`` is the method the put path calls, on both
paths.
"""

from __future__ import annotations

import fcntl
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_ec_broker.connector.client import mappings as M
from lmcache_ec_broker.shm import filter as F
from lmcache_ec_broker.shm import journal as J
from lmcache_ec_broker.shm.residency import usable_here

pytestmark = pytest.mark.skipif(not usable_here(), reason="clients read shared memory on x86-64")
NSLOTS = 24


def test_the_package_was_built_with_the_compiled_check() -> None:
    assert M._proven_absent is not None, (
        "lmcache_ec_broker.shm._placement_check is missing or of another layout: "
        "reinstall the package with a C compiler (pip install -e .)"
    )


class Segments:
    def __init__(self) -> None:
        tag = f"/ecb-test-{os.getpid()}-{id(self)}"
        self.fw = F.FilterWriter(tag + "-f", F.MIN_LOG2_SLOTS)
        self.fr = F.FilterReader(self.fw.name, self.fw.size, fd=self.fw.segment.share_fd())
        self.journal = J.Journal.create(tag + "-j", NSLOTS)

    def mappings(self, arenas: bool, journal: bool = True) -> M.Mappings:
        """A Mappings holding these segments (as _map leaves one), its check computed."""
        m = M.Mappings.__new__(M.Mappings)
        m.filter, m.journal, m._arenas = self.fr, self.journal if journal else None, arenas
        m._check = m._compiled_check()
        return m

    def close(self) -> None:
        self.fr.close()
        self.fw.close()
        self.journal.close()


@pytest.fixture(scope="module")
def segs():
    s = Segments()
    yield s
    s.close()


def _both(m: M.Mappings, key: str, own: int) -> tuple[bool, bool]:
    compiled = m.proven_absent(key, own)
    check, m._check = m._check, None
    try:
        python = m.proven_absent(key, own)
    finally:
        m._check = check
    return compiled, python


def test_the_check_follows_the_filter_and_the_journal(segs: Segments) -> None:
    m = segs.mappings(arenas=True)
    assert m._check is not None  # the compiled path is taken
    key = "never-added"
    for slot in range(NSLOTS):
        segs.journal.reset(slot)
    assert _both(m, key, -1) == (True, True)
    segs.fw.add(key)
    assert _both(m, key, -1) == (False, False)  # maybe present
    segs.fw.remove(key)
    segs.journal.hand_out(3)
    struct.pack_into("<I", segs.journal._p, 3 * J.PLACED_BYTES, 7)  # slot 3 placed 7, unsettled
    assert _both(m, key, -1) == (False, False)  # pending elsewhere: the filter proves nothing
    assert _both(m, key, 3) == (True, True)  # the caller's own slot does not count
    assert _both(segs.mappings(arenas=False), key, -1) == (True, True)  # no arenas: no scan
    segs.journal.settle(3, 7)
    assert _both(m, key, -1) == (True, True)
    segs.fw.set_partial(True)
    assert _both(m, key, -1) == (False, False)  # a partial filter proves no absence
    segs.fw.set_partial(False)
    # Arenas but no journal mapped: nothing is ever proven (the Python path decides).
    nojournal = segs.mappings(arenas=True, journal=False)
    assert nojournal._check is None and nojournal.proven_absent(key, -1) is False


_WORD = st.sampled_from([0, 1, 7, 0xFFFFFFFF])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    slots=st.lists(
        st.tuples(_WORD, _WORD, _WORD, st.sampled_from([0, 1, 5])), max_size=NSLOTS
    ),  # per slot: placed, settled, distrusted, held
    bound=st.integers(0, NSLOTS + 5),
    own=st.integers(-1, NSLOTS),
    flags=st.sampled_from([1, 1, 1, 0, 2, 3, 255]),  # mostly live: else nothing is proven
    counters=st.tuples(st.sampled_from([0, 1, 255]), st.sampled_from([0, 1, 255])),
    arenas=st.booleans(),
    key=st.text(min_size=1, max_size=40),
)
def test_the_compiled_check_answers_as_the_python_readers(
    segs: Segments, slots, bound, own, flags, counters, arenas, key
) -> None:  # fmt: skip
    j = segs.journal
    for slot in range(NSLOTS):
        j.reset(slot)
    for slot, (placed, settled, distrusted, held) in enumerate(slots):
        struct.pack_into("<I", j._p, slot * J.PLACED_BYTES, placed)
        struct.pack_into(
            "<4I", j._s, slot * J.SETTLED_BYTES, settled, distrusted, 0, held
        )  # settled, distrusted, tentative, held
    struct.pack_into("<I", j._s, j._bound_at, bound)
    fw = segs.fw
    fw.mm[F.HEADER_SIZE : F.HEADER_SIZE + fw.nslots] = bytes(fw.nslots)
    a, b = fw._hasher.slots(key)
    fw.mm[a], fw.mm[b] = counters  # b == a: the second write wins, in both readers
    fw.mm[F._FLAGS_OFFSET] = flags
    try:
        compiled, python = _both(segs.mappings(arenas=arenas), key, own)
        assert compiled == python
    finally:
        fw.mm[F._FLAGS_OFFSET] = F.FLAG_LIVE


def test_the_extension_checks_its_arguments() -> None:
    if M._proven_absent is None:
        pytest.skip("built without the extension")
    with pytest.raises(TypeError, match="9 arguments"):
        M._proven_absent(1)
    with pytest.raises(TypeError):
        M._proven_absent(None, 0, 0, 0, -1, 1, 4096, 7, "not bytes")
    # A mask the filter mapping does not hold, or a short digest: nothing proven, nothing read.
    assert M._proven_absent(None, 0, 0, 0, -1, 1, 128, 1 << 20, bytes(8)) is False
    assert M._proven_absent(None, 0, 0, 0, -1, 1, 1 << 20, 7, b"short") is False


def test_a_client_cannot_resize_the_placed_words_under_the_others() -> None:
    # Every admitted client is handed the placed words' descriptor read-write. Before they
    # were sealed against resizing, one ftruncate of it to 0 made the next read of a
    # placed word -- this check's, compiled or not, and the broker's -- die of SIGBUS.
    tag = f"/ecb-test-{os.getpid()}-resize"
    fw = F.FilterWriter(tag + "-f", F.MIN_LOG2_SLOTS)
    fr = F.FilterReader(fw.name, fw.size, fd=fw.segment.share_fd())
    broker = J.Journal.create(tag + "-j", NSLOTS)
    client = J.Journal.attach(
        broker.name, broker.size, None,
        os.dup(broker.segment.share_fd()), os.dup(broker.settled_segment.share_fd()),
    )  # fmt: skip
    m = M.Mappings.__new__(M.Mappings)
    m._check = None
    try:
        broker.hand_out(2)
        peer = broker.segment.share_fd()  # the descriptor a client is handed
        for size in (0, broker.size - 1, broker.size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(peer, size)
        with pytest.raises(PermissionError):  # nor seal it against new writable mappings
            fcntl.fcntl(peer, fcntl.F_ADD_SEALS, 0x0010)  # F_SEAL_FUTURE_WRITE
        assert os.fstat(peer).st_size == broker.size
        m.filter, m.journal, m._arenas = fr, client, True
        m._check = m._compiled_check()
        assert _both(m, "never-added", -1) == (True, True)  # still read, nothing pending
        assert not broker.unsettled(2)
    finally:
        m._check = None  # its views hold exports of the mappings
        client.close()
        broker.close()
        fr.close()
        fw.close()
