"""End to end with real ``vllm serve`` processes (vLLM on CPU) and a real broker.

All servers of the module (seven instances, one of them TP=2, and the session's
plain reference) start at once, in parallel, and are shared by the tests; each test
uses its own image so the tests do not see each other's entries. Expect ~2 minutes
on an idle 2-core machine, almost all of it server start-up.
Instance "b" names the connector in the short form (no ``ec_connector_module_path``):
it exists only through the package's ``vllm.general_plugins`` entry point.
Instances "faulty" (with its own broker, which a test kills) and "tp2" run
``faulty_ec_connector.ECBrokerConnectorWithFaults``: normal until a test arms a
fault for the next load (10.5 minutes for the module on the shared 2-core host
while other suites ran). Every instance but "hung" waits for the broker as long as a
loaded test host needs (``SLOW_HOST_BUDGETS``); "hung" keeps the production budgets
for the test of a hung broker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Unguarded on purpose: CI installs vLLM, so these tests must fail without it, never skip.
import vllm  # noqa: F401
from conftest import PATIENT

from lmcache_ec_broker import BrokerClient
from lmcache_ec_broker.connector.vllm import make_key
from lmcache_ec_broker.testing.broker_process import BrokerProcess
from lmcache_ec_broker.testing.tiny_qwen2vl import TinyQwen2VLSpec, build_tiny_qwen2vl
from lmcache_ec_broker.testing.vllm_server import (
    SLOW_HOST_BUDGETS,
    VllmServer,
    ec_transfer_config,
    last_model_field,
    png_data_url,
)

# The first test also pays for starting every server (minutes on a busy 2-core host).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
HERE = Path(__file__).resolve().parent

SPEC = TinyQwen2VLSpec()
ENTRY_BYTES = 16 * SPEC.hidden_size * 2  # a 112x112 image: 16 rows of bf16


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ece2e-", dir="/tmp"))  # short: AF_UNIX path limit
    yield d
    if not os.environ.get("LMCACHE_EC_KEEP_E2E_LOGS"):
        import shutil

        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or workdir / "models"
    return str(build_tiny_qwen2vl(root, SPEC))


class Broker:
    """A real broker process on a fixed socket that a test can stop and restart."""

    def __init__(self, workdir: Path, name: str = "broker") -> None:
        self.socket_path = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        self.process: BrokerProcess | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc if self.process is not None else None

    def start(self, *extra: str) -> None:
        args = ["--shm-size", "256MiB", *extra]
        self.process = BrokerProcess(self.socket_path, args, log_path=self.log_path)
        self.process.start(timeout=30)
        # Answering, not only accepting: what the engines' first lookups meet.
        ping = [sys.executable, "-m", "lmcache_ec_broker.cli", "ping", "--socket", self.socket_path]
        deadline = time.monotonic() + 30
        while subprocess.call(ping, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            assert self.process.proc is not None and self.process.proc.poll() is None, (
                self.process.read_log()
            )
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(30)

    def stats(self) -> dict:
        with BrokerClient(self.socket_path, **PATIENT) as c:
            stats = c.stats()
        assert stats, "broker did not answer stats"
        return stats

    def wait_unpinned(self) -> None:
        """Every lease and pin ends once its load is done (the releases are posted,
        so give the broker a moment to read them)."""
        deadline = time.monotonic() + 30
        while (stats := self.stats())["pins"]:
            assert time.monotonic() < deadline, f"pins held after the loads: {stats}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def broker(workdir: Path) -> Iterator[Broker]:
    b = Broker(workdir)
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def faulty_broker(workdir: Path) -> Iterator[Broker]:
    """The "faulty" instance's own broker: its tests kill it."""
    b = Broker(workdir, "faulty-broker")
    b.start()
    try:
        yield b
    finally:
        b.stop()


def pace(workdir: Path, server: str, seconds: float) -> Path:
    """Make every engine step of ``server`` sleep ``seconds`` first, until the returned
    file is removed (tests/e2e/faulty_ec_connector.py)."""
    path = workdir / f"{server}.fault.pace"
    path.write_text(str(seconds))
    return path


def arm(workdir: Path, server: str, fault: str) -> Path:
    """Arm a fault of tests/e2e/faulty_ec_connector.py for ``server``'s next load."""
    path = workdir / f"{server}.fault"
    path.write_text(fault)
    return path


