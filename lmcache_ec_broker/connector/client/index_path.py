"""The client's zero-round-trip path through the broker's residency index.

``has()`` answers an index positive True without asking; ``get``/``get_many``/
``get_into`` copy an index positive straight from the slab and keep the copy
only if the slot's seqlock word is unchanged afterwards (shm/residency.py says
why that proves the bytes were the entry's, untorn). Everything else -- index
misses, a slot rewritten during the copy, leases -- takes the broker's round
trip as before. ``ServedBatch`` (at the end, a part of each Session) keeps what
was served for one ``Served`` frame, which the broker answers with no reply, so
its hit counters and LRU stay what they would have been, within SERVED_FLUSH_S
even when the client sends nothing else (served_flush.py sends a due batch alone).

Used only on x86-64 (``residency.usable_here``), only while the connection was
confirmed within ``filter_trust_s`` (a killed broker's index cannot be cleared)
and only for the index the current handshake named (a restarted broker's index
is another segment).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ...protocol import HelloReply, Served
from ...shm.residency import CHANGED, COPIED, KEY_CAP, ResidencyReader, usable_here
from ...shm.segment import ShmError

if TYPE_CHECKING:
    import torch

    from .copy import SlabView

log = logging.getLogger(__name__)


def map_index(
    hello: HelloReply, owners: Collection[int], fd: int | None = None
) -> ResidencyReader | None:
    """The index the handshake names (from ``fd`` when the broker sent one), or None
    (not published, not x86-64, unusable)."""
    if not hello.residency_name:
        return None
    if not usable_here():
        return None  # no load fence from Python: the seqlock argument needs x86-TSO
    try:
        return ResidencyReader(
            hello.residency_name, hello.residency_size, hello.segment_size, owners, fd
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
) -> tuple[int | None, bool]:
    """Copy ``key`` into ``out`` if the index holds it with ``out``'s dtype and shape.
    Returns (the entry's nbytes if the copy is the entry's -- the slot unchanged -- else
    None, whether ``out`` was written): on (None, True) ``out`` holds bytes that must
    not be shown (the caller overwrites them with the broker's copy or zeroes them).

    A contiguous CPU ``out`` takes the compiled copy when the package has it
    (ResidencyReader.copy_into: the same answers in one call, issue 42); anything else
    -- CUDA, a non-contiguous ``out`` (refused by read_into, as before) -- this path."""
    if index.compiled and out.is_cpu and out.is_contiguous():
        nbytes = out.nbytes
        got = index.copy_into(
            key, out.data_ptr(), nbytes, dtype_name(out.dtype), out.shape,  # a tuple
            slab.base, slab.size,
        )  # fmt: skip
        if got == COPIED:
            return nbytes, True
        return None, got == CHANGED
    found = index.find(key)
    if found is None or found.dtype != dtype_name(out.dtype) or found.shape != list(out.shape):
        return None, False  # a mismatch is reported by the broker's path, as before
    slab.read_into(found.extents, out)
    return (found.nbytes, True) if index.unchanged(found) else (None, True)


# Index-served items (keys + has() hits) after which the caller sends the Served frame
# alone rather than ahead of the next request (see ServedBatch.note); without a flusher
# (SERVED_FLUSH_S None) also once the batch is this old.
_SERVED_MAX = 64
_SERVED_AGE_S = 0.005
# The longest a noted item waits for a request to carry it: then the client's flusher
# thread (connector/client/served_flush.py) sends it alone. The broker's counters, Prometheus
# and LRU order follow a served hit within this plus one loop turn (docs/design.md
# "Served hits reach the broker within 100 ms"). None: no flusher (benchmarks' switch).
SERVED_FLUSH_S: float | None = 0.05


class ServedBatch:
    """What the index served on one connection (hits, bytes, LRU touches), not yet
    told to the broker: a part of one Session, dropped with it (the counts die with
    the connection, like its pins). Sent as reply-less Served frames ahead of the
    connection's next request (the wire asks ``take``), or alone once ``note`` says
    so, by the flusher thread once ``at`` is SERVED_FLUSH_S old (``send_nowait``),
    and by flush() and close().

    Invariant: ``at`` is nonzero exactly while something is pending: noted items or
    ``_unsent``, the tail of frames a ``send_nowait`` could not write whole, which
    ``take`` returns first (so the wire never carries a frame cut by another)."""

    __slots__ = ("at", "_keys", "_nbytes", "_has", "_frame", "_per", "_arm", "_unsent")

    def __init__(
        self,
        frame: Callable[[Any], bytes],
        max_frame_bytes: int,
        arm: Callable[[], None] | None = None,
    ) -> None:
        self.at = 0.0  # when the oldest pending item was noted; 0: none
        self._keys: list[str] = []
        self._nbytes: list[int] = []
        self._has = 0
        self._frame = frame
        self._arm = arm  # told when the batch becomes non-empty (the flusher's deadline)
        self._unsent = b""
        # Indexed keys are <= KEY_CAP bytes: this many always fit the broker's frame limit.
        limit = max_frame_bytes or 1 << 20
        self._per = max(1, (limit - 64) // (KEY_CAP + 24))

    def note(self, keys: list[str], nbytes: list[int], has_hits: int) -> bool:
        """Note served items; True when the caller should send the batch now: at
        _SERVED_MAX items (a frame's worth), or -- only without a flusher -- once it is
        _SERVED_AGE_S old (a send per call would wake the broker per hit).

        With a flusher the age is its business (it sends the batch SERVED_FLUSH_S after
        the first item unless a request carried it): a caller that sent by age would,
        whenever its calls are more than _SERVED_AGE_S apart, wake the broker inside
        every index-served get or has() -- a write whose wake-up the kernel may run on
        the caller's CPU, in the caller's time (issue 42, docs/performance.md: 3.3-3.7x
        fewer broker wake-ups for calls 5 ms apart; on a loaded host 50 us of a 2 MiB
        get_into's time after its copy)."""
        now = time.monotonic()
        if not self.at:
            self.at = now
            if self._arm is not None:
                self._arm()
        self._keys += keys
        self._nbytes += nbytes
        self._has += has_hits
        return len(self._keys) + self._has >= _SERVED_MAX or (
            self._arm is None and now - self.at >= _SERVED_AGE_S
        )

    def take(self) -> bytes:
        """The pending Served frames (b"" if none), taken: the caller sends them first."""
        if not self.at:
            return b""
        keys, nbytes, has_hits = self._keys, self._nbytes, self._has
        out, self._unsent = self._unsent, b""
        self._keys, self._nbytes, self._has = [], [], 0
        self.at = 0.0
        if not keys and not has_hits:
            return out
        frames = [
            self._frame(Served(k, n, has_hits if not i else 0))
            for i, (k, n) in enumerate(_once_each(keys, nbytes, self._per))
        ]
        return out + b"".join(frames)

    def send_nowait(self, fd: int) -> bool:
        """Write the pending frames to ``fd``, the connection's socket, without ever
        blocking (the flusher thread holds the client's lock meanwhile: a full socket
        buffer -- a hung broker -- must not stall the caller behind it). What the
        socket cannot take now stays pending, ahead of everything else. True when
        nothing is left. OSError (the connection failed) propagates; the frames are
        dropped with the connection, and its next request finds the failure."""
        at = self.at
        data = self.take()
        if not data:
            return True
        if os.get_blocking(fd):  # the wire's sockets have a timeout, so O_NONBLOCK
            n = 0
        else:
            try:
                n = os.write(fd, data)
            except BlockingIOError:
                n = 0
        if n < len(data):
            self._unsent, self.at = data[n:], at
            return False
        return True


def _once_each(
    keys: list[str], nbytes: list[int], per: int
) -> list[tuple[list[str], list[int]]]:
    """``keys`` (with their ``nbytes``) cut into Served frames of at most ``per`` keys
    that each name a key once, in order (at least one frame): the broker counts a key
    at most once per frame (issue 40 item 8), so a key read twice goes in two."""
    out: list[tuple[list[str], list[int]]] = []
    cur_k: list[str] = []
    cur_n: list[int] = []
    seen: set[str] = set()
    for key, n in zip(keys, nbytes, strict=False):
        if key in seen or len(cur_k) >= per:
            out.append((cur_k, cur_n))
            cur_k, cur_n, seen = [], [], set()
        seen.add(key)
        cur_k.append(key)
        cur_n.append(n)
    out.append((cur_k, cur_n))
    return out
