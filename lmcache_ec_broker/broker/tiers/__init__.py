"""Lower tiers under the slab (see ``base.py`` for the contract) and their factory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (
    EntryMeta,
    LowerTier,
    SlabAccess,
    TierCorrupt,
    TierError,
    TierEvents,
    TierMiss,
    TierUnavailable,
)

if TYPE_CHECKING:
    from ...config import BrokerConfig

__all__ = [
    "EntryMeta",
    "LowerTier",
    "SlabAccess",
    "TierCorrupt",
    "TierError",
    "TierEvents",
    "TierMiss",
    "TierUnavailable",
    "all_empty_stats",
    "make_lower_tiers",
    "tier_counter_names",
]


def make_lower_tiers(config: BrokerConfig, slab_capacity: int) -> list[LowerTier]:
    """The configured lower tiers, nearest first (lookup and promotion order).

    A new backend adds one branch here; nothing else in the broker changes.
    """
    tiers: list[LowerTier] = []
    if config.local_disk:
        from .disk.tier import DiskTier

        tiers.append(
            DiskTier(
                config.local_disk,
                config.max_local_disk_size,
                max_pending_bytes=max(slab_capacity // 4, 1),
            )
        )
    # remote tier (Redis/Valkey, Mooncake): appended here, after the disk tier.
    if config.remote_url and not config.remote_url.lower().startswith("mooncakestore://"):
        from .redis.transport import RedisTier

        tiers.append(
            RedisTier(
                config,
                max_entry_bytes=config.max_entry_size or slab_capacity,
                max_pending_bytes=max(slab_capacity // 4, 1),
            )
        )
    if config.remote_url and config.remote_url.lower().startswith("mooncakestore://"):
        from .mooncake.settings import settings_from_config
        from .mooncake.transport import MooncakeTier

        tiers.append(
            MooncakeTier(settings_from_config(config), max_pending_bytes=max(slab_capacity // 4, 1))
        )
    return tiers


def _tier_classes() -> list[type[LowerTier]]:
    """Every tier implementation (configured or not): stats keys stay stable."""
    from .disk.tier import DiskTier
    from .mooncake.transport import MooncakeTier  # imports Mooncake's client only when it opens
    from .redis.transport import RedisTier

    # remote tier classes: appended here (import them lazily if they need extras).
    return [DiskTier, RedisTier, MooncakeTier]


def all_empty_stats() -> dict[str, int | float]:
    out: dict[str, int | float] = {}
    for cls in _tier_classes():
        out.update(cls.empty_stats())
    return out


def tier_counter_names() -> tuple[str, ...]:
    return tuple(name for cls in _tier_classes() for name in cls.counter_names)
