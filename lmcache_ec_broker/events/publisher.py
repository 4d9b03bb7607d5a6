"""The publisher thread: owns the ZMQ PUB and ROUTER sockets (pyzmq, the ``events``
extra) and never lets the broker's loop wait on the network.

The loop hands batches over with ``offer`` (a bounded queue: full means the batch
is dropped and counted by the tracker, never a wait). The thread sends them on the
PUB socket, keeps the last ``replay`` of them for vLLM-style replay requests, asks
the loop for heartbeats, and answers snapshot requests with state the loop took
(the thread waits for that answer without blocking the loop or its own sending).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .schema import END_SEQ, Snapshot, encoder, request_decoder, topic

log = logging.getLogger("lmcache_ec_broker.events")

_POLL_S = 0.05
_LINGER_MS = 500  # how long the last batches (the final 'cleared') may take to leave
_MAX_REQUEST = 1 << 16


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ZmqPublisher:
    """Bind in the constructor (a taken port refuses the broker's start), then ``start``."""

    def __init__(
        self,
        host: str,
        port: int,
        node: str,
        queue_size: int,
        replay: int,
        heartbeat_s: float,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.node = node
        self.heartbeat_s = heartbeat_s
        self._queue: queue.Queue[tuple[bytes, int, bytes] | None] = queue.Queue(queue_size)
        self._buffer: collections.deque[tuple[bytes, int, bytes]] = collections.deque(maxlen=replay)
        self.counters = {"events_snapshots": 0, "events_replays": 0, "events_bad_requests": 0}
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            for sock in (self._pub, self._router):
                sock.setsockopt(zmq.LINGER, _LINGER_MS)
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a gone client is dropped
            self.endpoint = tcp_endpoint(host, port)
            self.replay_endpoint = tcp_endpoint(host, port + 1)
            self._pub.bind(self.endpoint)
            self._router.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"{exc} (binding {tcp_endpoint(host, port)} and port {port + 1})"
            ) from exc
        self._loop: Callable[[], asyncio.AbstractEventLoop | None] = lambda: None
        self._snapshot: Callable[[], Snapshot] | None = None
        self._heartbeat: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._running = False

    # ------------------------------------------------------------ loop side

    def offer(self, topic_b: bytes, seq: int, payload: bytes) -> bool:
        """Hand a batch to the thread; False (dropped) when the queue is full."""
        try:
            self._queue.put_nowait((topic_b, seq, payload))
            return True
        except queue.Full:
            return False

    def start(
        self,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        snapshot: Callable[[], Snapshot],
        heartbeat: Callable[[], None],
    ) -> None:
        """Start the thread; ``loop`` returns the broker's loop once it serves (until
        then no heartbeats are sent and snapshot requests are answered with the end
        marker only)."""
        self._loop, self._snapshot, self._heartbeat = loop, snapshot, heartbeat
        self._running = True
        self._thread = threading.Thread(target=self._run, name="ec-events", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (the final batch included), then close the sockets."""
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the thread sees _running False after draining
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        else:
            self._close_sockets()

    def close_now(self) -> None:
        """Close an unstarted publisher (the broker's start failed after binding)."""
        if self._thread is None:
            self._close_sockets()

    # ------------------------------------------------------------ thread side

    def _run(self) -> None:
        pending: list[tuple[bytes, concurrent.futures.Future[Snapshot]]] = []
        next_beat = time.monotonic() + self.heartbeat_s
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    item = ()
                if item is None or (not self._running and item == ()):
                    self._drain()
                    break
                if item:
                    self._send(*item)
                    self._drain()
                while self._router.poll(0):
                    self._request(pending)
                pending = self._answer(pending)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_s
                    self._call_loop(self._heartbeat)
        except Exception:
            log.exception("the events publisher thread failed; no more events are published")
        finally:
            self._close_sockets()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._send(*item)

    def _send(self, topic_b: bytes, seq: int, payload: bytes) -> None:
        seq_b = seq.to_bytes(8, "big")
        self._pub.send_multipart((topic_b, seq_b, payload), flags=self._zmq.NOBLOCK)
        if self._buffer.maxlen:
            self._buffer.append((topic_b, seq, payload))

    def _request(self, pending: list) -> None:
        frames = self._router.recv_multipart(flags=self._zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] != b"":
            self.counters["events_bad_requests"] += 1
            return
        client, _, body = frames
        if len(body) == 8:  # vLLM's replay request: the first sequence number wanted
            self.counters["events_replays"] += 1
            start = int.from_bytes(body, "big")
            for topic_b, seq, payload in list(self._buffer):
                if seq >= start:
                    self._reply(client, topic_b, seq.to_bytes(8, "big"), payload)
            self._reply(client, b"", END_SEQ, b"")
            return
        try:
            request_decoder.decode(body)
        except Exception:
            self.counters["events_bad_requests"] += 1
            self._reply(client, b"", END_SEQ, b"")
            return
        fut: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()
        if self._call_loop(lambda: _fill(fut, self._snapshot)):
            pending.append((client, fut))
        else:
            self._reply(client, b"", END_SEQ, b"")

    def _answer(self, pending: list) -> list:
        left = []
        for client, fut in pending:
            if not fut.done():
                left.append((client, fut))
                continue
            try:
                snap = fut.result()
            except Exception:
                log.exception("taking a residency snapshot failed")
                self._reply(client, b"", END_SEQ, b"")
                continue
            self.counters["events_snapshots"] += 1
            self._reply(
                client,
                topic(self.node).encode(),
                snap.next_seq.to_bytes(8, "big"),
                encoder.encode(snap),
            )
        return left

    def _reply(self, client: bytes, *frames: bytes) -> None:
        try:
            self._router.send_multipart((client, b"", *frames), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # that client does not read; its request is answered by nothing

    def _call_loop(self, fn: Callable[[], Any] | None) -> bool:
        loop = self._loop()
        if fn is None or loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn)
            return True
        except RuntimeError:  # the loop closed meanwhile
            return False

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            sock.close()
        self._ctx.term()

    def stats(self) -> dict[str, int]:
        return {**self.counters, "events_queued": self._queue.qsize()}


def _fill(fut: concurrent.futures.Future, make: Callable[[], Snapshot] | None) -> None:
    try:
        assert make is not None
        fut.set_result(make())
    except BaseException as exc:
        fut.set_exception(exc)
