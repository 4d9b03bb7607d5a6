"""benchmarks/routing.py runs once with tiny sizes against real vllm serve, brokers
with residency events and the aggregator, so the script cannot rot (not a timed test):
two seeds, every policy, in a shuffled order, vLLM's caches reset before each run, and
the figures summarized with their spread over the seeds."""

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
    args += ["--policies", "rr,history,residency", "--seeds", "2", "--json", str(out)]
    if os.environ.get("LMCACHE_EC_TEST_MODELS"):
        args += ["--models", os.environ["LMCACHE_EC_TEST_MODELS"]]
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "routing.py"), *args],
        capture_output=True,
        text=True,
        timeout=540,  # under the suite's 600 s per-test timeout: a hang fails here, cleanly
        cwd=REPO,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    # The render endpoint's hashes are the keys the brokers publish: the residency
    # policy looks up what vLLM will actually ask for.
    assert "render hashes name the brokers' keys: yes" in r.stdout, r.stdout
    for needle in ("encoder runs", "broker hit", "TTFT p50 ms", "history", "residency"):
        assert needle in r.stdout, (needle, r.stdout)
    # The spread over seeds, and the paired per-seed differences between policies.
    assert "over 2 seeds" in r.stdout and "±" in r.stdout, r.stdout
    assert "residency vs rr" in r.stdout and "residency vs history" in r.stdout, r.stdout
    result = json.loads(out.read_text())
    runs = {(x["scenario"], x["policy"], x["seed"]): x for x in result["runs"]}
    assert set(runs) == {("evict", p, s) for p in ("rr", "history", "residency") for s in (1, 2)}
    for run in runs.values():
        assert run["requests"] == 2 and not run["errors"] and len(run["ttfts"]) == 2
        # vLLM's multimodal processor cache and encoder cache were reset before the run
        assert run["caches_reset"] == ["mm", "encoder"], run
    # Each seed ran every policy once, in the order the seeded shuffle drew.
    for s in (1, 2):
        order = [
            x["policy"] for x in sorted(result["runs"], key=lambda x: x["index"]) if x["seed"] == s
        ]
        assert sorted(order) == ["history", "residency", "rr"], order
    assert [x["index"] for x in result["runs"]] == list(range(6))
    assert result["order"] == [[x["seed"], x["scenario"], x["policy"]] for x in result["runs"]]
