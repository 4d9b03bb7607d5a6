"""TP ranks agree on a step's failed loads (connector/tp_agree.py, tp_shm.py): real
processes, a real gloo group, a real broker.

Each test starts two rank processes running this file (``python
tests/test_tp_agreement.py MODE RANK ...``): ``agree`` drives the agreement
alone (``setup_agreement`` on a plain gloo group); ``worker`` builds vLLM's TP group
(``init_distributed_environment`` + ``initialize_model_parallel`` over gloo) and the
connector's worker part (``ECBrokerWorker``) on a real broker, and runs a step with
loads the way the runner does (``start_load_caches`` with the runner's
``SchedulerOutput`` in the calling frame). Each rank writes what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
WAIT_S = 0.5  # the agreement's bounded wait in the tests of that bound
# The wait where a test needs the ranks to meet (both arrive, however slowly a loaded
# CI host runs them): a rank starved for more than WAIT_S would make the step
# "encode all", which those tests do not expect.
MEET_S = 60.0
STRESS_STEPS = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(mode: str, tmp: Path, *extra: str, own_shm: int = -1) -> list[dict[str, Any]]:
    """Two rank processes; rank ``own_shm`` (if any) sees its own empty /dev/shm, as
    a rank on another host does (a mount namespace with a tmpfs over it)."""
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def argv(rank: int) -> list[str]:
        cmd = [sys.executable, str(HERE), mode, str(rank), port, str(tmp), *extra]
        if rank != own_shm:
            return cmd
        ns = 'mount -t tmpfs t /dev/shm && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", ns, "sh", *cmd]

    procs = [
        subprocess.Popen(
            argv(rank),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    # One deadline for both, inside the test timeout (600 s): a "worker" rank imports
    # vLLM, which took ~2 min beside a loaded CI run (2026-12-02).
    deadline = time.monotonic() + 500
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


# --------------------------------------------------------------------- the tests


def test_ranks_agree_on_the_union_through_shared_memory(tmp_path: Path) -> None:
    """Rank 0 failed item 0, rank 1 item 2 of 4: both get {0, 2}; a step with no
    failure gives none; more items than one slot has bits share the last bit."""
    r0, r1 = _spawn("agree", tmp_path, "union")
    assert r0["kind"] == r1["kind"] == "shared-memory"
    assert r0["steps"] == r1["steps"]
    assert r0["steps"][0] == ["h0", "h2"]
    assert r0["steps"][1] == []
    assert r0["steps"][2] == [f"h{i}" for i in range(383, 400)]  # one failed past the bits


def _can_unshare_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a mount namespace"
    if shutil.which("unshare") is None:
        return "needs unshare(1)"
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/dev/shm"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return None if r.returncode == 0 else f"cannot make a mount namespace here: {r.stderr}"


def test_ranks_on_two_hosts_agree_by_the_all_reduce(tmp_path: Path) -> None:
    """Rank 1 cannot open rank 0's segment (its /dev/shm is another host's): both
    ranks take the all-reduce, decided by the set-up's all-reduce, and agree."""
    why = _can_unshare_mount()
    if why:
        pytest.skip(why)
    r0, r1 = _spawn("agree", tmp_path, "union", own_shm=1)
    assert r0["kind"] == r1["kind"] == "collective"
    assert r0["steps"] == r1["steps"]
    assert r0["steps"][0] == ["h0", "h2"] and r0["steps"][1] == []


def test_ranks_never_disagree_when_some_steps_time_out(tmp_path: Path) -> None:
    """STRESS_STEPS steps, random failures, a 2 ms bound, each rank late by 4 ms at
    random: some steps end "encode all" (a rank gave up), the others in the union;
    the two ranks' decisions are the same, step by step."""
    r0, r1 = _spawn("agree", tmp_path, "stress")
    assert r0["kind"] == "shared-memory"
    assert r0["steps"] == r1["steps"]
    assert r0["aborts"] == r1["aborts"]
    assert 0 < r0["aborts"] < STRESS_STEPS, r0["aborts"]


