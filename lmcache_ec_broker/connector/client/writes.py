"""The write path's pieces, as functions over the parts BrokerClient hands them: its
ClientLink (lock held by the caller's call, session, mappings, slab) and how long the
membership filter may be trusted since the broker last answered.

Two ways into the slab (docs/design.md "Put arenas"): a key the trusted filter says
is absent, and that fits this connection's put arena, is copied into the arena's own
blocks and its Place frame posted (no wait); any other key is reserved (one round
trip), copied, and its Commit posted. Either way, a put that returned is seen by every
later request from any process (the module docstring of connector/client/broker_client.py says
how)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...protocol import (
    Abort,
    Commit,
    ErrorReply,
    Reserve,
    ReserveReply,
    ReserveStatus,
    expected_nbytes,
)
from .errors import BrokerRefused, BrokerUnavailable
from .frames import _MAX_OWED
from .reads import copy_module

if TYPE_CHECKING:
    import torch

    from .arena_blocks import Run
    from .client_link import ClientLink
    from .session import Session


def put(link: ClientLink, trust_s: float, key: str, tensor: torch.Tensor) -> bool:
    """BrokerClient.put under the link's lock (its docstring says what the result
    means): the arena's no-wait placement when it can take the key, else a reserve."""
    cp = copy_module()
    if not tensor.is_cpu:
        cp.check_device(tensor.device)
    dtype = cp.dtype_name(tensor.dtype)
    shape = list(tensor.shape)
    nbytes = expected_nbytes(dtype, shape)
    with link.lock:
        s = link.live()
        if s is None:
            return False
        try:
            placed = _place_copy(link, s, trust_s, key, tensor, dtype, shape, nbytes)
            if placed is not None:
                _send_placed(s, placed[0], placed[2], [key])
                return True
            _ask_arena(s)
            reply: ReserveReply = s.wire.call(Reserve(key, nbytes, dtype, shape))
            if reply.status != ReserveStatus.RESERVED:
                return False
            try:
                link.slab().write(reply.extents, tensor)
            except BaseException:
                if s.alive:
                    try:
                        s.wire.call(Abort(reply.token))
                    except (BrokerUnavailable, BrokerRefused):
                        pass
                raise
            # Posted: the broker handles this connection's frames in order, so the
            # commit lands before anything this client asks next. It cannot be
            # refused (the token is this live connection's own open reservation,
            # which only the connection's end takes away); if the connection dies
            # first, the reservation is freed and the entry is simply absent.
            s.wire.post(Commit(reply.token))
            s.posted.add(key)
            return True
        except BrokerUnavailable:
            return False


def put_many(link: ClientLink, trust_s: float, items: list[tuple[str, torch.Tensor]]) -> list[bool]:
    """BrokerClient.put_many under the link's lock: the placeable items placed, the
    rest reserved in one round trip sent with the Places, their commits in one send."""
    cp = copy_module()
    check_device, dtype_name = cp.check_device, cp.dtype_name

    descs = []
    for _key, tensor in items:
        check_device(tensor.device)
        dtype = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        descs.append((dtype, shape, expected_nbytes(dtype, shape)))
    if not items:
        return []
    with link.lock:
        s = link.live()
        if s is None:
            return [False] * len(items)
        stored = [False] * len(items)
        try:
            placed = _place_many(link, s, trust_s, items, descs, stored)
        except BrokerUnavailable:
            return [False] * len(items)
        rest = [i for i in range(len(items)) if not stored[i]]
        if not rest:
            try:
                _send_placed(s, *_batch(s, *placed))
            except BrokerUnavailable:
                return [False] * len(items)
            return stored
        reqs = [Reserve(items[i][0], descs[i][2], *descs[i][:2]) for i in rest]
        wire, frame = s.wire, s.framer.frame
        try:
            if placed[0]:
                _send_placed(s, *_batch(s, *placed))
            else:
                _ask_arena(s)
            wire.send(b"".join(frame(r) for r in reqs))
            replies = wire.read_replies(len(reqs))
        except BrokerUnavailable:
            return [False] * len(items)
        refusal = next((r for r in replies if isinstance(r, ErrorReply)), None)
        todo = [
            (rest[j], r.token, r.extents)
            for j, r in enumerate(replies)
            if isinstance(r, ReserveReply) and r.status == ReserveStatus.RESERVED
        ]
        done: list[int] = []
        try:
            slab = link.slab() if todo else None
            for i, token, extents in todo:
                assert slab is not None
                slab.write(extents, items[i][1])
                done.append(token)
        except BrokerUnavailable:
            # The segment cannot be mapped (the connection, and with it every
            # reservation, is already dropped): an outage, not an error.
            return [False] * len(items)
        except BaseException:
            for _, token, _ in todo:
                if s.alive:
                    try:
                        wire.post(Abort(token))
                    except BrokerUnavailable:
                        pass
            raise
        if done:
            # Posted, as in put: one send, no wait (see put for why they cannot fail).
            try:
                wire.send_posted(b"".join(frame(Commit(t)) for t in done), len(done))
            except BrokerUnavailable:
                return [False] * len(items)
            s.posted.update(items[i][0] for i, _, _ in todo)
            for i, _, _ in todo:
                stored[i] = True
        if refusal is not None:
            raise BrokerRefused(refusal.code, refusal.message)
        return stored


