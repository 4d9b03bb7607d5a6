"""ECBrokerConnector against vLLM's real ECConnectorBase, real VllmConfig / Request
objects and a real broker process. No engine is started: the tests drive the
scheduler-side and worker-side hooks in the order vLLM calls them."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
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
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_ec_broker import BrokerClient  # noqa: E402
from lmcache_ec_broker.connector.vllm import (  # noqa: E402
    ECBrokerConnector,
    ECBrokerConnectorMetadata,
    make_key,
)
from lmcache_ec_broker.connector.vllm.weights_identity import EngineWatch  # noqa: E402
from lmcache_ec_broker.protocol import LookupState  # noqa: E402
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from delay_proxy import DelayProxy  # noqa: E402
from redis_servers import REDIS_SERVER, RedisServer  # noqa: E402

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
            ec_connector_extra_config={"socket_path": socket_path, **extra},
        ),
    )


class Pair:
    """The scheduler-side and worker-side connectors of one vLLM instance."""

    def __init__(self, config: VllmConfig) -> None:
        self.sched = ECBrokerConnector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECBrokerConnector(config, ECConnectorRole.WORKER)
        self.sched.wait_for_link(30)

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()

    def staged_first(self, request: Request, computed: int = 0) -> bool:
        """ensure_cache_available as vLLM's loop calls it, step after step, while the
        request is held only for a staging: True once it may be scheduled."""
        for _ in range(100):
            if self.sched.ensure_cache_available(request, computed):
                return True
            book = self.sched.connector_scheduler.book
            if book is None or not book.staging():
                return False  # held for something else (a promotion): a later step
            self.sched.wait_for_staging(30)
        return False

    def step(
        self,
        encoder_cache: dict,
        allocs: list[tuple[Request, int]],
        encode: dict[str, torch.Tensor] | None = None,
    ) -> set[str]:
        """One engine step in vLLM 0.32's order: ensure_cache_available per request
        (False: deferred to a later step), has_cache_item per item, alloc, meta,
        worker load, the runner's encoder, worker output back to the scheduler.
        ``encode``: mm_hash -> what the encoder computes for it. Returns the deferred ids."""
        deferred: set[str] = set()
        so = SchedulerOutput.make_empty()
        for request, index in allocs:
            if request.request_id in deferred or not self.staged_first(request):
                deferred.add(request.request_id)
                continue
            if not self.sched.has_cache_item(request.mm_features[index].identifier):
                so.scheduled_encoder_inputs.setdefault(request.request_id, []).append(index)
            self.sched.update_state_after_alloc(request, index)
        self.last = run_worker_step(self.sched, self.worker, so, encoder_cache, allocs, encode)
        return deferred


def ship(sched: ECBrokerConnector, so: SchedulerOutput) -> SchedulerOutput:
    """build_connector_meta, then the SchedulerOutput with its metadata pickled as one
    message, as vLLM's executor sends it to each worker."""
    so.ec_connector_metadata = sched.build_connector_meta(so)
    return pickle.loads(pickle.dumps(so))


def run_worker_step(
    sched: ECBrokerConnector,
    worker: ECBrokerConnector,
    so: SchedulerOutput,
    encoder_cache: dict,
    allocs: list[tuple[Request, int]],
    encode: dict[str, torch.Tensor] | None = None,
) -> SchedulerOutput:
    """The worker's half of a step, in the v1 model runner's order: bind, load, then
    the runner encodes the step's scheduled_encoder_inputs (simulated: no encoder
    here, ``encode`` gives its outputs) and save_caches each; the worker's output goes
    back to the scheduler. Returns the worker's copy of the SchedulerOutput."""
    shipped = ship(sched, so)
    worker.bind_connector_metadata(shipped.ec_connector_metadata)
    if worker.is_consumer:
        worker.start_load_caches(encoder_cache)
    requests = {r.request_id: r for r, _ in allocs}
    for req_id, indices in shipped.scheduled_encoder_inputs.items():
        for index in indices:
            mm_hash = requests[req_id].mm_features[index].identifier
            if encode is not None and mm_hash in encode:
                encoder_cache[mm_hash] = encode[mm_hash]
                worker.save_caches(encoder_cache, mm_hash)
    out = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    sched.update_connector_output(pickle.loads(pickle.dumps(out)))
    return shipped


@pytest.fixture
def pairs(model_config: ModelConfig, broker) -> Iterator:
    made: list[Pair] = []

    def factory(
        role: str = "ec_both",
        socket_path: str | None = None,
        model: ModelConfig | None = None,
        **extra: object,
    ) -> Pair:
        # Budgets of 30 s unless a test is about them: the defaults (scheduler 50 ms,
        # worker 200 ms) are waits that a broker starved of CPU on a loaded CI host can
        # overrun, which opens the circuit and turns the hits these tests expect into
        # misses. The tests of the budgets below set theirs.
        extra.setdefault("scheduler_budget_ms", 30_000)
        extra.setdefault("worker_budget_ms", 30_000)
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
    meta = p.sched.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, ECBrokerConnectorMetadata) and meta.loads == []
    assert p.sched.ec_misses == 1


def test_scheduler_decision_is_kept_within_a_step(pairs, broker):
    """has_cache_item said True: the load is queued even if the entry changes
    before update_state_after_alloc, because vLLM already counted it as a load."""
    p = pairs()
    h = "c" * 64
    p.worker.save_caches({h: embedding(2)}, h)
    assert p.staged_first(make_request("r", h)) and p.sched.has_cache_item(h)
    with BrokerClient(broker.socket_path) as c:
        assert c.delete(p.sched.key(h))
    p.sched.update_state_after_alloc(make_request("r", h), 0)
    meta = p.sched.build_connector_meta(SchedulerOutput.make_empty())
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
    # An (encoder-only) producer does not encode what the fleet holds, nor load it
    # (issue 32; tests/test_epd_connector.py); it takes no lease for it.
    assert producer.sched.has_cache_item(h)
    assert not producer.sched.connector_scheduler._step_leased
    assert consumer.staged_first(make_request("r", h)) and consumer.sched.has_cache_item(h)


def test_tp_ranks_store_once(pairs, broker):
    ranks = [pairs() for _ in range(3)]
    h = "e" * 64
    tensor = embedding(4)
    for r in ranks:
        r.worker.save_caches({h: tensor}, h)
    assert sum(r.worker.puts_stored for r in ranks) == 1
    with BrokerClient(broker.socket_path) as c:
        assert c.stats()["entries"] == 1


