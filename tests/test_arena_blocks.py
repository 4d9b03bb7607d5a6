"""The client's arena book: take/give keep an exact, merged account of free blocks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmcache_ec_broker.connector.client.arena_blocks import ArenaBlocks, extents_of


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60))
def test_take_and_give_never_lose_or_invent_a_block(ops: list[tuple[bool, int]]) -> None:
    book = ArenaBlocks()
    book.give([(0, 64), (100, 7), (200, 30)])
    held = set(range(64)) | set(range(100, 107)) | set(range(200, 230))
    out: list[list[tuple[int, int]]] = []
    for take, n in ops:
        if take or not out:
            got = book.take(n)
            if n > len(held):
                assert got is None
                continue
            assert got is not None
            blocks = [b for s, k in got for b in range(s, s + k)]
            assert len(blocks) == n and set(blocks) <= held and len(set(blocks)) == n
            if any(k >= n for _, k in _runs_before(held)):
                assert len(got) <= 1  # one run holds it: one copy
            held -= set(blocks)
            out.append(got)
        else:
            back = out.pop(n % len(out))
            book.give(back)
            held |= {b for s, k in back for b in range(s, s + k)}
        assert book.blocks == len(held)
        assert {b for s, k in book.runs for b in range(s, s + k)} == held
        assert all(a[0] + a[1] < b[0] for a, b in zip(book.runs, book.runs[1:], strict=False))


def _runs_before(held: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for b in sorted(held):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def test_extents_cover_the_bytes_over_the_runs_in_order() -> None:
    assert extents_of([(2, 1), (10, 2)], 4096 + 5000, 4096) == [(8192, 4096), (40960, 5000)]
    assert extents_of([(0, 3)], 1, 4096) == [(0, 1)]
