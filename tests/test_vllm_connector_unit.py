"""ECBrokerConnector against vLLM's real ECConnectorBase, real VllmConfig / Request
objects and a real broker process. No engine is started: the tests drive the
scheduler-side and worker-side hooks in the order vLLM calls them."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Imported unguarded on purpose: CI installs vLLM, so a missing vLLM fails here.
from vllm.config import ECTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorBase,
    ECConnectorRole,
)
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.connector.vllm import (  # noqa: E402
    ECBrokerConnector,
    ECBrokerConnectorMetadata,
    make_key,
)
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl  # noqa: E402

NUM_EMBEDS = 16
HIDDEN = 128  # TinyQwen2VLSpec().hidden_size


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    path = build_tiny_qwen2vl(root)
    return ModelConfig(model=str(path), dtype="bfloat16", max_model_len=512)


def make_config(
    model_config: ModelConfig, role: str, socket_path: str, **extra: object
) -> VllmConfig:
    return VllmConfig(
        model_config=model_config,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role=role,
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config={"socket_path": socket_path, "timeout_s": 2.0, **extra},
        ),
    )


class Pair:
    """The scheduler-side and worker-side connectors of one vLLM instance."""

    def __init__(self, config: VllmConfig) -> None:
        self.sched = ECBrokerConnector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECBrokerConnector(config, ECConnectorRole.WORKER)

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()

    def step(self, encoder_cache: dict, allocs: list[tuple[Request, int]]) -> set[str]:
        """One engine step in vLLM 0.32's order: ensure_cache_available per request
        (False: deferred to a later step), has_cache_item per item, alloc, meta,
        worker load, worker output back to the scheduler. Returns the deferred ids."""
        deferred: set[str] = set()
        for request, index in allocs:
            if request.request_id in deferred or not self.sched.ensure_cache_available(request, 0):
                deferred.add(request.request_id)
                continue
            self.sched.has_cache_item(request.mm_features[index].identifier)
            self.sched.update_state_after_alloc(request, index)
        meta = self.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
        meta = pickle.loads(pickle.dumps(meta))  # crosses a process boundary in vLLM
        self.worker.bind_connector_metadata(meta)
        if self.worker.is_consumer:
            self.worker.start_load_caches(encoder_cache)
        out = ECConnectorOutput(ec_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(pickle.loads(pickle.dumps(out)))
        return deferred


@pytest.fixture
def pairs(model_config: ModelConfig, broker) -> Iterator:
    made: list[Pair] = []

    def factory(
        role: str = "ec_both",
        socket_path: str | None = None,
        model: ModelConfig | None = None,
        **extra: object,
    ) -> Pair:
        config = make_config(
            model or model_config, role, socket_path or broker.socket_path, **extra
        )
        p = Pair(config)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.close()


def make_request(req_id: str, mm_hash: str) -> Request:
    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=mm_hash,
        mm_position=PlaceholderRange(offset=3, length=NUM_EMBEDS),
    )
    return Request(
        request_id=req_id,
        prompt_token_ids=[1, 2, 3] + [5] * NUM_EMBEDS + [4, 9],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=[feature],
    )


def embedding(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_EMBEDS, HIDDEN, generator=g).to(torch.bfloat16)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def connector_log() -> Iterator[Capture]:
    handler = Capture()
    logger = logging.getLogger("vllm.lmcache_ec_broker.connector")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_is_a_real_vllm_ec_connector(model_config, broker):
    assert issubclass(ECBrokerConnector, ECConnectorBase)
    assert not getattr(ECBrokerConnector, "__abstractmethods__", None)
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = make_config(model_config, "ec_both", broker.socket_path)
    conn = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    try:
        assert type(conn) is ECBrokerConnector
        assert conn.is_producer and conn.is_consumer
        assert conn.model_id.startswith(f"{model_config.model}#")
        assert conn.key("abc") == f"{conn.model_id}@1@0@abc@bfloat16"
    finally:
        conn.shutdown()


def test_key_format():
    assert make_key("m", "h" * 64, torch.bfloat16) == f"m@1@0@{'h' * 64}@bfloat16"
    assert make_key("org/model", "x", "float16") == "org/model@1@0@x@float16"


def test_save_then_load_round_trip(pairs, broker, connector_log):
    a, b = pairs(), pairs()
    h = "a" * 64
    tensor = embedding(1)
    a.worker.save_caches({h: tensor}, h)
    assert a.worker.puts_stored == 1
    assert f"EC put: stored {tensor.numel() * 2} bytes for mm_hash={h}" in connector_log.lines

    with BrokerClient(broker.socket_path) as c:
        before = c.stats()
        assert before["entries"] == 1

    request = make_request("req-1", h)
    cache: dict[str, torch.Tensor] = {}
    b.step(cache, [(request, 0)])
    assert b.sched.ec_hits == 1 and b.sched.ec_misses == 0
    assert b.worker.loads == 1
    assert cache[h].dtype == torch.bfloat16 and cache[h].shape == (NUM_EMBEDS, HIDDEN)
    assert torch.equal(cache[h], tensor)
    with BrokerClient(broker.socket_path) as c:
        assert c.stats()["hits"] > before["hits"]


def test_locally_encoded_items_are_not_loaded(pairs):
    p = pairs()
    request = make_request("req-1", "b" * 64)
    assert not p.sched.has_cache_item("b" * 64)
    p.sched.update_state_after_alloc(request, 0)  # vLLM calls it for encoded items too
    meta = p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    assert isinstance(meta, ECBrokerConnectorMetadata) and meta.loads == []
    assert p.sched.ec_misses == 1


def test_scheduler_decision_is_kept_within_a_step(pairs, broker):
    """has_cache_item said True: the load is queued even if the entry changes
    before update_state_after_alloc, because vLLM already counted it as a load."""
    p = pairs()
    h = "c" * 64
    p.worker.save_caches({h: embedding(2)}, h)
    assert p.sched.has_cache_item(h)
    with BrokerClient(broker.socket_path) as c:
        assert c.delete(p.sched.key(h))
    p.sched.update_state_after_alloc(make_request("r", h), 0)
    meta = p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    assert [(s.req_id, s.mm_hash, s.num_embeds) for s in meta.loads] == [("r", h, NUM_EMBEDS)]
    # The next step asks the broker again.
    assert not p.sched.has_cache_item(h)


def test_roles(pairs, broker):
    producer, consumer = pairs("ec_producer"), pairs("ec_consumer")
    h = "d" * 64
    consumer.worker.save_caches({h: embedding(3)}, h)  # consumer never saves
    with BrokerClient(broker.socket_path) as c:
        assert c.stats()["entries"] == 0
    producer.worker.save_caches({h: embedding(3)}, h)
    assert producer.worker.puts_stored == 1
    assert not producer.sched.has_cache_item(h)  # a producer encodes; it never loads
    assert consumer.sched.has_cache_item(h)


def test_tp_ranks_store_once(pairs, broker):
    ranks = [pairs() for _ in range(3)]
    h = "e" * 64
    tensor = embedding(4)
    for r in ranks:
        r.worker.save_caches({h: tensor}, h)
    assert sum(r.worker.puts_stored for r in ranks) == 1
    with BrokerClient(broker.socket_path) as c:
        assert c.stats()["entries"] == 1


def test_vanished_entry_fails_the_request_not_the_engine(pairs, broker):
    p = pairs()
    h = "f" * 64
    tensor = embedding(5)
    p.worker.save_caches({h: tensor}, h)
    request = make_request("doomed", h)

    # The entry disappears between the scheduler's check and the worker's load.
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    with BrokerClient(broker.socket_path) as c:
        assert c.delete(p.sched.key(h))
    cache: dict[str, torch.Tensor] = {}
    p.worker.bind_connector_metadata(p.sched.build_connector_meta(scheduler_output=None))  # type: ignore[arg-type]
    p.worker.start_load_caches(cache)
    # vLLM's gather raises on a missing entry; a placeholder keeps the step alive.
    assert cache[h].shape == (NUM_EMBEDS, HIDDEN)
    assert p.worker.load_failures == 1
    p.sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
    )
    p.worker.clear_connector_metadata()

    # The scheduler refuses to run it (or anything else on that placeholder) and fails it.
    assert not p.sched.ensure_cache_available(request, 0)
    later = make_request("later", h)
    assert not p.sched.ensure_cache_available(later, 0)
    assert p.sched.take_unavailable_requests() == {"doomed", "later"}
    assert p.sched.take_unavailable_requests() == set()
    assert p.sched.ensure_cache_available(make_request("other", "0" * 64), 0)

    # Once the broker has the entry again, the worker repairs its placeholder.
    p.worker.save_caches(cache, h)  # a placeholder is never published
    assert p.worker.puts_stored == 1
    pairs().worker.save_caches({h: tensor}, h)  # another instance re-encoded it
    p.step(cache, [])
    assert torch.equal(cache[h], tensor)
    assert p.sched.ensure_cache_available(make_request("again", h), 0)


def test_freed_placeholder_is_forgotten(pairs, broker):
    p = pairs()
    h = "9" * 64
    request = make_request("r", h)
    p.worker.save_caches({h: embedding(6)}, h)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    with BrokerClient(broker.socket_path) as c:
        c.delete(p.sched.key(h))
    cache: dict[str, torch.Tensor] = {}
    p.worker.bind_connector_metadata(p.sched.build_connector_meta(scheduler_output=None))  # type: ignore[arg-type]
    p.worker.start_load_caches(cache)
    p.sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
    )
    assert not p.sched.ensure_cache_available(make_request("r2", h), 0)
    del cache[h]  # vLLM evicted it from its encoder cache
    p.step(cache, [])
    assert p.sched.ensure_cache_available(make_request("r3", h), 0)


def test_broker_down_means_misses_not_crashes(pairs, sock_dir, connector_log):
    missing = os.path.join(sock_dir, "nobody.sock")
    p = pairs(socket_path=missing)
    h = "7" * 64
    p.worker.save_caches({h: embedding(7)}, h)
    assert p.worker.puts_stored == 0
    assert not p.sched.has_cache_item(h)
    assert any("not reachable" in line for line in connector_log.lines)


def test_broker_restart_keeps_serving(pairs, make_broker, sock_dir, connector_log):
    path = os.path.join(sock_dir, "restart.sock")
    first = make_broker("--shm-size", "64MiB", socket_path=path)
    p = pairs(socket_path=path)
    h, h2 = "5" * 64, "6" * 64
    p.worker.save_caches({h: embedding(8)}, h)
    assert p.sched.has_cache_item(h)
    p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    first.stop()

    assert not p.sched.has_cache_item(h)  # broker away: a miss, no exception
    assert any("not reachable" in line for line in connector_log.lines)
    p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    make_broker("--shm-size", "64MiB", socket_path=path)
    deadline = time.monotonic() + 10
    tensor = embedding(9)
    stored_before = p.worker.puts_stored
    while True:
        p.worker.save_caches({h2: tensor}, h2)
        if p.worker.puts_stored > stored_before:
            break
        assert time.monotonic() < deadline, "client did not reconnect"
        time.sleep(0.1)
    cache: dict[str, torch.Tensor] = {}
    while True:
        p.step(cache, [(make_request("r", h2), 0)])
        if h2 in cache and p.worker.loads:
            break
        assert time.monotonic() < deadline, "scheduler did not reconnect"
        time.sleep(0.1)
    assert torch.equal(cache[h2], tensor)
    assert any("reachable again" in line for line in connector_log.lines)


def test_first_hit_after_a_broker_restart_loads(pairs, make_broker, sock_dir):
    """Connections idle across a broker restart are found dead only when used: the
    scheduler's lookup and the worker's get retry once on a fresh connection, so the
    first hit after a restart loads. (Before: the lookup answered a miss, and a worker
    whose scheduler had already reconnected failed the request.)"""
    path = os.path.join(sock_dir, "rs.sock")
    first = make_broker("--shm-size", "64MiB", socket_path=path)
    p = pairs(socket_path=path)
    h0, h = "a0" * 32, "a1" * 32
    p.worker.save_caches({h0: embedding(60)}, h0)
    load_cycle(p, make_request("r0", h0))  # both connections in use
    first.stop()
    make_broker("--shm-size", "64MiB", socket_path=path)
    tensor = embedding(61)
    with BrokerClient(path) as c:
        assert c.put(p.sched.key(h), tensor)
    cache = load_cycle(p, make_request("r1", h))
    assert torch.equal(cache[h], tensor)
    assert p.sched.ec_hits == 2 and p.worker.loads == 2 and p.worker.load_failures == 0


def test_counters_reach_vllm_stats(pairs):
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging

    p = pairs()
    h = "3" * 64
    assert not p.sched.has_cache_item(h)
    p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    p.worker.save_caches({h: embedding(10)}, h)
    assert p.sched.has_cache_item(h)
    assert p.sched.stats()["ec_hits"] == 1 and p.sched.stats()["ec_misses"] == 1

    interval = p.sched.get_ec_connector_stats()
    assert interval.reduce() == {"ec_hits": 1, "ec_misses": 1}
    assert p.sched.get_ec_connector_stats() is None  # deltas: nothing new since

    # vLLM's own stats logger rebuilds, sums and prints them.
    logging_ = ECConnectorLogging(p.sched._vllm_config.ec_transfer_config)
    logging_.observe(interval.data)
    logging_.observe(p.worker.get_ec_connector_stats().data)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["EC Transfer metrics: ec_hits=1, ec_misses=1, puts_stored=1"]


def test_outputs_encoded_during_an_outage_are_published_after_it(pairs, make_broker, sock_dir):
    path = os.path.join(sock_dir, "outage.sock")
    first = make_broker("--shm-size", "64MiB", socket_path=path)
    p = pairs(socket_path=path)
    assert p.sched.client.connected
    first.stop()
    kept, dropped = "1" * 64, "2" * 64
    cache = {kept: embedding(11), dropped: embedding(12)}
    p.worker.save_caches(cache, kept)
    p.worker.save_caches(cache, dropped)
    assert p.worker.puts_stored == 0
    p.worker.start_save_caches(encoder_cache=cache)  # still away: nothing happens
    del cache[dropped]  # vLLM evicted this one meanwhile

    make_broker("--shm-size", "64MiB", socket_path=path)
    deadline = time.monotonic() + 10
    while p.worker.puts_stored == 0:
        assert time.monotonic() < deadline, "never published after the broker came back"
        p.worker.start_save_caches(encoder_cache=cache)
        time.sleep(0.1)
    assert p.worker.puts_stored == 1
    with BrokerClient(path) as c:
        assert c.has([p.sched.key(kept), p.sched.key(dropped)]) == [True, False]
    p.worker.start_save_caches(encoder_cache=cache)
    assert p.worker.puts_stored == 1  # nothing left to retry


# ------------------------------------------------- leases (issue 10 item 10)


def broker_stats(socket_path: str, *settle: Pair) -> dict:
    """The broker's stats once the posted messages (Release, Unlease) of ``settle``'s
    connections are processed: a round trip on a connection follows everything that
    connection sent before."""
    for p in settle:
        for conn in (p.sched, p.worker):
            if conn._client is not None:
                assert conn._client.ping()
    with BrokerClient(socket_path) as c:
        return c.stats()


def load_cycle(p: Pair, request: Request) -> dict[str, torch.Tensor]:
    cache: dict[str, torch.Tensor] = {}
    assert p.step(cache, [(request, 0)]) == set()
    return cache


def test_leases_end_once_the_load_is_done(pairs, make_broker):
    """A stream of has+load cycles through a slab of 16 blocks: every lease ends after
    its load, so eviction keeps working and no put is refused. (Before: each hit held
    a 30 s lease, the slab filled with leased entries and puts got NO_SPACE.)"""
    b = make_broker("--shm-size", "1MiB", "--block-size", "64KiB")
    a, reader = pairs(socket_path=b.socket_path), pairs(socket_path=b.socket_path)
    for i in range(48):
        h = f"{i:064x}"
        tensor = embedding(100 + i)
        a.worker.save_caches({h: tensor}, h)
        cache = load_cycle(reader, make_request(f"r{i}", h))
        assert torch.equal(cache[h], tensor), i
    assert a.worker.put_errors == 0 and a.worker.puts_stored == 48
    assert reader.worker.loads == 48 and reader.sched.ec_hits == 48
    s = broker_stats(b.socket_path, a, reader)
    assert s["no_space"] == 0 and s["evictions"] >= 48 - 16
    assert s["pins"] == 0, "leases still held after their loads"


def test_hits_not_loaded_this_step_release_their_lease(pairs, broker):
    """has_cache_item said True but the request was not scheduled after all (no
    update_state_after_alloc): the lease ends with the step."""
    p = pairs()
    h = "ab" * 32
    p.worker.save_caches({h: embedding(20)}, h)
    assert p.sched.ensure_cache_available(make_request("r", h), 0)
    assert p.sched.has_cache_item(h)
    assert broker_stats(broker.socket_path, p)["pins"] == 1
    p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    assert broker_stats(broker.socket_path, p)["pins"] == 0


def test_a_lease_still_needed_by_a_later_step_is_kept(pairs, broker):
    """Async scheduling: step 2 leases the hash again before step 1's load is
    reported; step 1's report must not end step 2's lease."""
    p = pairs()
    h = "cd" * 32
    p.worker.save_caches({h: embedding(21)}, h)
    first, second = make_request("r1", h), make_request("r2", h)
    metas = []
    for request in (first, second):
        assert p.sched.ensure_cache_available(request, 0)
        assert p.sched.has_cache_item(h)
        p.sched.update_state_after_alloc(request, 0)
        metas.append(p.sched.build_connector_meta(scheduler_output=None))  # type: ignore[arg-type]
    for n, meta in enumerate(metas):
        cache: dict[str, torch.Tensor] = {}
        p.worker.bind_connector_metadata(meta)
        p.worker.start_load_caches(cache)
        out = ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
        p.worker.clear_connector_metadata()
        assert h in cache
        assert broker_stats(broker.socket_path, p)["pins"] == 1, "lease ended before a load"
        p.sched.update_connector_output(out)
        assert broker_stats(broker.socket_path, p)["pins"] == (1 if n == 0 else 0)


# --------------------------------- lower tiers: defer, never wait (item 9)


def disk_broker(make_broker, sock_dir: str, socket_path: str | None = None):
    disk = os.path.join(sock_dir, "disk")
    return make_broker(
        "--shm-size", "8MiB", "--local-disk", disk, "--max-local-disk-size", "64MiB",
        socket_path=socket_path,
    )  # fmt: skip


def wait_written(socket_path: str, n: int) -> None:
    deadline = time.monotonic() + 30
    with BrokerClient(socket_path) as c:
        while True:
            s = c.stats()
            if s["disk_writes"] >= n and s["disk_pending_writes"] == 0:
                return
            assert time.monotonic() < deadline, f"disk writes did not finish: {s}"
            time.sleep(0.02)


def restarted_with_disk_only(make_broker, sock_dir: str, entries: dict[str, torch.Tensor], pairs):
    """A broker whose disk tier holds ``entries`` (stored through a connector) and
    whose slab is empty: the broker is stopped and started again on the same disk."""
    b = disk_broker(make_broker, sock_dir)
    writer = pairs(socket_path=b.socket_path)
    for h, tensor in entries.items():
        writer.worker.save_caches({h: tensor}, h)
    assert writer.worker.puts_stored == len(entries)
    wait_written(b.socket_path, len(entries))
    writer.close()
    b.stop()
    b2 = disk_broker(make_broker, sock_dir, socket_path=b.socket_path)
    with BrokerClient(b2.socket_path) as c:
        s = c.stats()
    assert s["entries"] == 0 and s["disk_entries"] == len(entries)
    return b2


def test_disk_hit_defers_the_request_until_promoted(pairs, make_broker, sock_dir):
    h = "d1" * 32
    tensor = embedding(30)
    b = restarted_with_disk_only(make_broker, sock_dir, {h: tensor}, pairs)
    p = pairs(socket_path=b.socket_path)
    request = make_request("r", h)
    cache: dict[str, torch.Tensor] = {}
    # The first lookup finds the entry on disk only: the request waits (the worker's
    # load must never wait on a promotion).
    assert p.step(cache, [(request, 0)]) == {"r"}
    assert p.sched.ec_deferred == 1 and p.sched.ec_hits == 0 and p.sched.ec_misses == 0
    assert p.worker.loads == 0 and cache == {}
    deadline = time.monotonic() + 30
    while p.step(cache, [(request, 0)]) == {"r"}:
        assert time.monotonic() < deadline, "never promoted"
        time.sleep(0.01)
    assert torch.equal(cache[h], tensor)
    assert p.sched.ec_hits == 1 and p.sched.ec_misses == 0 and p.sched.promotion_failures == 0
    s = broker_stats(b.socket_path, p)
    assert s["promotions"] == 1 and s["pins"] == 0


def test_promoted_hit_survives_a_full_slab_and_disk_until_loaded(pairs, make_broker, sock_dir):
    """Issue 10 item 9's scenario through the connector: a disk-only hit, deferred
    until promoted, then slab and disk filled by other puts before the worker loads:
    the load still succeeds (the lease covers the promoted entry until the load)."""
    h = "d4" * 32
    tensor = embedding(33)
    b = restarted_with_disk_only(make_broker, sock_dir, {h: tensor}, pairs)
    p = pairs(socket_path=b.socket_path)
    request = make_request("r", h)
    deadline = time.monotonic() + 30
    while not p.sched.ensure_cache_available(request, 0):
        p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "never promoted"
        time.sleep(0.01)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    meta = p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    filler = torch.zeros(256, 1024, dtype=torch.bfloat16)  # 512 KiB: 16 fill the slab
    with BrokerClient(b.socket_path) as c:
        for i in range(160):  # 80 MiB: more than the 8 MiB slab and the 64 MiB disk
            c.put(f"filler@1@0@{i:064x}@bfloat16", filler)
        assert c.stats()["evictions"] > 16
    cache: dict[str, torch.Tensor] = {}
    p.worker.bind_connector_metadata(meta)
    p.worker.start_load_caches(cache)
    assert p.worker.load_failures == 0 and torch.equal(cache[h], tensor)


def test_a_promotion_not_waited_for_is_encoded(pairs, make_broker, sock_dir):
    """max_defer_s=0: an entry still on a lower tier is encoded at once (counted)."""
    h = "d2" * 32
    b = restarted_with_disk_only(make_broker, sock_dir, {h: embedding(31)}, pairs)
    p = pairs(socket_path=b.socket_path, max_defer_s=0)
    cache: dict[str, torch.Tensor] = {}
    assert p.step(cache, [(make_request("r", h), 0)]) == set()
    assert p.sched.promotion_failures == 1 and p.sched.ec_misses == 1 and p.sched.ec_hits == 0
    assert cache == {} and p.worker.loads == 0
    assert broker_stats(b.socket_path, p)["pins"] == 0


def test_miss_after_pending_is_encoded_and_counted(pairs, make_broker, sock_dir):
    """The entry goes away while the request waits for its promotion: the next lookup
    answers MISS, the request is scheduled at once and encodes the item (counted)."""
    h = "d5" * 32
    b = restarted_with_disk_only(make_broker, sock_dir, {h: embedding(34)}, pairs)
    p = pairs(socket_path=b.socket_path)
    request = make_request("r", h)
    cache: dict[str, torch.Tensor] = {}
    assert p.step(cache, [(request, 0)]) == {"r"}
    with BrokerClient(b.socket_path) as c:
        c.delete(p.sched.key(h))
        assert c.has([p.sched.key(h)]) == [False]
    assert p.step(cache, [(request, 0)]) == set()
    assert p.sched.promotion_failures == 1 and p.sched.ec_misses == 1 and p.sched.ec_hits == 0
    assert cache == {} and p.worker.load_failures == 0
    assert broker_stats(b.socket_path, p)["pins"] == 0


def test_a_request_aborted_while_waiting_releases_its_lease(pairs, make_broker, sock_dir):
    h = "d3" * 32
    b = restarted_with_disk_only(make_broker, sock_dir, {h: embedding(32)}, pairs)
    p = pairs(socket_path=b.socket_path)
    request = make_request("r", h)
    assert not p.sched.ensure_cache_available(request, 0)
    p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    deadline = time.monotonic() + 30
    while broker_stats(b.socket_path)["entries"] == 0:  # promoted: the lease pins it
        assert time.monotonic() < deadline, "never promoted"
        time.sleep(0.01)
    assert broker_stats(b.socket_path, p)["pins"] == 1
    p.sched.request_finished(request)
    assert broker_stats(b.socket_path, p)["pins"] == 0


# ----------------------------- entries of the wrong shape or dtype (item 11)


WRONG = {
    "rows": torch.zeros(NUM_EMBEDS + 1, HIDDEN, dtype=torch.bfloat16),
    "width": torch.zeros(NUM_EMBEDS, HIDDEN * 2, dtype=torch.bfloat16),
    "dtype": torch.zeros(NUM_EMBEDS, HIDDEN, dtype=torch.float16),
    "rank": torch.zeros(1, NUM_EMBEDS, HIDDEN, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("what", sorted(WRONG))
def test_wrong_entry_is_deleted_and_the_request_encodes(pairs, broker, connector_log, what):
    p = pairs()
    # vLLM measures the encoder's output width on producers; the width check uses it.
    p.sched._widths = {"image": HIDDEN}
    h = f"e{what}".ljust(64, "0")
    key = p.sched.key(h)
    with BrokerClient(broker.socket_path) as c:
        assert c.put(key, WRONG[what])  # under the real key
    cache: dict[str, torch.Tensor] = {}
    assert p.step(cache, [(make_request("r", h), 0)]) == set()
    assert p.sched.invalid_deleted == 1 and p.sched.ec_misses == 1 and p.sched.ec_hits == 0
    assert cache == {}, "a wrong entry was loaded"
    assert any("is invalid for this model" in line for line in connector_log.lines)
    with BrokerClient(broker.socket_path) as c:
        assert c.has([key]) == [False], "the wrong entry is still served"
    # The request encodes the item; the right output is stored and served from then on.
    right = embedding(40)
    p.worker.save_caches({h: right}, h)
    assert p.worker.puts_stored == 1
    cache = load_cycle(p, make_request("r2", h))
    assert torch.equal(cache[h], right)


def test_wrong_entry_on_disk_is_deleted_from_every_tier(pairs, make_broker, sock_dir):
    b = disk_broker(make_broker, sock_dir)
    probe = pairs(socket_path=b.socket_path)
    h = "e5" * 32
    key = probe.sched.key(h)
    with BrokerClient(b.socket_path) as c:
        assert c.put(key, WRONG["rows"])
    wait_written(b.socket_path, 1)
    probe.close()
    b.stop()
    b2 = disk_broker(make_broker, sock_dir, socket_path=b.socket_path)
    p = pairs(socket_path=b2.socket_path)
    assert p.step({}, [(make_request("r", h), 0)]) == set()  # checked while PENDING
    assert p.sched.invalid_deleted == 1 and p.sched.ec_deferred == 0
    with BrokerClient(b2.socket_path) as c:
        assert c.has([key]) == [False]
        assert c.stats()["disk_entries"] == 0


def test_wrong_entry_at_load_time_fails_the_request_and_is_deleted(pairs, broker):
    """The scheduler saw a good entry; by the worker's load it was replaced by a wrong
    one: the worker deletes it and the request fails (never runs on a wrong tensor)."""
    p = pairs()
    h = "e6" * 32
    p.worker.save_caches({h: embedding(41)}, h)
    request = make_request("doomed", h)
    assert p.sched.ensure_cache_available(request, 0)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    meta = p.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
    key = p.sched.key(h)
    with BrokerClient(broker.socket_path) as c:
        assert c.delete(key)
        assert c.put(key, WRONG["rows"])
    cache: dict[str, torch.Tensor] = {}
    p.worker.bind_connector_metadata(meta)
    p.worker.start_load_caches(cache)
    assert p.worker.load_failures == 1 and p.worker.invalid_deleted == 1
    assert cache[h].shape == (NUM_EMBEDS, HIDDEN)  # a placeholder keeps the step alive
    p.sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
    )
    p.worker.clear_connector_metadata()
    assert not p.sched.ensure_cache_available(request, 0)
    assert p.sched.take_unavailable_requests() == {"doomed"}
    with BrokerClient(broker.socket_path) as c:
        assert c.has([key]) == [False]


# ---------------------------------- keys follow the weights (item 12)


def copy_model(model_config: ModelConfig, dest: Path) -> ModelConfig:
    shutil.copytree(model_config.model, dest)
    return ModelConfig(model=str(dest), dtype="bfloat16", max_model_len=512)


def replace_weights(model_dir: Path) -> None:
    """Overwrite the weights in place: same file, names, shapes and size; new values
    in the vision tower only (an encoder update)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in sorted(tensors) if "visual" in n and n.endswith("weight"))
    tensors[name] = tensors[name] + 1
    size = path.stat().st_size
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


