"""Learning-rate schedules over a run's budget: ``--lr-schedule constant|step:F1,F2,...|cosine``.

A schedule is a function of *progress*, the fraction of the run's budget
done (updates for the parameter servers, steps for the others), so every
method follows the same curve over its own updates: ``step:0.5,0.75``
divides the rate by 10 at half and at three quarters of the budget (the
shape Zheng et al. and most ImageNet recipes use), ``cosine`` anneals it to
zero.  The rate decays at the end whatever the method's update count, which
is what makes final test errors comparable: at a constant rate the last
iterate wanders with the gradient noise, and one run's final accuracy says
as much about that noise as about the method.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["parse", "per_step", "per_update"]

USAGE = "write constant, cosine, or step:F1,F2,... (the rate /10 at each fraction of the budget, e.g. step:0.5,0.75)"


def parse(spec: str | None, lr: float) -> Callable[[float], float]:
    """The rate at a given progress (0 at the start, 1 at the end of the budget) for base rate ``lr``."""
    name, _, numbers = (spec or "constant").partition(":")
    if name == "constant" and not numbers:
        return lambda progress: lr
    if name == "cosine" and not numbers:
        return lambda progress: lr * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    if name == "step":
        try:
            marks = sorted(float(f) for f in numbers.split(","))
        except ValueError:
            marks = []
        if marks and all(0 < f < 1 for f in marks):
            return lambda progress: lr * 0.1 ** sum(progress >= f for f in marks)
    raise ValueError(f"--lr-schedule {spec!r}: {USAGE}")


def per_step(spec: str | None, lr: float, epochs: int, steps: int) -> Callable[[int, int], float]:
    """The rate at step ``step`` of epoch ``epoch`` of a run of ``epochs`` x ``steps`` steps."""
    at = per_update(spec, lr, epochs * steps)
    return lambda epoch, step: at(epoch * steps + step)


def per_update(spec: str | None, lr: float, updates: int) -> Callable[[int], float]:
    """The rate a parameter server's rule uses for update ``version`` of a run of ``updates`` updates."""
    at, total = parse(spec, lr), max(1, updates)
    return lambda version: at(version / total)
