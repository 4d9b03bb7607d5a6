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
  ``settled`` (the last placement the broker handled), ``distrusted`` and
  ``tentative`` (the excuse, below), ``held`` (1 while the slot is handed out to a
  connection) -- then ``bound``: one more than the highest slot ever handed out, so
  readers scan ``bound`` slots, not ``nslots``.

Protocol:
- the client writes ``placed = seq`` *after* copying the entry and *before* sending
  the Place and returning from ``put``;
- the broker handles the Place (filter add, entry READY) and *then* writes
  ``settled = seq``;
- a reader trusts a local filter "absent" only while no other slot is *pending*
  (``held``, not ``distrusted``, and ``placed != settled``; read before the filter);
  otherwise it asks the broker, which first reads the pending frames of every
  connection whose slot is unsettled (server.settle_reservations), so the placement
  is handled before the answer.

A slot that shows ``settled`` was written after the filter add, so a filter read
that follows it sees the key (x86-TSO keeps stores and loads in order). The broker
zeroes a slot's words when it hands it to a connection (then sets ``held``) and when
that connection closes (``held`` 0), and raises ``bound`` over a slot *before* the
connection learns the slot.

What a misbehaving client can do with ``placed`` (the only words it can write, any
slot's): nothing through a slot nobody holds (``held`` is 0: readers skip it, issue
40 item 5); through a held slot, its own or another's, make readers ask the broker
(a round trip each) for at most ``STALL_BOUND_S`` of wall clock before the broker
distrusts that slot (below), again at most once per distrust period; or make a
pending placement of another client look settled until the broker's loop reads
that client's frame (microseconds to milliseconds): a missed hit, never a wrong one.
Its own placements' ``settled`` words, which decide whether it may read its own arena
blocks (connector/client/arena_put.py ``own_read``), are out of every client's reach: a
rewound or forged word can no longer make a client copy blocks another entry reused.

