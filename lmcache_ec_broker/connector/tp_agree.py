"""Tensor-parallel ranks agree on which failed loads to encode.

Every rank of a TP group runs the multimodal encoder together (its layers are
sharded and all-reduce, or data-parallel and all-gather): if one rank encoded an
item the others did not, the group would hang in a collective. So a load that
failed on any rank is encoded on every rank. All ranks call this in the same
step with the same ``hashes`` (the step's loads, from the one metadata broadcast
to all of them)."""

from __future__ import annotations

import torch


def _tp_cpu_group() -> object | None:
    """The TP group's CPU (gloo) process group, or None outside a multi-rank group."""
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:  # pragma: no cover - vLLM without these helpers
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    if group.world_size <= 1:
        return None
    return group.cpu_group


def union_over_tp(hashes: list[str], failed: set[str]) -> set[str]:
    """The hashes of ``hashes`` that failed on at least one rank of this TP group."""
    group = _tp_cpu_group()
    if group is None or not hashes:
        return set(failed)
    flags = torch.tensor([int(h in failed) for h in hashes], dtype=torch.int32)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    return {h for h, flag in zip(hashes, flags.tolist(), strict=True) if flag}
