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
        assert c._slab is not None and c._slab.pinned, "cudaHostRegister did not take"
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


def test_cpu_written_entry_loads_onto_the_device(broker) -> None:
    with BrokerClient(broker.socket_path) as c:
        src = torch.randn(300, 64, dtype=torch.bfloat16)
        assert c.put("cpu", src)
        got = c.get("cpu", device="cuda:0")
        assert got is not None and got.device.type == "cuda" and torch.equal(got.cpu(), src)
