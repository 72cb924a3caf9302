"""``mpicoll bench-kernels``: every kernel of every backend, against the device's own copy.

Effective bandwidth counts the bytes a kernel must move at least (DC-ASGD reads
g, w and w_bak and writes w: four arrays), divided by the median time.  The
copy bandwidth (read one array, write another) is measured in the same run on
the same device, and each kernel is reported as a fraction of it: 1.0 means the
kernel runs as fast as memory allows.
"""

from __future__ import annotations

import os

import numpy as np

from .. import arrays, compute
from .common import median_seconds, write_records

__all__ = ["run", "ARRAYS_MOVED"]

# arrays each kernel must read or write once (its bytes = arrays * elements * itemsize)
ARRAYS_MOVED = {"copy": 2, "reduce_sum": 3, "scaled_accumulate": 3, "sgd": 3, "adagrad": 5,
                "dcasgd": 4, "dcasgd_refresh": 5, "dcasgd_adaptive": 6,
                # float16 by its bits (compressed allreduces), float32 arrays only: a float32 array and a 16-bit
                # one (round, widen), or three 16-bit ones (add), each 1.5 float32 arrays' bytes
                "float16_round": 1.5, "float16_widen": 1.5, "float16_add": 1.5}


_LIBRARIES = {"numpy": None, "numba": None, "cupy": "cupy", "numba-cuda": "numba-cuda"}   # backend -> its arrays


def _library(backend: str) -> tuple[str | None, str]:
    """(the array library ``backend`` runs on, None for host memory; why it is not measured here, or "")."""
    reason = compute.backends().get(backend, "unknown backend")
    if reason != "available":
        return None, reason
    if backend in ("cupy", "numba-cuda"):
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and backend == "numba-cuda":
            return None, "Numba's CUDA simulator is on: its timings mean nothing"
        count, why = arrays.gpu_count()
        if not count:
            return None, why
    return _LIBRARIES[backend], ""


def _fresh(library: str | None, values: np.ndarray):
    """``values`` copied into a new array of ``library``."""
    array = arrays.empty(library, values.size, values.dtype)
    arrays.copy_into(array, values)
    return array


def _kernels(library: str | None, n: int, dtype, rng) -> dict:
    """name -> zero-argument call, on fresh arrays of the device."""
    def array(positive=False):
        values = rng.uniform(0.5, 1.5, n) if positive else rng.standard_normal(n)
        return _fresh(library, values.astype(dtype))

    w, g, b, m, h, y = array(), array(), array(), array(True), array(True), array()
    halves = {}
    if library is None and np.dtype(dtype) == np.float32:      # host float32 only, as compressions use them
        words, more, widened = np.empty(n, np.uint16), compute.narrow(y, np.empty(n, np.uint16)), np.empty_like(w)
        compute.narrow(w, words)
        halves = {"float16_round": lambda: compute.narrow(g, words),
                  "float16_widen": lambda: compute.widen(words, widened),
                  "float16_add": lambda: compute.add_narrow(more, words)}
    return {
        "reduce_sum": lambda: compute.reduce(w, y),
        "scaled_accumulate": lambda: compute.scaled_accumulate(w, y, 0.5, 0.5),
        "sgd": lambda: compute.sgd(w, g, 1e-3, 2.0),
        "adagrad": lambda: compute.adagrad(w, g, h, 1e-3),
        "dcasgd": lambda: compute.dcasgd(w, g, b, 1e-3, 0.04),
        "dcasgd_refresh": lambda: compute.dcasgd(w, g, b, 1e-3, 0.04, refresh_backup=True),
        "dcasgd_adaptive": lambda: compute.dcasgd_adaptive(w, g, b, m, 1e-3, 2.0),
        **halves,
    }


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-kernels", help="every kernel and backend against the device's copy bandwidth",
        description="Single process: mpicoll bench-kernels --threads 1,2 --output kernels.json")
    bench.add_argument("--elements", type=int, default=16 * 2**20, help="array length (default 16M)")
    bench.add_argument("--dtype", default="float32", help="float16, float32 or float64 (default float32)")
    bench.add_argument("--backends", default="numpy,numba,cupy,numba-cuda",
                       help="comma-separated (default: all; those not available here are skipped with the reason)")
    bench.add_argument("--threads", help="Numba thread counts to run, e.g. 1,2 (default: Numba's own)")
    bench.add_argument("--iters", type=int, default=10, help="timed calls per kernel (default 10)")
    bench.add_argument("--output", metavar="FILE.json", help="write one record per (kernel, backend, threads)")


def run(args) -> int:
    dtype = np.dtype(args.dtype)
    n = args.elements
    rng = np.random.default_rng(7)
    records = []
    threads_list = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    print(f"# mpicoll bench-kernels: {n:,} {dtype.name} elements, median of {args.iters}")
    print(f"{'kernel':>18} {'backend':>10} {'threads':>7} {'ms':>9} {'GB/s':>8} {'x copy':>7}")
    for backend in args.backends.split(","):
        library, reason = _library(backend)
        if reason:
            print(f"# {backend}: skipped ({reason})")
            continue
        # numpy arrays get the backend MPICOLL_KERNELS names, whatever their size
        previous = os.environ.pop("MPICOLL_KERNELS", None)
        if backend in ("numpy", "numba"):
            os.environ["MPICOLL_KERNELS"] = backend
        try:
            for threads in (threads_list if backend == "numba" else [None]):
                if threads is not None:
                    compute.set_threads(threads)
                records += _measure(backend, library, threads, n, dtype, rng, args.iters)
        finally:
            os.environ.pop("MPICOLL_KERNELS", None)
            if previous is not None:
                os.environ["MPICOLL_KERNELS"] = previous
    if args.output:
        write_records(args.output, records)
    return 0


def _measure(backend, library, threads, n, dtype, rng, iters) -> list[dict]:
    source, target = _fresh(library, rng.standard_normal(n).astype(dtype)), arrays.empty(library, n, dtype)
    sync = lambda: arrays.synchronize(library)  # noqa: E731
    rows = [("copy", median_seconds(lambda: arrays.copy(source, target), iters, sync))]
    rows += [(name, median_seconds(call, iters, sync)) for name, call in _kernels(library, n, dtype, rng).items()
             if not (backend == "numba" and name == "reduce_sum")]   # host reductions are numpy's
    copy_gbps = ARRAYS_MOVED["copy"] * n * dtype.itemsize / rows[0][1] / 1e9
    records = []
    for name, seconds in rows:
        gbps = ARRAYS_MOVED[name] * n * dtype.itemsize / seconds / 1e9
        records.append({"kernel": name, "backend": backend, "elements": n, "dtype": dtype.name, "time_s": seconds,
                        "gbps": gbps, "fraction_of_copy": gbps / copy_gbps, "threads": threads})
        shown = "-" if threads is None else str(threads)
        print(f"{name:>18} {backend:>10} {shown:>7} {seconds * 1e3:>9.3f} {gbps:>8.1f} {gbps / copy_gbps:>7.2f}",
              flush=True)
    return records
