"""The worker's counters (loads, failed loads, re-encodes, puts, timeouts) reach the
"EC Transfer metrics" line vLLM's own stat logger prints, on the V1 runner as on V2
(issue 30, item 9).

Driven through vLLM's own code in-process (tests/vllm_runner_harness.py): its
Scheduler, the runners' EC wrappers (V1: ECConnectorModelRunnerMixin, V2:
ActiveECConnector), ``Scheduler.update_from_output`` building the SchedulerStats,
and ``LoggingStatLogger`` (the logger ``vllm serve`` runs) consuming them; a real
broker. The encoder is a stub (no GPU, no model)."""

from __future__ import annotations

import os
import sys

import pytest
from vllm.config import ModelConfig
from vllm.v1.metrics import loggers as vllm_loggers

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.vllm.meta import WORKER_STAT_FIELDS
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_runner_harness import Engine, make_config, make_request, stub_encode  # noqa: E402


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    return ModelConfig(model=str(build_tiny_qwen2vl(root)), dtype="bfloat16", max_model_len=512)


def _logged_ec_metrics(engine: Engine, stats: list) -> dict[str, int]:
    """What vLLM's LoggingStatLogger prints for these SchedulerStats, parsed."""
    stat_logger = vllm_loggers.LoggingStatLogger(engine.config)
    for s in stats:
        stat_logger.record(scheduler_stats=s, iteration_stats=None)
    lines: list[str] = []

    def capture(fmt: str, *args: object) -> None:
        lines.append(fmt % args)

    logger = vllm_loggers.logger
    real = logger.info, logger.debug
    logger.info = logger.debug = capture  # an idle engine logs at debug
    try:
        stat_logger.log()
    finally:
        logger.info, logger.debug = real
    ec = [line for line in lines if line.startswith("EC Transfer metrics: ")]
    assert len(ec) == 1, lines
    pairs = ec[0].removeprefix("EC Transfer metrics: ").split(", ")
    return {k: int(v) for k, v in (p.split("=") for p in pairs)}


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_worker_counters_reach_vllms_logged_ec_stats(model_config, broker, v2) -> None:
    # Fails on the old connector with v1: the line had ec_hits/ec_misses only (the V1
    # runner never asks a worker for its stats). v2 guards against counting twice.
    engine = Engine(
        make_config(
            model_config, broker.socket_path, v2=v2, worker_budget_ms=5000, scheduler_budget_ms=5000
        )
    )
    stats: list = []
    update = engine.scheduler.update_from_output

    def update_from_output(*a, **kw):
        outputs = update(*a, **kw)
        stats.extend(eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats)
        return outputs

    engine.scheduler.update_from_output = update_from_output
    try:
        x, y = "a1" * 32, "b2" * 32  # vLLM content hashes: 64 hex digits
        for h in (x, y):  # another instance's outputs
            engine.worker.save_caches({h: stub_encode(h, 16)}, h)

        part = engine.worker.connector_worker
        fetch = part.fetch

        def delete_x(keys: list[str], device: str):  # x vanishes before it is staged
            with BrokerClient(broker.socket_path) as c:
                c.delete(engine.sched_connector.key(x))
            return fetch(keys, device)

        part.fetch = delete_x
        for r in (make_request("a", [x, y]), make_request("b", ["c3" * 32])):
            engine.add(r)
        engine.run()
        assert not engine.errors
        worker = engine.worker
        logged = _logged_ec_metrics(engine, stats)
    finally:
        engine.close()
    assert worker.loads == 1 and worker.load_failures == 1 and worker.staged == 1
    want = {name: getattr(worker, name) for name in WORKER_STAT_FIELDS if getattr(worker, name)}
    assert {k: logged.get(k, 0) for k in want} == want
    assert logged["ec_hits"] == 1 and logged["ec_misses"] == 2
    assert not set(logged) - {"ec_hits", "ec_misses", *want}
    # The scheduler's connector now knows them too (its stats() is per role).
    assert {k: engine.sched_connector.stats()[k] for k in want} == want
