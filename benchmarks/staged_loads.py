"""Time to first token of a hit, staged (issue 41) vs fetched in the step (before).

    .venv/bin/python benchmarks/staged_loads.py [--reps 30]
    PYTHONPATH=<old tree> .venv/bin/python benchmarks/staged_loads.py --harness <old tree>/tests

In-process, on CPU: vLLM's own Scheduler and the V1 / V2 runners' EC call sequences
(tests/vllm_runner_harness.py: a stub encoder, no model), the connector of whichever
``lmcache_ec_broker`` is importable, a real broker (the CLI). Per rep, another
instance's output for a new item is in the broker; one request with that item is
added to an idle engine and stepped until it has its token. Reported: the wall time
from ``add`` to the token (the connector's share of a hit's TTFT: lookup, staging or
in-step fetch, and the scheduler iterations the request waits) and the engine steps
it took, median and p90. No model runs, so the figures isolate the connector; a
served model adds its prefill to both alike. Run the old tree with its own harness
(``--harness``): this script only uses ``Engine``, ``make_config``, ``make_request``
and ``stub_encode``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Broker, MiB, median, percentile, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--harness", default=str(HERE.parent / "tests"))
    args = ap.parse_args()
    sys.path.insert(0, args.harness)
    from vllm.config import ModelConfig
    from vllm_runner_harness import Engine, make_config, make_request, stub_encode

    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or "/tmp/lmcache-ec-bench-models"
    model = ModelConfig(
        model=str(build_tiny_qwen2vl(root)), dtype="bfloat16", max_model_len=512
    )
    import lmcache_ec_broker

    print(f"connector: {Path(lmcache_ec_broker.__file__).parent}")
    rows = []
    with Broker(64 * MiB) as broker:
        for v2 in (False, True):
            config = make_config(model, broker.socket_path, v2=v2)
            engine = Engine(config)
            try:
                times, steps = [], []
                for rep in range(args.reps + 3):  # 3 warm-up reps
                    h = f"{rep:04d}-{int(v2)}".ljust(64, "h")
                    engine.worker.save_caches({h: stub_encode(h, 16)}, h)
                    request = make_request(f"r{rep}", [h])
                    t0 = time.perf_counter()
                    engine.add(request)
                    n = 0
                    while not engine.outputs.get(request.request_id):
                        engine.step()
                        n += 1
                        assert n < 100, "the request never produced a token"
                    while engine._inflight or engine.has_work():  # drain (not timed)
                        engine.step()
                    if rep >= 3:
                        times.append((time.perf_counter() - t0) * 1e3)
                        steps.append(n)
                loads = engine.worker.loads
            finally:
                engine.close()
            rows.append(
                [
                    "V2" if v2 else "V1",
                    f"{median(times):.2f}",
                    f"{percentile(times, 0.9):.2f}",
                    f"{median(steps):.0f}",
                    f"{loads} of {args.reps + 3}",
                ]
            )
    print(table(["runner", "add -> token ms (median)", "p90", "steps", "loads"], rows))


if __name__ == "__main__":
    main()
