"""Sizes as people write them (``2GiB``, ``512MB``, a plain number in a given unit)
and as the broker prints them."""

from __future__ import annotations

import re

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt](?:ib?|b)?|b)?\s*$", re.IGNORECASE)
_BINARY = {"b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def _unit_bytes(unit: str) -> int:
    """KiB/Ki/K and friends are powers of 1024; KB, MB, GB, TB are powers of 1000, as
    written (a '2GB' slab is 2,000,000,000 bytes, never silently 2 GiB)."""
    u = unit.lower()
    if len(u) == 2 and u[1] == "b" and u[0] in _POWER:
        return 1000 ** _POWER[u[0]]
    return _BINARY[u[0]]


def parse_size(value: str | int | float, plain_unit: int = GiB) -> int:
    """'512MiB', '2GiB', '64k' (binary), '2GB' (decimal: 2 * 10**9), or a plain number of
    ``plain_unit`` (GiB by default)."""
    if isinstance(value, bool):
        raise ValueError(f"size must be a number or a string like 512MiB, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return int(value * plain_unit)
    if str(value).strip().startswith("-"):
        raise ValueError(f"size must not be negative, got {value!r}")
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(
            f"cannot parse size {value!r}; use e.g. 512MiB, 2GiB (binary), 2GB (decimal) "
            "or a plain number of GiB"
        )
    number, unit = float(m.group(1)), m.group(2)
    mult = plain_unit if unit is None else _unit_bytes(unit)
    return int(number * mult)


def format_size(nbytes: int | float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
