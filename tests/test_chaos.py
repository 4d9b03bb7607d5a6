"""Chaos: client processes doing random put/get/has/delete while clients and the
broker are killed at random; afterwards no leaks and zero corrupt reads.

Runs ``benchmarks/soak.py`` for a fixed, short duration (it stops by itself) and
checks its figures. Bounded in time (the subprocess timeout) and in count (the
kill and restart rates over that duration).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_chaos_kills_clients_and_broker_without_leaks_or_corrupt_reads(tmp_path) -> None:
    out = tmp_path / "figures.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "soak.py"),
            "--duration", "25",
            "--clients", "3",
            "--kill-every", "0.8",
            "--restart-every", "6",
            "--check-every", "7",
            "--seed", "7",
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=REPO,
    )  # fmt: skip
    fig = json.loads(out.read_text())
    report = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, report
    assert fig["leaks_found"] == 0, fig["problems"]
    assert fig["corrupt_reads"] == 0, fig["problems"]
    assert fig["errors"] == 0, fig["problems"]
    # The chaos really happened, and the clients really worked through it.
    assert fig["clients_killed"] >= 10, report
    assert fig["broker_restarts"] >= 2, report
    assert fig["leak_checks"] >= 5, report
    assert fig["puts_stored"] > 0 and fig["get_hits"] > 0, report
    assert fig["bytes_verified"] > 0, report
    # No client call hung through a broker kill (client deadline 2 s + connect 1 s).
    assert fig["slowest_call_ms"] < 10_000, report
