"""Core sets: parsing ``--cpus``-style specs."""

from __future__ import annotations


def parse_cpus(spec: str | None) -> tuple[int, ...] | None:
    """'0', '0,2', '0-3' or '0-1,4' -> a tuple of core ids; None or '' -> None."""
    if not spec:
        return None
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return tuple(sorted(set(out)))
