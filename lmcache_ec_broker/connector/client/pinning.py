"""Pinning the slab for CUDA DMA (cudaHostRegister), and saying why it failed.

Registration is always attempted. NVIDIA's kernel module pins the pages with
``pin_user_pages(FOLL_LONGTERM)`` (``os_lock_user_pages``) and charges no
RLIMIT_MEMLOCK, so a container's few-MiB memlock limit does not refuse it; the
limit is read only to name it, and its fix, when a registration did fail.

A CUDA runtime call that fails also leaves its code as the calling thread's
"last error", and the next kernel launch check (PyTorch's, vLLM's) reports that
code as its own failure. So every call here that fails is followed at once by
cudaGetLastError, which clears it -- in the same runtime library instance that
PyTorch loaded, found in /proc/self/maps (a separately loaded instance keeps
its own error state, which PyTorch never reads).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

CAP_IPC_LOCK = 14  # bit in /proc/<pid>/status CapEff
RLIM_INFINITY = -1  # resource.RLIM_INFINITY on Linux
# Pinned for every CUDA context, not only the one current when registering.
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_FLAGS = HOST_REGISTER_PORTABLE
CUDA_ERROR_CUDART_UNLOADING = 4  # the process is tearing CUDA down: nothing to undo
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def parse_proc_status(text: str) -> tuple[int, int]:
    """(effective capability mask, bytes already locked or pinned) from /proc/self/status."""
    cap_eff, locked = 0, 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            cap_eff = int(value.strip(), 16)
        elif key in ("VmLck", "VmPin"):
            parts = value.split()
            if parts:
                locked += int(parts[0]) * 1024  # kB
    return cap_eff, locked


def memlock_refusal(size: int, soft_limit: int, cap_eff: int, locked: int) -> str | None:
    """Why registering ``size`` more bytes would be refused, or None if it can fit."""
    if cap_eff >> CAP_IPC_LOCK & 1 or soft_limit == RLIM_INFINITY:
        return None
    if locked + size <= soft_limit:
        return None
    return (
        f"the memlock limit (RLIMIT_MEMLOCK) is {soft_limit} bytes, {locked} already locked, "
        f"and the process lacks CAP_IPC_LOCK, so the {size}-byte slab cannot be pinned"
    )


def registration_refusal(size: int) -> str | None:
    """memlock_refusal for this process, now."""
    # Imported on first use: a process that drops privileges after importing the client
    # may no longer be able to read the interpreter's extension modules.
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            cap_eff, locked = parse_proc_status(f.read())
    except OSError:
        cap_eff, locked = 0, 0
    return memlock_refusal(size, soft, cap_eff, locked)


def failure_hint(size: int) -> str:
    """What to look at after cudaHostRegister of ``size`` bytes failed: the memlock limit
    where it could not hold them (a driver that does charge it), else the usual causes."""
    reason = registration_refusal(size)
    if reason is not None:
        return (
            f"Possibly the limit: {reason}. Raise it (ulimit -l unlimited, "
            "docker run --ulimit memlock=-1, LimitMEMLOCK=infinity) or grant CAP_IPC_LOCK"
        )
    return (
        "The range may already be registered by another library in this process, or the "
        "driver refused it; copies stay exact"
    )


def loaded_cudart_path(maps_text: str) -> str | None:
    """The CUDA runtime library mapped into this process (PyTorch's), from /proc/self/maps."""
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and "/libcudart.so" in fields[5]:
            return fields[5].strip()
    return None


class CudaRuntime:
    """cudaHostRegister / cudaHostUnregister / cudaGetLastError through ctypes."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def register(self, ptr: int, size: int, flags: int) -> int:
        code = self._register(ptr, size, flags)
        if code:
            self._last_error()  # clear it: the next kernel launch check must not see it
        return code

    def unregister(self, ptr: int) -> int:
        code = self._unregister(ptr)
        if code:
            self._last_error()
        return code

    def describe(self, code: int) -> str:
        raw = self._error_string(code)
        return f"cudaError {code}: {raw.decode(errors='replace') if raw else 'unknown'}"


def load_runtime() -> CudaRuntime | None:
    """PyTorch's CUDA runtime (call after CUDA is initialised), else one by soname."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            path = loaded_cudart_path(f.read())
    except OSError:
        path = None
    for candidate in ([path] if path else []) + list(_SONAMES):
        try:
            return CudaRuntime(ctypes.CDLL(candidate), candidate)
        except (OSError, AttributeError):
            continue
    return None
