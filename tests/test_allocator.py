"""Property tests of the block allocator's invariants."""

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmcache_ec_broker.shm.allocator import BlockAllocator


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(nblocks=st.integers(min_value=1, max_value=300))
    def setup(self, nblocks: int) -> None:
        self.alloc = BlockAllocator(nblocks)
        self.nblocks = nblocks
        self.held: list[list[tuple[int, int]]] = []

    @rule(n=st.integers(min_value=0, max_value=320))
    def allocate(self, n: int) -> None:
        free_before = self.alloc.free_blocks
        runs = self.alloc.allocate(n)
        if n > free_before:
            assert runs is None
            assert self.alloc.free_blocks == free_before
            return
        # Never fails while enough blocks are free, whatever the fragmentation.
        assert runs is not None
        assert sum(length for _, length in runs) == n
        if n and free_before and self.alloc.largest_run() < n <= free_before:
            pass  # fragmented case: several runs are fine
        self.held.append(runs)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(min_value=0, max_value=10_000))
    def free(self, i: int) -> None:
        runs = self.held.pop(i % len(self.held))
        self.alloc.free(runs)

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
