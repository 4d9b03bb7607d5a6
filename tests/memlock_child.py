"""Run a Python script the way a GPU worker in a default container runs: a low
memlock limit and no CAP_IPC_LOCK (which would exempt root from the limit).

    python memlock_child.py LIMIT_BYTES SCRIPT ARGS...

The limit and the capability are dropped in this process, then SCRIPT runs in
it with ``sys.argv = [SCRIPT, *ARGS]``.
"""

from __future__ import annotations

import ctypes
import resource
import runpy
import sys

CAP_IPC_LOCK = 14
PR_CAPBSET_DROP = 24
_CAP_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capability(cap: int) -> None:
    """Remove ``cap`` from this process's effective, permitted, inheritable and bounding sets."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        if err != 1:  # EPERM: not privileged, so the capability is not held anyway
            raise OSError(err, "prctl(PR_CAPBSET_DROP)")
    header = _Header(_CAP_VERSION_3, 0)
    data = (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    word, bit = divmod(cap, 32)
    mask = ~(1 << bit) & 0xFFFFFFFF
    data[word].effective &= mask
    data[word].permitted &= mask
    data[word].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def main() -> None:
    limit, script, *args = sys.argv[1:]
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (int(limit), int(limit)))
    drop_capability(CAP_IPC_LOCK)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
