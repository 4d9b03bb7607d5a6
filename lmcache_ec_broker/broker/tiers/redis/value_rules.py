"""The rules a value read from a Redis store must meet, for the threads
(``transport.py``) and the loop (``loop.py``) alike."""

from __future__ import annotations

from ..base import EntryMeta, TierMiss
from ..remote.transport import LookupAnswer
from ..remote.value import FIXED, MAX_HEADER, BadValue, Header, fixed_lengths, parse_header


class ValueRules:
    """What a stored value must be to be served: no larger than an entry may be, a
    header that parses (signed, where a key is set) and names the key it is read as.
    The threads and the loop read a value's header through the same checks.

    ``parse_header`` is called here, in this module, on purpose:
    benchmarks/remote_attribution.py times ``value_rules.parse_header``."""

    def __init__(self, max_entry_bytes: int, hmac_key: bytes | None) -> None:
        self.max_entry_bytes = max_entry_bytes
        self.hmac_key = hmac_key

    def meta(self, key: str, head: object, total: object) -> LookupAnswer:
        """A lookup's answer from ``GETRANGE key 0 <max header>`` and ``STRLEN key``."""
        if not isinstance(total, int) or total == 0 or not isinstance(head, bytes):
            return None  # absent (GETRANGE of a missing key is empty)
        try:
            h = parse_header(head, key, self.max_entry_bytes, self.hmac_key, total_len=total)
        except BadValue as exc:
            return exc
        return EntryMeta(h.nbytes, h.dtype, h.shape)

    def total(self, key: str, length: int | None) -> int:
        """A ``GET``'s bulk length, checked before a byte of the value is read."""
        if length is None:
            raise TierMiss(key)
        if length > MAX_HEADER + self.max_entry_bytes:
            raise BadValue(f"value of {length} bytes exceeds the entry size limit")
        return length

    def fixed_size(self, total: int) -> int:
        """How much to read first: the header's fixed part (less of a shorter value)."""
        return min(FIXED.size, total)

    def head_rest(self, fixed: bytes, total: int) -> int:
        """How many bytes of the header follow its fixed part ``fixed``."""
        size, _ = fixed_lengths(fixed)
        if size > total:
            raise BadValue("value is truncated inside its header")
        return size - FIXED.size

    def header(self, key: str, data: bytes, total: int) -> Header:
        return parse_header(data, key, self.max_entry_bytes, self.hmac_key, total_len=total)

    @staticmethod
    def unchanged(head: Header, meta: EntryMeta) -> None:
        """A promotion reads what its lookup saw, or nothing."""
        if (head.nbytes, head.dtype, head.shape) != (meta.nbytes, meta.dtype, meta.shape):
            raise BadValue("value changed since the lookup (other dtype/shape)")
