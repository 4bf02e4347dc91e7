"""Memory sizes as users write them: ``70GiB``, ``512MB``, ``1.5G``, plain bytes."""

from __future__ import annotations

import re

from ..errors import UsageError

UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([0-9]+))?\s*([a-zA-Z]*)\s*")


def parse_size(value: str | int | float, option: str = "--max-memory") -> int:
    """Bytes of ``value``: an int, or a number with an optional unit (B, KB/MB/GB/TB = powers of
    1000, KiB/MiB/GiB/TiB = powers of 1024, K/M/G/T = powers of 1000); case-insensitive."""
    if isinstance(value, bool):
        raise UsageError(f"{option}: cannot read {value!r} as a size")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE.fullmatch(str(value))
        if not match or match.group(3).lower() not in UNITS:
            raise UsageError(f"{option}: cannot read {value!r} as a size (examples: 70GiB, 512MB, 1073741824)")
        number = float(match.group(1)) * (10 ** int(match.group(2)) if match.group(2) else 1)
        unit = match.group(3).lower()
    size = int(number * UNITS[unit])
    if size <= 0:
        raise UsageError(f"{option} must be > 0 (got {value!r})")
    return size


def format_size(num_bytes: float) -> str:
    """``1.50 GiB``-style text (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB" if abs(value) < 1e6 else f"{value:.3g} TiB"