def test_a_rank_that_never_arrives_gives_encode_all_within_the_bound(tmp_path: Path) -> None:
    """Rank 1 arrives after rank 0 gave up: rank 0 returns within the bound with
    "encode every load"; rank 1, arriving after, takes the same decision without
    waiting (it had no failure: alone it would have encoded nothing). The next step
    is agreed normally."""
    r0, r1 = _spawn("agree", tmp_path, "late")
    assert r0["kind"] == "shared-memory"
    # Rank 1 comes only after rank 0's step: a rank 0 that waited for it would never
    # return. Its bound passed, it returns (+10 s: a starved CI host, not a wait).
    assert WAIT_S <= r0["elapsed"][0] < WAIT_S + 10, r0["elapsed"]
    # Rank 1's own bound is MEET_S (60 s): had it waited instead of taking the
    # decision that was there, it would have waited that long.
    assert r1["elapsed"][0] < MEET_S / 6, r1["elapsed"]
    assert r0["steps"][0] == r1["steps"][0] == ["h0", "h1", "h2"]
    assert r0["steps"][1] == r1["steps"][1] == ["h1"]


@pytest.mark.timeout(600)
def test_one_ranks_load_fails_both_ranks_reencode(tmp_path: Path, broker) -> None:
    """vLLM's TP group of two real processes, one broker: rank 0 loads both items,
    then the second entry is gone before rank 1 reads it (evicted between the
    ranks' reads). Both ranks encode that item in the step (rank 0 drops its
    loaded copy), neither encodes the other."""
    r0, r1 = _spawn("worker", tmp_path, broker.socket_path, "evict")
    for r in (r0, r1):
        assert r["kind"] == "shared-memory"
        assert r["encode"] == {"req-b": [0]}, r
        assert r["cache"] == ["a" * 64]
    assert r0["load_failures"] == 0 and r1["load_failures"] == 1
    assert r0["reencoded"] == r1["reencoded"] == 1


@pytest.mark.timeout(600)
def test_a_rank_that_never_arrives_does_not_hang_the_worker(tmp_path: Path, broker) -> None:
    """Rank 1 stays alive but never runs the step (it waits until rank 0 is done):
    rank 0's step returns within the bound and encodes every load of the step.
    Before (the gloo all-reduce) rank 0 waited for the CPU group's timeout."""
    r0, r1 = _spawn("worker", tmp_path, broker.socket_path, "absent")
    # Rank 1 comes only after rank 0 is done: a rank 0 that waited for it (or for the
    # CPU group's timeout) would never return. +10 s: the step's loads on a starved CI
    # host, not a wait.
    assert r0["elapsed"] < WAIT_S + 10, r0
    assert r0["encode"] == {"req-a": [0], "req-b": [0]}
    assert r0["cache"] == []
    assert r1 == {"absent": True}


# --------------------------------------------------------------------- rank programs


def _gloo(rank: int, port: str) -> Any:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return dist.new_group([0, 1], backend="gloo")


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _agree_main(rank: int, port: str, tmp: Path, case: str) -> dict[str, Any]:
    from lmcache_ec_broker.connector.tp_agree import setup_agreement

    group = _gloo(rank, port)
    # Only rank 0 of "late" needs the short bound (rank 1 never comes to its step 1).
    agreement = setup_agreement(
        group, rank, 2, 0, wait_s=WAIT_S if (case, rank) == ("late", 0) else MEET_S
    )
    steps: list[list[str]] = []
    elapsed: list[float] = []

    def step(hashes: list[str], failed: set[str]) -> None:
        t0 = time.monotonic()
        steps.append(sorted(agreement.union(hashes, failed), key=lambda h: int(h[1:])))
        elapsed.append(time.monotonic() - t0)

    hashes = [f"h{i}" for i in range(4)]
    if case == "union":
        step(hashes, {"h0"} if rank == 0 else {"h2"})
        step(hashes, set())
        many = [f"h{i}" for i in range(400)]
        step(many, {"h390"} if rank == 1 else set())
    elif case == "late":
        three = hashes[:3]
        if rank == 1:
            _wait_for(tmp / "rank0.step1")  # rank 0 has given up on step 1
        step(three, {"h1"} if rank == 0 else set())
        if rank == 0:
            (tmp / "rank0.step1").write_text("")
            agreement.shared.wait_s = 60.0  # step 2: rank 1 arrives whenever it is scheduled
        step(three, {"h1"} if rank == 1 else set())
    elif case == "stress":
        import random

        rng = random.Random(rank)
        for i in range(STRESS_STEPS):
            # Every tenth step the ranks meet (a long bound): a rank starved for a while
            # on a loaded host cannot fall RING steps behind (the group would break, every
            # later step "encode all"), and some steps are always agreed as a union.
            agreement.shared.wait_s = MEET_S if i % 10 == 0 else 0.002
            time.sleep(rng.choice((0, 0, 0, 0.004)))  # now and then a rank is late
            step(hashes, {h for h in hashes if rng.random() < 0.2})
        return {
            "kind": agreement.kind,
            "steps": steps,
            "aborts": agreement.shared.aborts,
        }
    return {"kind": agreement.kind, "steps": steps, "elapsed": elapsed}