@pytest.fixture(scope="module")
def servers(
    model: str, broker: Broker, faulty_broker: Broker, workdir: Path, plain_qwen2vl: VllmServer
) -> Iterator[dict[str, VllmServer]]:
    cores = os.cpu_count() or 1

    def server(
        name: str,
        role: str | None,
        tp: int = 1,
        socket_path: str = "",
        budgets: dict[str, int] = SLOW_HOST_BUDGETS,
        **connector: str,
    ) -> VllmServer:
        sock = socket_path or broker.socket_path
        cfg = ec_transfer_config(role, sock, **connector, **budgets) if role else None
        # vLLM binds every instance's OpenMP thread to core 0 by default: spread them.
        binds = [str((len(fleet) + rank) % cores) for rank in range(tp)]
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(binds),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "LMCACHE_EC_FAULT_FILE": str(workdir / f"{name}.fault"),
        }
        extra = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        return VllmServer(model, workdir / f"{name}.log", ec_config=cfg, env=env, extra_args=extra)

    fleet: dict[str, VllmServer] = {}

    for name, role in [
        ("a", "ec_both"),
        ("producer", "ec_producer"),
        ("consumer", "ec_consumer"),
    ]:
        fleet[name] = server(name, role)
    # The short form: the name resolves through the vllm.general_plugins entry point.
    short = {
        "ec_connector": "ECBrokerConnector",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"socket_path": broker.socket_path, **SLOW_HOST_BUDGETS},
    }
    fleet["b"] = VllmServer(
        model,
        workdir / "b.log",
        ec_config=json.dumps(short),
        env={"VLLM_CPU_OMP_THREADS_BIND": str(len(fleet) % cores)},
    )
    faults = {"connector": "ECBrokerConnectorWithFaults", "module": "faulty_ec_connector"}
    fleet["faulty"] = server("faulty", "ec_both", socket_path=faulty_broker.socket_path, **faults)
    fleet["tp2"] = server("tp2", "ec_both", tp=2, **faults)
    # The others wait for the broker as long as a loaded test host needs (a lookup past
    # the production budget is answered "miss" and the item encoded: right, but not the
    # load a test asserts); "hung" keeps the production budgets its test is about.
    fleet["hung"] = server("hung", "ec_both", budgets={})
    try:
        for s in fleet.values():
            s.start()
        for s in [*fleet.values(), plain_qwen2vl]:
            s.wait_ready(timeout=900)
        # "plain": the session's reference without a connector (conftest.py), not stopped here
        yield {**fleet, "plain": plain_qwen2vl}
    finally:
        for s in fleet.values():
            s.terminate()
        for s in fleet.values():
            s.wait_stopped()


def test_one_instance_reloads_from_broker_after_encoder_cache_reset(servers, broker):
    a = servers["a"]
    image = png_data_url(seed=1)
    before = broker.stats()
    cold = a.chat_token_ids(image)
    stored = a.ec_puts()
    assert list(stored.values()) == [ENTRY_BYTES], a.log_tail()
    after_put = broker.stats()
    assert after_put["entries"] == before["entries"] + 1

    a.reset_encoder_cache()
    warm = a.chat_token_ids(image)
    after_load = broker.stats()
    assert after_load["hits"] == after_put["hits"] + 1, "second request did not load from broker"
    assert a.ec_puts() == stored, "the encoder ran again instead of loading"
    assert a.ec_loads() == list(stored)
    assert warm == cold


def test_two_instances_share_one_broker(servers, broker):
    a, b, plain = servers["a"], servers["b"], servers["plain"]
    image = png_data_url(seed=2)
    stored_before = a.ec_puts()
    tokens_a = a.chat_token_ids(image)
    new = {h: n for h, n in a.ec_puts().items() if h not in stored_before}
    assert list(new.values()) == [ENTRY_BYTES]
    (mm_hash,) = new

    hits = broker.stats()["hits"]
    tokens_b = b.chat_token_ids(image)  # B's connector: the plugin-registered short name
    assert broker.stats()["hits"] == hits + 1, "B did not load A's entry"
    assert mm_hash not in b.ec_puts(), "B encoded the image itself"
    assert b.ec_loads() == [mm_hash]
    assert tokens_b == plain.chat_token_ids(image) == tokens_a
    broker.wait_unpinned()  # B's lease ended with its load


def test_disaggregated_producer_and_consumer(servers, broker):
    producer, consumer, plain = servers["producer"], servers["consumer"], servers["plain"]
    image = png_data_url(seed=3)
    producer.chat_token_ids(image, max_tokens=1)  # the encode step
    (mm_hash,) = [h for h in producer.ec_puts()]
    assert producer.ec_puts()[mm_hash] == ENTRY_BYTES

    hits = broker.stats()["hits"]
    tokens = consumer.chat_token_ids(image)
    assert broker.stats()["hits"] == hits + 1, "consumer did not load"
    assert consumer.ec_puts() == {}
    assert consumer.ec_loads() == [mm_hash]
    assert tokens == plain.chat_token_ids(image)


