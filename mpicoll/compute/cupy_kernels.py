"""The kernels for CuPy arrays: ``kernels/*.cu`` compiled once per process with NVRTC.

Launched on CuPy's current stream.  Runtime scalars are kernel arguments in
the compute type (float for float16 and float32 arrays, double for float64),
never part of the source, so each kernel is compiled exactly once.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from . import REDUCE_OPS, sources     # reduce.cu numbers its ops in REDUCE_OPS order

THREADS = 256
_C_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.float64): "double",
            np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
_OPTIMIZERS = ("dcasgd", "dcasgd_adaptive", "sgd", "adagrad", "scaled_accumulate")


@functools.lru_cache(maxsize=None)
def _module(source: str) -> cupy.RawModule:
    if source == "reduce.cu":
        names = [f"reduce<{t}, {op}>" for t in _C_TYPES.values() for op in range(len(REDUCE_OPS))]
        names += ["reduce_complex_prod<float>", "reduce_complex_prod<double>"]
    else:
        names = [f"{k}<{t}>" for k in _OPTIMIZERS for t in ("__half", "float", "double")]
    return cupy.RawModule(code=sources.source(source), name_expressions=names, options=("-std=c++17",))


@functools.lru_cache(maxsize=None)
def _kernel(source: str, name: str):
    """One compiled kernel, looked up once (not on every launch)."""
    return _module(source).get_function(name)


def _launch(kernel, n: int, *args) -> None:
    if n:
        blocks = min(65535, (n + THREADS - 1) // THREADS)
        kernel((blocks,), (THREADS,), (*args, np.int64(n)))


def reduce(out, a, b, op):
    if out.dtype.kind == "c":
        real = np.dtype(np.float32 if out.dtype == np.complex64 else np.float64)
        out_r, a_r, b_r = (x.view(real) for x in (out, a, b))
        if op == "sum":
            _launch(_kernel("reduce.cu", f"reduce<{_C_TYPES[real]}, 0>"), out_r.size, out_r, a_r, b_r)
        else:   # prod (the dispatcher admits nothing else for complex)
            _launch(_kernel("reduce.cu", f"reduce_complex_prod<{_C_TYPES[real]}>"), out.size, out_r, a_r, b_r)
        return
    _launch(_kernel("reduce.cu", f"reduce<{_C_TYPES[out.dtype]}, {REDUCE_OPS.index(op)}>"), out.size, out, a, b)


def _optimizer(name: str, dtype):
    return _kernel("optim.cu", f"{name}<{_C_TYPES[np.dtype(dtype)]}>")


def scaled_accumulate(x, y, a, b):
    _launch(_optimizer("scaled_accumulate", x.dtype), x.size, x, y, a, b)


def dcasgd(w, g, w_bak, lr, lam, refresh):
    _launch(_optimizer("dcasgd", w.dtype), w.size, w, g, w_bak, lr, lam, np.int32(refresh))


def dcasgd_adaptive(w, g, w_bak, m, lr, lam0, beta, eps, refresh):
    _launch(_optimizer("dcasgd_adaptive", w.dtype), w.size, w, g, w_bak, m, lr, lam0, beta, eps, np.int32(refresh))


def sgd(w, g, lr, tau):
    _launch(_optimizer("sgd", w.dtype), w.size, w, g, lr, tau)


def adagrad(w, g, h, lr, eps):
    _launch(_optimizer("adagrad", w.dtype), w.size, w, g, h, lr, eps)
