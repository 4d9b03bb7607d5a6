"""EPD across two nodes with real vLLM: an encoder instance (``--mm-encoder-only``,
``ec_producer``) on node 1, a prefill/decode instance (``ec_consumer``) on node 2,
each node its own broker (own socket, slab, events port), the brokers joined by a
real redis-server (the fleet tier), an aggregator following both brokers' residency
events, and ``examples/epd/proxy.py`` in front (twice: vLLM's protocol as it is, and
lookup-first).

Encoder runs are counted exactly: every instance's connector is a subclass that logs
each ``save_caches`` call, which vLLM makes once per item its encoder computed
(``counting_ec_connector.py``). One module, three ``vllm serve`` (E, PD, and an
aggregated instance without a connector for the reference answers), started once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, broker_stats, wait_until
from redis_servers import REDIS_SERVER, RedisServer

pytest.importorskip("vllm")

from counting_ec_connector import ENCODER_RAN  # noqa: E402

from lmcache_ec_broker.testing.broker_process import BrokerProcess  # noqa: E402
from lmcache_ec_broker.testing.media import image_part, mp4_data_url, video_part  # noqa: E402
from lmcache_ec_broker.testing.ports import free_ports
from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl  # noqa: E402
from lmcache_ec_broker.testing.vllm_server import (  # noqa: E402
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    png_data_url,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed"),
]

HERE = Path(__file__).resolve().parent
PROXY = REPO / "examples" / "epd" / "proxy.py"
FRAMES = 4  # sampled per video (--media-io-kwargs); the clips have more
MEDIA_ARGS = [
    "--max-model-len", "2048",
    "--max-num-batched-tokens", "2048",
    "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
    "--media-io-kwargs", json.dumps({"video": {"video_backend": "opencv", "num_frames": FRAMES}}),
]  # fmt: skip
E_ACCESS = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class NodeBroker:
    """One node's broker: its own socket and slab, residency events on, the fleet tier."""

    def __init__(self, workdir: Path, name: str, remote_url: str) -> None:
        self.name = name
        self.socket_path = str(workdir / f"{name}.sock")
        self.events_port = free_ports(2)
        cfg = workdir / f"{name}.yaml"
        cfg.write_text(
            f"remote_url: '{remote_url}'\nremote_timeout_s: 5.0\n"
            f"events_port: {self.events_port}\nevents_node: {name}\nevents_heartbeat_s: 0.5\n"
        )
        args = ["--shm-size", "256MiB", "--config", str(cfg)]
        log = workdir / f"broker-{name}.log"
        self.process = BrokerProcess(self.socket_path, args, log_path=log).start(timeout=60)
        wait_until(lambda: bool(broker_stats(self.socket_path)), f"broker {name}", timeout=60)

    def stats(self) -> dict:
        return broker_stats(self.socket_path)

    def stop(self) -> None:
        self.process.stop(60)


