"""The store's records: entries, pins, put arenas, and the interfaces the store
tells of residency changes (filter, residency index, observer); and what a new
entry's key and description must be (``EntryRules``). Plain data; the rules that
change them live in ``store.py`` (and ``conn_books.py``, which also keeps each
connection's state)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from ..protocol import ErrorCode, ErrorReply, Extent, expected_nbytes
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


@dataclass(slots=True, frozen=True)
class EntryRules:
    """What reserve and place both require of a new entry's key and description."""

    max_key_length: int
    max_entry_bytes: int
    capacity_bytes: int  # the slab's (named in the refusal of a too large entry)

    def check_key(self, key: str) -> ErrorReply | None:
        if not key:
            return ErrorReply(ErrorCode.KEY_INVALID, "key is empty")
        if len(key) > self.max_key_length:
            return ErrorReply(
                ErrorCode.KEY_INVALID,
                f"key is {len(key)} characters long; the maximum is {self.max_key_length}",
            )
        return None

    def check(self, key: str, nbytes: int, dtype: str, shape: list[int]) -> ErrorReply | None:
        if (err := self.check_key(key)) is not None:
            return err
        try:
            implied = expected_nbytes(dtype, shape)
        except ValueError as exc:
            code = ErrorCode.DTYPE_INVALID if "dtype" in str(exc) else ErrorCode.SHAPE_MISMATCH
            return ErrorReply(code, str(exc))
        if nbytes != implied:
            return ErrorReply(
                ErrorCode.SHAPE_MISMATCH,
                f"nbytes={nbytes} but dtype {dtype} with shape {shape} needs {implied} bytes",
            )
        if nbytes > self.max_entry_bytes:
            return ErrorReply(
                ErrorCode.TOO_LARGE,
                f"entry of {nbytes} bytes exceeds the maximum entry size of "
                f"{self.max_entry_bytes} bytes (slab capacity {self.capacity_bytes} bytes); "
                "start the broker with a larger --shm-size or max_entry_size",
            )
        return None


@dataclass(slots=True, eq=False)
class Pin:
    entry: Entry
    conn: int
    expires_at: float = 0.0  # 0: held until released; >0: a lease


@dataclass(slots=True)
class Arena:
    slot: int  # the connection's placement-journal slot (shm/journal.py)
    free: set[int] = field(default_factory=set)  # granted blocks not part of any entry


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
