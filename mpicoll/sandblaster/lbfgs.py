"""L-BFGS written against named vectors it never holds: what Sandblaster's coordinator runs.

The optimizer below sees the parameters, the gradient, the search direction
and the history pairs only by name (``"x"``, ``"g"``, ``"s3"``, ...) and acts on
them through the operations of a :class:`Vectors` store: dot products,
linear combinations, swaps and gradient evaluations.  The scalars (losses,
dot products, step lengths, the history's ``rho``) stay with the optimizer.
:class:`LocalVectors` holds the vectors in this process (the single-process
reference); :class:`mpicoll.sandblaster.coordinator.RemoteVectors` sends each
operation as a command to the parameter-server shards, which hold the vectors
in pieces, so the same iterates come out of one process or of many.

The method (Nocedal & Wright, *Numerical Optimization*, 2nd ed.):

- direction: the two-loop recursion (Alg. 7.4) over the last ``history`` pairs
  ``s = x+ - x``, ``y = g+ - g``, with ``H0 = gamma I``, ``gamma = s.y / y.y``
  of the newest pair, run on the coefficients of s, y and g over their dot
  products (vector-free, :meth:`LBFGS._direction`); a pair with
  ``s.y <= 1e-10 |s| |y|`` is skipped (it would
  break positive definiteness), and a direction that is not a descent
  direction resets the history and falls back to ``-g``;
- step: the line search of Alg. 3.5 with ``zoom`` (Alg. 3.6), which returns a
  step satisfying the strong Wolfe conditions (``c1 = 1e-4``, ``c2 = 0.9``):
  the first trial is 1 (``1/|g|`` on the first iteration, where the direction
  has no scale yet), growing x2 while the function still decreases and the slope
  is negative; zoom picks the minimiser of the quadratic through the bracket's
  low end (value and slope) and the high end's value, kept inside the middle 80%
  of the bracket (bisection when the quadratic is useless).  After 20 trials
  without such a step the run ends where it was, saying why (``stopped``).
  A trial point whose loss is NaN counts as infinitely high (a step too long,
  as where the model overflows), so the search backs off from it; a current
  point whose loss or gradient is not finite ends the run with
  :class:`mpicoll.Diverged`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..base.errors import Diverged

__all__ = ["Vectors", "LocalVectors", "LBFGS", "Iteration", "history_names", "C1", "C2"]

C1, C2 = 1e-4, 0.9           # the strong Wolfe conditions' constants
MAX_TRIALS = 20              # gradient evaluations one line search may spend
CURVATURE_FLOOR = 1e-10      # s.y must exceed this times |s| |y| for a pair to enter the history


def history_names(history: int) -> list[str]:
    """The vectors an L-BFGS with ``history`` pairs uses, besides none: the store allocates these."""
    return ["x", "g", "d", "x_trial", "g_trial"] + [f"s{i}" for i in range(history)] + \
        [f"y{i}" for i in range(history)]


class Vectors(Protocol):
    """Where the optimizer's vectors live, and the operations it may ask of them."""

    def dots(self, pairs: list[tuple[str, str]]) -> list[float]:
        """``[a . b for a, b in pairs]``, each over the whole vector."""

    def swap(self, a: str, b: str) -> None:
        """Exchange two vectors' contents (by name: nothing moves)."""

    def combination(self, out: str, terms: list[tuple[float, str]]) -> None:
        """``out = c1 v1 + c2 v2 + ...`` for ``terms = [(c1, v1), ...]``, summed in that order (``out`` none of
        them: a store may write ``out`` as it goes)."""

    def evaluate(self, at: str, gradient: str, batch: int) -> float:
        """The loss at vector ``at`` over batch number ``batch``; its gradient into ``gradient``."""


