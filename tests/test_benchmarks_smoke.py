"""Each benchmark script runs once with tiny sizes, so the scripts cannot rot.

These are not timed tests: they check that the scripts run against real processes
(broker, redis-server, vLLM's connector class, vllm serve) and print their tables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import REDIS_SERVER

from lmcache_ec_broker.testing.vllm_server import SLOW_HOST_BUDGETS

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark; past ``timeout`` it gets SIGINT first, so its ``finally`` stops
    the vllm serve / broker / redis processes it started (a SIGKILL would orphan the
    servers, which run in their own sessions), then SIGKILL. Keep ``timeout`` well under
    the suite's 600 s per-test timeout, or pytest-timeout kills the test first."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{script} ran past {timeout:.0f} s:\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_transfer_smoke(tmp_path: Path) -> None:
    # --no-vllm: importing vLLM takes minutes on a busy 2-core machine; the full
    # benchmark uses vLLM's real ECExampleConnector class.
    out = tmp_path / "transfer.json"
    before = {n for n in os.listdir("/dev/shm") if n.startswith("ecb-bench-st-")}
    r = _run(
        "transfer.py", "--sizes", "64KiB,1MiB", "--runs", "1", "--quick", "--no-vllm",
        "--disk-dir", str(tmp_path), "--json", str(out),
        timeout=420,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("memcpy", "get_into", "st-shm", "st-disk-cold", "redis", "ECCPUConnector",
                   "exact save_file/load_file calls",
                   "hit x1", "miss x1", "put_many+get_many", "new blocks", "reused blocks",
                   "hit x1 (asked: leased 1 ms)", "against the floor"):  # fmt: skip
        assert needle in r.stdout, (needle, r.stdout)
    assert out.exists()
    # Nothing left behind: private socket dirs and shm segments are removed.
    assert not {n for n in os.listdir("/dev/shm") if n.startswith("ecb-bench-st-")} - before


def test_wakeup_probe_smoke() -> None:
    r = _run("wakeup_probe.py", "--iters", "200", "--runs", "1", timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("both block", "both busy-poll", "pinned to one CPU"):
        assert needle in r.stdout, (needle, r.stdout)


def test_slab_copy_probe_smoke() -> None:
    # The rotating floors tiny too (defaults: 256 MiB region, 2 s idle, 64 copies: 11.7 s
    # of the run; 3.4 s with these, 2026-12-02).
    r = _run("slab_copy_probe.py", "--sizes", "1MiB", "--gaps", "0,0.1", "--reps", "2",
             "--rotate-sizes", "64KiB", "--region", "4MiB", "--copies", "8", "--idle", "0.2",
             timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "slab write (again)" in r.stdout and "1 MiB" in r.stdout, r.stdout
    assert "rotating shm idle" in r.stdout and "64 KiB" in r.stdout, r.stdout


def test_idle_memcpy_probe_smoke() -> None:
    # Tiny: the defaults populate 2 GiB and sleep 4 s (38-46 s of CI under load)
    r = _run("idle_memcpy_probe.py", "--region", "64MiB", "--nbytes", "4MiB", "--idle", "0.2",
             timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "never-touched memory" in r.stdout, r.stdout


def test_filter_probe_smoke() -> None:
    r = _run("filter_probe.py", "--number", "20", "--repeat", "1", "--sizes", "1,64", timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("blake2b keyed (v1)", "xxh3-64 seeded (v2)", "numpy gather"):
        assert needle in r.stdout, (needle, r.stdout)


def test_gpu_transfer_smoke() -> None:
    import torch

    r = _run("gpu_transfer.py", "--sizes", "64KiB,1MiB", "--runs", "1", timeout=300)
    if not torch.cuda.is_available():
        assert r.returncode == 3, r.stderr
        assert "no CUDA device" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-4000:]
    assert "cudaHostRegister" in r.stdout and "put GB/s" in r.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("modality, sizes", [("image", ["--images", "112"])])
def test_ttft_smoke(modality: str, sizes: list[str], tmp_path: Path) -> None:
    # Video and audio: tests/e2e/test_vllm_modalities.py makes the same checks on servers
    # it starts anyway (a warm request on the same instance and on a second one are
    # broker hits, num_frames per request); runs here started 6 more engines for them
    # (~140 s of CI).
    # test_ttft_video_and_audio_setups below runs their setup code. The "other node"
    # remote hit is checked here for images; the remote tier stores the bytes whatever
    # the modality (tests/test_remote_*.py).
    out = tmp_path / "ttft.json"
    models = os.environ.get("LMCACHE_EC_TEST_MODELS")
    # A loaded CI host can answer a lookup later than the production budget (a correct
    # miss, but not the warm hit asserted below): the instances wait as long as it needs.
    r = _run("ttft.py", "--modality", modality, *sizes, "--reps", "1", "--json", str(out),
             "--connector-extra", json.dumps(SLOW_HOST_BUDGETS),
             *(["--models", models] if models else []), timeout=480)  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    assert "warm (2nd instance)" in r.stdout and "yes" in r.stdout
    result = json.loads(out.read_text())
    assert result["modality"] == modality and result["rows"][0]["all_warm_hit"]
    # A third instance with its own broker ("another node"), A's and C's brokers sharing
    # one redis-server: C's warm request is a remote hit in C's broker.
    if REDIS_SERVER is None:
        assert not result["remote"] and "redis-server is not installed" in r.stdout
    else:
        assert result["remote"] and "warm (other node)" in r.stdout, r.stdout
        assert "other node = remote hit" in r.stdout, r.stdout
        assert result["rows"][0]["remote_hit"] and result["rows"][0]["warm_remote"]
    # The host is left as found: the shared memory vLLM's processes used (psm_*,
    # sem.mp-*: ~200 MiB per server) is gone once the servers have stopped.
    assert result["shm_used"], "the benchmark did not see its servers' shared memory"
    assert result["shm_left"] == []
    assert not [n for n in result["shm_used"] if os.path.exists(os.path.join("/dev/shm", n))]


def test_attribution_smoke(tmp_path: Path) -> None:
    out = tmp_path / "attribution.json"
    r = _run(
        "attribution.py", "--iters", "60", "--sizes", "64KiB", "--json", str(out),
        "--across-iters", "2", "--across-sizes", "64KiB,34MiB", timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("has() hit, 1 key", "put 64 KiB", "put (commit waited) 64 KiB",
                   "put (reserve path) 64 KiB", "get_into 64 KiB",
                   "raw Unix-socket ping-pong", "bare memcpy 64 KiB", "syscalls+wake-ups",
                   "has() hit, leased (asked)", "has() with a lease",
                   # issue 42: across processes, the copy before and after side by side
                   "Across processes (quiet)", "get 34 MiB", "frames", "faults",
                   "clone / get new", "2 memcpys / put+get_into",
                   "py after copy", "has() p50"):  # fmt: skip
        assert needle in r.stdout, (needle, r.stdout)
    res = json.loads(out.read_text())
    rows = res["rows"]
    # The broker's own times were read (an arena put waits for none: its Place is posted).
    assert all(row["broker"] > 0 or row["posted"] > 0 for row in rows), rows
    across = res["across"]["summary"][0][str(34 << 20)]
    assert {"before", "after"} <= set(across), across  # both paths, one run
    assert all(across[m]["get_new_vs_clone"] > 0 for m in ("before", "after")), across


def test_attribution_compares_two_client_trees(tmp_path: Path) -> None:
    # --before-tree: a "main" client (here this checkout again, standing in for a
    # worktree of main) and this checkout's, each in its own writer and reader,
    # interleaved against one broker, with their own baselines and has() figures.
    out = tmp_path / "attribution.json"
    r = _run(
        "attribution.py", "--only", "across", "--across-iters", "1", "--across-sizes", "64KiB",
        "--before-tree", str(REPO), "--gap-ms", "2", "--json", str(out), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "the reader asleep 2 ms before each get_into" in r.stdout, r.stdout
    run = json.loads(out.read_text())["across"]["runs"][0]
    assert run["modes"] == ["main", "branch"] and run["before_tree"] == str(REPO)
    assert set(run["has"]) == {"main", "branch"}
    per = json.loads(out.read_text())["across"]["summary"][0][str(64 << 10)]
    assert all(per[m]["vs_floor"] > 0 and per[m]["memcpy_reader_us"] > 0 for m in run["modes"])


def test_attribution_pins_the_processes_where_asked(tmp_path: Path) -> None:
    # --pin: the broker, the writer and the reader run on the CPUs named (CPU 0 exists
    # on every machine); a malformed value is refused by name.
    out = tmp_path / "attribution.json"
    r = _run(
        "attribution.py", "--only", "across", "--across-iters", "1", "--across-sizes", "64KiB",
        "--pin", "0/0/0", "--json", str(out), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "pinned: broker on CPUs 0, writers 0, readers 0" in r.stdout, r.stdout
    assert json.loads(out.read_text())["across"]["runs"][0]["pin"] == ["0", "0", "0"]
    bad = _run("attribution.py", "--only", "across", "--pin", "0/1", timeout=60)
    assert bad.returncode == 2 and "--pin takes three CPU lists" in bad.stderr, bad.stderr


def test_sched_batch_probe_smoke() -> None:
    r = _run(
        "sched_batch_probe.py", "--sizes", "64KiB", "--rounds", "1", "--iters", "20",
        "--hogs", "1", timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "1 CPU-bound processes beside it" in r.stdout and "has p99 batch" in r.stdout, r.stdout


def test_shm_floor_probe_smoke() -> None:
    # the bare pair checks its own bytes (a copy of other bytes fails the run)
    r = _run("shm_floor_probe.py", "--sizes", "64KiB", "--rounds", "1", "--iters", "3",
             "--gap-ms", "1", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "2 memcpys / bare" in r.stdout and "64 KiB" in r.stdout, r.stdout
    assert "2 memcpys / slab copies" in r.stdout, r.stdout  # the slab copies check theirs too
    # the streamed and memmove puts side by side (each get_into checks its bytes)
    assert "2 memcpys / streamed" in r.stdout and "client, memmove puts" in r.stdout, r.stdout
    assert "1 ms asleep before each get_into" in r.stdout, r.stdout


def test_ttft_video_and_audio_setups(tmp_path: Path) -> None:
    """benchmarks/ttft.py's video and audio setups (no servers: the end-to-end checks
    its smoke runs made for these modalities are in tests/e2e/test_vllm_modalities.py):
    the model builds, each sweep point's item is the modality's chat part, video
    points ask for their frame count per request (servers trust request kwargs), and
    the servers' context fits the largest item."""
    import argparse

    from benchmarks import ttft

    models = Path(os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path / "models")
    args = argparse.Namespace(frames="4,8", video_side=56, clips="2,3")
    video = ttft.SETUPS["video"](args, models)
    audio = ttft.SETUPS["audio"](args, models)
    for setup, n_points, part_type in ((video, 2, "video_url"), (audio, 2, "input_audio")):
        assert (Path(setup.model) / "config.json").exists(), setup.model
        assert len(setup.points) == n_points
        context = int(setup.server_args[setup.server_args.index("--max-model-len") + 1])
        assert context > max(p.tokens for p in setup.points)
        for point in setup.points:
            part, extra = point.item(0)
            assert part["type"] == part_type, part
    assert [v.item(0)[1]["media_io_kwargs"]["video"]["num_frames"] for v in video.points] == [4, 8]
    assert video.points[0].tokens < video.points[1].tokens
    assert "--trust-request-mm-kwargs" in video.server_args
    assert "--media-io-kwargs" in audio.server_args


