"""One kernel layer for every kind of array: reductions and fused optimizer updates.

Each function takes arrays of one kind and runs the backend that fits them:

==============  ==============================================  =====================================
backend         arrays                                          how
==============  ==============================================  =====================================
``numpy``       numpy arrays when Numba is absent, float16 on   numpy ufuncs (the reference
                the CPU, non-contiguous arrays                  definitions)
``numba``       contiguous numpy arrays                         fused ``njit(parallel=True)`` loops:
                                                                one pass over memory
``cupy``        CuPy arrays; any CUDA array                     ``kernels/*.cu`` compiled once by
                (``__cuda_array_interface__``, DLPack) when     CuPy's NVRTC
                CuPy is installed
``numba-cuda``  Numba device arrays; CUDA arrays when CuPy is   ``numba.cuda.jit`` kernels
                absent
==============  ==============================================  =====================================

Host arrays below ``NUMBA_FROM`` elements (64Ki) stay on numpy: one numpy pass
costs less than waking Numba's threads, and a short job skips the JIT.
``MPICOLL_KERNELS=numpy`` or ``=numba`` forces one or the other.  All
updates happen in place; scalars are passed to the kernels in the arrays'
compute precision (float32 for float16 and float32 arrays, float64 for float64).

The updates (Zheng et al. 2017 for DC-ASGD; Dean et al. 2012 for Adagrad in Downpour):

- ``dcasgd``: ``w <- w - lr * (g + lam * g*g*(w - w_bak))``, optionally ``w_bak <- w``
- ``dcasgd_adaptive``: ``m <- beta*m + (1-beta)*g*g``, ``lam = lam0 / sqrt(m + eps)``, then dcasgd
- ``sgd``: ``w <- w - (lr / tau) * g`` (tau: staleness)
- ``adagrad``: ``h <- h + g*g``, ``w <- w - lr * g / (sqrt(h) + eps)``
- ``scaled_accumulate``: ``x <- a*x + b*y`` (push-sum mixing)
- ``reduce``: ``out = a (op) b`` for sum, prod, min, max (NaN propagates through min and max)
- ``streaming_reducer``: ``out = a (op) b`` stored around the caches (non-temporal stores), for
  results not read again soon (:mod:`mpicoll.compute.streaming`; host, Numba, sum and prod)
- ``copy_around_caches``: ``out[...] = source`` the same way, for any contiguous host arrays
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np

from ..base import config, launcher, ops
from ..arrays import kinds     # which memory, and views: the only part of the array layer the kernels need

__all__ = ["reduce", "narrow", "widen", "add_narrow", "scaled_accumulate", "dcasgd", "dcasgd_adaptive", "sgd",
           "adagrad", "warm_up", "backend_for", "backends", "set_threads", "streaming_reducer", "copy_around_caches",
           "REDUCIBLE", "REDUCE_OPS", "FLOATS"]

FLOATS = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64))
REDUCE_OPS = ops.KERNEL_OPS          # sum, prod, min, max (mpicoll.base.ops: the one op table)
REDUCIBLE = FLOATS + tuple(np.dtype(t) for t in (np.int32, np.int64, np.complex64, np.complex128))
_MODULES = {"numpy": "numpy_kernels", "numba": "numba_kernels", "cupy": "cupy_kernels",
            "numba-cuda": "numba_cuda_kernels"}
_loaded: dict[str, object] = {}
_missing: dict[str, str] = {}


def _backend(name: str):
    """The backend module, imported on first use; None (with the reason kept) if it cannot load."""
    if name in _loaded:
        return _loaded[name]
    if name in _missing:
        return None
    try:
        module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    except Exception as error:  # noqa: BLE001 - any import failure means "not available here"
        _missing[name] = f"{type(error).__name__}: {error}"
        return None
    _loaded[name] = module
    if name == "numba":
        _start_numba_threads()
    return module


def _start_numba_threads() -> None:
    """Start Numba's threads now, each rank using its share of the node's cores, and leave torch's count as it was.

    Ranks sharing a node share its cores: each gets its part, not all of them (``NUMBA_NUM_THREADS`` overrides).
    Numba's OpenMP threading layer starts its pool with every core as the OpenMP thread count of the thread that
    starts it; where torch shares that OpenMP runtime (torch's CPU wheel and Numba both load the system's libgomp
    here) torch can then report and use that count: measured, with the count asked once beforehand
    (``torch.get_num_threads()``), 1 thread became 2 in each of 2 ranks on 2 cores, and a torch CNN's training took
    34 s instead of 1.3 s.  The pool starts once a process, here, so this is the one place to put the count back."""
    import numba
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    if "NUMBA_NUM_THREADS" in os.environ:
        numba.get_num_threads()                         # starts the pool
    else:
        set_threads(share_of_cores())                   # starts the pool, then takes this rank's share
    if torch is not None and torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def backends() -> dict[str, str]:
    """Every backend with "available" or the reason it is not (for ``mpicoll info``)."""
    report = {}
    for name in _MODULES:
        report[name] = "available" if _backend(name) is not None else _missing.get(name, "not importable")
    return report


def share_of_cores() -> int:
    """This rank's share of the node's cores: the cores over the ranks the launcher put here."""
    return max(1, config.cores() // launcher.ranks_started_here())


def share_torch_threads(torch) -> None:
    """Give ``torch`` (the module) this rank's share of the node's cores as intra-op threads, unless
    ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set (torch reads those itself; the user chose).

    One rule for ``import mpicoll.torch`` and ``mpicoll train``'s torch models (see
    :mod:`mpicoll.torch.threads` for why torch's own default is wrong under a launcher); the module is passed
    in because this layer never imports torch."""
    if not any(variable in os.environ for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        torch.set_num_threads(share_of_cores())


def limit_blas_threads() -> int | None:
    """Give numpy's BLAS (and OpenMP) this rank's share of the cores, not all of them.

    Ranks on one node each start a BLAS thread per core by default; on a
    shared node they then spin against each other (measured: a 4-rank MLP run
    on 2 cores took 2.8 s instead of 0.3 s).  The BLAS-heavy entry points
    (``mpicoll train``) call this; OPENBLAS_NUM_THREADS / OMP_NUM_THREADS set
    by the user win.  Returns the limit, or None without threadpoolctl.
    """
    if any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    threadpool_limits(limits=share_of_cores())
    return share_of_cores()


def set_threads(count: int) -> None:
    """Threads for the Numba CPU loops.

    By default each rank gets the node's cores divided by the ranks the launcher put
    on the node (``NUMBA_NUM_THREADS`` overrides), so ranks do not fight over cores.
    """
    if _backend("numba") is not None:
        import numba
        numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))


def streaming_reducer(op: str, dtype, *, into_two: bool = False):
    """``f(out, a, b)`` storing ``a (op) b`` in ``out`` around the caches, or None where there is none.

    For results that are not read again soon (see :mod:`mpicoll.compute.streaming`):
    sum and prod on contiguous float32/64 and int32/64 host arrays, with Numba.
    ``out`` may be ``a`` or ``b``.  ``MPICOLL_KERNELS=numpy`` turns it off.  ``into_two``:
    ``f(out, out2, a, b)`` stores the result in both in one pass; ``out`` and ``out2``
    must lie the same distance from 16-byte boundaries.
    """
    streaming = _streaming()
    if streaming is None:
        return None
    loops = streaming.TWICE if into_two else streaming.LOOPS
    return loops.get(op) if np.dtype(dtype) in streaming.DTYPES else None


def copy_around_caches(out: np.ndarray, source: np.ndarray) -> None:
    """``out[...] = source``, stored around the caches where Numba loads (see :mod:`mpicoll.compute.streaming`).

    For copies that are not read again soon.  Contiguous numpy arrays of the same
    shape and type; anything else (device arrays too), or ``MPICOLL_KERNELS=numpy``,
    is a plain copy.
    """
    streaming = _streaming()
    if streaming is not None and type(out) is np.ndarray and type(source) is np.ndarray \
            and out.flags.c_contiguous and source.flags.c_contiguous and out.dtype == source.dtype \
            and out.shape == source.shape:
        streaming.stream_copy(out.reshape(-1).view(np.uint8), source.reshape(-1).view(np.uint8))
    else:
        out[...] = source


def _streaming():
    """:mod:`mpicoll.compute.streaming`, or None where Numba does not load or ``MPICOLL_KERNELS=numpy``."""
    if _forced_kernels() == "numpy" or _backend("numba") is None:
        return None
    from . import streaming                   # Numba loads (above), so this does
    return streaming


NUMBA_FROM = 1 << 16     # elements: below this, a numpy pass beats waking Numba's threads (and its JIT)


def _forced_kernels() -> str:
    """The host kernels ``MPICOLL_KERNELS`` forces: "numpy", "numba", or "" (chosen by size)."""
    return config.kernels()


def _host_backend(operands) -> str:
    """numba for large contiguous float32/64 (and integer) host arrays when Numba loads, numpy otherwise.

    MPICOLL_KERNELS=numpy or =numba forces one (numba still only where it applies).
    """
    choice = _forced_kernels()
    if (choice == "numpy" or any(a.dtype == np.float16 or not a.flags.c_contiguous for a in operands)
            or (choice != "numba" and max(a.size for a in operands) < NUMBA_FROM)
            or _backend("numba") is None):            # last: importing Numba takes a while
        return "numpy"
    return "numba"


def backend_for(array) -> str:
    """The backend that would run for ``array``."""
    name = kinds.library(array)
    if name is None:
        return _host_backend([np.asarray(array)])
    if _backend(name) is None:
        raise RuntimeError(f"{type(array).__name__} arrays need the {name} backend: {_missing.get(name)}")
    return name


def _prepare(dtypes: tuple, operands: dict, names_in_place=()):
    """Check arrays agree (size, dtype, kind); return (backend module, flat arrays, dtype).

    Any non-contiguous host array sends the call to numpy, whose in-place
    updates work on views; the other backends get flat views.
    """
    prepared, libraries = {}, set()
    for name, array in operands.items():
        library = kinds.library(array)
        prepared[name] = np.asarray(array) if library is None else kinds.device_view(array)[1]
        libraries.add(library)
    first_name, first = next(iter(prepared.items()))
    if len(libraries) > 1:
        raise TypeError(f"{first_name} is a {type(first).__name__}, but not every array is: "
                        "pass arrays of one kind (all on the host, or all on one device library)")
    dtype = np.dtype(first.dtype)
    if dtype not in dtypes:
        raise TypeError(f"{first_name} has dtype {dtype}; this kernel takes {', '.join(map(str, dtypes))}")
    library = libraries.pop()
    for name, array in prepared.items():
        if np.dtype(array.dtype) != dtype or array.shape != first.shape:
            raise ValueError(f"{name} has shape {array.shape} and dtype {array.dtype}; expected "
                             f"{first.shape} and {dtype} like {first_name}")
        if name in names_in_place and library is None and not array.flags.writeable:
            raise ValueError(f"{name} is read-only; it is updated in place")
    backend = _host_backend(prepared.values()) if library is None else library
    if _backend(backend) is None:
        raise RuntimeError(f"{type(first).__name__} arrays need the {backend} backend: {_missing.get(backend)}")
    if backend != "numpy":      # flat views; a non-contiguous device array is refused, never copied
        prepared = {name: kinds.flat(array, name) for name, array in prepared.items()}
    return _backend(backend), prepared, dtype


def _scalar(dtype: np.dtype, value: float):
    """A scalar in the compute precision of ``dtype`` arrays."""
    return np.float64(value) if dtype == np.float64 else np.float32(value)


def reduce(a, b, out=None, op: str = "sum"):
    """``out = a (op) b`` elementwise (``out`` defaults to ``a``: ``a`` is reduced in place); returns out.

    Host arrays always take numpy's ufunc: a binary reduction is already one pass
    there, and measured faster than the Numba loop (16M float32: 56 against 48 GB/s
    on one core, docs/kernels.md).
    """
    out = a if out is None else out
    op = op.lower()
    if op not in REDUCE_OPS:
        raise ValueError(f"Unrecognized op: {op!r}; the kernels reduce with sum, prod, min or max")
    backend, arrays, dtype = _prepare(REDUCIBLE, {"out": out, "a": a, "b": b}, ("out",))
    if backend is _loaded.get("numba"):    # the Numba backend has no reductions
        backend = _backend("numpy")
    if dtype.kind == "c" and op in ("min", "max"):
        raise TypeError(f"{op} is not defined for complex numbers")
    backend.reduce(arrays["out"], arrays["a"], arrays["b"], op)
    return out


def _narrow_backend(dtype, *operands):
    """For 16-bit floats of ``dtype`` (float16, or bfloat16 from ml_dtypes) held as their bits (uint16): Numba's
    bit-level float16 loops for contiguous float32 host arrays (numpy's float16 is emulated element by element;
    the figures are in ``numba_kernels``), numpy otherwise; ``MPICOLL_KERNELS`` is obeyed."""
    choice = _forced_kernels()
    if np.dtype(dtype) != np.float16 or choice == "numpy" \
            or any(a.dtype not in (np.float32, np.uint16) or not a.flags.c_contiguous for a in operands) \
            or (choice != "numba" and max(a.size for a in operands) < NUMBA_FROM) or _backend("numba") is None:
        return _backend("numpy")
    return _backend("numba")


def narrow(x, words, dtype=np.float16, residual=None):
    """``words`` (uint16, x's size) <- the bits of float ``x`` as the 16-bit float ``dtype``, rounded to nearest
    even; with ``residual`` (error feedback): of ``x + residual``, and ``residual`` <- what the rounding took off
    (in x's precision)."""
    x, flat = np.ravel(x), np.ravel(words)
    if residual is None:
        _narrow_backend(dtype, x, flat).narrow(x, flat, dtype)
    else:
        residual = np.ravel(residual)
        _narrow_backend(dtype, x, residual, flat).narrow_carrying(x, residual, flat, dtype)
    return words


def widen(words, out, dtype=np.float16, scale: float = 1.0):
    """``out`` (float32 or float64) <- the values of the 16-bit floats ``dtype`` whose bits are ``words``, times
    ``scale``."""
    flat, out_flat = np.ravel(words), np.ravel(out)
    _narrow_backend(dtype, flat, out_flat).widen(flat, out_flat, dtype, _scalar(out_flat.dtype, scale))
    return out


def add_narrow(incoming, inout, dtype=np.float16):
    """``inout += incoming``, both 16-bit floats ``dtype`` as their bits (uint16): added in float32, rounded back."""
    _narrow_backend(dtype, incoming, inout).add_narrow(incoming, inout, dtype)
    return inout


def scaled_accumulate(x, y, a: float, b: float):
    """``x <- a*x + b*y`` in place (push-sum mixing of parameters and weights); returns x."""
    backend, arrays, dtype = _prepare(FLOATS, {"x": x, "y": y}, ("x",))
    backend.scaled_accumulate(arrays["x"], arrays["y"], _scalar(dtype, a), _scalar(dtype, b))
    return x


def dcasgd(w, g, w_bak, lr: float, lam: float, *, refresh_backup: bool = False):
    """The fused DC-ASGD step, in place on ``w`` (and ``w_bak`` if ``refresh_backup``); returns w."""
    backend, arrays, dtype = _prepare(FLOATS, {"w": w, "g": g, "w_bak": w_bak}, ("w", "w_bak"))
    backend.dcasgd(arrays["w"], arrays["g"], arrays["w_bak"], _scalar(dtype, lr), _scalar(dtype, lam),
                   bool(refresh_backup))
    return w


def dcasgd_adaptive(w, g, w_bak, m, lr: float, lam0: float, *, beta: float = 0.95, eps: float = 1e-7,
                    refresh_backup: bool = False):
    """The fused DC-ASGD-a step: updates ``m`` (mean square of g), ``w`` and optionally ``w_bak``; returns w."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    backend, arrays, dtype = _prepare(FLOATS, {"w": w, "g": g, "w_bak": w_bak, "m": m}, ("w", "w_bak", "m"))
    s = lambda v: _scalar(dtype, v)  # noqa: E731
    backend.dcasgd_adaptive(arrays["w"], arrays["g"], arrays["w_bak"], arrays["m"], s(lr), s(lam0), s(beta), s(eps),
                            bool(refresh_backup))
    return w


def sgd(w, g, lr: float, tau: float = 1.0):
    """``w <- w - (lr / tau) * g`` in place (tau: the gradient's staleness, >= 1); returns w."""
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    backend, arrays, dtype = _prepare(FLOATS, {"w": w, "g": g}, ("w",))
    backend.sgd(arrays["w"], arrays["g"], _scalar(dtype, lr), _scalar(dtype, tau))
    return w


def adagrad(w, g, h, lr: float, eps: float = 1e-8):
    """``h <- h + g*g``, ``w <- w - lr * g / (sqrt(h) + eps)`` in place; returns w."""
    backend, arrays, dtype = _prepare(FLOATS, {"w": w, "g": g, "h": h}, ("w", "h"))
    backend.adagrad(arrays["w"], arrays["g"], arrays["h"], _scalar(dtype, lr), _scalar(dtype, eps))
    return w


def warm_up(dtype=np.float32, size: int = NUMBA_FROM) -> None:
    """Load the host backend and each update kernel for ``dtype`` now, not in a timed loop's first step.

    ``size``: the largest array the kernels will see; below ``NUMBA_FROM``
    they run in numpy and Numba is never loaded (measured: a 9-rank job of a
    small MLP on 2 cores started in 2 s instead of 10).

    Importing Numba and loading its cached machine code costs 0.2-0.8 s per
    process (measured: SGP's first training step took 0.75 s on an emulated
    node with half a core, the next ones 20-60 ms).  Training calls this during
    set-up, so every method's clock starts with its kernels ready.
    """
    dtype = np.dtype(dtype)
    if dtype not in FLOATS or size < NUMBA_FROM or _host_backend([np.empty(NUMBA_FROM, dtype)]) == "numpy":
        return
    w, g, w_bak, m = (np.zeros(NUMBA_FROM, dtype) for _ in range(4))
    sgd(w, g, 0.0)
    scaled_accumulate(w, g, 1.0, 0.0)
    dcasgd(w, g, w_bak, 0.0, 0.0)
    dcasgd_adaptive(w, g, w_bak, m, 0.0, 0.0)
    adagrad(w, g, m, 0.0)
