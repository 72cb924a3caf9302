"""Fused CPU loops with Numba: one pass over memory, spread over threads.

Compiled on first use (and cached on disk).  Each update reads and writes
every array exactly once, against numpy's chain of temporaries: DC-ASGD as a
numpy expression moves about five times the bytes.  Plain reductions are not
here: numpy's ufunc already makes one pass, and faster (see ``reduce``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import formulas

_OPTIONS = dict(parallel=True, cache=True, nogil=True)
_compensated = njit(inline="always", cache=True)(formulas.compensated)
_mean_square = njit(inline="always", cache=True)(formulas.mean_square)


@njit(**_OPTIONS)
def scaled_accumulate(x, y, a, b):
    for i in prange(x.size):
        x[i] = a * x[i] + b * y[i]


@njit(**_OPTIONS)
def dcasgd(w, g, w_bak, lr, lam, refresh):
    for i in prange(w.size):
        updated = _compensated(w[i], g[i], w_bak[i], lr, lam)
        w[i] = updated
        if refresh:
            w_bak[i] = updated


@njit(**_OPTIONS)
def _dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, rest, eps, refresh):
    for i in prange(w.size):
        mi = _mean_square(m[i], g[i], beta, rest)
        updated = _compensated(w[i], g[i], w_bak[i], lr, lam0 / np.sqrt(mi + eps))
        m[i] = mi
        w[i] = updated
        if refresh:
            w_bak[i] = updated


def dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, eps, refresh):
    # 1 - beta computed here, in beta's precision, so the loop never widens to float64
    _dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, type(beta)(1) - beta, eps, refresh)


@njit(**_OPTIONS)
def sgd(w, g, lr, tau):
    rate = lr / tau
    for i in prange(w.size):
        w[i] -= rate * g[i]


@njit(**_OPTIONS)
def adagrad(w, g, h, lr, eps):
    for i in prange(w.size):
        gi = g[i]
        hi = h[i] + gi * gi
        h[i] = hi
        w[i] -= lr * gi / (np.sqrt(hi) + eps)
