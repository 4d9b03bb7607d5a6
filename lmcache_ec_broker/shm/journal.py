"""The placement journal: how a posted arena put stays visible to every other process.

A client with a put arena (see broker/store.py) copies an entry into its own blocks
and posts a Place without waiting, so when ``put`` returns the broker may not have
added the key to the membership filter yet, and another process's filter would
answer a wrong local "absent". The journal closes that gap.

Layout: ``nslots`` pairs of little-endian u32, one pair per arena slot (one slot per
connection holding an arena): ``placed`` (written by the client only) and
``settled`` (written by the broker only); then one u32 ``bound`` (broker only): one
more than the highest slot ever handed out, so readers scan ``bound`` slots, not
``nslots`` (the broker hands out the lowest free slot: a handful of arena holders
keep ``bound`` small). One writer per word.

Protocol:
- the client writes ``placed = seq`` (its placement count) *after* copying the entry
  and *before* sending the Place and returning from ``put``;
- the broker handles the Place (filter add, entry READY) and *then* writes
  ``settled = seq``;
- a reader trusts a local filter "absent" only while no other slot has
  ``placed != settled`` (read before the filter); otherwise it asks the broker, which
  first reads the pending frames of every connection whose slot is unsettled
  (server.settle_reservations), so the placement is handled before the answer.

A slot that shows ``settled`` was written after the filter add, so a filter read
that follows it sees the key (x86-TSO keeps stores and loads in order). A client
that scribbles on its slot (or others') can only make readers ask the broker more
often, or hide its own puts for a while: never a wrong hit, a torn or a foreign read.
The broker zeroes a slot when it hands it to a connection and when that connection
closes, and raises ``bound`` over a slot *before* the connection learns the slot: a
placement in a slot at or above the ``bound`` a reader saw was made after that read
began, so it is not a put that returned before the read.
"""

from __future__ import annotations

import struct
from collections.abc import Collection

from .segment import Segment

_PAIR = struct.Struct("<II")
_WORD = struct.Struct("<I")
SLOT_BYTES = _PAIR.size
_MASK = 0xFFFFFFFF

try:  # the client side has numpy (torch needs it); the broker reads slots one by one
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


_SCAN_IN_PYTHON = 16  # below this many slots a struct unpack beats numpy's per-call cost


def journal_size(nslots: int) -> int:
    return max(1, nslots) * SLOT_BYTES + _WORD.size  # the pairs, then ``bound``


class Journal:
    """One mapping of the journal segment (the broker's or a client's)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.nslots = (segment.size - _WORD.size) // SLOT_BYTES
        self._bound_at = self.nslots * SLOT_BYTES
        self._mm = segment.mm
        self._pairs = None
        self._bound = 0  # the broker's copy of ``bound``
        if _np is not None:
            self._pairs = _np.frombuffer(segment.mm, dtype="<u4", count=2 * self.nslots).reshape(
                self.nslots, 2
            )

    @classmethod
    def create(cls, name: str, nslots: int, mode: int = 0o600) -> Journal:
        return cls(Segment.create(name, journal_size(nslots), mode=mode, prefault=False))

    @classmethod
    def attach(cls, name: str, size: int, owners: Collection[int] | None) -> Journal:
        return cls(Segment.attach(name, size, prefault=False, owners=owners))

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def size(self) -> int:
        return self.segment.size

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.nslots:
            raise ValueError(f"journal slot {slot} outside 0..{self.nslots - 1}")
        return slot * SLOT_BYTES

    # ---------------------------------------------------------------- broker side

    def reset(self, slot: int) -> None:
        _PAIR.pack_into(self._mm, self._check(slot), 0, 0)

    def hand_out(self, slot: int) -> None:
        """Zero ``slot`` and cover it by ``bound``; call before its connection learns it."""
        self.reset(slot)
        if slot >= self._bound:
            self._bound = slot + 1
            _WORD.pack_into(self._mm, self._bound_at, self._bound)

    def settle(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._mm, self._check(slot) + 4, seq & _MASK)

    def unsettled(self, slot: int) -> bool:
        placed, settled = _PAIR.unpack_from(self._mm, self._check(slot))
        return placed != settled

    # ---------------------------------------------------------------- client side

    def mark_placed(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._mm, self._check(slot), seq & _MASK)

    def settled(self, slot: int) -> int:
        """The broker's ``settled`` word of ``slot`` (the last placement it handled)."""
        return _WORD.unpack_from(self._mm, self._check(slot) + 4)[0]

    def any_unsettled(self, own_slot: int = -1) -> bool:
        """True if a slot other than ``own_slot`` has a placement the broker has not
        handled yet (a local filter "absent" is then no proof)."""
        # ``bound`` comes from another process: clamp it (a scribbled value can only
        # shorten the scan, i.e. hide placements for a while, as the docstring says).
        (bound,) = _WORD.unpack_from(self._mm, self._bound_at)
        bound = min(bound, self.nslots)
        pairs = self._pairs
        if pairs is None or bound <= _SCAN_IN_PYTHON:
            words = struct.unpack_from(f"<{2 * bound}I", self._mm, 0)
            for slot in range(bound):
                if slot != own_slot and words[2 * slot] != words[2 * slot + 1]:
                    return True
            return False
        diff = pairs[:bound, 0] != pairs[:bound, 1]
        if 0 <= own_slot < bound:
            diff[own_slot] = False
        return bool(diff.any())

    def close(self) -> None:
        self._pairs = None
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()
