"""The session-wide /dev/shm cleanup must never unlink a live process's semaphore.

glibc maps a POSIX semaphore under the temporary name it created it with, then
links it to its real name (``sem.mp-*``) and unlinks the temporary, so
/proc/PID/maps shows ``/dev/shm/sem.XXXXXX (deleted)``. Matching by name alone
called every live semaphore unused; a test session ending while another
session's vLLM was starting unlinked the semaphore its engine process was about
to open (``FileNotFoundError`` in ``SemLock._rebuild``, every server failed)."""

from __future__ import annotations

import multiprocessing
import os

from lmcache_ec_broker.testing.shm_cleanup import list_vllm_shm, vllm_shm_in_use


def test_a_live_spawn_semaphore_is_in_use() -> None:
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem" + lock._semlock.name.replace("/", ".")
    assert name in list_vllm_shm()
    assert name in vllm_shm_in_use([os.getpid()])
    del lock
