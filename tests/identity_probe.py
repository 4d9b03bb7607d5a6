"""One real in-process vLLM engine (offline ``LLM``) in one of the configurations of
tests/test_identity.py, driven through the requests that test needs; prints what the
connector did as JSON on the last line. One engine per process (vLLM's globals).

argv: scenario, model dir, broker socket. Scenarios:

- ``dummy``: ``load_format="dummy"``; image 1, then image 3 with a client UUID.
- ``launcher``: ``external_launcher`` (one rank, as colocated RL runs it) with
  ``client_uuid_namespace``; image 1, image 2, image 3 with a client UUID; then the
  trainer's ``model.load_weights`` called directly on the worker's model; image 2
  twice.
- ``tp2``: TP 2 (``mp``); image 2.
- ``numbering``: ``mm_processor_cache_gb=0`` and no prefix caching; images 4 and 5.
- ``plain``: the default configuration; image 1.
- ``overrides``: ``hf_overrides`` (a vision-config key); image 1.
- ``mm_kwargs``: server-level ``mm_processor_kwargs`` (``max_pixels``: fewer image
  tokens); image 1.
"""

from __future__ import annotations

import json
import os
import sys

SCENARIO, MODEL, SOCKET = sys.argv[1:4]
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if SCENARIO == "launcher":  # torchrun's variables for a world of one
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from lmcache_ec_broker.testing.ports import free_ports  # noqa: E402

    os.environ["MASTER_PORT"] = str(free_ports(1))
if SCENARIO == "tp2":  # vLLM's CPU build binds every rank to NUMA node 0's cores otherwise
    cores = os.cpu_count() or 1
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0|{1 % cores}"

from vllm import LLM, SamplingParams  # noqa: E402

from lmcache_ec_broker.testing.vllm_server import png_data_url  # noqa: E402

UUID = "tenant-a/cat.png"


def main() -> None:
    extra: dict[str, object] = {
        "socket_path": SOCKET,
        "scheduler_budget_ms": 5000,
        "worker_budget_ms": 5000,
    }
    kwargs: dict[str, object] = {}
    if SCENARIO == "dummy":
        kwargs["load_format"] = "dummy"
    elif SCENARIO == "launcher":
        kwargs["distributed_executor_backend"] = "external_launcher"
        extra["client_uuid_namespace"] = "tenant-a"
    elif SCENARIO == "tp2":
        kwargs.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    elif SCENARIO == "numbering":
        kwargs.update(mm_processor_cache_gb=0, enable_prefix_caching=False)
    elif SCENARIO == "overrides":
        kwargs["hf_overrides"] = {"vision_config": {"initializer_range": 0.05}}
    elif SCENARIO == "mm_kwargs":
        kwargs["mm_processor_kwargs"] = {"max_pixels": 56 * 56}
    kwargs.setdefault("distributed_executor_backend", "uni")
    llm = LLM(
        model=MODEL,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        dtype="bfloat16",
        limit_mm_per_prompt={"image": 1, "video": 0},
        kv_cache_memory_bytes=64 << 20,
        ec_transfer_config={
            "ec_connector": "ECBrokerConnector",
            "ec_role": "ec_both",
            "ec_connector_module_path": "lmcache_ec_broker.connector.vllm",
            "ec_connector_extra_config": extra,
        },
        **kwargs,
    )
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler.ec_connector
    report: dict[str, object] = {"field": sched.model_id}

    last_hash: list[str] = [""]  # the identifier vLLM last asked the connector about
    has_cache_item = sched.has_cache_item

    def recording(identifier: str, *args: object, **kwargs: object) -> bool:
        last_hash[0] = identifier
        return has_cache_item(identifier, *args, **kwargs)

    sched.has_cache_item = recording

    def ask(seed: int, uuid: str | None = None) -> dict[str, object]:
        """One chat request (reset vLLM's own encoder cache after it); the connector
        counters it moved and its answer."""
        before = sched.stats()
        part: dict[str, object] = {"type": "image_url", "image_url": {"url": png_data_url(seed)}}
        if uuid is not None:
            part["uuid"] = uuid
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "describe"}]}]
        out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        core.reset_encoder_cache()
        after = sched.stats()
        moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        return {**moved, "tokens": list(out[0].outputs[0].token_ids)}

    if SCENARIO == "dummy":
        report["image1"] = ask(1)
        report["uuid"] = ask(3, UUID)
    elif SCENARIO == "launcher":
        report["image1"] = ask(1)
        report["image2"] = ask(2)
        report["uuid"] = ask(3, UUID)
        ids = getattr(sched, "_ids", None)  # None on code before issue 39
        report["uuid_key_part"] = ids.item_key(UUID) if ids is not None else UUID
        # Colocated RL: the trainer hands new weights to the model directly, as
        # external_launcher deployments do (no engine call, no collective_rpc).
        model = llm.llm_engine.model_executor.driver_worker.worker.get_model()
        name, param = next((n, p) for n, p in model.named_parameters() if n.startswith("visual."))
        model.load_weights([(name, (param.detach().float() + 0.5).to(param.dtype))])
        report["after_update"] = ask(2)
        report["again"] = ask(2)
        report["field_after_update"] = sched.model_id
    elif SCENARIO == "tp2":
        report["image2"] = ask(2)
    elif SCENARIO == "numbering":
        report["image4"] = ask(4)
        report["image5"] = ask(5)
    elif SCENARIO in ("plain", "overrides", "mm_kwargs"):
        report["image1"] = ask(1)
        report["image1_hash"] = last_hash[0]
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
