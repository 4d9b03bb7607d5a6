"""An entry is served only to an instance that would have computed the same bytes
(issue 39).

- ``test_real_engines_share_only_what_they_would_compute``: four real in-process
  vLLM engines (tests/identity_probe.py, one process each) and one broker prove, in
  order: a ``--load-format dummy`` instance's entries never reach a real one; client
  ``multi_modal_uuids`` are not shared by default and are shared, namespaced, with
  ``client_uuid_namespace``; a direct ``model.load_weights`` under
  ``external_launcher`` (colocated RL) changes the field before a stale entry is
  used; TP 1 and TP 2 of one model and configuration share; with vLLM numbering
  items (``mm_processor_cache_gb=0``, no prefix caching) nothing is looked up or
  stored, with one warning naming the settings.
- The identifier policy by form and configuration; the configuration's part of the
  model field (what separates, what does not); the V2 runner's loads with LoRA; the
  digest's all-gather when one rank fails.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import broker_stats
from vllm.config import LoadConfig, LoRAConfig, ModelConfig, VllmConfig

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.vllm.identifiers import IdentifierPolicy
from lmcache_ec_broker.connector.vllm.meta import make_key
from lmcache_ec_broker.connector.vllm.model_id import (
    config_fingerprint,
    config_parts,
    fingerprint,
    model_id,
)
from lmcache_ec_broker.connector.vllm.stage_link import loads_off_reason
from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

HERE = Path(__file__).resolve().parent
HEX = "0123456789abcdef" * 4  # a blake3/sha256 content hash: 64 hex digits

# ------------------------------------------------------------------ real engines


def probe(scenario: str, model: Path, socket_path: str) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, str(HERE / "identity_probe.py"), scenario, str(model), socket_path],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{scenario}: " + text[-6000:]
    (report,) = [line for line in out.stdout.splitlines() if line.startswith("{")][-1:]
    return json.loads(report), text


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_real_engines_share_only_what_they_would_compute(broker, tmp_path):
    model = build_tiny_qwen2vl(os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path)
    t0 = time.perf_counter()

    # 1. Dummy weights: their own field; a client UUID is not stored (no namespace).
    dummy, _ = probe("dummy", model, broker.socket_path)
    assert dummy["image1"]["puts_stored"] == 1
    assert "puts_stored" not in dummy["uuid"], "a client UUID keyed a shared entry"
    entries = broker_stats(broker.socket_path)["entries"]
    assert entries == 1

    # 2. The real weights (external_launcher, one rank, as colocated RL runs it):
    # never the dummy's entry; the UUID namespaced; a direct load_weights is seen.
    real, _ = probe("launcher", model, broker.socket_path)
    assert real["field"] != dummy["field"]
    assert real["field"].split("+c")[0] == dummy["field"].split("+c")[0]  # same files
    # ... and other weights in memory: the encoder digests at load differ too.
    assert "~w" in real["field"] and "~w" in dummy["field"]
    assert real["field"].rpartition("~w")[2] != dummy["field"].rpartition("~w")[2]
    assert real["image1"]["ec_misses"] == 1 and real["image1"]["puts_stored"] == 1, real
    assert real["image1"]["tokens"] != dummy["image1"]["tokens"]
    assert real["uuid"]["puts_stored"] == 1
    namespaced = make_key(real["field"], real["uuid_key_part"], "bfloat16")
    assert real["uuid_key_part"].startswith("uuid.")
    with BrokerClient(broker.socket_path) as c:
        assert c.has([namespaced]) == [True]
    # The update is seen before the stale entry is used: the scheduler's hit (old
    # field) fails its staging (weights changed, not fingerprinted yet) and is
    # encoded, then the new field misses and stores.
    assert "loads" not in real["after_update"], "loaded an entry of the old weights"
    assert real["after_update"].get("load_failures") == 1, real["after_update"]
    assert real["again"]["ec_misses"] == 1 and real["again"]["puts_stored"] == 1
    before_update = real["field"].rpartition("~w")[0]
    assert real["field_after_update"].startswith(before_update + "~w")
    assert real["field_after_update"] != real["field"]
    assert real["after_update"]["tokens"] == real["again"]["tokens"]

    # 3. TP 2 of the same model and configuration shares TP 1's entry (both ranks load):
    # the field, the encoder digest at load included, is the same for both layouts.
    tp2, _ = probe("tp2", model, broker.socket_path)
    assert tp2["field"] == real["field"]
    assert tp2["image2"].get("ec_hits") == 1 and tp2["image2"].get("loads") == 2, tp2
    assert "puts_stored" not in tp2["image2"]

    # 4. vLLM numbers items: nothing looked up nor stored; one warning with the fix.
    before = broker_stats(broker.socket_path)
    numbering, text = probe("numbering", model, broker.socket_path)
    after = broker_stats(broker.socket_path)
    assert after["entries"] == before["entries"] and after["puts"] == before["puts"]
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])  # no lookup
    for answer in (numbering["image4"], numbering["image5"]):
        assert "puts_stored" not in answer and "ec_hits" not in answer
    assert text.count("vLLM numbers multimodal items per instance") == 1
    assert "set --mm-processor-cache-gb above 0 or enable prefix caching" in text
    print(f"four engines: {time.perf_counter() - t0:.1f} s")


def edit_outside_the_sampled_bytes(path: Path, tensor: str) -> None:
    """Change one tensor's bytes in place where the file fingerprint does not read
    them (model_id.py samples 64 bytes at the start and the middle of each tensor)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(n))[tensor]["data_offsets"]
        at = 8 + n + start + (end - start) * 3 // 4 // 2 * 2
        assert start + 64 <= at - 8 - n and at - 8 - n >= start + (end - start) // 2 + 64
        f.seek(at)
        old = f.read(64)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in old))


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_real_engines_key_the_configuration_and_the_weights_that_run(broker, tmp_path):
    """Each of --hf-overrides, server-level --mm-processor-kwargs and weights that
    differ where the file fingerprint does not look gives real engines another model
    field: none of them loads the plain instance's entry, and the plain instance's
    entry stays (a configuration whose shapes differ never deletes it)."""
    original = build_tiny_qwen2vl(os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path)
    model = tmp_path / "model"
    shutil.copytree(original, model)
    sock = broker.socket_path

    plain, _ = probe("plain", model, sock)
    assert plain["image1"]["ec_misses"] == 1 and plain["image1"]["puts_stored"] == 1
    files, _, rest = plain["field"].partition("+c")
    config, _, digest = rest.partition("~w")
    assert files and config and digest
    plain_key = make_key(plain["field"], plain["image1_hash"], "bfloat16")
    with BrokerClient(sock) as c:
        assert c.has([plain_key]) == [True]

    for scenario in ("overrides", "mm_kwargs"):
        other, _ = probe(scenario, model, sock)
        o_files, _, o_rest = other["field"].partition("+c")
        o_config, _, o_digest = o_rest.partition("~w")
        # Same files and weights, another configuration: another field.
        assert (o_files, o_digest) == (files, digest), scenario
        assert o_config != config, scenario
        assert other["image1"]["ec_misses"] == 1, (scenario, other)
        assert other["image1"]["puts_stored"] == 1, (scenario, other)
        assert "loads" not in other["image1"], (scenario, other)
    # Fewer pixels, fewer image tokens: a different output, kept apart, nothing deleted.
    assert other["image1"]["tokens"] != plain["image1"]["tokens"]
    with BrokerClient(sock) as c:
        assert c.has([plain_key]) == [True]

    # One vision tensor changed where the file fingerprint does not read: the same
    # files part, the same configuration, another digest of the weights at load.
    edit_outside_the_sampled_bytes(model / "model.safetensors", "visual.blocks.0.mlp.fc1.weight")
    fingerprint.cache_clear()
    assert model_id(str(model)) == files
    edited, _ = probe("plain", model, sock)
    e_files, _, e_rest = edited["field"].partition("+c")
    assert (e_files, e_rest.partition("~w")[0]) == (files, config)
    assert e_rest.partition("~w")[2] != digest
    assert edited["image1"]["ec_misses"] == 1 and edited["image1"]["puts_stored"] == 1
    assert "loads" not in edited["image1"], edited


