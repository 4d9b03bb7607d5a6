"""``benchmarks/epd.py`` runs once with tiny sizes, so the script cannot rot. Not a timed
test: it checks that every config starts (real brokers, aggregator, proxy, vllm serve),
answers every request, and that the table carries what docs/epd.md reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_epd_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "epd.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "epd.py"),
         "--requests", "3", "--rates", "4", "--images", "2", "--multi", "0.5",
         "--side", "112", "--max-tokens", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=2300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    for needle in ("TTFT p50 ms", "p50 vs agg", "thr vs agg", "enc runs/item", "load average"):
        assert needle in r.stdout, (needle, r.stdout)
    results = json.loads(out.read_text())["results"]
    got = {(x["config"], x["workload"]) for x in results}
    assert got == {
        (c, w) for c in ("agg", "epd", "epd-lookup", "example") for w in ("unique", "zipf")
    }
    for x in results:
        assert len(x["ttfts"]) == x["requests"] == 3 and not x["errors"], x
        # Every item is encoded at least once somewhere. Through E, never twice: E's
        # own vLLM cache answers a repeat sent while the first is in flight, and PD
        # finds E's put in the node's broker (E stores before it answers).
        assert x["encoder_runs"] >= x["distinct"], x
        if x["config"] in ("epd", "epd-lookup"):
            assert x["encoder_runs"] == x["distinct"], x
