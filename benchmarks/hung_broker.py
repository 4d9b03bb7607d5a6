"""What a broken broker costs a vLLM engine, and where the connector's budgets come from.

Three measurements (all against real broker processes; ``serve`` also real ``vllm
serve`` instances of the tiny offline Qwen2-VL):

- ``rtt``: the connector's calls against a healthy broker on this host: a leasing
  lookup (the scheduler's), a load of a 16 x 128 bf16 entry and a put (the
  worker's); percentiles. The budgets must sit far above their tails (a budget hit
  on a healthy broker costs misses until the next probe), and far below what an
  engine step can afford.
- ``hooks``: the scheduler-side hooks of a real ECBrokerConnector driven like an
  engine that steps every ``--step-ms`` with one new multimodal request per step,
  for ``--seconds``, with the broker healthy and then SIGSTOPped: steps done and
  the time spent inside the hooks.
- ``serve`` (``--serve``): time to first token of fresh images, one at a time, on a
  server without the connector and on one whose broker is SIGSTOPped.

    python benchmarks/hung_broker.py [--serve] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Broker, MiB, exit_on_sigterm, percentile, table  # noqa: E402


def rtt(broker: Broker, n: int) -> dict[str, dict[str, float]]:
    import torch

    from lmcache_ec_broker import BrokerClient

    out: dict[str, dict[str, float]] = {}
    with BrokerClient(broker.socket_path, timeout_s=5.0) as c:
        entry = torch.randn(16, 128).to(torch.bfloat16)
        c.put("present", entry)
        calls = {
            "lookup+lease (scheduler)": lambda i: c.lookup(["present"], lease_ms=30_000),
            "get 4 KiB (worker load)": lambda i: c.get("present"),
            "put 4 KiB (worker put)": lambda i: c.put(f"k{i}", entry),
        }
        for name, call in calls.items():
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                call(i)
                times.append((time.perf_counter() - t0) * 1000)
            c.unlease(["present"])
            out[name] = {
                "p50_ms": percentile(times, 0.5),
                "p99_ms": percentile(times, 0.99),
                "p99.9_ms": percentile(times, 0.999),
                "max_ms": max(times),
            }
    return out


def _connector(socket_path: str, models: Path) -> Any:
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from lmcache_ec_broker.connector.vllm import ECBrokerConnector
    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(build_tiny_qwen2vl(models)), dtype="bfloat16", max_model_len=512
        ),
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config={"socket_path": socket_path},
        ),
    )
    return ECBrokerConnector(config, ECConnectorRole.SCHEDULER)


def hooks(broker: Broker, models: Path, seconds: float, step_ms: float) -> dict[str, Any]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    conn = _connector(broker.socket_path, models)

    def request(i: int) -> Request:
        feature = MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=f"{i:064x}",
            mm_position=PlaceholderRange(offset=3, length=16),
        )
        return Request(
            request_id=f"r{i}",
            prompt_token_ids=[1, 2, 3] + [5] * 16 + [4],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            mm_features=[feature],
        )

    results: dict[str, Any] = {}
    seq = 0
    for phase in ("healthy", "SIGSTOPped"):
        if phase == "SIGSTOPped":
            os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            steps, in_hooks, worst = 0, 0.0, 0.0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                seq += 1
                r = request(seq)
                t0 = time.perf_counter()
                conn.ensure_cache_available(r, 0)
                if not conn.has_cache_item(r.mm_features[0].identifier):
                    conn.update_state_after_alloc(r, 0)
                conn.build_connector_meta(SchedulerOutput.make_empty())
                dt = time.perf_counter() - t0
                steps += 1
                in_hooks += dt
                worst = max(worst, dt)
                time.sleep(max(0.0, step_ms / 1000 - dt))
            results[phase] = {
                "steps": steps,
                "in_hooks_s": in_hooks,
                "in_hooks_pct": 100 * in_hooks / seconds,
                "worst_step_ms": worst * 1000,
            }
        finally:
            if phase == "SIGSTOPped":
                os.kill(broker.proc.pid, signal.SIGCONT)
    conn.shutdown()
    return results


def serve(broker: Broker, models: Path, n: int) -> dict[str, Any]:
    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl
    from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config, png_data_url

    model = str(build_tiny_qwen2vl(models))
    logs = Path(tempfile.mkdtemp(prefix="ecb-hung-", dir="/tmp"))
    plain = VllmServer(model, logs / "plain.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    conn = VllmServer(
        model,
        logs / "connector.log",
        ec_config=ec_transfer_config("ec_both", broker.socket_path),
        env={"VLLM_CPU_OMP_THREADS_BIND": str(1 % (os.cpu_count() or 1))},
    )
    out: dict[str, Any] = {}
    try:
        for s in (plain, conn):
            s.start()
        for s in (plain, conn):
            s.wait_ready(timeout=900)
        for s in (plain, conn):
            s.chat_token_ids(png_data_url(seed=10_000), max_tokens=1)  # warm-up
        phases = [
            ("without connector", plain, False),
            ("connector, broker healthy", conn, False),
            ("connector, broker SIGSTOPped", conn, True),
            ("without connector (again)", plain, False),
        ]
        try:
            for k, (name, s, stop) in enumerate(phases):
                if stop:
                    os.kill(broker.proc.pid, signal.SIGSTOP)
                times = []
                t_all = time.perf_counter()
                for seed in range(n):  # new images in every phase: misses, then puts
                    t0 = time.perf_counter()
                    s.chat_token_ids(png_data_url(seed=20_000 + 1000 * k + seed), max_tokens=1)
                    times.append((time.perf_counter() - t0) * 1000)
                if stop:
                    os.kill(broker.proc.pid, signal.SIGCONT)
                out[name] = {
                    "ttft_mean_ms": sum(times) / len(times),
                    "ttft_p50_ms": percentile(times, 0.5),
                    "ttft_p99_ms": percentile(times, 0.99),
                    "ttft_max_ms": max(times),
                    "first_ms": times[0],
                    "req_per_s": n / (time.perf_counter() - t_all),
                }
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
    finally:
        for s in (plain, conn):
            s.stop()
    return out


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rtt-calls", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase of 'hooks'")
    p.add_argument("--step-ms", type=float, default=30.0)
    p.add_argument("--serve", action="store_true", help="also the vllm serve comparison")
    p.add_argument("--requests", type=int, default=20, help="per server, with --serve")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    models = Path(os.environ.get("LMCACHE_EC_TEST_MODELS") or tempfile.mkdtemp(dir="/tmp"))
    report: dict[str, Any] = {}
    with Broker(64 * MiB) as broker:
        report["rtt"] = rtt(broker, args.rtt_calls)
        print(
            table(
                ["call (healthy broker)", "p50 ms", "p99 ms", "p99.9 ms", "max ms"],
                [
                    [k, *(f"{v[f]:.3f}" for f in ("p50_ms", "p99_ms", "p99.9_ms", "max_ms"))]
                    for k, v in report["rtt"].items()
                ],
            )
        )
        report["hooks"] = hooks(broker, models, args.seconds, args.step_ms)
        print(
            table(
                [f"scheduler hooks, {args.seconds:.0f} s", "steps", "in hooks", "worst step"],
                [
                    [k, v["steps"], f"{v['in_hooks_pct']:.1f} %", f"{v['worst_step_ms']:.1f} ms"]
                    for k, v in report["hooks"].items()
                ],
            )
        )
        if args.serve:
            report["serve"] = serve(broker, models, args.requests)
            print(
                table(
                    ["server", "TTFT mean", "p50", "p99", "max", "first request", "req/s"],
                    [
                        [
                            k,
                            f"{v['ttft_mean_ms']:.0f} ms",
                            f"{v['ttft_p50_ms']:.0f} ms",
                            f"{v['ttft_p99_ms']:.0f} ms",
                            f"{v['ttft_max_ms']:.0f} ms",
                            f"{v['first_ms']:.0f} ms",
                            f"{v['req_per_s']:.2f}",
                        ]
                        for k, v in report["serve"].items()
                    ],
                )
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
