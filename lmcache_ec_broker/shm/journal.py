"""The placement journal: how a posted arena put stays visible to every other process.

A client with a put arena (see broker/store.py) copies an entry into its own blocks
and posts a Place without waiting, so when ``put`` returns the broker may not have
added the key to the membership filter yet, and another process's filter would
answer a wrong local "absent". The journal closes that gap.

Two segments, one writer class each (docs/design.md "Shared memory"):

- ``placed`` (a memfd labelled ``<slab>-j``: no name in /dev/shm that another uid
  could take first; handed to admitted clients over the socket): one
  little-endian u32 per arena slot, written by the slot's client: its placement count.
  Any admitted client can write any word of it, so nobody trusts it for more than a
  hint: the broker reads it only to decide whose socket to read first, a reader only
  to decide to ask the broker rather than trust its filter.
- ``settled`` (a sealed memfd, handed over the socket; no path reaches it and no
  mapping but the broker's can write it, root's included): per slot four u32 --
  ``settled`` (the last placement the broker handled), ``excused`` and ``tentative``
  (a stopped client's window, below), one spare -- then ``bound``: one more than the
  highest slot ever handed out, so readers scan ``bound`` slots, not ``nslots``.

Protocol:
- the client writes ``placed = seq`` *after* copying the entry and *before* sending
  the Place and returning from ``put``;
- the broker handles the Place (filter add, entry READY) and *then* writes
  ``settled = seq``;
- a reader trusts a local filter "absent" only while no other slot is *pending*
  (``placed != settled`` and ``placed != excused``; read before the filter);
  otherwise it asks the broker, which first reads the pending frames of every
  connection whose slot is unsettled (server.settle_reservations), so the placement
  is handled before the answer.

A slot that shows ``settled`` was written after the filter add, so a filter read
that follows it sees the key (x86-TSO keeps stores and loads in order). The broker
zeroes a slot when it hands it to a connection and when that connection closes, and
raises ``bound`` over a slot *before* the connection learns the slot.

What a misbehaving client can do with ``placed`` (the only words it can write): make
readers ask the broker (a round trip each; bounded per slot by the excuse below), or
make a pending placement of another client look settled until the broker's loop reads
that client's frame (microseconds to milliseconds): a missed hit, never a wrong one.
Its own placements' ``settled`` words, which decide whether it may read its own arena
blocks (connector/arena_put.py ``own_read``), are out of every client's reach: a
rewound or forged word can no longer make a client copy blocks another entry reused.

A stopped client (issue 29 item 6) leaves ``placed != settled`` for as long as it is
stopped, between marking and sending. Its window is *excused* after ``STALL_BOUND_S``
(the broker's own clock, per slot): when a reader's question makes the broker find
the slot still pending after reading that client's socket, and the same ``placed``
value has been pending that long, the broker writes ``tentative = p``, then reads the
client's socket to the end (every frame it sent so far is handled), and if the slot
is still pending writes ``excused = p``; readers then skip that slot. The client,
after sending its Place frames for ``p``, reads ``tentative``/``excused``: if either
is ``p`` it waits for its replies before ``put`` returns. Why no returned put is ever
skipped: if the client's check saw neither word, its check (and so its send) came
before the broker's ``tentative`` store, so the frame was in the socket when the
broker read it to the end, was handled and settled ``p`` -- no excuse is written;
otherwise the client waited until the broker handled the frame.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Collection

from .segment import Segment

_WORD = struct.Struct("<I")
PLACED_BYTES = 4  # per slot, in the ``placed`` segment
SETTLED_BYTES = 16  # per slot, in the ``settled`` segment: settled, excused, tentative, spare
_SETTLED, _EXCUSED, _TENTATIVE = 0, 4, 8
_MASK = 0xFFFFFFFF
# How long one placement may stay pending, by the broker's clock, before a reader's
# question excuses it (a stopped client then costs others at most about this long).
STALL_BOUND_S = 0.05

try:  # the client side has numpy (torch needs it); the broker reads slots one by one
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


_SCAN_IN_PYTHON = 16  # below this many slots a struct unpack beats numpy's per-call cost


def journal_size(nslots: int) -> int:
    """Bytes of the ``placed`` segment (the one the handshake names)."""
    return max(1, nslots) * PLACED_BYTES


def settled_size(nslots: int) -> int:
    return max(1, nslots) * SETTLED_BYTES + _WORD.size  # the slots, then ``bound``


class Journal:
    """One mapping of both journal segments (the broker's or a client's)."""

    def __init__(self, placed: Segment, settled: Segment) -> None:
        self.segment = placed
        self.settled_segment = settled
        self.nslots = placed.size // PLACED_BYTES
        if settled.size < settled_size(self.nslots):
            raise ValueError(
                f"journal settled words have {settled.size} bytes, "
                f"{settled_size(self.nslots)} needed for {self.nslots} slots"
            )
        self._bound_at = self.nslots * SETTLED_BYTES
        self._p = placed.mm
        self._s = settled.mm
        self._bound = 0  # the broker's copy of ``bound``
        self._since: dict[int, tuple[int, float]] = {}  # broker: slot -> (placed, first seen)
        self._placed = self._words = None
        if _np is not None:
            self._placed = _np.frombuffer(placed.mm, dtype="<u4", count=self.nslots)
            self._words = _np.frombuffer(
                settled.mm, dtype="<u4", count=4 * self.nslots
            ).reshape(self.nslots, 4)

    @classmethod
    def create(cls, name: str, nslots: int) -> Journal:
        placed = Segment.create_memfd(name, journal_size(nslots))
        try:
            settled = Segment.create_sealed(name + "s", settled_size(nslots))
        except BaseException:
            placed.close()
            placed.unlink()
            raise
        return cls(placed, settled)

    @classmethod
    def attach(
        cls,
        name: str,
        size: int,
        owners: Collection[int] | None,
        placed_fd: int | None = None,
        settled_fd: int | None = None,
    ) -> Journal:
        """Map the journal the handshake named. ``settled_fd`` (handed over the socket)
        is required: the settled words have no name."""
        if settled_fd is None:
            raise ValueError("the broker sent no journal settled words (an older broker?)")
        nslots = size // PLACED_BYTES
        if placed_fd is None:
            placed = Segment.attach(name, size, prefault=False, owners=owners)
        else:
            placed = Segment.attach_fd(placed_fd, name, size, False, owners)
        try:
            settled = Segment.attach_fd(
                settled_fd, name + "s", settled_size(nslots), False, owners, writable=False
            )
        except BaseException:
            placed.close()
            raise
        return cls(placed, settled)

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def size(self) -> int:
        return self.segment.size

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.nslots:
            raise ValueError(f"journal slot {slot} outside 0..{self.nslots - 1}")
        return slot

    # ---------------------------------------------------------------- broker side

    def reset(self, slot: int) -> None:
        self._check(slot)
        _WORD.pack_into(self._p, slot * PLACED_BYTES, 0)
        self._s[slot * SETTLED_BYTES : (slot + 1) * SETTLED_BYTES] = bytes(SETTLED_BYTES)
        self._since.pop(slot, None)

    def hand_out(self, slot: int) -> None:
        """Zero ``slot`` and cover it by ``bound``; call before its connection learns it."""
        self.reset(slot)
        if slot >= self._bound:
            self._bound = slot + 1
            _WORD.pack_into(self._s, self._bound_at, self._bound)

    def settle(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._s, self._check(slot) * SETTLED_BYTES + _SETTLED, seq & _MASK)

    def _placed_word(self, slot: int) -> int:
        return _WORD.unpack_from(self._p, slot * PLACED_BYTES)[0]

    def _word(self, slot: int, at: int) -> int:
        return _WORD.unpack_from(self._s, slot * SETTLED_BYTES + at)[0]

    def unsettled(self, slot: int) -> bool:
        """Whether ``slot``'s client says it placed something the broker has not handled
        (its own word: a hint for whose socket to read first, never trusted further)."""
        self._check(slot)
        placed = self._placed_word(slot)
        return placed != self._word(slot, _SETTLED) and placed != self._word(slot, _EXCUSED)

    def stalled(self, slot: int, drain: Callable[[], bool]) -> bool:
        """``slot`` is still pending after its connection's pending frames were read.
        Once the same placement has been pending ``STALL_BOUND_S``, excuse it (the
        module docstring's protocol; ``drain`` reads and handles everything the client
        sent so far and says whether it did). True if the slot is excused now."""
        self._check(slot)
        placed = self._placed_word(slot)
        now = time.monotonic()
        seen = self._since.get(slot)
        if seen is None or seen[0] != placed:
            self._since[slot] = (placed, now)
            return False
        if now - seen[1] < STALL_BOUND_S:
            return False
        base = slot * SETTLED_BYTES
        _WORD.pack_into(self._s, base + _TENTATIVE, placed)
        if drain() and self._placed_word(slot) == placed and self.unsettled(slot):
            _WORD.pack_into(self._s, base + _EXCUSED, placed)
            return True
        return False

    # ---------------------------------------------------------------- client side

    def mark_placed(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._p, self._check(slot) * PLACED_BYTES, seq & _MASK)

    def settled(self, slot: int) -> int:
        """The broker's ``settled`` word of ``slot`` (the last placement it handled)."""
        return self._word(self._check(slot), _SETTLED)

    def excused(self, slot: int, seq: int) -> bool:
        """Whether the broker excused (or is excusing) placement ``seq`` of ``slot``: its
        put must then wait for the broker before it returns."""
        self._check(slot)
        seq &= _MASK
        return self._word(slot, _TENTATIVE) == seq or self._word(slot, _EXCUSED) == seq

    def any_unsettled(self, own_slot: int = -1) -> bool:
        """True if a slot other than ``own_slot`` has a placement the broker has not
        handled (nor excused) yet: a local filter "absent" is then no proof."""
        (bound,) = _WORD.unpack_from(self._s, self._bound_at)
        bound = min(bound, self.nslots)
        placed, words = self._placed, self._words
        if placed is None or words is None or bound <= _SCAN_IN_PYTHON:
            p = struct.unpack_from(f"<{bound}I", self._p, 0)
            w = struct.unpack_from(f"<{4 * bound}I", self._s, 0)
            for slot in range(bound):
                if slot != own_slot and p[slot] != w[4 * slot] and p[slot] != w[4 * slot + 1]:
                    return True
            return False
        pl = placed[:bound]
        diff = (pl != words[:bound, 0]) & (pl != words[:bound, 1])
        if 0 <= own_slot < bound:
            diff[own_slot] = False
        return bool(diff.any())

    def close(self) -> None:
        self._placed = self._words = None
        self.segment.close()
        self.settled_segment.close()

    def unlink(self) -> None:
        self.segment.unlink()
        self.settled_segment.unlink()