# ------------------------------------------------------------------ identifiers


def config(cache_gb: float = 4, prefix: bool = True, algorithm: str = "blake3", tower=False):
    mm = SimpleNamespace(mm_processor_cache_gb=cache_gb, mm_hasher_algorithm=algorithm)
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=mm),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix),
        lora_config=LoRAConfig(enable_tower_connector_lora=True) if tower else None,
    )


def test_only_content_hashes_are_shared_by_default():
    ids = IdentifierPolicy(config())
    assert ids.item_key(HEX) == HEX
    for identifier in (
        "renderer0-mm-1-image-0",  # vLLM's numbered item
        "tenant-a/cat.png",  # a client UUID
        "4b8e1f0c-3e1a-4f7e-9d6a-2c1b0a9e8d7f",
        HEX[:-1],  # not the algorithm's length
        HEX.upper(),
        "adapter:" + HEX,  # tower LoRA
    ):
        assert ids.item_key(identifier) is None, identifier
    assert IdentifierPolicy(config(algorithm="sha512")).item_key(HEX) is None
    assert IdentifierPolicy(config(algorithm="sha512")).item_key(HEX * 2) == HEX * 2


def test_numbering_configuration_shares_nothing_and_says_what_to_change(caplog):
    import logging

    log = logging.getLogger("test-identity")
    with caplog.at_level(logging.WARNING, logger="test-identity"):
        ids = IdentifierPolicy(config(cache_gb=0, prefix=False), "tenant", log)
    # Per-request kwargs make vLLM hash the number: a hex string that is no content.
    assert ids.item_key(HEX) is None and ids.item_key("tenant-a/cat.png") is None
    (record,) = caplog.records
    assert "--mm-processor-cache-gb" in record.getMessage()
    assert "--enable-prefix-caching" in record.getMessage()
    # Either cache on: vLLM hashes.
    assert IdentifierPolicy(config(cache_gb=0, prefix=True)).item_key(HEX) == HEX
    assert IdentifierPolicy(config(cache_gb=4, prefix=False)).item_key(HEX) == HEX


