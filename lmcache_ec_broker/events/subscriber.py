"""Follow one broker's residency: a SUB socket for the stream, a DEALER for snapshots.

State machine per broker (``NodeFeed``), driven by one thread for many brokers:

- SYNCING: subscribe, ask for a snapshot, keep what the stream delivers meanwhile;
  the snapshot (state before ``next_seq``) replaces the node's residency and the
  kept batches from ``next_seq`` on are applied -> LIVE.
- LIVE: batches must arrive numbered ``expected``; a gap (a batch dropped by the
  broker or by ZMQ), a lower number (the broker restarted) or a heartbeat with a
  new epoch -> SYNCING. Nothing heard for ``down_after_s`` -> the node is down: its
  entries are forgotten (a lookup must not send requests to it) until it answers
  a snapshot again.
- A final 'cleared' (every tier) from a stopping broker forgets its entries at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .residency import Residency
from .schema import (
    TOPIC_PREFIX,
    EncoderCacheCleared,
    EventBatch,
    Heartbeat,
    SnapshotRequest,
    batch_decoder,
    encoder,
    parse_topic,
    snapshot_decoder,
)

log = logging.getLogger("lmcache_ec_broker.events")

SNAPSHOT_RETRY_S = 1.0
MAX_KEPT = 100_000  # batches kept while a snapshot is awaited


class NodeFeed:
    """One broker's endpoints and what is known of it (touched under the owner's lock)."""

    def __init__(self, ctx: Any, endpoint: str, replay_endpoint: str) -> None:
        import zmq

        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX.encode())
        self.sub.connect(endpoint)
        self.dealer: Any = None
        self.node = ""
        self.epoch = ""
        self.residency = Residency()
        self.live = False
        self.up = False
        self.expected = 0
        self.kept: list[tuple[int, bytes]] = []
        self.asked_at = 0.0
        self.heard_at = 0.0
        self.counters = {"batches": 0, "gaps": 0, "restarts": 0, "snapshots": 0, "bad": 0}

    def status(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "live": self.live,
            "endpoint": self.endpoint,
            "epoch": self.epoch,
            "seq": self.expected,
            "entries": len(self.residency),
            "age_s": round(time.monotonic() - self.heard_at, 3) if self.heard_at else None,
            **self.counters,
        }


class Subscriber:
    """Follows many brokers on one thread; ``lock`` guards every NodeFeed's state."""

    def __init__(self, endpoints: list[str], down_after_s: float = 3.0) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.down_after_s = down_after_s
        self.feeds = [NodeFeed(self.ctx, ep, replay_endpoint(ep)) for ep in endpoints]
        self._running = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="ec-events-sub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
        for feed in self.feeds:
            feed.sub.close(linger=0)
            if feed.dealer is not None:
                feed.dealer.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------ queries

    def lookup(self, model: str, hashes: list[str]) -> list[list[dict[str, Any]]]:
        with self.lock:
            out: list[list[dict[str, Any]]] = []
            for h in hashes:
                where = []
                for feed in self.feeds:
                    if feed.up and feed.live:
                        tiers = feed.residency.lookup(model, h)
                        if tiers:
                            where.append({"node": feed.node, "tiers": tiers})
                out.append(where)
            return out

    def nodes(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {(f.node or f.endpoint): f.status() for f in self.feeds}

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for feed in self.feeds:
            poller.register(feed.sub, zmq.POLLIN)
        dealers: dict[Any, NodeFeed] = {}
        while self._running:
            now = time.monotonic()
            with self.lock:
                for feed in self.feeds:
                    self._maintain(feed, now, poller, dealers)
            ready = dict(poller.poll(50))
            with self.lock:
                for feed in self.feeds:
                    if ready.get(feed.sub):
                        self._read_stream(feed)
                for sock, feed in list(dealers.items()):
                    if ready.get(sock) and feed.dealer is sock:
                        self._read_snapshot(feed, poller, dealers)

    def _maintain(self, feed: NodeFeed, now: float, poller: Any, dealers: dict) -> None:
        if feed.up and now - feed.heard_at > self.down_after_s:
            log.warning(
                "no events from %s for %.1fs: its entries are dropped",
                feed.endpoint,
                now - feed.heard_at,
            )
            self._down(feed)
        if not feed.live and now - feed.asked_at > SNAPSHOT_RETRY_S:
            self._ask_snapshot(feed, poller, dealers)

    def _down(self, feed: NodeFeed) -> None:
        feed.up = False
        feed.live = False
        feed.residency.clear()
        feed.kept.clear()

    def _resync(self, feed: NodeFeed) -> None:
        feed.live = False
        feed.asked_at = 0.0  # ask at once

    def _ask_snapshot(self, feed: NodeFeed, poller: Any, dealers: dict) -> None:
        zmq = self._zmq
        if feed.dealer is not None:  # an unanswered request: start over on a new socket
            poller.unregister(feed.dealer)
            dealers.pop(feed.dealer, None)
            feed.dealer.close(linger=0)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(feed.replay_endpoint)
        dealer.send_multipart((b"", encoder.encode(SnapshotRequest())), flags=zmq.NOBLOCK)
        feed.dealer = dealer
        dealers[dealer] = feed
        poller.register(dealer, zmq.POLLIN)
        feed.asked_at = time.monotonic()

    def _read_snapshot(self, feed: NodeFeed, poller: Any, dealers: dict) -> None:
        zmq = self._zmq
        frames = feed.dealer.recv_multipart(flags=zmq.NOBLOCK)
        poller.unregister(feed.dealer)
        dealers.pop(feed.dealer, None)
        feed.dealer.close(linger=0)
        feed.dealer = None
        if len(frames) != 4 or not frames[3]:
            return  # the broker could not answer yet: asked again after the retry delay
        try:
            snap = snapshot_decoder.decode(frames[3])
        except Exception:
            feed.counters["bad"] += 1
            return
        if feed.epoch and snap.epoch != feed.epoch:
            feed.counters["restarts"] += 1
        feed.node, feed.epoch = snap.node, snap.epoch
        feed.residency = Residency()
        for entry in snap.entries:
            feed.residency.apply(entry)
        feed.expected = snap.next_seq
        feed.live = feed.up = True
        feed.heard_at = time.monotonic()
        feed.counters["snapshots"] += 1
        kept, feed.kept = sorted(feed.kept), []
        for seq, payload in kept:
            if seq >= feed.expected:
                self._apply(feed, seq, payload)

    def _read_stream(self, feed: NodeFeed) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = feed.sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8 or parse_topic(frames[0]) is None:
                feed.counters["bad"] += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            feed.heard_at = time.monotonic()
            if not feed.live:
                if len(feed.kept) < MAX_KEPT:
                    feed.kept.append((seq, frames[2]))
                continue
            self._apply(feed, seq, frames[2])

    def _apply(self, feed: NodeFeed, seq: int, payload: bytes) -> None:
        if seq != feed.expected:
            feed.counters["gaps" if seq > feed.expected else "restarts"] += 1
            self._resync(feed)
            feed.kept.append((seq, payload))
            return
        try:
            batch: EventBatch = batch_decoder.decode(payload)
        except Exception:
            feed.counters["bad"] += 1
            self._resync(feed)
            return
        feed.expected = seq + 1
        feed.counters["batches"] += 1
        for event in batch.events:
            if isinstance(event, Heartbeat):
                if event.epoch != feed.epoch:
                    feed.counters["restarts"] += 1
                    self._resync(feed)
                    return
            elif isinstance(event, EncoderCacheCleared) and event.tier is None:
                self._down(feed)  # the broker is stopping
                return
            else:
                feed.residency.apply(event)


def replay_endpoint(endpoint: str) -> str:
    """The replay/snapshot socket of a broker publishing on ``endpoint`` (its port + 1)."""
    base, _, port = endpoint.rpartition(":")
    if not base.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"{endpoint!r} is not a tcp://host:port endpoint of a broker's events")
    return f"{base}:{int(port) + 1}"
