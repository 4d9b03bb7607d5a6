"""benchmarks/tp_agreement.py runs once with tiny sizes (not a timed test): two real
gloo ranks agree on which loads failed, by the all-reduce and by shared memory in the
same run, and the script prints its table and JSON (no figure is asserted)."""

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
    assert "collective / shm" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 2 and set(figures["loads"]) == {"1", "4"}
    for per in figures["loads"].values():
        assert per["collective"]["median_us"] > 0 and per["shared-memory"]["median_us"] > 0
        assert per["old_over_new"] > 0
