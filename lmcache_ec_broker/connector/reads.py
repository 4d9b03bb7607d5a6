"""The client's read path: get, get_many and get_into -- from the residency index
or this connection's own placements when they can serve (index_path.py), else
from the broker (a Get, the copy, a posted Release). A BrokerClient mixin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..protocol import Get, GetReply, Hit, Release
from . import index_path
from .errors import BrokerUnavailable
from .membership import _as_list, _expand

if TYPE_CHECKING:
    import torch


class Reads:
    """get / get_many / get_into of a BrokerClient."""

    def get(self, key: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        return self.get_many([key], device)[0]

    def get_many(
        self, keys: list[str], device: str | torch.device = "cpu"
    ) -> list[torch.Tensor | None]:
        """New tensors (same dtype and shape as put) for the hits, None for misses."""
        cp = _copy()
        dev = cp.torch.device(device)
        cp.check_device(dev)
        with self._lock:
            # The index first (a get usually follows a has() hit), then the filter for
            # what it lacks, then the broker for what the filter cannot rule out.
            local = self._get_local(_as_list(keys), dev)
            rest = (
                keys
                if local is None
                else [k for k, t in zip(keys, local, strict=True) if t is None]
            )
            if not rest:
                return [] if local is None else local  # no keys, or every one served here
            ask, mask = self._ask(rest)
            got = self._get_many_asked(ask, dev) if ask else []
            if mask is not None:
                got = _expand(mask, got, None)
            if local is None:
                return got
            it = iter(got)
            return [t if t is not None else next(it) for t in local]

    def _get_local(self, keys: list[str], dev: torch.device) -> list[torch.Tensor | None] | None:
        """The index's copies (None where the broker must be asked), or None when the
        index served nothing. Posts the Served frame. Call with the lock held."""
        index = self._usable_index()
        if index is None:
            return None
        try:
            slab = self._slab_view()
        except BrokerUnavailable:
            return None
        torch_dtype = _copy().torch_dtype
        from_own = None
        if self._own and any(k in self._own for k in keys):

            def from_own(key: str) -> torch.Tensor | None:
                return self._own_read(key, lambda e, d, s: slab.read(e, torch_dtype(d), s, dev))

        local, retries = index_path.read_known(index, slab, keys, dev, torch_dtype, from_own)
        self.index_retries += retries
        served = [k for k, t in zip(keys, local, strict=True) if t is not None]
        if not served:
            return None
        self.index_hits += len(served)
        self._post_served(served, [t.nbytes for t in local if t is not None], 0)
        return local

    def _get_many_asked(self, ask: list[str], dev: torch.device) -> list[torch.Tensor | None]:
        """get_many's round trip for ``ask``. Call with the lock held."""
        cp = _copy()
        torch_dtype = cp.torch_dtype
        try:
            reply: GetReply = self._call(Get(ask))
        except BrokerUnavailable:
            return [None] * len(ask)
        items = reply.items
        hits: list[Hit] = [h for h in items if h is not None]
        out: list[torch.Tensor | None] = []
        try:
            slab = self._slab_view() if hits else None
            for item in items:
                if item is None:
                    out.append(None)
                else:
                    assert slab is not None
                    out.append(slab.read(item.extents, torch_dtype(item.dtype), item.shape, dev))
        except BrokerUnavailable:
            return [None] * len(ask)
        finally:
            self._release(hits)
        return out

    def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the entry into ``out`` (same dtype and shape, contiguous; CPU or CUDA).

        The copy-only path: no allocation, so no first-touch page faults on the
        destination. True on a hit; False on a miss or while the broker is away.
        On False ``out`` is either untouched or zeroed (zeroed when an index copy
        was discarded and the broker then had no entry): it never holds another
        entry's bytes.
        """
        cp = _copy()
        if not out.is_cpu:
            cp.check_device(out.device)
        with self._lock:
            keys = [key]
            wrote = False
            index = self._usable_index()  # first: a get usually follows a has() hit
            if index is not None:
                try:
                    slab = self._slab_view()
                except BrokerUnavailable:
                    return False
                if key in self._own:
                    name = cp.dtype_name(out.dtype)

                    def copy_into(e: list[tuple[int, int]], d: str, s: list[int]) -> bool | None:
                        nonlocal wrote
                        if d != name or s != list(out.shape):
                            return None  # a mismatch is reported by the broker's path
                        wrote = True
                        slab.read_into(e, out)
                        return True

                    if self._own_read(key, copy_into):
                        self.index_hits += 1
                        self._post_served([key], [out.nbytes], 0)
                        return True
                found, wrote_index = index_path.read_known_into(
                    index, slab, key, out, cp.dtype_name
                )
                if found is not None:
                    self.index_hits += 1
                    self._post_served([key], [found.nbytes], 0)
                    return True
                self.index_retries += wrote or wrote_index
                wrote = wrote or wrote_index
            mask = self._maybe_mask(keys)
            if mask is not None and not mask[0]:
                self.local_misses += 1
                hit = False
            else:
                hit = self._get_into_asked(key, out, cp)
            if wrote and not hit:
                out.zero_()  # the discarded copy's bytes must not be shown
            return hit

    def _get_into_asked(self, key: str, out: torch.Tensor, cp: Any) -> bool:
        """get_into's round trip. Call with the lock held."""
        keys = [key]
        try:
            reply: GetReply = self._call(Get(keys))
        except BrokerUnavailable:
            return False
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
            self._slab_view().read_into(item.extents, out)
        except BrokerUnavailable:
            return False
        finally:
            self._release([item])
        return True

    def _release(self, hits: list[Hit]) -> None:
        if hits and self._sock is not None:
            try:
                self._post(Release([h.pin for h in hits]))
            except BrokerUnavailable:
                pass  # the pins died with the connection


_COPY: Any = None


def _copy() -> Any:
    """The copy module (it imports torch, so it is loaded on first use, not at import);
    kept here because an import statement per call costs a microsecond."""
    global _COPY
    if _COPY is None:
        from . import copy

        _COPY = copy
    return _COPY