def test_weights_replaced_in_place_change_the_key(pairs, model_config, tmp_path):
    mc = copy_model(model_config, tmp_path / "m")
    old = pairs(model=mc)
    h = "f1" * 32
    old.worker.save_caches({h: embedding(50)}, h)
    assert old.sched.model_id == old.worker.model_id  # scheduler and every rank agree
    assert load_cycle(old, make_request("r", h))  # the old instance hits

    replace_weights(Path(mc.model))
    from lmcache_ec_broker.connector.model_id import fingerprint

    fingerprint.cache_clear()  # a new vLLM process computes it afresh
    new = pairs(model=mc)
    assert new.sched.model_id != old.sched.model_id
    assert new.sched.model_id.startswith(f"{mc.model}#")
    cache: dict[str, torch.Tensor] = {}
    assert new.step(cache, [(make_request("r2", h), 0)]) == set()
    assert new.sched.ec_misses == 1 and new.sched.ec_hits == 0 and cache == {}, "stale hit"


def test_encoder_config_change_changes_the_key(model_config, tmp_path):
    from lmcache_ec_broker.connector.model_id import fingerprint, model_id

    mc = copy_model(model_config, tmp_path / "m")
    before = model_id(mc.model)
    proc = Path(mc.model) / "processor_config.json"
    cfg = json.loads(proc.read_text())
    cfg["image_mean"] = [0.25, 0.25, 0.25]
    proc.write_text(json.dumps(cfg))
    fingerprint.cache_clear()
    assert model_id(mc.model) != before
    # Files that do not change the encoder's output do not change the key.
    after = model_id(mc.model)
    (Path(mc.model) / "README.md").write_text("notes")
    os.utime(Path(mc.model) / "model.safetensors", (1, 1))
    fingerprint.cache_clear()
    assert model_id(mc.model) == after


