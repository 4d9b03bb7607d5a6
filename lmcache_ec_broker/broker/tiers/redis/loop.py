"""The Redis transport's calls on the broker's event loop (``resp_async.py``): a
lookup's pipeline, a promotion's ``GET``, and a get's lookup and read in one round
trip (``fetch``). A remote hit then waits for the store only, no thread hand-offs.

They run only with an idle pooled connection at hand and the store not behind TLS
(the loop reads plain sockets); they answer None/False when they cannot run here and
the runtime uses the threads. A Cluster redirect is never followed here: the threads
follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ....protocol import Extent
from ..base import EntryMeta, SlabAccess, TierMiss
from ..remote.transport import Declined, LookupAnswer, StoreDown
from ..remote.value import MAX_HEADER, BadValue, Header, Verifier
from .link import Link
from .resp import RespError, pack
from .resp_async import LoopConnection
from .value_rules import ValueRules


class LoopCalls:
    """``lookup`` / ``read`` / ``fetch`` of one Redis store, on the running loop."""

    def __init__(self, link: Link, rules: ValueRules, timeout_s: float) -> None:
        self.link = link
        self.rules = rules
        self.timeout_s = timeout_s
        self.tls = link.pool.params.tls is not None

    # ------------------------------------------------------------ connections

    def _conn(self, rk: bytes) -> LoopConnection | None:
        if self.tls or self.link.stopped.is_set():
            return None
        ep = self.link.router.cached_node(rk)
        if ep is None:
            return None
        lc = LoopConnection.take(self.link.pool, ep, asyncio.get_running_loop())
        if lc is not None:
            self.link.track(lc.conn)  # stop() cuts it too
        return lc

    @contextlib.asynccontextmanager
    async def _round_trip(self, lc: LoopConnection) -> AsyncIterator[None]:
        """One call's use of ``lc``, then ``lc`` released (back to the pool only if in
        step). A fault of the connection closes it and reads as StoreDown; what the
        call itself raises (TierMiss, BadValue, StoreDown, Declined) passes -- mid-value
        the stream is out of step, and the release closes the connection."""
        ep = lc.conn.ep
        t0 = time.monotonic()
        try:
            yield
        except (TierMiss, BadValue, StoreDown, Declined):
            raise
        except (OSError, TimeoutError, ValueError) as exc:
            lc.close()
            raise StoreDown([ep], f"{ep}: {exc or type(exc).__name__}") from None
        except BaseException:
            lc.close()
            raise
        finally:
            self.link.untrack(lc.conn)
            lc.release()
            self.link.meter.observe(time.monotonic() - t0)

    # ------------------------------------------------------------ the calls

    async def lookup(self, keys: list[str]) -> list[LookupAnswer] | None:
        """``lookup`` on the event loop: one pipelined round trip when every key lives
        on one node with an idle connection. None: not here (use ``lookup``)."""
        link = self.link
        rks = [link.rk(k) for k in keys]
        if len({link.router.cached_node(rk) for rk in rks}) != 1:
            return None
        lc = self._conn(rks[0])
        if lc is None:
            return None
        ep = lc.conn.ep
        pieces: list[bytes | memoryview] = []
        for rk in rks:
            pieces += pack(["GETRANGE", rk, 0, MAX_HEADER - 1])
            pieces += pack(["STRLEN", rk])
        async with self._round_trip(lc), asyncio.timeout(self.timeout_s):
            replies = await lc.pipeline(pieces, 2 * len(keys))
        link.meter.count("remote_loop_lookups")
        out: list[LookupAnswer] = []
        failed: StoreDown | None = None
        for j, key in enumerate(keys):
            head, total = replies[2 * j], replies[2 * j + 1]
            err = head if isinstance(head, RespError) else total
            if isinstance(err, RespError):
                if link.redirect_of(err, ep) is not None:
                    return None  # a slot moved: the threads follow redirects
                # Any other error reply is no answer, as in ``lookup``: the lookup fails
                # (StoreDown: the node's breaker counts it, the key stays in the filter),
                # never "absent" (``Link.not_an_answer``). WRONGTYPE refuses the key.
                verdict = link.not_an_answer(err, ep)
                if isinstance(verdict, StoreDown):
                    failed = failed or verdict
                    verdict = None
                out.append(verdict)
                continue
            out.append(self.rules.meta(key, head, total))
        if failed is not None:
            raise failed
        return out

    async def read(
        self, key: str, meta: EntryMeta, extents: list[Extent], slab: SlabAccess
    ) -> bool:
        """``read_into`` on the event loop (the same checks, the same bytes); False:
        not here -- nothing was written -- use ``read_into``."""
        lc = self._conn(self.link.rk(key))
        if lc is None:
            return False
        async with (
            self._round_trip(lc),
            asyncio.timeout(self.timeout_s * (1 + meta.nbytes / (64 << 20))),
        ):
            got = await self._get_head(lc, key)
            if got is None:
                return False  # a slot moved: the threads follow redirects
            total, head = got
            self.rules.unchanged(head, meta)
            await self._stream(lc, head, extents, slab)
        self.link.meter.count("remote_bytes_read", total)
        self.link.meter.count("remote_loop_reads")
        return True

    def fetch_conn(self, key: str) -> LoopConnection | None:
        """A connection for ``fetch`` (standalone stores: a Cluster redirect would need
        the threads), or None."""
        if self.link.cluster:
            return None
        return self._conn(self.link.rk(key))

    async def fetch(
        self,
        lc: LoopConnection,
        key: str,
        reserve: Callable[[EntryMeta], list[Extent] | None],
        slab: SlabAccess,
    ) -> EntryMeta:
        """Lookup and read in one round trip: ``GET``, the header checked as a lookup
        checks it, then ``reserve(meta)`` (on the loop, no hand-off) and the payload
        streamed into those extents and verified. Raises TierMiss, BadValue, Declined
        (``reserve`` took nothing: the connection, mid-value, is closed), StoreDown."""
        ep = lc.conn.ep
        async with self._round_trip(lc), asyncio.timeout(self.timeout_s) as deadline:
            got = await self._get_head(lc, key)
            if got is None:  # standalone stores only (fetch_conn): never a redirect
                raise StoreDown([ep], f"{ep}: unexpected cluster redirect")
            total, head = got
            meta = EntryMeta(head.nbytes, head.dtype, head.shape)
            extents = reserve(meta)
            if extents is None:
                raise Declined(f"no room for {key[:200]!r}")
            # never a byte outside what was reserved for exactly this payload
            if sum(n for _, n in extents) != head.nbytes:
                raise ValueError("reserved extents do not match the value's size")
            deadline.reschedule(
                asyncio.get_running_loop().time() + self.timeout_s * (1 + head.nbytes / (64 << 20))
            )
            await self._stream(lc, head, extents, slab)
        self.link.meter.count("remote_bytes_read", total)
        self.link.meter.count("remote_loop_reads")
        return meta

    # ------------------------------------------------------------ one GET's parts

    async def _get_head(self, lc: LoopConnection, key: str) -> tuple[int, Header] | None:
        """Send ``GET`` and read the value's length and header on the loop, checked as a
        lookup checks them; the payload is left in the stream. None: a Cluster slot
        moved (the threads follow redirects). Raises TierMiss, BadValue, StoreDown."""
        ep = lc.conn.ep
        await lc.send(pack(["GET", self.link.rk(key)]))
        try:
            length = await lc.bulk_len()
        except RespError as exc:
            if self.link.redirect_of(exc, ep) is not None:
                return None
            raise self.link.not_an_answer(exc, ep) from None  # never "absent"
        rules = self.rules
        total = rules.total(key, length)
        fixed = await lc.exact(rules.fixed_size(total))
        head = rules.header(key, fixed + await lc.exact(rules.head_rest(fixed, total)), total)
        return total, head

    async def _stream(
        self, lc: LoopConnection, head: Header, extents: list[Extent], slab: SlabAccess
    ) -> None:
        """The payload after ``head`` streamed into ``extents`` and verified; the
        connection is back in step only once the whole value and its CRLF are read."""
        verifier = Verifier(head)
        with slab.views(extents) as views:
            await lc.stream_into(views, verifier)
        await lc.crlf()
        lc.in_step = True
        verifier.finish()
