"""The CUDA data path (cudaHostRegister'd slab, non-blocking copies on a side stream).

Skipped without a CUDA device; run on a lent GPU machine with
``.venv/bin/python -m pytest -q tests/test_cuda_copy.py``.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ec_broker import BrokerClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_device_put_device_get_bit_identical(broker, dtype: torch.dtype) -> None:
    with BrokerClient(broker.socket_path) as c:
        src = (torch.randn(577, 1280, device="cuda") * 100).to(dtype)
        assert c.put("gpu", src)
        got = c.get("gpu", device="cuda")
        assert got is not None and got.is_cuda and got.dtype == dtype
        assert torch.equal(got, src)
        cpu = c.get("gpu")  # a CPU reader sees the same bytes
        assert cpu is not None and torch.equal(cpu, src.cpu())
        assert c.mappings.slab is not None and c.mappings.slab.pinned, "cudaHostRegister did not take"
        c.delete("gpu")


def test_non_contiguous_device_tensor_and_side_stream_ordering(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        base = torch.randn(1024, 2048, device="cuda")
        src = base.t()  # non-contiguous
        # Work queued on the current stream must be visible to the side-stream copy.
        src.mul_(3.0)
        assert c.put("nc", src)
        got = c.get("nc", device="cuda")
        assert got is not None and torch.equal(got, src)


def test_posted_commit_of_a_device_put_is_never_torn_for_another_reader(broker) -> None:
    # put posts its Commit without waiting (issue 18): the D2H copy must be complete
    # before the frame is sent, or another connection could load a half-copied entry.
    # Large entries (many DMA chunks), read by a second client right after each put.
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as reader:
        for i in range(8):
            src = torch.full((8192, 2048), float(i + 1), device="cuda", dtype=torch.bfloat16)
            assert c.put(f"posted{i}", src)
            c.ping()  # orders after the posted commit on the writer's connection
            got = reader.get(f"posted{i}")
            assert got is not None and torch.equal(got, src.cpu()), i
        assert c.put_many(
            [(f"pm{i}", torch.full((4096, 1024), -float(i), device="cuda")) for i in range(4)]
        ) == [True] * 4
        c.ping()
        for i in range(4):
            got = reader.get(f"pm{i}")
            assert got is not None and bool((got == -float(i)).all()), i


def test_a_device_put_into_the_arena_is_never_torn_for_another_reader(broker) -> None:
    # An entry under put_arena_bytes (8 MiB) is copied into the connection's put arena
    # and its Place posted with no wait at all: the D2H copy must be complete before
    # the frame leaves (SlabView.write synchronises), or a reader that asks right after
    # put returned could load a half-copied entry. The same code path as a CPU put.
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as reader:
        assert c.put("first", torch.ones(8, device="cuda"))  # reserves, asks for the arena
        for i in range(24):
            src = torch.full((1024, 1024), float(i + 1), device="cuda", dtype=torch.bfloat16)
            assert c.put(f"arena{i}", src)  # 2 MiB: placed
            got = reader.get(f"arena{i}")
            assert got is not None and torch.equal(got, src.cpu()), i
        assert c.put_many(
            [(f"apm{i}", torch.full((512, 512), -float(i), device="cuda")) for i in range(3)]
        ) == [True] * 3
        for i in range(3):
            got = reader.get(f"apm{i}")
            assert got is not None and bool((got == -float(i)).all()), i
        assert reader.stats()["arena_places"] >= 24


def test_cpu_written_entry_loads_onto_the_device(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        src = torch.randn(300, 64, dtype=torch.bfloat16)
        assert c.put("cpu", src)
        got = c.get("cpu", device="cuda:0")
        assert got is not None and got.device.type == "cuda" and torch.equal(got.cpu(), src)


def test_index_copies_onto_the_device_and_a_discarded_one_leaves_nothing(broker) -> None:
    # The residency index's zero-wait path onto a CUDA tensor: the H2D copy is
    # synchronised before the slot's seqlock word is re-read; a slot rewritten during
    # the copy falls back to the pinned get, and a final miss leaves ``out`` zeroed.
    src = torch.randn(257, 1024).to(torch.bfloat16)
    with BrokerClient(broker.socket_path) as c, BrokerClient(broker.socket_path) as other:
        assert other.put("idx", src) and other.flush()
        out = torch.empty(src.shape, dtype=src.dtype, device="cuda")
        assert c.get_into("idx", out) and torch.equal(out.cpu(), src)
        got = c.get_many(["idx"], device="cuda")[0]
        assert got is not None and got.is_cuda and torch.equal(got.cpu(), src)
        assert c.index_hits == 2 and c.index_retries == 0
        slab = c.slab()
        real = slab.read_into
        deleted: list[bool] = []

        def racing(*a, **kw):
            if not deleted:
                deleted.append(other.delete("idx"))
            return real(*a, **kw)

        slab.read_into = racing
        out.fill_(1.0)
        assert c.get_into("idx", out) is False
        assert deleted == [True] and c.index_retries == 1
        assert not out.any().item()


# ------------------------------------------------------------ registration


def _kernels_still_run() -> None:
    """An elementwise kernel checks the thread's last CUDA error after its launch: a
    registration failure left uncleared would surface here as this kernel's error."""
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum().item()) == 2.0 * 1023 * 1024 / 2
    torch.cuda.synchronize()


