"""Shared-memory segment lifecycle and the block allocator."""

from .allocator import BlockAllocator
from .segment import Segment, ShmError

__all__ = ["BlockAllocator", "Segment", "ShmError"]
