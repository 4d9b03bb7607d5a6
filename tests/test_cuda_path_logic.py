"""The parts of the CUDA data path that need no device: what is decided before a copy
(copy.py) and the staging link's hand-over of a staged tensor (stage_link.py). The copies
themselves are in tests/test_cuda_copy.py (skipped without a device)."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch

from lmcache_ec_broker.connector.client.copy import SlabView
from lmcache_ec_broker.connector.vllm.stage_link import StageLink


def test_read_checks_the_extents_before_allocating_the_shape() -> None:
    # A shape the extents do not cover is refused before torch.empty: on a device an
    # allocation of its size would fail only after emptying the allocator's cache.
    mm = mmap.mmap(-1, 1 << 20)
    view = SlabView(mm, 1 << 20)
    try:
        with pytest.raises(ValueError, match="extents cover 16 bytes"):
            view.read([(0, 16)], torch.uint8, [1 << 50], torch.device("cpu"))  # 1 PiB
        with pytest.raises(ValueError, match="lies outside"):
            view.read([((1 << 20) - 8, 16)], torch.float32, [4], torch.device("cpu"))
        view.u8[64:80] = torch.arange(16, dtype=torch.uint8)
        got = view.read([(72, 8), (64, 8)], torch.uint8, [2, 8], torch.device("cpu"))
        assert got.tolist() == [list(range(8, 16)), list(range(8))]
        assert view.read([(0, 0)], torch.bfloat16, [0, 3], torch.device("cpu")).shape == (0, 3)
    finally:
        view.close()
        mm.close()


class _FakeCudaTensor:
    is_cuda = True
    device = torch.device("cuda", 1)

    def __init__(self) -> None:
        self.recorded: list[object] = []

    def record_stream(self, stream: object) -> None:
        self.recorded.append(stream)


def _link_without_thread() -> StageLink:
    link = StageLink.__new__(StageLink)
    link._lock = threading.Lock()
    link._staged = {}
    return link


def test_take_records_a_staged_cuda_tensor_on_the_callers_stream(monkeypatch) -> None:
    # The link's thread allocated the tensor on its own current stream; vLLM reads it on
    # its stream: the caching allocator must not reuse the block before that stream's
    # work queued at the free is done (record_stream), or the link's next get overwrites
    # embeddings a queued kernel still reads.
    streams: list[object] = []

    def current_stream(device: object) -> object:
        streams.append(device)
        return ("vllm-stream", device)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    link = _link_without_thread()
    t = _FakeCudaTensor()
    link._staged["h"] = [t, 2]  # two orders: taken twice, recorded each time
    assert link.take("h") is t
    assert t.recorded == [("vllm-stream", torch.device("cuda", 1))]
    assert link.take("h") is t and len(t.recorded) == 2 and "h" not in link._staged
    assert link.take("h") is None and len(t.recorded) == 2


def test_take_of_a_cpu_tensor_touches_no_cuda(monkeypatch) -> None:
    def no_cuda(device: object) -> object:
        raise AssertionError("a CPU tensor needs no stream")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    link = _link_without_thread()
    t = torch.ones(3)
    link._staged["h"] = [t, 1]
    assert link.take("h") is t and link.take("h") is None


def test_prepare_device_registers_for_a_cuda_device_only(monkeypatch) -> None:
    # The staging thread prepares its client's slab before it links (worker.py,
    # _prepare_reads): registered with CUDA for a CUDA device, untouched for the CPU.
    mm = mmap.mmap(-1, 1 << 20)
    view = SlabView(mm, 1 << 20)
    asked: list[torch.device] = []
    monkeypatch.setattr(view, "_ensure_cuda", asked.append)
    try:
        view.prepare_device(torch.device("cpu"))
        assert asked == []
        view.prepare_device(torch.device("cuda", 1))
        assert asked == [torch.device("cuda", 1)]
    finally:
        view.close()
        mm.close()