def test_entry_vanished_after_staging_still_loads(pairs, broker):
    """Issue 41: the entry disappears between the staging and the step that loads it:
    the worker moves the tensor it staged; nothing is encoded, nothing of the step is
    edited, nothing failed. (Before: the worker fetched in the step, the load failed
    and the worker added the item to the runner's scheduled_encoder_inputs.)"""
    p = pairs()
    h = "f" * 64
    tensor = embedding(5)
    p.worker.save_caches({h: tensor}, h)
    request = make_request("doomed", h)
    assert p.staged_first(request)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    with BrokerClient(broker.socket_path) as c:
        assert c.delete(p.sched.key(h))
    so = SchedulerOutput.make_empty()
    so.scheduled_encoder_inputs["bystander"] = [2]  # another request's encode this step
    shipped = ship(p.sched, so)
    cache: dict[str, torch.Tensor] = {}
    p.worker.bind_connector_metadata(shipped.ec_connector_metadata)
    p.worker.start_load_caches(cache)
    assert torch.equal(cache[h], tensor)
    assert shipped.scheduled_encoder_inputs == {"bystander": [2]}  # untouched
    assert p.worker.load_failures == 0 and p.worker.loads == 1
    p.sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
    )
    p.worker.clear_connector_metadata()
    assert p.sched.take_unavailable_requests() == set()
    assert broker_stats(broker.socket_path, p)["pins"] == 0
    assert p.worker.connector_worker.link.held() == set()  # the order ended with the load

    # The entry is gone: the next request with the item (another instance) encodes it.
    other = pairs()
    cache2: dict[str, torch.Tensor] = {}
    other.step(cache2, [(make_request("again", h), 0)], {h: tensor})
    assert torch.equal(cache2[h], tensor) and other.worker.loads == 0
    assert other.sched.ec_misses == 1


def test_requests_that_consumed_the_item_are_never_touched(pairs, broker):
    """A request decoding after using item X, and a new one loading X whose load
    fails: nothing is failed or deferred, then or later (before: every running
    request with X was failed)."""
    p = pairs()
    h = "9" * 64
    tensor = embedding(6)
    p.worker.save_caches({h: tensor}, h)
    decoding = make_request("decoding", h)
    past_prompt = len(decoding.prompt_token_ids)
    newcomer = make_request("new", h)
    assert p.staged_first(newcomer)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(newcomer, 0)
    with BrokerClient(broker.socket_path) as c:
        c.delete(p.sched.key(h))
    cache: dict[str, torch.Tensor] = {}
    so = SchedulerOutput.make_empty()
    run_worker_step(p.sched, p.worker, so, cache, [(newcomer, 0)], {h: tensor})
    assert torch.equal(cache[h], tensor)
    for _ in range(3):
        assert p.sched.ensure_cache_available(decoding, past_prompt)
        assert p.sched.ensure_cache_available(newcomer, 0)
        p.step(cache, [])
    assert p.sched.take_unavailable_requests() == set()


def test_deepstack_width_on_a_consumer(pairs, broker):
    """A consumer never measures the encoder's output width (vLLM measures it on
    producers only), and DeepStack models (Qwen3-VL) output wider rows than the
    text hidden size. A stored entry of such width loads; a failed load inserts
    nothing of any width (before: zeros of the text hidden size, which the
    model's DeepStack split rejects, killing the engine) and is encoded instead."""
    producer, consumer = pairs("ec_producer"), pairs("ec_consumer")
    assert consumer.sched.connector_scheduler._widths == {}
    wide = torch.randn(NUM_EMBEDS, HIDDEN * 4).to(torch.bfloat16)  # 3 DeepStack levels
    h, gone = "d5" * 32, "d6" * 32
    producer.worker.save_caches({h: wide, gone: wide}, h)
    producer.worker.save_caches({h: wide, gone: wide}, gone)
    cache: dict[str, torch.Tensor] = {}
    consumer.step(cache, [(make_request("r", h), 0)])
    assert torch.equal(cache[h], wide)

    request = make_request("r2", gone)
    assert consumer.staged_first(request)
    assert consumer.sched.has_cache_item(gone)
    consumer.sched.update_state_after_alloc(request, 0)
    with BrokerClient(broker.socket_path) as c:
        c.delete(consumer.sched.key(gone))
    shipped = run_worker_step(
        consumer.sched,
        consumer.worker,
        SchedulerOutput.make_empty(),
        cache,
        [(request, 0)],
        {gone: wide},
    )
    assert shipped.scheduled_encoder_inputs == {}  # staged before it vanished: loaded
    assert torch.equal(cache[gone], wide)  # the stored output, never a placeholder
    assert consumer.worker.puts_stored == 0  # a consumer does not put


def test_async_scheduling_step_built_before_the_failed_one_ran(pairs, broker):
    """--async-scheduling: step N+1 is scheduled before step N's worker output comes
    back. N's load of X fails and is encoded in N; N+1's request with X finds X in
    vLLM's encoder cache (no lookup, no lease, no load) and reads the encoder's
    output; nothing is failed. (Before: N+1 ran on N's zero placeholder.)"""
    p = pairs()
    x = "a5" * 32
    tensor = embedding(30)
    p.worker.save_caches({x: tensor}, x)
    r1, r2 = make_request("r1", x), make_request("r2", x)
    assert p.staged_first(r1) and p.sched.has_cache_item(x)
    p.sched.update_state_after_alloc(r1, 0)
    so_n = ship(p.sched, SchedulerOutput.make_empty())
    with BrokerClient(broker.socket_path) as c:
        lookups = lookups_of(c.stats())
        c.delete(p.sched.key(x))
    # Step N+1, scheduled now: vLLM's encoder cache holds X (allocated in N).
    assert p.sched.ensure_cache_available(r2, 0)
    so_n1 = ship(p.sched, SchedulerOutput.make_empty())
    assert so_n1.ec_connector_metadata.loads == []
    with BrokerClient(broker.socket_path) as c:
        assert lookups_of(c.stats()) == lookups, "an item vLLM holds was looked up"
    cache: dict[str, torch.Tensor] = {}
    outs = []
    for so in (so_n, so_n1):
        p.worker.bind_connector_metadata(so.ec_connector_metadata)
        p.worker.start_load_caches(cache)
        for req_id, indices in so.scheduled_encoder_inputs.items():
            assert (req_id, indices) == ("r1", [0])
            cache[x] = tensor  # the runner encodes it
        assert torch.equal(cache[x], tensor)
        outs.append(
            ECConnectorOutput(ec_connector_worker_meta=p.worker.build_connector_worker_meta())
        )
        p.worker.clear_connector_metadata()
    for out in outs:
        p.sched.update_connector_output(out)
    assert p.sched.take_unavailable_requests() == set()
    assert broker_stats(broker.socket_path, p)["pins"] == 0


