"""The put arena path (docs/design.md "Put arenas"): a put copies into slab blocks
granted to this connection ahead of time and posts a Place, waiting for nothing;
grants are asked for when the arena runs low, and blocks of a placement the broker
did not store come back. A BrokerClient mixin; its state is set up in
BrokerClient.__init__. Call everything with the lock held."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..protocol import ArenaGrant, ArenaReply, Place, PlaceReply
from .arena_blocks import extents_of
from .errors import BrokerUnavailable
from .frames import _MAX_OWED

if TYPE_CHECKING:
    import torch


class ArenaPut:
    """Placing entries in this connection's arena."""

    def _may_place(self, key: str, nbytes: int) -> bool:
        """Whether ``key`` can go into the arena: the broker grants one, it will accept
        the entry (else the reserve path raises its refusal), and the trusted filter
        says the key is absent (a present key would be copied for nothing)."""
        hello = self._hello
        flt = self._filter
        return (
            hello is not None
            and self._arena_slot >= 0
            and self._journal is not None
            and flt is not None
            and 0 < len(key) <= hello.max_key_length
            and nbytes <= hello.max_entry_bytes
            and key not in self._posted_keys
            and time.monotonic() - self._confirmed_at <= self.filter_trust_s
            and not self._arena_hidden()  # else the filter's "absent" is no proof
            and not flt.maybe(key)
        )

    def _place_copy(
        self, key: str, tensor: torch.Tensor, dtype: str, shape: list[int], nbytes: int
    ) -> tuple[bytes, list[tuple[int, int]]] | None:
        """Copy ``tensor`` into arena blocks and return its Place frame (not sent yet)
        and the blocks; None: not placeable now, take the reserve path. Call with the
        lock held."""
        if self._owed >= _MAX_OWED:
            self._read_replies(0)
        if not self._may_place(key, nbytes):
            return None
        hello = self._hello
        assert hello is not None
        bs = hello.block_size
        need = -(-nbytes // bs)
        if self._arena.blocks < need and self._grant_owed:
            self._read_replies(0)  # the refill's reply, usually in already
            if not self._may_place(key, nbytes):
                return None
        runs = self._arena.take(need)
        if runs is None:
            return None
        try:
            self._slab_view().write(extents_of(runs, nbytes, bs), tensor)
        except BrokerUnavailable:
            raise  # the connection, and with it the arena, is gone
        except BaseException:
            self._arena.give(runs)
            raise
        self._arena_seq = seq = (self._arena_seq + 1) & 0xFFFFFFFF
        self._placing[key] = (seq, extents_of(runs, nbytes, bs), dtype, shape, nbytes)
        return self._frame(Place(key, nbytes, dtype, shape, runs, seq)), runs

    def _place_many(
        self,
        items: list[tuple[str, torch.Tensor]],
        descs: list[tuple[str, list[int], int]],
        stored: list[bool],
    ) -> tuple[list[bytes], list[str]]:
        """Copy every placeable item into the arena (marking it in ``stored``); the
        Place frames and keys, not sent yet. A failed copy gives every block back."""
        frames: list[bytes] = []
        keys: list[str] = []
        taken: list[tuple[int, int]] = []
        try:
            for i, (key, tensor) in enumerate(items):
                if key in keys:
                    continue  # a second item of the same key reserves (and finds it)
                dtype, shape, nbytes = descs[i]
                got = self._place_copy(key, tensor, dtype, shape, nbytes)
                if got is None:
                    continue
                frames.append(got[0])
                taken += got[1]
                keys.append(key)
                stored[i] = True
        except BrokerUnavailable:
            raise
        except BaseException:
            if self._sock is not None:
                self._arena.give(taken)  # nothing of this batch was sent
            raise
        return frames, keys

    def _send_placed(self, frames: list[bytes], keys: list[str]) -> None:
        """Post the Place frames (and a refill if the arena runs low) in one send. The
        journal says "placed" before the frames leave: from then on other processes
        ask the broker rather than trust their filter (shm/journal.py)."""
        assert self._journal is not None
        self._journal.mark_placed(self._arena_slot, self._arena_seq)
        grant = self._grant_frame()
        self._send(b"".join(frames) + grant)
        self._owed += len(frames) + (1 if grant else 0)
        if grant:
            self._grant_owed = True
        self._posted_keys.update(keys)
        placing, own = self._placing, self._own
        for key in keys:
            own[key] = placing[key]
        placing.clear()
        if len(own) > _MAX_OWED:  # drop what the broker has handled (the index has it)
            settled = self._journal.settled(self._arena_slot)
            for key in [k for k, v in own.items() if not _pending(v[0], settled)]:
                del own[key]

    def _grant_frame(self) -> bytes:
        """An ArenaGrant frame topping the arena up to the broker's cap, or b"" when it
        is at least half full, a grant is owed, or the last grant came back empty."""
        hello = self._hello
        if hello is None or not hello.put_arena_bytes or self._journal is None:
            return b""
        held = self._arena.blocks * hello.block_size
        if self._grant_owed or held * 2 >= hello.put_arena_bytes:
            return b""
        if time.monotonic() < self._grant_after:
            return b""
        return self._frame(ArenaGrant(hello.put_arena_bytes - held))

    def _ask_arena(self) -> None:
        """Post a grant when the arena is low (lazily: the first put of a connection);
        the reserve that follows reads its reply. Call with the lock held."""
        grant = self._grant_frame()
        if grant:
            self._send(grant)
            self._owed += 1
            self._grant_owed = True

    def _arena_reply(self, reply: ArenaReply | PlaceReply) -> None:
        """A grant's new blocks, or the blocks of a placement the broker did not store
        (the key was present), go (back) into the arena."""
        hello = self._hello
        if hello is None:
            return
        if isinstance(reply, ArenaReply):
            self._grant_owed = False
            if reply.slot >= 0:
                self._arena_slot = reply.slot
            if not reply.runs:
                self._grant_after = time.monotonic() + 1.0
        elif reply.stored:
            return
        nblocks = hello.segment_size // hello.block_size
        ok = [(b, n) for b, n in reply.runs if n > 0 and 0 <= b and b + n <= nblocks]
        if ok:
            self._arena.give(ok)

    def _arena_hidden(self) -> bool:
        """True while another connection may have placed an entry the broker has not
        handled yet: a local filter "absent" is then no proof (shm/journal.py)."""
        hello = self._hello
        if hello is None or not hello.put_arena_bytes:
            return False
        journal = self._journal
        return journal is None or journal.any_unsettled(self._arena_slot)


def _pending(seq: int, settled: int) -> bool:
    """Whether placement ``seq`` is after the last one the broker settled (u32 wrap)."""
    return 0 < (seq - settled) & 0xFFFFFFFF < 1 << 31
