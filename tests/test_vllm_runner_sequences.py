"""The connector inside vLLM's own scheduler and the model runners' EC call sequences,
in-process on CPU (tests/vllm_runner_harness.py says what is vLLM's code and what is
emulated), against a real broker: V1 and V2 runners, async scheduling on and off,
the three ways a SchedulerOutput can reach a worker, priority preemption within a
step, 0.33's encoder_input_updates, PP and DP. Hits are staged on the worker before
they are scheduled (stage_link.py, stage_book.py). Every case checks the promises: a
load cannot fail once staged, a staging that fails has the item encoded, neither
kills the engine (no exception out of a step) nor changes an answer (each request's
gathered embeddings are the encoder's own output)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm.config import ModelConfig

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_runner_harness import (  # noqa: E402
    Engine,
    make_config,
    make_request,
    stub_encode,
)

NEXT_SRC = Path(
    os.environ.get("LMCACHE_EC_VLLM_NEXT_SRC")
    or Path(__file__).resolve().parent.parent / ".venv" / "vllm-0.33.0"
)

RUNNERS = [
    pytest.param(False, False, id="v1-sync"),
    pytest.param(False, True, id="v1-async"),
    pytest.param(True, False, id="v2-sync"),
    pytest.param(True, True, id="v2-async"),
]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    return ModelConfig(model=str(build_tiny_qwen2vl(root)), dtype="bfloat16", max_model_len=512)


@pytest.fixture
def engines(model_config, broker):
    made: list[Engine] = []

    def factory(
        *,
        executor: str = "together",
        encoder_cache_cls=None,
        num_blocks: int = 400,
        tower_lora: bool = False,
        next_src: Path | None = None,
        **kw,
    ) -> Engine:
        # Generous broker budgets: a loaded CI machine must not turn a load into a miss.
        kw = {"worker_budget_ms": 5000, "scheduler_budget_ms": 5000, **kw}
        engine = Engine(
            make_config(model_config, broker.socket_path, **kw),
            executor=executor,
            encoder_cache_cls=encoder_cache_cls,
            num_blocks=num_blocks,
            tower_lora=tower_lora,
            next_src=next_src,
        )
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        engine.close()


def store(engine: Engine, *hashes: str, num_embeds: int = 16) -> None:
    """Put the encoder's output for ``hashes`` into the broker, as another instance did."""
    for h in hashes:
        engine.worker.save_caches({h: stub_encode(h, num_embeds)}, h)


def delete_before_staging(engine: Engine, broker, *hashes: str) -> None:
    """The entries vanish after the scheduler's lookup found them, before the worker
    stages them (a broker restart, an operator's clear): the staging fails."""
    worker = engine.worker.connector_worker
    fetch = worker.fetch

    def vanish_then_fetch(keys: list[str], device: str):
        with BrokerClient(broker.socket_path) as c:
            for h in hashes:
                if engine.sched_connector.key(h) in keys:
                    c.delete(engine.sched_connector.key(h))
        return fetch(keys, device)

    worker.fetch = vanish_then_fetch


def delete_when_loaded(engine: Engine, broker, *hashes: str) -> None:
    """The entries vanish after they were staged, before the step that loads them."""

    def hook(so) -> None:
        loads = {s.mm_hash for s in so.ec_connector_metadata.loads}
        with BrokerClient(broker.socket_path) as c:
            for h in set(hashes) & loads:
                c.delete(engine.sched_connector.key(h))

    engine.before_worker = hook


def assert_answers_unchanged(engine: Engine, requests) -> None:
    for request in requests:
        assert engine.outputs.get(request.request_id), f"{request.request_id} produced nothing"
        for f in request.mm_features:
            got = engine.gathered[request.request_id][f.identifier]
            want = stub_encode(f.identifier, f.mm_position.get_num_embeds())
            assert torch.equal(got, want), f"{request.request_id} read something else for {f}"


