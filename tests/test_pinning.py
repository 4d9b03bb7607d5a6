"""The CPU side of the CUDA registration decision (connector/client/pinning.py).

Registration is skipped, with one log line, when the memlock limit cannot hold
the slab and the process lacks CAP_IPC_LOCK; the GPU side (a refused or failed
registration leaves no CUDA error behind) is in tests/test_cuda_copy.py.
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
import json, logging, mmap
from lmcache_ec_broker.connector.client.copy import SlabView
from lmcache_ec_broker.connector.client.pinning import registration_refusal

records = []
handler = logging.Handler()
handler.emit = lambda rec: records.append(rec.getMessage())
logging.getLogger("lmcache_ec_broker").addHandler(handler)
logging.getLogger("lmcache_ec_broker").setLevel(logging.INFO)
size = 64 << 20
mm = mmap.mmap(-1, size)
view = SlabView(mm, size)
view._register()  # what the first CUDA copy does
print(json.dumps({"refusal": registration_refusal(size), "pinned": view.pinned, "log": records}))
view.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop CAP_IPC_LOCK")
def test_low_memlock_without_the_capability_skips_registration_with_one_line(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    r = subprocess.run(
        [sys.executable, str(HERE / "memlock_child.py"), str(64 << 10), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["refusal"] is not None and "RLIMIT_MEMLOCK" in out["refusal"]
    assert out["pinned"] is False
    (line,) = out["log"]
    assert "not registering the slab" in line and "ulimit -l" in line
    # Root with CAP_IPC_LOCK (this process) is not limited.
    assert registration_refusal(64 << 30) is None
