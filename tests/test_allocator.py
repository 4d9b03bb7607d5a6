"""Property tests of the block allocator's invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmcache_ec_broker.shm.allocator import BlockAllocator, DoubleFree


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(nblocks=st.integers(min_value=1, max_value=300))
    def setup(self, nblocks: int) -> None:
        self.alloc = BlockAllocator(nblocks)
        self.nblocks = nblocks
        self.held: list[list[tuple[int, int]]] = []
        self.freed: list[tuple[int, int]] = []  # runs freed at least once

    @rule(n=st.integers(min_value=0, max_value=320))
    def allocate(self, n: int) -> None:
        free_before = self.alloc.free_blocks
        largest_before = self.alloc.largest_run()
        runs = self.alloc.allocate(n)
        if n > free_before:
            assert runs is None
            assert self.alloc.free_blocks == free_before
            return
        # Never fails while enough blocks are free, whatever the fragmentation.
        assert runs is not None
        assert sum(length for _, length in runs) == n
        assert all(length > 0 for _, length in runs)
        if 0 < n <= largest_before:
            assert len(runs) == 1, f"{n} blocks fit one free run of {largest_before}: {runs}"
        else:
            assert n == 0 or len(runs) > 1  # fragmented: several runs are fine, never fewer
        self.held.append(runs)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(min_value=0, max_value=10_000))
    def free(self, i: int) -> None:
        runs = self.held.pop(i % len(self.held))
        self.alloc.free(runs)
        self.freed.extend(runs)

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(min_value=0, max_value=10_000), shift=st.integers(-2, 2))
    def double_free(self, i: int, shift: int) -> None:
        # A run freed before (shifted: overlapping a free run) is refused, state unchanged.
        start, length = self.freed[i % len(self.freed)]
        run = (max(0, start + shift), length)
        if run[0] + length > self.nblocks:
            return
        if any(s < run[0] + length and run[0] < s + n for r in self.held for s, n in r):
            return  # overlaps a held run too: that is a legal mix, not what this rule tests
        before = (self.alloc.free_blocks, self.alloc.free_runs)
        with pytest.raises(DoubleFree):
            self.alloc.free([run])
        assert (self.alloc.free_blocks, self.alloc.free_runs) == before

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check()
        owned: set[int] = set()
        for runs in self.held:
            for start, length in runs:
                blocks = set(range(start, start + length))
                assert not blocks & owned, "a block was handed out twice"
                assert start >= 0 and start + length <= self.nblocks
                owned |= blocks
        assert len(owned) + self.alloc.free_blocks == self.nblocks


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.integers(min_value=1, max_value=64))
def test_contiguous_when_possible(n: int) -> None:
    alloc = BlockAllocator(64)
    assert alloc.allocate(n) == [(0, n)]


def test_best_fit_prefers_single_extent() -> None:
    alloc = BlockAllocator(10)
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    alloc.allocate(5)
    assert a and b
    alloc.free(a)  # free: [0,3)
    alloc.free(b)  # coalesced: [0,5)
    assert alloc.free_runs == 1
    assert alloc.allocate(4) == [(0, 4)]


def test_fragmented_allocation_uses_several_extents() -> None:
    alloc = BlockAllocator(8)
    runs = [alloc.allocate(1) for _ in range(8)]
    for r in runs[::2]:
        assert r is not None
        alloc.free(r)
    got = alloc.allocate(4)
    assert got is not None and len(got) == 4 and sum(n for _, n in got) == 4
    assert alloc.allocate(1) is None


def test_double_and_overlapping_free_fail_loudly() -> None:
    alloc = BlockAllocator(16)
    a = alloc.allocate(4)
    b = alloc.allocate(4)
    assert a == [(0, 4)] and b == [(4, 4)]
    alloc.free(a)
    with pytest.raises(DoubleFree):
        alloc.free(a)  # twice
    with pytest.raises(DoubleFree):
        alloc.free([(2, 4)])  # half free, half held by b
    with pytest.raises(DoubleFree):
        alloc.free([(4, 2), (5, 2)])  # overlapping runs in one call
    with pytest.raises(ValueError):
        alloc.free([(14, 4)])  # past the end
    alloc.check()
    assert alloc.free_blocks == 12  # nothing was freed by the refused calls
    alloc.free(b)
    assert alloc.free_runs == 1 and alloc.largest_run() == 16


def test_best_fit_picks_the_shortest_run_that_fits() -> None:
    alloc = BlockAllocator(20)
    runs = [alloc.allocate(n) for n in (5, 1, 3, 1, 8, 2)]
    alloc.free(runs[0])  # free: [0,5)
    alloc.free(runs[2])  # free: [6,9)
    alloc.free(runs[4])  # free: [10,18) (+ [18,20) held by the 2-run)
    assert alloc.allocate(3) == [(6, 3)]  # the 3-run, not the 5- or 8-run
    assert alloc.allocate(4) == [(0, 4)]  # then the 5-run
    alloc.check()


def test_allocator_benchmark_runs() -> None:
    # The benchmark script (benchmarks/allocator.py) on a tiny slab, so it cannot rot.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "allocator.py"
    r = subprocess.run(
        [sys.executable, str(script), "--slab", "64MiB", "--ops", "200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "alloc_p99_us" in r.stdout and "1024 blocks" in r.stdout, r.stdout
