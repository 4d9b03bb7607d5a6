"""benchmarks/routing.py runs once with tiny sizes against real vllm serve, brokers
with residency events and the aggregator, so the script cannot rot (not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("zmq")


@pytest.mark.vllm
def test_routing_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    args = ["--requests", "4", "--images", "2", "--side", "112", "--scenarios", "evict"]
    args += ["--policies", "rr,history,residency", "--json", str(out)]
    if os.environ.get("LMCACHE_EC_TEST_MODELS"):
        args += ["--models", os.environ["LMCACHE_EC_TEST_MODELS"]]
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "routing.py"), *args],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    # The render endpoint's hashes are the keys the brokers publish: the residency
    # policy looks up what vLLM will actually ask for.
    assert "render hashes name the brokers' keys: yes" in r.stdout, r.stdout
    for needle in ("encoder runs", "broker hit", "TTFT p50 ms", "history", "residency"):
        assert needle in r.stdout, (needle, r.stdout)
    result = json.loads(out.read_text())
    runs = {(x["scenario"], x["policy"]): x for x in result["runs"]}
    assert set(runs) == {("evict", p) for p in ("rr", "history", "residency")}
    for run in runs.values():
        assert run["requests"] == 2 and not run["errors"] and len(run["ttfts"]) == 2
