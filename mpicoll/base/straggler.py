"""Injected slowness for experiments: slow ranks, and compute times that vary from step to step.

``--straggler RANK=FACTOR`` makes a rank FACTOR times slower: the rank does its
work as usual, then sleeps (FACTOR - 1) times as long as the work took, so a 3x
straggler looks like a machine one third as fast, whatever the work is.

``--delay DIST`` adds to every step of every rank a sleep drawn from a
distribution (milliseconds), seeded per rank, as published reproductions of
asynchronous SGD simulate workers of varying speed (Zheng et al. 2017; Dutta
et al. 2018 model compute times as shifted exponential or gamma): a worker's
steps then take different times, so the staleness of its gradients spreads
the way it does on a shared cluster, instead of the near-constant round robin
of identical processes.  ``gamma:K,THETA`` (shape K, scale THETA ms; mean
K*THETA), ``exp:MEAN`` or ``fixed:MS``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

__all__ = ["parse", "parse_delay", "DELAYS", "Straggler"]

# name -> (parameters, draw(rng, *parameters) in ms)
DELAYS: dict[str, tuple[int, Callable[..., float]]] = {
    "gamma": (2, lambda rng, shape, scale: rng.gamma(shape, scale)),
    "exp": (1, lambda rng, mean: rng.exponential(mean)),
    "fixed": (1, lambda rng, ms: ms),
}


def parse_delay(spec: str | None) -> Callable[[np.random.Generator], float] | None:
    """'gamma:2,1.5' -> a function drawing one delay in seconds from a generator; None for no delay."""
    if not spec:
        return None
    name, _, numbers = spec.partition(":")
    usage = "write gamma:SHAPE,SCALE_MS, exp:MEAN_MS or fixed:MS, e.g. gamma:2,1.5"
    if name not in DELAYS:
        raise ValueError(f"--delay {spec!r}: unknown distribution {name!r}; {usage}")
    count, draw = DELAYS[name]
    try:
        values = [float(v) for v in numbers.split(",")] if numbers else []
    except ValueError:
        raise ValueError(f"--delay {spec!r}: the parameters must be numbers; {usage}") from None
    if len(values) != count or not all(math.isfinite(v) and v >= 0 for v in values) or \
            (name == "gamma" and values[0] == 0):
        raise ValueError(f"--delay {spec!r}: {name} takes {count} non-negative number(s)"
                         f"{' (a positive shape)' if name == 'gamma' else ''}; {usage}")
    return lambda rng: draw(rng, *values) / 1000.0


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
    """Slows the work done inside ``with straggler:`` by ``factor``, then by a random ``delay`` (seconds)."""

    def __init__(self, factor: float = 1.0, delay: Callable[[np.random.Generator], float] | None = None,
                 seed=0):
        if factor < 1:
            raise ValueError(f"straggler factor must be >= 1, got {factor}")
        self.factor, self.delay = factor, delay
        self.rng = np.random.default_rng(seed)
        self.delayed_s = 0.0

    @classmethod
    def for_rank(cls, rank: int, spec: str | dict | None, delay: str | None = None, seed: int = 0) -> "Straggler":
        """This rank's slowness: its factor in ``spec``, and ``delay`` drawn from a generator seeded by (seed, rank)."""
        factors = spec if isinstance(spec, dict) else parse(spec)
        return cls(factors.get(rank, 1.0), parse_delay(delay), [seed, rank, 0x5106])

    def __enter__(self) -> "Straggler":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        delay = (self.factor - 1) * (time.perf_counter() - self._start) if self.factor > 1 else 0.0
        if self.delay:
            delay += self.delay(self.rng)
        if delay > 0:
            time.sleep(delay)
            self.delayed_s += delay
