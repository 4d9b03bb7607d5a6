"""Remove the shared memory that vLLM leaves in /dev/shm when its servers stop.

vLLM's processes create ``multiprocessing.shared_memory`` segments (``psm_*``),
semaphores (``sem.mp-*``) and CPU tensor-parallel buffers (``vllm_dist_*``) and
do not unlink all of them at shutdown: 150-250 MiB per stopped server, so a CI
machine or a benchmark host fills /dev/shm over runs.

Two ways to clean up:

- :func:`vllm_shm_in_use` + :func:`remove_shm`: record the names a server's own
  processes map or hold open while it runs, unlink the ones still there once it has
  stopped. Precise: it never touches another program's segments, also while other
  vLLM instances run on the same host (what :class:`VllmServer` does).
- :func:`removing_new_vllm_shm`: unlink the vLLM-named segments that appeared
  while the block ran and that no live process uses any more (a session-wide
  safety net for servers stopped some other way).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

SHM_DIR = "/dev/shm"
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")


def _is_vllm_name(name: str) -> bool:
    return name.startswith(VLLM_SHM_PREFIXES) and "/" not in name


def process_group(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Field 5 is the pgid; the command name (field 2) may contain spaces: skip past ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def vllm_shm_in_use(pids: Iterable[int]) -> set[str]:
    """Names of vLLM-named /dev/shm entries these processes map or hold open."""
    prefix = SHM_DIR + "/"
    names: set[str] = set()
    # A POSIX semaphore is mapped under the temporary name glibc created it with
    # (then linked to sem.mp-*, the temporary unlinked): match those by inode.
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(maxsplit=5)
                    path = fields[-1]
                    if path.startswith(prefix):
                        names.add(path[len(prefix) :].removesuffix(" (deleted)"))
                        inodes.add(int(fields[4]))
        except (OSError, ValueError):
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix) :].removesuffix(" (deleted)"))
    for name in list_vllm_shm() - names:
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_ino in inodes:
                names.add(name)
        except OSError:
            pass
    return {n for n in names if _is_vllm_name(n)}


def remove_shm(names: Iterable[str]) -> list[str]:
    """Unlink these vLLM-named /dev/shm entries if they are still there; the ones removed."""
    removed = []
    for name in names:
        if not _is_vllm_name(name):  # never anything else, whatever the caller passes
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:  # already gone (its owner unlinked it) or not ours to remove
            pass
    return removed


def list_vllm_shm() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if _is_vllm_name(n)}
    except FileNotFoundError:
        return set()


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


@contextmanager
def removing_new_vllm_shm() -> Iterator[None]:
    """Unlink the vLLM-named /dev/shm entries that appear while the block runs and
    that no live process maps or holds open when it ends.

    The second condition matters on a shared host: a vLLM engine starting in
    another test session has created its segments but its workers attach to
    them by name later; unlinking them then kills that engine's start-up.
    """
    before = list_vllm_shm()
    try:
        yield
    finally:
        new = list_vllm_shm() - before
        if new:
            remove_shm(new - vllm_shm_in_use(all_pids()))