@pytest.mark.parametrize(("v2", "async_scheduling"), RUNNERS)
def test_hit_loads_and_miss_encodes(engines, v2, async_scheduling):
    e = engines(v2=v2, async_scheduling=async_scheduling)
    store(e, "ab" * 32)
    requests = [make_request("a", ["ab" * 32]), make_request("b", ["cd" * 32])]
    for r in requests:
        e.add(r)
    e.run()
    assert_answers_unchanged(e, requests)
    assert e.worker.loads == 1 and e.worker.load_failures == 0
    assert e.sched_connector.ec_hits == 1 and e.sched_connector.ec_misses == 1


@pytest.mark.parametrize("executor", ["together", "inprocess", "apart"])
@pytest.mark.parametrize(("v2", "async_scheduling"), RUNNERS)
def test_failed_staging_is_encoded(engines, broker, v2, async_scheduling, executor):
    """The entry is gone when the worker stages it: the scheduler, told so, has vLLM
    encode it (has_cache_item False); nothing of the runner's step is edited, so the
    way the metadata travels ("apart" killed the engine before issue 31) is moot."""
    e = engines(v2=v2, async_scheduling=async_scheduling, executor=executor)
    x, y = "a1" * 32, "b2" * 32
    store(e, x, y)
    delete_before_staging(e, broker, x)
    requests = [make_request("a", [x, y]), make_request("bystander", ["c3" * 32])]
    for r in requests:
        e.add(r)
    e.run()
    assert_answers_unchanged(e, requests)
    assert e.worker.load_failures == 1 and e.worker.loads == 1
    assert e.sched_connector.ec_hits == 1 and e.sched_connector.ec_misses == 2
    assert not e.errors


@pytest.mark.parametrize(("v2", "async_scheduling"), RUNNERS)
def test_entry_gone_after_staging_still_loads(engines, broker, v2, async_scheduling):
    """Issue 41: once staged, a load cannot fail. The entry vanishes from the broker
    in the step that loads it; the worker moves its staged tensor anyway. (Before,
    the worker fetched in that step: the load failed and the item was re-encoded by
    editing the runner's step.)"""
    e = engines(v2=v2, async_scheduling=async_scheduling)
    x = "c1" * 32
    store(e, x)
    delete_when_loaded(e, broker, x)
    requests = [make_request("a", [x])]
    e.add(requests[0])
    e.run()
    assert_answers_unchanged(e, requests)
    assert e.worker.loads == 1 and e.worker.load_failures == 0
    assert e.sched_connector.ec_hits == 1 and not e.errors


@pytest.mark.parametrize("fails", [False, True], ids=["loads", "load-fails"])
@pytest.mark.parametrize(
    ("v2", "tower_lora"),
    [
        pytest.param(False, False, id="v1"),
        pytest.param(False, True, id="v1-tower-lora"),
        pytest.param(True, False, id="v2"),
    ],
)
def test_request_preempted_in_the_step_that_loads_its_item(engines, broker, v2, tower_lora, fails):
    """Item 4 of issue 31, with vLLM's priority scheduler: request "lo" is scheduled
    with a hit on its image (a load), then a higher-priority request needs a KV block
    and "lo" is preempted later in the same step. vLLM keeps the item in its encoder
    cache (freeable), so the worker must hold it when "lo" comes back: the load is
    shipped all the same and moves the staged tensor; with the entry deleted in that
    step ("load-fails") nothing changes, the tensor was staged before."""
    e = engines(
        v2=v2,
        priority=True,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        num_blocks=7,
        tower_lora=tower_lora,
    )
    img = "e9" * 32
    store(e, img)
    seen = []

    def hook(so) -> None:
        if "lo" in (so.preempted_req_ids or ()):
            seen.append(e.sched_connector.ec_hits)
            if fails:
                with BrokerClient(broker.socket_path) as c:
                    c.delete(e.sched_connector.key(img))

    e.before_worker = hook
    lo = make_request("lo", [img], text=68, tail=4, priority=1, max_tokens=2)
    hi = make_request("hi", [], text=15, priority=0, max_tokens=40)
    e.add(lo)
    e.step()
    e.add(hi)
    e.run(max_steps=80)
    assert seen == [1], "the scenario did not happen: lo preempted in the step of its hit"
    assert_answers_unchanged(e, [lo, hi])
    assert not e.errors


