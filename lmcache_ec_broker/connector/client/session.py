"""One connection to the broker and everything that lives exactly as long as it.

A ``Session`` is made when a connection's handshake succeeds and dropped whole when
the connection ends (``close``): nothing of it outlives the connection, and nothing
has to remember to reset a field. Its parts:

- ``wire`` (frames.py): the socket, the receive buffer, the replies still owed;
- ``arena`` (arena_put.py): the put arena the broker granted this connection;
- ``served`` (index_path.py): what the residency index served, not yet reported
  (``arm``: the client's flusher, told when it becomes non-empty: served_flush.py);
- ``posted``: keys of posted writes whose replies are still owed (read-your-writes:
  the filter may not list them yet, so they are never ruled out locally).

The parts do not know each other: the session hands each the callables it needs
(the wire tells the arena about owed replies, asks the Served batch for its frame)
when it builds them. Call everything with the client's lock held.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from ...protocol import HelloReply
from ...shm.journal import Journal
from .arena_put import PutArena
from .frames import Framer, Wire
from .index_path import ServedBatch


class Session:
    __slots__ = ("hello", "wire", "arena", "served", "posted", "framer")

    def __init__(
        self,
        sock: socket.socket,
        hello: HelloReply,
        journal: Journal | None,
        on_lost: Callable[[bool], None],
        wrap: Callable[[Any], Any] | None = None,
        arm: Callable[[], None] | None = None,
    ) -> None:
        self.hello = hello
        self.framer = framer = Framer(hello.max_frame_bytes)
        self.posted: set[str] = set()
        self.served = ServedBatch(framer.frame, hello.max_frame_bytes, arm)
        self.arena = PutArena(hello, journal, framer.frame)
        self.wire = Wire(
            sock,
            framer,
            prefix=self.served.take,
            on_owed=self.arena.owed_reply,
            on_caught_up=self._caught_up,
            on_lost=on_lost,
        )
        if wrap is not None:
            self.wire.wrap(wrap)

    def _caught_up(self) -> None:
        """Every posted request's reply was read: the broker handled them all."""
        self.posted.clear()
        self.arena.caught_up()

    @property
    def alive(self) -> bool:
        return self.wire.sock is not None

    def close(self) -> None:
        self.wire.close()
