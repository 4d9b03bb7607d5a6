"""The store's records: entries, pins, put arenas, per-connection state, and the
interfaces the store tells of residency changes (filter, residency index, observer).
Plain data; the rules that change them live in ``store.py``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from ..protocol import Extent
from ..shm.allocator import Run


class State(enum.Enum):
    RESERVED = 1
    READY = 2


@dataclass(slots=True, eq=False)
class Entry:
    key: str
    nbytes: int
    dtype: str
    shape: list[int]
    runs: list[Run]
    extents: list[Extent]
    state: State
    token: int = 0
    owner: int = 0  # connection id holding the reservation
    pins: int = 0
    doomed: bool = False  # removed from the index; blocks freed at the last release
    # A client's reservation: when it lapses (0: never, the broker's own). A lapsed
    # reservation has left the index; its blocks wait for its holder's commit or abort.
    expires_at: float = 0.0
    lapsed: bool = False


@dataclass(slots=True, eq=False)
class Pin:
    entry: Entry
    conn: int
    expires_at: float = 0.0  # 0: held until released; >0: a lease


@dataclass(slots=True)
class Arena:
    slot: int  # the connection's placement-journal slot (shm/journal.py)
    free: set[int] = field(default_factory=set)  # granted blocks not part of any entry


@dataclass(slots=True)
class ConnState:
    reservations: set[int] = field(default_factory=set)
    pins: set[int] = field(default_factory=set)
    leases: dict[str, int] = field(default_factory=dict)  # key -> pin id
    reserved_blocks: int = 0  # blocks of its open reservations (max_reserved_bytes cap)


class MembershipFilter(Protocol):
    """What the store needs of a membership filter (shm.filter.FilterWriter)."""

    def add(self, key: str) -> None: ...
    def remove(self, key: str) -> None: ...
    def set_partial(self, partial: bool) -> None: ...


class ResidencyIndex(Protocol):
    """What the store needs of the residency index (shm.residency.ResidencyWriter)."""

    def publish(
        self, key: str, nbytes: int, dtype: str, shape: list[int], extents: list[Extent]
    ) -> bool: ...
    def withdraw(self, key: str) -> None: ...


class StoreObserver(Protocol):
    """Told of slab residency changes on the loop thread; must not block."""

    def slab_stored(self, key: str, nbytes: int) -> None: ...
    def slab_removed(self, key: str) -> None: ...