def test_a_failed_registration_is_cleared_and_kernels_still_run(broker) -> None:
    from lmcache_ec_broker.connector.client import pinning

    with BrokerClient(broker.socket_path) as c:
        assert c.put("cpu", torch.ones(100))  # maps the slab (no CUDA yet)
        slab = c.mappings.slab
        assert slab is not None and not slab.pinned
        torch.zeros(1, device="cuda")  # CUDA initialised: its runtime is now loaded
        runtime = pinning.load_runtime()
        assert runtime is not None
        # Someone else registered the range first: the client's cudaHostRegister fails
        # for real (cudaErrorHostMemoryAlreadyRegistered).
        ptr, size = slab.u8.data_ptr(), slab.size
        assert runtime.register(ptr, size, pinning.HOST_REGISTER_FLAGS) == 0
        try:
            src = (torch.randn(577, 1280, device="cuda") * 10).to(torch.bfloat16)
            assert c.put("gpu", src)
            assert not slab.pinned  # its own registration failed
            _kernels_still_run()
            got = c.get("gpu", device="cuda")
            assert got is not None and torch.equal(got, src)
            _kernels_still_run()
        finally:
            assert runtime.unregister(ptr) == 0  # still ours: the client did not undo it
    _kernels_still_run()


LOW_MEMLOCK_CHILD = """
import json, logging, sys
import torch
from lmcache_ec_broker import BrokerClient

records = []
handler = logging.Handler()
handler.emit = lambda rec: records.append(rec.getMessage())
logging.getLogger("lmcache_ec_broker").addHandler(handler)
logging.getLogger("lmcache_ec_broker").setLevel(logging.INFO)
out = {}
with BrokerClient(sys.argv[1]) as c:
    src = (torch.randn(577, 1280, device="cuda") * 10).to(torch.bfloat16)
    out["put"] = c.put("gpu", src)
    got = c.get("gpu", device="cuda")
    out["equal"] = got is not None and bool(torch.equal(got, src))
    out["pinned"] = c.mappings.slab.pinned
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    out["kernel"] = float((x * 2).sum().item())
    torch.cuda.synchronize()
out["log"] = [r for r in records if "cudaHostRegister" in r]
print(json.dumps(out))
"""