def test_client_uuids_only_under_a_namespace_that_separates_tenants():
    a, b = IdentifierPolicy(config(), "tenant-a"), IdentifierPolicy(config(), "tenant-b")
    uuid = "cat@v1.png"  # '@' separates key fields: the key part never carries it
    assert a.item_key(uuid) == IdentifierPolicy(config(), "tenant-a").item_key(uuid)
    assert a.item_key(uuid) != b.item_key(uuid)
    assert a.item_key(uuid).startswith("uuid.") and "@" not in a.item_key(uuid)
    assert a.item_key("renderer0-mm-1-image-0") is None  # numbered: never
    assert a.item_key(HEX) == HEX  # content hashes as always
    with pytest.raises(ValueError, match="client_uuid_namespace must be a non-empty string"):
        IdentifierPolicy(config(), "")


# ------------------------------------------------------------------ configuration


@pytest.fixture(scope="module")
def base_config(tmp_path_factory) -> VllmConfig:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    mc = ModelConfig(model=str(build_tiny_qwen2vl(root)), dtype="bfloat16", max_model_len=512)
    return VllmConfig(model_config=mc)


def variant(base: VllmConfig, where: str, **changes: object) -> VllmConfig:
    """``base`` with attributes of one of its parts changed (the fingerprint reads them)."""
    v = copy.copy(base)
    if where == "load":
        v.load_config = LoadConfig(**changes)
        return v
    mc = copy.copy(base.model_config)
    v.model_config = mc
    if where == "mm":
        mc.multimodal_config = copy.copy(mc.multimodal_config)
        target = mc.multimodal_config
    elif where == "parallel":
        v.parallel_config = copy.copy(base.parallel_config)
        target = v.parallel_config
    else:
        target = mc
    for name, value in changes.items():
        setattr(target, name, value)
    return v


def test_the_configuration_that_decides_the_encoder_output_is_in_the_field(base_config):
    base = config_fingerprint(base_config)
    assert base == config_fingerprint(copy.copy(base_config))
    different = {
        "dummy weights": variant(base_config, "load", load_format="dummy"),
        "online fp8": variant(base_config, "model", quantization="fp8"),
        "hf overrides": variant(base_config, "model", hf_overrides={"vision_config": {"depth": 1}}),
        "remote code": variant(base_config, "model", trust_remote_code=True),
        "processor kwargs": variant(base_config, "mm", mm_processor_kwargs={"max_pixels": 3136}),
        "media io kwargs": variant(base_config, "mm", media_io_kwargs={"video": {"fps": 1}}),
        "model class": variant(base_config, "model", model_class_overrides={"x": "y"}),
    }
    for what, cfg in different.items():
        assert config_fingerprint(cfg) != base, what
    # Same computation: the parallel layout, the encoder-only role, eager mode share.
    same = {
        "TP 2": variant(base_config, "parallel", tensor_parallel_size=2),
        "encoder only": variant(base_config, "mm", mm_encoder_only=True),
        "eager": variant(base_config, "model", enforce_eager=True),
    }
    for what, cfg in same.items():
        assert config_fingerprint(cfg) == base, what
    parts = config_parts(base_config)
    assert parts["model_class"].endswith("Qwen2VLForConditionalGeneration")
    assert parts["vllm"] and parts["load_format"] == "auto"


