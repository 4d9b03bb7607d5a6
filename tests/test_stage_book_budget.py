"""The staging budget's promises (stage_book.py, invariant 4), as a Hypothesis state
machine over a real ``StageHub`` and one real rank on its socket:

- the embeddings of the open orders never exceed ``max_embeds``, unless one order is
  alone in the book;
- an item is left out only for lack of room (it would not fit and the book is not
  empty), never otherwise -- the book does not starve items;
- every order the book holds was sent to the rank exactly once, and the book's count
  of open embeddings is the sum of its orders', through orders, reports, loads,
  releases and ended requests;
- ``over_budget`` counts each item once per time it is held back: from the order
  that first leaves it out until it is ordered, allocated by vLLM (encoded instead),
  or every request that met it left out ended -- not once per step it waits.

The scheduler's use of it (a hit left out is a miss that step, staged in a later one)
is tested through vLLM's connector API in test_vllm_connector_unit.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_ec_broker.connector.vllm.stage_book import StageBook, StageState
from lmcache_ec_broker.connector.vllm.stage_link import (
    MAX_MSG,
    LinkHello,
    Stage,
    Staged,
    StageHub,
    StageItem,
    StageRelease,
)

MAX_EMBEDS = 100
ITEMS = {f"h{i}": n for i, n in enumerate((10, 30, 45, 60, 100, 150))}  # 150: over budget
REQUESTS = ("r0", "r1", "r2")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LinkHello | Stage | StageRelease | Staged)


class StageBudget(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ecb-stage-")
        self.hub = StageHub(os.path.join(self.dir, "hub.sock"), ranks=1)
        self.rank = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.rank.connect(self.hub.path)
        self.rank.send(_enc.encode(LinkHello(rank=0)))
        self.book = StageBook(self.hub, hold_s=3600, max_embeds=MAX_EMBEDS)
        self.book.refresh()
        assert self.book.ready
        self.model: dict[str, set[str]] = {}  # open orders -> requests waiting for them
        self.sent: dict[str, int] = {}  # orders the rank received, per item, not ended
        self.held_back: dict[str, set[str]] = {}  # items left out -> requests that met them
        self.times_held_back = 0

    def teardown(self) -> None:
        self.rank.close()
        self.book.close()  # closes the hub, which removes its socket
        shutil.rmtree(self.dir, ignore_errors=True)

    def _drain(self) -> None:
        """What the rank received: every Stage counts an order, every release ends it."""
        self.rank.setblocking(False)
        try:
            while True:
                msg = _dec.decode(self.rank.recv(MAX_MSG))
                if isinstance(msg, Stage):
                    for item in msg.items:
                        self.sent[item.mm_hash] = self.sent.get(item.mm_hash, 0) + 1
                elif isinstance(msg, StageRelease):
                    for h in msg.hashes:
                        self.sent.pop(h, None)
        except BlockingIOError:
            pass

    def _open(self) -> int:
        return sum(ITEMS[h] for h in self.model)

    @rule(
        req=st.sampled_from(REQUESTS),
        hashes=st.lists(st.sampled_from(sorted(ITEMS)), min_size=1, max_size=4),
    )
    def order(self, req: str, hashes: list[str]) -> None:
        expected_in: list[str] = []
        room = MAX_EMBEDS - self._open()
        for h in hashes:
            if h in self.model or h in expected_in:
                continue
            if ITEMS[h] <= room or (not self.model and not expected_in):
                expected_in.append(h)
                room -= ITEMS[h]
        assert self.book.order(req, [StageItem(h, "k-" + h, ITEMS[h]) for h in hashes])
        for h in expected_in:
            self.model[h] = set()
            self.held_back.pop(h, None)
        for h in hashes:
            if h in self.model:
                self.model[h].add(req)
            else:  # left out: only for lack of room, with something in the book
                assert self.model and self._open() + ITEMS[h] > MAX_EMBEDS, h
                assert self.book.state(h) is None
                if h not in self.held_back:  # a new time held back; a repeat is not
                    self.times_held_back += 1
                self.held_back.setdefault(h, set()).add(req)
        self._drain()

    @rule(h=st.sampled_from(sorted(ITEMS)))
    def allocated(self, h: str) -> None:
        """vLLM's encoder cache took the item (encoded, as a miss, or loaded)."""
        self.book.allocated(h)
        self.held_back.pop(h, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), ok=st.booleans())
    def report(self, data: st.DataObject, ok: bool) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        if self.book.state(h) is not StageState.STAGING:
            return
        self.rank.send(_enc.encode(Staged(rank=0, ok=[h] if ok else [], failed=[] if ok else [h])))
        self.hub.wait(5)
        self.book.refresh()
        assert self.book.state(h) is (StageState.STAGED if ok else StageState.FAILED)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def ship(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        if self.book.state(h) is StageState.STAGED:
            self.book.shipped(h)
            del self.model[h]
            self.sent.pop(h, None)  # the rank takes the tensor with the load

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        self.book.release({h})
        del self.model[h]
        self._drain()

    @rule(req=st.sampled_from(REQUESTS))
    def request_ends(self, req: str) -> None:
        self.book.forget_request(req)
        for h in [h for h, reqs in self.model.items() if reqs <= {req}]:
            del self.model[h]
        for reqs in self.model.values():
            reqs.discard(req)
        for h in [h for h, reqs in self.held_back.items() if reqs <= {req}]:
            del self.held_back[h]
        for reqs in self.held_back.values():
            reqs.discard(req)
        self._drain()

    @invariant()
    def within_the_budget(self) -> None:
        assert self.book.open_embeds == self._open()
        assert self.book.open_embeds <= MAX_EMBEDS or len(self.book) == 1
        assert len(self.book) == len(self.model)

    @invariant()
    def each_open_order_was_sent_once(self) -> None:
        assert {h: 1 for h in self.model} == self.sent

    @invariant()
    def over_budget_counts_each_time_an_item_is_held_back_once(self) -> None:
        assert self.book.over_budget == self.times_held_back


TestStageBudget = StageBudget.TestCase
TestStageBudget.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_an_item_held_back_for_several_steps_counts_once() -> None:
    """An item left out in steps 1, 2 and 3 (no room) and ordered in step 4 counts 1
    in ``over_budget``; held back again after that (a new time) it counts again, as
    it does after vLLM took it (encoded instead) or after its requests ended."""
    machine = StageBudget()
    book = machine.book
    try:
        big, small = StageItem("big", "k-big", 90), StageItem("small", "k-small", 20)
        assert book.order("r0", [big])
        for _ in range(3):  # steps 1-3: r1's item does not fit beside big's order
            assert book.order("r1", [small]) and book.state("small") is None
        assert book.over_budget == 1
        book.release({"big"})  # big's order ends (say, loaded): room again
        assert book.order("r1", [small])  # step 4: ordered
        assert book.state("small") is StageState.STAGING and book.over_budget == 1
        assert book.order("r0", [big])  # held back again behind small: a new time
        assert book.order("r0", [big])
        assert book.over_budget == 2
        book.allocated("big")  # vLLM encoded it instead: that time ended
        assert book.order("r2", [big]) and book.over_budget == 3
        book.forget_request("r2")  # its only request ended: so did that time
        assert book.order("r2", [big]) and book.over_budget == 4
        book.forget_request("r0")  # another request that met it left out: not the last
        assert book.order("r2", [big]) and book.over_budget == 4
    finally:
        machine.teardown()
