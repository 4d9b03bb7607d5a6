"""Entry identity across in-place weight updates and model copies (issue 28), with
real ``vllm serve`` processes and one real broker.

Three servers start together: A and B serve the tiny Qwen2-VL ``M1`` from one path
(A with ``--distributed-executor-backend mp``: its worker is another process, as on a
GPU host), C serves a byte-identical copy of ``M1`` at another path. ``M2`` is a
checkpoint of the same architecture with other weights.

- A answers image I cold under M1 and stores it; B loads that entry.
- C (same weights, other path) neither loads A's entry nor answers differently:
  vLLM's mm_hash covers the ``--model`` string, so copies at other paths do not share
  (docs/design.md, "Keys").
- A reloads M2 in place (``POST /collective_rpc reload_weights``, then
  ``POST /reset_encoder_cache``, as vLLM documents): A must encode I under M2, never
  load the M1 entry (the issue's reproduction: it loaded it).
- B, still on M1, keeps hitting the M1 entry.
- B reloads M2 too: it loads the entry A stored under M2 (equal weights share).
- A reloads M1: its identity is the original one again and it loads the M1 entry.

One test, three server start-ups overlapping (the cost is almost all start-up).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Unguarded on purpose: CI installs vLLM, so these tests must fail without it, never skip.
import vllm  # noqa: F401

from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl
from lmcache_ec_broker.testing.vllm_server import (
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    png_data_url,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SPEC = TinyQwen2VLSpec()
OTHER_WEIGHTS = TinyQwen2VLSpec(seed=1)  # same architecture, other weights


@pytest.fixture
def servers() -> Iterator[list[VllmServer]]:
    started: list[VllmServer] = []
    yield started
    for s in started:
        s.terminate()
    for s in started:
        s.wait_stopped()


def reload_weights(server: VllmServer, path: str | Path) -> None:
    """vLLM's documented in-place update: reload, then drop the encoder cache."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    reply = server._post("/collective_rpc", body, timeout=600)
    assert reply == b"" or "results" in json.loads(reply), reply
    server.reset_encoder_cache()


def test_in_place_updates_copies_and_instances_on_old_weights(broker, servers, tmp_path):
    root = Path(os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path / "models")
    m1 = build_tiny_qwen2vl(root, SPEC)
    m2 = build_tiny_qwen2vl(root, OTHER_WEIGHTS)
    copy = tmp_path / "elsewhere" / "tiny-qwen2vl-copy"
    shutil.copytree(m1, copy)
    cfg = ec_transfer_config("ec_both", broker.socket_path, **SLOW_HOST_BUDGETS)
    cores = os.cpu_count() or 1

    def server(name: str, model: Path, core: int, *extra: str) -> VllmServer:
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core % cores)}
        return VllmServer(model, tmp_path / f"{name}.log", cfg, list(extra), env)

    a = server("a", m1, 0, "--distributed-executor-backend", "mp")
    b = server("b", m1, 1)
    c = server("c", copy, 2)
    for s in (a, b, c):
        servers.append(s.start())
    for s in (a, b, c):
        s.wait_ready(timeout=900)

    image = png_data_url(seed=28)
    old = a.chat_token_ids(image)
    (mm_hash,) = a.ec_put_hashes()
    assert b.chat_token_ids(image) == old
    assert b.ec_loads() == [mm_hash], "B did not load A's entry"

    # Copies at another path: the same answer, but vLLM's mm_hash differs: no sharing.
    assert c.chat_token_ids(image) == old
    assert c.ec_loads() == [], "C loaded an entry of another --model string"
    assert c.ec_put_hashes() and c.ec_put_hashes()[0] != mm_hash

    # A reloads other weights in place: it must encode, never load the M1 entry.
    reload_weights(a, m2)
    new = a.chat_token_ids(image)
    assert a.ec_loads() == [], "A answered from the embeddings of its old weights"
    assert new != old, "the reloaded weights did not change the answer"
    assert a.ec_put_hashes() == [mm_hash, mm_hash], "A did not store its M2 entry"

    # B, still on M1, keeps hitting the M1 entry.
    b.reset_encoder_cache()
    assert b.chat_token_ids(image) == old
    assert b.ec_loads() == [mm_hash, mm_hash]

    # B reloads the same M2 weights: it shares A's M2 entry from its first request.
    reload_weights(b, m2)
    assert b.chat_token_ids(image) == new
    assert b.ec_loads() == [mm_hash] * 3, "B did not load the entry A stored under M2"
    assert b.ec_put_hashes() == []

    # A goes back to M1: the original identity, the original entry.
    reload_weights(a, m1)
    assert a.chat_token_ids(image) == old
    assert a.ec_loads() == [mm_hash], "A back on M1 did not load the M1 entry"
    assert a.ec_put_hashes() == [mm_hash, mm_hash]
