"""The key's model field follows the weights in memory (issue 28).

- ``test_weight_events_in_a_real_engine``: a real in-process vLLM engine
  (tests/weights_events_probe.py, its own process) goes through every weight event
  the CPU build can run; each row of docs/design.md's "Keys" table is checked here.
- The fingerprint itself: equal weights agree, any change to the encoder's weights
  changes it, the language model's weights do not.
- The worker never loads nor stores under a field it does not hold.
- Tower/connector LoRA items (identifiers vLLM prefixes with the adapter's name) are
  never looked up nor stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import LoRAConfig
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.input_processor import InputProcessor

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.vllm import make_key
from lmcache_ec_broker.connector.vllm.encoder_digest import local_digest
from lmcache_ec_broker.connector.vllm.model_id import model_id
from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_connector_unit import (  # noqa: E402,F401 - fixtures too
    Pair,
    broker_stats,
    embedding,
    make_config,
    make_request,
    model_config,
    pairs,
    run_worker_step,
)

# vLLM's item identifiers are content hashes: 64 hex digits (identifiers.py).
STALE, NEW, H2 = "5a" * 32, "4e" * 32, "b2" * 32

# ----------------------------------------------------------------- real engine


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_weight_events_in_a_real_engine(broker, tmp_path):
    root = Path(os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path / "models")
    m1 = build_tiny_qwen2vl(root, TinyQwen2VLSpec())
    m2 = build_tiny_qwen2vl(root, TinyQwen2VLSpec(seed=1))
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "weights_events_probe.py"),
            str(m1),
            str(m2),
            broker.socket_path,
        ],
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    static = r["static"]  # files, configuration and the encoder's digest at load
    base = static.rpartition("~w")[0]  # files and configuration (model_id.py)
    assert base.startswith(model_id(str(m1)) + "+c")

    # Start: the scheduler keys with the field of the weights as loaded, which the
    # workers fingerprinted right after the engine built its scheduler (before any
    # request). (The scheduler's stats carry the workers' counters too, from their
    # metadata: "puts_stored" beside "w_puts_stored", the worker's own.)
    assert r["start"] == [static, static]
    assert r["after_first_request"] == [static, static]
    assert r["first_request"] == {"ec_misses": 1, "w_puts_stored": 1, "puts_stored": 1}
    assert r["again"] == {"ec_hits": 1, "w_loads": 1, "loads": 1, "w_staged": 1, "staged": 1}
    # reset_encoder_cache alone, an update of the language model only: unchanged.
    assert r["after_reset_encoder_cache"] == [static, static]
    assert r["after_lm_only_update"] == [static, static]
    assert r["lm_only_request"] == {"ec_hits": 1, "w_loads": 1, "loads": 1, "w_staged": 1, "staged": 1}
    # collective_rpc + model.load_weights of a vision tensor: a new field, misses.
    (changed, worker_changed) = r["after_visual_load_weights"]
    assert changed == worker_changed and changed.startswith(base + "~w") and changed != static
    assert r["visual_request"] == {"ec_misses": 1, "w_puts_stored": 1, "puts_stored": 1}
    # The weight-transfer session: unknown (misses, no store) until it finishes.
    assert r["after_start_weight_update"][0] == ""
    assert r["session_request"] == {"ec_misses": 1}
    assert r["after_finish_weight_update"] == [changed, changed]
    # reload_weights: other weights, a new field; the original ones, the original field.
    (m2_field, _) = r["after_reload_m2"]
    assert m2_field.startswith(base + "~w") and m2_field not in (static, changed)
    assert r["after_reload_m2"] == [m2_field, m2_field]
    assert r["m2_request"] == {"ec_misses": 1, "w_puts_stored": 1, "puts_stored": 1}
    assert r["after_reload_m1"] == [static, static]
    assert r["m1_request"] == {"ec_hits": 1, "w_loads": 1, "loads": 1, "w_staged": 1, "staged": 1}
    # Sleep and wake-up with the same weights: unchanged.
    assert r["after_sleep_wake"] == [static, static]
    # Cost (docs/design.md, "Keys"): the fingerprint after a reload is a small part of it
    # (CPU time of the process; the figures themselves are measured in the docs).
    assert r["refresh_s"] < r["reload_s"] / 10, (r["refresh_s"], r["reload_s"])
    print(
        f"reload {r['reload_s'] * 1e3:.1f} ms, fingerprint {r['refresh_s'] * 1e3:.2f} ms, "
        f"encoder {r['encoder_params']} of {r['all_params']} parameters"
    )


# ----------------------------------------------------------------- fingerprint


class TinyVLM(torch.nn.Module):
    """A vision tower, a projector and a language model, like vLLM's VLMs."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.visual = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 64))
        self.language_model = torch.nn.Sequential(torch.nn.Embedding(100, 64))
        self.to(torch.bfloat16)

    def get_language_model(self) -> torch.nn.Module:
        return self.language_model


