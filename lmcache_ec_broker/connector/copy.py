"""Tensor copies between torch tensors and the mapped slab (the only data copy).

CPU tensors: one memcpy per extent between the tensor's bytes and the mapping.
CUDA tensors: the mapping is registered once per process with
``cudaHostRegister`` (pinning.py) so copies run as DMA; they are issued
``non_blocking`` on a dedicated stream and synchronised before ``write`` or
``read_into`` returns, i.e. before the client posts its Commit or Release
(neither is waited for: the broker publishes a committed entry, or reuses a
released block, as soon as it reads the frame, so the DMA must be complete
when the frame is sent). If
registration is not possible (e.g. the memlock limit), copies use pageable
memory and the reason is logged once. Tensors on any other device are refused:
their data pointer is not host memory.

Invariant: every copy, on every path, first checks the extents against the
slab and against the tensor's byte count (``_check``); the extents come from
another process and are never trusted blindly.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from ..protocol import Extent, expected_nbytes
from . import pinning

log = logging.getLogger(__name__)

SUPPORTED_DEVICES = ("cpu", "cuda")


def check_device(device: torch.device) -> None:
    """Refuse a device whose data pointer is not host or CUDA memory (meta, XPU, MPS, ...)."""
    if device.type not in SUPPORTED_DEVICES:
        raise ValueError(
            f"tensors on device {device} are not supported: the encoder cache copies CPU and "
            "CUDA tensors only; move the tensor with .cpu() (or .to('cuda')) first"
        )


# Both directions of the dtype <-> wire-name mapping, filled as names are checked (the
# checks cost a microsecond per call otherwise). Only names that passed are cached.
_NAMES: dict[torch.dtype, str] = {}
_DTYPES: dict[str, torch.dtype] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        expected_nbytes(name, [1])  # raises ValueError naming the problem
        _NAMES[dtype] = name
    return name


def torch_dtype(name: str) -> torch.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"the broker returned unknown dtype {name!r}")
        _DTYPES[name] = dt
    return dt


# CPU copies are one plain memcpy per extent (GIL released): torch's copy_ splits
# copies over intra-op threads, which on a busy host costs more than it gains
# (measured: 64 KiB into the slab 14 us with one thread, 280 us with two).
_memmove = ctypes.memmove


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's storage (0-d tensors included)."""
    return t.reshape(-1).view(torch.uint8)