class LocalVectors:
    """Every vector in this process (numpy, float64): the single-process reference.

    ``loss_and_gradient(w, batch) -> (loss, gradient)``: the mean loss over that
    batch and its gradient.
    """

    def __init__(self, init: np.ndarray, loss_and_gradient: Callable, history: int = 10):
        self.vectors = {name: np.zeros(np.size(init)) for name in history_names(history)}
        self.vectors["x"][:] = np.ravel(init)
        self.loss_and_gradient = loss_and_gradient
        self.evaluations = 0

    def dots(self, pairs):
        return [float(self.vectors[a] @ self.vectors[b]) for a, b in pairs]

    def swap(self, a, b):
        self.vectors[a], self.vectors[b] = self.vectors[b], self.vectors[a]

    def combination(self, out, terms):
        v = self.vectors
        total = terms[0][0] * v[terms[0][1]]
        for c, name in terms[1:]:
            total += c * v[name]
        v[out][:] = total

    def evaluate(self, at, gradient, batch):
        self.evaluations += 1
        loss, grad = self.loss_and_gradient(self.vectors[at], batch)
        self.vectors[gradient][:] = grad
        return float(loss)


@dataclass
class Iteration:
    """One accepted L-BFGS step, as the optimizer saw it."""

    number: int
    loss: float                  # at the new point, over this iteration's batch
    step: float                  # the accepted step length t (x+ = x + t d)
    gradient_norm: float         # |g| at the new point
    evaluations: int             # gradient evaluations so far, over the whole run
    trials: int                  # of them, this iteration's line search
    restarted: bool = False      # the two-loop direction was no descent direction: history reset


