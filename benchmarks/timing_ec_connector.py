"""A connector that times its own per-step hooks, for ``benchmarks/tp_step_cost.py``;
loaded by a real ``vllm serve`` through ``ec_connector_module_path`` (the benchmark
puts this directory on PYTHONPATH, after the tree whose connector it measures, so
the same file measures today's connector and an older checkout's).

Each worker rank logs one line per step in which its runner called the EC hooks
(the step's ``bind_connector_metadata`` .. ``clear_connector_metadata``): the loads
the step's metadata carried and the time spent inside the connector's hooks of that
step (``save_caches``, the put of what the encoder just computed, is listed apart:
a miss's cost, not a step's). The scheduler logs one line per step from
``build_connector_meta``: its hooks' time since the previous one (per request:
``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc``; per
step: ``build_connector_meta``, ``update_connector_output``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.logger import init_logger

from lmcache_ec_broker.connector.vllm import ECBrokerConnector

logger = init_logger("vllm.timing_ec_connector")
LINE = "EC step hooks: role=%s rank=%s loads=%d hooks_us=%.1f load_us=%.1f save_us=%.1f"


def _rank() -> str:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return str(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (the scheduler): the process
        return f"pid{os.getpid()}"


class TimingECBrokerConnector(ECBrokerConnector):
    _hooks_s = 0.0
    _load_s = 0.0
    _save_s = 0.0
    _loads = 0

    def _timed(self, name: str, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self._hooks_s += time.perf_counter() - t0

    # worker, once per step with EC hooks
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._hooks_s = self._load_s = self._save_s = 0.0
        self._loads = len(getattr(connector_metadata, "loads", ()) or ())
        self._timed("bind_connector_metadata", connector_metadata)

    def start_save_caches(self, *args: Any, **kwargs: Any) -> None:
        self._timed("start_save_caches", *args, **kwargs)

    def start_load_caches(self, *args: Any, **kwargs: Any) -> None:
        before = self._hooks_s
        self._timed("start_load_caches", *args, **kwargs)
        self._load_s = self._hooks_s - before

    def save_caches(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            super().save_caches(*args, **kwargs)
        finally:
            self._save_s += time.perf_counter() - t0

    def get_finished(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("get_finished", *args, **kwargs)

    def build_connector_worker_meta(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("build_connector_worker_meta", *args, **kwargs)

    def clear_connector_metadata(self) -> None:
        self._timed("clear_connector_metadata")
        if self.connector_worker is not None:
            logger.info(
                LINE, "worker", _rank(), self._loads, self._hooks_s * 1e6, self._load_s * 1e6,
                self._save_s * 1e6,
            )  # fmt: skip

    # scheduler, per request and per step
    def ensure_cache_available(self, *args: Any, **kwargs: Any) -> bool:
        return self._timed("ensure_cache_available", *args, **kwargs)

    def has_cache_item(self, *args: Any, **kwargs: Any) -> bool:
        return self._timed("has_cache_item", *args, **kwargs)

    def update_state_after_alloc(self, *args: Any, **kwargs: Any) -> None:
        self._timed("update_state_after_alloc", *args, **kwargs)

    def update_connector_output(self, *args: Any, **kwargs: Any) -> None:
        self._timed("update_connector_output", *args, **kwargs)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._timed("build_connector_meta", scheduler_output)
        loads = len(getattr(meta, "loads", ()) or ())
        logger.info(LINE, "scheduler", "-", loads, self._hooks_s * 1e6, 0.0, 0.0)
        self._hooks_s = 0.0
        return meta