def test_dedup_smoke(tmp_path: Path) -> None:
    """benchmarks/dedup.py, one broker, two clients, one round of two items: with claims
    every item is encoded once (without: by each client that missed it)."""
    out = tmp_path / "dedup.json"
    r = _run(
        "dedup.py", "--clients", "2", "--rounds", "1", "--items", "2", "--encode-ms", "50",
        "--size", "4096", "--quick", "--json", str(out),
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [x["claims"] for x in results] == [False, True]
    assert results[1]["encodes_per_item"] == 1.0, results


@pytest.mark.vllm
def test_dedup_vllm_smoke(tmp_path: Path) -> None:
    """benchmarks/dedup_vllm.py, one node, two real vllm serve instances, one burst of two
    new images (each instance one request per image, all at once): with claims every
    item is encoded once on the node, and the instance that lost the race waited for the
    other's encode (a claim that stopped deduplicating fails here: no wait, or two runs).
    Three bursts: on a loaded host one burst's requests may not meet (the second
    instance's arrives after the first's put: a plain hit), three rarely all miss."""
    out = tmp_path / "dedup_vllm.json"
    r = _run(
        "dedup_vllm.py", "--setups", "node", "--instances", "2", "--rounds", "3",
        "--items", "2", "--hit-items", "1", "--max-tokens", "2", "--side", "112",
        "--connector-extra", json.dumps(SLOW_HOST_BUDGETS), "--json", str(out),
        timeout=540,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for needle in ("runs/item", "p50 vs off", "burst: encoded here", "hit (staged)"):
        assert needle in r.stdout, (needle, r.stdout)
    runs = json.loads(out.read_text())["runs"]
    assert [x["claims"] for x in runs] == [False, True]
    off, on = runs
    for x in runs:
        assert x["distinct"] == 6 and not x["errors"], x
        assert all(s["mm_hash"] for s in x["sent"]), x["sent"]
    assert on["encoder_runs"] == 6, on
    roles = [s["role"] for s in on["sent"] if s["phase"] == "burst"]
    assert "waited, loaded" in roles and on["counters"]["claim_waits"] > 0, roles
    assert on["counters"]["claim_timeouts"] == 0, on["counters"]
    assert [s["role"] for s in on["sent"] if s["phase"] == "hit"] == ["loaded"], on["sent"]


def test_batch_start_probe_smoke() -> None:
    # benchmarks/batch_start_probe.py (issue 42: a read that starts a Served batch),
    # this checkout standing in for both trees.
    r = _run(
        "batch_start_probe.py", "--before-tree", str(REPO), "--rounds", "1", "--iters", "20",
        "--gap-ms", "1", timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("get_into 64 KiB", "has() hit", "before / after", "load (1 min)"):
        assert needle in r.stdout, (needle, r.stdout)


@pytest.mark.vllm
def test_tp_step_cost_smoke(tmp_path: Path) -> None:
    """benchmarks/tp_step_cost.py: one real vllm serve at TP 2, two images each as a miss
    then a hit: both ranks log steps with and without loads, and a hit loaded. Budgets
    of 10 s: on a loaded 2-vCPU host a TP 2 worker's fetch reply can arrive seconds
    late (docs/performance.md, "Per-step cost at TP=2"); at the benchmark's 2 s the
    staging then fails and the hit is encoded, which this smoke is not about.

    A run that loads no hit at all fails: it is how the held request's empty-step loop
    starving the broker showed (both ranks' staging Gets unanswered for the whole
    budget beside CPU-bound processes; scheduler.py's IDLE_STEP_WAIT_S ends it)."""
    out = tmp_path / "tp_step_cost.json"
    budgets = {"scheduler_budget_ms": 10_000, "worker_budget_ms": 10_000}
    r = _run(
        "tp_step_cost.py", "--images", "2", "--max-tokens", "2", "--side", "112",
        "--connector-extra", json.dumps(budgets), "--json", str(out), timeout=540,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for needle in ("p50 with/without", "hit (looked up, loaded)"):
        assert needle in r.stdout, (needle, r.stdout)
    samples = json.loads(out.read_text())["samples"]
    assert {"worker/0/True", "worker/1/True", "worker/0/False", "worker/1/False"} <= set(
        samples
    ), sorted(samples)


def test_step_put_under_staging_smoke() -> None:
    r = _run("step_put_under_staging.py", "--puts", "10", "--put-size", "64KiB",
             "--stage-size", "4MiB", "--stage-entries", "2", "--gap-ms", "1", timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    for needle in ("put alone", "shared client", "a client each"):
        assert needle in r.stdout, (needle, r.stdout)