def test_tensor_parallel_ranks_share_one_entry(servers, broker):
    """TP=2: both ranks run the encoder and put the same key; exactly one copies.
    After a reset both ranks load that one entry."""
    tp2 = servers["tp2"]
    image = png_data_url(seed=7)
    before = broker.stats()
    cold = tp2.chat_token_ids(image)
    after_put = broker.stats()
    assert after_put["entries"] == before["entries"] + 1
    assert after_put["puts"] == before["puts"] + 1
    skipped = ("put_present", "put_in_progress")
    assert sum(after_put[k] - before[k] for k in skipped) == 1, "the other rank copied too"
    (mm_hash,) = tp2.ec_puts()

    tp2.reset_encoder_cache()
    warm = tp2.chat_token_ids(image)
    assert broker.stats()["hits"] == after_put["hits"] + 2  # one load per rank
    assert tp2.ec_loads() == [mm_hash, mm_hash]
    assert warm == cold


def test_vanished_entry_is_encoded(servers, workdir):
    """The entry disappears between the scheduler's lookup and the worker's staging:
    the item is encoded; the answer is the cold answer (no error), and so is every
    retry (before issue 31: a 500, then every retry of the image failed)."""
    faulty, plain = servers["faulty"], servers["plain"]
    image = png_data_url(seed=5)
    cold = plain.chat_token_ids(image, max_tokens=1)
    assert faulty.chat_token_ids(image, max_tokens=1) == cold  # encodes and stores
    faulty.reset_encoder_cache()
    fault = arm(workdir, "faulty", "drop")
    assert faulty.chat_token_ids(image, max_tokens=1) == cold  # hit -> dropped -> encoded
    assert not fault.exists(), "the fault never fired: no staging happened"
    log = faulty.log_text()
    assert "EC staging failed for mm_hash=" in log
    assert faulty.chat_token_ids(image, max_tokens=1) == cold
    faulty.reset_encoder_cache()
    assert faulty.chat_token_ids(image, max_tokens=1) == cold  # loads the re-put entry
    other = png_data_url(seed=6)
    assert faulty.chat_token_ids(other) == plain.chat_token_ids(other)