def _worker_main(rank: int, port: str, tmp: Path, socket_path: str, case: str) -> dict[str, Any]:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.v1.core.sched.output import SchedulerOutput

    from lmcache_ec_broker import BrokerClient
    from lmcache_ec_broker.connector import tp_agree, tp_shm
    from lmcache_ec_broker.connector.vllm_meta import (
        ECBrokerConnectorMetadata,
        LoadSpec,
        make_key,
    )
    from lmcache_ec_broker.connector.vllm_worker import ECBrokerWorker

    # "evict": the ranks must meet (rank 1 reads after rank 0's delete, however slowly a
    # loaded host runs it); "absent": rank 0's bound is the subject.
    tp_shm.WAIT_S = WAIT_S if case == "absent" else MEET_S
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
    model, dtype = "tiny-model", torch.bfloat16
    a, b = "a" * 64, "b" * 64
    client = BrokerClient(socket_path)
    if rank == 0:
        for h in (a, b):
            client.put(make_key(model, h, dtype), torch.full((4, 8), 1.0, dtype=dtype))
    get_tp_group().barrier()  # both entries are in
    # The set-up every rank runs at the group's first step with loads (a collective),
    # here before the step so that an absent rank can skip the step itself.
    agreement = tp_agree.agreement_for(get_tp_group())
    if case == "absent" and rank == 1:
        _wait_for(tmp / "rank0.json", timeout=180)
        return {"absent": True}

    class Worker(ECBrokerWorker):
        def fetch(self, keys: list[str], device: str) -> list[torch.Tensor | None]:
            if case == "evict" and rank == 1:
                _wait_for(tmp / "rank0.loaded")
            got = super().fetch(keys, device)
            if case == "evict" and rank == 0:
                client.delete(make_key(model, b, dtype))  # gone before rank 1 reads it
                (tmp / "rank0.loaded").write_text("")
            return got

    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens = {"req-a": 1, "req-b": 1}
    so.ec_connector_metadata = ECBrokerConnectorMetadata(
        loads=[LoadSpec("req-a", a, 4, 8, 0), LoadSpec("req-b", b, 4, 8, 0)], model=model
    )
    worker = Worker(
        is_producer=False,
        dtype=dtype,
        model=model,
        model_source=(model, None),
        bound_metadata=lambda: so.ec_connector_metadata,
        client=lambda: client,
        on_live_connection=lambda fn: fn(client),
        note_health=lambda c: None,
        mismatch=lambda dtype, shape, n, width: "",
        delete_invalid=lambda invalid: None,
        private=lambda h: False,
    )
    cache: dict[str, torch.Tensor] = {}

    def run_step(scheduler_output: SchedulerOutput) -> None:  # as the runner's EC wrapper
        worker.start_load_caches(cache)

    t0 = time.monotonic()
    run_step(so)
    elapsed = time.monotonic() - t0
    return {
        "kind": agreement.kind,
        "elapsed": elapsed,
        "encode": {k: list(v) for k, v in so.scheduled_encoder_inputs.items()},
        "cache": sorted(cache),
        "load_failures": worker.load_failures,
        "reencoded": worker.reencoded,
    }


if __name__ == "__main__":
    mode, rank_s, port, tmp_s, *rest = sys.argv[1:]
    rank, tmp = int(rank_s), Path(tmp_s)
    main = _agree_main if mode == "agree" else _worker_main
    result = main(rank, port, tmp, *rest)
    partial = tmp / f"rank{rank}.json.part"
    partial.write_text(json.dumps(result))
    partial.rename(tmp / f"rank{rank}.json")
    os._exit(0)  # no teardown collective: the other rank may be gone
