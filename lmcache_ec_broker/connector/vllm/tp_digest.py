"""The encoder digest settled over the tensor-parallel group: every rank's rows
(:mod:`.encoder_digest`) all-gathered over the TP group's CPU group, so every rank
gets the same model field, whatever the TP size.

The all-gathers never wait on a rank that failed: each rank computes its parts inside
a ``try`` and always joins the all-gathers with a "failed" flag; a failure anywhere
makes every rank raise :class:`DigestFailed` (the field is then unknown: misses, no
stores), never a hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmcache_ec_broker.connector.vllm.encoder_digest import LANES, combine, local_parts, rank_rows

if TYPE_CHECKING:
    from torch import nn


class DigestFailed(RuntimeError):
    """A rank could not fingerprint its encoder (raised on every rank alike)."""


def _tp_group() -> Any | None:
    try:
        from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    except ImportError:  # pragma: no cover
        return None
    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def settle_field(model: nn.Module, base: str) -> str | None:
    """The model field for the weights ``model`` holds now: ``<base>~w<digest>``, the
    same on every rank of the TP group and for every TP size (all ranks must call it
    together: it all-gathers over the group's CPU group). None: no rank has an
    encoder.

    Invariant: every rank reaches both all-gathers, whatever its own digest did; a
    failure on any rank raises DigestFailed on all of them."""
    failure: BaseException | None = None
    rows: list[list[int]] = []
    try:
        parts = local_parts(model)
        rows = rank_rows(parts) if parts is not None else []
        mine = parts is not None
    except Exception as exc:  # joins the all-gathers anyway, flagged
        mine, failure = False, exc
    group = _tp_group()
    if group is None:
        if failure is not None:
            raise DigestFailed(f"cannot fingerprint the encoder: {failure!r}") from failure
        return f"{base}~w{combine([rows])}" if mine else None
    flags = torch.tensor([int(mine), int(failure is not None), len(rows)], dtype=torch.int64)
    gathered = [torch.zeros_like(flags) for _ in range(group.world_size)]
    torch.distributed.all_gather(gathered, flags, group=group.cpu_group)
    failed = [rank for rank, g in enumerate(gathered) if int(g[1])]
    if failed:
        raise DigestFailed(
            f"TP rank(s) {failed} could not fingerprint the encoder"
            + (f" (here: {failure!r})" if failure is not None else "")
        ) from failure
    if not any(int(g[0]) for g in gathered):
        return None
    # Every rank saw the same lengths: all pad to the longest, all join the same gather.
    longest = max(int(g[2]) for g in gathered)
    payload = torch.zeros((longest + 1, 3 + 2 * LANES), dtype=torch.int64)
    payload[0, 0] = len(rows)
    if rows:
        payload[1 : len(rows) + 1] = torch.tensor(rows, dtype=torch.int64)
    everyone = [torch.zeros_like(payload) for _ in range(group.world_size)]
    torch.distributed.all_gather(everyone, payload, group=group.cpu_group)
    ranks = [
        [list(map(int, row)) for row in p[1 : int(p[0, 0]) + 1].tolist()]
        for p in everyone
        if int(p[0, 0])  # a rank without an encoder (not a TP layout) adds nothing
    ]
    return f"{base}~w{combine(ranks)}"


def weights_digest(model: nn.Module) -> str | None:
    """The encoder's digest, the same on every rank of the TP group and for every TP
    size (all ranks must call it together). Raises DigestFailed on every rank if any
    rank failed."""
    field = settle_field(model, "")
    return None if field is None else field.rpartition("~w")[2]