class SlabView:
    """The client's view of the slab mapping; owns the CUDA registration."""

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.size = size
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8, count=size)
        self._base = self.u8.data_ptr()  # the mapping's address (fixed while it lives)
        self._runtime: pinning.CudaRuntime | None = None  # set while registered
        self._registered_by = 0  # the pid that registered
        self._cuda_tried = False
        self._stream: torch.cuda.Stream | None = None
        self.pinned = False  # True once registered: copies are DMA

    # ------------------------------------------------------------------ CUDA

    def _ensure_cuda(self, device: torch.device) -> torch.cuda.Stream:
        if not self._cuda_tried:
            self._cuda_tried = True
            with torch.cuda.device(device):
                self._register()
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _register(self) -> None:
        hint = (
            "copies use pageable memory, which is slower. Raise the memlock limit "
            "(ulimit -l unlimited, docker run --ulimit memlock=-1, LimitMEMLOCK=infinity) "
            "to enable DMA"
        )
        reason = pinning.registration_refusal(self.size)
        if reason is not None:
            log.warning("not registering the slab with cudaHostRegister: %s; %s", reason, hint)
            return
        runtime = pinning.load_runtime()
        if runtime is None:
            log.warning(
                "not registering the slab with cudaHostRegister: no CUDA runtime library "
                "(libcudart) could be loaded; copies use pageable memory, which is slower"
            )
            return
        code = runtime.register(self.u8.data_ptr(), self.size, pinning.HOST_REGISTER_FLAGS)
        if code == 0:
            self._runtime = runtime
            self._registered_by = os.getpid()
            self.pinned = True
            log.info("registered the %d-byte slab with cudaHostRegister", self.size)
        else:
            log.warning(
                "cudaHostRegister of the %d-byte slab failed (%s, cleared); %s",
                self.size,
                runtime.describe(code),
                hint,
            )

    # ------------------------------------------------------------------ copies

    def write(self, extents: list[Extent], tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s bytes into ``extents``; returns when the bytes are in the slab."""
        if not tensor.is_cpu:
            check_device(tensor.device)
        nbytes = tensor.nbytes  # numel * element size, whatever the strides
        self._check(extents, nbytes)
        if not nbytes:
            return
        if tensor.is_cuda:
            stream = self._ensure_cuda(tensor.device)
            src = _flat_bytes(tensor.contiguous())
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                off = 0
                for start, n in extents:
                    self.u8[start : start + n].copy_(src[off : off + n], non_blocking=True)
                    off += n
            stream.synchronize()
            return
        if len(extents) == 1 and not tensor.is_contiguous():
            # One strided pass straight into the slab instead of contiguous() + copy.
            start, n = extents[0]
            dst = self.u8[start : start + n].view(tensor.dtype).view(tensor.shape)
            dst.copy_(tensor)
            return
        # A contiguous CPU tensor's bytes start at data_ptr() (no uint8 view needed).
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        base, ptr, off = self._base, src.data_ptr(), 0
        for start, n in extents:
            _memmove(base + start, ptr + off, n)
            off += n

    def read(
        self, extents: list[Extent], dtype: torch.dtype, shape: list[int], device: torch.device
    ) -> torch.Tensor:
        """A new tensor holding the entry; returns when the copy is complete."""
        check_device(device)
        out = torch.empty(shape, dtype=dtype, device=device)
        self.read_into(extents, out)
        return out

    def read_into(self, extents: list[Extent], out: torch.Tensor) -> None:
        """Copy the entry into ``out`` (contiguous, matching size); returns when done."""
        if not out.is_cpu:
            check_device(out.device)
        if not out.is_contiguous():
            raise ValueError("the output tensor must be contiguous")
        nbytes = out.nbytes
        self._check(extents, nbytes)
        if not nbytes:
            return
        if out.is_cuda:
            dst = _flat_bytes(out)
            stream = self._ensure_cuda(out.device)
            stream.wait_stream(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(stream):
                off = 0
                for start, n in extents:
                    dst[off : off + n].copy_(self.u8[start : start + n], non_blocking=True)
                    off += n
            stream.synchronize()
            return
        # A contiguous CPU tensor's bytes start at data_ptr() (no uint8 view needed).
        base, ptr, off = self._base, out.data_ptr(), 0
        for start, n in extents:
            _memmove(ptr + off, base + start, n)
            off += n

    def _check(self, extents: list[Extent], nbytes: int) -> None:
        """Refuse extents that leave the slab or do not cover exactly the tensor's bytes."""
        total = 0
        for start, n in extents:
            if start < 0 or n < 0 or start + n > self.size:
                raise ValueError(f"extent ({start}, {n}) lies outside the {self.size}-byte slab")
            total += n
        if total != nbytes:
            raise ValueError(f"extents cover {total} bytes, the tensor has {nbytes}")

    def close(self) -> None:
        """Unregister (before the caller unmaps: CUDA must not keep pages of a dead mapping)."""
        runtime, self._runtime = self._runtime, None
        # A forked child inherits the mapping but not the parent's CUDA context: the
        # registration is the parent's to undo.
        self.pinned = False
        if runtime is not None and self._registered_by == os.getpid():
            code = runtime.unregister(self.u8.data_ptr())
            if code not in (0, pinning.CUDA_ERROR_CUDART_UNLOADING):
                log.warning(
                    "cudaHostUnregister of the slab failed (%s, cleared); its pages stay "
                    "locked until the process exits",
                    runtime.describe(code),
                )
        self._stream = None
        del self.u8
