"""Requests waiting for room in the staging budget (stage_book.py, invariant 4).

A hit the budget left out is *held back*; its request waits until loads have made
room instead of encoding the item again, at most ``wait_s`` in all per request.
``RoomWaits`` is a part of the scheduler connector (scheduler.py): it owns, per live
request, since when it waits (None once its bound passed), and whether this step held
one; it is handed the stage book it asks about.

Invariants:
- A request is held for room at most ``wait_s`` in all, from the first time; then its
  hits past the budget are encoded (one log line per request).
- An entry lives only while its request does (``forget`` at request_finished).
"""

from __future__ import annotations

import logging
import time

from lmcache_ec_broker.connector.vllm.stage_book import StageBook

log = logging.getLogger("vllm.lmcache_ec_broker.connector")


class RoomWaits:
    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._since: dict[str, float | None] = {}  # req_id -> since; None: bound passed
        self.held_now = False  # this step held a request for room (until step_ended)

    def hold(self, req_id: str) -> bool:
        """Hold ``req_id`` for room: True while within its bound. Open orders end as
        their requests are scheduled, fail or end, so room comes; encoding at once
        instead would encode again, in a burst of hits, every item the budget left out."""
        now = time.monotonic()
        since = self._since.setdefault(req_id, now)
        if since is not None and now - since < self._wait_s:
            self.held_now = True
            return True
        if since is not None:  # the bound just passed: said once per request
            self._since[req_id] = None
            log.info(
                "EC stage: request %s found no room in stage_max_embeds within %.1f s; "
                "its hits past it are encoded",
                req_id,
                self._wait_s,
            )
        return False

    def still_no_room(
        self, req_id: str, expected: dict[str, tuple[int, int | None]], book: StageBook
    ) -> bool:
        """A request held for room whose held-back hit still finds none is held again,
        without asking the broker: in a burst every waiting request would otherwise
        cost a lookup in every step (vLLM's waiting loop visits every held request)."""
        if self._since.get(req_id) is None:  # not waiting, or its bound passed
            return False
        for h, (embeds, _width) in expected.items():
            if book.held_back(h) and not book.fits(embeds) and book.room_may_come(req_id, embeds):
                return self.hold(req_id)
        return False

    def step_ended(self) -> None:
        self.held_now = False

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
