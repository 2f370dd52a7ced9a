"""Sizes as an owner writes them (``8G``, ``512M``, ``1.5GiB``, ``2GB``: ``parse_size``) and as
messages show them (``format_size``).
"""

from __future__ import annotations

import re
from typing import Any

MiB = 1024 * 1024

# Sizes: K, M, G, T (and KiB … TiB) count in 1024s, KB, MB, GB, TB in 1000s, B or nothing bytes.
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(I?B?)$", re.IGNORECASE)
_SIZE_HINT = "a size in bytes, or with a unit: 512M, 8G, 1.5GiB"


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``8G``, ``512M``, ``1.5GiB``, ``2GB``; ValueError else."""
    if isinstance(value, bool):
        raise ValueError(f"must be {_SIZE_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be {_SIZE_HINT}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    m = _SIZE.match(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"must be {_SIZE_HINT}")
    unit, suffix = m[2].upper(), m[3].upper()
    if not unit and suffix in ("", "B") and "." not in m[1]:
        factor = 1
    elif unit and suffix in ("", "IB"):
        factor = 1024 ** ("KMGTP".index(unit) + 1)
    elif unit and suffix == "B":
        factor = 1000 ** ("KMGTP".index(unit) + 1)
    else:
        raise ValueError(f"must be {_SIZE_HINT}")
    number = float(m[1]) if "." in m[1] else int(m[1])  # exact for whole numbers
    return int(number * factor)


def format_size(size: int) -> str:
    """``4 MiB``, ``1 GiB``, ``17.7 GiB``, ``512 bytes``: for messages, in the largest unit the
    size reaches (exact when it is a whole number of it, else to a tenth)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return (
                f"{size // factor} {unit}" if size % factor == 0 else f"{size / factor:.1f} {unit}"
            )
    return f"{size} bytes"
