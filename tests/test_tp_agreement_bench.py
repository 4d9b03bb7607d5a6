"""benchmarks/tp_agreement.py runs once with tiny sizes (not a timed test): two real
gloo ranks agree on which loads failed, and the script prints its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_tp_agreement_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/tp_agreement.py"),
            "--steps",
            "30",
            "--loads",
            "1,4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "median / target" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 2 and set(figures["loads"]) == {"1", "4"}
    assert all(f["median_us"] > 0 for f in figures["loads"].values())
