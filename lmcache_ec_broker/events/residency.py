"""What one node holds: pure state, fed with events, asked by lookups.

Invariant: an entry ``(model, mm_hash, dtype)`` is in ``by_hash[mm_hash]`` exactly
while it is held on at least one tier (``entries`` has a non-empty tier map for it).
"""

from __future__ import annotations

from .schema import (
    MEDIUM,
    EncoderCacheCleared,
    EncoderCacheRemoved,
    EncoderCacheStored,
    Event,
    model_matches,
)

Ident = tuple[str, str, str]  # (model, mm_hash, dtype)


class Residency:
    def __init__(self) -> None:
        self.entries: dict[Ident, dict[str, int]] = {}  # -> {tier: nbytes}
        self.by_hash: dict[str, set[Ident]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def stored(self, model: str, mm_hash: str, dtype: str, tier: str, nbytes: int) -> None:
        ident = (model, mm_hash, dtype)
        tiers = self.entries.get(ident)
        if tiers is None:
            tiers = self.entries[ident] = {}
            self.by_hash.setdefault(mm_hash, set()).add(ident)
        tiers[tier] = nbytes

    def removed(self, model: str, mm_hash: str, dtype: str, tier: str) -> None:
        ident = (model, mm_hash, dtype)
        tiers = self.entries.get(ident)
        if tiers is None or tiers.pop(tier, None) is None or tiers:
            return
        del self.entries[ident]
        idents = self.by_hash[mm_hash]
        idents.discard(ident)
        if not idents:
            del self.by_hash[mm_hash]

    def clear(self, tier: str | None = None) -> None:
        if tier is None:
            self.entries.clear()
            self.by_hash.clear()
            return
        for model, mm_hash, dtype in [i for i, t in self.entries.items() if tier in t]:
            self.removed(model, mm_hash, dtype, tier)

    def apply(self, event: Event) -> None:
        match event:
            case EncoderCacheStored():
                self.stored(event.model, event.mm_hash, event.dtype, event.tier, event.nbytes)
            case EncoderCacheRemoved():
                self.removed(event.model, event.mm_hash, event.dtype, event.tier)
            case EncoderCacheCleared():
                self.clear(event.tier)

    def snapshot(self) -> list[EncoderCacheStored]:
        return [
            EncoderCacheStored(mm_hash, model, dtype, tier, nbytes, MEDIUM.get(tier))
            for (model, mm_hash, dtype), tiers in self.entries.items()
            for tier, nbytes in tiers.items()
        ]

    def lookup(self, model: str, mm_hash: str) -> dict[str, int]:
        """Tier -> bytes for ``mm_hash`` of ``model`` (any dtype; the largest copy per tier)."""
        out: dict[str, int] = {}
        for ident in self.by_hash.get(mm_hash, ()):
            if model_matches(model, ident[0]):
                for tier, nbytes in self.entries[ident].items():
                    out[tier] = max(out.get(tier, 0), nbytes)
        return out

    def models(self) -> set[str]:
        return {m for m, _, _ in self.entries}
