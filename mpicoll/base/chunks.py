"""How a buffer is cut: into one run per rank (or per server) and into pipeline segments.

Neutral arithmetic, shared by the collective algorithms and the parameter
server's shard layout.
"""

from __future__ import annotations

__all__ = ["balanced_bounds", "block_bounds", "segments", "segment_elements"]


def balanced_bounds(count: int, parts: int) -> list[int]:
    """Split ``count`` elements into ``parts`` runs whose sizes differ by at most one."""
    return [count * i // parts for i in range(parts + 1)]


def block_bounds(block: int, parts: int) -> list[int]:
    """``parts`` runs of exactly ``block`` elements."""
    return [block * i for i in range(parts + 1)]


def segments(start: int, stop: int, step: int) -> list[slice]:
    """Slices of at most ``step`` elements covering [start, stop); none when empty."""
    return [slice(i, min(i + step, stop)) for i in range(start, stop, step)]


def segment_elements(segment_bytes: int, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in one pipeline segment (at least one)."""
    return max(1, segment_bytes // max(1, itemsize))
