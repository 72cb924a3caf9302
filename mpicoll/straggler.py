"""Injected slowness for experiments: ``--straggler RANK=FACTOR`` makes a rank FACTOR times slower.

The rank does its work as usual, then sleeps (FACTOR - 1) times as long as the work
took, so a 3x straggler looks like a machine one third as fast, whatever the work is.
"""

from __future__ import annotations

import math
import time

__all__ = ["parse", "Straggler"]


def parse(spec: str | None) -> dict[int, float]:
    """'3=3' or '1=2,3=4.5' -> {rank: factor}; factors must be >= 1."""
    factors: dict[int, float] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        rank, _, factor = part.partition("=")
        try:
            factors[int(rank)] = float(factor)
        except ValueError:
            raise ValueError(f"--straggler {spec!r}: write RANK=FACTOR, e.g. 3=3 or 1=2,3=4") from None
        if not math.isfinite(factors[int(rank)]):
            raise ValueError(f"--straggler {spec!r}: the factor must be a finite number, e.g. 3")
        if factors[int(rank)] < 1:
            raise ValueError(f"--straggler {spec!r}: a factor below 1 would speed rank {rank} up")
    return factors


class Straggler:
    """Slows the work done inside ``with straggler:`` by ``factor``."""

    def __init__(self, factor: float = 1.0):
        if factor < 1:
            raise ValueError(f"straggler factor must be >= 1, got {factor}")
        self.factor = factor
        self.delayed_s = 0.0

    @classmethod
    def for_rank(cls, rank: int, spec: str | dict | None) -> "Straggler":
        factors = spec if isinstance(spec, dict) else parse(spec)
        return cls(factors.get(rank, 1.0))

    def __enter__(self) -> "Straggler":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.factor > 1:
            delay = (self.factor - 1) * (time.perf_counter() - self._start)
            time.sleep(delay)
            self.delayed_s += delay
