"""The operator-facing docs say what the code does: every connector key the
connector reads is documented where a user looks for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONNECTOR = REPO / "lmcache_ec_broker" / "connector" / "vllm" / "connector.py"
RETIRED = {"timeout_s"}  # refused by the connector with a message naming its successors


def connector_keys() -> set[str]:
    keys = set(re.findall(r'\bextra\("([a-z_]+)"', CONNECTOR.read_text()))
    assert {"socket_path", "lease_ms", "max_defer_s", "model_name"} <= keys, keys
    return keys - RETIRED


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md", "examples/README.md"])
def test_every_connector_key_is_documented(doc: str) -> None:
    text = (REPO / doc).read_text()
    missing = sorted(k for k in connector_keys() if f"`{k}`" not in text)
    assert not missing, f"{doc} does not list the connector keys {missing}"
