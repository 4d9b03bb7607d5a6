"""ECBrokerConnector against vLLM's real ECConnectorBase, real VllmConfig / Request
objects and a real broker process. No engine is started: the tests drive the
scheduler-side and worker-side hooks in the order vLLM calls them."""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Iterator

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


def make_config(model_config: ModelConfig, role: str, socket_path: str) -> VllmConfig:
    return VllmConfig(
        model_config=model_config,
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role=role,
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config={"socket_path": socket_path, "timeout_s": 2.0},
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

    def step(self, encoder_cache: dict, allocs: list[tuple[Request, int]]) -> None:
        """One engine step: has_cache_item per item, alloc, meta, worker load."""
        for request, index in allocs:
            self.sched.has_cache_item(request.mm_features[index].identifier)
            self.sched.update_state_after_alloc(request, index)
        meta = self.sched.build_connector_meta(scheduler_output=None)  # type: ignore[arg-type]
        meta = pickle.loads(pickle.dumps(meta))  # crosses a process boundary in vLLM
        self.worker.bind_connector_metadata(meta)
        if self.worker.is_consumer:
            self.worker.start_load_caches(encoder_cache)
        out = ECConnectorOutput(ec_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(out)


@pytest.fixture
def pairs(model_config: ModelConfig, broker) -> Iterator:
    made: list[Pair] = []

    def factory(role: str = "ec_both", socket_path: str | None = None) -> Pair:
        p = Pair(make_config(model_config, role, socket_path or broker.socket_path))
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
        assert conn.key("abc") == f"{model_config.model}@1@0@abc@bfloat16"
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
    t0 = time.monotonic()
    p.worker.save_caches({h: embedding(7)}, h)
    assert p.worker.puts_stored == 0
    assert not p.sched.has_cache_item(h)
    assert time.monotonic() - t0 < 5
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
