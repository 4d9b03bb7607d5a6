"""Membership across brokers on one Redis store: each broker announces the keys it
writes on ``<prefix>announce``; this thread folds the others' announcements, and
every (re)subscription asks the policy for a key scan (announcements were missed)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from ..remote.transport import Node
from .link import Link
from .resp import ConnParams, ProtocolViolation, RespConnection, RespError

_SUB_POLL_S = 0.5
_ANNOUNCE_BATCH = 256


class Announcements:
    """The subscriber thread of one transport; ``link.stop()`` ends it."""

    def __init__(self, link: Link, params: ConnParams, channel: bytes) -> None:
        self.link = link
        self.params = params
        self.channel = channel
        self.thread: threading.Thread | None = None

    def start(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None] | None = None,
    ) -> None:
        self.thread = threading.Thread(
            target=self._run,
            args=(on_keys, on_resync, on_health),
            name="ec-remote-announce",
            daemon=True,
        )
        # The first key scan runs once the subscription is confirmed: a key written
        # before it is found by the scan, one written after is announced.
        self.thread.start()

    def _run(
        self,
        on_keys: Callable[[list[str]], None],
        on_resync: Callable[[], None],
        on_health: Callable[[Node, bool], None] | None,
    ) -> None:
        """Fold keys other brokers announce; reconnect with backoff. Every confirmed
        (re)subscription asks for a key scan (the announcements before it were missed)."""
        link = self.link
        stopped = link.stopped
        backoff = 0.2
        while not stopped.is_set():
            ep = (link.router.masters() or link.router.seeds)[0]
            node = link.node_of("") if not link.cluster else ep
            try:
                conn = RespConnection(ep, dataclasses.replace(self.params, timeout_s=_SUB_POLL_S))
            except (OSError, RespError) as exc:
                link.trouble.failed(exc, ep)
                if on_health is not None:
                    on_health(node, False)  # no traffic needed to notice a store that is down
                stopped.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            link.track(conn)  # stop() cuts it
            try:
                conn.command("SUBSCRIBE", self.channel)
                if on_health is not None:
                    on_health(node, True)  # ... nor to notice it is back
                on_resync()
                backoff = 0.2
                batch: list[str] = []
                while not stopped.is_set():
                    try:
                        msg = conn.read_reply()
                    except TimeoutError:
                        if conn.buffered or conn.partial:
                            # a reply cut by the timeout: the stream is out of step
                            raise ProtocolViolation("half a message, then silence") from None
                        if batch:
                            on_keys(batch)
                            batch = []
                        continue
                    if (
                        isinstance(msg, list)
                        and len(msg) == 3
                        and msg[0] == b"message"
                        and isinstance(msg[2], bytes)
                        and 0 < len(msg[2]) <= 64 * 1024
                    ):
                        batch.append(msg[2].decode("utf-8", "surrogateescape"))
                        if len(batch) >= _ANNOUNCE_BATCH or not conn.buffered:
                            on_keys(batch)
                            batch = []
            except (OSError, RespError, ProtocolViolation):
                pass
            finally:
                conn.close()
                link.untrack(conn)
            stopped.wait(backoff)
            backoff = min(backoff * 2, 10.0)