@pytest.fixture(scope="module")
def next_src() -> Path:
    if not (NEXT_SRC / "vllm/v1/worker/gpu/mm/encoder_cache.py").is_file():
        message = f"vLLM 0.33's V2 runner sources are not at {NEXT_SRC}; `bash .ci/setup.sh`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return NEXT_SRC


def rewind(e: Engine, request, to: int) -> None:
    """What 0.33's KV-load rollback does to a running request: its progress goes back,
    without reinstalling it on the worker; here its item also left vLLM's encoder
    cache, so the step that re-reads it asks the connector again."""
    request.num_computed_tokens = to
    request.num_in_flight_tokens = 0
    mgr = e.scheduler.encoder_cache_manager
    for f in request.mm_features:
        mgr.cached.pop(f.identifier, None)
        if f.identifier in mgr.freeable:
            mgr.num_freeable_slots -= mgr.freeable.pop(f.identifier)
        mgr.num_free_slots = mgr.num_freeable_slots = mgr.cache_size
        mgr.freed.append(f.identifier)


def test_rewound_request_whose_inputs_the_v2_worker_released(engines, broker, next_src):
    """Item 6 of issue 31 (0.33, V2): encoder_input_updates drop an item's inputs on
    the worker once consumed, and a rewind reads the item again. Before, a load
    that failed then was re-encoded from inputs the worker no longer had ("Encoder
    cache miss"). Now nothing is encoded in place of a load: the item, which the
    scheduler's mirror still counts as held by vLLM in that step, is not staged but
    encoded by vLLM itself (it restores the inputs); had it been staged, its load
    could not fail."""
    e = engines(
        v2=True, next_src=next_src, max_num_batched_tokens=16, long_prefill_token_threshold=16
    )
    img = "f7" * 32
    store(e, img)
    r = make_request("r", [img], text=4, tail=40, max_tokens=2)
    e.add(r)
    released = []

    def hook(so) -> None:
        for update in so.encoder_input_updates.get("r", {}).values():
            released.append(update is None)
        if any(s.mm_hash == img for s in so.ec_connector_metadata.loads):
            with BrokerClient(broker.socket_path) as c:  # the hit's entry vanishes
                c.delete(e.sched_connector.key(img))

    for _ in range(3):  # held while staged, [0,16) loads the item, [16,32) consumes it
        e.step()
    assert e.worker.loads == 1
    e.before_worker = hook
    e.step()  # [32,48): the scheduler releases the item's inputs
    assert released == [True], "0.33's scheduler did not release the item's inputs"
    rewind(e, r, 0)
    e.run()
    assert_answers_unchanged(e, [r])
    assert not e.errors
    assert e.worker.load_failures == 0