class Process:
    """A helper process (aggregator, proxy) whose log goes to a file."""

    def __init__(self, cmd: list[str], log_path: Path, url: str, ready_path: str) -> None:
        self.url = url
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + ready_path, timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(up, f"{cmd[:3]} answering", timeout=120, interval=0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def proxy_cmd(port: int, e: VllmServer, pd: VllmServer, lookup: str | None) -> list[str]:
    cmd = [sys.executable, str(PROXY), "--port", str(port), "--encoder", e.url]
    cmd += ["--pd", f"{pd.url}=node-2"]
    return cmd + (["--lookup", lookup] if lookup else [])


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="ecepd-", dir="/tmp"))  # short: AF_UNIX limit
    redis = RedisServer()
    brokers: dict[str, NodeBroker] = {}
    servers: dict[str, VllmServer] = {}
    helpers: dict[str, Process] = {}
    try:
        root = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
        model = str(build_tiny_qwen2vl(root, TinyQwen2VLSpec()))
        for name in ("node-1", "node-2"):
            brokers[name] = NodeBroker(workdir, name, redis.url("unix"))
        port = free_ports(1)
        agg = [sys.executable, "-m", "lmcache_ec_broker.events.aggregator", "--port", str(port)]
        agg += ["--down-after", "3"]
        for b in brokers.values():
            agg += ["--broker", f"tcp://127.0.0.1:{b.events_port}"]
        helpers["aggregator"] = Process(
            agg, workdir / "aggregator.log", f"http://127.0.0.1:{port}", "/healthz"
        )
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        }
        counting = {"connector": "CountingECBrokerConnector", "module": "counting_ec_connector"}
        cores = os.cpu_count() or 1
        specs = {
            # E: encoder only; PD: the render endpoint for the lookup-first proxy.
            "e": ("ec_producer", "node-1", ["--mm-encoder-only"]),
            "pd": ("ec_consumer", "node-2", ["--enable-scale-out"]),
            "plain": (None, None, []),
        }
        for i, (name, (role, node, extra)) in enumerate(specs.items()):
            cfg = None
            if role is not None:
                sock = brokers[node].socket_path
                cfg = ec_transfer_config(role, sock, **counting, **SLOW_HOST_BUDGETS)
            servers[name] = VllmServer(
                model,
                workdir / f"vllm-{name}.log",
                ec_config=cfg,
                extra_args=[*MEDIA_ARGS, *extra],
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
            )
        # All at once: a start is mostly single-threaded imports, so starts overlap on the
        # cores (each server runs its worker inside its EngineCore: two processes each).
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(timeout=900)
        e, pd = servers["e"], servers["pd"]
        for name, lookup in (("proxy", None), ("lookup_proxy", helpers["aggregator"].url)):
            port = free_ports(1)
            helpers[name] = Process(
                proxy_cmd(port, e, pd, lookup),
                workdir / f"{name}.log",
                f"http://127.0.0.1:{port}",
                "/stats",
            )
        yield {"model": model, "brokers": brokers, "servers": servers, **helpers}
    finally:
        for h in helpers.values():
            h.stop()
        for s in servers.values():
            s.terminate()
        for s in servers.values():
            s.wait_stopped()
        for b in brokers.values():
            b.stop()
        redis.stop()
        if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


def encoder_runs(server: VllmServer) -> list[str]:
    """mm_hashes this instance's encoder computed, in order (repeats kept)."""
    return ENCODER_RAN.findall(server.log_text())


def e_requests(server: VllmServer) -> int:
    """Chat requests the instance answered (uvicorn's access log)."""
    return len(E_ACCESS.findall(server.log_text()))


