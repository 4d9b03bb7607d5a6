"""The shared-memory segments of one broker epoch, mapped by a client.

A ``Mappings`` is made from the handshake of the first connection to a broker
epoch and kept across reconnects to the same epoch; it is dropped whole when the
broker restarted (another epoch: its segments are other segments) and during an
outage (a dead broker's shared memory stays charged while anyone maps it, and a
restarting broker needs that memory). Its parts:

- ``filter`` (shm/filter.py): the membership filter, read-only, or None;
- ``journal`` (shm/journal.py): the put arenas' placement journal, or None;
- ``index`` (shm/residency.py): the residency index, read-only, or None;
- the slab (``slab``): mapped at once from the descriptor the handshake brought
  (a mapping costs nothing until touched), and pre-faulted and wrapped on first use
  (``map_slab``): most has() calls never need it, and pre-faulting a large slab
  takes a while.

Every descriptor the handshake brought is closed here once mapped (the slab's
included): a client holds only mappings, no segment's descriptor, so nothing it
forks or executes can reach a segment through one (issue 40, item 2). They arrive
close-on-exec (broker_link.py) for the moment in between.

Every segment is checked to belong to a trusted uid before it is mapped (fstat).
A segment that cannot be mapped is left out with a warning (the path it serves
then asks the broker), except the slab, whose failure is an outage (ShmError).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from ...protocol import HelloReply
from ...shm import filter as filter_layout
from ...shm import journal as journal_layout
from ...shm.filter import FilterReader, key_digest
from ...shm.journal import Journal
from ...shm.residency import ResidencyReader
from ...shm.segment import Segment, ShmError
from . import index_path

if TYPE_CHECKING:
    from .copy import SlabView

log = logging.getLogger("lmcache_ec_broker.connector.client")  # one name for the whole client

try:  # compiled when the package was built (optional: shm/_placement_check.c)
    from ...shm._placement_check import LAYOUT as _CHECK_LAYOUT
    from ...shm._placement_check import proven_absent as _proven_absent
except ImportError:  # built without a C compiler: the Python readers
    _CHECK_LAYOUT, _proven_absent = (), None
# The layout the C file spells out: a build of another layout is not used.
if _CHECK_LAYOUT != (
    journal_layout.PLACED_BYTES, journal_layout.SETTLED_BYTES, journal_layout._SETTLED,
    journal_layout._DISTRUSTED, journal_layout._HELD, filter_layout.HEADER_SIZE,
    filter_layout._FLAGS_OFFSET, filter_layout.FLAG_LIVE,
):  # fmt: skip
    _proven_absent = None


class Mappings:
    __slots__ = ("epoch", "filter", "journal", "index", "slab", "_segment", "_hello", "_arenas",
                 "_owners", "_prefault", "_slab_error", "_check")  # fmt: skip

    def __init__(
        self,
        hello: HelloReply,
        owners: Collection[int],
        prefault: bool,
        fds: dict[str, int] | None = None,
    ) -> None:
        """``fds``: the descriptors the handshake brought, by label (taken over: closed
        here, mapped or not); without one a segment is opened by name, where it has one."""
        fds = dict(fds or {})
        try:
            self._map(hello, owners, prefault, fds)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _map(
        self, hello: HelloReply, owners: Collection[int], prefault: bool, fds: dict[str, int]
    ) -> None:
        self.epoch = hello.epoch
        self._hello = hello
        self._owners = owners
        self._prefault = prefault
        self._arenas = bool(hello.put_arena_bytes)
        self.slab: SlabView | None = None
        self._segment: Segment | None = None
        self._slab_error: ShmError | None = None  # why the slab's descriptor did not map
        slab_fd = fds.get("slab")
        if slab_fd is not None:
            try:  # not pre-faulted yet: map_slab does that on first use
                self._segment = Segment.attach_fd(
                    slab_fd, hello.segment_name, hello.segment_size, False, owners
                )
            except ShmError as exc:
                self._slab_error = exc  # an outage when first used, as before
        self.filter: FilterReader | None = None
        self.journal: Journal | None = None
        self.index: ResidencyReader | None = None
        if hello.filter_name:
            try:
                self.filter = FilterReader(
                    hello.filter_name, hello.filter_size, owners, fds.get("filter")
                )
            except (ShmError, ValueError, OverflowError) as exc:
                log.warning("not using the broker's membership filter: %s", exc)
        if hello.put_arena_bytes and hello.journal_name:
            try:
                self.journal = Journal.attach(
                    hello.journal_name,
                    hello.journal_size,
                    owners,
                    fds.get("journal"),
                    fds.get("settled"),
                )
            except (ShmError, ValueError, OverflowError) as exc:
                # Without it, arena puts are off and the filter is not trusted.
                log.warning("not using the broker's put arena: %s", exc)
        self.index = index_path.map_index(hello, owners, fds.get("index"))
        self._check = self._compiled_check()

    def _compiled_check(self) -> tuple | None:
        """proven_absent's fixed arguments for the compiled check (the objects whose
        exports keep the mappings alive, addresses, sizes), or None: the Python path."""
        flt, journal = self.filter, self.journal
        if _proven_absent is None or flt is None or flt.view is None:
            return None
        fview = flt.view
        if not self._arenas:
            return (fview,), 0, 0, 0, fview.ctypes.data, fview.nbytes, flt.mask, flt.seed
        views = journal.views() if journal is not None else None
        if views is None:
            return None  # arenas without a journal: nothing is ever proven (others_pending)
        placed, words = views
        keep = (fview, placed, words)
        return (
            keep, placed.ctypes.data, words.ctypes.data, journal.nslots,
            fview.ctypes.data, fview.nbytes, flt.mask, flt.seed,
        )  # fmt: skip

    def proven_absent(self, key: str, own_slot: int) -> bool:
        """Whether the membership filter's "absent" for ``key`` holds now: no other
        connection's placement pending (the journal, read first), and the filter live
        and saying absent -- one compiled call where the package has it (issue 42),
        else ``others_pending`` and ``filter.maybe``, the same answers."""
        check = self._check
        if check is not None:
            keep, placed, settled, nslots, faddr, fsize, mask, seed = check
            return _proven_absent(
                keep, placed, settled, nslots, own_slot, faddr, fsize, mask, key_digest(key, seed)
            )
        flt = self.filter
        return flt is not None and not self.others_pending(own_slot) and not flt.maybe(key)

    def map_slab(self) -> SlabView:
        """The slab, mapped (and pre-faulted) now if it is not yet; ShmError if it
        cannot be."""
        if self.slab is None:
            from .copy import SlabView

            hello = self._hello
            if self._slab_error is not None:
                raise self._slab_error
            if self._segment is None:
                self._segment = Segment.attach(
                    hello.segment_name, hello.segment_size, self._prefault, self._owners
                )
            elif self._prefault:
                self._segment.prefault_shared()
            self.slab = SlabView(self._segment.mm, hello.segment_size)
        return self.slab

    def others_pending(self, own_slot: int) -> bool:
        """True while another connection may have placed an entry the broker has not
        handled yet: a local filter "absent" is then no proof (shm/journal.py)."""
        if not self._arenas:
            return False
        journal = self.journal
        return journal is None or journal.any_unsettled(own_slot)

    def close(self) -> None:
        """Unmap everything (the slab's CUDA registration goes first, in SlabView.close)."""
        self._check = None  # its views hold exports of the filter and the journal
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self.filter is not None:
            self.filter.close()
            self.filter = None
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.index is not None:
            self.index.close()
            self.index = None