def _generated_tokens(server: VllmServer) -> float:
    """vLLM's own count of generated tokens (its Prometheus endpoint), all requests."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    )


def test_bystander_decoding_with_the_item_completes(servers, workdir):
    """Request A decodes after using image X; meanwhile B's staging of X fails. A
    completes with its own answer (before: A was failed with B), B answers cold.

    A's steps are paced (faulty_ec_connector.py: every engine step first sleeps 0.25 s
    while the pace file exists), so A's 400 tokens keep it in the engine for 400
    steps -- over 100 s -- while B needs a few of the same steps; the pace ends once
    B has answered. Before: A ran unpaced and a loaded host sometimes let it finish
    first ("A finished before B's load failed, three times")."""
    faulty, plain = servers["faulty"], servers["plain"]
    image = png_data_url(seed=11)
    long_cold = plain.chat_token_ids(image, max_tokens=400)
    cold = plain.chat_token_ids(image)
    faulty.chat_token_ids(image, max_tokens=1)  # X is in the broker now
    result: dict[str, object] = {}

    def run_a() -> None:
        try:
            result["a"] = faulty.chat_token_ids(image, max_tokens=400)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["a"] = exc

    paced = pace(workdir, "faulty", 0.25)
    a = threading.Thread(target=run_a)
    try:
        before = _generated_tokens(faulty)
        a.start()
        deadline = time.monotonic() + 300
        while _generated_tokens(faulty) < before + 2:  # A's prefill is done; it decodes
            assert a.is_alive(), f"A ended before decoding: {result}"
            assert time.monotonic() < deadline, "A never started decoding"
            time.sleep(0.2)
        faulty.reset_encoder_cache()
        fault = arm(workdir, "faulty", "drop")
        assert faulty.chat_token_ids(image) == cold
        assert not fault.exists(), "B did not load X"
        assert a.is_alive(), "A finished before B's staging failed although its steps were paced"
    finally:
        paced.unlink(missing_ok=True)  # A runs at full speed from here
        a.join(300)
    assert result["a"] == long_cold


def test_broker_killed_between_hit_and_load(servers, faulty_broker, workdir):
    """SIGKILL of the broker as the worker stages the hit: the answer is the cold
    answer (or an error), the retries are cold answers, and the instance uses the
    restarted broker again."""
    faulty, plain = servers["faulty"], servers["plain"]
    image = png_data_url(seed=12)
    cold = plain.chat_token_ids(image)
    faulty.chat_token_ids(image, max_tokens=1)
    faulty.reset_encoder_cache()
    assert faulty_broker.proc is not None
    fault = arm(workdir, "faulty", f"kill {faulty_broker.proc.pid}")
    try:
        answer: object = faulty.chat_token_ids(image)
    except urllib.error.HTTPError as exc:
        answer = exc
    assert not fault.exists(), "the fault never fired"
    assert faulty_broker.proc.wait(10) == -signal.SIGKILL
    assert answer == cold or isinstance(answer, urllib.error.HTTPError), answer
    assert faulty.chat_token_ids(image) == cold  # vLLM's own cache
    faulty_broker.start()  # as its supervisor would
    deadline = time.monotonic() + 30
    while True:
        faulty.reset_encoder_cache()
        assert faulty.chat_token_ids(image) == cold
        if faulty_broker.stats()["entries"]:
            break  # published again into the restarted broker
        assert time.monotonic() < deadline, "never stored into the restarted broker"
        time.sleep(0.5)
    faulty.reset_encoder_cache()
    loads = len(faulty.ec_loads())
    assert faulty.chat_token_ids(image) == cold
    assert len(faulty.ec_loads()) == loads + 1, "the restarted broker's entry was not loaded"


def test_tp2_load_failing_on_one_rank(servers, broker, workdir):
    """TP=2, rank 1's staging gets nothing while rank 0's succeeds: the scheduler
    promises no load (a hit needs every rank staged), so both ranks encode the item
    (their encoders run together); the answer is the cold answer."""
    tp2, plain = servers["tp2"], servers["plain"]
    image = png_data_url(seed=13)
    cold = plain.chat_token_ids(image)
    assert tp2.chat_token_ids(image) == cold
    tp2.reset_encoder_cache()
    fault = arm(workdir, "tp2", "fail-rank 1")
    assert tp2.chat_token_ids(image) == cold
    assert not fault.exists(), "rank 1 never staged"
    log = tp2.log_text()
    assert "EC staging failed for mm_hash=" in log
    tp2.reset_encoder_cache()
    assert tp2.chat_token_ids(image) == cold


def test_wrong_entry_under_the_real_key_is_not_served_nor_deleted(servers, broker):
    """An entry of the wrong shape under the key vLLM uses: the instance encodes the
    image again (same tokens, no error) and leaves the entry alone -- it is another
    configuration's (issue 39: instances never delete each other's entries). The key
    is the instance's own, from its start-up log line."""
    a = servers["a"]
    image = png_data_url(seed=8)
    known = a.ec_puts()
    cold = a.chat_token_ids(image)
    (mm_hash,) = [h for h in a.ec_puts() if h not in known]
    field = last_model_field(a.log_text())  # the field after the digest at load
    assert field is not None, a.log_tail()
    key = make_key(field, mm_hash, "bfloat16")
    wrong = torch.zeros(17, SPEC.hidden_size, dtype=torch.bfloat16)
    with BrokerClient(broker.socket_path, **PATIENT) as c:
        assert c.delete(key), "the instance does not use the key the test computed"
        assert c.put(key, wrong)

    a.reset_encoder_cache()
    assert a.chat_token_ids(image) == cold
    log = a.log_text()
    assert f"EC broker entry for mm_hash={mm_hash} is invalid for this model" in log
    assert mm_hash not in a.ec_loads()
    with BrokerClient(broker.socket_path, **PATIENT) as c:
        got = c.get(key)
    assert got is not None and got.shape == (17, SPEC.hidden_size), "the entry was deleted"
    broker.wait_unpinned()