# ------------------------------------------------------------------ LoRA, V2 loads


def test_v2_runner_keeps_loads_with_lora():
    """Language-model LoRA leaves the encoder's output alone: loads stay on. Tower
    LoRA too since staged loads (a load encodes nothing, so the tower mapping built
    before start_load_caches is moot); an item under a tower adapter is never
    shared (identifiers.py, test_only_content_hashes_are_shared_by_default)."""
    parallel = SimpleNamespace(distributed_executor_backend="mp", tensor_parallel_size=1)
    for lora in (LoRAConfig(), LoRAConfig(enable_tower_connector_lora=True)):
        config = SimpleNamespace(parallel_config=parallel, lora_config=lora, use_v2_model_runner=True)
        assert loads_off_reason(config) == ""


# ------------------------------------------------------------------ the digest's collective


def _digest_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from lmcache_ec_broker.connector.vllm import tp_digest

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    group = SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
    tp_digest._tp_group = lambda: group  # this test's TP group: both processes

    class Broken(torch.nn.Module):
        def named_parameters(self, *a, **k):
            raise RuntimeError("a parameter on a lost device")

    model = Broken() if rank == 1 else torch.nn.Linear(4, 4).to(torch.bfloat16)
    t0 = time.monotonic()
    try:
        tp_digest.settle_field(model, "m")
        results[rank] = ("returned", time.monotonic() - t0)
    except tp_digest.DigestFailed as exc:
        results[rank] = (f"DigestFailed: {exc}", time.monotonic() - t0)
    except Exception as exc:
        results[rank] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    # A worker whose digest raised stays alive (vLLM catches it): leave only once both
    # ranks have answered, so a rank left waiting in the all-gather is seen waiting.
    deadline = time.monotonic() + 90
    while len(results) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()


def test_digest_never_waits_on_a_rank_that_failed():
    """Rank 1's digest raises: both ranks leave the all-gather at once with
    DigestFailed (before: rank 0 waited in it until gloo's timeout, here 60 s)."""
    from lmcache_ec_broker.testing.ports import free_ports

    ctx = mp.get_context("fork")  # no re-import: seconds less
    results = ctx.Manager().dict()
    port = free_ports(1)
    procs = [ctx.Process(target=_digest_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(results.keys()) == [0, 1], dict(results)
    for rank in (0, 1):
        outcome, seconds = results[rank]
        assert outcome.startswith("DigestFailed"), (rank, outcome)
        assert "[1]" in outcome and seconds < 30, (rank, outcome, seconds)


# ------------------------------------------------------------------ the digest across TP layouts


def _tower_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "norm.w": torch.randn(32, generator=g),  # float32: two words per element
        "norm.b": torch.randn(32, generator=g),
        **{f"qkv.{s}": r(32, 32) for s in "qkv"},
        **{f"qkv.{s}b": r(32) for s in "qkv"},
        "proj.w": r(32, 32),
        "proj.b": r(32),
        "up.0": r(64, 32),
        "up.1": r(64, 32),
        "fc1.w": r(48, 32),
        "fc1.b": r(48),
        "fc2.w": r(32, 48),
        "rep.w": r(16, 32),
        "rep.b": r(16),
        "dp.w": r(24, 32),  # a layer with TP disabled: held whole on every rank
    }


def _tower(full: dict[str, torch.Tensor], odd: bool) -> torch.nn.Module:
    """vLLM's own parallel layers (QKV, merged column, column, row, replicated, TP
    disabled) and plain modules, loaded through their weight loaders: each rank holds
    its shards, as in an engine."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    bf16 = {"params_dtype": torch.bfloat16}
    t = torch.nn.Module()
    t.norm = torch.nn.LayerNorm(32)
    t.qkv = QKVParallelLinear(32, 8, 4, 4, bias=True, **bf16)
    t.proj = RowParallelLinear(32, 32, bias=True, **bf16)
    t.up = MergedColumnParallelLinear(32, [64, 64], bias=False, **bf16)
    t.fc1 = ColumnParallelLinear(32, 48, bias=True, **bf16)
    t.fc2 = RowParallelLinear(48, 32, bias=False, **bf16)
    t.rep = ReplicatedLinear(32, 16, bias=True, **bf16)
    t.dp = ColumnParallelLinear(32, 24, bias=False, disable_tp=True, **bf16)
    with torch.no_grad():
        t.norm.weight.copy_(full["norm.w"])
        t.norm.bias.copy_(full["norm.b"])
    for s in "qkv":
        t.qkv.weight_loader(t.qkv.weight, full[f"qkv.{s}"], s)
        t.qkv.weight_loader(t.qkv.bias, full[f"qkv.{s}b"], s)
    t.proj.weight_loader(t.proj.weight, full["proj.w"])
    t.proj.weight_loader(t.proj.bias, full["proj.b"])
    t.up.weight_loader(t.up.weight, full["up.0"], 0)
    t.up.weight_loader(t.up.weight, full["up.1"], 1)
    t.fc1.weight_loader(t.fc1.weight, full["fc1.w"])
    t.fc1.weight_loader(t.fc1.bias, full["fc1.b"])
    t.fc2.weight_loader(t.fc2.weight, full["fc2.w"])
    t.rep.weight_loader(t.rep.weight, full["rep.w"])
    t.rep.weight_loader(t.rep.bias, full["rep.b"])
    t.dp.weight_loader(t.dp.weight, full["dp.w"])
    if odd:  # a tensor sharded by a layer the digest does not know: differs per rank
        from vllm.distributed import get_tensor_model_parallel_rank

        t.odd = torch.nn.Parameter(torch.full((4,), float(get_tensor_model_parallel_rank())))
    model = torch.nn.Module()
    model.visual = t
    model.language_model = torch.nn.Linear(4, 4)
    model.get_language_model = lambda: model.language_model
    return model


def _tp_digest(rank: int, world: int, port: int, case: tuple, results) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from lmcache_ec_broker.connector.vllm.tp_digest import weights_digest

    seed, change_rank1, odd = case
    # vLLM's CPU communicator reads the name its CPU worker sets (cpu_worker.py); when an
    # earlier test in this process left the CPU platform's communicator chosen, it is used.
    os.environ["VLLM_DIST_IDENT"] = f"ec-digest-test-{port}"
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        model = _tower(_tower_weights(seed), odd)
        if change_rank1 and rank == 1:  # one element of rank 1's row-parallel shard
            with torch.no_grad():
                model.visual.fc2.weight[5, 3] += 1
        results[(world, case, rank)] = weights_digest(model)


def test_encoder_digest_is_the_same_for_tp1_and_tp2_and_covers_every_shard():
    """vLLM's parallel layers sharded over two gloo ranks give the digest of the same
    layers held whole (TP 1); other weights, or one element changed in rank 1's shard
    only, give another; a tensor of an unknown sharding makes the digest layout-bound
    (the same on both ranks, not TP 1's). Before: each rank's digest of its own shard,
    combined in rank order (TP 1 and TP 2 never agreed)."""
    from lmcache_ec_broker.testing.ports import free_ports

    ctx = mp.get_context("fork")  # vLLM imported once, above
    results = ctx.Manager().dict()
    cases = {
        (1, (0, False, False)),
        (2, (0, False, False)),
        (1, (1, False, False)),
        (2, (0, True, False)),
        (1, (0, False, True)),
        (2, (0, False, True)),
    }
    for world, case in sorted(cases):
        port = free_ports(1)
        procs = [
            ctx.Process(target=_tp_digest, args=(r, world, port, case, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0, (world, case)

    def digest(world: int, case: tuple) -> str:
        ranks = {results[(world, case, r)] for r in range(world)}
        assert len(ranks) == 1, ("ranks disagree", world, case, ranks)
        return ranks.pop()

    plain = (0, False, False)
    assert digest(2, plain) == digest(1, plain)
    assert digest(1, (1, False, False)) != digest(1, plain)
    assert digest(2, (0, True, False)) != digest(2, plain)
    odd = (0, False, True)
    assert digest(2, odd) != digest(1, odd)  # layout-bound, and both ranks agree on it