def _may_place(link: ClientLink, s: Session, trust_s: float, key: str, nbytes: int) -> bool:
    """Whether ``key`` can go into the arena: the arena can take it, and the
    trusted filter says the key is absent (a present key would be copied for
    nothing)."""
    m = link.maps
    return (
        m is not None
        and s.arena.fits(key, nbytes)
        and key not in s.posted
        and time.monotonic() - s.wire.confirmed_at <= trust_s
        and m.proven_absent(key, s.arena.slot)
    )


def _place_copy(
    link: ClientLink, s: Session, trust_s: float, key: str, tensor: torch.Tensor, dtype: str,
    shape: list[int], nbytes: int, refill: bool = True,
) -> tuple[bytes, list[Run], int] | None:  # fmt: skip
    """Copy ``tensor`` into arena blocks; its Place frame (with a refill when the arena
    runs low: its data ready to send), the blocks, and how many frames the data holds.
    None: not placeable now, take the reserve path. ``refill`` False: no refill (a
    batch asks for one at its end).

    Everything but the journal word and the send is done BEFORE the copy (issue 42):
    a copy of megabytes leaves the caches cold, and every step after it pays for that.
    The frame does not depend on the bytes; a failed copy takes it back (unplace)."""
    wire, arena = s.wire, s.arena
    if wire.owed >= _MAX_OWED:
        wire.read_replies(0)
    if not _may_place(link, s, trust_s, key, nbytes):
        return None
    if arena.grant_owed and not arena.holds(nbytes):
        wire.read_replies(0)  # the refill's reply, usually in already
        if not _may_place(link, s, trust_s, key, nbytes):
            return None
    got = arena.take(nbytes)
    if got is None:
        return None
    runs, extents = got
    slab = link.slab()  # may raise BrokerUnavailable: the blocks go with the connection
    try:
        frame = arena.place(key, runs, extents, dtype, shape, nbytes)
        grant = arena.grant_frame() if refill else b""
        slab.write(extents, tensor)
    except BaseException:
        arena.unplace(key)
        arena.give(runs)
        raise
    return (frame + grant if grant else frame), runs, 2 if grant else 1


def _place_many(
    link: ClientLink,
    s: Session,
    trust_s: float,
    items: list[tuple[str, torch.Tensor]],
    descs: list[tuple[str, list[int], int]],
    stored: list[bool],
) -> tuple[list[bytes], list[str]]:
    """Copy every placeable item into the arena (marking it in ``stored``); the
    Place frames and keys, not sent yet. A failed copy gives every block back."""
    frames: list[bytes] = []
    keys: list[str] = []
    taken: list[Run] = []
    try:
        for i, (key, tensor) in enumerate(items):
            if key in keys:
                continue  # a second item of the same key reserves (and finds it)
            dtype, shape, nbytes = descs[i]
            got = _place_copy(link, s, trust_s, key, tensor, dtype, shape, nbytes, False)
            if got is None:
                continue
            frames.append(got[0])
            taken += got[1]
            keys.append(key)
            stored[i] = True
    except BrokerUnavailable:
        raise
    except BaseException:
        if s.alive:
            for key in keys:
                s.arena.unplace(key)
            s.arena.give(taken)  # nothing of this batch was sent
        raise
    return frames, keys


def _batch(s: Session, frames: list[bytes], keys: list[str]) -> tuple[bytes, int, list[str]]:
    """put_many's Place frames and a refill if the arena runs low, as one send's data."""
    grant = s.arena.grant_frame()
    return b"".join(frames) + grant, len(frames) + (1 if grant else 0), keys


def _send_placed(s: Session, data: bytes, n: int, keys: list[str]) -> None:
    """Post ``n`` frames (the Places of ``keys``, a refill) in one send. The journal
    says "placed" just before the frames leave (PutArena.mark_placed); the bookkeeping
    goes first: a failed send drops the session and everything in it, so nothing here
    needs undoing."""
    arena = s.arena
    arena.sent(keys, n > len(keys))
    s.posted.update(keys)
    arena.mark_placed()
    s.wire.send_posted(data, n)
    if arena.excused():
        # This client stopped inside the window long enough for the broker to
        # excuse it (shm/journal.py): others skip its slot, so wait until the
        # broker has handled the placement before put returns.
        s.wire.read_replies(0)


def _ask_arena(s: Session) -> None:
    """Post a grant when the arena is low (lazily: the first put of a connection);
    the reserve that follows reads its reply."""
    grant = s.arena.grant_frame()
    if grant:
        s.wire.send_posted(grant, 1)
        s.arena.sent([], True)
