"""Issue 32: the vLLM connector in an EPD deployment (encoder-only ``ec_producer``
instances feeding ``ec_consumer`` prefill instances through the brokers), driven hook
by hook in vLLM 0.32's order against real VllmConfig / Request objects and real
broker processes (two nodes: two brokers joined by a real redis-server).

Deliverable 1: an encoder instance never encodes an item the fleet already holds --
in its own broker's slab or in the fleet's store -- and does not load it either.
Deliverable 2 at the connector's level: the encoder instance's step ends only once
its entries are in the store, and the prefill instance's lookup right after finds
them, with announcements arriving late and writes slowed.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from vllm.config import ModelConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from lmcache_ec_broker import BrokerClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import wait_until  # noqa: E402
from delay_proxy import DelayProxy  # noqa: E402
from redis_servers import REDIS_SERVER, RedisServer  # noqa: E402
from test_vllm_connector_unit import (  # noqa: E402
    Pair,
    embedding,
    make_config,
    make_request,
    model_config,  # noqa: F401 - the fixture
    ship,
)

NEEDS_REDIS = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def encoder_only_config(model_config: ModelConfig) -> ModelConfig:  # noqa: F811
    """The same tiny model (the same path: the same key field), as ``vllm serve
    --mm-encoder-only`` configures it."""
    return ModelConfig(
        model=model_config.model, dtype="bfloat16", max_model_len=512, mm_encoder_only=True
    )


@pytest.fixture
def instances(model_config, encoder_only_config) -> Iterator[Callable[..., Pair]]:  # noqa: F811
    made: list[Pair] = []

    def make(
        role: str,
        socket_path: str,
        encoder_only: bool = False,
        expect_encoder_only: bool | None = None,
        **extra: object,
    ) -> Pair:
        # budgets for a loaded 2-core test host (a first connection alone can take 50 ms);
        # no claim here depends on them
        extra.setdefault("scheduler_budget_ms", 1000)
        extra.setdefault("worker_budget_ms", 2000)
        # a copy each: vLLM sets mm_encoder_only on a pure producer's ModelConfig
        base = copy.deepcopy(encoder_only_config if encoder_only else model_config)
        config = make_config(base, role, socket_path, **extra)
        want = encoder_only if expect_encoder_only is None else expect_encoder_only
        assert config.is_mm_encoder_only == want
        p = Pair(config)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def step(
    p: Pair,
    encoder_cache: dict[str, torch.Tensor],
    requests: list[Request],
    encode: dict[str, torch.Tensor],
) -> tuple[set[str], set[str]]:
    """One engine step as vLLM 0.32 runs it: the scheduler's hooks per item (an item
    has_cache_item answers True for is an external item: allocated, not encoded), the
    metadata shipped with the SchedulerOutput, then the worker's hooks in the v1
    runner's order -- loads (consumers), the encoder's outputs saved, and, last,
    get_finished and build_connector_worker_meta before the step's output leaves.
    Returns (items the step encoded, requests deferred)."""
    so = SchedulerOutput.make_empty()
    deferred: set[str] = set()
    p.sched.wait_for_link(30)  # a served engine's workers link before its first request
    for r in requests:
        ready = p.sched.ensure_cache_available(r, 0)
        for _ in range(100):  # held only while a hit is staged on the workers: vLLM's
            if ready or not p.sched.stage_orders:  # later steps ask again
                break
            p.sched.wait_for_staging(30)
            ready = p.sched.ensure_cache_available(r, 0)
        if not ready:
            deferred.add(r.request_id)
            continue
        for index, feature in enumerate(r.mm_features):
            if feature.identifier in encoder_cache:
                continue  # vLLM's own encoder cache has it (check_and_update_cache)
            if not p.sched.has_cache_item(feature.identifier):
                so.scheduled_encoder_inputs.setdefault(r.request_id, []).append(index)
            p.sched.update_state_after_alloc(r, index)
    shipped = ship(p.sched, so)
    w = p.worker
    w.bind_connector_metadata(shipped.ec_connector_metadata)
    if w.is_producer:
        w.start_save_caches(encoder_cache=encoder_cache)
    if w.is_consumer:
        w.start_load_caches(encoder_cache)
    by_id = {r.request_id: r for r in requests}
    encoded: set[str] = set()
    for req_id, indices in shipped.scheduled_encoder_inputs.items():
        for index in indices:
            mm_hash = by_id[req_id].mm_features[index].identifier
            encoder_cache[mm_hash] = encode[mm_hash]
            encoded.add(mm_hash)
            w.save_caches(encoder_cache, mm_hash)
    out = ECConnectorOutput()
    out.finished_sending, out.finished_recving = w.get_finished(set())
    out.ec_connector_worker_meta = w.build_connector_worker_meta()
    w.clear_connector_metadata()
    p.sched.update_connector_output(out)
    return encoded, deferred


def stats(socket_path: str) -> dict:
    with BrokerClient(socket_path) as c:
        return c.stats()


# ---------------------------------------------------------------- one node


def test_encoder_instance_skips_what_its_broker_holds(instances, broker) -> None:
    """E encodes an item once; a later request of it after E's own encoder cache
    dropped it is neither encoded nor loaded, and no lease is taken for it."""
    e = instances("ec_producer", broker.socket_path, encoder_only=True)
    h, t = "e" * 64, embedding(3)
    encoded, _ = step(e, {}, [make_request("r1", h)], {h: t})
    assert encoded == {h}
    assert e.worker.puts_stored == 1 and e.worker.published == 1
    before = stats(broker.socket_path)
    cache: dict[str, torch.Tensor] = {}  # E's own cache dropped it (a new process, or evicted)
    e.sched.build_connector_meta(_freed(h))  # vLLM freed it: the mirror forgets it
    encoded, deferred = step(e, cache, [make_request("r2", h)], {h: t})
    assert encoded == set() and deferred == set()
    assert cache == {}, "an encoder instance loaded an item it only had to not encode"
    assert e.sched.ec_hits == 1 and e.worker.published == 2 and e.worker.publish_failures == 0
    after = stats(broker.socket_path)
    for name in ("puts", "put_present", "put_in_progress"):
        assert after[name] == before[name], f"the item was put again ({name})"
    assert after["pins"] == 0, "a lease (a pin) was taken for an item nobody loads"
    assert e.worker.loads == 0


def test_aggregated_instances_load_as_before_and_never_wait(instances, broker) -> None:
    """ec_both encodes a new item, loads it later (a hit is loaded: it runs the
    language model), and never waits for a publish. vLLM 0.32 makes every pure
    ec_producer encoder-only (VllmConfig._resolve_mm_encoder_only), so no producer
    that runs the language model can skip an item it would then lack."""
    h, t = "f" * 64, embedding(4)
    both = instances("ec_both", broker.socket_path)
    encoded, _ = step(both, {}, [make_request("r1", h)], {h: t})
    assert encoded == {h}
    assert stats(broker.socket_path)["publish_waits"] == 0, "an aggregated instance waited"
    cache: dict[str, torch.Tensor] = {}
    both.sched.build_connector_meta(_freed(h))
    encoded, _ = step(both, cache, [make_request("r3", h)], {h: t})
    assert encoded == set() and torch.equal(cache[h], t)
    assert stats(broker.socket_path)["publish_waits"] == 0
    producer = instances("ec_producer", broker.socket_path, expect_encoder_only=True)
    assert producer.sched._encoder_only_producer


def test_publish_wait_ms_is_checked_and_zero_turns_the_wait_off(instances, broker) -> None:
    with pytest.raises(ValueError, match="publish_wait_ms must be >= 0"):
        instances("ec_producer", broker.socket_path, encoder_only=True, publish_wait_ms=-1)
    e = instances("ec_producer", broker.socket_path, encoder_only=True, publish_wait_ms=0)
    h = "9" * 64
    step(e, {}, [make_request("r1", h)], {h: embedding(9)})
    assert e.worker.puts_stored == 1 and e.worker.published == 0
    assert stats(broker.socket_path)["publish_waits"] == 0


def _freed(*hashes: str) -> SchedulerOutput:
    so = SchedulerOutput.make_empty()
    so.free_encoder_mm_hashes = list(hashes)
    return so


# ---------------------------------------------------------------- two nodes


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.fixture
def slow_proxy(redis: RedisServer) -> Iterator[DelayProxy]:
    with DelayProxy(redis.port) as p:
        p.hold_s["SET"] = 0.05  # slow remote writes
        p.push_delay_s = 0.5  # announcements reach the other node late
        yield p


def _node(make_broker, tmp_path, url: str, name: str) -> str:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(f"remote_url: '{url}'\nremote_timeout_s: 2.0\n")
    return make_broker("--shm-size", "64MiB", "--config", str(cfg)).socket_path


@NEEDS_REDIS
def test_prefill_node_finds_every_item_the_encoder_node_answered_for(
    instances, make_broker, tmp_path, redis, slow_proxy
) -> None:
    """E on node 1, PD on node 2, both brokers behind the slow proxy. After each of
    E's steps (E's answer), PD's scheduler looks the item up at once: every item is
    found (deferred while promoted), loaded, and PD encodes nothing."""
    url = slow_proxy.url(redis.password)
    node1, node2 = _node(make_broker, tmp_path, url, "n1"), _node(make_broker, tmp_path, url, "n2")
    e = instances("ec_producer", node1, encoder_only=True)
    pd = instances("ec_consumer", node2)
    rounds = 8
    for i in range(rounds):
        h, t = f"{i:02d}" * 32, embedding(100 + i)
        assert step(e, {}, [make_request(f"e{i}", h)], {h: t})[0] == {h}
        r = make_request(f"pd{i}", h)
        assert _found(pd, r, h), f"round {i}: PD's lookup missed the item E had answered for"
        wait_until(lambda r=r: _promoted(pd, r), what=f"round {i}: the promotion", interval=0.01)
        cache: dict[str, torch.Tensor] = {}
        encoded, deferred = step(pd, cache, [r], {})  # {}: a KeyError if PD had to encode
        assert encoded == set() and deferred == set() and torch.equal(cache[h], t)
    assert e.worker.published == rounds and e.worker.publish_failures == 0
    assert pd.worker.loads == rounds and pd.sched.promotion_failures == 0


@NEEDS_REDIS
def test_control_without_the_publish_wait_the_prefill_node_misses(
    instances, make_broker, tmp_path, redis, slow_proxy
) -> None:
    """The same hand-off with E not waiting (publish_wait_ms 0: the old behaviour, E
    answers while its write is still on its way): PD's lookup right after misses, and
    PD would encode the item again. What the test above would see on the old code.
    E's writes are held 2 s here (not 50 ms): PD's lookup must come before the write
    lands, and on a loaded host the test process itself may wait longer than 50 ms
    for a CPU between E's step and PD's lookup (a CI run beside a CPU-bound process
    found one item that way, 2026-12-06)."""
    slow_proxy.hold_s["SET"] = 2.0
    url = slow_proxy.url(redis.password)
    node1, node2 = _node(make_broker, tmp_path, url, "n1"), _node(make_broker, tmp_path, url, "n2")
    e = instances("ec_producer", node1, encoder_only=True, publish_wait_ms=0)
    pd = instances("ec_consumer", node2)
    misses = 0
    for i in range(3):
        h = f"c{i}" * 32
        assert step(e, {}, [make_request(f"e{i}", h)], {h: embedding(i)})[0] == {h}
        misses += not _found(pd, make_request(f"pd{i}", h), h)
    assert misses == 3


def _found(p: Pair, r: Request, h: str) -> bool:
    """The prefill instance's scheduler, right away: is the item found (a hit, or
    deferred while it is promoted)? Ends the scheduler's step."""
    found = p.sched.ensure_cache_available(r, 0) is False or p.sched.has_cache_item(h)
    p.sched.build_connector_meta(SchedulerOutput.make_empty())
    return found


