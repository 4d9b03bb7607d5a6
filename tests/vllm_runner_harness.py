"""vLLM engine steps in-process on CPU: vLLM's own Scheduler (or AsyncScheduler), the
model runners' EC call sequences, a stub encoder, and the connector on a real broker.

What is vLLM's own code here, and what is emulated:

- scheduler side: vLLM's ``Scheduler`` / ``AsyncScheduler`` built from a real
  ``VllmConfig`` (the tiny Qwen2-VL's ``ModelConfig``), the way vLLM's scheduler tests
  build one (``tests/v1/core/utils.py: create_scheduler``); it creates the
  scheduler-side connector itself (``ECConnectorFactory``) and calls every hook;
  ``update_from_output`` takes a ``ModelRunnerOutput``;
- worker side: the worker connector is vLLM's process-global EC agent
  (``ensure_ec_transfer_initialized``), driven by the runners' real EC wrappers:
  V1 ``ECConnectorModelRunnerMixin.maybe_get_ec_connector_output`` and
  ``GPUModelRunner._batch_mm_inputs_from_scheduler``; V2 ``ActiveECConnector``
  (``worker/gpu/ec_connector.py``), ``EncoderCache`` and
  ``EncoderRunner.prepare_mm_inputs`` (0.33's ``EncoderCache`` with
  ``update_encoder_inputs`` when its source is given);
- emulated (no GPU, no model): the runners' request bookkeeping
  (``_update_states`` / ``finish_requests`` + ``add_requests``), the encoder (a
  deterministic tensor per mm_hash: ``stub_encode``) and the gather's cache check
  (vLLM raises ``RuntimeError("Encoder cache miss for ...")``); the V2 LoRA mapping
  is recorded as the set of items ``set_active_mm_loras`` saw.

Executors: ``together`` pickles the SchedulerOutput as one message (multiprocess
executor's MessageQueue), ``inprocess`` passes the object (uni / external_launcher),
``apart`` ships the connector metadata in its own message (what a vLLM change or
another executor would do).

Pipeline parallel (``pp``): vLLM's scheduler with ``pipeline_parallel_size`` set
(``use_pp``), as many batches in flight as vLLM's ``max_concurrent_batches`` (the
EngineCore's batch queue), the runner being the first PP rank's (the only one that
runs the EC hooks and the encoder). With the V1 runner, its EC output never reaches
the scheduler (0.32/0.33's V1 runner returns IntermediateTensors on a non-last PP
rank and drops ``ec_connector_output``; the last rank runs no EC hook); the V2
runner passes it on. Data parallel: one ``Engine`` per DP rank (each its own
scheduler, connectors and runner, as vLLM's DP engine cores), stepped in turn;
each installs its worker connector as vLLM's process-global EC agent for its step."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import pickle
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin
from vllm.v1.worker.gpu.ec_connector import ActiveECConnector
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache as EncoderCache032
from vllm.v1.worker.gpu.mm.encoder_runner import EncoderRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

HIDDEN = 128  # the tiny Qwen2-VL's hidden size (its encoder's output width)
BLOCK = 16
TOKEN = 7  # what the stub model samples


def stub_encode(mm_hash: str, num_embeds: int) -> torch.Tensor:
    """The stub encoder: a deterministic output per item (its mm_hash)."""
    seed = int.from_bytes(hashlib.blake2b(mm_hash.encode(), digest_size=4).digest(), "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_embeds, HIDDEN, generator=gen).to(torch.bfloat16)


def make_config(
    model_config: ModelConfig,
    socket_path: str,
    *,
    v2: bool = False,
    async_scheduling: bool = False,
    priority: bool = False,
    max_num_batched_tokens: int = 512,
    long_prefill_token_threshold: int = 0,
    pp: int = 1,
    **extra: object,
) -> VllmConfig:
    sc = SchedulerConfig(
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=model_config.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy="priority" if priority else "fcfs",
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=sc,
        cache_config=CacheConfig(block_size=BLOCK),
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config={"socket_path": socket_path, **extra},
        ),
    )
    # The CPU platform forces both off (platforms/cpu.py; "Model Runner V2 requires
    # Triton"); on GPUs both are on by default. The scheduler reads async_scheduling
    # from here and use_v2_model_runner (a property) once, at init: Engine sets it.
    config.scheduler_config.async_scheduling = async_scheduling
    config.parallel_config.pipeline_parallel_size = pp  # the scheduler reads it at init
    V2_RUNNER[id(config)] = v2
    return config


V2_RUNNER: dict[int, bool] = {}  # id(VllmConfig) -> whether its engine runs the V2 runner


def make_request(
    req_id: str,
    hashes: list[str],
    *,
    num_embeds: int = 16,
    text: int = 4,
    priority: int = 0,
    max_tokens: int = 1,
    tail: int | None = None,
) -> Request:
    """A prompt of ``text`` tokens, then per item its ``num_embeds`` placeholders
    followed by ``tail`` (default: ``text``) tokens."""
    features = []
    tokens: list[int] = [1] * text
    for mm_hash in hashes:
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                modality="image",
                identifier=mm_hash,
                mm_position=PlaceholderRange(offset=len(tokens), length=num_embeds),
            )
        )
        tokens += [5] * num_embeds + [1] * (text if tail is None else tail)
    init_none_hash(sha256)
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        mm_features=features,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, sha256),  # prefix caching is on
    )


def load_encoder_cache_033(src: Path) -> type:
    """vLLM 0.33's V2 ``EncoderCache`` (with ``update_encoder_inputs``), loaded from its
    extracted source into the installed vLLM."""
    path = src / "vllm/v1/worker/gpu/mm/encoder_cache.py"
    spec = importlib.util.spec_from_file_location("vllm033_encoder_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.EncoderCache


def encoder_input_updates_033(src: Path, scheduler: Scheduler) -> Callable[..., dict]:
    """vLLM 0.33's ``Scheduler._get_encoder_input_updates`` (its source, compiled here)
    bound to a 0.32 scheduler: what 0.33 puts in ``SchedulerOutput.encoder_input_updates``."""
    tree = ast.parse((src / "vllm/v1/core/sched/scheduler.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    (fn,) = [n for n in cls.body if getattr(n, "name", "") == "_get_encoder_input_updates"]
    namespace: dict[str, Any] = {
        "MultiModalKwargsItem": MultiModalKwargsItem,
        "NewRequestData": Any,
        "annotations": None,
    }
    module = ast.Module(
        body=[ast.ImportFrom("__future__", [ast.alias("annotations")], 0), fn], type_ignores=[]
    )
    exec(compile(ast.fix_missing_locations(module), str(src), "exec"), namespace)
    scheduler._pending_encoder_input_ids = {}  # type: ignore[attr-defined]
    return namespace["_get_encoder_input_updates"].__get__(scheduler)


class V1Runner:
    """GPUModelRunner's EC sequence (0.32/0.33 alike): _update_states, then inside
    ``maybe_get_ec_connector_output`` (bind, start_save_caches, start_load_caches)
    ``_execute_mm_encoder`` (vLLM's ``_batch_mm_inputs_from_scheduler``, save_caches
    per output) and ``_gather_mm_embeddings``."""

    def __init__(self, tower_lora: bool = False) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.tower_lora = tower_lora

    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(
                mm_features=new.mm_features, num_computed_tokens=new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].num_computed_tokens = computed

    def execute(self, so: SchedulerOutput) -> tuple[Any, dict[str, torch.Tensor]]:
        self.update_states(so)
        if not so.total_num_scheduled_tokens:
            # GPUModelRunner.execute_model returns EMPTY_MODEL_RUNNER_OUTPUT before any
            # EC hook in a step that schedules nothing (0.32/0.33; V2 has no_forward).
            return None, {}
        with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
            so, encoder_cache=self.encoder_cache
        ) as ec_output:
            hashes, kwargs, refs = GPUModelRunner._batch_mm_inputs_from_scheduler(self, so)
            if self.tower_lora:  # the tower LoRA mapping indexes the step's batch
                for req_id, _ in refs:
                    if req_id not in so.num_scheduled_tokens:
                        raise KeyError(req_id)
            for mm_hash, (_, _), (_, pos) in zip(hashes, kwargs, refs, strict=True):
                self.encoder_cache[mm_hash] = stub_encode(mm_hash, pos.get_num_embeds())
                ECConnectorModelRunnerMixin.maybe_save_ec_to_connector(self.encoder_cache, mm_hash)
            gathered = gather(so, self.requests, self.encoder_cache)
        return ec_output, gathered


class V2Runner:
    """The V2 model runner's EC sequence (``worker/gpu/model_runner.py``):
    finish_requests (finished and preempted requests removed), free_states,
    add_requests, 0.33's encoder_input_updates, set_active_mm_loras (recorded), then in
    ``ActiveECConnector.maybe_get_output`` the model state's ``execute_mm_encoder``
    (vLLM's ``EncoderRunner.prepare_mm_inputs``) and the gather; save_caches after."""

    def __init__(self, config: VllmConfig, encoder_cache_cls: type = EncoderCache032) -> None:
        self.encoder_cache = encoder_cache_cls()
        self.requests: dict[str, SimpleNamespace] = {}
        self.ec = ActiveECConnector(config, self.encoder_cache.encoder_outputs)
        self.lora_items: set[tuple[str, int]] | None = None

    def execute(self, so: SchedulerOutput) -> tuple[Any, dict[str, torch.Tensor]]:
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.requests.pop(req_id, None)
            self.encoder_cache.remove_request(req_id)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.free_encoder_cache(mm_hash)
        for new in so.scheduled_new_reqs:
            self.encoder_cache.add_request(new.req_id, new.mm_features)
            self.requests[new.req_id] = SimpleNamespace(num_computed_tokens=new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].num_computed_tokens = computed
        for req_id, updates in getattr(so, "encoder_input_updates", {}).items():
            self.encoder_cache.update_encoder_inputs(req_id, updates)
        scheduled_encoder_inputs = so.scheduled_encoder_inputs
        # set_active_mm_loras: the mapping is built here, before the connector runs.
        self.lora_items = {(r, i) for r, ids in scheduled_encoder_inputs.items() for i in ids}
        with self.ec.maybe_get_output(so) as ec_output:
            stub = SimpleNamespace(encoder_cache=self.encoder_cache, device="cpu")
            hashes, kwargs = EncoderRunner.prepare_mm_inputs(stub, scheduled_encoder_inputs)
            sizes = {
                f.identifier: f.mm_position.get_num_embeds()
                for feats in self.encoder_cache.mm_features.values()
                for f in feats
            }
            for mm_hash in hashes:
                self.encoder_cache.encoder_outputs[mm_hash] = stub_encode(mm_hash, sizes[mm_hash])
            features = {
                r: SimpleNamespace(
                    mm_features=self.encoder_cache.mm_features[r],
                    num_computed_tokens=self.requests[r].num_computed_tokens,
                )
                for r in so.num_scheduled_tokens
            }
            gathered = gather(so, features, self.encoder_cache.encoder_outputs)
        return ec_output, gathered


def gather(
    so: SchedulerOutput, requests: dict[str, SimpleNamespace], cache: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The runners' gather: every item overlapping a request's scheduled window must be
    in the encoder cache (vLLM raises "Encoder cache miss" otherwise)."""
    out = {}
    for req_id, n in so.num_scheduled_tokens.items():
        state = requests[req_id]
        start = state.num_computed_tokens
        for feature in state.mm_features:
            pos = feature.mm_position
            if pos.offset < start + n and start < pos.offset + pos.length:
                tensor = cache.get(feature.identifier)
                if tensor is None:
                    raise RuntimeError(f"Encoder cache miss for {feature.identifier}.")
                out[feature.identifier] = tensor
    return out


class Engine:
    """vLLM's EngineCore loop, in one process: schedule, ship, execute, update."""

    def __init__(
        self,
        config: VllmConfig,
        *,
        executor: str = "together",
        encoder_cache_cls: type | None = None,
        num_blocks: int = 400,
        tower_lora: bool = False,
        next_src: Path | None = None,
    ) -> None:
        """``next_src``: vLLM 0.33's sources: its V2 EncoderCache and the
        encoder_input_updates its scheduler computes before build_connector_meta."""
        assert executor in ("together", "inprocess", "apart")
        self.config = config
        self.executor = executor
        kv = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32
                    ),
                )
            ],
        )
        config.cache_config.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        self.v2 = V2_RUNNER.get(id(config), False)
        self.scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.scheduler.use_v2_model_runner = self.v2
        # Another Engine's worker connector (a DP rank) stays open: that Engine owns it.
        ec_transfer_state._EC_CONNECTOR_AGENT = None
        ec_transfer_state.ensure_ec_transfer_initialized(config)
        self.worker = ec_transfer_state.get_ec_transfer()
        self.scheduler.ec_connector.wait_for_link(30)  # as a served engine's, up at once
        pp = config.parallel_config.pipeline_parallel_size
        # vLLM's max_concurrent_batches (config/vllm.py) for this runner
        if config.scheduler_config.async_scheduling:
            self.depth = pp + 1 if self.v2 else max(pp, 2)
        else:
            self.depth = pp
        # The V1 runner on a first PP rank that is not the last drops its EC output.
        self.ec_output_reaches_scheduler = pp == 1 or self.v2
        if next_src is not None:
            encoder_cache_cls = load_encoder_cache_033(next_src)
            updates = encoder_input_updates_033(next_src, self.scheduler)
            build = self.scheduler.ec_connector.build_connector_meta

            def build_033(so: SchedulerOutput) -> Any:
                so.encoder_input_updates = updates(  # type: ignore[attr-defined]
                    so.num_scheduled_tokens, so.scheduled_new_reqs, so.scheduled_encoder_inputs
                )
                return build(so)

            self.scheduler.ec_connector.build_connector_meta = build_033
        self.runner: V1Runner | V2Runner = (
            V2Runner(config, encoder_cache_cls or EncoderCache032)
            if self.v2
            else V1Runner(tower_lora)
        )
        self.before_worker: Callable[[SchedulerOutput], None] | None = None
        self.gathered: dict[str, dict[str, torch.Tensor]] = {}  # req_id -> mm_hash -> embeds
        self.outputs: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}
        self._inflight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @property
    def sched_connector(self) -> Any:
        return self.scheduler.ec_connector

    def close(self) -> None:
        self.sched_connector.shutdown()
        self.worker.shutdown()
        if ec_transfer_state._EC_CONNECTOR_AGENT is self.worker:
            ec_transfer_state._EC_CONNECTOR_AGENT = None

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def ship(self, so: SchedulerOutput) -> SchedulerOutput:
        if self.executor == "inprocess":
            return so
        if self.executor == "together":
            return pickle.loads(pickle.dumps(so))
        meta = so.ec_connector_metadata
        so.ec_connector_metadata = None
        shipped = pickle.loads(pickle.dumps(so))
        so.ec_connector_metadata = meta
        shipped.ec_connector_metadata = pickle.loads(pickle.dumps(meta))
        return shipped

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        if self.before_worker is not None:
            self.before_worker(so)
        shipped = self.ship(so)
        ec_transfer_state._EC_CONNECTOR_AGENT = self.worker  # this engine's (DP rank's)
        ec_output, gathered = self.runner.execute(shipped)
        if not self.ec_output_reaches_scheduler:
            ec_output = None
        for req_id in so.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            for f in request.mm_features:
                if f.identifier in gathered:
                    self.gathered.setdefault(req_id, {})[f.identifier] = gathered[f.identifier]
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            # request.num_computed_tokens already counts this step (_update_after_schedule)
            done = request.num_computed_tokens >= request.num_prompt_tokens
            sampled.append([TOKEN] if done else [])
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            ec_connector_output=pickle.loads(pickle.dumps(ec_output)),
        )
        self._inflight.append((so, out))
        while len(self._inflight) >= self.depth or (self._inflight and not self.has_work()):
            self._update(*self._inflight.popleft())
        # The stagings this step's lookups ordered settle before the next step (the
        # link's thread is quick but not instant): every run takes the same steps.
        self.sched_connector.wait_for_staging(5.0)
        return so

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        outputs = self.scheduler.update_from_output(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None and o.finish_reason.name == "ERROR":
                    self.errors[o.request_id] = str(o.finish_reason)

    def run(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not self.has_work() and not self._inflight:
                return
            self.step()
        raise AssertionError("requests still running after max_steps")
