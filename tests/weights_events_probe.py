"""Drive a real in-process vLLM engine (offline ``LLM``, uni executor) through every
weight event the CPU build can run, and print what the connector's model field did
(JSON on the last line). Run by tests/test_weights_identity.py in its own process.

argv: model dir (M1), model dir with other weights (M2), broker socket.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.ec_transfer import get_ec_transfer  # noqa: E402

from lmcache_ec_broker.connector.vllm.encoder_digest import encoder_parameters  # noqa: E402
from lmcache_ec_broker.testing.vllm_server import png_data_url  # noqa: E402

M1, M2, SOCKET = sys.argv[1:4]


def bump_lm(worker) -> None:
    """An RL-style update through collective_rpc that touches the language model only."""
    model = worker.get_model()
    name, param = next(iter(model.get_language_model().named_parameters()))
    with torch.no_grad():
        param.add_(1)


def load_visual(worker) -> None:
    """An RL-style update through collective_rpc + model.load_weights (checkpoint
    names) that changes one vision-tower tensor."""
    model = worker.get_model()
    name, param = next((n, p) for n, p in model.named_parameters() if n.startswith("visual."))
    new = param.detach().float() + 0.5
    model.load_weights([(name, new.to(param.dtype))])


def main() -> None:
    llm = LLM(
        model=M1,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        dtype="bfloat16",
        limit_mm_per_prompt={"image": 1, "video": 0},
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=64 << 20,
        ec_transfer_config={
            "ec_connector": "ECBrokerConnector",
            "ec_role": "ec_both",
            "ec_connector_module_path": "lmcache_ec_broker.connector.vllm",
            "ec_connector_extra_config": {
                "socket_path": SOCKET,
                "scheduler_budget_ms": 2000,
                "worker_budget_ms": 2000,
            },
        },
    )
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler.ec_connector
    worker = get_ec_transfer()
    report: dict[str, object] = {"static": sched.model_id}

    def fields() -> list[object]:
        return [sched.model_id, worker.connector_worker.identity]

    def ask(image_seed: int) -> dict[str, int]:
        """One chat request; the connector counters it moved."""
        before = {**sched.stats(), **{f"w_{k}": v for k, v in worker.stats().items()}}
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(image_seed)}},
                    {"type": "text", "text": "describe"},
                ],
            }
        ]
        llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        core.reset_encoder_cache()
        after = {**sched.stats(), **{f"w_{k}": v for k, v in worker.stats().items()}}
        return {k: after[k] - before[k] for k in after if after[k] != before[k]}

    report["start"] = fields()
    report["first_request"] = ask(1)
    report["after_first_request"] = fields()
    report["again"] = ask(1)
    core.reset_encoder_cache()
    report["after_reset_encoder_cache"] = fields()
    core.collective_rpc(bump_lm)
    report["after_lm_only_update"] = fields()
    report["lm_only_request"] = ask(1)
    core.collective_rpc(load_visual)
    report["after_visual_load_weights"] = fields()
    report["visual_request"] = ask(1)
    for method in ("start_weight_update", "finish_weight_update"):
        try:  # no weight transfer backend configured: the workers refuse; still an event
            core.collective_rpc(method)
        except Exception as exc:
            report[f"{method}_error"] = type(exc).__name__
        report[f"after_{method}"] = fields()
        if method == "start_weight_update":
            report["session_request"] = ask(1)

    # Reload M2 from disk, then M1: timing of the reload itself vs the fingerprint.
    executor = core.model_executor
    # CPU time of this process (TP 1: the worker runs here), not wall time: on a loaded
    # host a preemption lands in either span at random (a CI run beside a CPU-bound
    # process measured 35 ms of wall time for the refresh against 211 for the reload)
    t0 = time.process_time()
    executor.collective_rpc("reload_weights", kwargs={"weights_path": M2})
    reload_s = time.process_time() - t0
    t0 = time.process_time()
    sched.weights_watch.refresh(core)
    refresh_s = time.process_time() - t0
    report["after_reload_m2"] = fields()
    report["reload_s"], report["refresh_s"] = reload_s, refresh_s
    report["m2_request"] = ask(1)
    core.collective_rpc("reload_weights", kwargs={"weights_path": M1})
    report["after_reload_m1"] = fields()
    report["m1_request"] = ask(1)
    core.sleep(1)
    core.wake_up()
    report["after_sleep_wake"] = fields()
    model = core.model_executor.driver_worker.worker.get_model()
    report["encoder_params"] = sum(p.numel() for _, p in encoder_parameters(model))
    report["all_params"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
