"""The client's book of its put arena: which granted slab blocks are free to place into.

Invariant (kept by BrokerClient): a block is in the book only while the broker has it
in this connection's arena and no posted Place names it. The book is emptied when the
connection goes (the broker frees the arena with it).
"""

from __future__ import annotations

Run = tuple[int, int]  # (first block, number of blocks)


class ArenaBlocks:
    """Free blocks of one connection's arena, as sorted, merged runs."""

    __slots__ = ("runs", "blocks")

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.blocks = 0

    def clear(self) -> None:
        self.runs = []
        self.blocks = 0

    def take(self, n: int) -> list[Run] | None:
        """``n`` blocks: the shortest run that holds them (one copy), else the first runs
        in order; None if the book holds fewer."""
        if n > self.blocks:
            return None
        if n == 0:
            return []
        runs = self.runs
        best = -1
        for i, (_, length) in enumerate(runs):
            if length >= n and (best < 0 or length < runs[best][1]):
                best = i
        self.blocks -= n
        if best >= 0:
            start, length = runs[best]
            if length == n:
                del runs[best]
            else:
                runs[best] = (start + n, length - n)
            return [(start, n)]
        out = []
        while n:
            start, length = runs[0]
            take = min(length, n)
            out.append((start, take))
            if take == length:
                del runs[0]
            else:
                runs[0] = (start + take, length - take)
            n -= take
        return out

    def give(self, runs: list[Run]) -> None:
        """Blocks granted, or taken and not placed after all, come (back) in."""
        merged: list[Run] = []
        for start, length in sorted(self.runs + [(int(s), int(n)) for s, n in runs]):
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.runs = merged
        self.blocks = sum(n for _, n in merged)


def extents_of(runs: list[Run], nbytes: int, block_size: int) -> list[tuple[int, int]]:
    """The byte extents of ``nbytes`` laid over block ``runs`` in order (as the broker's
    Store._extents lays them, so both sides agree where every byte is)."""
    out = []
    left = nbytes
    for start, length in runs:
        n = min(length * block_size, left)
        out.append((start * block_size, n))
        left -= n
    return out