def test_low_memlock_still_pins_copies_exact_and_kernels_run(broker, tmp_path) -> None:
    # A default container: memlock 64 KiB, no CAP_IPC_LOCK. NVIDIA's driver pins with
    # pin_user_pages and charges no memlock limit, so the registration takes.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_IPC_LOCK")
    script = tmp_path / "child.py"
    script.write_text(LOW_MEMLOCK_CHILD)
    here = Path(__file__).resolve().parent
    r = subprocess.run(
        [
            sys.executable,
            str(here / "memlock_child.py"),
            str(64 << 10),
            str(script),
            broker.socket_path,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["put"] and out["equal"]
    assert out["pinned"] is True, out["log"]
    assert out["kernel"] == 2.0 * 1023 * 1024 / 2
    assert len(out["log"]) == 1 and "registered the" in out["log"][0], out["log"]


def test_extents_are_checked_on_the_cuda_paths() -> None:
    import mmap

    from lmcache_ec_broker.connector.client.copy import SlabView

    mm = mmap.mmap(-1, 1 << 20)
    slab = SlabView(mm, 1 << 20)
    try:
        src = torch.ones(2048, device="cuda")  # 8 KiB
        with pytest.raises(ValueError, match="lies outside"):
            slab.write([(-16384, 8192)], src)
        with pytest.raises(ValueError, match="lies outside"):
            slab.write([((1 << 20) - 4096, 8192)], src)
        with pytest.raises(ValueError, match="extents cover 4096 bytes"):
            slab.write([(0, 4096)], src)
        with pytest.raises(ValueError, match="lies outside"):
            slab.read_into([((1 << 20) - 4096, 8192)], torch.empty(2048, device="cuda"))
        assert not slab.u8.any()
        slab.write([(8192, 4096), (0, 4096)], src)
        out = torch.zeros(2048, device="cuda")
        slab.read_into([(8192, 4096), (0, 4096)], out)
        assert torch.equal(out, src)
        _kernels_still_run()
    finally:
        slab.close()
        mm.close()


def test_two_clients_of_one_process_each_pin_and_prepare_registers_before_a_copy(broker) -> None:
    """A vLLM worker has two clients (the step's, the staging thread's: two mappings
    of the slab in one process); the staging one registers at start (prepare_device),
    before its first copy. Both must pin, and a put through one is read exactly
    through the other onto the device."""
    dev = torch.device("cuda", torch.cuda.current_device())
    with BrokerClient(broker.socket_path) as step, BrokerClient(broker.socket_path) as staging:
        slab = staging.slab()
        assert not slab.pinned
        slab.prepare_device(dev)
        assert slab.pinned, "prepare_device did not register the slab"
        src = torch.randn(333, 1280, device=dev).to(torch.bfloat16)
        assert step.put("two-clients", src)
        assert step.mappings.slab is not None and step.mappings.slab.pinned
        got = staging.get("two-clients", device=dev)
        assert got is not None and torch.equal(got, src)
    _kernels_still_run()


def test_close_unregisters_so_the_next_client_registers_again(broker) -> None:
    src = torch.randn(256, 1024, device="cuda")
    for _ in range(3):
        with BrokerClient(broker.socket_path) as c:
            assert c.put("again", src) or c.get("again", device="cuda") is not None
            assert c.mappings.slab is not None and c.mappings.slab.pinned
        _kernels_still_run()


# ------------------------------------------------------------ streams and failures

# torch.cuda._sleep cycles: tens of milliseconds of a busy stream, far longer than a
# copy of these sizes, so a copy not ordered after the work queued before it is seen.
_SPIN = 100_000_000


def test_copies_are_ordered_after_pending_work_on_a_non_default_stream(broker) -> None:
    # vLLM runs on a stream of its own (vllm.utils.current_stream), not the default one:
    # a put must copy what the caller's stream computes, even when that is still
    # queued (read after write), and get_into must write ``out`` only after what the
    # caller's stream still does to it (write after write).
    user = torch.cuda.Stream()
    with BrokerClient(broker.socket_path) as c, torch.cuda.stream(user):
        src = torch.zeros(1024, 1024, device="cuda")  # 4 MiB: the put arena
        torch.cuda._sleep(_SPIN)
        src.fill_(7.0)
        assert c.put("ordered", src)
        big = torch.zeros(2048, 2048, device="cuda")  # 16 MiB: reserved
        torch.cuda._sleep(_SPIN)
        big.fill_(3.0)
        assert c.put("ordered-big", big)
        out = torch.empty_like(src)
        torch.cuda._sleep(_SPIN)
        out.fill_(-1.0)
        assert c.get_into("ordered", out)
        assert bool((out == 7.0).all())
        got = c.get("ordered-big", device="cuda")
        assert got is not None and bool((got == 3.0).all())
        user.synchronize()


def test_the_broker_round_trip_onto_the_device(broker, monkeypatch) -> None:
    # The pinned Get (reads.get_asked, get_into_asked) with CUDA tensors: the other tests
    # are served by the residency index or the connection's own placement.
    src = (torch.randn(300, 1024) * 50).to(torch.bfloat16)
    with BrokerClient(broker.socket_path) as w, BrokerClient(broker.socket_path) as c:
        assert w.put("rt", src.cuda()) and w.flush()
        monkeypatch.setattr(c, "_usable_index", lambda s: None)
        got = c.get("rt", device="cuda")
        assert got is not None and got.is_cuda and torch.equal(got.cpu(), src)
        out = torch.zeros(src.shape, dtype=src.dtype, device="cuda")
        assert c.get_into("rt", out) and torch.equal(out.cpu(), src)
        assert c.get_many(["rt", "absent"], device="cuda")[1] is None
        with pytest.raises(ValueError, match="the output tensor is"):
            c.get_into("rt", torch.empty(3, device="cuda"))
        assert c.index_hits == 0
        _kernels_still_run()


def test_a_staged_tensor_taken_onto_another_stream_is_not_reused_under_its_reader(broker) -> None:
    # The staging link's thread gets on the default stream; vLLM reads the tensor on its
    # own stream and, with async scheduling, may free it before that read ran.
    # StageLink.take records it on the taker's stream, so the link's next get cannot be
    # handed the same block while the read is queued.
    import threading

    from lmcache_ec_broker.connector.vllm.stage_link import StageLink

    with BrokerClient(broker.socket_path) as c:
        assert c.put("a", torch.full((1024, 1024), 1.0))
        assert c.put("b", torch.full((1024, 1024), 2.0))
        link = StageLink.__new__(StageLink)  # its hand-over only: no hub, no thread
        link._lock = threading.Lock()
        staged = c.get("a", device="cuda")  # on the default stream, as the link's thread
        assert staged is not None
        link._staged = {"a": [staged, 1]}
        del staged
        vllm = torch.cuda.Stream()
        with torch.cuda.stream(vllm):
            t = link.take("a")
            assert t is not None
            torch.cuda._sleep(_SPIN)
            seen = t * 1.0
            del t  # freed on the host while the read is still queued
        again = c.get("b", device="cuda")  # the link's next get
        vllm.synchronize()
        assert again is not None and bool((again == 2.0).all())
        assert bool((seen == 1.0).all()), "the next get overwrote a tensor a queued kernel read"


class _FailSecondSlice:
    """Stands in for SlabView.u8: the second slice raises, as a copy failing part-way."""

    def __init__(self, real: torch.Tensor) -> None:
        self.real, self.n = real, 0

    def __getitem__(self, k):
        self.n += 1
        if self.n == 2:
            raise RuntimeError("injected: the second copy failed")
        return self.real[k]


def test_a_copy_failing_part_way_leaves_no_dma_in_flight() -> None:
    # The caller aborts (put), unplaces (arena) or releases (get) as soon as the copy
    # raises, and the broker reuses those blocks at once: copies issued before the
    # failure must be complete by then, not queued behind the caller's stream.
    import mmap

    from lmcache_ec_broker.connector.client.copy import SlabView

    mm = mmap.mmap(-1, 16 << 20)
    slab = SlabView(mm, 16 << 20)
    real = slab.u8
    extents = [(0, 4 << 20), (8 << 20, 4 << 20)]
    try:
        src = torch.full((2 << 20,), 5.0, device="cuda")  # 8 MiB
        slab.write(extents, torch.zeros_like(src))  # registers, makes the copy stream
        # pinned: a D2H copy into pageable memory returns only when done (no window)
        assert slab.pinned, "cudaHostRegister did not take"
        slab.u8 = _FailSecondSlice(real)
        torch.cuda._sleep(_SPIN)  # the first copy waits behind this
        with pytest.raises(RuntimeError, match="injected"):
            slab.write(extents, src)
        assert slab._stream is not None and slab._stream.query(), "write raised, DMA in flight"
        assert bool((real[: 4 << 20].view(torch.float32) == 5.0).all())
        slab.u8 = _FailSecondSlice(real)
        out = torch.zeros_like(src)
        torch.cuda._sleep(_SPIN)
        with pytest.raises(RuntimeError, match="injected"):
            slab.read_into(extents, out)
        assert slab._stream.query(), "read_into raised with its first copy in flight"
        _kernels_still_run()
    finally:
        slab.u8 = real
        slab.close()
        mm.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_second_device_from_a_thread_whose_current_device_is_the_first(broker) -> None:
    # A TP rank's device is cuda:1 while a new thread's (the staging link's) current
    # device is cuda:0: copies, the stream and the registration follow the tensor.
    import threading

    src = (torch.randn(512, 1024, device="cuda:1") * 10).to(torch.bfloat16)
    with BrokerClient(broker.socket_path) as c:
        assert c.put("d1", src)
        got: list[torch.Tensor | None] = []
        th = threading.Thread(target=lambda: got.append(c.get("d1", device="cuda:1")))
        th.start()
        th.join()
        assert got[0] is not None and got[0].device == torch.device("cuda", 1)
        assert torch.equal(got[0], src)
        out = torch.empty_like(src)
        assert c.get_into("d1", out) and torch.equal(out, src)
        on0 = c.get("d1", device="cuda:0")
        assert on0 is not None and torch.equal(on0.cpu(), src.cpu())