def _promoted(p: Pair, r: Request) -> bool:
    """One scheduler step of a deferred request: True once it may be scheduled."""
    ready = p.sched.ensure_cache_available(r, 0)
    p.sched.build_connector_meta(SchedulerOutput.make_empty())  # the step ends
    return ready


@NEEDS_REDIS
def test_encoder_node_skips_what_another_node_published(
    instances, make_broker, tmp_path, redis, slow_proxy
) -> None:
    """Two encoder instances on two nodes: the second, asked for an item the first
    published a moment ago (its announcement not heard yet), neither encodes nor
    promotes it into its own slab, and its step's publish finds it in the store."""
    url = slow_proxy.url(redis.password)
    node1, node2 = _node(make_broker, tmp_path, url, "n1"), _node(make_broker, tmp_path, url, "n2")
    e1 = instances("ec_producer", node1, encoder_only=True)
    e2 = instances("ec_producer", node2, encoder_only=True)
    h, t = "ab" * 32, embedding(7)
    assert step(e1, {}, [make_request("a", h)], {h: t})[0] == {h}
    encoded, _ = step(e2, {}, [make_request("b", h)], {h: t})
    assert encoded == set(), "the second encoder instance encoded an item the fleet held"
    assert e2.sched.ec_hits == 1 and e2.worker.published == 1
    s2 = stats(node2)
    assert s2["promotions"] == 0 and s2["puts"] == 0