def test_items_vllm_holds_are_not_looked_up_until_freed(pairs, broker):
    p = pairs()
    x = "b7" * 32
    p.worker.save_caches({x: embedding(31)}, x)
    cache: dict[str, torch.Tensor] = {}
    p.step(cache, [(make_request("r1", x), 0)])
    assert p.worker.loads == 1
    lookups = lookups_of(broker_stats(broker.socket_path, p))
    for i in range(3):  # later requests (or chunks) with X: vLLM has it
        assert p.sched.ensure_cache_available(make_request(f"r{i + 2}", x), 0)
        p.sched.build_connector_meta(SchedulerOutput.make_empty())
    s = broker_stats(broker.socket_path, p)
    assert lookups_of(s) == lookups and s["pins"] == 0
    freed = SchedulerOutput.make_empty()
    freed.free_encoder_mm_hashes = [x]  # vLLM evicted X from its encoder cache
    p.sched.build_connector_meta(freed)
    assert p.staged_first(make_request("r9", x))
    assert lookups_of(broker_stats(broker.socket_path, p)) == lookups + 1


def test_a_stale_mirror_after_reset_encoder_cache_still_loads(pairs, broker):
    """vLLM's reset_encoder_cache tells the connector nothing: the first has_cache_item
    for an item the mirror calls held shows it is stale; the item is looked up and
    staged while the scheduler waits (bounded), then loaded (not encoded), and the
    mirror starts over."""
    p = pairs()
    x = "c8" * 32
    tensor = embedding(32)
    p.worker.save_caches({x: tensor}, x)
    p.step({}, [(make_request("r1", x), 0)])
    cache: dict[str, torch.Tensor] = {}  # the worker's cache after the reset
    p.step(cache, [(make_request("r2", x), 0)])
    assert torch.equal(cache[x], tensor) and p.worker.loads == 2


def test_reset_encoder_cache_through_the_engine_stages_like_any_hit(pairs, broker):
    """EngineCore.reset_encoder_cache (wrapped: weights_identity.EngineWatch) empties
    the mirror: the next request's item is ordered in ensure_cache_available and the
    request held while it stages, as any hit -- has_cache_item never waits."""
    p = pairs()
    x = "c7" * 32
    tensor = embedding(34)
    p.worker.save_caches({x: tensor}, x)
    p.step({}, [(make_request("r1", x), 0)])
    sched = p.sched.connector_scheduler
    watch = EngineWatch("m", lambda field: None, on_encoder_cache_reset=sched.encoder_cache_reset)
    watch.after_call(object(), "reset_encoder_cache")  # an engine without an executor
    request = make_request("r2", x)
    assert not p.sched.ensure_cache_available(request, 0), "not held while staging"
    assert sched.book is not None and sched.book.staging() == {x}
    cache: dict[str, torch.Tensor] = {}
    p.step(cache, [(request, 0)])
    assert torch.equal(cache[x], tensor) and p.worker.loads == 2


def test_a_stale_mirror_staging_vllm_does_not_allocate_is_released(pairs, broker):
    """has_cache_item stages an item the stale mirror hid (above), answers True, and
    vLLM then does not allocate it (no budget): the order ends with the step, so the
    workers do not hold its tensor until the next reset."""
    p = pairs()
    x = "c9" * 32
    p.worker.save_caches({x: embedding(33)}, x)
    p.step({}, [(make_request("r1", x), 0)])  # the mirror now says vLLM holds x
    request = make_request("r2", x)
    assert p.sched.ensure_cache_available(request, 0)
    assert p.sched.has_cache_item(x)  # stale mirror: staged while the scheduler waited
    assert p.sched.stage_orders == 1
    p.sched.build_connector_meta(SchedulerOutput.make_empty())  # not allocated
    assert p.sched.stage_orders == 0


def test_items_beyond_the_steps_reach_are_not_looked_up(pairs, broker, model_config):
    """A chunked prefill: the second image starts past max_num_batched_tokens from
    the computed tokens; it is looked up in the step that can reach it, once."""
    p = pairs()
    near, far = "e1" * 32, "e2" * 32
    for i, h in enumerate((near, far)):
        p.worker.save_caches({h: embedding(40 + i)}, h)
    reach = p.sched.connector_scheduler._settings.reach
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=h,
            mm_position=PlaceholderRange(offset=off, length=NUM_EMBEDS),
        )
        for h, off in ((near, 3), (far, reach + 10))
    ]
    request = Request(
        request_id="long",
        prompt_token_ids=[7] * (reach + 40),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )
    before = lookups_of(broker_stats(broker.socket_path, p))
    assert p.staged_first(request)
    assert p.sched.connector_scheduler._step_state.keys() == {near}
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    assert p.staged_first(request, reach)
    assert p.sched.connector_scheduler._step_state.keys() == {far}
    assert lookups_of(broker_stats(broker.socket_path, p)) == before + 2


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
    assert p.staged_first(make_request("r0", h)) and p.sched.has_cache_item(h)
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    first.stop()

    # broker away: a miss, no exception
    assert p.sched.ensure_cache_available(make_request("r1", h2), 0)
    assert not p.sched.has_cache_item(h2)
    assert any("not reachable" in line for line in connector_log.lines)
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    make_broker("--shm-size", "64MiB", socket_path=path)
    deadline = time.monotonic() + 30  # a reconnect, on a loaded host
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
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    p.worker.save_caches({h: embedding(10)}, h)
    assert p.staged_first(make_request("r", h)) and p.sched.has_cache_item(h)
    assert p.sched.stats()["ec_hits"] == 1 and p.sched.stats()["ec_misses"] == 1

    interval = p.sched.get_ec_connector_stats()
    assert interval.reduce() == {"ec_hits": 1, "ec_misses": 1}
    assert p.sched.get_ec_connector_stats() is None  # deltas: nothing new since

    # The worker's counters travel in its metadata to the scheduler's connector, which
    # reports them (the V1 runner never asks a worker; tests/test_vllm_worker_stats.py).
    from vllm.v1.outputs import ECConnectorOutput

    assert p.worker.get_ec_connector_stats() is None
    meta = p.worker.build_connector_worker_meta()
    p.sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=meta))
    # vLLM's own stats logger rebuilds, sums and prints them.
    logging_ = ECConnectorLogging(p.sched._vllm_config.ec_transfer_config)
    logging_.observe(interval.data)
    logging_.observe(p.sched.get_ec_connector_stats().data)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["EC Transfer metrics: ec_hits=1, ec_misses=1, staged=1, puts_stored=1"]


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
    deadline = time.monotonic() + 30  # a reconnect, on a loaded host
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
            for client in (conn._clients.live(), conn._stage_clients.live()):
                if client is not None:
                    assert client.ping()
    with BrokerClient(socket_path) as c:
        return c.stats()


