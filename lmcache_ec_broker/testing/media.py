"""Deterministic synthetic media for tests and benchmarks: MP4 videos and WAV clips,
and the OpenAI chat-content parts that carry them to ``vllm serve``.

Each item is a function of its seed: the same seed gives the same bytes, different
seeds give visibly/audibly different content (so their encoder outputs differ).
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
import wave
from typing import Any

AUDIO_RATE = 16_000  # what Whisper-style feature extractors expect: no resampling


def mp4_bytes(seed: int, frames: int = 16, size: int = 112, fps: int = 8) -> bytes:
    """An MP4 (OpenCV's ``mp4v``) of ``frames`` frames, ``size`` x ``size`` pixels:
    a seed-specific gradient with a square moving across it."""
    import cv2
    import numpy as np

    y, x = np.mgrid[0:size, 0:size]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write mp4v video here (no MP4 encoder)")
        side = max(4, size // 6)
        for f in range(frames):
            frame = np.stack(
                [
                    (x * 7 + seed * 31 + f * 3) % 256,
                    (y * 5 + seed * 17) % 256,
                    (x * y + seed * 13 + f * 11) % 256,
                ],
                axis=-1,
            ).astype(np.uint8)
            pos = (f * 5 + seed * 7) % (size - side)
            frame[pos : pos + side, pos : pos + side] = (255 - 40 * (f % 4), 255, 0)
            writer.write(frame)
        writer.release()
        with open(path, "rb") as fh:
            data = fh.read()
    finally:
        os.unlink(path)
    if not data:
        raise RuntimeError("OpenCV wrote an empty MP4")
    return data


def mp4_data_url(seed: int, frames: int = 16, size: int = 112, fps: int = 8) -> str:
    return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(seed, frames, size, fps)).decode()


def wav_bytes(seed: int, seconds: float = 3.0, rate: int = AUDIO_RATE) -> bytes:
    """A 16-bit mono WAV: seed-specific tones that change every quarter second, plus noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    segment = (t * 4).astype(int)  # a new pair of tones every 0.25 s
    f1 = 200 + rng.integers(0, 1800, size=segment.max() + 1)[segment]
    f2 = 300 + rng.integers(0, 3000, size=segment.max() + 1)[segment]
    signal = 0.4 * np.sin(2 * np.pi * f1 * t) + 0.3 * np.sin(2 * np.pi * f2 * t)
    signal += 0.05 * rng.standard_normal(n)
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def audio_part(wav: bytes) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }
