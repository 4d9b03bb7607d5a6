"""Time to first token through real ``vllm serve``: cold encoder vs. warm from the broker.

    .venv/bin/python benchmarks/ttft.py                        # ~4-6 minutes on 2 cores
    .venv/bin/python benchmarks/ttft.py --images 224 --reps 1  # smoke run

A random-weight Qwen2-VL-family model is built offline with a vision tower large
enough that the encoder is a real share of prefill (the text side is tiny, so the
figures isolate what the cache saves). Two ``vllm serve`` instances (vLLM's CPU
build here; any vLLM on a GPU) share one broker through ECBrokerConnector
(role ec_both). For each image size and each of ``--reps`` distinct images:

- cold:  instance A sees the image first: the encoder runs (and the entry is stored);
- warm (same instance): ``POST /reset_encoder_cache`` on A, same request again:
  vLLM's own encoder cache is empty, the entry comes from the broker;
- warm (2nd instance): the same request on instance B, which never saw the image.

TTFT is the latency of a ``max_tokens=1`` chat completion (prefill + one token).
Every warm figure is checked against the broker's hit counter, so a warm request
that silently recomputed the encoder is reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import Broker, MiB, fmt_size, median, table  # noqa: E402


def bench_spec(max_side: int):
    from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec

    # Text side: 2 small layers. Vision side: 6 layers of width 384 over up to a few
    # thousand patches -- the encoder dominates prefill, as for real VLMs on images.
    return TinyQwen2VLSpec(
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


def ttft(url: str, model: str, image_url: str) -> float:
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "describe the image"},
                ],
            }
        ],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", default="224,448,672", help="square image sides in pixels")
    p.add_argument("--reps", type=int, default=3, help="distinct images per size")
    p.add_argument("--models", default=None, help="model cache root (default: a temp dir)")
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args()

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl, image_tokens
    from lmcache_ec_broker.testing.vllm_server import VllmServer, ec_transfer_config, png_data_url

    sides = [int(s) for s in args.images.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ecb-ttft-", dir="/tmp"))
    spec = bench_spec(max(sides))
    model = str(build_tiny_qwen2vl(args.models or work / "models", spec))
    max_tokens = max(image_tokens(spec, s, s) for s in sides) + 64
    extra = [
        "--max-model-len", str(max(512, max_tokens)),
        "--max-num-batched-tokens", str(max(512, max_tokens)),
    ]  # fmt: skip
    servers: list[VllmServer] = []
    rows, raw = [], []
    try:
        with Broker(512 * MiB) as broker:
            cores = os.cpu_count() or 1
            for i, name in enumerate(("a", "b")):
                servers.append(
                    VllmServer(
                        model,
                        work / f"{name}.log",
                        ec_config=ec_transfer_config("ec_both", broker.socket_path),
                        extra_args=extra,
                        env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
                    ).start()
                )
            t0 = time.monotonic()
            for s in servers:
                s.wait_ready(timeout=900)
            print(
                f"  two vllm serve instances ready in {time.monotonic() - t0:.0f}s", file=sys.stderr
            )
            a, b = servers
            client = BrokerClient(broker.socket_path)

            def hits() -> int:
                return int(client.stats().get("hits", 0))

            for side in sides:
                for s in servers:  # first-request costs (allocations, kernels) off the clock
                    ttft(s.url, model, png_data_url(10_000 + side, side))
                cold, warm_a, warm_b, ok = [], [], [], True
                for rep in range(args.reps):
                    img = png_data_url(side * 100 + rep, side)
                    cold.append(ttft(a.url, model, img))
                    a.reset_encoder_cache()
                    h = hits()
                    warm_a.append(ttft(a.url, model, img))
                    ok &= hits() > h
                    h = hits()
                    warm_b.append(ttft(b.url, model, img))
                    ok &= hits() > h
                tokens = image_tokens(spec, side, side)
                entry = tokens * spec.hidden_size * 2
                c, wa, wb = median(cold), median(warm_a), median(warm_b)
                raw.append(
                    {"side": side, "tokens": tokens, "entry_bytes": entry,
                     "cold": cold, "warm_same": warm_a, "warm_other": warm_b, "all_warm_hit": ok}
                )  # fmt: skip
                rows.append([
                    f"{side}x{side}", tokens, fmt_size(entry) if entry % 1024 == 0 else f"{entry} B",
                    f"{c * 1e3:.0f}", f"{wa * 1e3:.0f}", f"{(c - wa) * 1e3:.0f}", f"{c / wa:.2f}x",
                    f"{wb * 1e3:.0f}", f"{c / wb:.2f}x", "yes" if ok else "NO (see logs)",
                ])  # fmt: skip
                print(f"  measured {side}x{side}", file=sys.stderr, flush=True)
            client.close()
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.wait_stopped()
        keep = os.environ.get("LMCACHE_EC_KEEP_BENCH")
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"model: tiny Qwen2-VL, random weights (text {spec.num_layers}x{spec.hidden_size}, "
        f"vision {spec.vision_depth}x{spec.vision_embed_dim}); TTFT in ms, median of "
        f"{args.reps} distinct images per size\n"
    )
    print(
        table(
            ["image", "image tokens", "entry", "cold", "warm (same)", "saved", "speedup",
             "warm (2nd instance)", "speedup", "warm = broker hit"],
            rows,
        )
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0 if all(r["all_warm_hit"] for r in raw) else 1


if __name__ == "__main__":
    sys.exit(main())