def test_equal_weights_agree_and_any_encoder_change_does_not():
    a, b = TinyVLM(), TinyVLM()
    assert local_digest(a) == local_digest(b)
    base = local_digest(a)

    with torch.no_grad():
        b.language_model[0].weight.add_(1)  # language model only: the encoder's output is the same
    assert local_digest(b) == base

    with torch.no_grad():
        b.visual[1].weight[3, 7] += 0.25  # one element of the tower
    assert local_digest(b) != base

    c = TinyVLM()
    with torch.no_grad():  # the same words, permuted: another tensor
        w = c.visual[0].weight
        w.copy_(w.flip(0))
    assert local_digest(c) != base
    assert local_digest(TinyVLM(seed=1)) != base

    # A large tensor is reduced in place (no packing); its changes count too.
    big = torch.nn.Module()
    big.visual = torch.nn.Linear(2048, 1024, bias=False).to(torch.bfloat16)
    before = local_digest(big)
    with torch.no_grad():
        big.visual.weight[1000, 5] += 1
    assert local_digest(big) != before


# ----------------------------------------------------------------- worker guard


def test_worker_neither_loads_nor_stores_under_a_field_it_does_not_hold(pairs, broker):  # noqa: F811
    p: Pair = pairs()
    stored = embedding(1)
    with BrokerClient(broker.socket_path) as c:
        assert c.put(make_key(p.sched.model_id, STALE, torch.bfloat16), stored)
    # The worker was told (by a fingerprint) that its weights changed; the scheduler
    # still keys with the old field: the hit is encoded instead, the output not stored.
    p.worker.connector_worker.adopt_identity(p.sched.model_id + "~wdeadbeefdeadbeef")
    req = make_request("r1", STALE)
    cache: dict[str, torch.Tensor] = {}
    fresh = embedding(2)
    p.step(cache, [(req, 0)], encode={STALE: fresh})
    assert p.worker.loads == 0 and p.worker.load_failures == 1
    assert torch.equal(cache[STALE], fresh)
    assert p.worker.puts_stored == 0

    # Unknown field (a weight-transfer session): misses without asking, no stores.
    p.worker.connector_worker.adopt_identity(None)
    p.sched.connector_scheduler.set_field("")
    with BrokerClient(broker.socket_path) as c:
        assert c.put(make_key(p.worker.model_id, NEW, torch.bfloat16), embedding(3))
    misses = p.sched.ec_misses
    p.step({}, [(make_request("r2", NEW), 0)], encode={NEW: embedding(4)})
    assert p.sched.ec_misses == misses + 1, "the scheduler answered a hit with no field"
    assert p.worker.loads == 0 and p.worker.puts_stored == 0


def test_stagings_under_the_old_field_end_when_it_changes(pairs, broker):  # noqa: F811
    """A hit staged for a request not scheduled yet, then the weights change (between
    steps): the staged tensor, computed by the old weights, is released on the
    worker and the item is no longer promised."""
    p: Pair = pairs()
    h = "ef" * 32
    p.worker.save_caches({h: embedding(5)}, h)
    req = make_request("r1", h)
    assert p.staged_first(req) and p.sched.has_cache_item(h)
    p.sched.build_connector_meta(SchedulerOutput.make_empty())  # r1 not scheduled after all
    link = p.worker.connector_worker.link
    assert link.held() == {h}
    p.sched.connector_scheduler.set_field(p.sched.model_id + "~w0123456789abcdef")
    assert not p.sched.has_cache_item(h)
    deadline = time.monotonic() + 30
    while link.held():
        assert time.monotonic() < deadline, "the old weights' tensor was never released"
        time.sleep(0.01)
    assert broker_stats(broker.socket_path, p)["pins"] == 0


# ----------------------------------------------------------------- tower LoRA


def test_tower_lora_identifier_is_the_adapters_name_and_the_hash():
    """What the connector relies on: with tower/connector LoRA vLLM keys an item by
    ``<adapter name>:<mm_hash>``, a name, not the adapter's weights."""
    processor = SimpleNamespace(lora_config=LoRAConfig(enable_tower_connector_lora=True))
    lora = LoRARequest("adapter", 1, "/adapters/a")
    assert InputProcessor._get_mm_identifier(processor, "h", lora) == "adapter:h"
    assert InputProcessor._get_mm_identifier(processor, "h", None) == "h"


def test_tower_lora_items_are_never_looked_up_nor_stored(model_config, broker):  # noqa: F811
    config = make_config(model_config, "ec_both", broker.socket_path)
    config.lora_config = LoRAConfig(enable_tower_connector_lora=True)
    p = Pair(config)
    try:
        private = "adapter:" + "a1" * 32
        with BrokerClient(broker.socket_path) as c:  # what another adapter of that name stored
            assert c.put(make_key(p.sched.model_id, private, torch.bfloat16), embedding(1))
        req = make_request("r1", private)
        assert p.sched.ensure_cache_available(req, 0)
        assert not p.sched.has_cache_item(private)
        so = SchedulerOutput.make_empty()
        so.scheduled_encoder_inputs["r1"] = [0]
        p.sched.update_state_after_alloc(req, 0)
        cache: dict[str, torch.Tensor] = {}
        run_worker_step(p.sched, p.worker, so, cache, [(req, 0)], {private: embedding(2)})
        assert p.worker.loads == 0 and p.worker.puts_stored == 0

        # Items without an adapter are shared as always.
        req2 = make_request("r2", H2)
        p.step({}, [(req2, 0)], encode={H2: embedding(3)})
        assert p.worker.puts_stored == 1
    finally:
        p.close()
