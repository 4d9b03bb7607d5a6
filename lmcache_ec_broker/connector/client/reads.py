"""The read path's pieces, as functions over the parts BrokerClient hands them:
a Get round trip on a wire (the copy, then a posted Release), and copies from this
connection's own not-yet-handled placements (PutArena.own_read). BrokerClient
(connector/client/broker_client.py) decides which path serves a key: the residency index
(index_path.py), the connection's own placements, the filter, the broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...protocol import Get, GetReply, Hit, Release
from .errors import BrokerUnavailable

if TYPE_CHECKING:
    import torch

    from .arena_put import PutArena
    from .copy import SlabView
    from .frames import Wire


def own_reader(
    arena: PutArena, peer_gone: Callable[[], bool], slab: SlabView, dev: torch.device
) -> Callable[[str], torch.Tensor | None]:
    """For index_path.read_known: a key's copy from this connection's own placement."""
    torch_dtype = copy_module().torch_dtype

    def from_own(key: str) -> torch.Tensor | None:
        return arena.own_read(key, lambda e, d, s: slab.read(e, torch_dtype(d), s, dev), peer_gone)

    return from_own


def own_into(
    arena: PutArena, peer_gone: Callable[[], bool], slab: SlabView, key: str,
    out: torch.Tensor, cp: Any,
) -> tuple[bool, bool]:  # fmt: skip
    """Copy ``key`` from this connection's own placement into ``out``: (served, wrote).
    On (False, True) ``out`` holds bytes that must not be shown."""
    name = cp.dtype_name(out.dtype)
    wrote = False

    def copy_into(e: list[tuple[int, int]], d: str, s: list[int]) -> bool | None:
        nonlocal wrote
        if d != name or s != list(out.shape):
            return None  # a mismatch is reported by the broker's path
        wrote = True
        slab.read_into(e, out)
        return True

    return bool(arena.own_read(key, copy_into, peer_gone)), wrote


def get_asked(
    wire: Wire, slab: Callable[[], SlabView], ask: list[str], dev: torch.device
) -> list[torch.Tensor | None]:
    """A Get for ``ask``, the copies, the Release posted. Raises BrokerUnavailable."""
    torch_dtype = copy_module().torch_dtype
    reply: GetReply = wire.call(Get(ask))
    items = reply.items
    hits: list[Hit] = [h for h in items if h is not None]
    out: list[torch.Tensor | None] = []
    try:
        view = slab() if hits else None
        for item in items:
            if item is None:
                out.append(None)
            else:
                assert view is not None
                out.append(view.read(item.extents, torch_dtype(item.dtype), item.shape, dev))
    finally:
        _release(wire, hits)
    return out


def get_into_asked(
    wire: Wire, slab: Callable[[], SlabView], key: str, out: torch.Tensor, cp: Any
) -> bool:
    """get_into's round trip. Raises BrokerUnavailable."""
    reply: GetReply = wire.call(Get([key]))
    item = reply.items[0]
    if item is None:
        return False
    try:
        dtype_name = cp.dtype_name
        if item.dtype != dtype_name(out.dtype) or item.shape != list(out.shape):
            raise ValueError(
                f"entry {key!r} is {item.dtype} {item.shape}, the output tensor is "
                f"{dtype_name(out.dtype)} {list(out.shape)}; pass a matching tensor "
                "or use get()"
            )
        slab().read_into(item.extents, out)
    finally:
        _release(wire, [item])
    return True


def _release(wire: Wire, hits: list[Hit]) -> None:
    if hits and wire.sock is not None:
        try:
            wire.post(Release([h.pin for h in hits]))
        except BrokerUnavailable:
            pass  # the pins died with the connection


_COPY: Any = None


def copy_module() -> Any:
    """The copy module (it imports torch, so it is loaded on first use, not at import);
    kept here because an import statement per call costs a microsecond. The put path
    (writes.py) uses it too."""
    global _COPY
    if _COPY is None:
        from . import copy

        _COPY = copy
    return _COPY
