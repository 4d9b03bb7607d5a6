"""Fault injection for the e2e tests, loaded by a real vLLM through
``ec_connector_module_path`` (PYTHONPATH points here).

Armed by the test through the file named by $LMCACHE_EC_FAULT_FILE; the fault
fires at the next staging fetch of a worker (the moment between the scheduler's
lookup and the worker's copy of the entry, docs/design.md "Staged loads"), once,
then the file is gone:

- ``drop``: delete the entries being staged from the broker (a restart, ``clear``);
- ``kill PID``: SIGKILL the broker process PID;
- ``fail-rank R``: on tensor-parallel rank R only, the staging gets nothing (the
  other ranks stage normally).

Pacing: while the file ``$LMCACHE_EC_FAULT_FILE.pace`` exists, every worker step
first sleeps the seconds it holds, so a long request stays in the engine for as
many steps as it has tokens, however fast or loaded the host: a test holds a
request decoding until what it waits for has happened, then removes the file.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from lmcache_ec_broker.connector.vllm import ECBrokerConnector
from lmcache_ec_broker.connector.vllm.worker import ECBrokerWorker

FAULT_FILE_ENV = "LMCACHE_EC_FAULT_FILE"
PACE_SUFFIX = ".pace"


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().rank_in_group


def _pace() -> None:
    """Sleep as long as the pace file says, if there is one (every step, see above)."""
    try:
        with open(os.environ.get(FAULT_FILE_ENV, "") + PACE_SUFFIX) as f:
            seconds = float(f.read() or 0)
    except (OSError, ValueError):
        return
    time.sleep(min(seconds, 5.0))


class _WorkerWithFaults(ECBrokerWorker):
    def fetch(self, keys: list[str], device: str) -> list[torch.Tensor | None]:
        if _fire(self._client(), keys):  # "fail-rank": this rank gets nothing
            return [None] * len(keys)
        return super().fetch(keys, device)


class ECBrokerConnectorWithFaults(ECBrokerConnector):
    worker_class = _WorkerWithFaults

    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None:
        _pace()
        super().start_load_caches(encoder_cache, **kwargs)


def _fire(client: Any, keys: list[str]) -> bool:
    """Fire the armed fault, if any, at this staging fetch; True: fail this fetch."""
    path = os.environ.get(FAULT_FILE_ENV, "")
    try:
        with open(path) as f:
            fault = f.read().split()
    except OSError:
        return False
    if not fault:
        return False
    if fault[0] == "fail-rank" and int(fault[1]) != _tp_rank():
        return False  # armed for another rank: leave it to that one
    try:
        os.unlink(path)  # once
    except FileNotFoundError:
        return False  # another process fired it
    if fault[0] == "drop":
        for key in keys:
            client.delete(key)
    elif fault[0] == "kill":
        os.kill(int(fault[1]), signal.SIGKILL)
    elif fault[0] == "fail-rank":
        return True
    return False
