"""The client's zero-round-trip path through the broker's residency index.

``has()`` answers an index positive True without asking; ``get``/``get_many``/
``get_into`` copy an index positive straight from the slab and keep the copy
only if the slot's seqlock word is unchanged afterwards (shm/residency.py says
why that proves the bytes were the entry's, untorn). Everything else -- index
misses, a slot rewritten during the copy, leases -- takes the broker's round
trip as before. The caller (BrokerClient) posts what was served here in one
``Served`` frame, which the broker answers with no reply, so its hit counters
and LRU stay what they would have been.

Used only on x86-64 (``residency.usable_here``), only while the connection was
confirmed within ``filter_trust_s`` (a killed broker's index cannot be cleared)
and only for the index the current handshake named (a restarted broker's index
is another segment).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from ..protocol import HelloReply
from ..shm.residency import Found, ResidencyReader, usable_here
from ..shm.segment import ShmError

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
