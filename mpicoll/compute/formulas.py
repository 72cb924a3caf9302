"""Per-element formulas shared by the Numba CPU and CUDA backends (compiled by each).

Written once as plain Python so the two JIT targets cannot drift apart; the
CUDA sources in ``kernels/optim.cu`` state the same formulas in C++.
"""


def compensated(w, g, w_bak, lr, lam):
    """DC-ASGD: w - lr * (g + lam * g*g*(w - w_bak))."""
    return w - lr * (g + lam * g * g * (w - w_bak))


def mean_square(m, g, beta, rest):
    """DC-ASGD-a's running mean of g*g: beta*m + (1-beta)*g*g, with rest = 1 - beta."""
    return beta * m + rest * g * g
