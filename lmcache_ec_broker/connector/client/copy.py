"""Tensor copies between torch tensors and the mapped slab (the only data copy).

CPU tensors: one memcpy per extent between the tensor's bytes and the mapping (into
the slab, puts of ``STREAM_MIN`` bytes or more with non-temporal stores).
CUDA tensors: the mapping is registered once per process with
``cudaHostRegister`` (pinning.py) so copies run as DMA; they are issued
``non_blocking`` on a dedicated stream and synchronised before ``write`` or
``read_into`` returns or raises, i.e. before the client posts its Commit or Release
(neither is waited for: the broker publishes a committed entry, or reuses a
released block, as soon as it reads the frame, so the DMA must be complete
when the frame is sent). If registration fails, copies use pageable memory and
one line says why (CUDA's error; the memlock limit too where it could not hold the
slab). Tensors on any other device are refused:
their data pointer is not host memory.

Invariant: every copy, on every path, first checks the extents against the
slab and against the tensor's byte count (``_check``); the extents come from
another process and are never trusted blindly.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
from collections.abc import Callable

import torch

from ...protocol import Extent, expected_nbytes
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
# (measured: 64 KiB into the slab 14 us with one thread, 280 us with two; 2 and 8 MiB
# into the slab 0.25 and 1.0 ms with memmove, 6.6-14 ms with copy_ once its second
# thread slept or a CPU-bound process ran beside it: issue 42).
_memmove = ctypes.memmove

# A put of STREAM_MIN bytes or more is copied into the slab with
# non-temporal stores (shm/_stream_copy.c says why, and what keeps it right): the put
# faster (8 MiB 1.2-1.4x, 34 MiB 1.4-1.5x) and the writer's caches kept. A reader that
# copies the entry out at once then reads it from memory, not the shared cache: from
# 4 MiB the pair is still faster (4 MiB 6-30%, 8-34 MiB 6-24%); at 1-2 MiB the reader
# loses what the put gains (the pair no faster, up to 18% slower in a round;
# benchmarks/shm_floor_probe.py, docs/performance.md). Without the compiled module (no C
# compiler at install), or off x86-64, memmove.
STREAM_MIN = 4 << 20
try:
    from ...shm._stream_copy import stream_copy as _stream_copy
except ImportError:  # pragma: no cover - built with a C compiler in every supported set-up
    _stream_copy = None

# The one exception: a get into a NEW CPU tensor of NEW_TENSOR_MIN bytes or more. Such a
# tensor is fresh pages from the allocator (glibc maps anything over 32 MiB anew), and
# their first-touch faults cost more than the copy on this VM (34 MiB: 16 ms with
# memmove on one core, 8 ms for torch's clone() on two). So the tensor's pages are
# advised MADV_HUGEPAGE before anything touches them (529 faults instead of 8,705 at
# 34 MiB) and the copy is torch's copy_ -- the same copy clone() runs, over the same
# intra-op threads, so the get is never slower than a clone() of the entry and is
# faster by the faults it saves (benchmarks/attribution.py --only across). Only the
# new tensor's own whole pages are advised: never the slab, never a caller's tensor.
# Where THP is off ("never") the advice is a no-op.
NEW_TENSOR_MIN = 32 << 20
_MADV_HUGEPAGE = 14
_PAGE = mmap.PAGESIZE


def _load_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise() if sys.platform.startswith("linux") else None


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for transparent huge pages for a new CPU tensor's whole pages, before its
    first touch; False where the kernel refused or cannot be asked (the copy then
    pays 4 KiB faults, as before)."""
    if _madvise is None:
        return False
    ptr = t.data_ptr()
    start = -(-ptr // _PAGE) * _PAGE  # this tensor's whole pages only
    end = (ptr + t.nbytes) // _PAGE * _PAGE
    return end > start and _madvise(start, end - start, _MADV_HUGEPAGE) == 0


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's storage (0-d tensors included)."""
    return t.reshape(-1).view(torch.uint8)


class SlabView:
    """The client's view of the slab mapping; owns the CUDA registration."""

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.size = size
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8, count=size)
        self.base = self.u8.data_ptr()  # the mapping's address (fixed while it lives)
        self._runtime: pinning.CudaRuntime | None = None  # set while registered
        self._registered_by = 0  # the pid that registered
        self._cuda_tried = False
        self._stream: torch.cuda.Stream | None = None
        self.pinned = False  # True once registered: copies are DMA
        # read()'s new-tensor path from this size (NEW_TENSOR_MIN; a benchmark sets
        # sys.maxsize to compare with the memmove path in the same process)
        self.new_tensor_min = NEW_TENSOR_MIN
        # write() streams puts from this size (STREAM_MIN; sys.maxsize: memmove
        # only, as a benchmark compares them)
        self.stream_min = STREAM_MIN if _stream_copy is not None else sys.maxsize

    # ------------------------------------------------------------------ CUDA

    def prepare_device(self, device: torch.device) -> None:
        """Register the slab for copies with ``device`` now, not on the first copy:
        ``cudaHostRegister`` pins every page of the slab, which a staged load must not
        pay within its bound (connector/vllm/worker.py). No-op off CUDA."""
        if device.type == "cuda":
            self._ensure_cuda(device)

    def _ensure_cuda(self, device: torch.device) -> torch.cuda.Stream:
        if not self._cuda_tried:
            self._cuda_tried = True
            with torch.cuda.device(device):
                self._register()
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _register(self) -> None:
        # Always attempted, whatever RLIMIT_MEMLOCK says: NVIDIA's driver pins with
        # pin_user_pages(FOLL_LONGTERM) and charges no memlock limit (os_lock_user_pages
        # in its kernel module), so a container's few-MiB limit does not stop it. The
        # limit is only named in the warning when a registration failed.
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
            return
        log.warning(
            "cudaHostRegister of the %d-byte slab failed (%s, cleared); copies use pageable "
            "memory, which is slower. %s",
            self.size,
            runtime.describe(code),
            pinning.failure_hint(self.size),
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
            try:
                with torch.cuda.stream(stream):
                    off = 0
                    for start, n in extents:
                        self.u8[start : start + n].copy_(src[off : off + n], non_blocking=True)
                        off += n
            finally:
                # Also when a copy raised part-way (an interrupt, a CUDA error): the
                # caller then aborts or unplaces the blocks, which are reused at once.
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
        base, ptr, off = self.base, src.data_ptr(), 0
        copy = _stream_copy if nbytes >= self.stream_min else _memmove
        for start, n in extents:
            copy(base + start, ptr + off, n)
            off += n

    def read(
        self, extents: list[Extent], dtype: torch.dtype, shape: list[int], device: torch.device
    ) -> torch.Tensor:
        """A new tensor holding the entry; returns when the copy is complete."""
        check_device(device)
        # Checked before allocating: a shape the extents do not cover must not cost an
        # allocation of its size first (on a device, an out-of-memory there first frees
        # every cached block of the caching allocator, with a device synchronize).
        self._check(extents, math.prod(shape) * dtype.itemsize)
        out = torch.empty(shape, dtype=dtype, device=device)
        if out.is_cpu and out.nbytes >= self.new_tensor_min:
            advise_huge(out)
            dst, off = _flat_bytes(out), 0
            for start, n in extents:
                dst[off : off + n].copy_(self.u8[start : start + n])
                off += n
            return out
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
            try:
                with torch.cuda.stream(stream):
                    off = 0
                    for start, n in extents:
                        dst[off : off + n].copy_(self.u8[start : start + n], non_blocking=True)
                        off += n
            finally:
                # Also when a copy raised part-way: the copies issued before it must not
                # read blocks the caller releases, nor write ``out`` after it raised.
                stream.synchronize()
            return
        # A contiguous CPU tensor's bytes start at data_ptr() (no uint8 view needed).
        base, ptr, off = self.base, out.data_ptr(), 0
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