@dataclass
class LBFGS:
    """The optimizer's own state: the scalars of the history, never its vectors."""

    vectors: Vectors
    history: int = 10
    tolerance: float = 1e-10             # stop once |g| falls below this
    pairs: list = field(default_factory=list)      # (slot, rho) of the stored pairs, oldest first
    gamma: float = 1.0
    evaluations: int = 0
    loss: float = math.nan
    gradient_norm: float = math.nan
    batch: int | None = None             # the batch "g" was computed on
    stopped: str = ""                    # why the run ended early, if it did
    gram: dict = field(default_factory=dict)       # (name, name) -> their dot product, for the stored vectors
    _trial_gg: float = math.nan          # |g_trial|^2 of the last trial point

    def minimize(self, iterations: int, batch_of: Callable[[int], int] = lambda k: 0,
                 on_iteration: Callable[[Iteration], None] | None = None,
                 evaluations: int | None = None, start: int = 0) -> list[Iteration]:
        """Take up to ``iterations`` steps from vector ``"x"``, and no new step once ``evaluations`` gradient
        evaluations are spent; ``batch_of(k)``: iteration k's batch number (constant for full-batch
        L-BFGS).  A new batch re-evaluates the gradient at ``x`` on it, so each history pair compares
        gradients of one function.  ``start``: the steps already taken, when resumed from :meth:`state`."""
        done = []
        for k in range(start, iterations):
            if evaluations is not None and self.evaluations >= evaluations:
                break
            batch = batch_of(k)
            if batch != self.batch:
                self.loss = self._evaluate("x", "g", batch)
                self.gram[("g", "g")] = self.vectors.dots([("g", "g")])[0]
            self.gradient_norm = math.sqrt(self.gram[("g", "g")])
            if not (math.isfinite(self.loss) and math.isfinite(self.gradient_norm)):
                raise Diverged(f"L-BFGS: the loss ({self.loss}) or the gradient's norm ({self.gradient_norm}) at "
                               f"the current point (step {k}) is NaN or Inf: check the data, and the model's loss "
                               "and gradient there")
            if self.gradient_norm <= self.tolerance:
                self.stopped = f"converged: |g| = {self.gradient_norm:.3g}"
                break
            restarted, slope = self._direction()
            first = 1.0 / self.gradient_norm if not self.pairs and k == 0 else 1.0
            before = self.evaluations
            step, loss, ok = self._line_search(first, slope)
            if not ok:
                self.stopped = (f"the line search found no step meeting the Wolfe conditions in {MAX_TRIALS} "
                                f"trials at |g| = {self.gradient_norm:.3g} (near a minimum, the loss no longer "
                                "changes in floating point; elsewhere, the gradient does not match the loss)")
                break
            self._remember(step)
            self.vectors.swap("x", "x_trial")
            self.vectors.swap("g", "g_trial")
            self.loss, self.gram[("g", "g")] = loss, self._trial_gg
            done.append(Iteration(k + 1, loss, step, math.sqrt(self._trial_gg), self.evaluations,
                                  self.evaluations - before, restarted))
            self.gradient_norm = done[-1].gradient_norm
            if on_iteration:
                on_iteration(done[-1])
        return done

    def state(self) -> dict[str, np.ndarray]:
        """The scalars that, with the vectors x, g and the history's, continue the run exactly (:meth:`load_state`)."""
        gram = sorted(self.gram.items())
        return {"pairs": np.array([slot for slot, _ in self.pairs], np.int64),
                "rhos": np.array([rho for _, rho in self.pairs]),
                "scalars": np.array([self.gamma, self.loss, self.gradient_norm, self._trial_gg]),
                "evaluations": np.array(self.evaluations), "batch": np.array(-1 if self.batch is None else self.batch),
                "gram_names": np.array([f"{a} {b}" for (a, b), _ in gram]),
                "gram_values": np.array([value for _, value in gram])}

    def load_state(self, state) -> None:
        """Continue from a :meth:`state` (the vectors restored beside it)."""
        self.pairs = [(int(slot), float(rho)) for slot, rho in zip(state["pairs"], state["rhos"])]
        self.gamma, self.loss, self.gradient_norm, self._trial_gg = (float(v) for v in state["scalars"])
        self.evaluations, batch = int(state["evaluations"]), int(state["batch"])
        self.batch = None if batch < 0 else batch
        self.gram = {tuple(str(names).split()): float(value)
                     for names, value in zip(state["gram_names"], state["gram_values"])}

    def _evaluate(self, at: str, gradient: str, batch: int) -> float:
        self.evaluations += 1
        self.batch = batch
        return self.vectors.evaluate(at, gradient, batch)

    def _dot(self, a: str, b: str) -> float:
        return self.gram[(a, b) if a <= b else (b, a)]

    def _measure(self, pairs: list[tuple[str, str]]) -> None:
        """Dot products of these pairs of vectors, in one operation, into :attr:`gram`."""
        for (a, b), value in zip(pairs, self.vectors.dots(pairs)):
            self.gram[(a, b) if a <= b else (b, a)] = value

    def _pair_dots(self, slots) -> None:
        """Measure the dot products of the history vectors in ``slots`` with every stored pair's (one operation)."""
        stored = [name for slot, _ in self.pairs for name in (f"s{slot}", f"y{slot}")]
        mine = [name for slot in slots for name in (f"s{slot}", f"y{slot}")]
        wanted = {tuple(sorted((a, b))) for a in mine for b in set(stored) | set(mine)}
        self._measure(sorted(wanted))

    def _direction(self) -> tuple[bool, float]:
        """``d = -H g`` by the two-loop recursion run on coefficients (vector-free L-BFGS: Chen, Wang & Zhou,
        2014): d is a combination of the stored s, y and g, and every dot product the recursion needs is one
        of those vectors' with another, measured when the vectors were made (g's in one operation here).  So
        the stores' vectors are touched by two operations per direction, not by 4m.  Returns (whether it
        fell back to ``-g``, the slope ``g.d``)."""
        v = self.vectors
        if not self.pairs:
            v.combination("d", [(-1.0, "g")])
            return False, -self._dot("g", "g")
        names = [name for slot, _ in self.pairs for name in (f"s{slot}", f"y{slot}")]
        self._measure([("g", name) for name in names])
        coefficients = {"g": 1.0}                        # q, then r: sum of coefficient x vector

        def dot(name: str) -> float:
            return sum(c * self._dot(name, other) for other, c in coefficients.items())

        alphas = []
        for slot, rho in reversed(self.pairs):
            alpha = rho * dot(f"s{slot}")
            coefficients[f"y{slot}"] = coefficients.get(f"y{slot}", 0.0) - alpha
            alphas.append(alpha)
        coefficients = {name: self.gamma * c for name, c in coefficients.items()}
        for (slot, rho), alpha in zip(self.pairs, reversed(alphas)):
            beta = rho * dot(f"y{slot}")
            coefficients[f"s{slot}"] = coefficients.get(f"s{slot}", 0.0) + alpha - beta
        slope = -dot("g")
        if slope < 0:
            v.combination("d", [(-c, name) for name, c in coefficients.items()])
            return False, slope
        self.pairs.clear()                               # not a descent direction: start over
        v.combination("d", [(-1.0, "g")])
        return True, -self._dot("g", "g")

    def _trial(self, t: float) -> tuple[float, float]:
        """(loss, slope) at ``x + t d``, left in ``x_trial`` and ``g_trial`` (and |g_trial|^2 noted)."""
        self.vectors.combination("x_trial", [(1.0, "x"), (t, "d")])
        loss = self._evaluate("x_trial", "g_trial", self.batch)
        slope, self._trial_gg = self.vectors.dots([("g_trial", "d"), ("g_trial", "g_trial")])
        return (math.inf if math.isnan(loss) else loss), slope      # NaN: too far, as +inf (back off)

    def _line_search(self, t: float, slope0: float) -> tuple[float, float, bool]:
        """(step, loss, found) by Nocedal & Wright's Alg. 3.5 with zoom; the trial point stays in x_trial."""
        f0, previous = self.loss, (0.0, self.loss, slope0)
        for trial in range(MAX_TRIALS):
            f, slope = self._trial(t)
            if f > f0 + C1 * t * slope0 or (trial and f >= previous[1]):
                return self._zoom(previous, (t, f, slope), f0, slope0, MAX_TRIALS - trial - 1)
            if abs(slope) <= -C2 * slope0:
                return t, f, True
            if slope >= 0:
                return self._zoom((t, f, slope), previous, f0, slope0, MAX_TRIALS - trial - 1)
            previous, t = (t, f, slope), 2.0 * t
        return t, f, False

    def _zoom(self, low, high, f0: float, slope0: float, budget: int) -> tuple[float, float, bool]:
        """Shrink the bracket [low, high] (each ``(t, loss, slope)``; low the lower loss) to a Wolfe step."""
        for _ in range(budget):
            t = _interpolate(low, high)
            f, slope = self._trial(t)
            if f > f0 + C1 * t * slope0 or f >= low[1]:
                high = (t, f, slope)
                continue
            if abs(slope) <= -C2 * slope0:
                return t, f, True
            if slope * (high[0] - low[0]) >= 0:
                high = low
            low = (t, f, slope)
        return low[0], low[1], False

    def _remember(self, step: float) -> None:
        """Store the pair (s, y) of the accepted step in the oldest slot, if its curvature is positive, and
        measure its dot products with the other pairs (one operation)."""
        v = self.vectors
        used = {slot for slot, _ in self.pairs}
        slot = next((i for i in range(self.history) if i not in used), None)
        if slot is None:
            slot = self.pairs.pop(0)[0]
        v.combination(f"s{slot}", [(step, "d")])
        v.combination(f"y{slot}", [(1.0, "g_trial"), (-1.0, "g")])
        self._pair_dots([slot])
        sy, yy, ss = self._dot(f"s{slot}", f"y{slot}"), self._dot(f"y{slot}", f"y{slot}"), \
            self._dot(f"s{slot}", f"s{slot}")
        if sy > CURVATURE_FLOOR * math.sqrt(ss * yy):
            self.pairs.append((slot, 1.0 / sy))
            self.gamma = sy / yy


def _interpolate(low, high) -> float:
    """The minimiser of the quadratic with low's value and slope and high's value, kept inside the
    bracket's middle 80%; its midpoint when the quadratic has no minimum there."""
    (a, fa, da), (b, fb, _) = low, high
    width = b - a
    curvature = fb - fa - da * width
    t = a - da * width * width / (2.0 * curvature) if curvature > 0 else a + width / 2
    lo, hi = sorted((a + 0.1 * width, b - 0.1 * width))
    return min(max(t, lo), hi) if math.isfinite(t) else a + width / 2
