"""The client's zero-round-trip path through the broker's residency index.

``has()`` answers an index positive True without asking; ``get``/``get_many``/
``get_into`` copy an index positive straight from the slab and keep the copy
only if the slot's seqlock word is unchanged afterwards (shm/residency.py says
why that proves the bytes were the entry's, untorn). Everything else -- index
misses, a slot rewritten during the copy, leases -- takes the broker's round
trip as before. ``IndexServing`` (a BrokerClient mixin, at the end) decides when
the index may be trusted, reads this connection's own not-yet-handled placements,
and posts what was served in one ``Served`` frame, which the broker answers with
no reply, so its hit counters and LRU stay what they would have been.

Used only on x86-64 (``residency.usable_here``), only while the connection was
confirmed within ``filter_trust_s`` (a killed broker's index cannot be cleared)
and only for the index the current handshake named (a restarted broker's index
is another segment).
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ..protocol import HelloReply, Served
from ..shm.residency import KEY_CAP, Found, ResidencyReader, usable_here
from ..shm.segment import ShmError
from .arena_put import _pending
from .errors import BrokerUnavailable

if TYPE_CHECKING:
    import torch

    from .copy import SlabView

log = logging.getLogger(__name__)


def map_index(hello: HelloReply, owners: Collection[int]) -> ResidencyReader | None:
    """The index the handshake names, or None (not published, not x86-64, unusable)."""
    if not hello.residency_name:
        return None
    if not usable_here():
        return None  # no load fence from Python: the seqlock argument needs x86-TSO
    try:
        return ResidencyReader(
            hello.residency_name, hello.residency_size, hello.segment_size, owners
        )
    except (ShmError, ValueError, OverflowError) as exc:
        log.warning("not using the broker's residency index: %s", exc)
        return None


def has_known(index: ResidencyReader, keys: list[str]) -> list[bool]:
    """Per key, True where the index holds it now (a positive is exact)."""
    contains = index.contains
    return [contains(k) for k in keys]


def read_known(
    index: ResidencyReader,
    slab: SlabView,
    keys: list[str],
    device: torch.device,
    torch_dtype,  # copy.torch_dtype
    from_own: Callable[[str], torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor | None], int]:
    """Per key, a new tensor copied from the slab if the index held the key and the
    slot was unchanged after the copy, else None (ask the broker); and how many copies
    were discarded because their slot changed. ``from_own``: first try the client's
    own not-yet-handled placement of the key (BrokerClient._own_read)."""
    out: list[torch.Tensor | None] = []
    retries = 0
    for key in keys:
        if from_own is not None and (mine := from_own(key)) is not None:
            out.append(mine)
            continue
        found = index.find(key)
        tensor = None
        if found is not None:
            try:
                dtype = torch_dtype(found.dtype)
            except ValueError:
                dtype = None
            if dtype is not None:
                t = slab.read(found.extents, dtype, found.shape, device)
                if index.unchanged(found):
                    tensor = t
                else:
                    retries += 1
        out.append(tensor)
    return out, retries


def read_known_into(
    index: ResidencyReader, slab: SlabView, key: str, out: torch.Tensor, dtype_name
) -> tuple[Found | None, bool]:
    """Copy ``key`` into ``out`` if the index holds it with ``out``'s dtype and shape.
    Returns (the Found if the copy is the entry's -- the slot unchanged -- else None,
    whether ``out`` was written): on (None, True) ``out`` holds bytes that must not be
    shown (the caller overwrites them with the broker's copy or zeroes them)."""
    found = index.find(key)
    if found is None or found.dtype != dtype_name(out.dtype) or found.shape != list(out.shape):
        return None, False  # a mismatch is reported by the broker's path, as before
    slab.read_into(found.extents, out)
    return (found, True) if index.unchanged(found) else (None, True)


# Index-served items (keys + has() hits) and age after which the Served frame is sent
# alone rather than ahead of the next request (see IndexServing._post_served).
_SERVED_MAX = 64
_SERVED_AGE_S = 0.005
_HUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


class IndexServing:
    """A BrokerClient mixin: when the index may be trusted, reads of this connection's
    own placements, and the Served reports. Call with the lock held."""

    def _usable_index(self) -> ResidencyReader | None:
        """The residency index while it may be trusted (the filter's rule: a connection
        confirmed within filter_trust_s). Call with the lock held."""
        index = self._index
        sock = self._sock
        if (
            index is None
            or sock is None
            or time.monotonic() - self._confirmed_at > self.filter_trust_s
        ):
            return None
        # A killed broker cannot clear its index, and answering from it would also keep
        # its dead slab mapped: a hang-up on the socket (one poll, ~1 us) is an outage.
        if self._peer_gone():
            self._drop_socket()
            return None
        return index

    def _peer_gone(self) -> bool:
        """True once the broker's end of the connection is closed (one poll(0))."""
        sock = self._sock
        if sock is None:
            return True
        if self._hup_sock is not sock:
            self._hup_poll = select.poll()
            self._hup_poll.register(sock.fileno(), _HUP)
            self._hup_sock = sock
        assert self._hup_poll is not None
        return bool(self._hup_poll.poll(0))

    def _own_read(
        self, key: str, copy: Callable[[list[tuple[int, int]], str, list[int]], Any]
    ) -> Any:
        """``copy(extents, dtype, shape)`` from this connection's own blocks if ``key``
        was placed here and the broker has not handled that Place before or during the
        copy; None otherwise (the index or the broker is asked). Why it is exact: until
        the broker settles the seq, the blocks are this connection's arena blocks, freed
        only when the connection closes -- after its socket is closed, which the poll
        after the copy sees; and the journal word is re-read after the copy (x86-TSO,
        as for the index). Call with the lock held, the index usable."""
        own = self._own.get(key)
        journal = self._journal
        if own is None or journal is None or self._arena_slot < 0:
            return None
        seq, extents, dtype, shape, _nbytes = own
        before = journal.settled(self._arena_slot)
        if not _pending(seq, before):
            del self._own[key]  # handled: the index (or the broker) has the last word
            return None
        got = copy(extents, dtype, shape)
        if journal.settled(self._arena_slot) != before or self._peer_gone():
            return None
        return got

    def _post_served(self, keys: list[str], nbytes: list[int], has_hits: int) -> None:
        """Note what the index served (hits, bytes, LRU touches) for the broker. Sent
        as one reply-less Served frame ahead of this client's next request, or alone
        once _SERVED_MAX calls' worth or _SERVED_AGE_S of it is pending (a send per
        call would cost a wake-up of the broker per hit), and by flush() and close()."""
        if not self._served_at:
            self._served_at = time.monotonic()
        self._served_keys += keys
        self._served_nbytes += nbytes
        self._served_has += has_hits
        if (
            len(self._served_keys) + self._served_has >= _SERVED_MAX
            or time.monotonic() - self._served_at >= _SERVED_AGE_S
        ):
            try:
                self._send(b"")
            except BrokerUnavailable:
                pass  # uncounted, like a get whose Release could not be sent

    def _served_frame(self) -> bytes:
        """The pending Served frame (b"" if none), taken: the caller sends it first."""
        if not self._served_at:
            return b""
        keys, nbytes, has_hits = self._served_keys, self._served_nbytes, self._served_has
        self._served_keys, self._served_nbytes, self._served_has = [], [], 0
        self._served_at = 0.0
        # Indexed keys are <= KEY_CAP bytes: this many always fit the broker's frame limit.
        hello = self._hello
        limit = hello.max_frame_bytes if hello is not None and hello.max_frame_bytes else 1 << 20
        per = max(1, (limit - 64) // (KEY_CAP + 24))
        return b"".join(
            self._frame(Served(keys[i : i + per], nbytes[i : i + per], has_hits if not i else 0))
            for i in range(0, max(len(keys), 1), per)
        )
