"""Byte sizes as users write them: ``6GB`` = 6*10^9, ``6GiB`` = 6*2^30, or plain bytes."""

from __future__ import annotations

import re

from memcc.errors import InputError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """``"6GB"`` -> 6000000000; raises ``InputError`` naming the accepted units."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise InputError(f"size {text} must not be negative")
        return int(text)
    if text.strip().startswith("-"):
        raise InputError(f"size '{text}' must not be negative")
    m = _PATTERN.match(text)
    unit = m.group(2).upper() if m else None
    if m is not None and m.group(2).endswith("b") and m.group(2)[:-1] != unit[:-1].lower():
        # 10Mb reads as megabits to most; memcc's sizes are bytes.
        prefix = m.group(2)[:-1]
        raise InputError(f"size '{text}': a lowercase b after {prefix} means bits; "
                         f"write {m.group(1)}{prefix}B for bytes")
    if m is None or unit not in _UNITS:
        raise InputError(
            f"cannot read size '{text}': write a number with an optional unit, e.g. 6GB "
            "(10^9 bytes), 6GiB (2^30 bytes), 512MB, 512MiB, or plain bytes"
        )
    value = float(m.group(1)) * _UNITS[unit]
    return int(round(value))


def format_size(n: float | None) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n):,} B"