def test_entry_on_disk_only_defers_the_request_then_loads(servers, broker, workdir):
    """After a broker restart the entry is on the disk tier only: the consumer's
    scheduler defers the request until the entry is promoted into the slab, then
    loads it (its worker never waits on the disk), with the tokens of a plain run."""
    a, consumer, plain = servers["a"], servers["consumer"], servers["plain"]
    disk = ["--local-disk", str(workdir / "disk"), "--max-local-disk-size", "256MiB"]
    broker.stop()
    broker.start(*disk)
    image = png_data_url(seed=9)
    deadline = time.monotonic() + 60
    seed = 200
    known = set(a.ec_puts())
    while not set(a.ec_puts()) - known:  # A reconnects after its backoff (seconds)
        assert time.monotonic() < deadline, "A did not store into the restarted broker"
        a.chat_token_ids(png_data_url(seed=seed), max_tokens=1)
        seed += 1
        time.sleep(0.5)
    known = set(a.ec_puts())
    a.chat_token_ids(image, max_tokens=1)
    (mm_hash,) = [h for h in a.ec_puts() if h not in known]
    probes = [png_data_url(seed=s) for s in range(220, 226)]
    for probe in probes:
        a.chat_token_ids(probe, max_tokens=1)
    broker.stop()  # SIGTERM: the disk tier's write-behind is flushed
    broker.start(*disk)
    assert broker.stats()["entries"] == 0

    # Until the consumer's clients are back from the outage, with images it never
    # saw (not the target: resetting vLLM's encoder cache leaves the connector's
    # mirror of it stale for one lookup, see docs/design.md).
    for probe in probes:
        loads = len(consumer.ec_loads())
        consumer.chat_token_ids(probe, max_tokens=1)
        if len(consumer.ec_loads()) > loads:
            break
    else:
        pytest.fail("the consumer never loaded from the restarted broker")
    tokens = consumer.chat_token_ids(image)
    assert mm_hash in consumer.ec_loads()
    assert tokens == plain.chat_token_ids(image)
    log = consumer.log_text()
    assert re.search(rf"EC defer: request \S+ waits for mm_hash={mm_hash}", log), "not deferred"
    assert "EC load failed" not in log
    assert broker.stats()["promotions"] >= 1
    broker.wait_unpinned()


def _timed_answers(server: VllmServer, seeds: range) -> tuple[list[list[int]], list[float]]:
    answers, times = [], []
    for seed in seeds:
        t0 = time.perf_counter()
        answers.append(server.chat_token_ids(png_data_url(seed=seed), max_tokens=1))
        times.append(time.perf_counter() - t0)
    return answers, times


def test_hung_broker_costs_the_engine_nearly_nothing(servers, broker):
    """The broker SIGSTOPped (alive, silent) while new images flow: the instance's
    time to first token stays close to a server without the connector (one budget
    wait per outage, then none; benchmarks/hung_broker.py measures it). Before:
    10 s for the first request, then 5 s per broker call. The two servers' requests
    alternate, so both see the same load from whatever else runs on the host; each
    has answered one request first (a server's first request also pays vLLM's own
    first-use costs, seconds on a loaded host)."""
    hung, plain = servers["hung"], servers["plain"]
    for server in (hung, plain):
        server.chat_token_ids(png_data_url(seed=299), max_tokens=1)
    got, want, with_connector, without = [], [], [], []
    assert broker.proc is not None
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        for seed in range(300, 308):
            for server, answers, times in ((hung, got, with_connector), (plain, want, without)):
                (answer,), (took,) = _timed_answers(server, range(seed, seed + 1))
                answers.append(answer)
                times.append(took)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    assert got == want
    extra = sum(with_connector) - sum(without)
    # "hung" has the production budgets, 50 ms + 200 ms, paid once per outage; the
    # defect cost 10 s for the first request and 5 s for each later one (45 s in all
    # here). The bounds sit far from both, so a loaded host (CI runs this beside the
    # rest of the suite) cannot flip them: a total under 8 s, and the median of the
    # later requests (one slow outlier is the host, not the broker) under 2 s above
    # the plain server's.
    assert extra < 8.0, f"{with_connector=} {without=}"
    later = statistics.median(with_connector[1:]) - statistics.median(without[1:])
    assert later < 2.0, f"{with_connector=} {without=}"
    assert "did not answer within" in hung.log_text()


def test_broker_outage_keeps_vllm_serving(servers, broker):
    """Runs last: stops the module's broker. vLLM serves through the outage (the
    encoder runs locally) and uses the broker again once it is back."""
    a, plain = servers["a"], servers["plain"]
    broker.stop()
    image = png_data_url(seed=4)
    assert a.chat_token_ids(image) == plain.chat_token_ids(image)
    assert "EC broker not reachable" in a.log_text()

    broker.start()
    known = set(a.ec_puts())
    deadline = time.monotonic() + 30
    seed = 100
    while not set(a.ec_puts()) - known:  # reconnects after its backoff (seconds)
        assert time.monotonic() < deadline, "vLLM did not store into the restarted broker"
        a.chat_token_ids(png_data_url(seed=seed), max_tokens=1)
        seed += 1
        time.sleep(0.5)
    assert broker.stats()["entries"] >= 1
