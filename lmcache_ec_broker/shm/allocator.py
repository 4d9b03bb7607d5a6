"""Fixed-size block allocator handing out *extents* (runs of blocks).

Invariants (checked by ``check()``; property-tested in tests/test_allocator.py):
- free runs are disjoint, lie inside [0, nblocks) and are coalesced: no two free
  runs touch, so a contiguous allocation is found whenever one is possible;
- ``free_blocks`` equals the sum of the free run lengths, and the per-block
  ``_used`` map marks exactly the blocks outside free runs;
- ``allocate(n)`` succeeds whenever ``n <= free_blocks``: it returns one run if
  any free run holds ``n`` blocks (the smallest such run: best fit, one copy for
  the client) and otherwise combines the largest runs, so fragmentation never
  causes a failure;
- ``free`` refuses (``DoubleFree``, state unchanged) a run that is not entirely
  allocated: a double or overlapping free is a bug in the caller that would hand
  the same blocks to two entries.

Cost, with R free runs of D distinct lengths (D <= sqrt(2 * nblocks), since the
lengths sum to at most nblocks): a single-run allocation is O(log D + D) for the
sorted-length index (a list insert), never a scan of the R runs; a fragmented
one additionally O(k) for the k runs it takes; ``free`` is O(log D + D + length).
"""

from __future__ import annotations

import bisect

Run = tuple[int, int]  # (first block, number of blocks)


class DoubleFree(RuntimeError):
    """``free`` was given blocks that are (partly) free already."""


class BlockAllocator:
    def __init__(self, nblocks: int) -> None:
        if nblocks < 0:
            raise ValueError("nblocks must be >= 0")
        self.nblocks = nblocks
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        # length -> starts of the free runs of that length. A set, not a dict: taking
        # "any" member of a dict that had many members deleted scans their dummies.
        self._by_len: dict[int, set[int]] = {}
        self._lens: list[int] = []  # the distinct free-run lengths, ascending
        # One byte per block (1/65536 of a slab of 64 KiB blocks), 1 = allocated:
        # lets free() detect double and overlapping frees.
        self._used = bytearray(nblocks)
        self.free_blocks = 0
        if nblocks:
            self._add(0, nblocks)

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            starts = self._by_len[length] = set()
            bisect.insort(self._lens, length)
        starts.add(start)
        self.free_blocks += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        starts = self._by_len[length]
        starts.remove(start)
        if not starts:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]
        self.free_blocks -= length
        return length

    @property
    def free_runs(self) -> int:
        return len(self._by_start)

    def largest_run(self) -> int:
        return self._lens[-1] if self._lens else 0

    def _take(self, start: int, length: int, n: int) -> Run:
        """Allocate the first ``n`` blocks of the free run (start, length)."""
        self._remove(start)
        if length > n:
            self._add(start + n, length - n)
        self._used[start : start + n] = b"\x01" * n
        return (start, n)

    def allocate(self, n: int) -> list[Run] | None:
        """Return runs totalling exactly ``n`` blocks, or None if fewer are free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n == 0:
            return []
        if n > self.free_blocks:
            return None
        i = bisect.bisect_left(self._lens, n)
        if i < len(self._lens):  # best fit: the shortest run that holds n blocks
            length = self._lens[i]
            start = _any(self._by_len[length])
            return [self._take(start, length, n)]
        runs: list[Run] = []
        need = n
        while need:  # no run is long enough: the largest runs first
            length = self._lens[-1]
            start = _any(self._by_len[length])
            take = min(length, need)
            runs.append(self._take(start, length, take))
            need -= take
        runs.sort()
        return runs

    def free(self, runs: list[Run]) -> None:
        """Return runs to the free pool. All are checked before any is freed."""
        for start, length in runs:
            if length <= 0 or start < 0 or start + length > self.nblocks:
                raise ValueError(f"run {start}+{length} is outside the allocator")
            if self._used.find(0, start, start + length) != -1:
                raise DoubleFree(
                    f"run {start}+{length} is (partly) free already: double or overlapping free"
                )
        prev_end = -1
        for start, length in sorted(runs):  # runs of one call must not overlap each other
            if start < prev_end:
                raise DoubleFree(f"run {start}+{length} overlaps another run of the same free")
            prev_end = start + length
        for start, length in runs:
            end = start + length
            self._used[start:end] = bytes(length)
            prev_start = self._by_end.get(start)
            if prev_start is not None:
                start = prev_start
                length += self._remove(prev_start)
            if end in self._by_start:
                length += self._remove(end)
            self._add(start, length)

    def check(self) -> None:
        """Assert the invariants (tests and debugging; O(nblocks))."""
        total = 0
        last_end = -1
        free_map = bytearray(b"\x01" * self.nblocks)
        for start in sorted(self._by_start):
            length = self._by_start[start]
            assert length > 0, "empty free run"
            assert start > last_end, "free runs overlap or touch (not coalesced)"
            assert self._by_end[start + length] == start, "end index out of sync"
            assert start in self._by_len.get(length, set()), "length index out of sync"
            free_map[start : start + length] = bytes(length)
            last_end = start + length
            total += length
        assert last_end <= self.nblocks, "free run beyond the end"
        assert len(self._by_end) == len(self._by_start), "index sizes differ"
        assert sum(len(s) for s in self._by_len.values()) == len(self._by_start), "length index"
        assert self._lens == sorted(self._by_len), "sorted lengths out of sync"
        assert total == self.free_blocks, "free_blocks out of sync"
        assert free_map == self._used, "used-block map out of sync"


def _any(starts: set[int]) -> int:
    """A member of a non-empty set, O(1) amortised, without removing it."""
    start = starts.pop()
    starts.add(start)
    return start
