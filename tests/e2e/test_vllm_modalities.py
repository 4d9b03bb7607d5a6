"""Video and audio end to end: real ``vllm serve`` processes (vLLM on CPU), a real broker.

Video: the tiny Qwen2-VL, an MP4 written by the test with OpenCV, sent as
``video_url`` with ``--media-io-kwargs '{"video": {"video_backend": "opencv",
"num_frames": N}}'``.
Audio: the tiny Qwen2-Audio, a WAV written by the test, sent as ``input_audio``.

All servers of the module (seven engines) start at once and are shared by the
tests; each test uses its own clips so the tests do not see each other's entries.
Expect a few minutes, almost all of it server start-up. The last test SIGKILLs one
of the module's servers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Unguarded on purpose: CI installs vLLM, so these tests must fail without it, never skip.
import vllm  # noqa: F401
from conftest import PATIENT, BrokerProcess, shm_segments, wait_until

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.testing.media import audio_part, mp4_data_url, video_part, wav_bytes
from lmcache_ec_broker.testing.tiny_qwen2audio import (
    SAMPLING_RATE,
    TinyQwen2AudioSpec,
    audio_tokens,
    build_tiny_qwen2audio,
)
from lmcache_ec_broker.testing.tiny_qwen2vl import (
    TinyQwen2VLSpec,
    build_tiny_qwen2vl,
    video_tokens,
)
from lmcache_ec_broker.testing.vllm_server import SLOW_HOST_BUDGETS, VllmServer, ec_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

VIDEO_SPEC = TinyQwen2VLSpec()
AUDIO_SPEC = TinyQwen2AudioSpec()
FRAMES, OTHER_FRAMES = 8, 4  # sampled per video by the servers (--media-io-kwargs)
VIDEO_SIDE = 112  # the clips' frame size: inside the tiny model's pixel limits
CLIP_SECONDS = 3.0
CLIP_FRAMES = 16  # recorded per MP4: more than FRAMES (see video_args)





def video_entry_bytes(frames: int) -> int:
    rows = video_tokens(VIDEO_SPEC, VIDEO_SIDE, VIDEO_SIDE, frames)
    return rows * VIDEO_SPEC.hidden_size * 2  # bf16


def audio_entry_bytes(seconds: float) -> int:
    return audio_tokens(int(seconds * SAMPLING_RATE)) * AUDIO_SPEC.hidden_size * 2


def video_args(frames: int) -> list[str]:
    # vLLM 0.32 picks its "qwen2_vl" video loader for Qwen2-VL, which samples by fps
    # and ignores num_frames; the generic "opencv" loader honours num_frames (the
    # clip must have more frames than that, or the HF processor resamples by fps).
    video_io = {"video": {"video_backend": "opencv", "num_frames": frames}}
    return [
        "--max-model-len", "2048",
        "--max-num-batched-tokens", "2048",
        "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
        "--media-io-kwargs", json.dumps(video_io),
    ]  # fmt: skip


AUDIO_ARGS = [
    # Qwen2-Audio reserves 750 tokens per clip (one 30 s window).
    "--max-model-len", "1024",
    "--max-num-batched-tokens", "1024",
    "--limit-mm-per-prompt", '{"audio": 1}',
    "--media-io-kwargs", '{"audio": {"audio_backend": "soundfile"}}',
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ecmod-", dir="/tmp"))  # short: AF_UNIX path limit
    yield d
    if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def broker(workdir: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(str(workdir / "broker.sock"), ["--shm-size", "256MiB"]).start()
    try:
        yield b
    finally:
        b.stop()
    assert not shm_segments(b.socket_path, include_filter=True), "broker left its segments"


def stats(broker: BrokerProcess) -> dict:
    with BrokerClient(broker.socket_path, **PATIENT) as c:
        s = c.stats()
    assert s, "broker did not answer stats"
    return s


def counted_hits(broker: BrokerProcess, want: int) -> int:
    """The broker's hit count once it reaches ``want`` (or after 60 s): a load answered
    from the residency index reaches the broker's counters through the client's
    flusher, within ~50 ms of the load, not with the reply to vLLM's request
    (tests/test_served_flush.py holds it to that bound; here a starved host may take
    longer, while a load never reported never arrives)."""
    return wait_until(
        lambda: (n := int(stats(broker)["hits"])) >= want and n, f"{want} hits", timeout=60
    )


@pytest.fixture(scope="module")
def servers(broker: BrokerProcess, workdir: Path) -> Iterator[dict[str, VllmServer]]:
    models = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
    video_model = build_tiny_qwen2vl(models, VIDEO_SPEC)
    audio_model = build_tiny_qwen2audio(models, AUDIO_SPEC)
    cores = os.cpu_count() or 1
    fleet: dict[str, VllmServer] = {}

    def server(name: str, model: Path, args: list[str], connected: bool = True) -> None:
        cfg = (
            ec_transfer_config("ec_both", broker.socket_path, **SLOW_HOST_BUDGETS)
            if connected
            else None
        )
        # vLLM binds every instance's OpenMP thread to core 0 by default: spread them.
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(len(fleet) % cores)}
        fleet[name] = VllmServer(model, workdir / f"{name}.log", cfg, args, env=env)

    # A and B also take num_frames per request (media_io_kwargs), as benchmarks/ttft.py's do.
    trust = [*video_args(FRAMES), "--trust-request-mm-kwargs"]
    server("video_a", video_model, trust)
    server("video_b", video_model, trust)
    server("video_other_frames", video_model, video_args(OTHER_FRAMES))
    # The reference without a connector; it also accepts a per-request num_frames.
    server("video_plain", video_model, [*video_args(FRAMES), "--trust-request-mm-kwargs"], False)
    server("audio_a", audio_model, AUDIO_ARGS)
    server("audio_b", audio_model, AUDIO_ARGS)
    server("audio_plain", audio_model, AUDIO_ARGS, connected=False)
    try:
        for s in fleet.values():
            s.start()
        for s in fleet.values():
            s.wait_ready(timeout=900)
        yield fleet
    finally:
        for s in fleet.values():
            s.terminate()
        for s in fleet.values():
            s.wait_stopped()


def check_second_instance_loads(a, b, plain, broker, part, control, entry_bytes, **request):
    """A encodes and stores; its encoder cache reset, A loads its own entry back; B,
    which never saw the item, loads A's entry (a broker hit, no encoder run, a
    connector load) and answers exactly as a vLLM without the connector does.
    ``request`` adds top-level request fields (``media_io_kwargs``) to every request."""
    entries = stats(broker)["entries"]
    stored_before = a.ec_puts()
    tokens_a = a.chat_parts_token_ids([part], **request)
    new = {h: n for h, n in a.ec_puts().items() if h not in stored_before}
    assert list(new.values()) == [entry_bytes], a.log_tail()
    (mm_hash,) = new
    assert stats(broker)["entries"] == entries + 1

    # Warm on the same instance: vLLM's encoder cache emptied, the entry comes from the
    # broker (benchmarks/ttft.py's "warm (same)").
    a.reset_encoder_cache()
    hits = stats(broker)["hits"]
    assert a.chat_parts_token_ids([part], **request) == tokens_a
    assert counted_hits(broker, hits + 1) == hits + 1, "A did not load its own entry back"
    assert a.ec_loads()[-1] == mm_hash
    assert a.ec_put_hashes().count(mm_hash) == 1, "A ran the encoder again"

    hits = stats(broker)["hits"]
    loaded_before = b.ec_loads()
    tokens_b = b.chat_parts_token_ids([part], **request)
    assert counted_hits(broker, hits + 1) == hits + 1, "B did not load A's entry"
    assert mm_hash not in b.ec_puts(), "B ran the encoder itself"
    assert b.ec_loads() == [*loaded_before, mm_hash]

    reference = plain.chat_parts_token_ids([part], **request)
    assert tokens_b == reference == tokens_a
    # The item shapes the answer (so equal tokens above mean the right embedding).
    assert plain.chat_parts_token_ids([control], **request) != reference


def test_video_second_instance_loads_first_instances_entry(servers, broker):
    check_second_instance_loads(
        servers["video_a"], servers["video_b"], servers["video_plain"], broker,
        part=video_part(mp4_data_url(seed=11, frames=CLIP_FRAMES)),
        control=video_part(mp4_data_url(seed=12, frames=CLIP_FRAMES)),
        entry_bytes=video_entry_bytes(FRAMES),
    )  # fmt: skip


def test_same_video_at_another_num_frames_is_another_entry(servers, broker):
    """The same MP4 sampled at 4 instead of 8 frames is a different encoder output:
    an instance configured for 4 frames must miss A's 8-frame entry and store its
    own, and the 8-frame instances must keep loading the 8-frame entry."""
    a, b = servers["video_a"], servers["video_b"]
    other, plain = servers["video_other_frames"], servers["video_plain"]
    part = video_part(mp4_data_url(seed=13, frames=CLIP_FRAMES))
    stored_before = set(a.ec_puts())
    a.chat_parts_token_ids([part])
    (hash_8,) = set(a.ec_puts()) - stored_before

    hits = stats(broker)["hits"]
    tokens_4 = other.chat_parts_token_ids([part])
    assert stats(broker)["hits"] == hits, "4-frame request was served the 8-frame entry"
    assert hash_8 not in other.ec_puts()
    assert list(other.ec_puts().values()) == [video_entry_bytes(OTHER_FRAMES)], other.log_tail()
    assert hash_8 not in other.ec_loads()
    per_request_4 = {"video": {"num_frames": OTHER_FRAMES}}
    assert tokens_4 == plain.chat_parts_token_ids([part], media_io_kwargs=per_request_4)

    b.chat_parts_token_ids([part])
    assert counted_hits(broker, hits + 1) == hits + 1
    assert b.ec_loads()[-1] == hash_8, "8-frame instance loaded something else"


def test_audio_second_instance_loads_first_instances_entry(servers, broker):
    check_second_instance_loads(
        servers["audio_a"], servers["audio_b"], servers["audio_plain"], broker,
        # Seeds whose answers differ (a random-weight model maps some clips alike).
        part=audio_part(wav_bytes(seed=22, seconds=CLIP_SECONDS)),
        control=audio_part(wav_bytes(seed=26, seconds=CLIP_SECONDS)),
        entry_bytes=audio_entry_bytes(CLIP_SECONDS),
    )  # fmt: skip


def test_video_frames_asked_per_request_are_shared_too(servers, broker):
    """num_frames per request (``media_io_kwargs``), as benchmarks/ttft.py --modality
    video sends it: vLLM hashes it into mm_hash, A stores an entry of that many frames,
    A (reset) and B load it. (Replaces that benchmark's video smoke run, which started
    three engines of its own for these checks.)"""
    per_request = {"video": {"video_backend": "opencv", "num_frames": OTHER_FRAMES}}
    check_second_instance_loads(
        servers["video_a"], servers["video_b"], servers["video_plain"], broker,
        part=video_part(mp4_data_url(seed=14, frames=CLIP_FRAMES)),
        control=video_part(mp4_data_url(seed=12, frames=CLIP_FRAMES)),
        entry_bytes=video_entry_bytes(OTHER_FRAMES),
        media_io_kwargs=per_request,
    )  # fmt: skip


def test_a_server_killed_on_a_slow_shutdown_leaves_no_shared_memory(servers):
    """A loaded host makes vLLM's shutdown outlast stop()'s timeout; the SIGKILL that
    follows used to leave its psm_* segments (~400 MiB for this tiny model) in /dev/shm.

    Runs last in the module (pytest keeps the file's order): it takes one of the
    module's servers, which no test needs afterwards, instead of starting its own."""
    from lmcache_ec_broker.testing.shm_cleanup import list_vllm_shm

    server = servers.pop("video_other_frames")
    server.stop(timeout=0.1)  # straight to SIGKILL of the whole process group
    assert server.proc is not None and server.proc.returncode is not None
    assert server.shm_seen, "the server was not seen using shared memory"
    assert not server.shm_seen & list_vllm_shm(), "segments left behind"
