"""docs/performance.md leads with the current figures, dated, with the machine's load and
memcpy rate beside them, and the README quotes only figures that page holds (issue 42)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PERF = REPO / "docs" / "performance.md"
README = REPO / "README.md"

# A measured figure in prose: a duration (17.5 min, 29 min 5 s, set-up 100 s), a rate
# (GB/s, µs per call) or a ratio (0.45x). Settings (a 5 s timeout, a 50 ms interval)
# are not figures and are not matched.
FIGURE = re.compile(
    r"\d+(?:\.\d+)? min(?: \d+ s)?|set-up \d+ s|\d+(?:\.\d+)? GB/s|\d+(?:\.\d+)?x\b"
    r"|\d+(?:\.\d+)? µs per"
)
DATE = re.compile(r"20\d\d-\d\d-\d\d")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start : nxt if nxt >= 0 else len(text)]


def test_the_current_figures_are_dated_with_load_and_memcpy_rate() -> None:
    text = PERF.read_text()
    assert "\n## Current figures" in text, "docs/performance.md has no 'Current figures' section"
    cur = _section(text, "\n## Current figures")
    assert DATE.search(cur.splitlines()[1]), "the heading carries the date of the runs"
    assert re.search(r"memcpy\s+rate[\s\S]{0,200}?\d+(?:\.\d+)? GB/s", cur), "the memcpy rate"
    assert re.search(r"load(?: average)? \d+(?:\.\d+)?", cur), "the load beside the figures"
    for table in re.findall(r"((?:^\|.*\n)+)", cur, re.M):
        assert table.count("\n") >= 3, table  # header, rule, at least one row


def test_the_readme_quotes_only_figures_the_docs_hold() -> None:
    perf = PERF.read_text()
    quoted = FIGURE.findall(README.read_text())
    missing = [f for f in quoted if f not in perf]
    assert not missing, f"README figures not in docs/performance.md: {missing}"


def test_the_figure_check_finds_a_figure_the_docs_lack() -> None:
    line = "A fresh clone took 41 min 7 s (set-up 999 s), 0.37x of the floor."
    assert FIGURE.findall(line) == ["41 min 7 s", "set-up 999 s", "0.37x"]
    assert not FIGURE.findall("a 5 s timeout, every 50 ms")
