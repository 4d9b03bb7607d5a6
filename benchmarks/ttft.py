"""Time to first token through real ``vllm serve``: cold encoder vs. warm from the broker.

    .venv/bin/python benchmarks/ttft.py                               # images, ~3 min
    .venv/bin/python benchmarks/ttft.py --modality video              # 8/16/32/64 frames
    .venv/bin/python benchmarks/ttft.py --modality audio              # 5/15/30 s clips
    .venv/bin/python benchmarks/ttft.py --images 224 --reps 1         # smoke run

Random-weight models are built offline with an encoder large enough to be a real
share of prefill (the text side is tiny, so the figures isolate what the cache
saves): a Qwen2-VL-family model for images and video (MP4s written with OpenCV,
``num_frames`` chosen per request), a Qwen2-Audio-family model for audio (WAVs).
Two ``vllm serve`` instances (vLLM's CPU build here; any vLLM on a GPU) share one
broker through ECBrokerConnector (role ec_both). For each sweep point and each
of ``--reps`` distinct items:

- cold:  instance A sees the item first: the encoder runs (and the entry is stored);
- warm (same instance): ``POST /reset_encoder_cache`` on A, same request again:
  vLLM's own encoder cache is empty, the entry comes from the broker;
- warm (2nd instance): the same request on instance B, which never saw the item;
- warm (other node): the same request on instance C, a "different node": C has its
  own broker (own socket, slab, everything), and A's and C's brokers share one
  redis-server (started here, on a Unix socket) as their remote tier. Before C is
  timed, A's broker has written the entry to Redis (write-behind) and C's broker has
  heard of the key; C's broker then promotes it from Redis into its slab.
  ``--no-remote`` leaves C out; without redis-server the column is skipped (said so).

TTFT is the latency of a ``max_tokens=1`` chat completion (prefill + one token).
Every warm figure is checked against the broker's hit counter (C's against its
broker's remote-hit counter), so a warm request that silently recomputed the encoder
is reported, not hidden. With fewer cores than instances, a request is timed only
once the instance sharing its core has been idle 1.5 s (see ``timed``). The servers'
shared memory is removed when they stop (the run leaves /dev/shm as it found it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from redis_servers import REDIS_SERVER, RedisServer  # noqa: E402

from benchmarks._common import Broker, MiB, exit_on_sigterm, fmt_size, median, table  # noqa: E402

Item = tuple[dict[str, Any], dict[str, Any]]  # (chat content part, extra request fields)


@dataclass
class Point:
    """One row of the sweep: ``item(k)`` is the k-th distinct item of this point."""

    label: str
    tokens: int
    item: Callable[[int], Item]


@dataclass
class Setup:
    model: str
    describe: str
    server_args: list[str]
    first_column: str
    points: list[Point]
    entry_bytes_per_token: int
    notes: list[str] = field(default_factory=list)


def image_setup(args: argparse.Namespace, models: Path) -> Setup:
    from lmcache_ec_broker.testing.media import image_part
    from lmcache_ec_broker.testing.tiny_qwen2vl import (
        TinyQwen2VLSpec,
        build_tiny_qwen2vl,
        image_tokens,
    )
    from lmcache_ec_broker.testing.vllm_server import png_data_url

    sides = [int(s) for s in args.images.split(",")]
    spec = vision_spec(TinyQwen2VLSpec, max(sides))
    points = [
        Point(
            f"{s}x{s}",
            image_tokens(spec, s, s),
            lambda k, s=s: (image_part(png_data_url(s * 100 + k, s)), {}),
        )
        for s in sides
    ]
    return Setup(
        model=str(build_tiny_qwen2vl(models, spec)),
        describe=f"tiny Qwen2-VL, random weights (text {spec.num_layers}x{spec.hidden_size}, "
        f"vision {spec.vision_depth}x{spec.vision_embed_dim})",
        server_args=context_args(max(p.tokens for p in points)),
        first_column="image",
        points=points,
        entry_bytes_per_token=spec.hidden_size * 2,
    )


def vision_spec(cls, max_side: int):
    # Text side: 2 small layers. Vision side: 6 layers of width 384 over up to a few
    # thousand patches -- the encoder dominates prefill, as for real VLMs.
    return cls(
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=2,
        num_heads=8,
        num_kv_heads=8,
        vision_depth=6,
        vision_embed_dim=384,
        vision_heads=6,
        vision_mlp_ratio=4,
        min_pixels=56 * 56,
        max_pixels=max_side * max_side,
    )


def video_setup(args: argparse.Namespace, models: Path) -> Setup:
    from lmcache_ec_broker.testing.media import mp4_data_url, video_part
    from lmcache_ec_broker.testing.tiny_qwen2vl import (
        TinyQwen2VLSpec,
        build_tiny_qwen2vl,
        video_tokens,
    )

    frames = [int(f) for f in args.frames.split(",")]
    side = args.video_side
    spec = vision_spec(TinyQwen2VLSpec, side)
    # More frames than any point samples: when num_frames covers every frame, vLLM
    # lets the HF processor resample by fps instead.
    recorded = max(frames) + 8
    cache: dict[int, str] = {}

    def clip(k: int) -> str:  # one MP4 per rep, shared by every frame count
        if k not in cache:
            cache[k] = mp4_data_url(5000 + k, frames=recorded, size=side, fps=8)
        return cache[k]

    def item(k: int, n: int) -> Item:
        # vLLM 0.32's default loader for Qwen2-VL samples by fps and ignores
        # num_frames; the generic "opencv" loader honours it. Per request, so one
        # pair of servers serves the whole sweep; vLLM hashes these kwargs into
        # mm_hash, so each frame count is its own entry.
        io = {"video": {"video_backend": "opencv", "num_frames": n}}
        return video_part(clip(k)), {"media_io_kwargs": io}

    points = [
        Point(f"{n} frames", video_tokens(spec, side, side, n), lambda k, n=n: item(k, n))
        for n in frames
    ]
    return Setup(
        model=str(build_tiny_qwen2vl(models, spec)),
        describe=f"tiny Qwen2-VL, random weights (text {spec.num_layers}x{spec.hidden_size}, "
        f"vision {spec.vision_depth}x{spec.vision_embed_dim}); {recorded}-frame MP4 "
        f"({side}x{side}, {recorded / 8:.0f} s at 8 fps), frames sampled per request",
        server_args=[
            *context_args(max(p.tokens for p in points)),
            "--limit-mm-per-prompt",
            '{"image": 0, "video": 1}',
            "--trust-request-mm-kwargs",
        ],  # fmt: skip
        first_column="video",
        points=points,
        entry_bytes_per_token=spec.hidden_size * 2,
    )


def audio_setup(args: argparse.Namespace, models: Path) -> Setup:
    from lmcache_ec_broker.testing.media import audio_part, wav_bytes
    from lmcache_ec_broker.testing.tiny_qwen2audio import (
        SAMPLING_RATE,
        WINDOW_SECONDS,
        TinyQwen2AudioSpec,
        audio_tokens,
        build_tiny_qwen2audio,
    )

    clips = [float(c) for c in args.clips.split(",")]
    spec = TinyQwen2AudioSpec(
        hidden_size=1024,
        intermediate_size=2048,
        num_heads=8,
        num_kv_heads=8,
        audio_layers=8,
        audio_d_model=512,
        audio_heads=8,
        audio_ffn_dim=2048,
        num_mel_bins=128,
    )
    points = [
        Point(
            f"{c:g} s",
            audio_tokens(int(c * SAMPLING_RATE)),
            lambda k, c=c: (audio_part(wav_bytes(7000 + int(c * 10) * 10 + k, c)), {}),
        )
        for c in clips
    ]
    return Setup(
        model=str(build_tiny_qwen2audio(models, spec)),
        describe=f"tiny Qwen2-Audio, random weights (text {spec.num_layers}x{spec.hidden_size}, "
        f"audio {spec.audio_layers}x{spec.audio_d_model}); 16 kHz mono WAVs",
        server_args=[
            # Qwen2-Audio reserves one 30 s window (750 tokens) per clip.
            *context_args(max(750, *(p.tokens for p in points))),
            "--limit-mm-per-prompt",
            '{"audio": 1}',
            "--media-io-kwargs",
            '{"audio": {"audio_backend": "soundfile"}}',
        ],  # fmt: skip
        first_column="audio clip",
        points=points,
        entry_bytes_per_token=spec.hidden_size * 2,
        notes=[
            f"Qwen2-Audio's encoder always runs one padded {WINDOW_SECONDS} s window (1500 "
            "positions) and masks the padding afterwards, so its cost, and the saving, do "
            "not grow with the clip; only the entry and the text prefill do."
        ],
    )


def context_args(max_item_tokens: int) -> list[str]:
    n = str(max(512, max_item_tokens + 64))
    return ["--max-model-len", n, "--max-num-batched-tokens", n]


def ttft(url: str, model: str, item: Item) -> float:
    part, extra = item
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "describe it"}]}],
        "max_tokens": 1,
        "temperature": 0.0,
        **extra,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        r.read()
    return time.perf_counter() - t0


QUIET_S = 1.5  # see timed() in main

SETUPS = {"image": image_setup, "video": video_setup, "audio": audio_setup}


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modality", choices=sorted(SETUPS), default="image")
    p.add_argument("--images", default="224,448,672", help="image: square sides in pixels")
    p.add_argument("--frames", default="8,16,32,64", help="video: frames sampled per request")
    p.add_argument("--video-side", type=int, default=224, help="video: frame side in pixels")
    p.add_argument("--clips", default="5,15,30", help="audio: clip lengths in seconds")
    p.add_argument(
        "--reps", type=int, default=None, help="distinct items per point (3; 2 for video/audio)"
    )
    p.add_argument("--models", default=None, help="model cache root (default: a temp dir)")
    p.add_argument(
        "--no-remote",
        action="store_true",
        help="leave out the 'warm (other node)' column (third instance, own broker, Redis)",
    )
    p.add_argument(
        "--connector-extra",
        type=json.loads,
        default={},
        help="JSON merged into the instances' ec_connector_extra_config, e.g. "
        '\'{"scheduler_budget_ms": 2000}\' (a loaded test host; default: production values)',
    )
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args()
    reps = args.reps or (3 if args.modality == "image" else 2)
    remote_note = ""
    if args.no_remote:
        remote_note = "warm (other node): off (--no-remote)"
    elif REDIS_SERVER is None:
        remote_note = (
            "warm (other node): SKIPPED, redis-server is not installed (apt-get install "
            "redis-server; or pass --no-remote)"
        )
        print("  " + remote_note, file=sys.stderr, flush=True)
    remote = not remote_note

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.testing.shm_cleanup import list_vllm_shm
    from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config

    work = Path(tempfile.mkdtemp(prefix="ecb-ttft-", dir="/tmp"))
    setup = SETUPS[args.modality](args, Path(args.models) if args.models else work / "models")
    servers: list[VllmServer] = []
    rows, raw = [], []
    load = os.getloadavg()[0]
    keep = bool(os.environ.get("LMCACHE_EC_KEEP_BENCH"))
    try:
        with contextlib.ExitStack() as stack:
            remote_args: list[str] = []
            if remote:  # one store (Unix socket only) for two "nodes"
                redis = stack.enter_context(RedisServer(tcp=False))
                remote_args = ["--remote-url", redis.url("unix")]
            broker = stack.enter_context(Broker(512 * MiB, remote_args))
            brokers = [broker, broker]  # A and B share one broker
            if remote:  # C: its own broker, socket, slab
                brokers.append(stack.enter_context(Broker(512 * MiB, remote_args)))
            cores = os.cpu_count() or 1
            for i, (name, br) in enumerate(zip("abc", brokers, strict=False)):
                servers.append(
                    VllmServer(
                        setup.model,
                        work / f"{name}.log",
                        ec_config=ec_transfer_config(
                            "ec_both", br.socket_path, **args.connector_extra
                        ),
                        extra_args=setup.server_args,
                        env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
                    ).start()
                )
            t0 = time.monotonic()
            for s in servers:
                s.wait_ready(timeout=900)
            print(
                f"  {len(servers)} vllm serve instances ready in {time.monotonic() - t0:.0f}s",
                file=sys.stderr,
            )
            a = servers[0]
            client = stack.enter_context(BrokerClient(broker.socket_path))
            client_c = stack.enter_context(BrokerClient(brokers[2].socket_path)) if remote else None

            # After each step, a vLLM worker busy-polls its message queue for 1 s
            # (shm_broadcast, busy_loop_s) on its bound core. With three instances on
            # fewer cores, two share one: a request timed there while the other spins
            # ran up to ~0.7 s slower here. So a request waits until the instance
            # sharing its core has been idle for QUIET_S.
            last_done = [float("-inf")] * len(servers)

            def timed(i: int, item: Item) -> float:
                for j, done in enumerate(last_done):
                    if j != i and j % cores == i % cores:
                        time.sleep(max(0.0, done + QUIET_S - time.monotonic()))
                try:
                    return ttft(servers[i].url, setup.model, item)
                finally:
                    last_done[i] = time.monotonic()

            def hits() -> int:
                return int(client.stats().get("hits", 0))

            def remote_hits() -> int:
                assert client_c is not None
                return int(client_c.stats().get("remote_hits", 0))

            def a_to_redis() -> Callable[[], bool]:
                """Call before A's cold request; the returned wait() is true once A's
                broker has written the new entry to Redis and C's broker knows its key."""
                if client_c is None:
                    return lambda: True
                sa, sc = client.stats(), client_c.stats()
                done = int(sa.get("remote_writes", 0)) + int(sa.get("remote_writes_skipped", 0))
                known = int(sc.get("remote_known_keys", 0))

                def wait(timeout: float = 120.0) -> bool:
                    deadline = time.monotonic() + timeout
                    while time.monotonic() < deadline:
                        sa, sc = client.stats(), client_c.stats()
                        written = (
                            int(sa.get("remote_writes", 0))
                            + int(sa.get("remote_writes_skipped", 0))
                            > done
                            and int(sa.get("remote_pending_writes", 0)) == 0
                        )
                        if written and int(sc.get("remote_known_keys", 0)) > known:
                            return True
                        time.sleep(0.02)
                    print(
                        f"  A's entry did not reach C's broker in {timeout:.0f}s (A: "
                        f"{ {k: v for k, v in sa.items() if k.startswith('remote_')} }, C: "
                        f"{ {k: v for k, v in sc.items() if k.startswith('remote_')} })",
                        file=sys.stderr,
                        flush=True,
                    )
                    return False

                return wait

            for point in setup.points:
                # First-request costs (allocations, kernels; C: the remote read) off the clock.
                wait = a_to_redis()
                timed(0, point.item(10_000))
                wait()
                for i in range(1, len(servers)):
                    timed(i, point.item(10_000))
                cold, warm_a, warm_b, warm_c, ok, ok_c = [], [], [], [], True, True
                for rep in range(reps):
                    item = point.item(rep)
                    wait = a_to_redis()
                    cold.append(timed(0, item))
                    # A's write-behind finishes before any warm request is timed.
                    ok_c &= wait()
                    a.reset_encoder_cache()
                    h = hits()
                    warm_a.append(timed(0, item))
                    ok &= hits() > h
                    h = hits()
                    warm_b.append(timed(1, item))
                    ok &= hits() > h
                    if remote:
                        h = remote_hits()
                        warm_c.append(timed(2, item))
                        ok_c &= remote_hits() > h
                entry = point.tokens * setup.entry_bytes_per_token
                c, wa, wb = median(cold), median(warm_a), median(warm_b)
                row = {
                    "point": point.label, "tokens": point.tokens, "entry_bytes": entry,
                    "cold": cold, "warm_same": warm_a, "warm_other": warm_b,
                    "all_warm_hit": ok and (ok_c or not remote),
                }  # fmt: skip
                cells = [
                    point.label, point.tokens, fmt_size(entry) if entry % 1024 == 0 else f"{entry} B",
                    f"{c * 1e3:.0f}", f"{wa * 1e3:.0f}", f"{(c - wa) * 1e3:.0f}", f"{c / wa:.2f}x",
                    f"{wb * 1e3:.0f}", f"{(c - wb) * 1e3:.0f}", f"{c / wb:.2f}x",
                    "yes" if ok else "NO (see logs)",
                ]  # fmt: skip
                if remote:
                    wc = median(warm_c)
                    row |= {"warm_remote": warm_c, "remote_hit": ok_c}
                    cells += [
                        f"{wc * 1e3:.0f}", f"{(c - wc) * 1e3:.0f}", f"{c / wc:.2f}x",
                        "yes" if ok_c else "NO (see logs)",
                    ]  # fmt: skip
                raw.append(row)
                rows.append(cells)
                print(f"  measured {point.label}", file=sys.stderr, flush=True)
            if remote:
                st = {k: v for k, v in client_c.stats().items() if k.startswith("remote_")}
                print(f"  C's broker: {st}", file=sys.stderr, flush=True)
    except BaseException:
        keep = True  # the servers' logs hold the cause
        print(f"  failed; the servers' logs are kept in {work}", file=sys.stderr, flush=True)
        raise
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.wait_stopped()  # also removes the shared memory the servers used
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    used = set().union(*(s.shm_seen for s in servers)) if servers else set()
    left = sorted(used & list_vllm_shm())
    print(
        f"model: {setup.describe}; {os.cpu_count()} CPUs, load average {load:.1f} at start; "
        f"TTFT in ms, median of {reps} distinct items per row\n"
    )
    headers = [setup.first_column, "tokens", "entry", "cold", "warm (same)", "saved", "speedup",
               "warm (2nd instance)", "saved", "speedup", "warm = broker hit"]  # fmt: skip
    if remote:
        headers += ["warm (other node)", "saved", "speedup", "other node = remote hit"]
    print(table(headers, rows))
    if remote:
        print(
            "\nwarm (other node): a third instance with its own broker; A's and C's brokers "
            "share one redis-server (Unix socket, same host), so the figure includes C's "
            "broker reading the entry from Redis into its slab, not a network transfer."
        )
    elif remote_note:
        print("\n" + remote_note)
    for note in setup.notes:
        print("\n" + note)
    print(f"\n/dev/shm: {len(used)} vLLM segments used by the servers, {len(left)} left behind")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"modality": args.modality, "rows": raw, "remote": remote,
                 "remote_note": remote_note, "shm_used": sorted(used), "shm_left": left},
                indent=2,
            )
        )  # fmt: skip
    return 0 if all(r["all_warm_hit"] for r in raw) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
