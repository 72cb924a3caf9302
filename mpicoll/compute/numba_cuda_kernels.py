"""The kernels for Numba CUDA device arrays (and, in tests, Numba's CUDA simulator).

Same definitions as ``kernels/*.cu``, written with ``numba.cuda.jit``: a
grid-stride loop per kernel, runtime scalars as arguments.
"""

from __future__ import annotations

import math

from numba import cuda

from . import formulas

from numba import config

_compensated = cuda.jit(device=True)(formulas.compensated)
_mean_square = cuda.jit(device=True)(formulas.mean_square)

# The simulator runs every thread as a Python thread: small blocks keep tests quick,
# and the grid-stride loops cover any size with any launch.
THREADS = 8 if config.ENABLE_CUDASIM else 256
MAX_BLOCKS = 4 if config.ENABLE_CUDASIM else 4096


def _launch(kernel, n, *args):
    if n == 0:
        return
    blocks = min(MAX_BLOCKS, (n + THREADS - 1) // THREADS)
    kernel[blocks, THREADS](*args)


@cuda.jit
def _sum(out, a, b):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i]


@cuda.jit
def _prod(out, a, b):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] * b[i]


@cuda.jit
def _min(out, a, b):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        x, y = a[i], b[i]
        out[i] = x + y if (x != x or y != y) else (y if y < x else x)


@cuda.jit
def _max(out, a, b):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        x, y = a[i], b[i]
        out[i] = x + y if (x != x or y != y) else (y if y > x else x)


_REDUCE = {"sum": _sum, "prod": _prod, "min": _min, "max": _max}


def reduce(out, a, b, op):
    _launch(_REDUCE[op], out.size, out, a, b)


@cuda.jit
def _scaled_accumulate(x, y, a, b):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        x[i] = a * x[i] + b * y[i]


def scaled_accumulate(x, y, a, b):
    _launch(_scaled_accumulate, x.size, x, y, a, b)


@cuda.jit
def _dcasgd(w, g, w_bak, lr, lam, refresh):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        updated = _compensated(w[i], g[i], w_bak[i], lr, lam)
        w[i] = updated
        if refresh:
            w_bak[i] = updated


def dcasgd(w, g, w_bak, lr, lam, refresh):
    _launch(_dcasgd, w.size, w, g, w_bak, lr, lam, refresh)


@cuda.jit
def _dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, rest, eps, refresh):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        mi = _mean_square(m[i], g[i], beta, rest)
        updated = _compensated(w[i], g[i], w_bak[i], lr, lam0 / math.sqrt(mi + eps))
        m[i] = mi
        w[i] = updated
        if refresh:
            w_bak[i] = updated


def dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, eps, refresh):
    _launch(_dcasgd_adaptive, w.size, w, g, w_bak, m, lr, lam0, beta, type(beta)(1) - beta, eps, refresh)


@cuda.jit
def _sgd(w, g, rate):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        w[i] -= rate * g[i]


def sgd(w, g, lr, tau):
    _launch(_sgd, w.size, w, g, lr / tau)


@cuda.jit
def _adagrad(w, g, h, lr, eps):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        gi = g[i]
        hi = h[i] + gi * gi
        h[i] = hi
        w[i] -= lr * gi / (math.sqrt(hi) + eps)


def adagrad(w, g, h, lr, eps):
    _launch(_adagrad, w.size, w, g, h, lr, eps)
