"""The CPU side of the CUDA registration (connector/client/pinning.py, copy.py).

Registration is attempted whatever the memlock limit (NVIDIA's driver charges
none); a failed one logs one line that names the limit and its fix where the
limit could not hold the slab. Here the CUDA runtime is the one part stood in
for (no GPU); the GPU side -- a low limit still pins, a failed registration
leaves no CUDA error behind -- is in tests/test_cuda_copy.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmcache_ec_broker.connector.client.pinning import (
    CAP_IPC_LOCK,
    RLIM_INFINITY,
    failure_hint,
    loaded_cudart_path,
    memlock_refusal,
    parse_proc_status,
    registration_refusal,
)

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def test_proc_status_parse() -> None:
    text = (
        "Name:\tpython\nVmLck:\t      12 kB\nVmPin:\t       4 kB\n"
        "CapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\n"
    )
    cap_eff, locked = parse_proc_status(text)
    assert cap_eff >> CAP_IPC_LOCK & 1 and locked == 16 * 1024
    cap_eff, locked = parse_proc_status("CapEff:\t000001fffeffbfff\n")
    assert not cap_eff >> CAP_IPC_LOCK & 1 and locked == 0


def test_memlock_decision() -> None:
    cap, no_cap = 1 << CAP_IPC_LOCK, 0
    assert memlock_refusal(64 << 30, 64 << 10, cap, 0) is None  # the capability exempts
    assert memlock_refusal(64 << 30, RLIM_INFINITY, no_cap, 0) is None
    assert memlock_refusal(MiB, 2 * MiB, no_cap, MiB) is None  # fits exactly
    why = memlock_refusal(MiB, 2 * MiB, no_cap, MiB + 4096)
    assert why is not None
    assert f"{2 * MiB} bytes" in why and f"{MiB + 4096} already locked" in why
    assert "CAP_IPC_LOCK" in why and f"{MiB}-byte slab" in why


def test_loaded_runtime_is_found_in_the_process_maps() -> None:
    maps = (
        "7f01-7f02 r-xp 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f03-7f04 r-xp 00000000 08:01 12 "
        "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f05-7f06 rw-p 00000000 00:00 0 \n"
    )
    assert loaded_cudart_path(maps).endswith("nvidia/cuda_runtime/lib/libcudart.so.12")
    assert loaded_cudart_path(maps.replace("libcudart", "libcublas")) is None


CHILD = """
import json, logging, mmap, sys
from lmcache_ec_broker.connector.client import copy, pinning

records = []
handler = logging.Handler()
handler.emit = lambda rec: records.append(rec.getMessage())
logging.getLogger("lmcache_ec_broker").addHandler(handler)
logging.getLogger("lmcache_ec_broker").setLevel(logging.INFO)


class Driver:  # stands for libcudart (no GPU here): answers with the code it is given
    path = "libcudart.so.12"
    calls = []

    def register(self, ptr, size, flags):
        self.calls.append(size)
        return int(sys.argv[1])

    def unregister(self, ptr):
        return 0

    def describe(self, code):
        return f"cudaError {code}: out of memory"


driver = Driver()
pinning.load_runtime = lambda: driver
size = 64 << 20
mm = mmap.mmap(-1, size)
view = copy.SlabView(mm, size)
view._register()  # what the first CUDA copy does
print(json.dumps({"calls": driver.calls, "pinned": view.pinned, "log": records}))
view._runtime = None
view.close()
"""


def _run_low_memlock(tmp_path, code: int) -> dict:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    r = subprocess.run(
        [sys.executable, str(HERE / "memlock_child.py"), str(64 << 10), str(script), str(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop CAP_IPC_LOCK")
def test_low_memlock_does_not_stop_the_registration(tmp_path) -> None:
    # A container's memlock limit (64 KiB, no CAP_IPC_LOCK): registration is still
    # attempted, and taken when the driver takes it.
    out = _run_low_memlock(tmp_path, 0)
    assert out["calls"] == [64 << 20] and out["pinned"] is True
    (line,) = out["log"]
    assert "registered the 67108864-byte slab" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop CAP_IPC_LOCK")
def test_failed_registration_under_a_low_limit_names_the_limit_and_the_fix(tmp_path) -> None:
    out = _run_low_memlock(tmp_path, 2)
    assert out["calls"] == [64 << 20] and out["pinned"] is False
    (line,) = out["log"]
    assert "cudaHostRegister of the 67108864-byte slab failed (cudaError 2" in line
    assert "RLIMIT_MEMLOCK" in line and "65536 bytes" in line
    assert "ulimit -l unlimited" in line and "CAP_IPC_LOCK" in line
    # Root with CAP_IPC_LOCK (this process) is not limited: no limit to blame.
    assert registration_refusal(64 << 30) is None
    assert "RLIMIT_MEMLOCK" not in failure_hint(64 << 30)
