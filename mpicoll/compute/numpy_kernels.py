"""The reference backend: plain numpy, in the arrays' own precision.

Every other backend is tested against these definitions (and these against
float64 formulas).  Used for numpy arrays when Numba is absent, for float16
on the CPU, and for arrays that are not contiguous.
"""

from __future__ import annotations

import numpy as np

from ..base import ops

_REDUCE = {op.name: op.ufunc for op in ops.OPS if op.kernel}


def reduce(out, a, b, op):
    _REDUCE[op](a, b, out=out)


def scaled_accumulate(x, y, a, b):
    x *= a
    x += b * y


def _compensated(w, g, w_bak, lr, lam):
    """w <- w - lr * (g + lam * g*g*(w - w_bak)), built in one temporary."""
    step = w - w_bak
    step *= g
    step *= g
    step *= lam
    step += g
    step *= lr
    w -= step


def dcasgd(w, g, w_bak, lr, lam, refresh):
    _compensated(w, g, w_bak, lr, lam)
    if refresh:
        w_bak[...] = w


def dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, eps, refresh):
    m *= beta
    m += (1 - beta) * g * g
    dcasgd(w, g, w_bak, lr, lam0 / np.sqrt(m + eps), refresh)


def sgd(w, g, lr, tau):
    w -= (lr / tau) * g


def adagrad(w, g, h, lr, eps):
    h += g * g
    w -= lr * g / (np.sqrt(h) + eps)


def narrow(x, words, dtype):
    words.view(dtype)[...] = x


def narrow_carrying(x, residual, words, dtype):
    carried = x + residual
    narrowed = words.view(dtype)
    narrowed[...] = carried
    np.subtract(carried, narrowed, out=residual)


def widen(words, out, dtype, scale):
    np.multiply(words.view(dtype), scale, out=out, dtype=out.dtype)


def add_narrow(incoming, inout, dtype):
    total = inout.view(dtype)
    np.add(incoming.view(dtype), total, out=total)