The excuse (issue 29 item 6, issue 40 item 5): a slot that stays pending -- a client
stopped between marking and sending, or one rewriting its word -- is *distrusted*
once the broker has found it pending after reading its client's socket, at readers'
questions, for ``STALL_BOUND_S`` of wall clock (the broker's clock, per slot,
whatever ``placed`` values it showed: rewriting the word does not restart the clock,
nor does showing it settled now and then; only a finding more than
``STALL_FORGET_S`` after the slot's last one starts afresh). The broker writes ``tentative``,
reads the client's socket to the end (every frame it sent so far is handled), and if
the slot is still pending writes ``distrusted``; readers then skip the slot whatever
its ``placed`` says. The distrust lasts ``DISTRUST_S``, doubling each time the same
connection earns it again, up to ``DISTRUST_MAX_S`` (``sweep``, on the broker's lease
sweeper); then readers trust the word again. So a client holds others' fast paths
down for at most ``STALL_BOUND_S`` per distrust period, and what it costs is its own:
the client, after sending its Place frames, reads ``tentative``/``distrusted``: if
either is set it waits for its replies before ``put`` returns (a posted put becomes
a round trip). Why no returned put is ever skipped: if the client's check saw neither
word, its check (and so its send) came before the broker's ``tentative`` store, so
the frame was in the socket when the broker read it to the end, was handled and
settled -- the slot is not pending, no distrust is written; otherwise the client
waited until the broker handled the frame. A connection busy with a slow request (or
not reading its replies) is read no further: an honest client sends nothing after a
request it waits for, and its Places before it were handled before it went busy, so
nothing of an honest client's is skipped there either.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Collection

from .segment import Segment

_WORD = struct.Struct("<I")
PLACED_BYTES = 4  # per slot, in the ``placed`` segment
SETTLED_BYTES = 16  # per slot, in the ``settled`` segment: settled, distrusted, tentative, held
_SETTLED, _DISTRUSTED, _TENTATIVE, _HELD = 0, 4, 8, 12
_MASK = 0xFFFFFFFF
# How long a slot may be found pending (after reading its client's socket), by the
# broker's wall clock and whatever values it shows, before the broker distrusts it: a
# stopped or misbehaving client costs others at most about this long per distrust.
STALL_BOUND_S = 0.05
# A stalled finding this long after the slot's previous one starts its clock afresh.
STALL_FORGET_S = 1.0
# How long a distrust lasts: doubling each time the same connection earns one again.
DISTRUST_S = 1.0
DISTRUST_MAX_S = 16.0

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
        # broker: slot -> (first, last) time it was found stalled, with no two findings
        # more than STALL_FORGET_S apart between; distrusted slot -> when the distrust ends;
        # slot -> distrusts its current connection earned (the next one lasts longer)
        self._since: dict[int, tuple[float, float]] = {}
        self._until: dict[int, float] = {}
        self._strikes: dict[int, int] = {}
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
        """Zero ``slot`` (``held`` 0: readers skip it; its connection closed)."""
        self._check(slot)
        _WORD.pack_into(self._p, slot * PLACED_BYTES, 0)
        self._s[slot * SETTLED_BYTES : (slot + 1) * SETTLED_BYTES] = bytes(SETTLED_BYTES)
        self._since.pop(slot, None)
        self._until.pop(slot, None)
        self._strikes.pop(slot, None)

    def hand_out(self, slot: int) -> None:
        """Zero ``slot``, mark it held and cover it by ``bound``; call before its
        connection learns it."""
        self.reset(slot)
        _WORD.pack_into(self._s, slot * SETTLED_BYTES + _HELD, 1)
        if slot >= self._bound:
            self._bound = slot + 1
            _WORD.pack_into(self._s, self._bound_at, self._bound)

    def settle(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._s, self._check(slot) * SETTLED_BYTES + _SETTLED, seq & _MASK)

    def _placed_word(self, slot: int) -> int:
        return _WORD.unpack_from(self._p, slot * PLACED_BYTES)[0]

    def _word(self, slot: int, at: int) -> int:
        return _WORD.unpack_from(self._s, slot * SETTLED_BYTES + at)[0]

    def _put(self, slot: int, at: int, value: int) -> None:
        _WORD.pack_into(self._s, slot * SETTLED_BYTES + at, value)

    def unsettled(self, slot: int) -> bool:
        """Whether ``slot``'s client says it placed something the broker has not handled
        (its own word: a hint for whose socket to read first, never trusted further);
        never while the slot is distrusted (nobody waits for it then)."""
        self._check(slot)
        if self._word(slot, _DISTRUSTED):
            return False
        return self._placed_word(slot) != self._word(slot, _SETTLED)

    def distrusted(self, slot: int) -> bool:
        """Whether readers skip ``slot`` now (the broker's side of ``excused``)."""
        return bool(self._word(self._check(slot), _DISTRUSTED))

    def stalled(self, slot: int, drain: Callable[[], bool]) -> bool:
        """``slot`` is still pending after its connection's pending frames were read.
        Once it has been found so for ``STALL_BOUND_S`` of wall clock (whatever values
        it showed; findings more than ``STALL_FORGET_S`` apart start afresh),
        distrust it (the module docstring's protocol; ``drain`` reads and handles
        everything the client sent so far and says whether it did). True if the slot
        is distrusted now."""
        self._check(slot)
        now = time.monotonic()
        seen = self._since.get(slot)
        first = now if seen is None or now - seen[1] > STALL_FORGET_S else seen[0]
        self._since[slot] = (first, now)
        if now - first < STALL_BOUND_S:
            return False
        self._put(slot, _TENTATIVE, 1)
        if drain() and self.unsettled(slot):
            strikes = self._strikes.get(slot, 0)
            self._strikes[slot] = strikes + 1
            self._until[slot] = now + min(DISTRUST_S * 2**strikes, DISTRUST_MAX_S)
            self._put(slot, _DISTRUSTED, 1)
            self._since.pop(slot, None)
            return True
        # handled after all (or not readable to the end): no distrust; the window's
        # flag goes (the client then relies on readers asking, as before)
        self._put(slot, _TENTATIVE, 0)
        return False

    def sweep(self, now: float | None = None) -> int:
        """End the distrusts whose time is up (readers trust those slots' words again);
        how many ended. Cheap: only distrusted slots are looked at."""
        until = self._until
        if not until:
            return 0
        now = time.monotonic() if now is None else now
        ended = [slot for slot, t in until.items() if t <= now]
        for slot in ended:
            del until[slot]
            self._put(slot, _DISTRUSTED, 0)
            self._put(slot, _TENTATIVE, 0)
        return len(ended)

    # ---------------------------------------------------------------- client side

    def mark_placed(self, slot: int, seq: int) -> None:
        _WORD.pack_into(self._p, self._check(slot) * PLACED_BYTES, seq & _MASK)

    def settled(self, slot: int) -> int:
        """The broker's ``settled`` word of ``slot`` (the last placement it handled)."""
        return self._word(self._check(slot), _SETTLED)

    def excused(self, slot: int) -> bool:
        """Whether the broker distrusts (or is about to distrust) ``slot``: readers skip
        it, so a put just posted from it must wait for the broker before it returns."""
        self._check(slot)
        return bool(self._word(slot, _TENTATIVE) or self._word(slot, _DISTRUSTED))

    def any_unsettled(self, own_slot: int = -1) -> bool:
        """True if a held slot other than ``own_slot``, not distrusted, has a placement
        the broker has not handled yet: a local filter "absent" is then no proof."""
        (bound,) = _WORD.unpack_from(self._s, self._bound_at)
        bound = min(bound, self.nslots)
        placed, words = self._placed, self._words
        if placed is None or words is None or bound <= _SCAN_IN_PYTHON:
            p = struct.unpack_from(f"<{bound}I", self._p, 0)
            w = struct.unpack_from(f"<{4 * bound}I", self._s, 0)
            for slot in range(bound):
                at = 4 * slot
                if slot != own_slot and p[slot] != w[at] and w[at + 3] and not w[at + 1]:
                    return True
            return False
        w = words[:bound]
        diff = (placed[:bound] != w[:, 0]) & (w[:, 3] != 0) & (w[:, 1] == 0)
        if 0 <= own_slot < bound:
            diff[own_slot] = False
        return bool(diff.any())

    def views(self) -> tuple[object, object] | None:
        """The numpy views of the placed words and the settled words (what the put
        arena's compiled check reads, through their addresses), or None without numpy."""
        if self._placed is None or self._words is None:
            return None
        return self._placed, self._words

    def close(self) -> None:
        self._placed = self._words = None
        self.segment.close()
        self.settled_segment.close()
