"""Wiring the events into a broker (an add-on: ``run.py`` hands ``install`` to the
server when ``events_port`` or ``events_lookup_port`` is set, and ``BrokerServer.prepare``
calls it; the server does not import this package): the tracker observes the store
and the coordinator, the publisher thread and the lookup endpoint start, and the
broker's stop publishes a final 'cleared' before the sockets close."""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from ..broker.lifecycle import BrokerError
from ..config_events import node_name
from .lookup_http import LookupServer
from .tracker import ResidencyTracker

if TYPE_CHECKING:
    from ..broker.server import BrokerServer

log = logging.getLogger("lmcache_ec_broker.events")

EVENTS_EXTRA = "pip install 'lmcache-ec-broker[events]' (from a clone: pip install '.[events]')"


class EventsError(BrokerError):
    """The events cannot start; the message names the fix."""


def install(server: BrokerServer) -> ResidencyTracker:
    cfg = server.config
    node = node_name(cfg)
    publisher = None
    if cfg.events_port:
        try:
            from .publisher import ZmqPublisher
        except ImportError as exc:
            raise EventsError(
                f"events_port {cfg.events_port} needs pyzmq, which cannot be imported ({exc}); "
                f"install the events extra: {EVENTS_EXTRA}, or leave events off (events_port 0)"
            ) from exc
        try:
            publisher = ZmqPublisher(
                cfg.events_host,
                cfg.events_port,
                node,
                cfg.events_queue,
                cfg.events_replay,
                cfg.events_heartbeat_s,
            )
        except OSError as exc:
            raise EventsError(
                f"cannot publish events on {cfg.events_host}:{cfg.events_port}: {exc}; choose "
                "another events_port (it and events_port + 1 must be free; 0 turns events off)"
            ) from exc
    tracker = ResidencyTracker(node, server.epoch, publisher.offer if publisher else None)
    server.store.index.observer = tracker
    server.tiers.observer = tracker
    http = None
    if cfg.events_lookup_port:
        try:
            http = LookupServer(
                cfg.events_host,
                cfg.events_lookup_port,
                lambda model, hashes: _on_loop(server, lambda: _answer(tracker, model, hashes)),
                lambda: _on_loop(server, lambda: _nodes(tracker)),
            )
        except OSError as exc:
            if publisher is not None:
                publisher.close_now()
            raise EventsError(
                f"cannot serve the lookup API on {cfg.events_host}:{cfg.events_lookup_port}: "
                f"{exc}; choose another events_lookup_port (0 turns it off)"
            ) from exc
        http.start()
        log.info("residency lookup on http://%s:%d/v1/lookup", cfg.events_host, http.port)
    if publisher is not None:
        publisher.start(lambda: server.loop, tracker.snapshot, tracker.heartbeat)
        log.info(
            "residency events on %s (replay and snapshots on %s), node %s",
            publisher.endpoint,
            publisher.replay_endpoint,
            node,
        )

    async def stop() -> None:
        tracker.close()
        if publisher is not None:
            await publisher.stop()
        if http is not None:
            http.close()

    def stats() -> dict[str, int]:
        out = tracker.stats()
        if publisher is not None:
            out.update(publisher.stats())
        return out

    server.shutdown_hooks.append(stop)
    server.stats_providers.append(stats)
    return tracker


def _answer(tracker: ResidencyTracker, model: str, hashes: list[str]) -> list[list[dict[str, Any]]]:
    return [
        [{"node": tracker.node, "tiers": tiers}] if tiers else []
        for tiers in tracker.lookup(model, hashes)
    ]


def _nodes(tracker: ResidencyTracker) -> dict[str, dict[str, Any]]:
    return {
        tracker.node: {
            "up": not tracker.closed,
            "epoch": tracker.epoch,
            "seq": tracker.next_seq,
            "entries": len(tracker.residency),
        }
    }


def _on_loop(server: BrokerServer, fn: Any) -> Any:
    """Run ``fn`` on the broker's loop (the tracker is loop state) and wait for it."""
    loop = server.loop
    if loop is None or loop.is_closed() or not loop.is_running():
        raise RuntimeError("the broker is not serving")
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return fut.result(timeout=5)