def lookups_of(stats: dict) -> int:
    """Keys the broker was asked about by has/lookup."""
    return stats["has_hits"] + stats["has_misses"]


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


def test_a_staging_copy_does_not_hold_up_the_steps_put(pairs, broker, monkeypatch):
    """The staging thread copies an entry out of the slab through a client of its own
    (process_clients.py): a put in the step goes ahead while that copy runs. Before,
    both shared one client, whose lock is held through a copy, so the step's put (and
    the engine's step) waited for the whole staging copy."""
    from lmcache_ec_broker.connector.client.copy import SlabView

    a, b = pairs(), pairs()
    h, y = "c1" * 32, "c2" * 32
    a.worker.save_caches({h: embedding(3)}, h)
    copying, release = threading.Event(), threading.Event()
    read = SlabView.read

    def held_read(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            copying.set()  # the staging thread is in its copy out of the slab
            release.wait(30)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(SlabView, "read", held_read)
    request = make_request("req-held-copy", h)
    assert not b.sched.ensure_cache_available(request, 0)  # held: staging ordered
    assert copying.wait(30)
    put_done = threading.Event()

    def step_put() -> None:
        b.worker.save_caches({y: embedding(4)}, y)
        put_done.set()

    putter = threading.Thread(target=step_put)
    putter.start()
    try:
        assert put_done.wait(10), "the step's put waited for the staging thread's copy"
    finally:
        release.set()
        putter.join(30)
    assert b.worker.puts_stored == 1
    cache: dict[str, torch.Tensor] = {}
    b.step(cache, [(request, 0)])
    assert b.worker.loads == 1 and torch.equal(cache[h], embedding(3))
    with BrokerClient(broker.socket_path) as c:
        assert c.has([b.sched.key(y)]) == [True]


def test_the_staging_client_is_connected_and_mapped_before_the_link_is_up(pairs):
    """The staging thread connects its client and maps the slab before it links to
    the scheduler: the first staged hit does not pay them inside stage_wait_ms (a
    multi-GiB slab's mapping alone can take longer than the 700 ms default)."""
    p = pairs()  # returns once every encoder rank linked
    client = p.worker._stage_clients.live()
    assert client is not None and client.connected
    maps = client.mappings
    assert maps is not None and maps.slab is not None


def test_a_staged_hit_ends_its_lease_and_is_released_with_its_request(pairs, broker):
    """The lookup's lease protects the entry until the workers staged it, no longer;
    a request that ends before it loads (aborted, or never scheduled) releases the
    tensor its worker staged for it."""
    p = pairs()
    h = "ab" * 32
    p.worker.save_caches({h: embedding(20)}, h)
    request = make_request("r", h)
    assert p.staged_first(request)
    assert p.sched.has_cache_item(h)
    assert broker_stats(broker.socket_path, p)["pins"] == 0
    link = p.worker.connector_worker.link
    assert link.held() == {h}
    p.sched.build_connector_meta(SchedulerOutput.make_empty())  # not scheduled after all
    assert link.held() == {h}  # still wanted: the request waits
    p.sched.request_finished(request)
    deadline = time.monotonic() + 30
    while link.held():
        assert time.monotonic() < deadline, "the staged tensor was never released"
        time.sleep(0.01)
    assert not p.sched.has_cache_item(h)  # a new order is needed for a new promise


def test_staged_embeddings_stay_within_the_staging_budget(pairs, broker):
    """vLLM's waiting loop skips a held request and looks at the next, so one step can
    meet every waiting request's hits. What is staged on a rank's device at once stays
    within ``stage_max_embeds`` (stage_book.py, invariant 4): a request whose hit finds
    no room waits (held, not encoded) and its hit is staged in a later step, once loads
    have made room."""
    p = pairs(stage_max_embeds=2 * NUM_EMBEDS)
    hashes = [f"{i:02x}" * 32 for i in range(5)]
    tensors = {h: embedding(40 + i) for i, h in enumerate(hashes)}
    for h, tensor in tensors.items():
        p.worker.save_caches({h: tensor}, h)
    requests = [make_request(f"r{i}", h) for i, h in enumerate(hashes)]
    link = p.worker.connector_worker.link
    book = p.sched.connector_scheduler.book

    # Step 1: every request asked in turn, as the waiting loop does.
    held = [not p.sched.ensure_cache_available(r, 0) for r in requests]
    assert held == [True] * 5  # two staging, three waiting for room
    p.sched.wait_for_staging(30)
    assert link.held() == set(hashes[:2]) and book.open_embeds == 2 * NUM_EMBEDS
    assert [p.sched.has_cache_item(h) for h in hashes] == [True, True, False, False, False]
    assert p.sched.stage_over_budget == 3
    p.sched.build_connector_meta(SchedulerOutput.make_empty())  # nothing scheduled

    # A step without room: the three are held again without a lookup each (in a burst,
    # a lookup per waiting request in every step).
    sched = p.sched.connector_scheduler
    lookups: list[list[str]] = []
    real_lookup = sched._lookup

    def counted_lookup(hashes: list[str], *args: object, **kw: object) -> None:
        lookups.append(hashes)
        real_lookup(hashes, *args, **kw)

    sched._lookup = counted_lookup
    assert not any(p.sched.ensure_cache_available(r, 0) for r in requests[2:])
    assert lookups == []
    p.sched.build_connector_meta(SchedulerOutput.make_empty())

    # Step 2: the two staged ones are scheduled and loaded; the rest still wait.
    cache: dict[str, torch.Tensor] = {}
    so = SchedulerOutput.make_empty()
    for r in requests[:2]:
        assert p.sched.ensure_cache_available(r, 0)
        assert p.sched.has_cache_item(r.mm_features[0].identifier)
        p.sched.update_state_after_alloc(r, 0)
    run_worker_step(p.sched, p.worker, so, cache, [(r, 0) for r in requests[:2]])
    assert set(cache) == set(hashes[:2]) and book.open_embeds == 0
    assert all(torch.equal(cache[h], tensors[h]) for h in hashes[:2])

    # Step 3: room again -- the next two are looked up and staged; the last one finds
    # none again and waits, still without a lookup.
    held = [not p.sched.ensure_cache_available(r, 0) for r in requests[2:]]
    assert held == [True, True, True]
    assert lookups == [[h] for h in hashes[2:4]]
    p.sched.wait_for_staging(30)
    assert link.held() == set(hashes[2:4])
    assert not any(p.sched.has_cache_item(h) for h in hashes[4:])
    # The last one was held back in steps 1 and 3 (not ordered, not encoded between):
    # one time, counted once; each item held back counted once in all.
    assert p.sched.stage_over_budget == 3


def test_an_item_held_back_counts_once_per_time(pairs, broker):
    """A request whose hit finds no room in ``stage_max_embeds`` waits for it at most
    ``stage_wait_ms`` in all, then its hit is encoded. ``stage_over_budget`` counts an
    item once per time it is held back for lack of room, not once per step: asked
    again while held back it does not count; once vLLM encoded it instead
    (update_state_after_alloc) that time is over, and held back again after vLLM freed
    it, it counts again."""
    wait_s = 3.0
    p = pairs(stage_max_embeds=NUM_EMBEDS, stage_wait_ms=int(wait_s * 1000))
    a, b = "f1" * 32, "f2" * 32
    for i, h in enumerate((a, b)):
        p.worker.save_caches({h: embedding(60 + i)}, h)
    ra, rb = make_request("ra", a), make_request("rb", b)
    assert not p.sched.ensure_cache_available(ra, 0)  # a is ordered, fills the budget
    p.sched.wait_for_staging(30)
    first = time.monotonic()
    for _ in range(3):  # three steps in which b does not fit: one time held back
        assert not p.sched.ensure_cache_available(rb, 0)  # waits for room
        assert not p.sched.has_cache_item(b)
        assert p.sched.stage_over_budget == 1
        p.sched.build_connector_meta(SchedulerOutput.make_empty())
    assert time.monotonic() - first < wait_s, "the host was too slow for this test's bound"
    time.sleep(wait_s - (time.monotonic() - first) + 0.05)  # a never ships: no room came
    assert p.sched.ensure_cache_available(rb, 0) and not p.sched.has_cache_item(b)
    p.sched.update_state_after_alloc(rb, 0)  # vLLM encodes b instead: that time ends
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    freed = SchedulerOutput.make_empty()
    freed.free_encoder_mm_hashes = [b]  # vLLM evicted b (rb still runs)
    p.sched.build_connector_meta(freed)
    assert not p.sched.ensure_cache_available(make_request("rb2", b), 0)  # a new time
    assert p.sched.stage_over_budget == 2


def test_a_request_whose_own_orders_fill_the_budget_is_not_held_for_room(pairs, broker):
    """Room comes only from other requests' orders: a request of two hits that do not
    fit together is not held for room (its own staged hit would be loaded only once
    it is scheduled). Its first hit is staged and loaded, the second encoded, in the
    next step -- not after ``stage_wait_ms``."""
    p = pairs(stage_max_embeds=NUM_EMBEDS + NUM_EMBEDS // 2, stage_wait_ms=30_000)
    a, b = "d1" * 32, "d2" * 32
    for i, h in enumerate((a, b)):
        p.worker.save_caches({h: embedding(70 + i)}, h)
    first = make_request("r", a)
    second = make_request("r", b).mm_features[0]
    second.mm_position = PlaceholderRange(offset=6 + NUM_EMBEDS, length=NUM_EMBEDS)
    r = Request(
        request_id="r",
        prompt_token_ids=[1, 2, 3] + [5] * NUM_EMBEDS + [4, 9, 1] + [5] * NUM_EMBEDS + [4],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=[first.mm_features[0], second],
    )
    assert not p.sched.ensure_cache_available(r, 0)  # a is staging
    p.sched.wait_for_staging(30)
    started = time.monotonic()
    assert p.sched.ensure_cache_available(r, 0)  # a staged; b cannot fit beside it
    assert time.monotonic() - started < 5
    assert p.sched.has_cache_item(a) and not p.sched.has_cache_item(b)
    assert p.sched.stage_over_budget == 1


def test_an_item_larger_than_the_staging_budget_is_staged_alone(pairs, broker):
    """An item larger than ``stage_max_embeds`` is still staged when nothing else is
    (never starved); a second item's request waits for room."""
    p = pairs(stage_max_embeds=NUM_EMBEDS // 2)
    a, b = "e1" * 32, "e2" * 32
    for i, h in enumerate((a, b)):
        p.worker.save_caches({h: embedding(50 + i)}, h)
    assert not p.sched.ensure_cache_available(make_request("ra", a), 0)
    assert not p.sched.ensure_cache_available(make_request("rb", b), 0)  # waits for room
    p.sched.wait_for_staging(30)
    assert p.sched.has_cache_item(a) and not p.sched.has_cache_item(b)
    assert p.worker.connector_worker.link.held() == {a}


def test_the_default_staging_budget_is_the_encoder_cache_vllm_sizes(model_config, broker):
    """By default ``stage_max_embeds`` is the size vLLM's scheduler gives its encoder
    cache: ``max(encoder_cache_size, the largest item's embeddings)``, not the
    configuration's ``encoder_cache_size`` -- here 64 (a small
    ``max_num_batched_tokens``), below the tiny model's largest item (a video). The
    explicit key still wins, even below that."""
    from vllm.config import SchedulerConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    def scheduler_side(**extra: object) -> ECBrokerConnector:
        config = make_config(model_config, "ec_both", broker.socket_path, **extra)
        config.scheduler_config = scheduler_config
        return ECBrokerConnector(config, ECConnectorRole.SCHEDULER)

    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=model_config.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )

    info = MULTIMODAL_REGISTRY.create_processor(model_config).info
    largest = max(
        info.get_mm_max_tokens_per_item(
            seq_len=model_config.max_model_len, mm_counts={"image": 1, "video": 1}
        ).values()
    )
    sched = scheduler_side()
    try:
        configured = scheduler_config.encoder_cache_size
        assert configured == 64 < largest  # one item larger than the configured size
        assert sched.connector_scheduler.book.max_embeds == largest
    finally:
        sched.shutdown()
    sched = scheduler_side(stage_max_embeds=40)
    try:
        assert sched.connector_scheduler.book.max_embeds == 40
    finally:
        sched.shutdown()


def test_the_default_staging_budget_falls_back_to_the_configured_size(caplog):
    """Where vLLM has no encoder cache (a text-only model) or its code cannot size one
    here, the default is the configuration's ``encoder_cache_size`` (with a warning in
    the second case): never an engine that fails to start for a default."""
    from types import SimpleNamespace

    from lmcache_ec_broker.connector.vllm.stage_book import vllm_encoder_cache_size

    sched = SimpleNamespace(encoder_cache_size=300, max_num_batched_tokens=512)
    text = SimpleNamespace(supports_multimodal_inputs=False)
    assert vllm_encoder_cache_size(SimpleNamespace(scheduler_config=sched, model_config=text)) == 300
    broken = SimpleNamespace(supports_multimodal_inputs=True)  # vLLM's budget fails on it
    with caplog.at_level(logging.WARNING, logger="vllm.lmcache_ec_broker.connector"):
        size = vllm_encoder_cache_size(SimpleNamespace(scheduler_config=sched, model_config=broken))
    assert size == 300
    assert "could not compute vLLM's encoder cache size" in caplog.text


def test_a_staging_budget_of_zero_is_refused_with_the_fix(model_config, broker):
    with pytest.raises(ValueError, match="stage_max_embeds must be > 0"):
        ECBrokerConnector(
            make_config(model_config, "ec_both", broker.socket_path, stage_max_embeds=0),
            ECConnectorRole.SCHEDULER,
        )


def test_an_order_sent_before_the_last_load_ran_keeps_both(pairs, broker):
    """Async scheduling: step 2 orders the item again (vLLM freed it in between)
    before step 1's load ran on the worker; each order holds its own count, so both
    steps' loads find the tensor (stage_book.py, invariant 1)."""
    p = pairs()
    h = "cd" * 32
    tensor = embedding(21)
    p.worker.save_caches({h: tensor}, h)
    metas = []
    for request in (make_request("r1", h), make_request("r2", h)):
        assert p.staged_first(request)
        assert p.sched.has_cache_item(h)
        p.sched.update_state_after_alloc(request, 0)
        freed = SchedulerOutput.make_empty()
        metas.append(p.sched.build_connector_meta(freed))
        p.sched.connector_scheduler._held.discard(h)  # vLLM freed it (free_encoder_mm_hashes of a later step)
    for meta in metas:
        cache: dict[str, torch.Tensor] = {}
        p.worker.bind_connector_metadata(meta)
        p.worker.start_load_caches(cache)
        p.worker.clear_connector_metadata()
        assert torch.equal(cache[h], tensor)
    assert p.worker.loads == 2 and p.worker.connector_worker.link.held() == set()
    assert broker_stats(broker.socket_path, p)["pins"] == 0


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
        p.sched.build_connector_meta(SchedulerOutput.make_empty())
        assert time.monotonic() < deadline, "never promoted"
        time.sleep(0.01)
    assert p.sched.has_cache_item(h)
    p.sched.update_state_after_alloc(request, 0)
    meta = p.sched.build_connector_meta(SchedulerOutput.make_empty())
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
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
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
def test_wrong_entry_is_a_miss_and_left_alone(pairs, broker, connector_log, what):
    """Issue 39: an entry of another dtype/shape under this instance's key is another
    configuration's output: a miss here (the request encodes the item), never
    loaded, never deleted (it was deleted from every tier before)."""
    p = pairs()
    # vLLM measures the encoder's output width on producers; the width check uses it.
    p.sched.connector_scheduler._widths = {"image": HIDDEN}
    h = f"e{what}".encode().hex().ljust(64, "0")
    key = p.sched.key(h)
    with BrokerClient(broker.socket_path) as c:
        assert c.put(key, WRONG[what])  # under the real key
    cache: dict[str, torch.Tensor] = {}
    assert p.step(cache, [(make_request("r", h), 0)]) == set()
    assert p.sched.invalid_skipped == 1 and p.sched.ec_misses == 1 and p.sched.ec_hits == 0
    assert cache == {}, "a wrong entry was loaded"
    assert any("is invalid for this model" in line for line in connector_log.lines)
    with BrokerClient(broker.socket_path) as c:
        assert c.has([key]) == [True], "another configuration's entry was deleted"
        got = c.get(key)
    assert got is not None and torch.equal(got, WRONG[what])


def test_wrong_entry_on_disk_is_left_on_every_tier(pairs, make_broker, sock_dir):
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
    assert p.sched.invalid_skipped == 1 and p.sched.ec_deferred == 0
    with BrokerClient(b2.socket_path) as c:
        assert c.stats()["disk_entries"] == 1, "deleted from the disk tier"


def test_wrong_entry_at_staging_is_encoded_instead_and_left_alone(pairs, broker):
    """The scheduler saw a good entry; by the worker's staging it was replaced by a
    wrong one: the staging fails, the item is encoded (never run on a wrong tensor, no
    request failed), and the entry is not the worker's to delete."""
    p = pairs()
    h = "e6" * 32
    good = embedding(41)
    p.worker.save_caches({h: good}, h)
    key = p.sched.key(h)
    worker = p.worker.connector_worker
    fetch = worker.fetch

    def replaced_then_fetch(keys: list[str], device: str):
        with BrokerClient(broker.socket_path) as c:
            assert c.delete(key)
            assert c.put(key, WRONG["rows"])
        return fetch(keys, device)

    worker.fetch = replaced_then_fetch
    cache: dict[str, torch.Tensor] = {}
    p.step(cache, [(make_request("r", h), 0)], {h: good})
    assert p.worker.load_failures == 1 and p.worker.invalid_skipped == 1
    assert p.sched.ec_misses == 1 and p.worker.loads == 0
    assert torch.equal(cache[h], good)  # the encoder's output
    assert p.sched.take_unavailable_requests() == set()
    with BrokerClient(broker.socket_path) as c:
        got = c.get(key)
    assert got is not None and torch.equal(got, WRONG["rows"]), "another's entry was touched"


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
    from lmcache_ec_broker.connector.vllm.model_id import fingerprint

    fingerprint.cache_clear()  # a new vLLM process computes it afresh
    new = pairs(model=mc)
    assert new.sched.model_id != old.sched.model_id
    assert new.sched.model_id.startswith(f"{mc.model}#")
    cache: dict[str, torch.Tensor] = {}
    assert new.step(cache, [(make_request("r2", h), 0)]) == set()
    assert new.sched.ec_misses == 1 and new.sched.ec_hits == 0 and cache == {}, "stale hit"


def test_encoder_config_change_changes_the_key(model_config, tmp_path):
    from lmcache_ec_broker.connector.vllm.model_id import fingerprint, model_id

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
    from lmcache_ec_broker.connector.vllm.model_id import fingerprint

    a = copy_model(model_config, tmp_path / "a")
    b = copy_model(model_config, tmp_path / "b")
    os.utime(Path(b.model) / "model.safetensors", (1, 1))
    assert fingerprint(a.model) == fingerprint(b.model) == fingerprint(model_config.model)
    assert fingerprint(a.model, "v2") != fingerprint(a.model)


def test_explicit_model_name(pairs, model_config, tmp_path):
    p = pairs(model_name="qwen2-vl-tiny:2026-11")
    # The name replaces the file-based part; the configuration's part follows (issue 39).
    assert re.fullmatch(r"qwen2-vl-tiny:2026-11\+c[0-9a-f]{16}@1@0@x@bfloat16", p.sched.key("x"))
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
    from lmcache_ec_broker.connector.vllm.model_id import fingerprint, model_id

    weights = tmp_path / "model.gguf"
    weights.write_bytes(bytes(range(256)) * 64)
    before = model_id(str(weights))
    assert before == f"{weights}#{fingerprint(str(weights))}"
    weights.write_bytes(bytes(range(255, -1, -1)) * 64)
    fingerprint.cache_clear()
    assert model_id(str(weights)) != before


# ------------------------------- a hung broker costs nothing (issue 21 item 3)


def test_hung_broker_costs_the_scheduler_one_budget_per_outage(pairs, make_broker):
    """The scheduler's hooks driven like an engine stepping with a new multimodal
    request per step, the broker SIGSTOPped: one scheduler_budget_ms wait, then
    misses in microseconds; after SIGCONT the probe finds it and hits come back.
    (Before: 10 s for the first call, then 5 s per call.)

    A budget of 3 s (the default is 50 ms): every later step must take under a third of
    it, so a step that waited for the broker again (a budget per call) fails, while a
    step answered at once passes even with this process starved of CPU on a loaded CI
    host (a 100 ms budget with a 20 ms bound on later steps could not tell the two
    apart there)."""
    budget = 3.0
    b = make_broker("--shm-size", "64MiB")
    p = pairs(
        socket_path=b.socket_path,
        scheduler_budget_ms=budget * 1000,
        worker_budget_ms=200,
        probe_interval_ms=100,
    )
    x = "f7" * 32
    p.worker.save_caches({x: embedding(50)}, x)
    assert p.sched.client.timeout_s == budget and p.worker.client.timeout_s == 0.2
    os.kill(b.pid, signal.SIGSTOP)
    try:
        waits, held_steps = [], []
        for i in range(40):
            r = make_request(f"r{i}", x)  # a hit, if the broker answered
            held = 0
            while True:
                t0 = time.perf_counter()
                scheduled = p.sched.ensure_cache_available(r, 0)
                if scheduled:
                    assert not p.sched.has_cache_item(x)
                    p.sched.update_state_after_alloc(r, 0)
                p.sched.build_connector_meta(SchedulerOutput.make_empty())
                waits.append(time.perf_counter() - t0)
                if scheduled:
                    break
                held += 1  # held at the outage's start (claims: reask.py invariant 3)
                time.sleep(0.002)
                assert held < 5000, "a request held without a bound by a hung broker"
            held_steps.append(held)
            p.sched.connector_scheduler._held.clear()  # a new item each step, as far as vLLM's cache goes
        # The first step waited its budget (a sleep can only run long), and not the
        # 10 s of before; later steps did not wait for the broker at all. Only the
        # request that met the outage's start was held (two probe intervals at most).
        assert 0.9 * budget < waits[0] < 3 * budget, waits[0]
        assert max(waits[1:]) < budget / 3, max(waits[1:])
        assert held_steps[0] > 0 and not any(held_steps[1:]), held_steps
        assert p.sched.broker_timeouts == 1
    finally:
        os.kill(b.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not (p.staged_first(make_request("again", x)) and p.sched.has_cache_item(x)):
        assert time.monotonic() < deadline, "the scheduler never used the broker again"
        p.sched.build_connector_meta(SchedulerOutput.make_empty())
        p.sched.connector_scheduler._held.clear()
        time.sleep(0.05)


def test_a_broker_of_another_protocol_version_costs_misses_never_the_engine(
    pairs, broker, monkeypatch
):
    """Installed a new release, restarted vLLM but not the broker: the handshake is
    refused with the fix named, and every hook answers a miss or skips -- none raises."""
    from lmcache_ec_broker.connector.client import broker_link
    from lmcache_ec_broker.connector.client.errors import BrokerRefused
    from lmcache_ec_broker.protocol import PROTOCOL_VERSION

    monkeypatch.setattr(broker_link, "PROTOCOL_VERSION", PROTOCOL_VERSION - 1)
    with pytest.raises(BrokerRefused, match="same lmcache-ec-broker version"):
        BrokerClient(broker.socket_path)
    p = pairs()
    x = "c3" * 32
    r = make_request("r", x)
    assert p.sched.ensure_cache_available(r, 0)
    assert not p.sched.has_cache_item(x)
    p.sched.update_state_after_alloc(r, 0)
    so = SchedulerOutput.make_empty()
    so.scheduled_encoder_inputs = {"r": [0]}
    shipped = run_worker_step(p.sched, p.worker, so, {}, [(r, 0)], encode={x: embedding(9)})
    assert shipped.scheduled_encoder_inputs == {"r": [0]}  # encoded, as without a broker


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_a_slow_remote_store_costs_the_scheduler_misses_not_its_circuit(
    pairs, make_broker, tmp_path
):
    """Every reply of the shared store to this node's broker 1 s late (on the wire): the
    scheduler's lookup of an item only the store holds is answered within its budget
    -- a miss, encoded -- and the circuit stays closed, so the next request's local hit
    is still a hit. (Before: the lookup waited for the store, the budget opened the
    circuit as for a hung broker, and local hits too became encodes until a probe.)

    Sized for a loaded CI host: a 6 s budget (the broker cuts the store short at half
    of it, 3 s) and a store 20 s late. A lookup that waited for the store would overrun
    the budget (a timeout, the circuit open); one cut short has 3 s of slack before the
    budget even if the broker is starved of CPU (with a 200 ms budget it had 100 ms)."""
    budget, late = 6.0, 20.0
    srv = RedisServer()
    try:
        with DelayProxy(srv.port) as proxy:

            def node(name: str, url: str):
                cfg = tmp_path / f"{name}.yaml"
                cfg.write_text(
                    # shutdown_flush_s: at teardown a lookup still waits for the late
                    # store; the broker would give it 20 s (the default) to finish.
                    f"remote_url: '{url}'\nremote_timeout_s: {3 * late}\n"
                    "shutdown_flush_s: 2.0\n"
                )
                return make_broker("--shm-size", "64MiB", "--config", str(cfg))

            other, here = node("other", srv.url("unix")), node("here", proxy.url(srv.password))
            p = pairs(
                socket_path=here.socket_path,
                scheduler_budget_ms=budget * 1000,
                probe_interval_ms=10_000,
            )
            near, far = "a1" * 32, "b2" * 32
            with BrokerClient(other.socket_path) as c:  # another node encoded "far"
                assert c.put(p.sched.key(far), embedding(71))
                deadline = time.monotonic() + 30
                while c.stats()["remote_writes"] < 1:
                    assert time.monotonic() < deadline, "the other node's write-behind"
                    time.sleep(0.02)
            p.worker.save_caches({near: embedding(72)}, near)  # in this node's slab
            with BrokerClient(here.socket_path) as c:
                assert c.has([p.sched.key(near)]) == [True]
                deadline = time.monotonic() + 30
                # this node heard of "far" (an announcement): its filter lets it be asked
                while c.stats()["remote_known_keys"] < 2:
                    assert time.monotonic() < deadline, "this node never learned of far"
                    time.sleep(0.02)
            proxy.reply_delay_s = late
            waits = []
            for i, h in enumerate((far, near, far)):
                r = make_request(f"r{i}", h)
                t0 = time.perf_counter()
                assert p.staged_first(r)
                hit = p.sched.has_cache_item(h)
                waits.append(time.perf_counter() - t0)
                assert hit == (h == near), (i, h, hit)
                p.sched.update_state_after_alloc(r, 0)
                p.sched.build_connector_meta(SchedulerOutput.make_empty())
            assert p.sched.broker_timeouts == 0
            assert max(waits) < budget, waits  # (and far below the store's 20 s)
            with BrokerClient(here.socket_path) as c:
                st = c.stats()
                # (the second lookup of far may join the first, still running: >= 1)
                assert st["remote_lookups_cut_short"] >= 1, str({k: v for k, v in st.items() if v})
    finally:
        srv.stop()


def test_hung_broker_skips_the_workers_puts_and_loads(pairs, make_broker):
    """Worker side: the first put waits worker_budget_ms, later puts are skipped at
    once and counted; the staging thread's client waits once too, then a staging fails
    at once (the item is encoded); all published after.
    Without put arenas: a put into its arena waits for nothing, hung broker or not
    (tests/test_put_arena.py), so here the first wait would be the load's.

    A budget of 3 s (the default is 200 ms): a later put or load that waited for the
    broker again would take 3 s, one skipped at once takes microseconds; the bound,
    a third of the budget, tells them apart even on a loaded CI host (a 150 ms budget
    with 20 ms and 50 ms bounds could not)."""
    budget = 3.0
    b = make_broker("--shm-size", "64MiB", "--put-arena-size", "0")
    p = pairs(socket_path=b.socket_path, worker_budget_ms=budget * 1000, probe_interval_ms=100)
    p.worker.save_caches({"0" * 64: embedding(51)}, "0" * 64)  # connected, mapped
    cache = {f"{i + 1:064x}": embedding(60 + i) for i in range(5)}
    os.kill(b.pid, signal.SIGSTOP)
    try:
        waits = []
        for h in cache:
            t0 = time.perf_counter()
            p.worker.save_caches(cache, h)
            waits.append(time.perf_counter() - t0)
        assert 0.9 * budget < waits[0] < 3 * budget and max(waits[1:]) < budget / 3, waits
        assert p.worker.puts_skipped == 5 and p.worker.broker_timeouts == 1
        # The staging thread reads through a client of its own (process_clients.py):
        # its first read pays that client's one wait of the outage, off the step's
        # thread; the next staging fails at once.
        waits = []
        for n, h in enumerate(("0" * 64, "0" * 63 + "1")):
            r = make_request(f"r{n}", h)
            p.sched.connector_scheduler._step_state[h] = LookupState.READY  # seen before the hang
            t0 = time.perf_counter()
            assert p.staged_first(r)  # ordered; the staging fails: encoded
            waits.append(time.perf_counter() - t0)
            assert not p.sched.has_cache_item(h) and p.worker.load_failures == n + 1
        assert waits[0] < 3 * budget and waits[1] < budget / 3, waits
        assert p.worker.broker_timeouts == 2
    finally:
        os.kill(b.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while p.worker.puts_stored < 6:
        assert time.monotonic() < deadline, "outputs encoded during the hang never published"
        p.worker.start_save_caches(encoder_cache=cache)
        time.sleep(0.05)


def test_timeout_s_is_refused_with_the_fix(model_config, broker):
    config = make_config(model_config, "ec_both", broker.socket_path, timeout_s=5.0)
    with pytest.raises(ValueError, match="scheduler_budget_ms"):
        ECBrokerConnector(config, ECConnectorRole.SCHEDULER)
    config = make_config(model_config, "ec_both", broker.socket_path, worker_budget_ms=0)
    with pytest.raises(ValueError, match="worker_budget_ms"):
        ECBrokerConnector(config, ECConnectorRole.WORKER)


def test_an_empty_step_waits_for_the_stage_report_of_a_held_request(pairs, broker, monkeypatch):
    """While a request is held for staging, vLLM's engine steps again at once with
    nothing scheduled; each such step waits in build_connector_meta for the workers'
    report (at most IDLE_STEP_WAIT_S), so the hold is not thousands of empty steps a
    second that starve the broker on a loaded host. The report ends the wait at once;
    a step that schedules tokens never waits."""
    from lmcache_ec_broker.connector.vllm import scheduler as scheduler_module

    p = pairs()
    x = "d3" * 32
    p.worker.save_caches({x: embedding(36)}, x)
    link = p.worker.connector_worker.link
    gate = threading.Event()
    fetch = link._fetch
    link._fetch = lambda items: (gate.wait(60), fetch(items))[1]  # a slow staging Get
    request = make_request("held", x)
    assert not p.sched.ensure_cache_available(request, 0)
    assert p.sched.connector_scheduler.book.staging() == {x}

    monkeypatch.setattr(scheduler_module, "IDLE_STEP_WAIT_S", 0.5)
    started = time.monotonic()
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    assert time.monotonic() - started >= 0.45, "an empty step did not wait for the report"

    monkeypatch.setattr(scheduler_module, "IDLE_STEP_WAIT_S", 30.0)
    busy = SchedulerOutput.make_empty()
    busy.total_num_scheduled_tokens = 4  # another request runs: never delayed
    started = time.monotonic()
    p.sched.build_connector_meta(busy)
    assert time.monotonic() - started < 10

    threading.Timer(0.1, gate.set).start()
    started = time.monotonic()
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    assert time.monotonic() - started < 10, "the report did not end the wait"
    assert p.sched.ensure_cache_available(request, 0), "staged, yet still held"
