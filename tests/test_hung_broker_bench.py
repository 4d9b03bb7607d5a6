"""benchmarks/hung_broker.py runs (tiny settings) so it cannot rot, and its hooks
measurement shows what the connector promises: with the broker SIGSTOPped, the
scheduler's hooks still keep pace with the engine's steps (one budget wait)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_hung_broker_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "hung.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "hung_broker.py"), "--rtt-calls", "200",
         "--seconds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert set(report["rtt"]) == {
        "lookup+lease (scheduler)",
        "get 4 KiB (worker load)",
        "put 4 KiB (worker put)",
    }
    healthy, stopped = report["hooks"]["healthy"], report["hooks"]["SIGSTOPped"]
    assert stopped["steps"] > healthy["steps"] / 2, report["hooks"]
    assert stopped["worst_step_ms"] < 1000, report["hooks"]
    assert "scheduler hooks" in r.stdout