def test_copies_of_one_model_agree_on_the_fingerprint(model_config, tmp_path):
    """What a fleet needs: the same files at another path, time or host hash alike."""
    from lmcache_ec_broker.connector.model_id import fingerprint

    a = copy_model(model_config, tmp_path / "a")
    b = copy_model(model_config, tmp_path / "b")
    os.utime(Path(b.model) / "model.safetensors", (1, 1))
    assert fingerprint(a.model) == fingerprint(b.model) == fingerprint(model_config.model)
    assert fingerprint(a.model, "v2") != fingerprint(a.model)


def test_explicit_model_name(pairs, model_config, tmp_path):
    p = pairs(model_name="qwen2-vl-tiny:2026-11")
    assert p.sched.key("x") == "qwen2-vl-tiny:2026-11@1@0@x@bfloat16"
    assert p.worker.key("x") == p.sched.key("x")
    with pytest.raises(ValueError, match="model_name .* contains '@'"):
        pairs(model_name="a@b")
    with pytest.raises(ValueError, match="model_name must be a non-empty string"):
        pairs(model_name="")


# ------------------------------------------------ the vLLM plugin (issue 13)


def test_plugin_entry_point_registers_the_short_name(model_config, broker):
    from importlib.metadata import entry_points

    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from lmcache_ec_broker.connector import plugin

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "lmcache_ec_broker"]
    assert ep.value == "lmcache_ec_broker.connector.plugin:register"
    register = ep.load()
    assert register is plugin.register
    register()
    register()  # idempotent: vLLM loads plugins in every process, tests call it again
    config = VllmConfig(
        model_config=model_config,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_extra_config={"socket_path": broker.socket_path},
        ),
    )
    conn = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    try:
        assert type(conn) is ECBrokerConnector
    finally:
        conn.shutdown()


def test_plugin_import_does_not_import_torch():
    code = (
        "import sys; import lmcache_ec_broker.connector.plugin; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_file_model_is_fingerprinted(tmp_path):
    from lmcache_ec_broker.connector.model_id import fingerprint, model_id

    weights = tmp_path / "model.gguf"
    weights.write_bytes(bytes(range(256)) * 64)
    before = model_id(str(weights))
    assert before == f"{weights}#{fingerprint(str(weights))}"
    weights.write_bytes(bytes(range(255, -1, -1)) * 64)
    fingerprint.cache_clear()
    assert model_id(str(weights)) != before
