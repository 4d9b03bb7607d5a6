"""Fixed-size block allocator handing out *extents* (runs of blocks).

Invariants (checked by ``check()``; property-tested in tests/test_allocator.py):
- free runs are disjoint, lie inside [0, nblocks) and are coalesced: no two free
  runs touch, so a contiguous allocation is found whenever one is possible;
- ``free_blocks`` equals the sum of the free run lengths;
- ``allocate(n)`` succeeds whenever ``n <= free_blocks``: it prefers the
  best-fitting single run (one copy for the client) and otherwise combines the
  largest runs, so fragmentation never causes a failure.
The allocator does not know who owns a run; the entry index frees each run
exactly once.
"""

from __future__ import annotations

Run = tuple[int, int]  # (first block, number of blocks)


class BlockAllocator:
    def __init__(self, nblocks: int) -> None:
        if nblocks < 0:
            raise ValueError("nblocks must be >= 0")
        self.nblocks = nblocks
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self.free_blocks = 0
        if nblocks:
            self._add(0, nblocks)

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self.free_blocks += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        self.free_blocks -= length
        return length

    @property
    def free_runs(self) -> int:
        return len(self._by_start)

    def largest_run(self) -> int:
        return max(self._by_start.values(), default=0)

    def allocate(self, n: int) -> list[Run] | None:
        """Return runs totalling exactly ``n`` blocks, or None if fewer are free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n == 0:
            return []
        if n > self.free_blocks:
            return None
        best_start, best_len = -1, 0
        for start, length in self._by_start.items():
            if length == n:
                best_start, best_len = start, length
                break
            if length > n and (best_len == 0 or length < best_len):
                best_start, best_len = start, length
        if best_len:
            self._remove(best_start)
            if best_len > n:
                self._add(best_start + n, best_len - n)
            return [(best_start, n)]
        runs: list[Run] = []
        need = n
        for start, length in sorted(self._by_start.items(), key=lambda kv: -kv[1]):
            self._remove(start)
            take = min(length, need)
            runs.append((start, take))
            if length > take:
                self._add(start + take, length - take)
            need -= take
            if need == 0:
                break
        runs.sort()
        return runs

    def free(self, runs: list[Run]) -> None:
        for start, length in runs:
            if length <= 0 or start < 0 or start + length > self.nblocks:
                raise ValueError(f"run {start}+{length} is outside the allocator")
            end = start + length
            prev_start = self._by_end.get(start)
            if prev_start is not None:
                start = prev_start
                length += self._remove(prev_start)
            if end in self._by_start:
                length += self._remove(end)
            self._add(start, length)

    def check(self) -> None:
        """Assert the invariants (tests and debugging; O(runs log runs))."""
        total = 0
        last_end = -1
        for start in sorted(self._by_start):
            length = self._by_start[start]
            assert length > 0, "empty free run"
            assert start > last_end, "free runs overlap or touch (not coalesced)"
            assert self._by_end[start + length] == start, "end index out of sync"
            last_end = start + length
            total += length
        assert last_end <= self.nblocks, "free run beyond the end"
        assert len(self._by_end) == len(self._by_start), "index sizes differ"
        assert total == self.free_blocks, "free_blocks out of sync"
