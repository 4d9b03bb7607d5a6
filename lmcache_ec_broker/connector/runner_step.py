"""The step the model runner is executing, seen from the worker connector's hook.

A failed load is encoded in the same step by adding ``(request, item)`` to the dict
the runner encodes from right after ``start_load_caches`` returns: its
``SchedulerOutput.scheduled_encoder_inputs``. The connector's metadata carries a
reference to that dict, which holds only while the metadata travels in the same
pickled message as the SchedulerOutput. Rather than trust the transport, the worker
finds the runner's own SchedulerOutput: vLLM's EC wrappers call
``start_load_caches`` from a frame that holds it as the local ``scheduler_output``
(V1: ``ECConnectorModelRunnerMixin._get_ec_connector_output``; V2:
``ActiveECConnector.maybe_get_output``; the same in 0.32 and 0.33, checked by
tests/test_vllm_compat.py). It is the runner's step exactly when its
``ec_connector_metadata`` is the metadata bound to this connector (the runner binds
that very attribute), whatever executor or serialisation carried them.

Only called after a load failed: the walk costs a few microseconds, never on a
step whose loads all succeed."""

from __future__ import annotations

import sys
from typing import Any

MAX_DEPTH = 8  # frames above the hook searched (the wrappers are 1-2 frames up)


def runner_step(metadata: Any) -> Any | None:
    """The SchedulerOutput the runner executes now, or None if it cannot be found."""
    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        step = frame.f_locals.get("scheduler_output")
        if step is not None and getattr(step, "ec_connector_metadata", None) is metadata:
            inputs = getattr(step, "scheduled_encoder_inputs", None)
            if isinstance(inputs, dict):
                return step
    return None
