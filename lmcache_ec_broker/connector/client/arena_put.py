"""The put arena of one connection (docs/design.md "Put arenas"): a put copies into
slab blocks granted to this connection ahead of time and posts a Place, waiting for
nothing; grants are asked for when the arena runs low, and blocks of a placement
the broker did not store come back.

``PutArena`` is a part of one ``Session`` (connector/client/session.py): made with the
connection, dropped with it (the broker frees the arena with the connection). It
gets what it reads through its constructor: the handshake's limits, the placement
journal of the broker's epoch (or None) and the session's framer. It builds frames
but never sends: BrokerClient sends them on the session's wire.

Invariant: a block is in ``blocks`` only while the broker has it in this
connection's arena and no posted Place names it. Call everything with the
client's lock held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from ...protocol import ArenaGrant, ArenaReply, HelloReply, Place, PlaceReply
from ...shm.journal import Journal
from .arena_blocks import ArenaBlocks, Run, extents_of
from .frames import _MAX_OWED

# key -> (seq, extents, dtype, shape, nbytes) of a placement made on this connection
Own = tuple[int, list[tuple[int, int]], str, list[int], int]


class PutArena:
    """Placing entries in this connection's arena."""

    __slots__ = (
        "blocks",
        "slot",
        "seq",
        "own",
        "grant_owed",
        "_placing",
        "_grant_after",
        "_journal",
        "_frame",
        "_block_size",
        "_cap_bytes",
        "_nblocks",
        "_max_key",
        "_max_entry",
    )

    def __init__(
        self,
        hello: HelloReply,
        journal: Journal | None,
        frame: Callable[[msgspec.Struct], bytes],
    ) -> None:
        self.blocks = ArenaBlocks()
        self.slot = -1  # this connection's journal slot, known from the first grant
        self.seq = 0  # placements made (journal "placed"; wraps at 2**32)
        # Entries this connection placed whose Place the broker may not have handled
        # yet. Until the broker settles that seq the blocks are still this connection's
        # arena blocks, which nobody else can write, so a get of such a key may copy
        # from them (own_read).
        self.own: dict[str, Own] = {}
        self._placing: dict[str, Own] = {}
        self.grant_owed = False  # an ArenaGrant is posted and its reply not read yet
        self._grant_after = 0.0  # after an empty grant: ask again no sooner than this
        self._journal = journal if hello.put_arena_bytes else None
        self._frame = frame
        self._block_size = hello.block_size
        self._cap_bytes = hello.put_arena_bytes if journal is not None else 0
        self._nblocks = hello.segment_size // hello.block_size
        self._max_key = hello.max_key_length
        self._max_entry = hello.max_entry_bytes

    def fits(self, key: str, nbytes: int) -> bool:
        """Whether the arena can take ``key`` at all (it holds a slot, and the broker
        will accept the entry: else the reserve path raises its refusal)."""
        return (
            self.slot >= 0
            and self._journal is not None
            and 0 < len(key) <= self._max_key
            and nbytes <= self._max_entry
        )

    def need(self, nbytes: int) -> int:
        """Blocks an entry of ``nbytes`` takes."""
        return -(-nbytes // self._block_size)

    def holds(self, nbytes: int) -> bool:
        """Whether the arena holds enough free blocks for ``nbytes`` now."""
        return self.blocks.blocks >= self.need(nbytes)

    def take(self, nbytes: int) -> tuple[list[Run], list[tuple[int, int]]] | None:
        """Blocks for ``nbytes`` and the extents to copy into, or None (too few held)."""
        runs = self.blocks.take(self.need(nbytes))
        if runs is None:
            return None
        return runs, extents_of(runs, nbytes, self._block_size)

    def give(self, runs: list[Run]) -> None:
        self.blocks.give(runs)

    def place(
        self, key: str, runs: list[Run], extents: list[tuple[int, int]], dtype: str,
        shape: list[int], nbytes: int,
    ) -> bytes:  # fmt: skip
        """Note a copied entry and return its Place frame (not sent yet)."""
        self.seq = seq = (self.seq + 1) & 0xFFFFFFFF
        self._placing[key] = (seq, extents, dtype, shape, nbytes)
        return self._frame(Place(key, nbytes, dtype, shape, runs, seq))

    def unplace(self, key: str) -> None:
        """``place`` taken back: the copy failed, the frame is never sent (the seq it
        took is skipped; the journal only ever compares the last one)."""
        self._placing.pop(key, None)

    def mark_placed(self) -> None:
        """The journal says "placed" before the frames leave: from then on other
        processes ask the broker rather than trust their filter (shm/journal.py)."""
        assert self._journal is not None
        self._journal.mark_placed(self.slot, self.seq)

    def excused(self) -> bool:
        """Whether the broker distrusts this connection's journal slot (a placement
        stayed pending too long): the put must wait for the broker before returning."""
        journal = self._journal
        return journal is not None and journal.excused(self.slot)

    def sent(self, keys: list[str], granted: bool) -> None:
        """The Place frames of ``keys`` (and a grant if ``granted``) are being sent (a
        failed send drops the session with this arena)."""
        if granted:
            self.grant_owed = True
        placing, own = self._placing, self.own
        for key in keys:
            own[key] = placing[key]
        placing.clear()
        if len(own) > _MAX_OWED and self._journal is not None:
            # drop what the broker has handled (the index has it)
            settled = self._journal.settled(self.slot)
            for key in [k for k, v in own.items() if not pending(v[0], settled)]:
                del own[key]

    def grant_frame(self) -> bytes:
        """An ArenaGrant frame topping the arena up to the broker's cap, or b"" when it
        is at least half full, a grant is owed, or the last grant came back empty."""
        if not self._cap_bytes:
            return b""
        held = self.blocks.blocks * self._block_size
        if self.grant_owed or held * 2 >= self._cap_bytes:
            return b""
        if time.monotonic() < self._grant_after:
            return b""
        return self._frame(ArenaGrant(self._cap_bytes - held))

    def owed_reply(self, reply: Any) -> None:
        """A posted request's reply: a grant's new blocks, or the blocks of a placement
        the broker did not store (the key was present), go (back) into the arena."""
        if isinstance(reply, ArenaReply):
            self.grant_owed = False
            if reply.slot >= 0:
                self.slot = reply.slot
            if not reply.runs:
                self._grant_after = time.monotonic() + 1.0
        elif not isinstance(reply, PlaceReply) or reply.stored:
            return
        nblocks = self._nblocks
        ok = [(b, n) for b, n in reply.runs if n > 0 and 0 <= b and b + n <= nblocks]
        if ok:
            self.blocks.give(ok)

    def caught_up(self) -> None:
        self.grant_owed = False  # its reply, if one was owed, was just read

    def own_read(self, key: str, copy: Callable[..., Any], peer_gone: Callable[[], bool]) -> Any:
        """``copy(extents, dtype, shape)`` from this connection's own blocks if ``key``
        was placed here and the broker has not handled that Place before or during the
        copy; None otherwise (the index or the broker is asked). Why it is exact: until
        the broker settles the seq, the blocks are this connection's arena blocks, freed
        only when the connection closes -- after its socket is closed, which
        ``peer_gone`` after the copy sees; and the journal word is re-read after the
        copy (x86-TSO, as for the index)."""
        own = self.own.get(key)
        journal = self._journal
        if own is None or journal is None or self.slot < 0:
            return None
        seq, extents, dtype, shape, _nbytes = own
        before = journal.settled(self.slot)
        if not pending(seq, before):
            del self.own[key]  # handled: the index (or the broker) has the last word
            return None
        got = copy(extents, dtype, shape)
        if journal.settled(self.slot) != before or peer_gone():
            return None
        return got


def pending(seq: int, settled: int) -> bool:
    """Whether placement ``seq`` is after the last one the broker settled (u32 wrap)."""
    return 0 < (seq - settled) & 0xFFFFFFFF < 1 << 31


_pending = pending  # the name tests and older code import
