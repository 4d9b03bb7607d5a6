"""Tensor-parallel ranks agree on which failed loads to encode.

Every rank of a TP group runs the multimodal encoder together (its layers are
sharded and all-reduce, or data-parallel and all-gather): if one rank encoded an
item the others did not, the group would hang in a collective. So a load that
failed on any rank is encoded on every rank. All ranks call ``union_over_tp`` in
the same steps (those with loads) with the same ``hashes`` in the same order (the
step's loads, from the one metadata broadcast to all of them).

How they agree, chosen once per TP group at its first step with loads by one gloo
broadcast and one all-reduce on the group's CPU group (every rank takes the same
choice, from the all-reduce):

- every rank on this host: ``tp_shm.SharedAgreement``, a few microseconds; a rank
  that does not arrive within ``tp_shm.WAIT_S`` makes the step "encode every load"
  on every rank (it cannot make ranks disagree: see ``tp_shm``'s invariants);
- ranks on several hosts (or no usable /dev/shm): one max all-reduce of an int32
  per load on the CPU group, as before (hundreds of microseconds; it waits as long
  as vLLM's own CPU-group collectives, whose timeout bounds it).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Protocol

import torch

from lmcache_ec_broker.connector import tp_shm

log = logging.getLogger("vllm.lmcache_ec_broker.connector")

_NAME_BYTES = 128  # the segment's path, then its nonce, broadcast from rank 0


class Agreement(Protocol):
    kind: str

    def union(self, hashes: list[str], failed: set[str]) -> set[str]: ...


class CollectiveAgreement:
    """A max all-reduce over the group's CPU (gloo) group."""

    kind = "collective"

    def __init__(self, group: Any) -> None:
        self._group = group

    def union(self, hashes: list[str], failed: set[str]) -> set[str]:
        flags = torch.tensor([int(h in failed) for h in hashes], dtype=torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return {h for h, flag in zip(hashes, flags.tolist(), strict=True) if flag}


class LocalAgreement:
    """Through the host's shared memory (``tp_shm``)."""

    kind = "shared-memory"

    def __init__(self, shared: tp_shm.SharedAgreement) -> None:
        self.shared = shared

    def union(self, hashes: list[str], failed: set[str]) -> set[str]:
        mine = [i for i, h in enumerate(hashes) if h in failed] if failed else None
        agreed = self.shared.agree(tp_shm.bits_of(len(hashes), mine) if mine else 0)
        if agreed is None:
            log.warning(
                "EC TP agreement: a rank was more than %g s late for this step; every rank "
                "encodes all %d loads of it",
                self.shared.wait_s,
                len(hashes),
            )
            return set(hashes)
        if not agreed:
            return set()  # the usual step: no rank failed a load
        return {hashes[i] for i in tp_shm.indices_of(len(hashes), agreed)}


def setup_agreement(
    group: Any, rank: int, world: int, src: int, wait_s: float = tp_shm.WAIT_S
) -> Agreement:
    """Collective over ``group`` (a gloo group; every rank calls it once, together):
    the shared-memory agreement if every rank opened rank 0's segment, else the
    all-reduce. ``src``: the global rank of the group's rank 0."""
    fd, path = None, ""
    payload = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if rank == 0:
        try:
            fd, path, nonce = tp_shm.SharedAgreement.create(world)
            raw = path.encode() + b"\0" + nonce
            payload[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        except OSError as exc:
            log.info("EC TP agreement: no shared segment (%s): the all-reduce is used", exc)
    try:
        torch.distributed.broadcast(payload, src=src, group=group)
        raw = bytes(payload.tolist())
        name, _, rest = raw.partition(b"\0")
        if rank != 0 and name:
            fd = tp_shm.SharedAgreement.open(name.decode(), rest[: tp_shm.NONCE_LEN], world)
        ok = torch.tensor([int(fd is not None)], dtype=torch.int32)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=group)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    finally:
        if rank == 0 and path:
            with contextlib.suppress(OSError):
                os.unlink(path)  # every rank that will use it has it open (or never will)
    if int(ok.item()):
        assert fd is not None
        return LocalAgreement(tp_shm.SharedAgreement(fd, rank, world, wait_s))
    if fd is not None:
        os.close(fd)
    return CollectiveAgreement(group)


def _tp_group() -> Any | None:
    """vLLM's TP GroupCoordinator, or None outside a multi-rank group."""
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:  # pragma: no cover - vLLM without these helpers
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    if group.world_size <= 1:
        return None
    return group


# id(cpu_group) -> (the group, its agreement); the group is held so that its id is
# never reused by a later group while the entry exists.
_agreements: dict[int, tuple[Any, Agreement]] = {}


def agreement_for(group: Any) -> Agreement:
    """The agreement of vLLM's TP ``group``, set up at its first use (the first step
    with loads, which every rank of the group runs together)."""
    key = id(group.cpu_group)
    held, agreement = _agreements.get(key, (None, None))
    if held is not group.cpu_group or agreement is None:
        agreement = setup_agreement(
            group.cpu_group, group.rank_in_group, group.world_size, group.ranks[0], tp_shm.WAIT_S
        )
        _agreements[key] = (group.cpu_group, agreement)
        log.info("EC TP agreement on failed loads: %s (%d ranks)", agreement.kind, group.world_size)
    return agreement


def union_over_tp(hashes: list[str], failed: set[str]) -> set[str]:
    """The hashes of ``hashes`` that failed on at least one rank of this TP group."""
    group = _tp_group()
    if group is None or not hashes:
        return set(failed)
    return agreement_for(group).union(hashes, failed)
