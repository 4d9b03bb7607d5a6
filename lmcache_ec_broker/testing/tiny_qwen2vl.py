"""Build a tiny random-weight Qwen2-VL checkpoint offline, for tests and benchmarks.

Everything is generated locally (no model hub): a byte-level BPE tokenizer trained
on synthetic sentences, a Qwen-style chat template, the Qwen2-VL image/video
processors and a randomly initialised model saved with ``save_pretrained``. The
result is deterministic for a given :class:`TinyQwen2VLSpec` and cached in a
directory named after the spec, so repeated calls are cheap.

Usage::

    python -m lmcache_ec_broker.testing.tiny_qwen2vl [--root DIR] [--vision-depth 4 ...]

prints the model directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Ids 0..6, in this order: the config below refers to them by position.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an image picture photo shows describe what is in this of and with on cat dog "
    "red blue green small large tree house car road sky cloud sun water person people "
    "table chair window door light dark left right top bottom color shape square circle "
    "user assistant system please answer question text hello world one two three four"
).split()

DEFAULT_ROOT = Path(
    os.environ.get(
        "LMCACHE_EC_TEST_MODELS", Path.home() / ".cache" / "lmcache-ec-broker" / "models"
    )
)


@dataclass(frozen=True)
class TinyQwen2VLSpec:
    """Shape of the tiny model. Raise the vision fields to make the encoder a
    real share of prefill (benchmarks); keep the defaults for fast tests."""

    vocab_size: int = 512
    tokenizer_vocab: int = 400
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    vision_mlp_ratio: int = 2
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0

    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def mrope_section(self) -> list[int]:
        # Qwen2-VL splits half the head dim into (temporal, height, width) as 1/4, 3/8, 3/8.
        half = self.hidden_size // self.num_heads // 2
        t = half // 4
        h = (half - t) // 2
        return [t, h, half - t - h]


def train_tokenizer(special_tokens: tuple[str, ...], vocab: int, model_vocab: int, seed: int):
    """A byte-level BPE tokenizer trained on synthetic sentences; ``special_tokens``
    get ids 0.. in order (the model configs refer to them by position)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + rng.choice(".?!")
        for _ in range(4000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, name in enumerate(special_tokens):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    if tok.get_vocab_size() > model_vocab:
        raise ValueError(
            f"tokenizer vocab {tok.get_vocab_size()} exceeds model vocab {model_vocab}"
        )
    return tok


def _train_tokenizer(spec: TinyQwen2VLSpec):
    return train_tokenizer(SPECIAL_TOKENS, spec.tokenizer_vocab, spec.vocab_size, spec.seed)


def _build_into(spec: TinyQwen2VLSpec, out: Path) -> None:
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    pixels = {
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.merge_size,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**pixels),
        chat_template=CHAT_TEMPLATE,
    )

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "max_window_layers": spec.num_layers,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": spec.mrope_section(),
            },
            "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
            "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
            "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        },
        vision_config={
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.hidden_size,
            "num_heads": spec.vision_heads,
            "mlp_ratio": spec.vision_mlp_ratio,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
        },
        image_token_id=SPECIAL_TOKENS.index("<|image_pad|>"),
        video_token_id=SPECIAL_TOKENS.index("<|video_pad|>"),
        vision_start_token_id=SPECIAL_TOKENS.index("<|vision_start|>"),
        vision_end_token_id=SPECIAL_TOKENS.index("<|vision_end|>"),
        architectures=["Qwen2VLForConditionalGeneration"],
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2VLForConditionalGeneration(config).to(getattr(torch, spec.dtype))
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "tiny_spec.json").write_text(
        json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True)
    )


def build_cached(root: str | Path | None, name: str, build: Callable[[Path], None]) -> Path:
    """Return ``root/name``, calling ``build(tmpdir)`` first if it is not there yet.

    A finished build has ``tiny_spec.json`` (``build`` writes it last). Safe to call
    from concurrent processes: each builds in a private temporary directory and
    renames it into place; the first rename wins.
    """
    root = Path(root) if root is not None else DEFAULT_ROOT
    target = root / name
    if (target / "tiny_spec.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        tmp.chmod(0o755)
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tiny_spec.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_qwen2vl(root: str | Path | None = None, spec: TinyQwen2VLSpec | None = None) -> Path:
    """Return the directory of the model for ``spec``, building it if not cached."""
    spec = spec or TinyQwen2VLSpec()
    return build_cached(root, f"tiny-qwen2vl-{spec.digest()}", lambda out: _build_into(spec, out))


def image_tokens(spec: TinyQwen2VLSpec, width: int, height: int) -> int:
    """Encoder output rows for an image already inside the pixel limits and
    a multiple of ``patch_size * merge_size`` on each side."""
    unit = spec.patch_size * spec.merge_size
    return (width // unit) * (height // unit)


def video_tokens(spec: TinyQwen2VLSpec, width: int, height: int, frames: int) -> int:
    """Encoder output rows for ``frames`` sampled frames of that size (frames are
    grouped ``temporal_patch_size`` at a time; an odd count is padded up)."""
    groups = -(-frames // spec.temporal_patch_size)
    return groups * image_tokens(spec, width, height)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help=f"cache root (default {DEFAULT_ROOT})")
    for field in dataclasses.fields(TinyQwen2VLSpec):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)
    args = vars(parser.parse_args(argv))
    root = args.pop("root")
    print(build_tiny_qwen2vl(root, TinyQwen2VLSpec(**args)))


if __name__ == "__main__":
    _main()


def build_bench_qwen2vl(work: Path, side: int) -> str:
    """The benchmarks' model (epd.py, dedup_vllm.py, tp_step_cost.py): an encoder that is
    a real share of the prefill, for images up to ``side`` px; built into the shared
    test-model cache ($LMCACHE_EC_TEST_MODELS) when set, else under ``work``."""
    spec = TinyQwen2VLSpec(
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=4,
        vision_depth=4,
        vision_embed_dim=256,
        vision_heads=4,
        vision_mlp_ratio=4,
        min_pixels=56 * 56,
        max_pixels=side * side,
    )
    return str(build_tiny_qwen2vl(os.environ.get("LMCACHE_EC_TEST_MODELS") or work / "models", spec))