def chat_tokens(
    url: str, model: str, parts: list[dict[str, Any]], max_tokens: int = 6
) -> list[int]:
    """Greedy completion through ``url`` (the proxy or an instance): the token ids."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    reply = http_json(url + "/v1/chat/completions", body)
    return [
        int(t["token"].removeprefix("token_id:"))
        for t in reply["choices"][0]["logprobs"]["content"]
    ]


def stats(proxy: Process) -> dict[str, Any]:
    return http_json(proxy.url + "/stats")


def render_hashes(fleet: dict[str, Any], parts: list[dict[str, Any]]) -> list[str]:
    """The items' mm hashes, from vLLM's render endpoint on PD."""
    body = {"model": fleet["model"], "messages": [{"role": "user", "content": parts}]}
    reply = http_json(
        fleet["servers"]["pd"].url + "/v1/chat/completions/render", {**body, "mm_payload": "none"}
    )
    by_modality = reply["features"]["mm_hashes"]
    return [h for m in sorted(by_modality) for h in by_modality[m]]


def resident(fleet: dict[str, Any], hashes: list[str]) -> bool:
    """The aggregator lists every hash in the shared tier."""
    body = {"model": fleet["model"], "mm_hashes": hashes}
    found = http_json(fleet["aggregator"].url + "/v1/lookup", body)["results"]
    return all(any("remote" in n["tiers"] for n in r["nodes"]) for r in found)


IMAGE_A, IMAGE_B, IMAGE_C, VIDEO = (
    [image_part(png_data_url(seed=301))],
    [image_part(png_data_url(seed=302)), image_part(png_data_url(seed=303))],
    [image_part(png_data_url(seed=304))],
    [video_part(mp4_data_url(seed=305, frames=16))],
)


@pytest.mark.parametrize("parts", [IMAGE_A, IMAGE_B, VIDEO], ids=["image", "two-images", "video"])
def test_pd_loads_every_item_e_encoded(fleet, parts) -> None:
    """Through the proxy (vLLM's protocol): E encodes each item once, PD loads every one
    of them from node 2's broker (fleet tier) and encodes none, and the answer equals the
    aggregated instance's."""
    e, pd, plain = (fleet["servers"][n] for n in ("e", "pd", "plain"))
    proxy = fleet["proxy"]
    e_runs, pd_runs, pd_loads = len(encoder_runs(e)), len(encoder_runs(pd)), len(pd.ec_loads())
    before = stats(proxy)

    tokens = chat_tokens(proxy.url, fleet["model"], parts)

    new_e = encoder_runs(e)[e_runs:]
    assert len(new_e) == len(set(new_e)) == len(parts), e.log_tail()
    assert set(new_e) <= set(e.ec_puts()), "E encoded an item and did not store it"
    assert encoder_runs(pd)[pd_runs:] == [], "PD encoded an item E had encoded"
    assert sorted(pd.ec_loads()[pd_loads:]) == sorted(new_e), pd.log_tail()
    assert pd.ec_puts() == {}, "a consumer stored something"
    after = stats(proxy)
    assert after["encoder_requests"] - before["encoder_requests"] == len(parts)
    assert after["encoder_errors"] == before["encoder_errors"] == 0
    assert tokens == chat_tokens(plain.url, fleet["model"], parts)


def test_repeat_after_e_cache_dropped_is_not_encoded_again(fleet) -> None:
    """An item E encoded before, after E's own vLLM cache dropped it: E does not encode it
    again (the fleet holds it), and PD still loads it."""
    e, pd, plain = (fleet["servers"][n] for n in ("e", "pd", "plain"))
    (mm_hash,) = render_hashes(fleet, IMAGE_A)
    chat_tokens(fleet["proxy"].url, fleet["model"], IMAGE_A)  # encoded by now either way
    assert mm_hash in e.ec_puts()
    e.reset_encoder_cache()
    pd.reset_encoder_cache()  # PD must load it again: the hand-off is exercised too
    e_runs, pd_runs, pd_loads = len(encoder_runs(e)), len(encoder_runs(pd)), len(pd.ec_loads())
    put_present = fleet["brokers"]["node-1"].stats()["put_present"]

    tokens = chat_tokens(fleet["proxy"].url, fleet["model"], IMAGE_A)

    new_e = encoder_runs(e)[e_runs:]
    assert new_e == [], (
        f"E encoded {new_e} again (node 1 put_present {put_present} -> "
        f"{fleet['brokers']['node-1'].stats()['put_present']})"
    )
    assert encoder_runs(pd)[pd_runs:] == [], "PD encoded it"
    assert pd.ec_loads()[pd_loads:] == [mm_hash], pd.log_tail()
    assert tokens == chat_tokens(plain.url, fleet["model"], IMAGE_A)


def test_lookup_first_skips_e_when_the_fleet_holds_every_item(fleet) -> None:
    """With ``--lookup``, a request whose items are all in the fleet tier never reaches E;
    PD loads them; a request with one new item sends only that item to E."""
    e, pd, plain = (fleet["servers"][n] for n in ("e", "pd", "plain"))
    lp = fleet["lookup_proxy"]
    held = sorted(set(e.ec_puts()))
    wait_until(lambda: resident(fleet, held), "the aggregator lists E's items", timeout=30)
    pd.reset_encoder_cache()  # PD loads from its broker, not from vLLM's own cache
    e_seen, e_runs, pd_loads = e_requests(e), len(encoder_runs(e)), len(pd.ec_loads())
    before = stats(lp)

    parts = [IMAGE_B[0], *VIDEO]  # encoded by the first test
    tokens = chat_tokens(lp.url, fleet["model"], parts)

    after = stats(lp)
    assert after["e_skipped"] == before["e_skipped"] + 1, after
    assert after["encoder_requests"] == before["encoder_requests"], after
    assert after["lookup_errors"] == 0, after
    assert e_requests(e) == e_seen, "the request reached E"
    assert len(encoder_runs(e)) == e_runs
    assert len(pd.ec_loads()) == pd_loads + 2, pd.log_tail()
    assert tokens == chat_tokens(plain.url, fleet["model"], parts)

    # One resident item, one new one: only the new one goes to E, PD loads both.
    mixed = [IMAGE_A[0], IMAGE_C[0]]
    pd.reset_encoder_cache()
    e_seen, pd_loads = e_requests(e), len(pd.ec_loads())
    tokens = chat_tokens(lp.url, fleet["model"], mixed)
    after2 = stats(lp)
    assert after2["encoder_requests"] == after["encoder_requests"] + 1, after2
    assert after2["items_skipped"] == after["items_skipped"] + 1, after2
    assert e_requests(e) == e_seen + 1
    assert len(pd.ec_loads()) == pd_loads + 2, pd.log_tail()
    assert tokens == chat_tokens(plain.url, fleet["model"], mixed)
