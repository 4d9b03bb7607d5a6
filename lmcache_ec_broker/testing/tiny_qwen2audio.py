"""Build a tiny random-weight Qwen2-Audio checkpoint offline, for tests and benchmarks.

Like :mod:`lmcache_ec_broker.testing.tiny_qwen2vl`: a byte-level BPE tokenizer
trained on synthetic sentences, a Qwen-style chat template, a Whisper feature
extractor and a randomly initialised Qwen2-Audio saved in the layout vLLM reads.
Deterministic for a given :class:`TinyQwen2AudioSpec`, cached in a directory
named after the spec.

    python -m lmcache_ec_broker.testing.tiny_qwen2audio [--root DIR] [--audio-layers 4 ...]

prints the model directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lmcache_ec_broker.testing.tiny_qwen2vl import DEFAULT_ROOT, build_cached, train_tokenizer

# Ids 0..5, in this order: the config below refers to them by position.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
)

# vLLM hands the template one part per audio item ({"type": "audio"}); Qwen2-Audio's
# processor then expands the single <|AUDIO|> to one token per encoder output row.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('audio', 'audio_url', 'input_audio') or 'audio' in part %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SAMPLING_RATE = 16_000
# Qwen2-Audio (as vLLM runs it) always encodes one 30 s Whisper window: 3000 mel
# frames -> 1500 positions after conv2 -> 750 output rows after the pooler. Shorter
# clips are padded to the window and their rows masked off afterwards.
WINDOW_SECONDS = 30
MAX_SOURCE_POSITIONS = 1500
HOP_LENGTH = 160


@dataclass(frozen=True)
class TinyQwen2AudioSpec:
    """Shape of the tiny model. Raise the audio fields to make the encoder a real
    share of prefill (benchmarks); keep the defaults for fast tests."""

    vocab_size: int = 512
    tokenizer_vocab: int = 400
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    audio_layers: int = 2
    audio_d_model: int = 64
    audio_heads: int = 2
    audio_ffn_dim: int = 128
    num_mel_bins: int = 80
    # Standard deviation of conv1 and the projector at init. With the default 0.02
    # the encoder output is dominated by its (random) position table and different
    # clips give the same tokens; at 2.0, 7 of 10 test clips gave distinct tokens
    # (0.5: 3 of 10).
    input_init_std: float = 2.0
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0

    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def audio_tokens(num_samples: int) -> int:
    """Encoder output rows (= prompt tokens, = entry rows) for a 16 kHz mono clip
    of ``num_samples`` samples, as Qwen2-Audio's processor counts them."""
    mel = min(num_samples, WINDOW_SECONDS * SAMPLING_RATE) // HOP_LENGTH
    after_conv = (mel - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


# Weight-name prefixes as transformers 5.x may write them (nested under "model.", or
# mapped back on save, which for 5.19 doubles the language model's "model.") and as
# vLLM 0.32's qwen2_audio.py loads them (the classic layout). Longest prefixes first.
_VLLM_PREFIXES = (
    ("language_model.model.model.", "language_model.model."),
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)


def _rename_for_vllm(name: str) -> str:
    for old, new in _VLLM_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"unexpected weight name {name!r} in the tiny Qwen2-Audio checkpoint")


def _build_into(spec: TinyQwen2AudioSpec, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(
            SPECIAL_TOKENS, spec.tokenizer_vocab, spec.vocab_size, spec.seed
        ),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=spec.num_mel_bins,
        sampling_rate=SAMPLING_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=WINDOW_SECONDS,
        return_attention_mask=True,
    )
    processor = Qwen2AudioProcessor(
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )

    config = Qwen2AudioConfig(
        audio_config={
            "num_mel_bins": spec.num_mel_bins,
            "encoder_layers": spec.audio_layers,
            "encoder_attention_heads": spec.audio_heads,
            "encoder_ffn_dim": spec.audio_ffn_dim,
            "d_model": spec.audio_d_model,
            "max_source_positions": MAX_SOURCE_POSITIONS,
        },
        text_config={
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "max_window_layers": spec.num_layers,
            "tie_word_embeddings": False,
            "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
            "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
            "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        },
        audio_token_index=SPECIAL_TOKENS.index("<|AUDIO|>"),
        architectures=["Qwen2AudioForConditionalGeneration"],
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():
        for layer in (model.model.audio_tower.conv1, model.model.multi_modal_projector.linear):
            layer.weight.normal_(0.0, spec.input_init_std)
    model = model.to(getattr(torch, spec.dtype))
    model.generation_config.do_sample = False
    model.save_pretrained(out)

    weights = out / "model.safetensors"
    tensors = load_file(weights)
    save_file({_rename_for_vllm(k): v for k, v in tensors.items()}, weights, {"format": "pt"})
    processor.save_pretrained(out)
    # transformers 5.x writes the feature extractor into processor_config.json only;
    # vLLM (through AutoFeatureExtractor) also looks for preprocessor_config.json.
    feature_extractor.save_pretrained(out)
    (out / "tiny_spec.json").write_text(
        json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True)
    )


def build_tiny_qwen2audio(
    root: str | Path | None = None, spec: TinyQwen2AudioSpec | None = None
) -> Path:
    """Return the directory of the model for ``spec``, building it if not cached."""
    spec = spec or TinyQwen2AudioSpec()
    return build_cached(
        root, f"tiny-qwen2audio-{spec.digest()}", lambda out: _build_into(spec, out)
    )


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help=f"cache root (default {DEFAULT_ROOT})")
    for field in dataclasses.fields(TinyQwen2AudioSpec):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)
    args = vars(parser.parse_args(argv))
    root = args.pop("root")
    print(build_tiny_qwen2audio(root, TinyQwen2AudioSpec(**args)))


if __name__ == "__main__":
    _main()
