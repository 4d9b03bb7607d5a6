"""Scheduler-side rules that keep every promised load re-encodable in its step.

A load the scheduler ships (``has_cache_item`` True) is re-encoded by the runner in
the same step if it fails (``vllm_worker._encode_instead``). That needs the request
in the runner's step and its multimodal inputs on the worker. ``StepGuard`` (a part
the scheduler's ``ECBrokerConnector`` holds) keeps these invariants:

- **A load is shipped only for a request scheduled in its step.** vLLM's priority
  scheduler can preempt a request later in the same step it was scheduled in (after
  ``update_state_after_alloc``); its item stays in vLLM's encoder cache (freeable), so
  the worker must hold it when the request, or another, next reads it. Such a load
  is not shipped (the V2 runner removed the request: a failed load could not be
  re-encoded) but *owed*: in a later step, the first scheduled request that reads the
  item while vLLM neither encodes nor loads it gets the load, re-encodable through
  it. The debt ends there, or when vLLM frees the item (``free_encoder_mm_hashes``).
- **No load is promised for an item whose inputs the worker released.** vLLM 0.33's
  V2 scheduler sends ``encoder_input_updates``: ``None`` drops an item's inputs on
  the worker once consumed, a payload restores them. A request rewound after that
  could load the item with nothing to re-encode it from; the connector mirrors the
  updates and answers such an item as a miss (vLLM then encodes it and restores its
  inputs itself).
- **No load at all where a re-encode cannot be made consistent** (decided at
  start-up, ``loads_off_reason``): ``external_launcher`` with more than one rank
  (every rank runs its own scheduler and its own lookups, so ranks could disagree
  on what to encode), and the V2 runner with tower/connector LoRA
  (``enable_tower_connector_lora``: ``set_active_mm_loras`` builds the tower mapping
  before ``start_load_caches``, so a re-encoded item would be encoded without its
  mapping; LoRA on the language model alone leaves loads on). The connector still
  saves; lookups are misses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_ec_broker.connector.vllm_meta import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request


def loads_off_reason(vllm_config: Any) -> str:
    """Why this configuration must never promise a load; "" if it may."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "pipeline_parallel_size", 1) or 1
    )
    if backend == "external_launcher" and ranks > 1:
        return (
            "external_launcher runs one scheduler per rank: their lookups could disagree "
            "on which items to encode"
        )
    lora = getattr(vllm_config, "lora_config", None)
    # Only tower/connector LoRA changes the encoder's output (issue 39): with LoRA on the
    # language model alone the V2 runner's tower mapping is empty and loads are safe.
    if lora is not None and getattr(lora, "enable_tower_connector_lora", False):
        try:
            v2 = bool(vllm_config.use_v2_model_runner)
        except Exception:  # an older vLLM without the V2 runner
            v2 = False
        if v2:
            return (
                "the V2 model runner with tower/connector LoRA builds the tower LoRA mapping "
                "before start_load_caches: a failed load could not be re-encoded with it"
            )
    return ""


class StepGuard:
    """A part of the scheduler's connector (created by it, given the vLLM config and
    the encoder output width per modality); owns the requests of the step, the owed
    loads and the released inputs."""

    def __init__(self, vllm_config: Any, width: Callable[[str], int | None]) -> None:
        self.loads_off = loads_off_reason(vllm_config)
        self._width = width
        # req_id -> (request, computed tokens) for requests vLLM asked about this step
        self._step_requests: dict[str, tuple[Request, int]] = {}
        self._owed: set[str] = set()  # items vLLM holds that the worker may lack
        # req_id -> item indices whose inputs the worker dropped (0.33 V2)
        self._released: dict[str, set[int]] = {}
        self.owed_loads = 0  # loads shipped to settle a debt (a counter, for tests)

    def note_request(self, request: Request, num_computed_tokens: int) -> set[str]:
        """ensure_cache_available's request; returns the hashes that must be a miss
        this step (their inputs are released on the worker)."""
        self._step_requests[request.request_id] = (request, num_computed_tokens)
        released = self._released.get(request.request_id)
        if not released:
            return set()
        return {request.mm_features[i].identifier for i in released}

    def guard_loads(self, scheduler_output: Any, loads: list[LoadSpec]) -> list[LoadSpec]:
        """The loads to ship with this step's metadata (see the module's invariants)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        self._track_inputs(scheduler_output)
        self._owed.difference_update(getattr(scheduler_output, "free_encoder_mm_hashes", ()))
        if scheduled is None:  # not a vLLM SchedulerOutput: nothing to check against
            self._step_requests = {}
            return loads
        # vLLM lists every request of the step in num_scheduled_tokens; a request
        # preempted later in the step is in preempted_req_ids and not there. (An output
        # scheduling nothing, as hand-built ones do, is checked by the preempted only.)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        kept = []
        for spec in loads:
            if spec.req_id in scheduled if scheduled else spec.req_id not in preempted:
                kept.append(spec)
            else:
                self._owed.add(spec.mm_hash)
        if self._owed:
            kept += self._settle(scheduler_output, scheduled, {s.mm_hash for s in kept})
        self._step_requests = {}
        return kept

    def _settle(
        self, scheduler_output: Any, scheduled: dict[str, int], shipped: set[str]
    ) -> list[LoadSpec]:
        encoded = {
            self._step_requests[r][0].mm_features[i].identifier
            for r, ids in (
                getattr(scheduler_output, "scheduled_encoder_inputs", None) or {}
            ).items()
            if r in self._step_requests
            for i in ids
        }
        extra = []
        for req_id, n in scheduled.items():
            entry = self._step_requests.get(req_id)
            if entry is None:
                continue
            request, computed = entry
            for index, feature in enumerate(request.mm_features):
                h = feature.identifier
                pos = feature.mm_position
                if h not in self._owed or h in shipped or h in encoded:
                    continue
                if not (pos.offset < computed + n and computed < pos.offset + pos.length):
                    continue  # not read in this step
                extra.append(
                    LoadSpec(
                        req_id,
                        h,
                        int(request.get_num_encoder_embeds(index))
                        if hasattr(request, "get_num_encoder_embeds")
                        else pos.length,
                        self._width(feature.modality),
                        index,
                    )
                )
                shipped.add(h)
                self._owed.discard(h)
                self.owed_loads += 1
        return extra

    def _track_inputs(self, scheduler_output: Any) -> None:
        """Mirror 0.33's encoder_input_updates (absent before: nothing is released)."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self._released.pop(new.req_id, None)  # (re)installed with its inputs
        for req_id in getattr(scheduler_output, "finished_req_ids", ()):
            self._released.pop(req_id, None)
        updates = getattr(scheduler_output, "encoder_input_updates", None)
        if not updates:
            return
        for req_id, per_item in updates.items():
            released = self._released.setdefault(req_id, set())
            for index, data in per_item.items():
                if data is None:
                    released.add(index)
                else:
                    released.discard(index)
            if not released:
                del self._released[req_id]