def test_external_launcher_with_several_ranks_never_promises_a_load(model_config, broker):
    """Item 3 of issue 31: with external_launcher every rank runs its own scheduler
    (vllm/v1/executor/uniproc_executor.py, ExecutorWithExternalLauncher) and its own
    lookups, so ranks could disagree on which items to encode: no loads (saves go on)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from lmcache_ec_broker.connector.vllm import ECBrokerConnector

    config = make_config(model_config, broker.socket_path)
    config.parallel_config.distributed_executor_backend = "external_launcher"
    config.parallel_config.tensor_parallel_size = 2
    sched = ECBrokerConnector(config, ECConnectorRole.SCHEDULER)
    worker = ECBrokerConnector(config, ECConnectorRole.WORKER)
    try:
        h = "e1" * 32
        worker.save_caches({h: stub_encode(h, 16)}, h)
        assert worker.puts_stored == 1
        request = make_request("r", [h])
        assert sched.ensure_cache_available(request, 0)
        assert not sched.has_cache_item(h)
        assert "external_launcher" in sched.loads_off
        config.parallel_config.tensor_parallel_size = 1  # one rank: nothing to disagree on
        assert ECBrokerConnector(config, ECConnectorRole.SCHEDULER).loads_off == ""
    finally:
        sched.shutdown()
        worker.shutdown()


def test_v2_runner_with_lora_loads():
    """Item 5 of issue 31 forbade loads with LoRA on the V2 runner (a re-encode in
    start_load_caches would miss the tower LoRA mapping built before it). Loads no
    longer encode anything: LoRA loads on both runners."""
    from types import SimpleNamespace

    from vllm.config import LoRAConfig

    from lmcache_ec_broker.connector.vllm.stage_link import loads_off_reason

    # Tower/connector LoRA only: LoRA on the language model alone keeps loads on
    # (issue 39, tests/test_identity.py).
    tower = LoRAConfig(enable_tower_connector_lora=True)
    parallel = SimpleNamespace(distributed_executor_backend="mp", tensor_parallel_size=2)
    for v2 in (False, True):
        for lora in (tower, LoRAConfig()):
            config = SimpleNamespace(parallel_config=parallel, lora_config=lora, use_v2_model_runner=v2)
            assert loads_off_reason(config) == ""


PP_RUNNERS = [
    pytest.param(False, False, id="v1-sync"),
    pytest.param(True, False, id="v2-sync"),
    pytest.param(True, True, id="v2-async"),
]


@pytest.mark.parametrize(("v2", "async_scheduling"), PP_RUNNERS)
def test_failed_staging_with_pipeline_parallel(engines, broker, v2, async_scheduling):
    """PP=2: vLLM's scheduler with use_pp and its batch queue (as many batches in
    flight as max_concurrent_batches; chunked prefills keep a request in several),
    the runner the first PP rank's (the only one with EC hooks and the encoder). A
    failed staging is encoded; every request reads the encoder's output. With the V1
    runner the first rank's EC output never reaches the scheduler (vLLM drops it on a
    non-last PP rank): staging reports travel on the staging link, so hits are served
    on both runners."""
    e = engines(
        v2=v2, async_scheduling=async_scheduling, pp=2, max_num_batched_tokens=24, lease_ms=300
    )
    assert e.depth == (3 if async_scheduling else 2)
    x, y = "f1" * 32, "f2" * 32
    store(e, x, y)
    delete_before_staging(e, broker, x)
    requests = [
        make_request("a", [x, y], max_tokens=3),
        make_request("bystander", ["f3" * 32], max_tokens=3),
        make_request("again", [y, "f4" * 32], max_tokens=2),
    ]
    for r in requests:
        e.add(r)
    e.run(max_steps=80)
    assert not e.errors
    assert_answers_unchanged(e, requests)
    assert e.worker.load_failures == 1 and e.worker.loads >= 1
    # A later request's load is promised and served (x was encoded and stored again).
    z = "f5" * 32
    store(e, z)
    loads = e.worker.loads
    later = make_request("later", [z, x], text=5)  # another prompt: no prefix-cache hit
    e.add(later)
    e.run(max_steps=40)
    assert not e.errors
    assert_answers_unchanged(e, [later])
    assert e.worker.loads == loads + 1 and e.worker.load_failures == 1


@pytest.mark.parametrize(("v2", "async_scheduling"), RUNNERS)
def test_failed_staging_in_one_data_parallel_rank(engines, broker, v2, async_scheduling):
    """DP=2 on one host: two engines (each DP rank its own scheduler, connectors,
    runner and staging link, as vLLM's DP engine cores), one broker, stepped in turn.
    Rank 0 loads the item; the entry is gone when rank 1's worker stages it (its own
    lookup found it): rank 1 encodes it and stores it again; rank 0 is untouched."""
    ranks = [engines(v2=v2, async_scheduling=async_scheduling) for _ in range(2)]
    x = "d1" * 32
    store(ranks[0], x)
    delete_before_staging(ranks[1], broker, x)
    per_rank = [
        [make_request(f"r{i}-a", [x], max_tokens=2), make_request(f"r{i}-b", ["d2" * 32])]
        for i in range(2)
    ]
    for e, requests in zip(ranks, per_rank, strict=True):
        for r in requests:
            e.add(r)
    for _ in range(50):
        busy = [e for e in ranks if e.has_work() or e._inflight]
        if not busy:
            break
        for e in busy:
            e.step()
    for e, requests in zip(ranks, per_rank, strict=True):
        assert not e.errors
        assert_answers_unchanged(e, requests)
    assert (ranks[0].worker.loads, ranks[0].worker.load_failures) == (1, 0)
    # rank 1 staged x and failed; it loads d2, which rank 0 encoded and stored
    assert ranks[1].worker.load_failures == 1
    assert ranks[1].sched_connector.ec_misses == 1 and ranks[1].sched_connector.ec_hits == 1
    with BrokerClient(broker.socket_path) as c:
        assert c.get(ranks[1].sched_connector.key(x)) is not None, "rank 1 did not store it again"


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_an_item_another_instance_is_encoding_is_waited_for(engines, v2):
    """Issue 41, deliverable 2 on a node: instances A and B (one broker) meet a new
    item at the same moment. A's lookup claims it and A encodes it; B's lookup finds
    it claimed and holds its request, then stages and loads A's output: the encoder
    ran once for the item. (Before: both encoded it.)"""
    a, b = engines(v2=v2), engines(v2=v2)
    x = "9a" * 32
    ra, rb = make_request("a", [x]), make_request("b", [x])
    a.add(ra)
    b.add(rb)
    b_steps: list = []

    def b_meets_it_meanwhile(so) -> None:  # after A's lookup, before A's encode
        if not b_steps:
            b_steps.append(b.step())

    a.before_worker = b_meets_it_meanwhile
    a.run()
    assert b_steps and not b_steps[0].num_scheduled_tokens, "B was not held"
    assert b.sched_connector.claim_waits >= 1
    b.run()
    assert_answers_unchanged(a, [ra])
    assert_answers_unchanged(b, [rb])
    assert a.worker.puts_stored == 1 and a.sched_connector.ec_misses == 1
    assert b.worker.loads == 1 and b.sched_connector.ec_hits == 1, "B encoded it too"
    assert b.sched_connector.ec_misses == 0 and not a.errors and not b.errors


def test_a_claim_that_never_lands_costs_one_bounded_wait(engines, broker):
    """The other encoder claimed the item and never stores it (crashed, aborted
    without letting go): the request waits claim_wait_ms, then encodes it itself."""
    b = engines(claim_wait_ms=300)
    x = "9b" * 32
    with BrokerClient(broker.socket_path) as other:  # another instance's claim
        (info,) = other.lookup([b.sched_connector.key(x)], claim_ms=60_000)
        assert info.state == 0  # MISS: claimed for "other"
        rb = make_request("b", [x])
        b.add(rb)
        t0 = time.monotonic()
        steps = 0
        while not b.outputs.get("b"):
            b.step()
            steps += 1
            assert time.monotonic() - t0 < 30, "the request hung on a claim"
        waited = time.monotonic() - t0
    assert_answers_unchanged(b, [rb])
    assert 0.3 <= waited < 10, waited
    assert b.sched_connector.claim_timeouts == 1 and b.sched_connector.ec_misses == 1


def test_a_held_request_re_asks_at_intervals_not_every_step(engines, broker, monkeypatch):
    """A request held on another encoder's claim is not looked up again on every
    engine step (vLLM steps an engine with a held request at once; the connector's
    empty-step wait, IDLE_STEP_WAIT_S, is off here so that steps come every
    millisecond): its CLAIMED answer is kept between re-asks spaced out by
    connector/vllm/reask.py. The broker counts the claiming lookups it answered CLAIMED;
    before, one per step. When the other encoder's put lands, the held request loads
    it (no encode here)."""
    from lmcache_ec_broker.connector.vllm import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "IDLE_STEP_WAIT_S", 0.0)
    b = engines(claim_wait_ms=10_000)
    x = "9c" * 32
    with BrokerClient(broker.socket_path) as other:  # another instance's claim
        (info,) = other.lookup([b.sched_connector.key(x)], claim_ms=60_000)
        assert info.state == 0  # MISS: claimed for "other"
        before = other.stats()["claims_answered"]
        rb = make_request("b", [x])
        b.add(rb)
        t0 = time.monotonic()
        steps = 0
        while time.monotonic() - t0 < 0.5:  # held for 500 ms, a step every ~ms
            assert not b.step().num_scheduled_tokens, "not held on the claim"
            steps += 1
            time.sleep(0.001)
        asked = other.stats()["claims_answered"] - before
        assert steps >= 100, f"only {steps} steps: the test cannot tell"
        # 5, 10, 20, then every 40 ms: ~15 in 500 ms (a loaded machine steps late: fewer)
        assert 1 <= asked <= 20, f"{asked} claiming lookups in {steps} steps"
        assert b.sched_connector.claim_reasks == asked - 1
        assert b.sched_connector.claim_waits == steps
        store(engines(), x)  # the other encoder's put lands
        landed = time.monotonic()
        while not b.outputs.get("b"):
            b.step()
            time.sleep(0.001)
            assert time.monotonic() - landed < 10, "the request hung after the put landed"
    assert_answers_unchanged(b, [rb])
    assert b.worker.loads == 1 and b.sched_connector.ec_hits == 1, "it encoded it itself"
    assert b.sched_connector.ec_misses == 0 and b.sched_connector.claim_timeouts == 0


def test_a_held_request_outlives_a_hung_broker_a_bounded_time(engines, broker):
    """A re-ask of a held item that the broker does not answer (SIGSTOPped: the lookup
    times out and the client's circuit opens) keeps the request held -- the other
    encoder is most likely still on it -- for at most two probe intervals; with the
    broker still hung it is then encoded here: never a hang, never a wrong answer."""
    b = engines(
        claim_wait_ms=60_000, scheduler_budget_ms=50, worker_budget_ms=500, probe_interval_ms=300
    )
    x = "9e" * 32
    with BrokerClient(broker.socket_path) as other:
        other.lookup([b.sched_connector.key(x)], claim_ms=60_000)  # another's claim
        rb = make_request("b", [x])
        b.add(rb)
        for _ in range(3):
            assert not b.step().num_scheduled_tokens, "not held on the claim"
            time.sleep(0.01)
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            held_for = None
            while not b.outputs.get("b"):
                before_step = time.monotonic() - t0  # (the step's put waits its budget)
                out = b.step()
                if out.num_scheduled_tokens and held_for is None:
                    held_for = before_step
                time.sleep(0.002)
                assert time.monotonic() - t0 < 20, "the request hung on a hung broker"
        finally:
            os.kill(broker.pid, signal.SIGCONT)
    assert held_for is not None
    # held through the hang (one 50 ms timeout, then the open circuit's misses) for
    # two probe intervals from the first unanswered re-ask, then encoded here
    assert 0.5 <= held_for < 5, held_for
    assert_answers_unchanged(b, [rb])
    assert b.worker.loads == 0 and b.sched_connector.claim_timeouts == 0
    assert b.sched_connector.broker_timeouts >= 1


def test_a_first_lookup_past_the_budget_is_held_once_per_outage(engines, broker):
    """A request's first claiming lookup the broker does not answer (SIGSTOPped: it
    times out, the circuit opens) holds the request -- on a busy host another
    instance may be encoding the item -- for at most two probe intervals from the
    outage's start, then it is encoded here; a request arriving later in the same
    outage is encoded at once (one bounded wait per outage, reask.py invariant 3)."""
    a = engines(
        claim_wait_ms=60_000, scheduler_budget_ms=50, worker_budget_ms=200, probe_interval_ms=300
    )
    first, later = make_request("first", ["9f" * 32]), make_request("later", ["a0" * 32])
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        a.add(first)
        held_for = None
        while not a.outputs.get("first"):
            before_step = time.monotonic() - t0
            if a.step().num_scheduled_tokens and held_for is None:
                held_for = before_step
            time.sleep(0.002)
            assert time.monotonic() - t0 < 20, "the request hung on a hung broker"
        a.add(later)
        out = a.step()
        assert out.num_scheduled_tokens, "a request later in the outage was held too"
        while not a.outputs.get("later"):
            a.step()
            assert time.monotonic() - t0 < 30, "the later request hung"
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    assert held_for is not None
    assert 0.5 <= held_for < 5, held_for  # 0.6 s: two 300 ms probe intervals
    assert_answers_unchanged(a, [first, later])
    assert a.worker.loads == 0 and a.sched_connector.claim_timeouts == 0
    assert a.sched_connector.broker_timeouts >= 1


def test_a_request_aborted_while_held_asks_no_more(engines, broker):
    """Aborted while held on a claim: the request lets go of everything; the item is
    not asked about again for it."""
    from vllm.v1.request import RequestStatus

    b = engines(claim_wait_ms=10_000)
    x = "9d" * 32
    with BrokerClient(broker.socket_path) as other:
        other.lookup([b.sched_connector.key(x)], claim_ms=60_000)
        b.add(make_request("b", [x]))
        for _ in range(3):
            b.step()
            time.sleep(0.01)
        assert b.sched_connector.claims_awaited == 1
        b.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        before = other.stats()["claims_answered"]
        for _ in range(20):
            b.step()
            time.sleep(0.005)
        assert other.stats()["claims_answered"] == before
        assert b.sched_connector.claims_awaited == 0 and not b.has_work()


@pytest.mark.parametrize("explicit", [None, 40])
def test_the_default_staging_budget_is_vllms_own_encoder_cache_size(engines, explicit):
    """vLLM's Scheduler sizes its encoder cache at max(encoder_cache_size, the largest
    item's embeddings): with ``max_num_batched_tokens`` 64 the configured size (64) is
    below the tiny model's largest item, and the staging budget's default is what
    vLLM's own EncoderCacheManager holds, not 64. An explicit ``stage_max_embeds``
    still wins."""
    kw = {} if explicit is None else {"stage_max_embeds": explicit}
    e = engines(max_num_batched_tokens=64, **kw)
    vllm_size = e.scheduler.encoder_cache_manager.cache_size
    assert e.scheduler.vllm_config.scheduler_config.encoder_cache_size == 64 < vllm_size
    book = e.sched_connector.connector_scheduler.book
    assert book.max_embeds == (vllm_size if explicit is None else explicit)


# The waiting loop is the scheduler's, the same for every runner: the two ends of RUNNERS.
@pytest.mark.parametrize(("v2", "async_scheduling"), [RUNNERS[0], RUNNERS[-1]])
@pytest.mark.parametrize("budget", [None, 32])
def test_staging_is_bounded_when_every_waiting_request_is_a_hit(engines, v2, async_scheduling, budget):
    """vLLM's waiting loop skips a request ensure_cache_available holds and looks at the
    next (a held request takes no token budget), so one step meets every waiting
    request's hits: without a bound (``budget`` None: far more than all of them) the
    first step stages all twelve at once on the worker's device. With
    ``stage_max_embeds`` 32 (two items of 16) never more than two are held staged; the
    requests whose hits find no room wait for it (bounded by stage_wait_ms) instead of
    encoding them: every item is loaded, none encoded again, every answer is the same,
    and nothing fails."""
    kw = {"stage_max_embeds": budget} if budget is not None else {"stage_max_embeds": 1 << 20}
    e = engines(v2=v2, async_scheduling=async_scheduling, **kw)
    hashes = [f"{i:02x}" * 32 for i in range(0x30, 0x3C)]
    store(e, *hashes)
    requests = [make_request(f"r{i}", [h]) for i, h in enumerate(hashes)]
    for r in requests:
        e.add(r)
    link = e.worker.connector_worker.link
    most_held = 0
    for _ in range(50):
        if not e.has_work():
            break
        e.step()
        most_held = max(most_held, len(link.held()))
    assert not e.has_work()
    assert_answers_unchanged(e, requests)
    assert not e.errors and e.worker.load_failures == 0
    if budget is None:
        assert most_held == len(hashes)  # the hazard: all of them in one step
        assert e.worker.loads == len(hashes)
    else:
        assert most_held <= 2, most_held
        assert e.sched_connector.stage_over_budget > 0
        assert e.worker.loads == len(hashes)  # waited for room: none encoded again
