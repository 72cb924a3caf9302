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


# -- float16 by its bits (Numba has no float16 on the CPU; numpy's is emulated element by element) ---------------
# A float16 is handled as its 16 bits (uint16): widened by a table of all 65536 values (256 KiB, in cache),
# rounded back to nearest even by integer arithmetic on float32's bits (F. Giesen's float_to_half_fast3_rtne):
# bit for bit what numpy's float16 gives (tests/compute/test_kernels.py), about 3x numpy's speed (mpicoll
# bench-kernels; docs/compression.md).  Compressed allreduces (mpicoll.collectives.compression) use them.

_HALVES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)     # bits -> value


@njit(inline="always", cache=True)
def _single_bits_as_half_bits(bits, value):
    """The float16 bits nearest (ties to even) float32 ``value``, whose bits are ``bits``."""
    sign = (bits >> 16) & 0x8000
    magnitude = bits & 0x7FFFFFFF
    if magnitude >= 0x47800000:                            # 65520 and up, inf, NaN
        return sign | (0x7E00 if magnitude > 0x7F800000 else 0x7C00)
    if magnitude < 0x38800000:                             # below 2^-14: a float16 subnormal (or zero)
        scaled = abs(value) * 16777216.0                   # in units of 2^-24, exact
        whole = np.floor(scaled)
        rest = scaled - whole
        if rest > 0.5 or (rest == 0.5 and int(whole) & 1):
            whole += 1.0
        return sign | int(whole)
    odd = (magnitude >> 13) & 1
    return sign | (((magnitude + 0xC8000FFF + odd) & 0xFFFFFFFF) >> 13)


@njit(cache=True, nogil=True)
def _narrow(x, out):
    bits = x.view(np.uint32)
    for i in range(x.size):
        out[i] = _single_bits_as_half_bits(bits[i], x[i])


@njit(cache=True, nogil=True)
def _to_half_carrying(x, residual, out, table):
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    for i in range(x.size):
        scratch[0] = x[i] + residual[i]
        h = _single_bits_as_half_bits(bits[0], scratch[0])
        out[i] = h
        residual[i] = scratch[0] - table[h]


def narrow(x, out, dtype):
    """out (uint16) <- the float16 bits of float32 ``x`` (``dtype``: float16, the only one these loops take)."""
    _narrow(x, out)


def narrow_carrying(x, residual, out, dtype):
    """Error feedback, fused: carried = x + residual; out <- its float16 bits; residual <- carried - that value
    (float32 throughout)."""
    _to_half_carrying(x, residual, out, _HALVES)


@njit(cache=True, nogil=True)
def _from_half(h, out, scale, table):
    for i in range(h.size):
        out[i] = table[h[i]] * scale


def widen(h, out, dtype, scale):
    """out (float32) <- the value of float16 bits ``h``, times ``scale``."""
    _from_half(h, out, scale, _HALVES)


@njit(cache=True, nogil=True)
def _add_halves(incoming, inout, table):
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    for i in range(inout.size):
        scratch[0] = table[incoming[i]] + table[inout[i]]
        inout[i] = _single_bits_as_half_bits(bits[0], scratch[0])


def add_narrow(incoming, inout, dtype):
    """inout <- incoming + inout, float16 bits both: added in float32 and rounded to float16 (numpy's float16 add)."""
    _add_halves(incoming, inout, _HALVES)
